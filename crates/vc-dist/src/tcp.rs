//! The CPU collective backend (docs/distributed.md §3), like PyTorch's gloo: the rank processes
//! form a ring of TCP connections (each rank sends to the next and receives from the previous
//! one), and rank 0 keeps one more connection to every rank as the control plane, which carries
//! the rendezvous and aborts.
//!
//! Rendezvous: rank 0 listens on the master address; every other rank connects (retrying until
//! the timeout, since rank 0 may start later), says who it is and where its ring listener is;
//! rank 0 answers everyone with the address table and an optional payload (the NCCL unique id).
//! Then each rank connects to the next one's ring listener and accepts the previous one.
//!
//! Failure: a rank that fails calls [`Collective::abort`]; the message goes to rank 0, which
//! passes it to every rank. A rank whose control connection closes without saying goodbye (it
//! was killed) is reported the same way by rank 0. An aborted rank shuts its ring sockets down,
//! so a collective blocked on them fails at once with the reason. Every socket operation also
//! has a timeout: nothing waits forever.
//!
//! Heartbeats: every rank and rank 0 send each other a heartbeat every second on the control
//! plane, from a thread of their own. A rank that is alive but silent — stopped (SIGSTOP), or
//! its machine gone without closing the connection — is noticed when nothing has come from it
//! for half the timeout, and the run is aborted naming it, even while the others are busy computing
//! or blocked inside a GPU collective, where no socket timeout applies.
//!
//! Here: the rendezvous, the ring and the collectives over it. The control plane's messages and
//! shared state are in `control`, the conversions between tensors and the bytes the ring carries
//! in `wire`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

use super::collective::{Collective, ReduceOp};

mod control;
mod wire;

use control::{recv_msg, send_msg, Control, Hello, Welcome, BYE, HELLO, WELCOME};
use wire::{f32_bytes, f32_from, from_bytes, pod_vec, to_bytes};

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
}

/// The two ring connections of a rank.
struct Ring {
    next: TcpStream,
    prev: TcpStream,
}

/// A rank of a run, connected to the others.
pub struct TcpCollective {
    rank: usize,
    world: usize,
    ring: Option<Ring>,
    control: Arc<Control>,
    timeout: Duration,
    /// The rendezvous payload from rank 0.
    payload: Vec<u8>,
}

