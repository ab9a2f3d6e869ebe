//! The control plane of the TCP collectives (docs/distributed.md §3): the framed messages rank 0
//! and every other rank exchange on their control connections (the rendezvous greeting and
//! answer, aborts, goodbyes, heartbeats) and [`Control`], the state those connections share: the
//! first abort reason, the ring sockets it shuts down, the goodbyes rank 0 waits for, and when
//! each peer was last heard from. It runs beside the collectives, on threads of its own, and
//! knows nothing of tensors or of the ring's algorithms.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Control-plane message kinds.
pub(super) const HELLO: u8 = 1;
pub(super) const WELCOME: u8 = 2;
const ABORT: u8 = 3;
pub(super) const BYE: u8 = 4;
const HEARTBEAT: u8 = 5;

/// How often a rank tells the other end of its control connections that it is alive.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Hello {
    pub(super) rank: usize,
    pub(super) world: usize,
    /// Ranks per shard group (docs/distributed.md §4.7), which every rank must agree on.
    pub(super) group: usize,
    pub(super) ring_port: u16,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Welcome {
    /// Ring listener of every rank, `host:port`.
    pub(super) ring: Vec<String>,
    pub(super) payload: Vec<u8>,
}

pub(super) fn send_msg(mut s: &TcpStream, kind: u8, payload: &[u8]) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(5 + payload.len());
    frame.push(kind);
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.extend_from_slice(payload);
    s.write_all(&frame)
}

pub(super) fn recv_msg(mut s: &TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 5];
    s.read_exact(&mut head)?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload)?;
    Ok((head[0], payload))
}

/// Shared state of the control plane.
pub(super) struct Control {
    pub(super) rank: usize,
    pub(super) aborted: Mutex<Option<String>>,
    pub(super) finishing: AtomicBool,
    /// Every ring's sockets, shut down on abort so that blocked collectives return.
    pub(super) ring: Mutex<Vec<TcpStream>>,
    /// Rank 0: the connection to every other rank (index = rank); others: `[rank 0]`.
    pub(super) links: Vec<Option<TcpStream>>,
    /// Rank 0: goodbyes received.
    pub(super) byes: Mutex<usize>,
    pub(super) bye_seen: Condvar,
    /// Serialises writes on the control connections (heartbeats, aborts, goodbyes).
    pub(super) write: Mutex<()>,
    /// When each peer (index = rank) was last heard from on the control plane.
    pub(super) last_heard: Mutex<Vec<Instant>>,
    /// A peer silent for this long is taken for stopped or unreachable.
    pub(super) silence: Duration,
    /// Run once when the run is aborted (e.g. aborting a GPU communicator).
    pub(super) on_abort: Mutex<Vec<Box<dyn Fn() + Send + Sync>>>,
}

impl Control {
    /// Records `why` (the first reason wins), tells the others, and unblocks the ring.
    pub(super) fn abort(&self, why: &str, tell_others: bool) {
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
    pub(super) fn send(&self, link: &TcpStream, kind: u8, payload: &[u8]) -> std::io::Result<()> {
        let _guard = self.write.lock().expect("control state");
        send_msg(link, kind, payload)
    }

    /// Sends heartbeats and watches the peers' until the run finishes or is aborted.
    pub(super) fn heartbeat(self: Arc<Self>) {
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

    pub(super) fn aborted(&self) -> Option<String> {
        self.aborted.lock().expect("control state").clone()
    }

    /// Reads one control connection until it ends. `peer` is the rank at the other end.
    pub(super) fn listen(self: Arc<Self>, stream: TcpStream, peer: usize) {
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
