//! Tests of the TCP collectives: ranks on threads connected over loopback, checked against the
//! collectives' definitions, an abort reaching every rank, and a rendezvous that times out
//! naming the missing rank. A file of its own to keep [`super`] to the ring and its collectives.

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
