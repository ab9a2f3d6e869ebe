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

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::collective::{Collective, ReduceOp};

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

/// Control-plane message kinds.
const HELLO: u8 = 1;
const WELCOME: u8 = 2;
const ABORT: u8 = 3;
const BYE: u8 = 4;
const HEARTBEAT: u8 = 5;

/// How often a rank tells the other end of its control connections that it is alive.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);

#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    rank: usize,
    world: usize,
    ring_port: u16,
}

#[derive(Debug, Serialize, Deserialize)]
struct Welcome {
    /// Ring listener of every rank, `host:port`.
    ring: Vec<String>,
    payload: Vec<u8>,
}

fn send_msg(mut s: &TcpStream, kind: u8, payload: &[u8]) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(5 + payload.len());
    frame.push(kind);
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.extend_from_slice(payload);
    s.write_all(&frame)
}

fn recv_msg(mut s: &TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 5];
    s.read_exact(&mut head)?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload)?;
    Ok((head[0], payload))
}

/// Shared state of the control plane.
struct Control {
    rank: usize,
    aborted: Mutex<Option<String>>,
    finishing: AtomicBool,
    /// Ring sockets, shut down on abort so that blocked collectives return.
    ring: Mutex<Vec<TcpStream>>,
    /// Rank 0: the connection to every other rank (index = rank); others: `[rank 0]`.
    links: Vec<Option<TcpStream>>,
    /// Rank 0: goodbyes received.
    byes: Mutex<usize>,
    bye_seen: Condvar,
    /// Serialises writes on the control connections (heartbeats, aborts, goodbyes).
    write: Mutex<()>,
    /// When each peer (index = rank) was last heard from on the control plane.
    last_heard: Mutex<Vec<Instant>>,
    /// A peer silent for this long is taken for stopped or unreachable.
    silence: Duration,
    /// Run once when the run is aborted (e.g. aborting a GPU communicator).
    on_abort: Mutex<Vec<Box<dyn Fn() + Send + Sync>>>,
}

impl Control {
    /// Records `why` (the first reason wins), tells the others, and unblocks the ring.
    fn abort(&self, why: &str, tell_others: bool) {
        {
            let mut a = self.aborted.lock().expect("control state");
            if a.is_some() {
                return;
            }
            *a = Some(why.to_string());
        }
        if tell_others {
            for link in self.links.iter().flatten() {
                let _ = self.send(link, ABORT, why.as_bytes());
            }
        }
        for s in self.ring.lock().expect("control state").iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
        self.bye_seen.notify_all();
        for f in self.on_abort.lock().expect("control state").iter() {
            f();
        }
    }

    /// Sends one message on a control connection (whole, never interleaved with another).
    fn send(&self, link: &TcpStream, kind: u8, payload: &[u8]) -> std::io::Result<()> {
        let _guard = self.write.lock().expect("control state");
        send_msg(link, kind, payload)
    }

    /// Sends heartbeats and watches the peers' until the run finishes or is aborted.
    fn heartbeat(self: Arc<Self>) {
        loop {
            std::thread::sleep(HEARTBEAT_EVERY);
            if self.finishing.load(Ordering::SeqCst) || self.aborted().is_some() {
                return;
            }
            for link in self.links.iter().flatten() {
                let _ = self.send(link, HEARTBEAT, &[]);
            }
            let silent = {
                let heard = self.last_heard.lock().expect("control state");
                self.links
                    .iter()
                    .enumerate()
                    .filter(|(_, l)| l.is_some())
                    .map(|(i, _)| if self.rank == 0 { i } else { 0 })
                    .find(|&peer| heard[peer].elapsed() > self.silence)
            };
            if let Some(peer) = silent {
                if self.finishing.load(Ordering::SeqCst) {
                    return;
                }
                self.abort(
                    &format!(
                        "rank {peer} stopped responding: nothing was heard from it for {} s (half \
                         of train.dist_timeout); it is stopped (SIGSTOP), hung outside this \
                         program, or its machine is unreachable",
                        self.silence.as_secs()
                    ),
                    true,
                );
                return;
            }
        }
    }

    fn aborted(&self) -> Option<String> {
        self.aborted.lock().expect("control state").clone()
    }

