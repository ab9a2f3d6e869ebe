//! The generation thread and its queue (docs/serving.md §3): requests wait in a bounded queue,
//! join the running batch at a frame boundary when there is room, and leave it when they end or
//! their client goes away. One dedicated thread owns the frame loop; it sends each row's frames
//! to the request's decode worker as they are made.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};

use anyhow::{Context, Result};

use vc_core::artifacts::codes::CodeFrame;
use vc_generate::continuous_batch::{Row, StepOutcome, Stepper};
use vc_generate::runaway::GuardStop;
use vc_generate::sampling::RowRng;
use vc_generate::talker_loop::LoopOptions;
use vc_generate::{RowPlan, Synthesizer};
use vc_kernels::pool::on_pool;

/// One speech request as the generation thread runs it: its rows (chunks of the text) one
/// after the other.
pub struct Job {
    pub rows: Vec<RowPlan>,
    pub opts: LoopOptions,
    /// Row `c` draws from `RowRng::new(seed, 0, c)`, as `voiceclone speak` for one text.
    pub seed: u64,
    pub events: mpsc::Sender<GenEvent>,
    /// Set when the client is gone (or the server gives up on the request): the row leaves
    /// the batch at the next frame boundary.
    pub cancel: Arc<AtomicBool>,
}

/// What the generation thread tells a request's decode worker.
#[derive(Debug, Clone)]
pub enum GenEvent {
    /// Row `chunk` starts (a new utterance for the codec; ICL reference codes in front).
    ChunkStart {
        chunk: usize,
        ref_codes: Option<Vec<CodeFrame>>,
    },
    Frame(CodeFrame),
    /// The row ended: at EOS (`Some(step)`), at the frame limit, or stopped by a runaway guard
    /// (`stopped`, docs/model.md §7.2).
    ChunkEnd {
        eos_step: Option<usize>,
        stopped: Option<GuardStop>,
    },
    /// Every row is done.
    Done {
        frames: usize,
    },
    /// The request failed; the message says why.
    Failed(String),
    /// The shutdown ended the request before it was done: its stream ends cleanly, shorter.
    Ended(String),
}

/// Why a request was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    QueueFull,
    ShuttingDown,
}

struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
}

struct SchedulerState {
    queue: Mutex<Queue>,
    wake: Condvar,
    running: AtomicUsize,
    /// Set by [`Scheduler::end_all`]: every running and waiting request is ended.
    end_all: AtomicBool,
    alive: AtomicBool,
}

