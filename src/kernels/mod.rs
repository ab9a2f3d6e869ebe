//! CPU kernels of inference on plain slices, and their `unsafe` (docs/performance.md §2): the
//! model code above knows tensors and weights, this module only numbers. Outward every function
//! is safe; each `unsafe` block says why it holds (`// SAFETY:`). Only `std`, `rayon` and `half`
//! are used, so the module's tests can run under Miri on their own.
//!
//! | module | what |
//! |---|---|
//! | [`isa`] | run-time detection of AVX2, AVX-VNNI, AVX-512 (VNNI, BF16) |
//! | [`q8`] | 8-bit block-quantized matrices times activation rows (`vpdpbusd`) |
//! | [`bf16_dot`] | bf16- or f32-stored matrices times activation rows (`vdpbf16ps`, FMA) |
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod bf16_dot;
pub mod isa;
pub mod q8;
