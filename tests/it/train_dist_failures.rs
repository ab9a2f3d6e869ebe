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
            // SAFETY: kill(2) takes plain integers and touches no memory of ours.
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
        |child, _| {
            // SAFETY: kill(2) takes plain integers and touches no memory of ours.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
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
    let port = free_ports(1);
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

/// Where a rank can die while a checkpoint of 3 ranks is written, and the hook that stops it
/// there: (what, environment, marker of the pause).
const SAVE_KILL_POINTS: &[(&str, &str, &str, &str)] = &[
    (
        "rank 1, its file written",
        "VOICECLONE_TEST_PAUSE_AFTER_RANK_FILE",
        "4:1",
        "rank 1 paused after writing its file of step 4",
    ),
    (
        "rank 0, its file written",
        "VOICECLONE_TEST_PAUSE_AFTER_RANK_FILE",
        "4:0",
        "rank 0 paused after writing its file of step 4",
    ),
    (
        "rank 0, every rank file written",
        "VOICECLONE_TEST_PAUSE_IN_CHECKPOINT_WRITE",
        "4:rank-files",
        "paused in checkpoint write at step 4 (rank-files)",
    ),
    (
        "rank 0, index written",
        "VOICECLONE_TEST_PAUSE_IN_CHECKPOINT_WRITE",
        "4:index",
        "paused in checkpoint write at step 4 (index)",
    ),
    (
        "rank 0, directory in place, latest not yet",
        "VOICECLONE_TEST_PAUSE_IN_CHECKPOINT_WRITE",
        "4:in-place",
        "paused in checkpoint write at step 4 (in-place)",
    ),
    (
        "rank 0, latest written, not pruned",
        "VOICECLONE_TEST_PAUSE_IN_CHECKPOINT_WRITE",
        "4:latest",
        "paused in checkpoint write at step 4 (latest)",
    ),
];

/// Runs `args` until the hook `(var, value)` pauses a rank at `marker`, SIGKILLs that rank, and
/// checks the run failed naming a rank.
fn kill_at(ws: &std::path::Path, args: &[&str], var: &str, value: &str, marker: &str) {
    let (err, status, took) = run_until(ws, args, &[(var, value)], marker, |_, line| {
        signal_pid_in(line, libc::SIGKILL)
    });
    assert!(!status.success(), "{err}");
    assert!(err.contains("was killed by signal 9"), "{err}");
    assert!(took < std::time::Duration::from_secs(40), "{took:?}");
    no_orphans(ws);
}

#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn a_rank_killed_anywhere_in_a_save_resumes_to_the_uninterrupted_result() {
    let model = "tiny-0b6";
    let args = [
        "--max-steps",
        "6",
        "--save-every",
        "2",
        "--keep",
        "3",
        "--cpu-ranks",
        "3",
    ];
    let full = workspace(model);
    ok(&train(full.path(), &args));
    let want = state(full.path(), 6);
    let check = |ws: &std::path::Path, what: &str| {
        let o = train(ws, &args);
        ok(&o);
        assert!(
            state(ws, 6) == want,
            "killed at {what}: the resumed run differs"
        );
        assert_eq!(metrics(ws), metrics(full.path()), "killed at {what}");
        let left: Vec<String> = std::fs::read_dir(ws.join("checkpoints"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".tmp-") || n.starts_with(".old-"))
            .collect();
        assert!(left.is_empty(), "killed at {what}: left {left:?}");
    };
    for (what, var, value, marker) in SAVE_KILL_POINTS {
        let ws = workspace(model);
        kill_at(ws.path(), &args, var, value, marker);
        check(ws.path(), what);
    }
    // A re-save of step 4 (after a kill with its directory in place but `latest` still naming
    // step 2) killed while the old step-4 directory is moved aside.
    let ws = workspace(model);
    kill_at(
        ws.path(),
        &args,
        "VOICECLONE_TEST_PAUSE_IN_CHECKPOINT_WRITE",
        "4:in-place",
        "paused in checkpoint write at step 4 (in-place)",
    );
    kill_at(
        ws.path(),
        &args,
        "VOICECLONE_TEST_PAUSE_IN_CHECKPOINT_WRITE",
        "4:old-aside",
        "paused in checkpoint write at step 4 (old-aside)",
    );
    check(ws.path(), "a re-save, old directory moved aside");
}

