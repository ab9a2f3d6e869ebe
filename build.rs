//! Facts about the build that `voiceclone --version` reports (docs/architecture.md §9.3): the
//! git commit, and the instruction sets whisper.cpp's ggml is compiled for, which `vc-prep`'s
//! build script works out and hands over as `links` metadata. When that script built the AVX-512
//! copy of ggml's CPU backend, the binary's link redirects `ggml_backend_cpu_reg` to it
//! (docs/architecture.md §9.4): a link argument applies only to the package whose script prints
//! it, so this one repeats it.

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
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

    let isa = std::env::var("DEP_VOICECLONE_GGML_CPU_ISA").unwrap_or_else(|_| "unknown".into());
    println!("cargo:rustc-env=VOICECLONE_GGML_ISA={isa}");
    if std::env::var("DEP_VOICECLONE_GGML_CPU_AVX512_VARIANT").as_deref() == Ok("on") {
        println!("cargo:rustc-link-arg=-Wl,--wrap=ggml_backend_cpu_reg");
    }
}
