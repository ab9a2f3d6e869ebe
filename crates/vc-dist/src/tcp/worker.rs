//! The communication thread of one ring (docs/distributed.md §3.5): it owns the ring's sockets
//! and runs the collectives started on it, one at a time in the order they were started, while
//! the rank computes. Every rank of the ring starts the same collectives in the same order, so
//! the rings' threads meet step for step. A collective that fails (a peer gone, the run aborted)
//! fails its caller's wait; the ones queued behind it fail at their first step, the run being
//! aborted by then. The thread ends when the last handle to it is dropped. A reduce-scatter can
//! hand its result on to another ring's thread (hybrid sharding's all-reduce across groups), in
//! the order of this ring's collectives.

use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, Result};

use super::control::Control;
use super::ring::Ring;
use crate::collective::ReduceOp;

/// A collective for the ring's thread.
pub(super) enum Op {
    AllGather(Vec<u8>),
    ReduceScatter {
        values: Vec<f32>,
        bf16: bool,
    },
    /// A reduce-scatter whose part is then all-reduced on another ring (its thread's queue).
    ReduceScatterThen {
        values: Vec<f32>,
        bf16: bool,
        then: Arc<Worker>,
    },
    AllReduce {
        values: Vec<f32>,
        bf16: bool,
    },
    Broadcast {
        bytes: Vec<u8>,
        root: usize,
    },
    Host {
        values: Vec<f64>,
        op: ReduceOp,
    },
}

/// What a collective gives back.
pub(super) enum Out {
    Bytes(Vec<u8>),
    Values(Vec<f32>),
    Host(Vec<f64>),
    /// The answer of the collective a chained one started on another ring.
    Chained(Reply),
}

struct Job {
    op: Op,
    reply: SyncSender<Result<Out>>,
}

/// A ring's communication thread.
pub(super) struct Worker {
    jobs: Mutex<Sender<Job>>,
    control: Arc<Control>,
    /// This rank, for messages.
    rank: usize,
}

/// The answer to a started collective.
pub(super) struct Reply {
    rx: Receiver<Result<Out>>,
    control: Arc<Control>,
    rank: usize,
}

impl Reply {
    /// Waits for the collective's result.
    pub(super) fn wait(self) -> Result<Out> {
        match self.rx.recv() {
            Ok(r) => r,
            Err(_) => Err(ended(&self.control, self.rank)),
        }
    }
}

fn ended(control: &Control, rank: usize) -> anyhow::Error {
    match control.aborted() {
        Some(why) => anyhow!("the run was aborted: {why}"),
        None => anyhow!("rank {rank}: the communication thread of a ring ended"),
    }
}

impl Worker {
    /// Starts the thread that runs `ring`'s collectives.
    pub(super) fn spawn(ring: Ring, name: &str) -> Result<Arc<Self>> {
        let (tx, rx) = mpsc::channel::<Job>();
        let (control, rank) = (ring.control.clone(), ring.members[ring.pos]);
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                for job in rx {
                    let out = run(&ring, job.op);
                    // A caller that went away (its own error) no longer waits.
                    let _ = job.reply.send(out);
                }
            })?;
        Ok(Arc::new(Self {
            jobs: Mutex::new(tx),
            control,
            rank,
        }))
    }

    /// Queues `op` behind the collectives started before it.
    pub(super) fn start(&self, op: Op) -> Result<Reply> {
        let (reply, rx) = mpsc::sync_channel(1);
        self.jobs
            .lock()
            .expect("ring queue")
            .send(Job { op, reply })
            .map_err(|_| ended(&self.control, self.rank))?;
        Ok(Reply {
            rx,
            control: self.control.clone(),
            rank: self.rank,
        })
    }
}

fn run(ring: &Ring, op: Op) -> Result<Out> {
    Ok(match op {
        Op::AllGather(bytes) => Out::Bytes(ring.all_gather(&bytes, "all-gather", true)?),
        Op::ReduceScatter { values, bf16 } => Out::Values(ring.reduce_scatter(values, bf16)?),
        Op::ReduceScatterThen { values, bf16, then } => {
            let mine = ring.reduce_scatter(values, bf16)?;
            // Queued in the order of this ring's reduce-scatters, the same on every rank.
            Out::Chained(then.start(Op::AllReduce { values: mine, bf16 })?)
        }
        Op::AllReduce { values, bf16 } => Out::Values(ring.all_reduce(values, bf16)?),
        Op::Broadcast { bytes, root } => Out::Bytes(ring.broadcast(bytes, root)?),
        Op::Host { values, op } => Out::Host(ring.host(&values, op)?),
    })
}