    /// Reads one control connection until it ends. `peer` is the rank at the other end.
    fn listen(self: Arc<Self>, stream: TcpStream, peer: usize) {
        let _ = stream.set_read_timeout(None);
        loop {
            match recv_msg(&stream) {
                Ok((ABORT, msg)) => {
                    let why = String::from_utf8_lossy(&msg).into_owned();
                    // Rank 0 relays an abort to every rank; the others only record it.
                    self.abort(&why, self.rank == 0);
                    return;
                }
                Ok((BYE, _)) => {
                    *self.byes.lock().expect("control state") += 1;
                    self.bye_seen.notify_all();
                    return;
                }
                Ok((HEARTBEAT, _)) => {
                    self.last_heard.lock().expect("control state")[peer] = Instant::now();
                }
                Ok(_) => {}
                Err(_) => {
                    if self.finishing.load(Ordering::SeqCst) && self.rank != 0 {
                        return;
                    }
                    let why = if peer == 0 {
                        "lost the connection to rank 0 (it exited or was killed)".to_string()
                    } else {
                        format!(
                            "rank {peer} disconnected without finishing (it exited or was killed)"
                        )
                    };
                    self.abort(&why, self.rank == 0);
                    return;
                }
            }
        }
    }
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

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn f32_from(bytes: &[u8]) -> Vec<f32> {
    pod_vec(bytes)
}

/// `bytes` (a whole number of `T`s, any alignment) copied into a `Vec<T>`.
fn pod_vec<T: bytemuck::Pod + Default>(bytes: &[u8]) -> Vec<T> {
    let n = bytes.len() / std::mem::size_of::<T>();
    let mut v = vec![T::default(); n];
    bytemuck::cast_slice_mut(&mut v).copy_from_slice(&bytes[..n * std::mem::size_of::<T>()]);
    v
}

/// A contiguous tensor's raw bytes on the host, and how to rebuild one from them.
fn to_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.to_device(&Device::Cpu)?.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => f32_bytes(&t.to_vec1::<f32>()?),
        DType::BF16 => {
            let v: Vec<u16> = t
                .to_vec1::<half::bf16>()?
                .iter()
                .map(|x| x.to_bits())
                .collect();
            bytemuck::cast_slice(&v).to_vec()
        }
        DType::F64 => bytemuck::cast_slice(&t.to_vec1::<f64>()?).to_vec(),
        DType::U32 => bytemuck::cast_slice(&t.to_vec1::<u32>()?).to_vec(),
        other => bail!("the TCP collectives do not carry {other:?} tensors"),
    })
}

