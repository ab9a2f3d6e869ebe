//! The memory-reuse policy of the crate: **the allocator keeps freed memory for the next
//! allocation; nothing else caches buffers.**
//!
//! Every layer call, training step and codec chunk allocates and frees the same activation-
//! sized buffers again (candle's autograd gradients, kernel outputs: up to ~200 MB each in the
//! codec decoder). glibc serves blocks above its mmap threshold with fresh `mmap`s and unmaps
//! them on free, so each reuse page-faults and zero-fills the memory again (measured: a million
//! minor faults and a third of a CPU training step in the kernel; ~45 000 faults, 0.1 s, for
//! one 184 MB codec buffer — as much as the convolution that fills it). [`keep_freed_memory`]
//! turns that off once per process: blocks of every size come from the heap, and freed memory
//! stays there (up to 1 GiB above the top of the heap before it is trimmed). Kernels then
//! allocate plain `Vec`s ([`super::buf`] writes them without a zero-filling pass), whatever
//! calls them (the codec's convolutions, candle's ops, the trainer), so one mechanism covers
//! inference and training alike.
//!
//! The cost is that a process's resident memory does not shrink below its peak while it runs,
//! which suits these batch commands (the memory is reused by the next chunk or step).

/// Applies the policy (glibc only; elsewhere the platform allocator's defaults stay). Call at
/// the start of the process, before the first large allocation; calling it again is harmless.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu", not(miri)))]
    {
        /// Freed memory above the top of the heap that glibc keeps instead of trimming.
        const TRIM_THRESHOLD: libc::c_int = 1 << 30;
        // SAFETY: mallopt only adjusts allocator parameters; it is safe to call at any time.
        unsafe {
            // No mmap-backed blocks at all: their size would be capped at 32 MiB (glibc's
            // largest mmap threshold), and the codec's activations are larger.
            libc::mallopt(libc::M_MMAP_MAX, 0);
            libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
        }
    }
}
