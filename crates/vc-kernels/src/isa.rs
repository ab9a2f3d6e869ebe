//! Which x86-64 extensions the inference kernels ([`super::q8`], [`super::q4`],
//! [`super::bf16_dot`]) may use, detected once at run time (docs/performance.md §2.2), and the
//! cap on them that `VOICECLONE_ISA` sets, so that a narrower path can be measured on a wider CPU
//! ([`IsaCap`], docs/performance.md §2.6).
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

    /// What the kernels may use: what this CPU has, narrowed by `VOICECLONE_ISA` where it is
    /// set (detected once). A value [`IsaCap::from_env`] refuses caps nothing here; the binary
    /// refuses to start with it, and the examples print the path they take.
    pub fn detected() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| match IsaCap::from_env() {
            Ok(Some(cap)) => Isa::hardware().within(cap),
            Ok(None) | Err(_) => Isa::hardware(),
        })
    }

    /// What this CPU has, whatever the cap (detected once).
    pub fn hardware() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(detect)
    }

    /// The extensions of `self` that `cap` allows: never more than `self` has.
    pub fn within(self, cap: IsaCap) -> Isa {
        let allowed = cap.widest();
        Isa {
            avx2: self.avx2 && allowed.avx2,
            avx_vnni: self.avx_vnni && allowed.avx_vnni,
            avx512: self.avx512 && allowed.avx512,
            avx512_vnni: self.avx512_vnni && allowed.avx512_vnni,
        }
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

    /// A short name of the widest 4-bit path ([`super::q4`]): the integer paths of `q8`, with
    /// nibbles unpacked in registers.
    pub fn q4_path(self) -> &'static str {
        self.q8_path()
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

/// The environment variable that caps the kernels' paths (docs/performance.md §2.6).
pub const CAP_VAR: &str = "VOICECLONE_ISA";

/// How far `VOICECLONE_ISA` lets the kernels go: each level allows its extensions and those of
/// the levels before it, and only where the CPU has them ([`Isa::within`]), so a cap narrows
/// and never widens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IsaCap {
    /// Every kernel's scalar path.
    Scalar,
    /// AVX2 + FMA + F16C (the `vpmaddubsw` integer paths).
    Avx2,
    /// AVX2 and AVX-VNNI (256-bit `vpdpbusd`), no AVX-512.
    AvxVnni,
    /// Everything the kernels use, AVX-512 and its VNNI included (no cap).
    Avx512,
}

impl IsaCap {
    /// The values `VOICECLONE_ISA` takes, in the order of the levels.
    pub const NAMES: &'static [&'static str] = &["scalar", "avx2", "avx-vnni", "avx512"];
    const ALL: [IsaCap; 4] = [
        IsaCap::Scalar,
        IsaCap::Avx2,
        IsaCap::AvxVnni,
        IsaCap::Avx512,
    ];

    /// The name `VOICECLONE_ISA` uses.
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// A level by its name.
    pub fn parse(s: &str) -> Result<IsaCap, String> {
        Self::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| {
                format!(
                    "{CAP_VAR}={s:?} is not a level of the kernels' paths; use one of {}",
                    Self::NAMES.join(", ")
                )
            })
    }

    /// The cap `VOICECLONE_ISA` sets: `None` where it is unset or empty, an error message
    /// where it names no level (or is not Unicode).
    pub fn from_env() -> Result<Option<IsaCap>, String> {
        match std::env::var(CAP_VAR) {
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(v)) => Err(format!(
                "{CAP_VAR}={v:?} is not a level of the kernels' paths; use one of {}",
                Self::NAMES.join(", ")
            )),
            Ok(v) if v.is_empty() => Ok(None),
            Ok(v) => Self::parse(&v).map(Some),
        }
    }

    /// The widest set of extensions this level allows.
    fn widest(self) -> Isa {
        let at_least = |level: IsaCap| self as usize >= level as usize;
        Isa {
            avx2: at_least(IsaCap::Avx2),
            avx_vnni: at_least(IsaCap::AvxVnni),
            avx512: at_least(IsaCap::Avx512),
            avx512_vnni: at_least(IsaCap::Avx512),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cap_narrows_and_never_widens() {
        let all = Isa {
            avx2: true,
            avx_vnni: true,
            avx512: true,
            avx512_vnni: true,
        };
        assert_eq!(all.within(IsaCap::Scalar), Isa::SCALAR);
        assert_eq!(all.within(IsaCap::Avx2).q4_path(), "avx2");
        assert_eq!(all.within(IsaCap::AvxVnni).q4_path(), "avx-vnni");
        assert!(!all.within(IsaCap::AvxVnni).avx512);
        assert_eq!(all.within(IsaCap::Avx512), all);
        // An AVX2-only CPU stays AVX2-only under any wider cap.
        let avx2 = Isa {
            avx2: true,
            ..Isa::SCALAR
        };
        for cap in IsaCap::ALL {
            assert!(avx2.within(cap) == avx2 || cap == IsaCap::Scalar, "{cap:?}");
            assert_eq!(Isa::SCALAR.within(cap), Isa::SCALAR);
        }
    }

    #[test]
    fn cap_names_round_trip_and_unknown_ones_are_messages() {
        for (cap, name) in IsaCap::ALL.iter().zip(IsaCap::NAMES) {
            assert_eq!(cap.name(), *name);
            assert_eq!(IsaCap::parse(name), Ok(*cap));
        }
        let err = IsaCap::parse("avx1024").unwrap_err();
        assert!(
            err.contains("VOICECLONE_ISA=\"avx1024\"")
                && err.contains("scalar, avx2, avx-vnni, avx512"),
            "{err}"
        );
    }
}
