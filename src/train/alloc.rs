//! Allocator settings: the crate's one memory-reuse policy lives in [`crate::kernels::alloc`]
//! (applied to every command at start-up); re-exported here for the trainer.

pub use crate::kernels::alloc::keep_freed_memory;
