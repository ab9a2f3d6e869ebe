//! Overlap and hybrid sharding (docs/distributed.md §4.6, §4.7, §8.1) on in-process ranks
//! connected by the TCP backend — its communication threads run beside the computation as in
//! a real run:
//!
//! - prefetching on gives the bits of prefetching off at 2, 3 and 4 ranks, in both shard
//!   modes, on both fixture models and both backends, with LoRA and in every memory mode, flat
//!   and in shard groups;
//! - shard groups train like one group within the sharded tolerance, and the groups' replicas
//!   stay the same bits;
//! - the bytes each rank sends in a step, by link, are those of the ring formulas.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::tests::{rel, values};
use super::ShardedTrainer;
use crate::test_support::{options, workspace};
use crate::{Backend, Storage, TrainOptions};
use vc_core::config::{Offload, OptimizerState, Recompute, ReduceDtype, Shard as ShardMode};
use vc_dist::shard::RowSplit;
use vc_dist::tcp::{Endpoint, TcpCollective};
use vc_dist::topology::{Groups, Nodes};
use vc_dist::{Collective, LinkBytes, Mesh};

const BACKENDS: [Backend; 2] = [Backend::Kernels, Backend::Autograd(Storage::Bf16)];

/// One run's setting.
#[derive(Clone, Copy, Debug)]
struct Run {
    model: &'static str,
    backend: Backend,
    mode: ShardMode,
    ranks: usize,
    group: usize,
    /// Ranks per node, for the link counters.
    per_node: usize,
    prefetch: usize,
}

/// Runs `f` on the ranks of `run`, each a thread with its own trainer on the workspace `ws`,
/// connected by TCP over loopback; `tweak` sets the options' memory modes.
fn on_tcp_ranks<T: Send>(
    run: Run,
    ws: &Path,
    tweak: &(dyn Fn(&mut TrainOptions) + Sync),
    f: impl Fn(&mut ShardedTrainer) -> T + Sync,
) -> Vec<T> {
    let listener = Arc::new(std::net::TcpListener::bind("127.0.0.1:0").unwrap());
    let port = listener.local_addr().unwrap().port();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..run.ranks)
            .map(|rank| {
                let (f, listener) = (&f, listener.clone());
                s.spawn(move || {
                    let mut ep = Endpoint::new(
                        rank,
                        run.ranks,
                        format!("127.0.0.1:{port}"),
                        Duration::from_secs(60),
                    );
                    ep.listener = (rank == 0).then_some(listener);
                    ep.nodes = Nodes {
                        ranks_per_node: run.per_node,
                    };
                    let groups = Groups::new(run.ranks, run.group).unwrap();
                    let m = TcpCollective::connect_mesh(&ep, Vec::new(), groups).unwrap();
                    let world: Arc<dyn Collective> = Arc::new(m.world);
                    let mesh = Mesh {
                        shard: match m.shard {
                            Some(s) => Arc::new(s),
                            None => world.clone(),
                        },
                        replicas: m.replicas.map(|r| Arc::new(r) as Arc<dyn Collective>),
                        world: world.clone(),
                    };
                    let mut opts = options(ws, run.model, run.backend, 3);
                    opts.config.prefetch = run.prefetch;
                    tweak(&mut opts);
                    let mut t = ShardedTrainer::new(opts, mesh, run.mode, "test".into(), false)
                        .expect("a sharded trainer");
                    let out = f(&mut t);
                    world.finish().unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    })
}

/// A tensor's rows on a rank: its name and the bits of its master and both moments.
type Rows = (String, Vec<u32>, Vec<u32>, Vec<u32>);

/// What a rank holds after some steps: each step's loss and gradient norm, and the bits of
/// every master and moment of its rows.
#[derive(Debug, PartialEq)]
struct Held {
    metrics: Vec<(u64, u64)>,
    state: Vec<Rows>,
}

fn bits(v: Vec<f32>) -> Vec<u32> {
    v.into_iter().map(f32::to_bits).collect()
}

/// `steps` optimizer steps, then what the rank holds.
fn train(t: &mut ShardedTrainer, steps: usize) -> Held {
    let metrics = (0..steps)
        .map(|_| {
            let micro = t.run.sampler.next_step(3);
            let m = t.step(&micro).unwrap();
            (m.loss.to_bits(), m.grad_norm.to_bits())
        })
        .collect();
    let state = t
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            (
                p.name.clone(),
                bits(values(&p.master().unwrap())),
                bits(values(&t.adam.m[i].decode().unwrap())),
                bits(values(&t.adam.v[i].decode().unwrap())),
            )
        })
        .collect();
    Held { metrics, state }
}

