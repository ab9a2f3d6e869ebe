//! The CPU collective backend (docs/distributed.md §3), like PyTorch's gloo: the rank processes
//! form rings of TCP connections (each rank sends to the next member and receives from the
//! previous one) — one of every rank, and under hybrid sharding one per shard group and one per
//! set of replicas (docs/distributed.md §4.7) — and rank 0 keeps one more connection to every rank as the control
//! plane, which carries the rendezvous and aborts.
//!
//! Each ring has a communication thread of its own (`worker`), which runs the collectives started
//! on it in order while the rank computes: a [`TcpCollective`] is a handle on one ring's thread.
//!
//! Failure: a rank that fails calls [`Collective::abort`]; the message goes to rank 0, which
//! passes it to every rank. A rank whose control connection closes without saying goodbye (it
//! was killed) is reported the same way by rank 0. An aborted rank shuts every ring socket down,
//! so a collective blocked on them fails at once with the reason, and the ones queued behind it
//! fail too. Every socket operation also has a timeout: nothing waits forever.
//!
//! Heartbeats: every rank and rank 0 send each other a heartbeat every second on the control
//! plane, from a thread of their own. A rank that is alive but silent — stopped (SIGSTOP), or
//! its machine gone without closing the connection — is noticed when nothing has come from it
//! for half the timeout, and the run is aborted naming it, even while the others are busy computing
//! or blocked inside a GPU collective, where no socket timeout applies.
//!
//! Here: the communicators and their collectives. The rendezvous and the rings' connections are
//! in `rendezvous`, a ring's algorithms in `ring`, its thread in `worker`, the control plane in
//! `control`, the conversions between tensors and the bytes the rings carry in `wire`.

use std::net::TcpListener;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

use super::collective::{Collective, LinkBytes, Pending, ReduceOp};
use super::topology::{Emulation, Groups, Nodes};

mod control;
mod rendezvous;
mod ring;
mod wire;
mod worker;

use control::{Control, BYE};
use rendezvous::RingKind;
use ring::Counters;
use wire::{from_bytes, to_bytes};
use worker::{Op, Out, Worker};

/// Where a rank finds the others.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub rank: usize,
    pub world: usize,
    /// Rank 0's rendezvous address, `host:port`.
    pub master: String,
    /// For the rendezvous and for every later socket operation.
    pub timeout: Duration,
    /// Rank 0's rendezvous socket when it was bound before this rank started (by our launcher,
    /// so that no other process can take the port in between); `None`: rank 0 binds `master`.
    pub listener: Option<Arc<TcpListener>>,
    /// Which node each rank is on: what a rank sends is counted by it (docs/distributed.md §8).
    pub nodes: Nodes,
    /// The network emulated between nodes (benchmarks and tests, docs/distributed.md §8.3).
    pub emulation: Option<Emulation>,
}

impl Endpoint {
    /// Rank `rank` of `world` meeting at `master`, every rank on one node, no emulation.
    pub fn new(rank: usize, world: usize, master: String, timeout: Duration) -> Self {
        Self {
            rank,
            world,
            master,
            timeout,
            listener: None,
            nodes: Nodes::single(world),
            emulation: None,
        }
    }
}

/// One communicator of a rank: the whole run's, or a group's (docs/distributed.md §4.7).
pub struct TcpCollective {
    /// This rank's place in the communicator.
    rank: usize,
    world: usize,
    /// The ring's communication thread; `None` in a communicator of one rank.
    worker: Option<Arc<Worker>>,
    /// A shard group's: the thread of this rank's replicas' ring, which its reduce-scatters
    /// hand their results to for the all-reduce across groups.
    across: Option<Arc<Worker>>,
    counters: Arc<Counters>,
    control: Arc<Control>,
    timeout: Duration,
    /// The rendezvous payload from rank 0.
    payload: Vec<u8>,
    /// The communicator of every rank, which ends the run (finishing, or aborting when it is
    /// dropped before).
    whole: bool,
}

/// A rank's communicators under hybrid sharding (docs/distributed.md §4.7).
pub struct TcpMesh {
    /// Every rank of the run.
    pub world: TcpCollective,
    /// This rank's shard group; `None` when the group is the whole world.
    pub shard: Option<TcpCollective>,
    /// The ranks holding the same shard in the other groups; `None` with one group.
    pub replicas: Option<TcpCollective>,
}

impl TcpCollective {
    /// Joins the run at `ep` as one group of every rank (see the module docs). Rank 0 passes
    /// `payload` to every rank.
    pub fn connect(ep: &Endpoint, payload: Vec<u8>) -> Result<Self> {
        Ok(Self::connect_mesh(ep, payload, Groups::flat(ep.world))?.world)
    }