fn from_bytes(bytes: &[u8], dtype: DType, shape: &[usize], device: &Device) -> Result<Tensor> {
    let t = match dtype {
        DType::F32 => Tensor::from_vec(f32_from(bytes), shape, &Device::Cpu)?,
        DType::BF16 => {
            let v: Vec<u16> = pod_vec(bytes);
            let v: Vec<half::bf16> = v.into_iter().map(half::bf16::from_bits).collect();
            Tensor::from_vec(v, shape, &Device::Cpu)?
        }
        DType::F64 => Tensor::from_vec(pod_vec::<f64>(bytes), shape, &Device::Cpu)?,
        DType::U32 => Tensor::from_vec(pod_vec::<u32>(bytes), shape, &Device::Cpu)?,
        other => bail!("the TCP collectives do not carry {other:?} tensors"),
    };
    Ok(t.to_device(device)?)
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
mod tests {
    use super::*;

    /// A rendezvous socket bound before any rank starts, as our launcher binds it (a port
    /// chosen and released first could be taken by a parallel test), and its port.
    fn bound_rendezvous() -> (Arc<TcpListener>, u16) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        (Arc::new(l), port)
    }

    /// Runs `f` on `world` ranks (threads) connected over loopback.
    fn run<T: Send>(world: usize, f: impl Fn(TcpCollective) -> T + Sync) -> Vec<T> {
        let (listener, port) = bound_rendezvous();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let f = &f;
                    let listener = listener.clone();
                    s.spawn(move || {
                        let ep = Endpoint {
                            rank,
                            world,
                            master: format!("127.0.0.1:{port}"),
                            timeout: Duration::from_secs(20),
                            listener: (rank == 0).then_some(listener),
                        };
                        let c = TcpCollective::connect(&ep, b"hello".to_vec()).unwrap();
                        assert_eq!(c.payload(), b"hello");
                        f(c)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn ring_collectives_agree_with_their_definition() {
        for world in [1usize, 2, 3, 4] {
            let out = run(world, |c| {
                let r = c.rank() as f32;
                // Shard of 2 rows × 3, different per rank.
                let shard =
                    Tensor::new(&[[r, r + 0.5, -r], [10.0 * r, 1.0, 2.0]], &Device::Cpu).unwrap();
                let gathered = c.all_gather(&shard).unwrap();
                let bf = c.all_gather(&shard.to_dtype(DType::BF16).unwrap()).unwrap();
                assert_eq!(bf.dtype(), DType::BF16);
                // Full tensor: world × 2 rows; rank r contributes (r + 1) × row index.
                let rows: Vec<f32> = (0..world * 2 * 3).map(|i| (i as f32) * (r + 1.0)).collect();
                let full = Tensor::from_vec(rows, (world * 2, 3), &Device::Cpu).unwrap();
                let reduced = c.reduce_scatter(&full).unwrap();
                let b = c
                    .broadcast(&Tensor::new(&[r + 7.0], &Device::Cpu).unwrap(), world - 1)
                    .unwrap();
                let host = c.all_reduce_host(&[r as f64, 1.0], ReduceOp::Sum).unwrap();
                let max = c.all_reduce_host(&[r as f64], ReduceOp::Max).unwrap();
                c.barrier().unwrap();
                c.finish().unwrap();
                (
                    gathered.to_vec2::<f32>().unwrap(),
                    reduced.to_vec2::<f32>().unwrap(),
                    b.to_vec1::<f32>().unwrap(),
                    host,
                    max,
                )
            });
            let total: f32 = (1..=world).map(|k| k as f32).sum();
            for (rank, (g, red, b, host, max)) in out.into_iter().enumerate() {
                assert_eq!(g.len(), 2 * world, "world {world}");
                for q in 0..world {
                    let q = q as f32;
                    assert_eq!(g[2 * q as usize], vec![q, q + 0.5, -q]);
                    assert_eq!(g[2 * q as usize + 1], vec![10.0 * q, 1.0, 2.0]);
                }
                for (i, row) in red.iter().enumerate() {
                    for (j, v) in row.iter().enumerate() {
                        let flat = ((rank * 2 + i) * 3 + j) as f32;
                        assert_eq!(*v, flat * total, "world {world} rank {rank}");
                    }
                }
                assert_eq!(b, vec![(world - 1) as f32 + 7.0]);
                let s: f64 = (0..world).map(|k| k as f64).sum();
                assert_eq!(host, vec![s, world as f64]);
                assert_eq!(max, vec![(world - 1) as f64]);
            }
        }
    }

    #[test]
    fn an_abort_reaches_every_rank_and_fails_their_collectives() {
        let out = run(3, |c| {
            if c.rank() == 2 {
                c.abort("rank 2 failed: disk full");
            }
            // Everyone else blocks in a collective that rank 2 never joins.
            let started = Instant::now();
            let r = c.all_reduce_host(&[1.0], ReduceOp::Sum);
            let why = c.aborted();
            (r.is_err(), why, started.elapsed())
        });
        for (rank, (failed, why, took)) in out.into_iter().enumerate() {
            assert!(failed, "rank {rank}");
            assert_eq!(
                why.as_deref(),
                Some("rank 2 failed: disk full"),
                "rank {rank}"
            );
            assert!(took < Duration::from_secs(10), "rank {rank} took {took:?}");
        }
    }

    #[test]
    fn a_rendezvous_with_a_missing_rank_times_out_naming_it() {
        let (listener, port) = bound_rendezvous();
        let ep = |rank| Endpoint {
            rank,
            world: 3,
            master: format!("127.0.0.1:{port}"),
            timeout: Duration::from_secs(2),
            listener: (rank == 0).then(|| listener.clone()),
        };
        let (r0, r1) = std::thread::scope(|s| {
            let a = s.spawn(|| TcpCollective::connect(&ep(0), vec![]).err().unwrap());
            let b = s.spawn(|| TcpCollective::connect(&ep(1), vec![]).err().unwrap());
            (a.join().unwrap(), b.join().unwrap())
        });
        let e0 = format!("{r0:#}");
        assert!(
            e0.contains(&format!("127.0.0.1:{port}")) && e0.contains("rank(s) 2 never connected"),
            "{e0}"
        );
        let e1 = format!("{r1:#}");
        assert!(
            e1.contains("rank 1") && e1.contains(&format!("127.0.0.1:{port}")),
            "{e1}"
        );
    }
}
