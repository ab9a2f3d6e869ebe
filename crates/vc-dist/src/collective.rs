//! The collectives a sharded training step needs (docs/distributed.md §3), over candle tensors.
//! Every rank calls every collective in the same order with equally shaped inputs; an error in
//! one (a peer that failed, was killed or timed out) is an error everywhere, never a hang.

use anyhow::Result;
use candle_core::Tensor;

/// How values of different ranks combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
}

impl ReduceOp {
    pub fn apply(self, a: f64, b: f64) -> f64 {
        match self {
            ReduceOp::Sum => a + b,
            ReduceOp::Max => a.max(b),
        }
    }
}

/// Tensor results are values: they record no autograd graph, whatever their inputs recorded
/// (a gathered unit or row must not keep the graph that produced its shard alive,
/// docs/training.md §6.7).
pub trait Collective: Send + Sync {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;

    /// Every rank's `shard` (all the same shape, contiguous), concatenated along dimension 0 in
    /// rank order.
    fn all_gather(&self, shard: &Tensor) -> Result<Tensor>;

    /// The element-wise sum over ranks of `full` (dimension 0 = world × n), of which this rank
    /// gets rows `[rank·n, (rank+1)·n)`. f32, or bf16 (`train.reduce_dtype`): bf16 values travel,
    /// each partial sum is formed in f32 and rounded to bf16 before it travels on, as NCCL's ring
    /// does.
    fn reduce_scatter(&self, full: &Tensor) -> Result<Tensor>;

    /// `root`'s `t` on every rank (the others pass a tensor of the same shape and dtype).
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;

    /// Host values combined over ranks, in rank order (so every rank gets identical bits):
    /// losses, frame counts, non-finite and stop flags.
    fn all_reduce_host(&self, values: &[f64], op: ReduceOp) -> Result<Vec<f64>>;

    /// Returns when every rank has called it.
    fn barrier(&self) -> Result<()> {
        self.all_reduce_host(&[0.0], ReduceOp::Sum).map(|_| ())
    }

    /// Stops the whole run because of `why` (this rank failed): every rank's collectives fail
    /// from now on with that reason. Idempotent.
    fn abort(&self, why: &str);

    /// Why the run was aborted, if it was (by this or another rank).
    fn aborted(&self) -> Option<String>;

    /// Orderly end of the run: after this no collective may be called.
    fn finish(&self) -> Result<()>;
}