    /// Joins the run at `ep` with shard groups `groups`: the world's communicator and this
    /// rank's group's and replicas' ones.
    pub fn connect_mesh(ep: &Endpoint, payload: Vec<u8>, groups: Groups) -> Result<TcpMesh> {
        let joined = rendezvous::join(ep, payload, &groups)?;
        let control = joined.control;
        let handle = |rank: usize, world: usize, ring: Option<(Arc<Worker>, Arc<Counters>)>| {
            let (worker, counters) = match ring {
                Some((w, c)) => (Some(w), c),
                None => (None, Arc::new(Counters::default())),
            };
            TcpCollective {
                rank,
                world,
                worker,
                across: None,
                counters,
                control: control.clone(),
                timeout: ep.timeout,
                payload: Vec::new(),
                whole: false,
            }
        };
        let (mut world_ring, mut shard_ring, mut replica_ring) = (None, None, None);
        for (kind, ring) in joined.rings {
            let counters = ring.counters.clone();
            let (slot, name) = match kind {
                RingKind::World => (&mut world_ring, "ring-world"),
                RingKind::Shard => (&mut shard_ring, "ring-shard"),
                RingKind::Replicas => (&mut replica_ring, "ring-replicas"),
            };
            *slot = Some((Worker::spawn(ring, name)?, counters));
        }
        let (rank, n) = (ep.rank, ep.world);
        let mut world = handle(rank, n, world_ring.clone());
        world.whole = true;
        world.payload = joined.payload;
        let (shard, replicas) = if groups.size == n {
            (None, None)
        } else if groups.size == 1 {
            // Groups of one rank shard nothing; every other rank holds a replica.
            (Some(handle(0, 1, None)), Some(handle(rank, n, world_ring)))
        } else {
            let mut shard = handle(groups.index(rank), groups.size, shard_ring);
            shard.across = replica_ring.as_ref().map(|(w, _)| w.clone());
            (
                Some(shard),
                Some(handle(groups.group(rank), groups.count(), replica_ring)),
            )
        };
        // One listener thread per control connection.
        for (peer, link) in control.links.iter().enumerate() {
            if let Some(link) = link {
                link.set_write_timeout(Some(ep.timeout))?;
                let peer = if ep.rank == 0 { peer } else { 0 };
                let reader = link.try_clone()?;
                let c = control.clone();
                std::thread::Builder::new()
                    .name(format!("control-{peer}"))
                    .spawn(move || c.listen(reader, peer))?;
            }
        }
        if ep.world > 1 {
            let c = control.clone();
            std::thread::Builder::new()
                .name("heartbeat".into())
                .spawn(move || c.heartbeat())?;
        }
        Ok(TcpMesh {
            world,
            shard,
            replicas,
        })
    }

    /// Runs `f` once when the run is aborted, by this rank or another (from whichever thread
    /// learns of it first), e.g. to abort a GPU communicator that a blocked rank waits in.
    pub fn on_abort(&self, f: impl Fn() + Send + Sync + 'static) {
        self.control
            .on_abort
            .lock()
            .expect("control state")
            .push(Box::new(f));
        if self.control.aborted().is_some() {
            if let Some(f) = self.control.on_abort.lock().expect("control state").last() {
                f();
            }
        }
    }

    /// The payload rank 0 passed to [`Self::connect`].
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// Queues `op` on the ring's thread.
    fn start(&self, op: Op) -> Result<worker::Reply> {
        let worker = self
            .worker
            .as_ref()
            .context("a collective of one rank has no ring")?;
        worker.start(op)
    }
}

