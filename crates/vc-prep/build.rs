//! whisper.cpp's side of the build (docs/architecture.md §9.3, §9.4): the instruction sets its
//! ggml is compiled for (the `GGML_*` variables of `.cargo/config.toml`, or the user's, that
//! whisper-rs-sys hands to its CMake), the optional AVX-512 copy of its CPU backend, and on glibc
//! targets the static C++ runtime. What the binary must know of it reaches the binary's build
//! script as `links` metadata (`DEP_VOICECLONE_GGML_CPU_*`): the ISA line `--version` reports,
//! and whether the final link must redirect `ggml_backend_cpu_reg` (a link argument applies only
//! to the package that prints it).

use std::path::{Path, PathBuf};
use std::process::Command;

/// ggml's x86 instruction-set options, in the order they are reported, with their names.
const GGML_ISA: [(&str, &str); 10] = [
    ("GGML_SSE42", "SSE4.2"),
    ("GGML_AVX", "AVX"),
    ("GGML_AVX2", "AVX2"),
    ("GGML_FMA", "FMA"),
    ("GGML_F16C", "F16C"),
    ("GGML_BMI2", "BMI2"),
    ("GGML_AVX_VNNI", "AVX-VNNI"),
    ("GGML_AVX512", "AVX-512"),
    ("GGML_AVX512_VNNI", "AVX-512-VNNI"),
    ("GGML_AVX512_BF16", "AVX-512-BF16"),
];

fn on(var: &str) -> Option<bool> {
    let v = std::env::var(var).ok()?;
    Some(matches!(
        v.to_ascii_uppercase().as_str(),
        "ON" | "1" | "TRUE" | "YES"
    ))
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");

    // ggml's CMake defaults to -march=native unless GGML_NATIVE is OFF.
    println!("cargo:rerun-if-env-changed=GGML_NATIVE");
    for (var, _) in GGML_ISA {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let ggml = if on("GGML_NATIVE").unwrap_or(true) {
        "native (-march=native of the build machine)".to_string()
    } else {
        let isa: Vec<&str> = GGML_ISA
            .iter()
            .filter(|(var, _)| on(var) == Some(true))
            .map(|(_, name)| *name)
            .collect();
        if isa.is_empty() {
            "x86-64 baseline".to_string()
        } else {
            isa.join(" ")
        }
    };
    println!("cargo:isa={ggml}");

    static_cxx_runtime();
    ggml_avx512_variant();
}

/// The instruction sets of the second CPU backend (ggml's own "zen4" variant): x86-64-v4 with
/// VBMI, VNNI and BF16. `vc_prep::ggml_cpu` checks the same list at run time.
const AVX512_VARIANT: [&str; 5] = [
    "GGML_AVX512",
    "GGML_AVX512_VBMI",
    "GGML_AVX512_VNNI",
    "GGML_AVX512_BF16",
    "GGML_AVX2",
];

fn out_dir() -> PathBuf {
    PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"))
}

/// With `VOICECLONE_GGML_AVX512=ON` (scripts/release/release.sh sets it), compiles ggml's CPU backend a
/// second time, for AVX-512, and links it in beside whisper-rs-sys's portable one
/// (docs/architecture.md §9.4). Every global symbol of the second copy gets the prefix
/// `vc512_`, so the two coexist; the one reference from outside a CPU backend to its inside,
/// ggml's registry calling `ggml_backend_cpu_reg`, is redirected by the linker (`--wrap`) to
/// `vc_prep::ggml_cpu`, which returns one backend or the other for this CPU. Everything else
/// reaches a backend through the function tables that call returns.
fn ggml_avx512_variant() {
    println!("cargo::rustc-check-cfg=cfg(ggml_avx512_variant)");
    println!("cargo:rerun-if-env-changed=VOICECLONE_GGML_AVX512");
    if on("VOICECLONE_GGML_AVX512") != Some(true) {
        return;
    }
    // The copy must be of the whisper.cpp that whisper-rs-sys builds (Cargo.lock names it),
    // with its settings.
    println!("cargo:rerun-if-changed=../../Cargo.lock");
    println!("cargo:rerun-if-env-changed=GGML_LLAMAFILE");
    let src = whisper_cpp_source();
    let out = out_dir().join("ggml-avx512");
    // The whole project, as whisper-rs-sys configures it (the crate's copy of ggml lacks files
    // its own project needs); only the CPU backend's target is built.
    let mut config = cmake::Config::new(&src);
    config
        .out_dir(&out)
        .profile("Release")
        .build_target("ggml-cpu")
        .define("BUILD_SHARED_LIBS", "OFF")
        .define("WHISPER_BUILD_TESTS", "OFF")
        .define("WHISPER_BUILD_EXAMPLES", "OFF")
        .define("GGML_OPENMP", "OFF")
        .define("GGML_NATIVE", "OFF");
    // The portable backend's settings (.cargo/config.toml, or the user's), then the AVX-512
    // ones over them.
    let portable = GGML_ISA.iter().map(|(var, _)| *var);
    for var in std::iter::once("GGML_LLAMAFILE").chain(portable) {
        if let Ok(v) = std::env::var(var) {
            config.define(var, v);
        }
    }
    for var in AVX512_VARIANT {
        config.define(var, "ON");
    }
    config.build();
    let lib = find_file(&out.join("build"), "libggml-cpu.a")
        .unwrap_or_else(|| panic!("no libggml-cpu.a under {}", out.join("build").display()));

    // Every global symbol the archive defines, renamed in its definitions and its own references.
    let nm = Command::new("nm")
        .args(["--defined-only", "-g", "-P"])
        .arg(&lib)
        .output()
        .expect("cannot run nm (binutils) on the AVX-512 ggml backend");
    assert!(nm.status.success(), "nm failed on {}", lib.display());
    let mut names: Vec<String> = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let name = f.next()?;
            // Archive member headers ("lib.a[obj.o]:") are not symbols.
            (f.next().is_some() && !name.ends_with(':')).then(|| name.to_string())
        })
        .collect();
    names.sort();
    names.dedup();
    assert!(
        names.iter().any(|n| n == "ggml_backend_cpu_reg"),
        "the AVX-512 backend defines no ggml_backend_cpu_reg"
    );
    let map = out.join("rename.txt");
    let text: String = names.iter().map(|n| format!("{n} vc512_{n}\n")).collect();
    std::fs::write(&map, text).expect("cannot write the symbol map");
    let dir = out.join("lib");
    std::fs::create_dir_all(&dir).expect("cannot create the AVX-512 backend directory");
    let renamed = dir.join("libvoiceclone_ggml_cpu_avx512.a");
    let status = Command::new("objcopy")
        .arg(format!("--redefine-syms={}", map.display()))
        .arg(&lib)
        .arg(&renamed)
        .status()
        .expect("cannot run objcopy (binutils)");
    assert!(status.success(), "objcopy failed on {}", lib.display());

    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rustc-link-lib=static=voiceclone_ggml_cpu_avx512");
    // For this crate's own tests; the binary's build script repeats it from the metadata.
    println!("cargo:rustc-link-arg=-Wl,--wrap=ggml_backend_cpu_reg");
    println!("cargo:rustc-cfg=ggml_avx512_variant");
    println!("cargo:avx512_variant=on");
}

