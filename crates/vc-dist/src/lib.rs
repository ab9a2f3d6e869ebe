//! Distributed training (docs/distributed.md): ranks are processes, on GPUs and on the CPU alike.
//! `vc-dist`: this crate knows tensors, ranks and processes, not the model:
//!
//! - [`collective`]: the `Collective` trait (all-gather, reduce-scatter, broadcast, host
//!   all-reduce, barrier, abort);
//! - [`tcp`]: the CPU backend (ring collectives over TCP, rendezvous; its control plane in
//!   `tcp::control`, the tensors' bytes on the wire in `tcp::wire`);
//! - `nccl` (feature `nccl`): the GPU backend over `cudarc::nccl`;
//! - [`shard`]: how tensors split into row ranges; [`unit_packing`]: one collective per unit;
//! - [`env`]: whether this process is a rank of a run (ours, torchrun's or Slurm's);
//! - [`launch`]: `--gpus N` / `--cpu-ranks N`: start the rank processes and watch them;
//! - `local` (tests): an in-process world of ranks on threads.

pub mod collective;
pub mod env;
pub mod launch;
pub mod local;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod shard;
pub mod tcp;
pub mod unit_packing;

pub use collective::{Collective, ReduceOp};
pub use env::RankEnv;
