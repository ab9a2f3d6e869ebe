//! A team of helper threads that stay awake between the short parallel loops of a frame of
//! speech (docs/performance.md §2.5).
//!
//! A `q8` frame of the 0.6B model is ~750 matrix products of 0.03–0.3 ms, separated by a few
//! microseconds of serial work (norms, RoPE, attention, sampling). Split over the rayon pool,
//! each product found the other worker asleep — rayon parks idle workers after a few rounds
//! of yielding — and waited for the kernel to wake it: one frame spent a fifth of its time in
//! futex wake-ups and the scheduler, and a woken worker often joined a product after the
//! caller had done most of it. The team's helpers instead spin for a while after their last
//! task ([`SPIN`]), yielding the CPU to any other runnable thread on every round, so the next
//! product starts on every core at once; after that they park, so an idle process costs
//! nothing.
//!
//! [`for_each_chunk`] is the only entry: `data` cut into chunks, `f(index, chunk)` called once
//! per chunk, by the caller and the helpers together, each chunk claimed through one atomic
//! counter. One call runs at a time on the team; a call made while the team is busy (another
//! thread's product, or a task calling back in) runs through rayon instead, so callers never
//! wait on each other. Which thread runs a chunk never changes what it computes.

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering::SeqCst};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// How long a helper keeps looking for work after its last task before it parks: longer than
/// the serial gaps inside a frame (microseconds) and between the frames of a batch, short
/// enough that a finished request leaves no core busy.
const SPIN: Duration = Duration::from_micros(if cfg!(miri) { 0 } else { 500 });

/// One call of [`for_each_chunk`], on the caller's stack while any thread can reach it.
struct TeamCall {
    /// The type-erased chunk runner; valid for as long as the job is published.
    run: *const (dyn Fn(usize) + Sync),
    next: AtomicUsize,
    done: AtomicUsize,
    total: usize,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl TeamCall {
    /// Claims and runs chunks until none are left. A panicking chunk still counts as done (its
    /// payload is kept for the caller), so the caller never waits for a chunk that cannot end.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, SeqCst);
            if i >= self.total {
                return;
            }
            // SAFETY: `run` points to the caller's closure, which outlives the job's
            // publication (the caller waits for every helper to leave before returning).
            let run = unsafe { &*self.run };
            if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(i))) {
                self.panic
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(p);
            }
            self.done.fetch_add(1, SeqCst);
        }
    }
}

struct Team {
    helpers: usize,
    /// The published job, or null.
    job: AtomicPtr<TeamCall>,
    /// Helpers that may be touching the published job (entered before checking it).
    inside: AtomicUsize,
    /// Set while a caller owns the team.
    busy: AtomicBool,
    /// Helpers parked on `wake`.
    parked: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

fn team() -> &'static Team {
    static TEAM: OnceLock<&'static Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        // As many threads as the global rayon pool, the caller being one of them (asked from a
        // thread outside every pool: the first call may come from a smaller pool's worker).
        let global = std::thread::spawn(rayon::current_num_threads)
            .join()
            .unwrap_or(1);
        let helpers = global.saturating_sub(1);
        let team: &'static Team = Box::leak(Box::new(Team {
            helpers,
            job: AtomicPtr::new(std::ptr::null_mut()),
            inside: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            parked: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        }));
        for h in 0..helpers {
            let spawned = std::thread::Builder::new()
                .name(format!("voiceclone-team-{h}"))
                .spawn(move || helper(team));
            if spawned.is_err() {
                // Without its helpers the team never takes a call (they run through rayon).
                team.busy.store(true, SeqCst);
            }
        }
        team
    })
}

