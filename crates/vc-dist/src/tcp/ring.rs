//! One ring of TCP connections among some of the ranks — all of them, a shard group, or the
//! replicas of one shard (docs/distributed.md §3.1, §4.7) — and the collectives over it, on
//! bytes and f32 values. Each step of a ring collective sends one chunk to the next rank while
//! receiving one from the previous (the send on a thread of its own, so full socket buffers
//! never deadlock). A ring runs on its communication thread (`worker`), one collective at a
//! time in the order they were started.
//!
//! What this rank sends is counted by where it goes (another node or not), and where the
//! network is emulated (docs/distributed.md §8.3) a send to another node waits for this rank's
//! emulated link first.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::control::Control;
use super::wire::{f32_bytes, f32_from, pod_vec};
use crate::collective::{LinkBytes, ReduceOp};
use crate::topology::Emulation;

/// Tensor bytes a communicator's ring has sent, by where they went.
#[derive(Default)]
pub(super) struct Counters {
    within: AtomicU64,
    across: AtomicU64,
}

impl Counters {
    pub(super) fn get(&self) -> LinkBytes {
        LinkBytes {
            within_node: self.within.load(Ordering::Relaxed),
            across_nodes: self.across.load(Ordering::Relaxed),
        }
    }
}

/// This rank's emulated link to other nodes: what it sends there leaves one message after the
/// other at the emulated bandwidth and arrives a latency later.
pub(super) struct Nic {
    emulation: Emulation,
    free_at: Mutex<Instant>,
}

impl Nic {
    pub(super) fn new(emulation: Emulation) -> Self {
        Self {
            emulation,
            free_at: Mutex::new(Instant::now()),
        }
    }

    /// Takes the link for `bytes`; returns when they have arrived at the other end.
    fn arrival(&self, bytes: usize) -> Instant {
        let mut free = self.free_at.lock().expect("emulated link");
        let leaves = (*free).max(Instant::now()) + self.emulation.transfer_time(bytes);
        *free = leaves;
        leaves + self.emulation.latency
    }
}

/// The ring's sockets and this rank's place in it.
pub(super) struct Ring {
    /// The ranks of the ring (numbered in the whole run), in ring order.
    pub(super) members: Vec<usize>,
    /// This rank's position in `members`.
    pub(super) pos: usize,
    pub(super) next: TcpStream,
    pub(super) prev: TcpStream,
    /// Whether the next rank is on another node.
    pub(super) across: bool,
    pub(super) control: Arc<Control>,
    pub(super) timeout: Duration,
    pub(super) counters: Arc<Counters>,
    /// The emulated link, where the network is emulated.
    pub(super) nic: Option<Arc<Nic>>,
}

