//! The collectives a sharded training step needs (docs/distributed.md §3), over candle tensors.
//! Every rank of a communicator calls every collective in the same order with equally shaped
//! inputs; an error in one (a peer that failed, was killed or timed out) is an error everywhere,
//! never a hang.
//!
//! The tensor collectives come in two forms: `start_*` returns a [`Pending`] at once while the
//! transfer goes on beside the caller's computation (a communication thread per ring on the
//! CPU, a second CUDA stream on a GPU), and the plain form starts and waits. Started
//! collectives run in the order they were started; the plain ones and the host values queue
//! behind them on the same communicator (docs/distributed.md §3.5).

use std::ops::{Add, Sub};
use std::sync::Arc;

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

/// A collective that was started and not yet waited for. [`Pending::wait`] gives its result, or
/// the error that stopped it: a peer that failed or an aborted run fails every pending
/// collective of every rank, and none waits longer than the run's timeout.
#[must_use = "a started collective is waited for, or the run fails"]
pub struct Pending(PendingState);

enum PendingState {
    Ready(Tensor),
    Later(Box<dyn FnOnce() -> Result<Tensor>>),
}

impl Pending {
    /// A collective that completed when it was started (a world of one, in-process worlds).
    pub fn ready(t: Tensor) -> Self {
        Self(PendingState::Ready(t))
    }

    /// A collective whose result `finish` waits for.
    pub fn later(finish: impl FnOnce() -> Result<Tensor> + 'static) -> Self {
        Self(PendingState::Later(Box::new(finish)))
    }

    /// The collective's result, once every rank's part of it arrived.
    pub fn wait(self) -> Result<Tensor> {
        match self.0 {
            PendingState::Ready(t) => Ok(t),
            PendingState::Later(f) => f(),
        }
    }
}

/// Tensor bytes one rank sent, by where they went (docs/distributed.md §8.1): to a rank on its
/// own node, or to one on another node. Host values (losses, flags) are not counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkBytes {
    pub within_node: u64,
    pub across_nodes: u64,
}

impl Add for LinkBytes {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        Self {
            within_node: self.within_node + o.within_node,
            across_nodes: self.across_nodes + o.across_nodes,
        }
    }
}

impl Sub for LinkBytes {
    type Output = Self;
    fn sub(self, o: Self) -> Self {
        Self {
            within_node: self.within_node - o.within_node,
            across_nodes: self.across_nodes - o.across_nodes,
        }
    }
}

/// One communicator: the ranks of a run, or of a group of them (docs/distributed.md §4.7).
/// `rank` and `world` are this rank's place in the communicator. Tensor results are values:
/// they record no autograd graph, whatever their inputs recorded (a gathered unit or row must
/// not keep the graph that produced its shard alive, docs/training.md §6.7).
pub trait Collective: Send + Sync {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;

    /// Starts gathering every rank's `shard` (all the same shape, contiguous), concatenated
    /// along dimension 0 in rank order.
    fn start_all_gather(&self, shard: &Tensor) -> Result<Pending>;

    /// Starts the element-wise sum over ranks of `full` (dimension 0 = world × n), of which this
    /// rank gets rows `[rank·n, (rank+1)·n)`. f32, or bf16 (`train.reduce_dtype`): bf16 values
    /// travel, each partial sum is formed in f32 and rounded to bf16 before it travels on, as
    /// NCCL's ring does. The sum over a given number of ranks is added in a fixed order.
    fn start_reduce_scatter(&self, full: &Tensor) -> Result<Pending>;

    /// Starts the element-wise sum over ranks of `t` (any shape; f32 or bf16, summed as
    /// [`Self::start_reduce_scatter`] sums), the same bits on every rank.
    fn start_all_reduce(&self, t: &Tensor) -> Result<Pending>;

    /// Starts [`Self::start_reduce_scatter`] of `full` and then the all-reduce of this rank's
    /// part over `across` (hybrid sharding, docs/distributed.md §4.7: the group's sum, then the
    /// sum over the groups), the second starting as soon as the first is done, without the
    /// caller. This default starts the all-reduce when the result is waited for; the backends
    /// chain them where they run (a ring's thread, a stream).
    fn start_reduce_scatter_across(
        &self,
        full: &Tensor,
        across: Arc<dyn Collective>,
    ) -> Result<Pending> {
        if self.world() == 1 {
            return across.start_all_reduce(full);
        }
        let scatter = self.start_reduce_scatter(full)?;
        Ok(Pending::later(move || across.all_reduce(&scatter.wait()?)))
    }

    /// [`Self::start_all_gather`], waited for.
    fn all_gather(&self, shard: &Tensor) -> Result<Tensor> {
        self.start_all_gather(shard)?.wait()
    }

    /// [`Self::start_reduce_scatter`], waited for.
    fn reduce_scatter(&self, full: &Tensor) -> Result<Tensor> {
        self.start_reduce_scatter(full)?.wait()
    }

    /// [`Self::start_all_reduce`], waited for.
    fn all_reduce(&self, t: &Tensor) -> Result<Tensor> {
        self.start_all_reduce(t)?.wait()
    }

    /// `root`'s `t` on every rank (the others pass a tensor of the same shape and dtype).
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;

    /// Host values combined over ranks, in rank order (so every rank gets identical bits):
    /// losses, frame counts, non-finite and stop flags.
    fn all_reduce_host(&self, values: &[f64], op: ReduceOp) -> Result<Vec<f64>>;

    /// Returns when every rank has called it.
    fn barrier(&self) -> Result<()> {
        self.all_reduce_host(&[0.0], ReduceOp::Sum).map(|_| ())
    }

    /// Tensor bytes this rank has sent through this communicator since it was made.
    fn sent(&self) -> LinkBytes;

    /// Stops the whole run because of `why` (this rank failed): every rank's collectives, on
    /// every communicator, fail from now on with that reason. Idempotent.
    fn abort(&self, why: &str);

    /// Why the run was aborted, if it was (by this or another rank).
    fn aborted(&self) -> Option<String>;

    /// Orderly end of the run (on the communicator of every rank; a no-op on a group's): after
    /// this no collective may be called.
    fn finish(&self) -> Result<()>;
}
