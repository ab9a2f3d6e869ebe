//! Run-time selection of the AVX2 + FMA code paths (x86-64).
//!
//! Kernels are written once as plain loops; [`with_avx2`] compiles a loop a second time inside
//! a function with AVX2 and FMA enabled and picks that version when the CPU has them. Rust never
//! contracts `a·b + c` into a fused multiply-add, so both versions compute the same values
//! (kernels that want FMAs call `mul_add` or the intrinsics explicitly).

/// Whether the CPU has AVX2 and FMA (detected once). Under Miri only the features enabled at
/// compile time count (`-C target-feature=+avx2,+fma`), as Miri cannot run `cpuid`.
#[cfg(target_arch = "x86_64")]
pub fn has_avx2_fma() -> bool {
    #[cfg(miri)]
    {
        cfg!(all(target_feature = "avx2", target_feature = "fma"))
    }
    #[cfg(not(miri))]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
}

/// Runs `f` in a function compiled with AVX2 and FMA enabled when the CPU has them, so that
/// loops inlined into it use 256-bit vectors; otherwise calls `f` directly. Results are the
/// same either way: no fused multiply-adds are introduced (Rust does not contract `a·b + c`).
#[inline(always)]
pub fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2_fma() {
            #[target_feature(enable = "avx2,fma")]
            fn run<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            // SAFETY: the CPU supports the enabled features (checked above).
            return unsafe { run(f) };
        }
    }
    f()
}
