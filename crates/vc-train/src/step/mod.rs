//! One optimizer step's computation (docs/training.md §2, §5): the objective ([`loss`]) over the
//! forward pass cut at the units ([`units`], each unit's computation in [`units::forward`]), the trained set and its masters
//! ([`trainable`], [`params`], [`lora`]), the text table's row-sparse gradient ([`text_grad`]),
//! and how a step computes: the kernels or autograd, and the weights' storage dtype
//! ([`crate::Backend`]). The single-device trainer and a sharded run's ranks both compute with
//! these.

pub(crate) mod backend;
pub mod lora;
pub mod loss;
pub mod params;
pub mod text_grad;
pub mod trainable;
pub mod units;
