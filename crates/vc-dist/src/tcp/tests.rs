//! Tests of the TCP collectives: ranks on threads connected over loopback, checked against the
//! collectives' definitions (flat and in shard groups), started collectives overlapping the
//! caller's work, an abort reaching every rank and failing what it had started, the bytes
//! counted per link, the emulated network's pace, and a rendezvous that times out naming the
//! missing rank.

use super::*;

/// A rendezvous socket bound before any rank starts, as our launcher binds it (a port
/// chosen and released first could be taken by a parallel test), and its port.
fn bound_rendezvous() -> (Arc<TcpListener>, u16) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    (Arc::new(l), port)
}

/// Runs `f` on `world` ranks (threads) connected over loopback in shard groups of `group`,
/// on nodes of `per_node` ranks, the network between them emulated as `emulation` says.
fn run_mesh<T: Send>(
    world: usize,
    group: usize,
    per_node: usize,
    emulation: Option<&str>,
    f: impl Fn(TcpMesh) -> T + Sync,
) -> Vec<T> {
    let (listener, port) = bound_rendezvous();
    let emulation = emulation.map(|e| Emulation::parse(e).unwrap());
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let f = &f;
                let listener = listener.clone();
                s.spawn(move || {
                    let mut ep = Endpoint::new(
                        rank,
                        world,
                        format!("127.0.0.1:{port}"),
                        Duration::from_secs(20),
                    );
                    ep.listener = (rank == 0).then_some(listener);
                    ep.nodes = Nodes {
                        ranks_per_node: per_node,
                    };
                    ep.emulation = emulation;
                    let groups = Groups::new(world, group).unwrap();
                    let m = TcpCollective::connect_mesh(&ep, b"hello".to_vec(), groups).unwrap();
                    assert_eq!(m.world.payload(), b"hello");
                    f(m)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Runs `f` on `world` ranks (threads) connected over loopback, one group, one node.
fn run<T: Send>(world: usize, f: impl Fn(TcpCollective) -> T + Sync) -> Vec<T> {
    run_mesh(world, world, world, None, |m| f(m.world))
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
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
    let ep = |rank| {
        let mut ep = Endpoint::new(rank, 3, format!("127.0.0.1:{port}"), Duration::from_secs(2));
        ep.listener = (rank == 0).then(|| listener.clone());
        ep
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

/// Sums over ranks agree with their definitions: all-reduce of any length (not a multiple of
/// the ranks), in f32 exactly and in bf16 as bf16-rounded partial sums, the same bits on every
/// rank; and collectives started together and waited for later give what they give waited
/// for one by one, in the order they were started.
#[test]
fn all_reduces_and_started_collectives_agree_with_their_definitions() {
    for world in [1usize, 2, 3, 4] {
        let out = run(world, |c| {
            let r = c.rank() as f32;
            let t = Tensor::from_vec(
                (0..7).map(|i| i as f32 + 0.25 * r).collect::<Vec<_>>(),
                7,
                &Device::Cpu,
            )
            .unwrap();
            let f32_sum = values(&c.all_reduce(&t).unwrap());
            let b = c.all_reduce(&t.to_dtype(DType::BF16).unwrap()).unwrap();
            assert_eq!(b.dtype(), DType::BF16);
            // Three collectives in flight at once, then waited for in reverse.
            let shard = Tensor::new(&[[r, -r]], &Device::Cpu).unwrap();
            let full = Tensor::from_vec(
                (0..2 * world)
                    .map(|i| i as f32 * (r + 1.0))
                    .collect::<Vec<_>>(),
                (world, 2),
                &Device::Cpu,
            )
            .unwrap();
            let g = c.start_all_gather(&shard).unwrap();
            let rs = c.start_reduce_scatter(&full).unwrap();
            let ar = c.start_all_reduce(&t).unwrap();
            let host = c.all_reduce_host(&[1.0], ReduceOp::Sum).unwrap();
            let (ar, rs, g) = (ar.wait().unwrap(), rs.wait().unwrap(), g.wait().unwrap());
            assert_eq!(values(&ar), f32_sum);
            assert_eq!(values(&g), values(&c.all_gather(&shard).unwrap()));
            assert_eq!(values(&rs), values(&c.reduce_scatter(&full).unwrap()));
            assert_eq!(host, vec![world as f64]);
            c.finish().unwrap();
            (f32_sum, values(&b))
        });
        let want: Vec<f32> = (0..7)
            .map(|i| (0..world).map(|q| i as f32 + 0.25 * q as f32).sum())
            .collect();
        for (rank, (f, b)) in out.iter().enumerate() {
            assert_eq!(f, &want, "world {world} rank {rank}");
            assert_eq!(
                b, &out[0].1,
                "world {world}: every rank gets the same bf16 bits"
            );
            for (x, y) in b.iter().zip(&want) {
                assert!((x - y).abs() <= y.abs() / 64.0, "world {world}: {x} vs {y}");
            }
        }
    }
}

/// Hybrid groups: 6 ranks as 2 groups of 3 and as 3 groups of 2. The group's communicator
/// gathers within the group, the replicas' sums across groups; the bytes each rank sends are
/// counted by the node they go to (nodes of 3 ranks) and equal the ring formulas.
#[test]
fn shard_groups_gather_within_and_sum_across_and_count_their_bytes() {
    for group in [3usize, 2] {
        let count = 6 / group;
        let out = run_mesh(6, group, 3, None, |m| {
            let (shard, replicas) = (m.shard.unwrap(), Arc::new(m.replicas.unwrap()));
            assert_eq!((shard.world(), replicas.world()), (group, count));
            let rank = m.world.rank();
            let mine = Tensor::new(&[rank as f32; 4], &Device::Cpu).unwrap();
            let gathered = values(&shard.all_gather(&mine.reshape((1, 4)).unwrap()).unwrap());
            let summed = values(&replicas.all_reduce(&mine).unwrap());
            let host = m
                .world
                .all_reduce_host(&[rank as f64], ReduceOp::Sum)
                .unwrap();
            let sent = shard.sent() + replicas.sent();
            // The group's reduce-scatter chained to the replicas' all-reduce on the rings'
            // threads gives the two one after the other, in f32 and bf16.
            let full = Tensor::from_vec(
                (0..group * 3)
                    .map(|i| (i + 7 * rank) as f32 * 0.37)
                    .collect::<Vec<_>>(),
                (group, 3),
                &Device::Cpu,
            )
            .unwrap();
            for t in [full.clone(), full.to_dtype(DType::BF16).unwrap()] {
                let across: Arc<dyn Collective> = replicas.clone();
                let chained = shard.start_reduce_scatter_across(&t, across).unwrap();
                let stepwise = replicas
                    .all_reduce(&shard.reduce_scatter(&t).unwrap())
                    .unwrap();
                let chained = chained.wait().unwrap();
                assert_eq!(chained.dtype(), t.dtype());
                assert_eq!(values(&chained), values(&stepwise), "rank {rank}");
            }
            m.world.finish().unwrap();
            (gathered, summed, host, sent)
        });
        for (rank, (gathered, summed, host, sent)) in out.into_iter().enumerate() {
            let g = rank / group;
            let want: Vec<f32> = (g * group..(g + 1) * group)
                .flat_map(|q| [q as f32; 4])
                .collect();
            assert_eq!(gathered, want, "group {group} rank {rank}");
            let same: f32 = (0..count).map(|k| (k * group + rank % group) as f32).sum();
            assert_eq!(summed, vec![same; 4], "group {group} rank {rank}");
            assert_eq!(host, vec![15.0]);
            // All-gather: group−1 chunks of 16 bytes; all-reduce over `count` ranks of 4
            // values: 2·(count−1) chunks of ceil(4/count) f32 values.
            let gather = (group as u64 - 1) * 16;
            let reduce = 2 * (count as u64 - 1) * 4u64.div_ceil(count as u64) * 4;
            // The next member of the group ring and of the replicas' ring: on this node?
            let members = Groups::new(6, group).unwrap();
            let node = |r: usize| r / 3;
            let next_in = |ranks: Vec<usize>| {
                let p = ranks.iter().position(|&r| r == rank).unwrap();
                ranks[(p + 1) % ranks.len()]
            };
            let mut want = LinkBytes::default();
            for (bytes, next) in [
                (gather, next_in(members.members(rank))),
                (reduce, next_in(members.replicas(rank))),
            ] {
                if node(next) == node(rank) {
                    want.within_node += bytes;
                } else {
                    want.across_nodes += bytes;
                }
            }
            assert_eq!(sent, want, "group {group} rank {rank}");
        }
    }
}

/// A collective started before the caller computes runs during the computation: over an
/// emulated link of 80 Mbit/s, gathering 1 MB per rank across two nodes takes about 100 ms,
/// and starting it before 100 ms of work ends both in about 100 ms, not 200. Without starting
/// first the same work and gather take their sum.
#[test]
fn started_collectives_run_while_the_caller_computes_on_an_emulated_network() {
    let emulation = "ranks-per-node=1,bandwidth=80mbit,latency=1ms";
    let work = Duration::from_millis(100);
    let out = run_mesh(2, 2, 1, Some(emulation), |m| {
        let c = m.world;
        let shard = Tensor::zeros((1, 250_000), DType::F32, &Device::Cpu).unwrap();
        c.barrier().unwrap();
        let t0 = Instant::now();
        c.all_gather(&shard).unwrap();
        let alone = t0.elapsed();
        c.barrier().unwrap();
        let t0 = Instant::now();
        std::thread::sleep(work);
        c.all_gather(&shard).unwrap();
        let serial = t0.elapsed();
        c.barrier().unwrap();
        let t0 = Instant::now();
        let p = c.start_all_gather(&shard).unwrap();
        std::thread::sleep(work);
        p.wait().unwrap();
        let overlapped = t0.elapsed();
        let sent = c.sent();
        c.finish().unwrap();
        (alone, serial, overlapped, sent)
    });
    for (rank, (alone, serial, overlapped, sent)) in out.into_iter().enumerate() {
        eprintln!(
            "rank {rank}: gather {alone:?}, after work {serial:?}, started first {overlapped:?}"
        );
        assert!(
            alone >= Duration::from_millis(95),
            "rank {rank}: paced {alone:?}"
        );
        assert!(
            serial >= work + Duration::from_millis(95),
            "rank {rank}: {serial:?}"
        );
        assert!(
            overlapped < work + alone / 2,
            "rank {rank}: started first {overlapped:?}, work {work:?}, gather {alone:?}"
        );
        assert_eq!(sent.across_nodes, 3 * 1_000_000, "rank {rank}");
        assert_eq!(sent.within_node, 0);
    }
}

/// An abort fails every collective a rank had started, the one running and those queued behind
/// it, promptly.
#[test]
fn an_abort_fails_every_started_collective() {
    let out = run_mesh(4, 2, 4, None, |m| {
        let c = m.world;
        let t = Tensor::ones((1, 8), DType::F32, &Device::Cpu).unwrap();
        if c.rank() == 3 {
            std::thread::sleep(Duration::from_millis(200));
            c.abort("rank 3 failed: out of memory");
            return (true, c.aborted(), Duration::ZERO);
        }
        let started = Instant::now();
        // Rank 3 joins neither: the first blocks until the abort, the second is queued behind.
        let running = c.start_all_gather(&t).unwrap();
        let queued = c.start_all_reduce(&t).unwrap();
        let failed = running.wait().is_err() && queued.wait().is_err();
        (failed, c.aborted(), started.elapsed())
    });
    for (rank, (failed, why, took)) in out.into_iter().enumerate() {
        assert!(failed, "rank {rank}");
        assert_eq!(
            why.as_deref(),
            Some("rank 3 failed: out of memory"),
            "rank {rank}"
        );
        assert!(took < Duration::from_secs(10), "rank {rank} took {took:?}");
    }
}