fn helper(team: &'static Team) {
    let mut last_work = Instant::now();
    loop {
        let p = team.job.load(SeqCst);
        if !p.is_null() {
            // Announce, then check that the job is still published: a caller that has
            // withdrawn it waits for `inside` to drop to zero before its job goes away.
            team.inside.fetch_add(1, SeqCst);
            if team.job.load(SeqCst) == p {
                // SAFETY: `p` is still published and we are counted in `inside`, so the caller
                // has not returned and the job on its stack is alive.
                let job = unsafe { &*p };
                if job.next.load(SeqCst) < job.total {
                    job.work();
                }
            }
            team.inside.fetch_sub(1, SeqCst);
            last_work = Instant::now();
        }
        if last_work.elapsed() < SPIN {
            // Stay awake, but let any other runnable thread on this core go first.
            std::thread::yield_now();
            continue;
        }
        let mut guard = team.lock.lock().unwrap_or_else(|e| e.into_inner());
        team.parked.fetch_add(1, SeqCst);
        while team.job.load(SeqCst).is_null() {
            // The timeout only bounds the cost of a missed notification (there is none by
            // construction: the caller reads `parked` after publishing).
            guard = team
                .wake
                .wait_timeout(guard, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        team.parked.fetch_sub(1, SeqCst);
        drop(guard);
        last_work = Instant::now();
    }
}

/// Calls `f(i, chunk)` for every `chunk`-long piece of `data` (the last one may be shorter),
/// on the team's threads and the caller's, and returns when all are done; a panic in `f` is
/// raised again here.
pub fn for_each_chunk<T: Send>(data: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let chunk = chunk.max(1);
    let total = data.len().div_ceil(chunk);
    let team = team();
    if total <= 1 || team.helpers == 0 || rayon::current_num_threads() <= 1 {
        data.chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
        return;
    }
    if team.busy.swap(true, SeqCst) {
        data.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
        return;
    }
    let len = data.len();
    let base = SharedPtr(data.as_mut_ptr());
    let run = move |i: usize| {
        let start = i * chunk;
        let end = (start + chunk).min(len);
        // SAFETY: `i < total` is handed out exactly once (one atomic counter), so the chunks
        // `start..end` of different calls are disjoint parts of `data`, which the caller
        // borrows mutably until every chunk is done.
        let piece = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), end - start) };
        f(i, piece);
    };
    let run_ref: &(dyn Fn(usize) + Sync) = &run;
    // SAFETY: only the lifetime is erased; the job is withdrawn and every helper has left it
    // before `run` goes out of scope (below), and no helper touches a withdrawn job.
    let run_ptr: *const (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(run_ref) };
    let job = TeamCall {
        run: run_ptr,
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        total,
        panic: Mutex::new(None),
    };
    team.job
        .store(&job as *const TeamCall as *mut TeamCall, SeqCst);
    if team.parked.load(SeqCst) > 0 {
        let _guard = team.lock.lock().unwrap_or_else(|e| e.into_inner());
        team.wake.notify_all();
    }
    job.work();
    wait_until(|| job.done.load(SeqCst) == total);
    team.job.store(std::ptr::null_mut(), SeqCst);
    wait_until(|| team.inside.load(SeqCst) == 0);
    team.busy.store(false, SeqCst);
    if let Some(p) = job.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
        std::panic::resume_unwind(p);
    }
}

/// Spins until `ready()`, yielding the core now and then: what is awaited is a helper's chunk
/// (or its leaving a withdrawn job), microseconds unless the helper was preempted.
fn wait_until(ready: impl Fn() -> bool) {
    let mut rounds = 0u32;
    while !ready() {
        rounds += 1;
        if rounds.is_multiple_of(64) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// A pointer to the caller's data that the chunk runner may carry to other threads.
struct SharedPtr<T>(*mut T);

impl<T> Clone for SharedPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for SharedPtr<T> {}

impl<T> SharedPtr<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

// SAFETY: the pointer is only turned into disjoint chunks, one per claimed index (see
// `for_each_chunk`), of a slice of `T: Send` values that the caller borrows mutably.
unsafe impl<T: Send> Send for SharedPtr<T> {}
// SAFETY: as above: sharing the pointer hands out no overlapping access.
unsafe impl<T: Send> Sync for SharedPtr<T> {}

#[cfg(test)]
mod tests {
    use super::*;

    fn squares(n: usize, chunk: usize) -> Vec<u64> {
        let mut v = vec![0u64; n];
        for_each_chunk(&mut v, chunk, |i, c| {
            for (j, x) in c.iter_mut().enumerate() {
                let k = (i * chunk + j) as u64;
                *x += k * k;
            }
        });
        v
    }

    #[test]
    fn every_chunk_runs_once() {
        for (n, chunk) in [(0, 4), (1, 4), (7, 1), (1000, 3), (4096, 64)] {
            let want: Vec<u64> = (0..n as u64).map(|k| k * k).collect();
            assert_eq!(squares(n, chunk), want, "n {n}, chunk {chunk}");
        }
    }

    #[test]
    fn concurrent_and_nested_calls_all_complete() {
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for r in 0..50 {
                        let n = 100 + 13 * t + r;
                        let want: Vec<u64> = (0..n as u64).map(|k| k * k).collect();
                        assert_eq!(squares(n, 7), want);
                    }
                });
            }
        });
        // A chunk that calls in again (the team is busy: the inner call goes through rayon).
        let mut outer = vec![0u64; 8];
        for_each_chunk(&mut outer, 1, |i, c| {
            c[0] = squares(50, 5).iter().sum::<u64>() + i as u64;
        });
        let s: u64 = (0..50u64).map(|k| k * k).sum();
        assert_eq!(outer, (0..8).map(|i| s + i).collect::<Vec<_>>());
    }

    #[test]
    fn a_panicking_chunk_panics_the_caller_and_the_team_goes_on() {
        let caught = std::panic::catch_unwind(|| {
            let mut v = vec![0u8; 64];
            for_each_chunk(&mut v, 4, |i, _| {
                if i == 9 {
                    panic!("chunk nine");
                }
            });
        });
        let payload = caught.expect_err("the panic reached the caller");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"chunk nine"));
        assert_eq!(squares(300, 8)[17], 289);
    }
}
