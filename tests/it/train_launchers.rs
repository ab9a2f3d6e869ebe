//! Sharded runs started by other launchers (docs/distributed.md §5): torchrun's environment,
//! the real torchrun, and the Ray launcher (`scripts/ray_train.py`).

use crate::dist_support::*;

#[test]
fn a_torchrun_launch_equals_cpu_ranks() {
    let model = "tiny-0b6";
    let ours = workspace(model);
    ok(&train(
        ours.path(),
        &["--max-steps", "3", "--save-every", "3", "--cpu-ranks", "2"],
    ));
    let ws = workspace(model);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let mut a = vec!["train"];
            a.extend_from_slice(BASE);
            a.extend(["--max-steps", "3", "--save-every", "3"]);
            let mut c = command(ws.path(), &a);
            // As torchrun sets them; the rendezvous uses MASTER_PORT + 1.
            c.env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", (port - 1).to_string());
            c.spawn_output()
        })
        .collect();
    for (rank, h) in ranks.into_iter().enumerate() {
        let o = h.join().unwrap();
        assert!(o.status.success(), "rank {rank}: {}", text(&o));
    }
    assert!(
        state(ws.path(), 3) == state(ours.path(), 3),
        "torchrun-style launch differs"
    );
    assert_eq!(metrics(ws.path()), metrics(ours.path()));
}
