//! Which of whisper.cpp's CPU backends runs (docs/architecture.md §9.4).
//!
//! whisper-rs-sys compiles ggml's CPU backend for the portable baseline. A release build
//! (`VOICECLONE_GGML_AVX512=ON`, set by scripts/release/release.sh) links a second copy compiled for
//! AVX-512 with VBMI, VNNI and BF16, its symbols renamed by the build script; the linker sends
//! ggml's one call into a CPU backend, `ggml_backend_cpu_reg`, here, and this returns the second
//! copy's registration where the CPU has every extension it was compiled for. The answer is
//! fixed for the process, so every context and thread uses the same copy.

/// The extensions the AVX-512 copy is compiled for (build.rs `AVX512_VARIANT`, with what
/// `GGML_AVX512` adds: F, CD, VL, DQ, BW), all present on this CPU.
#[cfg(target_arch = "x86_64")]
fn cpu_has_avx512_variant() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512cd")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512dq")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vbmi")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx512bf16")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
        && is_x86_feature_detected!("bmi2")
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_has_avx512_variant() -> bool {
    false
}

/// The CPU backend whisper.cpp runs in this process, for `--version` and prep's log.
pub fn backend() -> &'static str {
    if !cfg!(ggml_avx512_variant) {
        "the portable build (no AVX-512 copy in this binary)"
    } else if cpu_has_avx512_variant() {
        "the AVX-512 copy (AVX-512 F/CD/VL/DQ/BW, VBMI, VNNI, BF16)"
    } else {
        "the portable build (this CPU lacks an extension of the AVX-512 copy)"
    }
}

#[cfg(ggml_avx512_variant)]
mod dispatch {
    use std::ffi::c_void;

    extern "C" {
        /// whisper-rs-sys's portable backend (the name `--wrap` gives the original).
        fn __real_ggml_backend_cpu_reg() -> *mut c_void;
        /// The AVX-512 copy, renamed by the build script.
        fn vc512_ggml_backend_cpu_reg() -> *mut c_void;
    }

    /// What ggml's registry calls instead of `ggml_backend_cpu_reg`.
    #[no_mangle]
    extern "C" fn __wrap_ggml_backend_cpu_reg() -> *mut c_void {
        // The same answer on every call: std caches what CPUID says for the process.
        if super::cpu_has_avx512_variant() {
            // SAFETY: both take no arguments and return ggml's static registration record.
            unsafe { vc512_ggml_backend_cpu_reg() }
        } else {
            // SAFETY: as above.
            unsafe { __real_ggml_backend_cpu_reg() }
        }
    }
}
