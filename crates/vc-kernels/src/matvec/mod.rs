//! Products of a few activation rows with a weight matrix stored row-major in `(N, K)`
//! (PyTorch's layout): `out (M, N) = x (M, K) · wᵀ`, for the memory-bound decode steps of
//! generation, one module per weight format.
//!
//! Each format streams its weight rows once per call, output rows split across threads in
//! fixed tasks, and accumulates in f32.

pub mod bf16;
