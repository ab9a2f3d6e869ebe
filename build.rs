//! Facts about the build that `voiceclone --version` reports (docs/architecture.md §9.3): the
//! git commit, and the instruction sets whisper.cpp's ggml is compiled for (the `GGML_*`
//! variables of `.cargo/config.toml`, or the user's, that whisper-rs-sys hands to its CMake).
//! On glibc targets it also links the C++ runtime statically (docs/architecture.md §9.4).

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

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
}

fn on(var: &str) -> Option<bool> {
    let v = std::env::var(var).ok()?;
    Some(matches!(
        v.to_ascii_uppercase().as_str(),
        "ON" | "1" | "TRUE" | "YES"
    ))
}

fn main() {
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=VOICECLONE_COMMIT={commit}");
    // Rerun when HEAD moves: HEAD itself, the branch file it names, and packed refs. Only files
    // that exist (a missing one would rerun this script on every build).
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        let dir = Path::new(&dir);
        let mut watch = vec![dir.join("HEAD"), dir.join("packed-refs")];
        if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watch.push(dir.join(r));
        }
        for p in watch.iter().filter(|p| p.exists()) {
            println!("cargo:rerun-if-changed={}", p.display());
        }
    }
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
    println!("cargo:rustc-env=VOICECLONE_GGML_ISA={ggml}");

    static_cxx_runtime();
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
    let dir =
        PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("static-cxx");
    std::fs::create_dir_all(&dir).expect("cannot create the static C++ runtime directory");
    let link = dir.join("libstdc++.a");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&archive, &link).expect("cannot link the static libstdc++");
    println!("cargo:rustc-link-search=native={}", dir.display());
}
