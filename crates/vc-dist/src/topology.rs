//! Where the ranks of a run are (docs/distributed.md §4.7, §8): which node each rank runs on,
//! which ranks shard their state together (a shard group) and which hold the same shard
//! (replicas), and, for benchmarks and tests, a network emulated between CPU ranks that share
//! one machine.
//!
//! Ranks are numbered node by node (torchrun, Slurm and our launcher all do), so a node, like a
//! shard group, is a block of consecutive ranks.

use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};

/// The environment variable that turns on the emulated network ([`Emulation`]).
pub const EMULATE_NETWORK: &str = "VOICECLONE_EMULATE_NETWORK";

/// Nodes of `ranks_per_node` consecutive ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nodes {
    pub ranks_per_node: usize,
}

impl Nodes {
    /// Every rank on one node.
    pub fn single(world: usize) -> Self {
        Self {
            ranks_per_node: world.max(1),
        }
    }

    pub fn node(&self, rank: usize) -> usize {
        rank / self.ranks_per_node.max(1)
    }

    pub fn same_node(&self, a: usize, b: usize) -> bool {
        self.node(a) == self.node(b)
    }
}

/// Shard groups of `size` consecutive ranks (docs/distributed.md §4.7): a group shards the
/// weights, gradients and optimizer state among its ranks; the groups hold replicas of one
/// another. `size == world` is one group: every rank shards with every other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Groups {
    pub world: usize,
    pub size: usize,
}

impl Groups {
    /// Groups of `size` ranks out of `world`; `size` must divide `world`.
    pub fn new(world: usize, size: usize) -> Result<Self> {
        ensure!(
            size >= 1 && size <= world && world.is_multiple_of(size),
            "a shard group of {size} ranks does not divide the {world} ranks of the run into \
             equal groups (train.shard_group)"
        );
        Ok(Self { world, size })
    }

    /// One group of every rank (flat sharding).
    pub fn flat(world: usize) -> Self {
        Self { world, size: world }
    }

    pub fn count(&self) -> usize {
        self.world / self.size
    }

    /// The group rank `rank` belongs to.
    pub fn group(&self, rank: usize) -> usize {
        rank / self.size
    }

    /// Rank `rank`'s place in its group: which shard it holds.
    pub fn index(&self, rank: usize) -> usize {
        rank % self.size
    }

    /// The ranks of `rank`'s group, in order.
    pub fn members(&self, rank: usize) -> Vec<usize> {
        let g = self.group(rank);
        (g * self.size..(g + 1) * self.size).collect()
    }

    /// The ranks holding the same shard as `rank` (one per group, `rank` among them), in order.
    pub fn replicas(&self, rank: usize) -> Vec<usize> {
        let i = self.index(rank);
        (0..self.count()).map(|g| g * self.size + i).collect()
    }
}

/// A network between nodes emulated on one machine (docs/distributed.md §8.3): CPU ranks are
/// taken to run on nodes of `ranks_per_node`, and what a rank sends to another node leaves
/// through a link of its own of the given bandwidth and latency (as one NIC per GPU), while
/// traffic within a node is left as it is. A benchmark and test setting, off unless
/// [`EMULATE_NETWORK`] is set, e.g. `ranks-per-node=2,bandwidth=1gbit,latency=200us`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Emulation {
    pub ranks_per_node: usize,
    pub bytes_per_second: f64,
    pub latency: Duration,
}

impl Emulation {
    /// The emulation [`EMULATE_NETWORK`] asks for, if it is set.
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var(EMULATE_NETWORK) {
            Ok(v) if !v.trim().is_empty() => Self::parse(&v)
                .with_context(|| format!("environment variable {EMULATE_NETWORK}={v:?}"))
                .map(Some),
            _ => Ok(None),
        }
    }

    /// Parses `ranks-per-node=N,bandwidth=B,latency=L`: B with a unit of `gbit`, `mbit`,
    /// `gbyte` or `mbyte` (per second), L with `us`, `ms` or `s`.
    pub fn parse(spec: &str) -> Result<Self> {
        let (mut nodes, mut bw, mut lat) = (None, None, None);
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((k, v)) = part.split_once('=') else {
                bail!("{part:?} is not KEY=VALUE");
            };
            let v = v.trim();
            match k.trim() {
                "ranks-per-node" => {
                    let n: usize = v
                        .parse()
                        .with_context(|| format!("ranks-per-node={v:?} is not a number"))?;
                    ensure!(n >= 1, "ranks-per-node must be at least 1");
                    nodes = Some(n);
                }
                "bandwidth" => bw = Some(parse_bandwidth(v)?),
                "latency" => lat = Some(parse_duration(v)?),
                other => {
                    bail!("unknown key {other:?} (expected ranks-per-node, bandwidth and latency)")
                }
            }
        }
        Ok(Self {
            ranks_per_node: nodes.context("ranks-per-node is missing")?,
            bytes_per_second: bw.context("bandwidth is missing")?,
            latency: lat.unwrap_or(Duration::ZERO),
        })
    }

    /// The time `bytes` take to leave through the emulated link.
    pub fn transfer_time(&self, bytes: usize) -> Duration {
        Duration::from_secs_f64(bytes as f64 / self.bytes_per_second)
    }
}

