//! Running a computation on the rayon pool's own threads (docs/performance.md §2.4).

/// Runs `f` on a worker thread of the global rayon pool and returns its result; the calling
/// thread waits. On a worker already, `f` simply runs.
///
/// Every parallel loop of the kernels then starts inside the pool: the worker splits it with its
/// peers through its own queue, and with one thread it runs inline. Started from a thread
/// outside the pool, each loop is instead injected into the pool and the caller sleeps until a
/// worker has finished it — a hand-off through the scheduler per loop, and a frame of speech
/// has ~750 of them (it was 40 % of a `q8` frame on one thread).
///
/// `f` must not block on work that needs a pool thread of its own (another thread's parallel
/// loop): with one thread in the pool that would never run.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn runs_on_a_worker_and_returns_the_result() {
        // The test harness's threads are not the pool's.
        assert!(rayon::current_thread_index().is_none());
        let (idx, sum) = on_pool(|| {
            let sum: u64 = (0..1000u64).into_par_iter().sum();
            (rayon::current_thread_index(), sum)
        });
        assert!(idx.is_some(), "the closure ran outside the pool");
        assert_eq!(sum, 999 * 1000 / 2);
        // Nested: already on a worker, it runs in place.
        let nested = on_pool(|| on_pool(rayon::current_thread_index));
        assert!(nested.is_some());
    }
}
