//! The row inference path: the talker and code predictor on plain f32 rows (named for the rows,
//! not the device; the candle modules run on a CPU too, docs/performance.md §2.3): the same
//! computation as [`super::layers`] (docs/model.md §4.1, §5.1, §5.2, §12), written as straight
//! loops around the matrix kernels of [`vc_kernels`], with the matrices in the format the
//! precision asks for ([`LinearWeight`](crate::linear::LinearWeight)).
//!
//! Why not candle here: a generated frame is one talker step and fifteen code-predictor steps,
//! each a few dozen small operations per layer around the matrix-vector products. Through candle
//! each is a dispatched op with its own allocation; here they are loops over a few thousand
//! floats, so a frame costs little beyond reading the weights (docs/performance.md §2).
//! Training and the CUDA path keep the candle modules.
//!
//! The parts, each in a module of its own: [`RowDecoderStack`] with its [`Cache`] and the row
//! loops of a step (`decoder_stack`), one step for rows that each own their cache (`row_step`),
//! adapters kept factored beside the base (`adapters`), the dot product and RMS normalisation
//! all of them use (`row_math`), and the two models built on the stack,
//! [`RowCodePredictor`] (`code_predictor`) and [`RowTalker`] (`talker`).

mod adapters;
mod code_predictor;
mod decoder_stack;
mod row_math;
mod row_step;
mod talker;

pub use adapters::AdapterId;
pub use code_predictor::{RowCodePredictor, SubCodePick};
pub use decoder_stack::{Cache, RowDecoderStack};
pub use talker::RowTalker;