#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn max_restarts_restarts_a_killed_rank_and_finishes_like_an_uninterrupted_run() {
    let model = "tiny-0b6";
    let args = ["--max-steps", "6", "--save-every", "2", "--cpu-ranks", "3"];
    let full = workspace(model);
    ok(&train(full.path(), &args));
    let ws = workspace(model);
    let mut restarting = args.to_vec();
    restarting.extend(["--max-restarts", "1"]);
    let (err, status, _) = run_until(
        ws.path(),
        &restarting,
        &[
            ("VOICECLONE_TEST_PAUSE_AT_STEP", "4:1"),
            ("VOICECLONE_TEST_FIRST_ATTEMPT_ONLY", "1"),
        ],
        "rank 1 paused at step 4",
        |_, line| signal_pid_in(line, libc::SIGKILL),
    );
    assert!(status.success(), "{err}");
    assert!(
        err.contains("rank 1 was killed by signal 9")
            && err.contains(
                "restarting every rank from the last complete checkpoint (restart 1 of 1)"
            ),
        "{err}"
    );
    assert!(
        state(ws.path(), 6) == state(full.path(), 6),
        "the restarted run differs from the uninterrupted one"
    );
    assert_eq!(metrics(ws.path()), metrics(full.path()));
    no_orphans(ws.path());

    // A failure that a restart would only repeat is not restarted.
    let ws = workspace(model);
    let mut a = vec!["train"];
    a.extend_from_slice(BASE);
    a.extend([
        "--max-steps",
        "6",
        "--cpu-ranks",
        "2",
        "--max-restarts",
        "2",
    ]);
    let o = command(ws.path(), &a)
        .env("VOICECLONE_TEST_NAN_AT_STEP", "2")
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("the loss became NaN at step 2"), "{err}");
    assert!(!err.contains("restarting every rank"), "{err}");
}

/// A failure that repeats without progress is restarted once, not until the restarts run out:
/// the launcher compares what failed and where (the rank, the kind of error, the step), not the
/// message, which names each attempt's own temporary checkpoint directory
/// (docs/distributed.md §5.1). Here rank 0's disk is full whenever it writes checkpoint 2.
#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn a_checkpoint_write_that_fails_every_time_is_restarted_once() {
    let ws = workspace("tiny-0b6");
    let mut a = vec!["train"];
    a.extend_from_slice(BASE);
    a.extend([
        "--max-steps",
        "3",
        "--save-every",
        "1",
        "--cpu-ranks",
        "2",
        "--max-restarts",
        "3",
    ]);
    let o = command(ws.path(), &a)
        .env("VOICECLONE_TEST_DISK_FULL_AT_CHECKPOINT", "2:0")
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("No space left on device") && err.contains(".tmp-step-0000002-"),
        "{err}"
    );
    assert!(
        err.contains("restart 1 of 3") && !err.contains("restart 2 of 3"),
        "{err}"
    );
    assert!(
        err.contains("failed the same way again (the same rank, kind of error and step)"),
        "{err}"
    );
    // Step 1's checkpoint is whole and named by `latest`.
    let latest = std::fs::read_to_string(ws.path().join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), "step-0000001");
    no_orphans(ws.path());
}

#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn a_stopped_rank_ends_the_run_within_the_timeout_naming_it() {
    let model = "tiny-0b6";
    let ws = tempfile::tempdir().unwrap();
    make_workspace(
        ws.path(),
        model,
        &synthetic_rows(7, 21),
        &xvector(hidden(model), 3),
        "[train]\ndist_timeout = 6",
    );
    let (err, status, took) = run_until(
        ws.path(),
        &["--max-steps", "6", "--cpu-ranks", "3"],
        &[("VOICECLONE_TEST_PAUSE_AT_STEP", "2:2")],
        "rank 2 paused at step 2",
        |_, line| signal_pid_in(line, libc::SIGSTOP),
    );
    assert!(!status.success());
    assert!(
        err.contains("rank 2 stopped responding")
            && err.contains("rank 2 did not stop after the failure and was killed"),
        "{err}"
    );
    assert!(
        took < std::time::Duration::from_secs(6 + 30),
        "the run took {took:?} to end"
    );
    eprintln!("a stopped rank ended the run after {took:?}:\n{err}");
    no_orphans(ws.path());
}
