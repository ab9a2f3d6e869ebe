//! `vc-kernels`: every CPU kernel of voiceclone, on slices — the model crates above know tensors
//! and weights, this crate only numbers — and nearly all of the workspace's `unsafe`.
//!
//! | module | what |
//! |---|---|
//! | [`mat`] | bounds-checked matrix views with a lifetime (`MatRef`, `MatMut`) |
//! | [`gemm`] | the one GEMM wrapper over them (the `gemm` crate), serial or on the rayon pool |
//! | [`few_rows`] | its products of a few rows, the weights read once (same bits as the crate's) |
//! | [`gemm_call`] | what a product asks for (threads, overwrite or add, the sums' blocks), for both |
//! | [`buf`] | new output buffers written once, without a zero-filling pass, in parallel tiles |
//! | [`simd`] | run-time choice of the AVX2 + FMA build of a loop |
//! | [`math`] | the polynomial `exp` family every vectorised loop uses |
//! | [`libm`] | f32 `exp`, `sin`, `cos`, `powf` that are the same on glibc and musl |
//! | [`act`] | the codec's activations (ELU, SnakeBeta, GELU, SwiGLU gating, masked softmax) |
//! | [`conv`], [`winograd`] | the codec's causal convolutions in row tiles |
//! | [`conv_transpose`], [`depthwise_conv`], [`rows_linear`] | its transposed and depthwise convolutions and channels-last linear layers, on those tiles |
//! | [`residual_unit`] | the codec's residual unit, fused tile by tile |
//! | [`isa`] | run-time detection of AVX2, AVX-VNNI, AVX-512 (VNNI, BF16), capped by `VOICECLONE_ISA` |
//! | [`q8`] | 8-bit block-quantized matrices times activation rows (`vpdpbusd`), inference (`q8::rows`: the activation rows' quantization; `q8::x86`: the x86-64 kernels) |
//! | [`q4`] | 4-bit block-quantized matrices times the same activation rows, inference (`q4::x86`: its x86-64 kernels) |
//! | [`bf16_dot`] | bf16- or f32-stored matrices times activation rows (widening + FMA), inference |
//! | [`matvec`] | `x · wᵀ` for a few f32 rows against bf16 candle weights (the tensor path) |
//! | [`grad`] | inner loops of the training kernels with hand-written backward passes |
//! | [`optim`], [`loss`] | AdamW's element-wise updates, the fused cross-entropy |
//! | [`moment8`] | 8-bit block codes of AdamW's moments (training) |
//! | [`alloc`] | the memory-reuse policy |
//! | [`pool`] | running a whole computation on a worker of the rayon pool |
//! | [`team`] | helper threads that stay awake between the short loops of a frame |
//! | [`test_values`] | deterministic test inputs this crate's tests and those above share |
//!
//! Rules the crate keeps:
//! - **Safety.** Outward every function is safe. `unsafe` appears only where the hardware or a
//!   dependency needs it: the `gemm` crate's pointer interface (behind [`gemm::gemm`], whose
//!   views guarantee the extents), the AVX2 paths' unaligned loads and their run-time feature
//!   check, committing buffers that [`buf`] has verified are fully written, and `mallopt`.
//!   Every block says why it holds (`// SAFETY:`, enforced by `clippy::undocumented_unsafe_blocks`).
//!   `scripts/ci/miri.sh` runs this module's tests under Miri, scalar and AVX2 builds.
//! - **Parallelism.** Outputs are split into disjoint chunks that each task owns, with
//!   per-worker scratch where needed; no threads are spawned per call. It goes through rayon
//!   (`par_chunks_mut`, [`buf::par_new_vec`]; nested calls simply nest), with one exception:
//!   the `q8` and `q4` products and the attention heads, the loops of a frame of speech, run on
//!   [`team`], whose helpers stay awake between loops instead of parking as rayon's workers do
//!   (its one shared pointer is the chunked output, each chunk claimed once). Callers with many
//!   small parallel loops in a row (a frame of speech) run them from inside the pool
//!   ([`pool::on_pool`]), so that each rayon loop is not handed over from an outside thread.
//! - **Determinism.** Every reduction runs in a fixed order (per-block partials summed in block
//!   order), so results do not depend on the thread count: exact training resume relies on it.
//! - **Memory.** Kernels allocate plain `Vec`s for their outputs and keep nothing between
//!   calls; reuse of freed memory is the allocator's job, configured once per process
//!   ([`alloc`]).
//! - **Self-contained.** No dependency beyond `gemm`, `rayon`, `half`, `anyhow` and `libc`:
//!   its tests build without candle or whisper.cpp, and `scripts/ci/miri.sh` runs them under Miri
//!   (which cannot build either).

pub mod act;
pub mod alloc;
pub mod bf16_dot;
pub mod buf;
pub mod conv;
pub mod conv_transpose;
pub mod depthwise_conv;
pub mod few_rows;
pub mod gemm;
pub mod gemm_call;
pub mod grad;
pub mod isa;
pub mod libm;
pub mod loss;
pub mod mat;
pub mod math;
pub mod matvec;
pub mod moment8;
pub mod optim;
pub mod pool;
pub mod q4;
pub mod q8;
pub mod residual_unit;
pub mod rows_linear;
pub mod simd;
pub mod team;
pub mod test_values;
pub mod winograd;
