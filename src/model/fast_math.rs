//! The polynomial `exp` and the AVX2 helpers, moved to [`crate::kernels::math`] and
//! [`crate::kernels::simd`]; re-exported here for the model and training code.

pub use crate::kernels::math::exp;
#[cfg(target_arch = "x86_64")]
pub use crate::kernels::simd::has_avx2_fma;
pub use crate::kernels::simd::with_avx2;