/// The f32 values of a tensor of any dtype the rings sum, on the host.
fn f32_values(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

/// Summed f32 `values` as a tensor of `shape` in `dtype` on `device`.
fn summed(values: Vec<f32>, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    Ok(Tensor::from_vec(values, shape, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?)
}

/// Whether the rings sum `t`'s dtype in bf16 (else f32).
fn sums_in_bf16(t: &Tensor, what: &str) -> Result<bool> {
    match t.dtype() {
        DType::F32 => Ok(false),
        DType::BF16 => Ok(true),
        other => bail!("{what} sums f32 or bf16 tensors, not {other:?}"),
    }
}

fn host_out(out: Out) -> Result<Vec<f64>> {
    match out {
        Out::Host(v) => Ok(v),
        _ => bail!("a host all-reduce gave tensor bytes"),
    }
}

fn values_out(out: Out) -> Result<Vec<f32>> {
    match out {
        Out::Values(v) => Ok(v),
        _ => bail!("a sum gave bytes"),
    }
}

fn bytes_out(out: Out) -> Result<Vec<u8>> {
    match out {
        Out::Bytes(v) => Ok(v),
        _ => bail!("a gather gave values"),
    }
}

impl Collective for TcpCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn start_all_gather(&self, shard: &Tensor) -> Result<Pending> {
        let mut shape = shard.dims().to_vec();
        anyhow::ensure!(!shape.is_empty(), "all-gather needs at least one dimension");
        if self.world == 1 {
            return Ok(Pending::ready(shard.detach()));
        }
        shape[0] *= self.world;
        let reply = self.start(Op::AllGather(to_bytes(shard)?))?;
        let (dtype, device) = (shard.dtype(), shard.device().clone());
        Ok(Pending::later(move || {
            from_bytes(&bytes_out(reply.wait()?)?, dtype, &shape, &device)
        }))
    }

    fn start_reduce_scatter(&self, full: &Tensor) -> Result<Pending> {
        let bf16 = sums_in_bf16(full, "reduce-scatter")?;
        let mut shape = full.dims().to_vec();
        anyhow::ensure!(
            !shape.is_empty() && shape[0].is_multiple_of(self.world),
            "reduce-scatter: dimension 0 ({:?}) must split into {} equal chunks",
            shape.first(),
            self.world
        );
        if self.world == 1 {
            return Ok(Pending::ready(full.detach()));
        }
        shape[0] /= self.world;
        let reply = self.start(Op::ReduceScatter {
            values: f32_values(full)?,
            bf16,
        })?;
        let (dtype, device) = (full.dtype(), full.device().clone());
        Ok(Pending::later(move || {
            summed(values_out(reply.wait()?)?, &shape, dtype, &device)
        }))
    }

    fn start_reduce_scatter_across(
        &self,
        full: &Tensor,
        across: Arc<dyn Collective>,
    ) -> Result<Pending> {
        // Chained on the rings' threads when this is the group whose replicas `across` are.
        let (Some(then), true) = (&self.across, self.world > 1 && across.world() > 1) else {
            if self.world == 1 {
                return across.start_all_reduce(full);
            }
            let scatter = self.start_reduce_scatter(full)?;
            return Ok(Pending::later(move || across.all_reduce(&scatter.wait()?)));
        };
        let bf16 = sums_in_bf16(full, "reduce-scatter")?;
        let mut shape = full.dims().to_vec();
        anyhow::ensure!(
            !shape.is_empty() && shape[0].is_multiple_of(self.world),
            "reduce-scatter: dimension 0 ({:?}) must split into {} equal chunks",
            shape.first(),
            self.world
        );
        shape[0] /= self.world;
        let reply = self.start(Op::ReduceScatterThen {
            values: f32_values(full)?,
            bf16,
            then: then.clone(),
        })?;
        let (dtype, device) = (full.dtype(), full.device().clone());
        Ok(Pending::later(move || {
            let Out::Chained(summed) = reply.wait()? else {
                bail!("a chained reduce-scatter gave no all-reduce");
            };
            self::summed(values_out(summed.wait()?)?, &shape, dtype, &device)
        }))
    }

    fn start_all_reduce(&self, t: &Tensor) -> Result<Pending> {
        let bf16 = sums_in_bf16(t, "all-reduce")?;
        if self.world == 1 {
            return Ok(Pending::ready(t.detach()));
        }
        let reply = self.start(Op::AllReduce {
            values: f32_values(t)?,
            bf16,
        })?;
        let (shape, dtype, device) = (t.dims().to_vec(), t.dtype(), t.device().clone());
        Ok(Pending::later(move || {
            summed(values_out(reply.wait()?)?, &shape, dtype, &device)
        }))
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if self.world == 1 {
            return Ok(t.detach());
        }
        anyhow::ensure!(
            root < self.world,
            "broadcast from rank {root} of {}",
            self.world
        );
        let bytes = self
            .start(Op::Broadcast {
                bytes: to_bytes(t)?,
                root,
            })?
            .wait()?;
        from_bytes(&bytes_out(bytes)?, t.dtype(), t.dims(), t.device())
    }

    fn all_reduce_host(&self, values: &[f64], op: ReduceOp) -> Result<Vec<f64>> {
        if self.world == 1 {
            return Ok(values.to_vec());
        }
        host_out(
            self.start(Op::Host {
                values: values.to_vec(),
                op,
            })?
            .wait()?,
        )
    }

    fn sent(&self) -> LinkBytes {
        self.counters.get()
    }

    fn abort(&self, why: &str) {
        self.control.abort(why, true);
    }

    fn aborted(&self) -> Option<String> {
        self.control.aborted()
    }

    fn finish(&self) -> Result<()> {
        if self.world == 1 || !self.whole {
            return Ok(());
        }
        self.barrier()?;
        self.control.finishing.store(true, Ordering::SeqCst);
        if self.control.rank == 0 {
            // Wait for every other rank's goodbye, so none is taken for killed when it exits.
            let deadline = Instant::now() + self.timeout;
            let mut byes = self.control.byes.lock().expect("control state");
            while *byes < self.world - 1 && self.control.aborted().is_none() {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    bail!(
                        "rank 0: not every rank said goodbye within {} s",
                        self.timeout.as_secs()
                    );
                }
                byes = self
                    .control
                    .bye_seen
                    .wait_timeout(byes, left)
                    .expect("control state")
                    .0;
            }
            if let Some(why) = self.control.aborted() {
                bail!("the run was aborted: {why}");
            }
        } else if let Some(Some(link)) = self.control.links.first() {
            self.control.send(link, BYE, &[])?;
        }
        Ok(())
    }
}

impl Drop for TcpCollective {
    fn drop(&mut self) {
        // A rank that goes away without finishing (an error unwinding through its caller) makes
        // sure the others hear about it now rather than at their next timeout.
        if self.whole && !self.control.finishing.load(Ordering::SeqCst) && self.world > 1 {
            self.control.abort(
                &format!("rank {} stopped before the end of the run", self.rank),
                true,
            );
        }
    }
}

#[cfg(test)]
mod tests;
