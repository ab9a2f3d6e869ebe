//! Sharded runs started by other launchers (docs/distributed.md §5): torchrun's environment,
//! the real torchrun, and the Ray launcher (`scripts/launchers/ray_train.py`).

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
    let port = free_ports(1);
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

/// The real torchrun (Debian's CPU build of PyTorch, installed by the test-asset script).
const TORCHRUN: &str = "/usr/bin/torchrun";

/// `torchrun … voiceclone --workdir WS train BASE extra` for 2 CPU ranks on this machine.
fn torchrun(ws: &std::path::Path, extra: &[&str]) -> std::process::Command {
    let port = two_free_ports();
    let mut c = std::process::Command::new(TORCHRUN);
    // `--no_python`: the entry point is a program, not a Python script. `-r 1 -t 2`: torch 1.13
    // on Python 3.11 cannot parse its own default of no redirection (Std.NONE is no longer
    // iterated), so stdout goes to the log directory and stderr is also shown.
    c.args(["--nproc_per_node", "2", "--no_python", "-r", "1", "-t", "2"])
        .arg("--log_dir")
        .arg(ws.join("torchrun-logs"))
        .args(["--master_addr", "127.0.0.1", "--master_port"])
        .arg(port.to_string())
        .args(extra.iter().take_while(|a| **a != "--"))
        .arg(env!("CARGO_BIN_EXE_voiceclone"))
        .arg("--workdir")
        .arg(ws)
        .arg("train")
        .args(BASE)
        .args(extra.iter().skip_while(|a| **a != "--").skip(1))
        .args(["--cpu-ranks", "2"])
        .env_remove("RUST_LOG");
    for v in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        c.env_remove(v);
    }
    c
}

#[test]
fn the_real_torchrun_equals_cpu_ranks() {
    if !crate::common::have_tool(std::path::Path::new(TORCHRUN), "Debian's python3-torch") {
        return;
    }
    let model = "tiny-0b6";
    let args = ["--max-steps", "3", "--save-every", "3"];
    let ours = workspace(model);
    let mut a = args.to_vec();
    a.extend(["--cpu-ranks", "2"]);
    ok(&train(ours.path(), &a));
    let ws = workspace(model);
    let mut extra = vec!["--"];
    extra.extend(args);
    let o = torchrun(ws.path(), &extra).output().unwrap();
    ok(&o);
    assert!(
        state(ws.path(), 3) == state(ours.path(), 3),
        "torchrun differs from --cpu-ranks 2"
    );
    assert_eq!(metrics(ws.path()), metrics(ours.path()));
}

#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn a_torchrun_restart_resumes_from_the_last_checkpoint() {
    if !crate::common::have_tool(std::path::Path::new(TORCHRUN), "Debian's python3-torch") {
        return;
    }
    let model = "tiny-0b6";
    let args = ["--max-steps", "6", "--save-every", "2"];
    let full = workspace(model);
    let mut a = args.to_vec();
    a.extend(["--cpu-ranks", "2"]);
    ok(&train(full.path(), &a));
    let ws = workspace(model);
    let mut extra = vec!["--max_restarts", "1", "--"];
    extra.extend(args);
    let mut cmd = torchrun(ws.path(), &extra);
    cmd.env("VOICECLONE_TEST_PAUSE_AT_STEP", "4:1")
        .env("VOICECLONE_TEST_FIRST_ATTEMPT_ONLY", "1");
    let (err, status, _) = run_command_until(cmd, "rank 1 paused at step 4", |_, line| {
        signal_pid_in(line, libc::SIGKILL)
    });
    assert!(status.success(), "{err}");
    // torchrun restarted the ranks (its second attempt's logs), which continued from the last
    // checkpoint; rank 0's standard output is in torchrun's log directory.
    let logs = files_under(&ws.path().join("torchrun-logs"));
    assert!(
        logs.iter()
            .any(|p| p.to_string_lossy().contains("attempt_1")),
        "no second attempt: {logs:?}\n{err}"
    );
    assert!(
        logs.iter().any(|p| std::fs::read_to_string(p)
            .is_ok_and(|t| t.contains("resuming from checkpoints/step-0000002"))),
        "the restarted ranks did not resume: {err}"
    );
    assert!(
        state(ws.path(), 6) == state(full.path(), 6),
        "the run torchrun restarted differs from the uninterrupted one"
    );
    assert_eq!(metrics(ws.path()), metrics(full.path()));
}

