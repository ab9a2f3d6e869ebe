//! Distributed training (docs/distributed.md): ranks are processes, on GPUs and on the CPU alike.
//! `vc-dist`: this crate knows tensors, ranks and processes, not the model:
//!
//! - [`collective`]: the `Collective` trait (all-gather, reduce-scatter, all-reduce, each also
//!   started and waited for later; broadcast, host all-reduce, barrier, abort, bytes sent);
//! - [`mesh`]: a rank's communicators: the run's, its shard group's and its replicas';
//! - [`topology`]: nodes, shard groups, and the emulated network of benchmarks;
//! - [`tcp`]: the CPU backend (rendezvous, ring collectives over TCP on a communication thread
//!   per ring, the control plane);
//! - `nccl` (feature `nccl`): the GPU backend over `cudarc::nccl`;
//! - [`shard`]: how tensors split into row ranges; [`unit_packing`]: one collective per unit;
//! - [`env`]: whether this process is a rank of a run (ours, torchrun's or Slurm's);
//! - [`launch`]: `--gpus N` / `--cpu-ranks N`: start the rank processes and watch them;
//! - `local` (tests): an in-process world of ranks on threads.

mod collective;
pub mod env;
pub mod launch;
pub mod local;
mod mesh;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod shard;
pub mod tcp;
pub mod topology;
pub mod unit_packing;

pub use collective::{Collective, LinkBytes, Pending, ReduceOp};

pub use mesh::Mesh;
