//! Allocator settings for a CPU training process.
//!
//! Every step allocates and frees hundreds of activation-sized buffers (autograd gradients,
//! kernel outputs). glibc serves blocks above its mmap threshold with fresh `mmap`s and returns
//! them on free, so each step page-faults and zero-fills the same memory again (measured: a
//! million minor faults and a third of the CPU time in the kernel on the benchmark model). A
//! fixed 32 MiB threshold (glibc's maximum) and a high trim threshold keep freed blocks in the
//! heap for the next step instead.

/// Applies the settings (glibc only; a no-op elsewhere). Call before the first large allocation.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const MMAP_THRESHOLD: libc::c_int = 32 << 20;
        const TRIM_THRESHOLD: libc::c_int = 1 << 30;
        // SAFETY: mallopt only adjusts allocator parameters; it is safe to call at any time.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
            libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
        }
    }
}