/// Every file under `dir`.
fn files_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.path().is_dir() {
                out.extend(files_under(&e.path()));
            } else {
                out.push(e.path());
            }
        }
    }
    out
}

/// A Ray cluster on this machine for the length of a test (`ray start --head`), stopped when
/// dropped.
struct RayCluster {
    python: std::path::PathBuf,
    address: String,
}

impl RayCluster {
    fn start() -> Option<Self> {
        let venv = crate::common::assets().join("venv/bin");
        if !crate::common::have_tool(&venv.join("ray"), "the ray package") {
            return None;
        }
        let port = two_free_ports();
        let o = std::process::Command::new(venv.join("ray"))
            .args([
                "start",
                "--head",
                "--num-cpus",
                "2",
                "--include-dashboard=false",
            ])
            .arg("--disable-usage-stats")
            .arg(format!("--port={port}"))
            .output()
            .unwrap();
        assert!(o.status.success(), "ray start: {}", text(&o));
        Some(Self {
            python: venv.join("python"),
            address: format!("127.0.0.1:{port}"),
        })
    }

    /// `scripts/launchers/ray_train.py` with 2 CPU workers running `voiceclone --workdir WS train BASE
    /// args`, after `options`.
    fn train(
        &self,
        ws: &std::path::Path,
        options: &[&str],
        args: &[&str],
    ) -> std::process::Command {
        let mut c = std::process::Command::new(&self.python);
        c.arg(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/launchers/ray_train.py"),
        )
        .args(["--address", &self.address, "--workers", "2", "--cpu"])
        .arg("--voiceclone")
        .arg(env!("CARGO_BIN_EXE_voiceclone"))
        .args(options)
        .arg("--")
        .arg("--workdir")
        .arg(ws)
        .arg("train")
        .args(BASE)
        .args(args)
        .env_remove("RUST_LOG");
        c
    }
}

impl Drop for RayCluster {
    fn drop(&mut self) {
        let ray = self.python.with_file_name("ray");
        let _ = std::process::Command::new(ray)
            .args(["stop", "--force"])
            .output();
    }
}

#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn the_ray_launcher_equals_cpu_ranks_and_restarts_a_killed_rank() {
    let Some(ray) = RayCluster::start() else {
        return;
    };
    let model = "tiny-0b6";
    let args = ["--max-steps", "6", "--save-every", "2"];
    let ours = workspace(model);
    let mut a = args.to_vec();
    a.extend(["--cpu-ranks", "2"]);
    ok(&train(ours.path(), &a));

    let ws = workspace(model);
    let o = ray.train(ws.path(), &[], &args).output().unwrap();
    ok(&o);
    assert!(
        state(ws.path(), 6) == state(ours.path(), 6),
        "the Ray launch differs from --cpu-ranks 2"
    );
    assert_eq!(metrics(ws.path()), metrics(ours.path()));

    // A rank killed in the first attempt: Ray reports the failure, the script starts every
    // rank again (--max-restarts), and the run finishes as the uninterrupted one did.
    let ws = workspace(model);
    let mut cmd = ray.train(ws.path(), &["--max-restarts", "1"], &args);
    cmd.env("VOICECLONE_TEST_PAUSE_AT_STEP", "4:1")
        .env("VOICECLONE_TEST_FIRST_ATTEMPT_ONLY", "1");
    let (err, status, _) = run_command_until(cmd, "rank 1 paused at step 4", |_, line| {
        signal_pid_in(line, libc::SIGKILL)
    });
    assert!(status.success(), "{err}");
    assert!(
        err.contains("restarting every rank from the last complete checkpoint (restart 1 of 1)"),
        "{err}"
    );
    assert!(
        state(ws.path(), 6) == state(ours.path(), 6),
        "the run Ray restarted differs from the uninterrupted one"
    );
}
