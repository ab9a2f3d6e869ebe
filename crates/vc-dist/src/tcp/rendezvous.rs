//! Joining a run over TCP (docs/distributed.md §3.3): rank 0 listens on the master address;
//! every other rank connects (retrying until the timeout, since rank 0 may start later), says
//! who it is, how it groups the ranks and where its ring listener is; rank 0 answers everyone
//! with the address table and an optional payload (the NCCL unique ids), and keeps the
//! connections as the control plane. Then every rank connects the rings it is a member of — the
//! whole world's, and under hybrid sharding its shard group's and its replicas' (docs/distributed.md §4.7) — to the
//! next member's listener and accepts the previous member of each.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::control::{recv_msg, send_msg, Control, Hello, Welcome, HELLO, WELCOME};
use super::ring::{Counters, Nic, Ring};
use super::Endpoint;
use crate::topology::Groups;

/// Which ring a connection belongs to (its first byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RingKind {
    World = 0,
    Shard = 1,
    Replicas = 2,
}

/// What joining gives a rank: the control plane, its rings, and rank 0's payload.
pub(super) struct Joined {
    pub(super) control: Arc<Control>,
    pub(super) rings: Vec<(RingKind, Ring)>,
    pub(super) payload: Vec<u8>,
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

/// The rings `rank` is a member of (with more than one member), and their members in order.
fn rings_of(rank: usize, groups: &Groups) -> Vec<(RingKind, Vec<usize>)> {
    let mut out = Vec::new();
    if groups.world > 1 {
        out.push((RingKind::World, (0..groups.world).collect()));
    }
    // A group of every rank is the world's ring; groups of one rank shard nothing, and their
    // replicas are the whole world.
    if groups.size > 1 && groups.size < groups.world {
        out.push((RingKind::Shard, groups.members(rank)));
        out.push((RingKind::Replicas, groups.replicas(rank)));
    }
    out
}

/// Rank 0's side of the rendezvous: every rank's greeting, then the welcome to all.
fn meet_as_root(
    ep: &Endpoint,
    groups: &Groups,
    ring_port: u16,
    payload: Vec<u8>,
    deadline: Instant,
) -> Result<(Vec<Option<TcpStream>>, Welcome)> {
    let secs = ep.timeout.as_secs();
    let listener = match &ep.listener {
        Some(l) => l.try_clone().context("the rendezvous socket")?,
        None => TcpListener::bind(bind_addr(&ep.master)?)
            .with_context(|| format!("rank 0 cannot listen on {} for the rendezvous", ep.master))?,
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
        if hello.group != groups.size {
            bail!(
                "rank {} shards in groups of {} ranks, rank 0 in groups of {} (train.shard_group \
                 must be the same on every rank)",
                hello.rank,
                hello.group,
                groups.size
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
    Ok((links, welcome))
}

/// Another rank's side: its greeting to rank 0, and rank 0's welcome.
fn meet_as_member(
    ep: &Endpoint,
    groups: &Groups,
    ring_port: u16,
    deadline: Instant,
) -> Result<(Vec<Option<TcpStream>>, Welcome)> {
    let secs = ep.timeout.as_secs();
    let s = connect_until(&ep.master, deadline).with_context(|| {
        format!(
            "rank {} cannot reach rank 0 at {} for the rendezvous (timeout {secs} s)",
            ep.rank, ep.master
        )
    })?;
    let hello = Hello {
        rank: ep.rank,
        world: ep.world,
        group: groups.size,
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
            "rank {}: the rendezvous at {} did not complete within {secs} s (are all {} ranks \
             started?)",
            ep.rank, ep.master, ep.world
        )
    })?;
    anyhow::ensure!(
        kind == WELCOME,
        "unexpected message {kind} at the rendezvous"
    );
    Ok((vec![Some(s)], serde_json::from_slice(&body)?))
}

/// Joins the run at `ep` with shard groups `groups`: the rendezvous, then the rings.
pub(super) fn join(ep: &Endpoint, payload: Vec<u8>, groups: &Groups) -> Result<Joined> {
    anyhow::ensure!(
        ep.world >= 1 && ep.rank < ep.world && groups.world == ep.world,
        "rank {} is not in a world of {}",
        ep.rank,
        ep.world
    );
    let deadline = Instant::now() + ep.timeout;
    let secs = ep.timeout.as_secs();
    let ring_listener = TcpListener::bind("0.0.0.0:0").context("cannot open a ring port")?;
    let ring_port = ring_listener.local_addr()?.port();
    let (links, welcome) = if ep.rank == 0 {
        meet_as_root(ep, groups, ring_port, payload, deadline)?
    } else {
        meet_as_member(ep, groups, ring_port, deadline)?
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
    // Connect to the next member of every ring first (a listener queues the connection until
    // it is accepted), then accept the previous member of each.
    let specs = rings_of(ep.rank, groups);
    let mut nexts = Vec::with_capacity(specs.len());
    for (kind, members) in &specs {
        let pos = members
            .iter()
            .position(|&r| r == ep.rank)
            .expect("a member");
        let next = members[(pos + 1) % members.len()];
        let s = connect_until(&welcome.ring[next], deadline)
            .with_context(|| format!("rank {} cannot reach rank {next}", ep.rank))?;
        let mut hello = vec![*kind as u8];
        hello.extend_from_slice(&(ep.rank as u32).to_le_bytes());
        (&s).write_all(&hello)?;
        nexts.push(s);
    }
    let mut prevs: Vec<Option<TcpStream>> = (0..specs.len()).map(|_| None).collect();
    for _ in 0..specs.len() {
        let Some((prev, _)) = accept_until(&ring_listener, deadline, &|| None)? else {
            let waiting: Vec<String> = specs
                .iter()
                .zip(&prevs)
                .filter(|(_, p)| p.is_none())
                .map(|((_, m), _)| {
                    let pos = m.iter().position(|&r| r == ep.rank).expect("a member");
                    m[(pos + m.len() - 1) % m.len()].to_string()
                })
                .collect();
            bail!(
                "rank {}: rank(s) {} did not connect to its rings within {secs} s",
                ep.rank,
                waiting.join(", ")
            );
        };
        prev.set_read_timeout(Some(ep.timeout))?;
        let mut who = [0u8; 5];
        (&prev).read_exact(&mut who)?;
        let from = u32::from_le_bytes([who[1], who[2], who[3], who[4]]) as usize;
        let slot = specs.iter().position(|(k, _)| *k as u8 == who[0]);
        let Some(slot) = slot.filter(|&i| prevs[i].is_none()) else {
            bail!(
                "rank {}: rank {from} connected to a ring it does not share",
                ep.rank
            );
        };
        let m = &specs[slot].1;
        let pos = m.iter().position(|&r| r == ep.rank).expect("a member");
        let expected = m[(pos + m.len() - 1) % m.len()];
        anyhow::ensure!(
            from == expected,
            "rank {}: expected rank {expected} on a ring, got rank {from}",
            ep.rank
        );
        prevs[slot] = Some(prev);
    }
    let nic = ep.emulation.map(|e| Arc::new(Nic::new(e)));
    let mut rings = Vec::with_capacity(specs.len());
    for (((kind, members), next), prev) in specs.into_iter().zip(nexts).zip(prevs) {
        let prev = prev.expect("every ring accepted");
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
        let pos = members
            .iter()
            .position(|&r| r == ep.rank)
            .expect("a member");
        let next_rank = members[(pos + 1) % members.len()];
        rings.push((
            kind,
            Ring {
                across: !ep.nodes.same_node(ep.rank, next_rank),
                members,
                pos,
                next,
                prev,
                control: control.clone(),
                timeout: ep.timeout,
                counters: Arc::new(Counters::default()),
                nic: nic.clone(),
            },
        ));
    }
    Ok(Joined {
        control,
        rings,
        payload: welcome.payload,
    })
}