fn parse_bandwidth(v: &str) -> Result<f64> {
    let lower = v.to_ascii_lowercase();
    let units = [
        ("gbit", 1e9 / 8.0),
        ("mbit", 1e6 / 8.0),
        ("gbyte", 1e9),
        ("mbyte", 1e6),
    ];
    for (unit, scale) in units {
        if let Some(n) = lower.strip_suffix(unit) {
            let n: f64 = n
                .trim()
                .parse()
                .with_context(|| format!("bandwidth {v:?} is not a number of {unit}"))?;
            ensure!(
                n.is_finite() && n > 0.0,
                "bandwidth {v:?} must be above zero"
            );
            return Ok(n * scale);
        }
    }
    bail!("bandwidth {v:?} needs a unit: gbit, mbit, gbyte or mbyte (per second)")
}

fn parse_duration(v: &str) -> Result<Duration> {
    let lower = v.to_ascii_lowercase();
    for (unit, scale) in [("us", 1e-6), ("ms", 1e-3), ("s", 1.0)] {
        if let Some(n) = lower.strip_suffix(unit) {
            let n: f64 = n
                .trim()
                .parse()
                .with_context(|| format!("latency {v:?} is not a number of {unit}"))?;
            ensure!(
                n.is_finite() && n >= 0.0,
                "latency {v:?} must not be negative"
            );
            return Ok(Duration::from_secs_f64(n * scale));
        }
    }
    bail!("latency {v:?} needs a unit: us, ms or s")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_and_replicas_partition_the_ranks() {
        let g = Groups::new(6, 3).unwrap();
        assert_eq!(g.count(), 2);
        assert_eq!(g.members(4), vec![3, 4, 5]);
        assert_eq!(g.replicas(4), vec![1, 4]);
        assert_eq!((g.group(4), g.index(4)), (1, 1));
        assert_eq!(Groups::new(6, 2).unwrap().replicas(1), vec![1, 3, 5]);
        assert_eq!(Groups::flat(4).replicas(2), vec![2]);
        let e = Groups::new(6, 4).unwrap_err().to_string();
        assert!(e.contains("train.shard_group"), "{e}");
        assert!(Groups::new(4, 0).is_err());
        let n = Nodes { ranks_per_node: 2 };
        assert!(n.same_node(2, 3) && !n.same_node(1, 2));
    }

    #[test]
    fn emulated_networks_are_parsed_with_units() {
        let e = Emulation::parse("ranks-per-node=2, bandwidth=1gbit, latency=200us").unwrap();
        assert_eq!(e.ranks_per_node, 2);
        assert_eq!(e.bytes_per_second, 125e6);
        assert_eq!(e.latency, Duration::from_micros(200));
        assert_eq!(e.transfer_time(125_000_000), Duration::from_secs(1));
        let e = Emulation::parse("bandwidth=2.5GByte,ranks-per-node=4").unwrap();
        assert_eq!((e.bytes_per_second, e.latency), (2.5e9, Duration::ZERO));
        for bad in [
            "bandwidth=1gbit",
            "ranks-per-node=2,bandwidth=1",
            "ranks-per-node=2,bandwidth=0gbit",
            "ranks-per-node=2,bandwidth=1gbit,latency=5",
            "ranks-per-node=2,bandwidth=1gbit,jitter=1ms",
            "ranks-per-node=0,bandwidth=1gbit",
        ] {
            assert!(Emulation::parse(bad).is_err(), "{bad}");
        }
    }
}