impl Ring {
    fn size(&self) -> usize {
        self.members.len()
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
        let n = self.size();
        let prev = self.members[(self.pos + n - 1) % n];
        let next = self.members[(self.pos + 1) % n];
        let rank = self.members[self.pos];
        let msg = match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                "rank {rank}: {what} timed out after {} s (ranks {prev} and {next} are its ring \
                 neighbours)",
                self.timeout.as_secs()
            ),
            _ => format!(
                "rank {rank}: {what} failed: {e} (ranks {prev} and {next} are its ring neighbours)"
            ),
        };
        self.control.abort(&msg, true);
        anyhow::anyhow!(msg)
    }

    /// Sends `send` to the next rank while receiving `recv` from the previous one; `count`:
    /// tensor bytes, which the link counters take.
    fn exchange(&self, send: &[u8], recv: &mut [u8], what: &str, count: bool) -> Result<()> {
        if let Some(why) = self.control.aborted() {
            bail!("the run was aborted: {why}");
        }
        let nic = self.nic.as_ref().filter(|_| self.across);
        let (r, w) = std::thread::scope(|s| {
            let sender = s.spawn(|| {
                if let Some(nic) = nic {
                    let at = nic.arrival(send.len());
                    std::thread::sleep(at.saturating_duration_since(Instant::now()));
                }
                (&self.next).write_all(send)
            });
            let r = (&self.prev).read_exact(recv);
            (r, sender.join().expect("ring sender"))
        });
        r.map_err(|e| self.ring_error(e, what))?;
        w.map_err(|e| self.ring_error(e, what))?;
        if count {
            let c = if self.across {
                &self.counters.across
            } else {
                &self.counters.within
            };
            c.fetch_add(send.len() as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Every member's `chunk` (equal lengths), concatenated in ring order.
    pub(super) fn all_gather(&self, chunk: &[u8], what: &str, count: bool) -> Result<Vec<u8>> {
        let (n, w, p) = (chunk.len(), self.size(), self.pos);
        let mut out = vec![0u8; n * w];
        out[p * n..(p + 1) * n].copy_from_slice(chunk);
        for s in 0..w - 1 {
            let send_idx = (p + w - s) % w;
            let recv_idx = (p + 2 * w - s - 1) % w;
            let send = out[send_idx * n..(send_idx + 1) * n].to_vec();
            self.exchange(
                &send,
                &mut out[recv_idx * n..(recv_idx + 1) * n],
                what,
                count,
            )?;
        }
        Ok(out)
    }

    /// Sums `acc` (size × n values, one chunk of n per member) over the members in place: after
    /// the call chunk `pos` holds the sum of every member's chunk `pos`, added in a fixed order
    /// for a given ring size (the others hold partial sums). With `bf16` the chunks travel as
    /// bf16, each partial sum rounded before it is sent on.
    fn sum_chunks(&self, acc: &mut [f32], bf16: bool, what: &str) -> Result<()> {
        let (w, p) = (self.size(), self.pos);
        let n = acc.len() / w;
        let mut incoming = vec![0u8; n * if bf16 { 2 } else { 4 }];
        // Step s: send chunk (p-s-1), receive chunk (p-s-2) and add it.
        for s in 0..w - 1 {
            let send_idx = (p + 2 * w - s - 1) % w;
            let recv_idx = (p + 2 * w - s - 2) % w;
            let chunk = &acc[send_idx * n..(send_idx + 1) * n];
            let send = if bf16 {
                chunk
                    .iter()
                    .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                    .collect()
            } else {
                f32_bytes(chunk)
            };
            self.exchange(&send, &mut incoming, what, true)?;
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
        Ok(())
    }

    /// This member's chunk of the sum over members of `acc` (size × n values); rounded to bf16
    /// values with `bf16`.
    pub(super) fn reduce_scatter(&self, mut acc: Vec<f32>, bf16: bool) -> Result<Vec<f32>> {
        self.sum_chunks(&mut acc, bf16, "reduce-scatter")?;
        let n = acc.len() / self.size();
        let mut mine = acc[self.pos * n..(self.pos + 1) * n].to_vec();
        if bf16 {
            round_to_bf16(&mut mine);
        }
        Ok(mine)
    }

    /// The sum over members of `values` (any length), the same bits on every member: the
    /// reduce-scatter of [`Self::reduce_scatter`] over chunks padded to equal length, then the
    /// owners' sums gathered.
    pub(super) fn all_reduce(&self, mut values: Vec<f32>, bf16: bool) -> Result<Vec<f32>> {
        let (len, w, p) = (values.len(), self.size(), self.pos);
        let n = len.div_ceil(w);
        values.resize(n * w, 0.0);
        self.sum_chunks(&mut values, bf16, "all-reduce")?;
        let mut mine = values[p * n..(p + 1) * n].to_vec();
        let bytes = if bf16 {
            round_to_bf16(&mut mine);
            mine.iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect()
        } else {
            f32_bytes(&mine)
        };
        let all = self.all_gather(&bytes, "all-reduce", true)?;
        let mut out: Vec<f32> = if bf16 {
            all.chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect()
        } else {
            f32_from(&all)
        };
        out.truncate(len);
        Ok(out)
    }

    /// The root member's `bytes` on every member: around the ring from the root, every member
    /// but the last one forwarding what it received.
    pub(super) fn broadcast(&self, mut bytes: Vec<u8>, root: usize) -> Result<Vec<u8>> {
        let w = self.size();
        let hops = (self.pos + w - root) % w;
        if hops > 0 {
            (&self.prev)
                .read_exact(&mut bytes)
                .map_err(|e| self.ring_error(e, "broadcast"))?;
        }
        if hops < w - 1 {
            if let Some(nic) = self.nic.as_ref().filter(|_| self.across) {
                let at = nic.arrival(bytes.len());
                std::thread::sleep(at.saturating_duration_since(Instant::now()));
            }
            (&self.next)
                .write_all(&bytes)
                .map_err(|e| self.ring_error(e, "broadcast"))?;
            let c = if self.across {
                &self.counters.across
            } else {
                &self.counters.within
            };
            c.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        }
        Ok(bytes)
    }

    /// Every member's `values` combined in ring order (uncounted: host values).
    pub(super) fn host(&self, values: &[f64], op: ReduceOp) -> Result<Vec<f64>> {
        let bytes = self.all_gather(bytemuck::cast_slice(values), "all-reduce", false)?;
        let all: Vec<f64> = pod_vec(&bytes);
        let k = values.len();
        let mut out = all[..k].to_vec();
        for r in 1..self.size() {
            for (o, v) in out.iter_mut().zip(&all[r * k..(r + 1) * k]) {
                *o = op.apply(*o, *v);
            }
        }
        Ok(out)
    }
}

fn round_to_bf16(v: &mut [f32]) {
    for x in v {
        *x = half::bf16::from_f32(*x).to_f32();
    }
}