/// Prefetching on (`prefetch` units ahead) against off, bit for bit.
fn prefetch_changes_no_bit(
    run: Run,
    ws: &Path,
    tweak: &(dyn Fn(&mut TrainOptions) + Sync),
    prefetch: &[usize],
) {
    let plain = on_tcp_ranks(Run { prefetch: 0, ..run }, ws, tweak, |t| train(t, 2));
    for &prefetch in prefetch {
        let ahead = on_tcp_ranks(Run { prefetch, ..run }, ws, tweak, |t| train(t, 2));
        for (r, (a, p)) in ahead.iter().zip(&plain).enumerate() {
            assert!(
                a == p,
                "{run:?}, prefetch {prefetch}: rank {r} differs from prefetch 0"
            );
        }
    }
}

fn run(model: &'static str, backend: Backend, mode: ShardMode, ranks: usize) -> Run {
    Run {
        model,
        backend,
        mode,
        ranks,
        group: ranks,
        per_node: ranks,
        prefetch: 1,
    }
}

#[test]
fn prefetching_changes_no_bit_at_any_rank_count_mode_model_or_backend() {
    for model in ["tiny-0b6", "tiny-1b7"] {
        let dir = tempfile::tempdir().unwrap();
        workspace(dir.path(), model, 7);
        for backend in BACKENDS {
            for mode in [ShardMode::Full, ShardMode::GradOp] {
                for ranks in [2, 3, 4] {
                    let r = run(model, backend, mode, ranks);
                    prefetch_changes_no_bit(r, dir.path(), &|_| {}, &[1, 2]);
                }
            }
        }
    }
}

#[test]
fn prefetching_changes_no_bit_with_lora_or_any_memory_mode_flat_or_grouped() {
    let dir = tempfile::tempdir().unwrap();
    workspace(dir.path(), "tiny-0b6", 7);
    type Tweak = Box<dyn Fn(&mut TrainOptions) + Sync>;
    let tweaks: Vec<(&str, Tweak)> = vec![
        (
            "lora",
            Box::new(|o: &mut TrainOptions| {
                o.config.lora_rank = 4;
                o.config.lora_full = vec!["talker.codec_head.weight".into()];
            }),
        ),
        (
            "int8",
            Box::new(|o: &mut TrainOptions| o.config.optimizer_state = OptimizerState::Int8),
        ),
        (
            "bf16-compensated",
            Box::new(|o: &mut TrainOptions| {
                o.config.optimizer_state = OptimizerState::Bf16Compensated
            }),
        ),
        (
            "offload",
            Box::new(|o: &mut TrainOptions| o.config.offload = Offload::Optimizer),
        ),
        (
            "recompute",
            Box::new(|o: &mut TrainOptions| o.config.recompute = Recompute::Layers),
        ),
        (
            "reduce bf16",
            Box::new(|o: &mut TrainOptions| o.config.reduce_dtype = ReduceDtype::Bf16),
        ),
    ];
    for (k, (name, tweak)) in tweaks.iter().enumerate() {
        for (b, backend) in BACKENDS.into_iter().enumerate() {
            for (m, mode) in [ShardMode::Full, ShardMode::GradOp].into_iter().enumerate() {
                // Flat (3 ranks) and in groups (4 as 2 × 2) in turn: each setting meets both.
                let (ranks, group) = [(3, 3), (4, 2)][(k + b + m) % 2];
                eprintln!("{name} {backend:?} {mode:?} {ranks} ranks in groups of {group}");
                let r = Run {
                    group,
                    ..run("tiny-0b6", backend, mode, ranks)
                };
                prefetch_changes_no_bit(r, dir.path(), tweak.as_ref(), &[1]);
            }
        }
    }
}

