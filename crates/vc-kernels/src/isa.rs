//! Which x86-64 extensions the inference kernels ([`super::q8`], [`super::bf16_dot`]) may use,
//! detected once at run time (docs/performance.md §2.2).
//!
//! Under Miri only the features enabled at compile time count (Miri cannot run `cpuid`), so the
//! tests there exercise the scalar paths unless `-C target-feature` says otherwise.

use std::sync::OnceLock;

/// The instruction-set extensions the kernels branch on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Isa {
    /// AVX2 + FMA + F16C (256-bit float and integer vectors, f16 conversion).
    pub avx2: bool,
    /// AVX-VNNI: `vpdpbusd` on 256-bit vectors (VEX encoding).
    pub avx_vnni: bool,
    /// AVX-512 F + BW + VL.
    pub avx512: bool,
    /// AVX-512 VNNI: `vpdpbusd` on 512-bit vectors.
    pub avx512_vnni: bool,
}

impl Isa {
    /// Nothing beyond the x86-64 baseline: every kernel's scalar path.
    pub const SCALAR: Isa = Isa {
        avx2: false,
        avx_vnni: false,
        avx512: false,
        avx512_vnni: false,
    };

    /// What this CPU has (detected once).
    pub fn detected() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(detect)
    }

    /// The paths worth testing against the scalar reference on this CPU: the detected set and
    /// every narrower one it implies (AVX2 only, AVX-VNNI without AVX-512, ...).
    pub fn testable() -> Vec<Isa> {
        let d = Isa::detected();
        let mut out = vec![Isa::SCALAR];
        if d.avx2 {
            out.push(Isa {
                avx2: true,
                ..Isa::SCALAR
            });
        }
        if d.avx2 && d.avx_vnni {
            out.push(Isa {
                avx2: true,
                avx_vnni: true,
                ..Isa::SCALAR
            });
        }
        if d.avx2 && d.avx512 {
            out.push(Isa {
                avx2: true,
                avx512: true,
                ..Isa::SCALAR
            });
        }
        if d != *out.last().expect("non-empty") {
            out.push(d);
        }
        out
    }

    /// A short name of the widest integer path ([`super::q8`]).
    pub fn q8_path(self) -> &'static str {
        if self.avx512_vnni {
            "avx512-vnni"
        } else if self.avx_vnni {
            "avx-vnni"
        } else if self.avx2 {
            "avx2"
        } else {
            "scalar"
        }
    }

    /// A short name of the widest bf16 path ([`super::bf16_dot`]).
    pub fn bf16_path(self) -> &'static str {
        if self.avx512 {
            "avx512"
        } else if self.avx2 {
            "avx2"
        } else {
            "scalar"
        }
    }
}

#[cfg(all(target_arch = "x86_64", not(miri)))]
fn detect() -> Isa {
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    let avx512 = avx2
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl");
    Isa {
        avx2,
        avx_vnni: avx2 && is_x86_feature_detected!("avxvnni"),
        avx512,
        avx512_vnni: avx512 && is_x86_feature_detected!("avx512vnni"),
    }
}

#[cfg(any(not(target_arch = "x86_64"), miri))]
fn detect() -> Isa {
    let avx2 = cfg!(all(
        target_feature = "avx2",
        target_feature = "fma",
        target_feature = "f16c"
    ));
    let avx512 = avx2
        && cfg!(all(
            target_feature = "avx512f",
            target_feature = "avx512bw",
            target_feature = "avx512vl"
        ));
    Isa {
        avx2,
        avx_vnni: avx2 && cfg!(target_feature = "avxvnni"),
        avx512,
        avx512_vnni: avx512 && cfg!(target_feature = "avx512vnni"),
    }
}
