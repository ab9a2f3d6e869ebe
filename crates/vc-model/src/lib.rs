//! The Qwen3-TTS port (described in docs/model.md). Model code knows nothing of the CLI,
//! the workspace or files beyond the model directory it is given.

pub mod adapted_files;
pub mod autograd_ops;
pub mod bf16_matmul;
pub mod code_predictor;
pub mod codec;
pub mod config;
pub mod files;
pub mod infer;
pub mod layers;
pub mod linear;
pub mod mel;
pub mod ops;
pub mod overlay;
pub mod speaker;
pub mod talker;
pub mod text;
pub mod weights;