/// The masters of every tensor, reassembled from the ranks of the first group.
fn masters(run: Run, ws: &Path, steps: usize) -> (Vec<(u64, u64)>, Vec<Vec<f32>>) {
    let held = on_tcp_ranks(run, ws, &|_| {}, |t| {
        let h = train(t, steps);
        let rows: Vec<_> = (0..t.params.len())
            .map(|i| t.splits[i].owned(t.shard_index()))
            .collect();
        (h, rows)
    });
    // The other groups hold the same bits: replicas stay replicas.
    for (r, (h, _)) in held.iter().enumerate().skip(run.group) {
        assert!(
            h == &held[r % run.group].0,
            "{run:?}: rank {r} is not a replica of rank {}",
            r % run.group
        );
    }
    let metrics = held[0].0.metrics.clone();
    let n = held[0].0.state.len();
    let full = (0..n)
        .map(|i| {
            let mut parts: Vec<_> = held[..run.group]
                .iter()
                .map(|(h, rows)| (rows[i].start, h.state[i].1.clone()))
                .collect();
            parts.sort_by_key(|p| p.0);
            parts
                .into_iter()
                .flat_map(|(_, b)| b.into_iter().map(f32::from_bits))
                .collect()
        })
        .collect();
    (metrics, full)
}

/// Shard groups train like one group of the same ranks within the sharded tolerance
/// (docs/distributed.md §9): 4 ranks as 2 × 2, 6 as 3 × 2 and 2 × 3, both modes, both
/// backends; every group's replica holds the same bits.
#[test]
fn shard_groups_train_like_one_group() {
    let dir = tempfile::tempdir().unwrap();
    workspace(dir.path(), "tiny-0b6", 7);
    for backend in BACKENDS {
        for mode in [ShardMode::Full, ShardMode::GradOp] {
            for (ranks, group) in [(4, 2), (6, 3), (6, 2)] {
                let flat = run("tiny-0b6", backend, mode, ranks);
                let (fm, fw) = masters(flat, dir.path(), 2);
                let (hm, hw) = masters(Run { group, ..flat }, dir.path(), 2);
                let tag = format!("{backend:?} {mode:?} {ranks} ranks in groups of {group}");
                for ((hl, hg), (fl, fg)) in hm.iter().zip(&fm) {
                    for (h, f) in [(hl, fl), (hg, fg)] {
                        let (h, f) = (f64::from_bits(*h), f64::from_bits(*f));
                        assert!((h - f).abs() <= 1e-5 * f.abs(), "{tag}: {h} vs {f}");
                    }
                }
                let worst = hw
                    .iter()
                    .zip(&fw)
                    .map(|(h, f)| rel(h, f))
                    .fold(0f64, f64::max);
                eprintln!("{tag}: masters within {worst:.1e} of one group's");
                assert!(worst <= 1e-5, "{tag}: masters differ by {worst:e}");
            }
        }
    }
}