/// Accepts one connection before `deadline`, checking `give_up` between tries.
fn accept_until(
    listener: &TcpListener,
    deadline: Instant,
    give_up: &dyn Fn() -> Option<String>,
) -> Result<Option<(TcpStream, SocketAddr)>> {
    listener.set_nonblocking(true)?;
    loop {
        match listener.accept() {
            Ok((s, a)) => {
                s.set_nonblocking(false)?;
                return Ok(Some((s, a)));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e.into()),
        }
        if let Some(why) = give_up() {
            bail!("{why}");
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn connect_until(addr: &str, deadline: Instant) -> Result<TcpStream> {
    loop {
        let last = match addr.to_socket_addrs() {
            Ok(mut addrs) => match addrs.next() {
                Some(a) => match TcpStream::connect_timeout(&a, Duration::from_secs(2)) {
                    Ok(s) => return Ok(s),
                    Err(e) => e.to_string(),
                },
                None => format!("{addr} resolves to no address"),
            },
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            bail!("cannot connect to {addr}: {last}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl TcpCollective {
    /// Joins the run at `ep` (see the module docs). Rank 0 passes `payload` to every rank.
    pub fn connect(ep: &Endpoint, payload: Vec<u8>) -> Result<Self> {
        anyhow::ensure!(
            ep.world >= 1 && ep.rank < ep.world,
            "rank {} is not in a world of {}",
            ep.rank,
            ep.world
        );
        let deadline = Instant::now() + ep.timeout;
        let secs = ep.timeout.as_secs();
        let ring_listener = TcpListener::bind("0.0.0.0:0").context("cannot open a ring port")?;
        let ring_port = ring_listener.local_addr()?.port();
        let (links, welcome) = if ep.rank == 0 {
            let listener = match &ep.listener {
                Some(l) => l.try_clone().context("the rendezvous socket")?,
                None => TcpListener::bind(bind_addr(&ep.master)?).with_context(|| {
                    format!("rank 0 cannot listen on {} for the rendezvous", ep.master)
                })?,
            };
            let mut links: Vec<Option<TcpStream>> = (0..ep.world).map(|_| None).collect();
            let mut ring = vec![String::new(); ep.world];
            ring[0] = format!("{}:{ring_port}", host_of(&ep.master));
            let mut joined = 1;
            while joined < ep.world {
                let Some((s, addr)) = accept_until(&listener, deadline, &|| None)? else {
                    let missing: Vec<String> = (1..ep.world)
                        .filter(|&r| links[r].is_none())
                        .map(|r| r.to_string())
                        .collect();
                    bail!(
                        "the rendezvous at {} timed out after {secs} s: rank(s) {} never connected \
                         ({} of {} ranks joined)",
                        ep.master,
                        missing.join(", "),
                        joined,
                        ep.world
                    );
                };
                s.set_read_timeout(Some(ep.timeout))?;
                let (kind, body) = recv_msg(&s).context("a rank's greeting")?;
                anyhow::ensure!(kind == HELLO, "unexpected message {kind} at the rendezvous");
                let hello: Hello = serde_json::from_slice(&body)?;
                if hello.world != ep.world {
                    bail!(
                        "rank {} thinks the world has {} ranks, rank 0 says {}",
                        hello.rank,
                        hello.world,
                        ep.world
                    );
                }
                if hello.rank == 0 || hello.rank >= ep.world || links[hello.rank].is_some() {
                    bail!(
                        "rank {} joined the rendezvous twice or does not exist",
                        hello.rank
                    );
                }
                ring[hello.rank] = format!("{}:{}", addr.ip(), hello.ring_port);
                links[hello.rank] = Some(s);
                joined += 1;
            }
            let welcome = Welcome { ring, payload };
            let body = serde_json::to_vec(&welcome)?;
            for link in links.iter().flatten() {
                send_msg(link, WELCOME, &body)?;
            }
            (links, welcome)
        } else {
            let s = connect_until(&ep.master, deadline).with_context(|| {
                format!(
                    "rank {} cannot reach rank 0 at {} for the rendezvous (timeout {secs} s)",
                    ep.rank, ep.master
                )
            })?;
            let hello = Hello {
                rank: ep.rank,
                world: ep.world,
                ring_port,
            };
            send_msg(&s, HELLO, &serde_json::to_vec(&hello)?)?;
            s.set_read_timeout(Some(
                deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1)),
            ))?;
            let (kind, body) = recv_msg(&s).with_context(|| {
                format!(
                    "rank {}: the rendezvous at {} did not complete within {secs} s (are all {} \
                     ranks started?)",
                    ep.rank, ep.master, ep.world
                )
            })?;
            anyhow::ensure!(
                kind == WELCOME,
                "unexpected message {kind} at the rendezvous"
            );
            let welcome: Welcome = serde_json::from_slice(&body)?;
            (vec![Some(s)], welcome)
        };
        let control = Arc::new(Control {
            rank: ep.rank,
            aborted: Mutex::new(None),
            finishing: AtomicBool::new(false),
            ring: Mutex::new(Vec::new()),
            byes: Mutex::new(0),
            bye_seen: Condvar::new(),
            write: Mutex::new(()),
            last_heard: Mutex::new(vec![Instant::now(); links.len().max(ep.world)]),
            // Half the timeout: a silent peer is named before the collective waiting for it
            // times out (which could only name the ring neighbours).
            silence: (ep.timeout / 2).max(Duration::from_secs(1)),
            on_abort: Mutex::new(Vec::new()),
            links,
        });
        // The ring: connect to the next rank, accept the previous one.
        let ring = if ep.world > 1 {
            let next_rank = (ep.rank + 1) % ep.world;
            let prev_rank = (ep.rank + ep.world - 1) % ep.world;
            let next = connect_until(&welcome.ring[next_rank], deadline)
                .with_context(|| format!("rank {} cannot reach rank {next_rank}", ep.rank))?;
            (&next).write_all(&(ep.rank as u32).to_le_bytes())?;
            let Some((prev, _)) = accept_until(&ring_listener, deadline, &|| None)? else {
                bail!(
                    "rank {}: rank {prev_rank} did not connect to the ring within {secs} s",
                    ep.rank
                );
            };
            prev.set_read_timeout(Some(ep.timeout))?;
            let mut who = [0u8; 4];
            (&prev).read_exact(&mut who)?;
            let who = u32::from_le_bytes(who) as usize;
            anyhow::ensure!(
                who == prev_rank,
                "rank {}: expected rank {prev_rank} on the ring, got rank {who}",
                ep.rank
            );
            for s in [&next, &prev] {
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(ep.timeout))?;
                s.set_write_timeout(Some(ep.timeout))?;
            }
            control
                .ring
                .lock()
                .expect("control state")
                .extend([next.try_clone()?, prev.try_clone()?]);
            Some(Ring { next, prev })
        } else {
            None
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
        Ok(Self {
            rank: ep.rank,
            world: ep.world,
            ring,
            control,
            timeout: ep.timeout,
            payload: welcome.payload,
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

    /// The error for a failed ring operation: the abort reason when there is one.
    fn ring_error(&self, e: std::io::Error, what: &str) -> anyhow::Error {
        // A neighbour that closes its ring sockets does so because the run was aborted (or it
        // died, which rank 0 announces): that reason travels on the control plane and may
        // arrive just after the socket error, so wait a moment for it before blaming the ring.
        let timed_out = matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        );
        let wait_until = Instant::now() + Duration::from_secs(if timed_out { 0 } else { 3 });
        loop {
            if let Some(why) = self.control.aborted() {
                return anyhow::anyhow!("the run was aborted: {why}");
            }
            if Instant::now() >= wait_until {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let prev = (self.rank + self.world - 1) % self.world;
        let next = (self.rank + 1) % self.world;
        let msg = match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                "rank {}: {what} timed out after {} s (ranks {prev} and {next} are its ring \
                 neighbours)",
                self.rank,
                self.timeout.as_secs()
            ),
            _ => format!(
                "rank {}: {what} failed: {e} (ranks {prev} and {next} are its ring neighbours)",
                self.rank
            ),
        };
        self.control.abort(&msg, true);
        anyhow::anyhow!(msg)
    }

    /// Sends `send` to the next rank while receiving `recv` from the previous one.
    fn exchange(&self, send: &[u8], recv: &mut [u8], what: &str) -> Result<()> {
        if let Some(why) = self.control.aborted() {
            bail!("the run was aborted: {why}");
        }
        let ring = self.ring.as_ref().expect("a ring with more than one rank");
        let (r, w) = std::thread::scope(|s| {
            let sender = s.spawn(|| (&ring.next).write_all(send));
            let r = (&ring.prev).read_exact(recv);
            (r, sender.join().expect("ring sender"))
        });
        r.map_err(|e| self.ring_error(e, what))?;
        w.map_err(|e| self.ring_error(e, what))?;
        Ok(())
    }

    /// Ring all-gather of equal byte chunks.
    fn all_gather_bytes(&self, chunk: &[u8]) -> Result<Vec<u8>> {
        let (n, w) = (chunk.len(), self.world);
        let mut out = vec![0u8; n * w];
        out[self.rank * n..(self.rank + 1) * n].copy_from_slice(chunk);
        for s in 0..w.saturating_sub(1) {
            let send_idx = (self.rank + w - s) % w;
            let recv_idx = (self.rank + 2 * w - s - 1) % w;
            let send = out[send_idx * n..(send_idx + 1) * n].to_vec();
            self.exchange(
                &send,
                &mut out[recv_idx * n..(recv_idx + 1) * n],
                "all-gather",
            )?;
        }
        Ok(out)
    }
}

/// `0.0.0.0:PORT` for a `host:port` address: rank 0 accepts on every interface.
fn bind_addr(master: &str) -> Result<String> {
    let port = master
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .with_context(|| format!("{master:?} is not a host:port address"))?;
    Ok(format!("0.0.0.0:{port}"))
}

fn host_of(master: &str) -> &str {
    master.rsplit_once(':').map_or(master, |(h, _)| h)
}

impl Collective for TcpCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&self, shard: &Tensor) -> Result<Tensor> {
        if self.world == 1 {
            return Ok(shard.clone());
        }
        let mut shape = shard.dims().to_vec();
        anyhow::ensure!(!shape.is_empty(), "all-gather needs at least one dimension");
        shape[0] *= self.world;
        let bytes = self.all_gather_bytes(&to_bytes(shard)?)?;
        from_bytes(&bytes, shard.dtype(), &shape, shard.device())
    }

    fn reduce_scatter(&self, full: &Tensor) -> Result<Tensor> {
        let bf16 = match full.dtype() {
            DType::F32 => false,
            DType::BF16 => true,
            other => anyhow::bail!("reduce-scatter sums f32 or bf16 tensors, not {other:?}"),
        };
        let mut shape = full.dims().to_vec();
        anyhow::ensure!(
            !shape.is_empty() && shape[0].is_multiple_of(self.world),
            "reduce-scatter: dimension 0 ({:?}) must split into {} equal chunks",
            shape.first(),
            self.world
        );
        shape[0] /= self.world;
        if self.world == 1 {
            return Ok(full.clone());
        }
        let w = self.world;
        let mut acc = full
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let n = acc.len() / w;
        let mut incoming = vec![0u8; n * if bf16 { 2 } else { 4 }];
        // Step s: send chunk (r-s-1), receive chunk (r-s-2) and add it; after w-1 steps chunk r
        // holds the sum of every rank's chunk r, added in a fixed order. In bf16 a partial sum
        // is rounded before it travels.
        for s in 0..w - 1 {
            let send_idx = (self.rank + 2 * w - s - 1) % w;
            let recv_idx = (self.rank + 2 * w - s - 2) % w;
            let chunk = &acc[send_idx * n..(send_idx + 1) * n];
            let send = if bf16 {
                chunk
                    .iter()
                    .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                    .collect()
            } else {
                f32_bytes(chunk)
            };
            self.exchange(&send, &mut incoming, "reduce-scatter")?;
            let add: Vec<f32> = if bf16 {
                incoming
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect()
            } else {
                f32_from(&incoming)
            };
            acc[recv_idx * n..(recv_idx + 1) * n]
                .iter_mut()
                .zip(add)
                .for_each(|(a, b)| *a += b);
        }
        if bf16 {
            let mine: Vec<half::bf16> = acc[self.rank * n..(self.rank + 1) * n]
                .iter()
                .map(|v| half::bf16::from_f32(*v))
                .collect();
            return Ok(Tensor::from_vec(mine, shape, &Device::Cpu)?.to_device(full.device())?);
        }
        let mine = acc[self.rank * n..(self.rank + 1) * n].to_vec();
        Ok(Tensor::from_vec(mine, shape, &Device::Cpu)?.to_device(full.device())?)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if self.world == 1 {
            return Ok(t.clone());
        }
        anyhow::ensure!(
            root < self.world,
            "broadcast from rank {root} of {}",
            self.world
        );
        // Around the ring from the root: every rank but the last one forwards what it received.
        let w = self.world;
        let ring = self.ring.as_ref().expect("a ring");
        let hops = (self.rank + w - root) % w;
        let mut bytes = to_bytes(t)?;
        if hops > 0 {
            (&ring.prev)
                .read_exact(&mut bytes)
                .map_err(|e| self.ring_error(e, "broadcast"))?;
        }
        if hops < w - 1 {
            (&ring.next)
                .write_all(&bytes)
                .map_err(|e| self.ring_error(e, "broadcast"))?;
        }
        from_bytes(&bytes, t.dtype(), t.dims(), t.device())
    }

    fn all_reduce_host(&self, values: &[f64], op: ReduceOp) -> Result<Vec<f64>> {
        if self.world == 1 {
            return Ok(values.to_vec());
        }
        let bytes = self.all_gather_bytes(bytemuck::cast_slice(values))?;
        let all: Vec<f64> = pod_vec(&bytes);
        let k = values.len();
        let mut out = all[..k].to_vec();
        for r in 1..self.world {
            for (o, v) in out.iter_mut().zip(&all[r * k..(r + 1) * k]) {
                *o = op.apply(*o, *v);
            }
        }
        Ok(out)
    }

    fn abort(&self, why: &str) {
        self.control.abort(why, true);
    }

    fn aborted(&self) -> Option<String> {
        self.control.aborted()
    }

    fn finish(&self) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        self.barrier()?;
        self.control.finishing.store(true, Ordering::SeqCst);
        if self.rank == 0 {
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
        if !self.control.finishing.load(Ordering::SeqCst) && self.world > 1 {
            self.control.abort(
                &format!("rank {} stopped before the end of the run", self.rank),
                true,
            );
        }
    }
}

#[cfg(test)]
mod tests;
