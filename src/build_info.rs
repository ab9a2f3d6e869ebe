//! What this binary is, for `voiceclone --version` (docs/architecture.md §9.3): its version and
//! commit, the optional features compiled in, and the CPU code paths it takes on this machine —
//! those our kernels choose at run time (within `VOICECLONE_ISA`'s cap, docs/performance.md §2.6)
//! and those whisper.cpp's ggml was compiled for.

use vc_kernels::isa::{Isa, IsaCap, CAP_VAR};

/// Facts fixed when the binary was built (the binary's build script finds them).
#[derive(Debug, Clone, Copy)]
pub struct Build<'a> {
    /// Short git commit, or "unknown" outside a git checkout.
    pub commit: &'a str,
    /// The x86 extensions ggml was compiled for, or "native (...)".
    pub ggml_isa: &'a str,
}

/// The long `--version` text: one fact per line after the first. `isa` is what the kernels may
/// use, already narrowed by `cap` where one is set.
pub fn describe(build: Build<'_>, isa: Isa, cap: Option<IsaCap>) -> String {
    let yes = |b: bool| if b { "yes" } else { "no" };
    let features: Vec<&str> = [
        (cfg!(feature = "cuda"), "cuda"),
        (cfg!(feature = "nccl"), "nccl"),
    ]
    .into_iter()
    .filter_map(|(on, name)| on.then_some(name))
    .collect();
    let features = if features.is_empty() {
        "none (CPU only)".to_string()
    } else {
        features.join(", ")
    };
    let capped = cap.map_or(String::new(), |c| {
        format!(", capped by {CAP_VAR}={}", c.name())
    });
    format!(
        "{version} (commit {commit})\n\
         features: {features}\n\
         cpu: avx2+fma+f16c {avx2}, avx-vnni {vnni}, avx-512 {avx512}, avx-512-vnni {avx512_vnni} \
         (amx: not used{capped})\n\
         kernels: int8 matmul {q8}, int4 matmul {q4}, bf16 matmul {bf16}\n\
         whisper.cpp (ggml) compiled for: {ggml}\n\
         whisper.cpp runs: {ggml_cpu}",
        version = env!("CARGO_PKG_VERSION"),
        commit = build.commit,
        avx2 = yes(isa.avx2),
        vnni = yes(isa.avx_vnni),
        avx512 = yes(isa.avx512),
        avx512_vnni = yes(isa.avx512_vnni),
        q8 = isa.q8_path(),
        q4 = isa.q4_path(),
        bf16 = isa.bf16_path(),
        ggml = build.ggml_isa,
        ggml_cpu = vc_prep::ggml_cpu::backend(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_paths_the_kernels_take() {
        let build = Build {
            commit: "0123456789ab",
            ggml_isa: "AVX2 FMA",
        };
        let scalar = describe(build, Isa::SCALAR, None);
        assert!(scalar.starts_with(&format!(
            "{} (commit 0123456789ab)\n",
            env!("CARGO_PKG_VERSION")
        )));
        assert!(scalar.contains("avx2+fma+f16c no"), "{scalar}");
        assert!(
            scalar.contains("int8 matmul scalar, int4 matmul scalar, bf16 matmul scalar"),
            "{scalar}"
        );
        assert!(scalar.contains("compiled for: AVX2 FMA\n"), "{scalar}");
        assert!(
            scalar
                .lines()
                .last()
                .unwrap()
                .starts_with("whisper.cpp runs: the "),
            "{scalar}"
        );
        assert!(!scalar.contains("capped"), "{scalar}");
        let all = Isa {
            avx2: true,
            avx_vnni: false,
            avx512: true,
            avx512_vnni: true,
        };
        let wide = describe(build, all, None);
        assert!(wide.contains("avx-512 yes, avx-512-vnni yes"), "{wide}");
        assert!(
            wide.contains("int8 matmul avx512-vnni, int4 matmul avx512-vnni, bf16 matmul avx512"),
            "{wide}"
        );
        // Capped to AVX2, the text names the cap and the narrower paths.
        let capped = describe(build, all.within(IsaCap::Avx2), Some(IsaCap::Avx2));
        assert!(
            capped.contains(
                "avx-512 no, avx-512-vnni no (amx: not used, capped by VOICECLONE_ISA=avx2)"
            ),
            "{capped}"
        );
        assert!(
            capped.contains("int8 matmul avx2, int4 matmul avx2, bf16 matmul avx2"),
            "{capped}"
        );
    }
}