/// The bytes the ring collectives of one step send, by link, for one rank
/// (docs/distributed.md §8.1): per unit two gathers (`full`; one with grad-op, whose replicas are refreshed) and a
/// reduce-scatter within the group of S, and with G groups an all-reduce of the unit's flat
/// shard across them; the text rows' gather and reduction within the group (the largest
/// number any rank of the group owns, padded) and the all-reduce of this rank's rows across
/// groups; grad-op gathers the whole table after the update. Each ring sends to its next
/// member: within the node or across.
fn formula(t: &ShardedTrainer, text_ids: &[u32], per_node: usize) -> LinkBytes {
    let (rank, world, s) = (t.rank(), t.world(), t.group_size());
    let groups = Groups::new(world, s).unwrap();
    let g = groups.count();
    let storage = t.storage.size_in_bytes() as u64;
    let reduce = crate::reduce_dtype(t.run.opts.config.reduce_dtype).size_in_bytes() as u64;
    let (s64, g64) = (s as u64, g as u64);
    let (mut group_bytes, mut replica_bytes) = (0u64, 0u64);
    let gathers = match t.mode {
        ShardMode::Full => 2,
        ShardMode::GradOp => 1,
    };
    for u in &t.units {
        let n = u.layout.shard_len as u64;
        if n == 0 {
            continue;
        }
        group_bytes += (s64 - 1) * n * (gathers * storage + reduce);
        replica_bytes += 2 * (g64 - 1) * n.div_ceil(g64) * reduce;
    }
    if let Some(text) = t.text {
        let split = RowSplit::new(t.shapes[text][0], s);
        let width = t.shapes[text][1] as u64;
        let owned = |q: usize| {
            let own = split.owned(q);
            text_ids
                .iter()
                .filter(|&&i| own.contains(&(i as usize)))
                .count() as u64
        };
        let kmax = (0..s).map(owned).max().unwrap();
        group_bytes += (s64 - 1) * kmax * width * (storage + reduce);
        let mine = owned(t.shard_index());
        if mine > 0 {
            replica_bytes += 2 * (g64 - 1) * (mine * width).div_ceil(g64) * reduce;
        }
        if t.mode == ShardMode::GradOp {
            group_bytes += (s64 - 1) * t.text_layout(text).shard_len as u64 * storage;
        }
    }
    let node = |r: usize| r / per_node;
    let next = |ranks: Vec<usize>| {
        let p = ranks.iter().position(|&r| r == rank).unwrap();
        ranks[(p + 1) % ranks.len()]
    };
    let mut out = LinkBytes::default();
    for (bytes, next) in [
        (group_bytes, next(groups.members(rank))),
        (replica_bytes, next(groups.replicas(rank))),
    ] {
        if node(next) == node(rank) {
            out.within_node += bytes;
        } else {
            out.across_nodes += bytes;
        }
    }
    out
}

/// What every rank sends in a step equals the formula, flat and in groups, in both modes and on
/// both backends (f32 and bf16 storage), on nodes of 2 ranks; the step's metrics report the
/// most any rank sent.
#[test]
fn the_bytes_sent_per_link_are_those_of_the_ring_formulas() {
    let dir = tempfile::tempdir().unwrap();
    workspace(dir.path(), "tiny-0b6", 7);
    for backend in BACKENDS {
        for mode in [ShardMode::Full, ShardMode::GradOp] {
            for (ranks, group) in [(4, 4), (4, 2), (6, 3), (4, 1)] {
                let r = Run {
                    group,
                    per_node: 2,
                    ..run("tiny-0b6", backend, mode, ranks)
                };
                let out = on_tcp_ranks(r, dir.path(), &|_| {}, |t| {
                    let micro = t.run.sampler.next_step(3);
                    let ids = t.step_text_ids(&t.run.dataset, &micro);
                    let want = formula(t, &ids, 2);
                    let before = t.sent();
                    let m = t.step(&micro).unwrap();
                    let got = t.sent() - before;
                    (want, got, m.sent_within_node, m.sent_across_nodes)
                });
                let tag = format!("{backend:?} {mode:?} {ranks} ranks in groups of {group}");
                for (rank, (want, got, _, _)) in out.iter().enumerate() {
                    assert_eq!(got, want, "{tag}: rank {rank}");
                }
                let most = |f: fn(&LinkBytes) -> u64| out.iter().map(|o| f(&o.1)).max();
                for (_, _, within, across) in &out {
                    assert_eq!(*within, most(|b| b.within_node), "{tag}");
                    assert_eq!(*across, most(|b| b.across_nodes), "{tag}");
                }
                eprintln!(
                    "{tag}: rank 0 sent {:?}, the formula {:?}",
                    out[0].1, out[0].0
                );
            }
        }
    }
}
