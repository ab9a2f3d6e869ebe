//! Facts about the build that `voiceclone --version` reports (docs/architecture.md §9.4): the
//! git commit, and the instruction sets whisper.cpp's ggml is compiled for (the `GGML_*`
//! variables of `.cargo/config.toml`, or the user's, that whisper-rs-sys hands to its CMake).

use std::path::Path;
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
}