/// whisper-rs-sys's copy of whisper.cpp: the version Cargo.lock pins, in cargo's registry.
fn whisper_cpp_source() -> PathBuf {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let lock =
        std::fs::read_to_string(manifest.join("../../Cargo.lock")).expect("cannot read Cargo.lock");
    let version = lock
        .split("[[package]]")
        .find(|p| p.contains("name = \"whisper-rs-sys\""))
        .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = ")))
        .map(|v| v.trim_matches('"').to_string())
        .expect("Cargo.lock has no whisper-rs-sys");
    let home = std::env::var("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cargo")
        });
    let registry = home.join("registry/src");
    std::fs::read_dir(&registry)
        .ok()
        .into_iter()
        .flatten()
        .flatten()
        .map(|index| {
            index
                .path()
                .join(format!("whisper-rs-sys-{version}/whisper.cpp"))
        })
        .find(|p| p.join("CMakeLists.txt").is_file())
        .unwrap_or_else(|| {
            panic!(
                "whisper-rs-sys {version}'s whisper.cpp is not under {} (VOICECLONE_GGML_AVX512 \
                 needs the crate's source from the registry)",
                registry.display()
            )
        })
}

fn find_file(dir: &Path, name: &str) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if let Some(found) = find_file(&path, name) {
                return Some(found);
            }
        } else if path.file_name().is_some_and(|n| n == name) {
            return Some(path);
        }
    }
    None
}

/// Makes whisper.cpp's C++ runtime part of the executable on glibc targets, so that a binary
/// needs no libstdc++ of a particular version on the machine it runs on. whisper-rs-sys asks to
/// link `stdc++` by name; the linker takes the first search directory holding `libstdc++.so` or
/// `libstdc++.a`, and ours, searched before the system's, holds only the archive. Elsewhere (the
/// musl release build, whose zig links its own static libc++) nothing changes.
fn static_cxx_runtime() {
    let target = std::env::var("TARGET").unwrap_or_default();
    if !target.ends_with("-linux-gnu") {
        return;
    }
    println!("cargo:rerun-if-env-changed=CXX");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let archive = Command::new(&cxx)
        .arg("-print-file-name=libstdc++.a")
        .output()
        .ok()
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
        // Without the archive the compiler prints the bare name back.
        .filter(|p| p.is_absolute() && p.is_file());
    let Some(archive) = archive else {
        println!(
            "cargo:warning=no static libstdc++ found by `{cxx} -print-file-name=libstdc++.a`: \
             the binary will need the system's libstdc++.so"
        );
        return;
    };
    let dir = out_dir().join("static-cxx");
    std::fs::create_dir_all(&dir).expect("cannot create the static C++ runtime directory");
    let link = dir.join("libstdc++.a");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&archive, &link).expect("cannot link the static libstdc++");
    println!("cargo:rustc-link-search=native={}", dir.display());
}