/// Handle of the generation thread.
pub struct Scheduler {
    shared: Arc<SchedulerState>,
    max_queue: usize,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Scheduler {
    /// Starts the generation thread over `synth`'s row inference path.
    pub fn start(synth: Arc<Synthesizer>, max_batch: usize, max_queue: usize) -> Result<Self> {
        anyhow::ensure!(
            synth.row_talker().is_some(),
            "voiceclone serve runs the talker on the row inference path (precision f32, \
             bf16-weights, q8 or q4); {} is not one of them",
            synth.precision()
        );
        let shared = Arc::new(SchedulerState {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                closed: false,
            }),
            wake: Condvar::new(),
            running: AtomicUsize::new(0),
            end_all: AtomicBool::new(false),
            alive: AtomicBool::new(true),
        });
        let s = shared.clone();
        let delay = vc_generate::streaming::test_frame_delay();
        let thread = std::thread::Builder::new()
            .name("voiceclone-generate".into())
            .spawn(move || {
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    generation_loop(&synth, &s, max_batch.max(1), delay)
                }));
                s.alive.store(false, Ordering::SeqCst);
                // Nothing waits any more: every queued request ends.
                let mut q = s.queue.lock().unwrap_or_else(|e| e.into_inner());
                q.closed = true;
                let why = match &result {
                    Ok(()) => "the server is shutting down".to_string(),
                    Err(_) => "the generation thread failed (see the server log)".to_string(),
                };
                for job in q.jobs.drain(..) {
                    let _ = job.events.send(GenEvent::Failed(why.clone()));
                }
                if result.is_err() {
                    tracing::error!("the generation thread panicked");
                }
            })
            .context("cannot start the generation thread")?;
        Ok(Scheduler {
            shared,
            max_queue,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Queues a request, or says why not (the queue holds at most `max_queue` waiting
    /// requests besides the running batch).
    pub fn submit(&self, job: Job) -> std::result::Result<(), Refused> {
        let mut q = self.shared.queue.lock().unwrap_or_else(|e| e.into_inner());
        if q.closed || !self.shared.alive.load(Ordering::SeqCst) {
            return Err(Refused::ShuttingDown);
        }
        // Requests whose client already went away give their place up.
        q.jobs.retain(|j| !j.cancel.load(Ordering::SeqCst));
        if q.jobs.len() >= self.max_queue {
            return Err(Refused::QueueFull);
        }
        q.jobs.push_back(job);
        drop(q);
        self.shared.wake.notify_all();
        Ok(())
    }

    /// (rows running, requests waiting).
    pub fn load(&self) -> (usize, usize) {
        let waiting = self
            .shared
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .jobs
            .len();
        (self.shared.running.load(Ordering::SeqCst), waiting)
    }

    /// Takes no new requests; the thread stops once the running and queued ones are done.
    pub fn close(&self) {
        self.shared
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .closed = true;
        self.shared.wake.notify_all();
    }

    /// Ends every running and waiting request now (their streams end cleanly).
    pub fn end_all(&self) {
        self.shared.end_all.store(true, Ordering::SeqCst);
        self.close();
    }

    /// Waits for the generation thread (after [`Self::close`]).
    pub fn join(&self) {
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// A request in the running batch: its current row and what is left of it.
struct Active {
    job: Job,
    chunk: usize,
    row: Row,
    frames: usize,
}

fn start_chunk(synth: &Synthesizer, job: &Job, chunk: usize) -> Result<Row> {
    let talker = synth.row_talker().expect("checked in Scheduler::start");
    let plan = &job.rows[chunk];
    let _ = job.events.send(GenEvent::ChunkStart {
        chunk,
        ref_codes: plan.ref_codes.clone(),
    });
    // The prefill, on a pool worker (docs/performance.md §2.4).
    on_pool(|| {
        Row::start(
            talker,
            &plan.prompt,
            synth.pad_embed(),
            job.opts.clone(),
            plan.guard.clone(),
            RowRng::new(job.seed, 0, chunk as u64),
            plan.adapter,
        )
    })
}

fn generation_loop(
    synth: &Synthesizer,
    shared: &SchedulerState,
    max_batch: usize,
    delay: Option<std::time::Duration>,
) {
    let talker = synth.row_talker().expect("checked in Scheduler::start");
    let mut stepper = Stepper::new(talker);
    let mut active: Vec<Active> = Vec::new();
    loop {
        // Admit waiting requests at this frame boundary.
        let mut admitted = Vec::new();
        {
            let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            while active.is_empty() && q.jobs.is_empty() && !q.closed {
                q = shared.wake.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            if shared.end_all.load(Ordering::SeqCst) {
                for job in q.jobs.drain(..) {
                    let _ = job.events.send(GenEvent::Ended(
                        "the server shut down before this request started".into(),
                    ));
                }
            }
            if active.is_empty() && q.jobs.is_empty() && q.closed {
                break;
            }
            while active.len() + admitted.len() < max_batch {
                match q.jobs.pop_front() {
                    Some(job) => admitted.push(job),
                    None => break,
                }
            }
        }
        for job in admitted {
            if job.cancel.load(Ordering::SeqCst) {
                continue;
            }
            match start_chunk(synth, &job, 0) {
                Ok(row) => active.push(Active {
                    job,
                    chunk: 0,
                    row,
                    frames: 0,
                }),
                Err(e) => {
                    let _ = job.events.send(GenEvent::Failed(format!("{e:#}")));
                }
            }
        }
        if shared.end_all.load(Ordering::SeqCst) {
            for a in active.drain(..) {
                let _ = a.job.events.send(GenEvent::Ended(
                    "the server is shutting down; the stream ends here".into(),
                ));
            }
        }
        // Rows whose client went away leave before the step.
        active.retain(|a| !a.job.cancel.load(Ordering::SeqCst));
        shared.running.store(active.len(), Ordering::SeqCst);
        if active.is_empty() {
            continue;
        }
        let outcomes = {
            let mut rows: Vec<&mut Row> = active.iter_mut().map(|a| &mut a.row).collect();
            // On a pool worker, so that the step's parallel loops start inside the pool
            // (docs/performance.md §2.4).
            on_pool(|| stepper.step(talker, &mut rows))
        };
        let outcomes = match outcomes {
            Ok(o) => o,
            Err(e) => {
                let msg = format!("generation failed: {e:#}");
                tracing::error!("{msg}");
                for a in active.drain(..) {
                    let _ = a.job.events.send(GenEvent::Failed(msg.clone()));
                }
                continue;
            }
        };
        let mut keep = Vec::with_capacity(active.len());
        for (mut a, outcome) in active.drain(..).zip(outcomes) {
            let (frame, ended, stopped) = match outcome {
                StepOutcome::Frame(f) => (Some(f), None, None),
                StepOutcome::Last(f) => (Some(f), Some(None), None),
                StepOutcome::Stopped(f, why) => {
                    let stop =
                        GuardStop::new(a.chunk, &a.job.rows[a.chunk].text, a.row.frames(), why);
                    // The server log names the request by its seed (`x-voiceclone-seed`).
                    tracing::warn!("request with seed {}: {}", a.job.seed, stop.describe());
                    (Some(f), Some(None), Some(stop))
                }
                StepOutcome::Eos(step) => (None, Some(Some(step)), None),
            };
            let mut gone = false;
            if let Some(f) = frame {
                a.frames += 1;
                gone |= a.job.events.send(GenEvent::Frame(f)).is_err();
            }
            if let Some(eos_step) = ended {
                gone |= a
                    .job
                    .events
                    .send(GenEvent::ChunkEnd { eos_step, stopped })
                    .is_err();
                if !gone && a.chunk + 1 < a.job.rows.len() {
                    a.chunk += 1;
                    match start_chunk(synth, &a.job, a.chunk) {
                        Ok(row) => a.row = row,
                        Err(e) => {
                            let _ = a.job.events.send(GenEvent::Failed(format!("{e:#}")));
                            continue;
                        }
                    }
                } else {
                    let _ = a.job.events.send(GenEvent::Done { frames: a.frames });
                    continue;
                }
            }
            if gone {
                a.job.cancel.store(true, Ordering::SeqCst);
                continue;
            }
            keep.push(a);
        }
        active = keep;
        shared.running.store(active.len(), Ordering::SeqCst);
        if let Some(d) = delay {
            std::thread::sleep(d);
        }
    }
    shared.running.store(0, Ordering::SeqCst);
}
