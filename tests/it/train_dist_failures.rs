//! Sharded runs that fail (docs/distributed.md §3.4, §5): a rank that panics, is killed, stops
//! responding or dies in the middle of a checkpoint; signals to the launcher; restarts.

use crate::dist_support::*;

#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn a_failing_rank_stops_every_rank() {
    let model = "tiny-0b6";
    let args = ["--max-steps", "6", "--cpu-ranks", "3"];
    // A rank that panics in the middle of a step.
    let ws = workspace(model);
    let started = std::time::Instant::now();
    let mut a = vec!["train"];
    a.extend_from_slice(BASE);
    a.extend_from_slice(&args);
    let o = command(ws.path(), &a)
        .env("VOICECLONE_TEST_PANIC_AT_STEP", "2:1")
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("error: rank 1 failed: rank 1 panicked") && err.contains("panics at step 2"),
        "{err}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
    no_orphans(ws.path());

    // A rank killed with SIGKILL.
    let ws = workspace(model);
    let (err, status, took) = run_until(
        ws.path(),
        &args,
        &[("VOICECLONE_TEST_PAUSE_AT_STEP", "2:2")],
        "rank 2 paused at step 2",
        |_, line| {
            let pid: i32 = line
                .rsplit("(pid ")
                .next()
                .and_then(|s| s.trim_end_matches(')').parse().ok())
                .unwrap();
            unsafe { libc::kill(pid, libc::SIGKILL) };
        },
    );
    assert!(!status.success());
    assert!(
        err.contains("error: rank 2 was killed by signal 9"),
        "{err}"
    );
    assert!(
        took < std::time::Duration::from_secs(30),
        "the run took {took:?} to stop"
    );
    no_orphans(ws.path());
}

#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn sigterm_to_the_launcher_saves_and_the_run_resumes_exactly() {
    let model = "tiny-0b6";
    let args = ["--max-steps", "6", "--save-every", "6", "--cpu-ranks", "2"];
    let full = workspace(model);
    ok(&train(full.path(), &args));
    let ws = workspace(model);
    let (err, status, took) = run_until(
        ws.path(),
        &args,
        &[("VOICECLONE_TEST_PAUSE_AFTER_STEP", "3")],
        "paused after step 3",
        |child, _| unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        },
    );
    assert!(
        !status.success(),
        "an interrupted run must not report success"
    );
    assert!(
        err.contains("training interrupted after step 3 of 6"),
        "{err}"
    );
    assert!(took < std::time::Duration::from_secs(30));
    no_orphans(ws.path());
    assert_eq!(
        std::fs::read_to_string(ws.path().join("checkpoints/latest"))
            .unwrap()
            .trim(),
        "step-0000003"
    );
    ok(&train(ws.path(), &args));
    assert!(
        state(ws.path(), 6) == state(full.path(), 6),
        "SIGTERM + resume differs"
    );
}

#[test]
fn a_rendezvous_with_a_missing_rank_times_out_naming_it() {
    let ws = tempfile::tempdir().unwrap();
    make_workspace(
        ws.path(),
        "tiny-0b6",
        &synthetic_rows(7, 21),
        &xvector(hidden("tiny-0b6"), 3),
        "[train]\ndist_timeout = 3",
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let started = std::time::Instant::now();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let mut a = vec!["train"];
            a.extend_from_slice(BASE);
            let mut c = command(ws.path(), &a);
            c.env("RANK", rank.to_string())
                .env("WORLD_SIZE", "3")
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", (port - 1).to_string());
            c.spawn_output()
        })
        .collect();
    let outs: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    for (rank, o) in outs.iter().enumerate() {
        assert!(!o.status.success(), "rank {rank}");
    }
    let err0 = String::from_utf8_lossy(&outs[0].stderr);
    assert!(
        err0.contains(&format!("127.0.0.1:{port}")) && err0.contains("rank(s) 2 never connected"),
        "{err0}"
    );
    let err1 = String::from_utf8_lossy(&outs[1].stderr);
    assert!(err1.contains("rank 1"), "{err1}");
}
