//! The memory-reuse policy of the crate: **the allocator keeps freed memory for the next
//! allocation; nothing else caches buffers.**
//!
//! Every layer call, training step and codec chunk allocates and frees the same activation-
//! sized buffers again (candle's autograd gradients, kernel outputs: up to ~200 MB each in the
//! codec decoder). glibc serves blocks above its mmap threshold with fresh `mmap`s and unmaps
//! them on free, so each reuse page-faults and zero-fills the memory again (measured: a million
//! minor faults and a third of a CPU training step in the kernel; ~45 000 faults, 0.1 s, for
//! one 184 MB codec buffer — as much as the convolution that fills it). [`keep_freed_memory`]
//! turns that off once per process: blocks of every size come from one heap shared by every
//! thread, and freed memory stays there (up to 1 GiB above the top of the heap before it is
//! trimmed). Kernels then
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
            // One heap for every thread: a block freed by one thread (a rayon worker's kernel
            // output, dropped on the main thread) serves the next allocation of any other.
            // With glibc's per-thread arenas each kept its own freed memory, and a training
            // step's peak resident memory varied from run to run by up to 2.5 GB above what was
            // allocated (docs/training.md §11); the lock costs nothing next to tensor-sized
            // allocations.
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
}

/// The system allocator, counting the bytes it has handed out: what the memory plan is held to
/// (docs/training.md §6.9). Installed as the global allocator of `test-hooks` builds only; the
/// two relaxed atomic updates per allocation cost nothing measurable next to tensor work.
pub struct Counting;

static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static PEAK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Counting {
    /// Bytes allocated and not yet freed, and the most there ever were.
    pub fn live_and_peak() -> (usize, usize) {
        use std::sync::atomic::Ordering::Relaxed;
        (LIVE.load(Relaxed), PEAK.load(Relaxed))
    }

    fn add(n: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        let now = LIVE.fetch_add(n, Relaxed) + n;
        PEAK.fetch_max(now, Relaxed);
    }

    fn sub(n: usize) {
        LIVE.fetch_sub(n, std::sync::atomic::Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to `System` with the caller's layout unchanged; the counters
// are only arithmetic on the side.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: the caller's contract for this method, passed on to `System` unchanged.
        let p = unsafe { std::alloc::System.alloc(layout) };
        if !p.is_null() {
            Self::add(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: the caller's contract for this method, passed on to `System` unchanged.
        let p = unsafe { std::alloc::System.alloc_zeroed(layout) };
        if !p.is_null() {
            Self::add(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: the caller's contract for this method, passed on to `System` unchanged.
        unsafe { std::alloc::System.dealloc(ptr, layout) };
        Self::sub(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract for this method, passed on to `System` unchanged.
        let p = unsafe { std::alloc::System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            Self::sub(layout.size());
            Self::add(new_size);
        }
        p
    }
}
