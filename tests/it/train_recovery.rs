//! Interrupted `voiceclone train` and `voiceclone export` runs and the next run's recovery
//! (docs/training.md §7.2, §8 and §10): runs stopped by SIGTERM or killed by SIGKILL in the
//! middle of a checkpoint write resume to bit-identical weights, a non-finite loss stops without
//! saving the broken step, an export killed while it replaces `model/` is repaired by the next
//! run, and a damaged newest checkpoint is moved aside and training continues from the one
//! before. Most runs are paused or broken at a chosen point through the `test-hooks` build.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};

use crate::train_cli::{latest, metrics, ok, state, train, workspace, TRAIN};
use crate::train_support::{command, read_raw, text, voiceclone};

/// Spawns `voiceclone train` with `env`, reading stderr until a line contains `marker`.
fn spawn_until(ws: &Path, extra: &[&str], env: (&str, &str), marker: &str) -> Child {
    let mut args = vec!["train"];
    args.extend_from_slice(TRAIN);
    args.extend_from_slice(extra);
    let mut child = command(ws, &args)
        .env(env.0, env.1)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let mut seen = Vec::new();
    loop {
        match lines.next() {
            Some(Ok(l)) => {
                if l.contains(marker) {
                    break;
                }
                seen.push(l);
            }
            _ => panic!("the run ended before {marker:?}: {seen:?}"),
        }
    }
    // Keep draining stderr so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    child
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: plain kill(2) on our own child process.
    let rc = unsafe { libc::kill(child.id() as i32, sig) };
    assert_eq!(rc, 0);
}

fn masters(ws: &Path, step: usize) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    state(ws, step)
}

#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn stopped_and_killed_runs_resume_bit_identically() {
    let args = ["--max-steps", "8", "--lr", "5e-3", "--warmup-steps", "2"];
    // The uninterrupted reference.
    let a = workspace(6);
    let mut full: Vec<&str> = args.to_vec();
    full.extend(["--save-every", "4"]);
    ok(&train(a.path(), &full));
    let reference = masters(a.path(), 8);
    assert!(reference.keys().any(|k| k.starts_with("exp_avg_sq.")));

    // SIGTERM after step 3: the run saves step 3 and stops; resuming reaches the same state.
    let b = workspace(6);
    let child = spawn_until(
        b.path(),
        &full,
        ("VOICECLONE_TEST_PAUSE_AFTER_STEP", "3"),
        "paused after step 3",
    );
    // Meanwhile a second run in the same workspace is refused.
    let o = train(b.path(), &full);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("another `voiceclone train`"),
        "{}",
        text(&o)
    );
    signal(&child, libc::SIGTERM);
    let out = child.wait_with_output().unwrap();
    assert!(
        !out.status.success(),
        "an interrupted run must not report success"
    );
    assert_eq!(latest(b.path()), "step-0000003");
    assert_eq!(metrics(b.path()).len(), 3);
    let o = train(b.path(), &full);
    ok(&o);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("resuming from checkpoints/step-0000003"),
        "{}",
        text(&o)
    );
    assert!(
        masters(b.path(), 8) == reference,
        "SIGTERM + resume differs from an uninterrupted run"
    );
    let (mb, ma) = (metrics(b.path()), metrics(a.path()));
    assert_eq!(mb.len(), 8);
    for (x, y) in mb.iter().zip(&ma) {
        assert_eq!(x["loss"], y["loss"]);
        assert_eq!(x["grad_norm"], y["grad_norm"]);
    }

    // SIGKILL while step 4's checkpoint is being written: step 2 stays the latest complete one.
    let c = workspace(6);
    let mut every2: Vec<&str> = args.to_vec();
    every2.extend(["--save-every", "2"]);
    let child = spawn_until(
        c.path(),
        &every2,
        ("VOICECLONE_TEST_PAUSE_IN_CHECKPOINT_WRITE", "4"),
        "paused in checkpoint write at step 4",
    );
    signal(&child, libc::SIGKILL);
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    assert_eq!(latest(c.path()), "step-0000002");
    let partial: Vec<PathBuf> = std::fs::read_dir(c.path().join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(".tmp-step-0000004")
        })
        .collect();
    assert_eq!(
        partial.len(),
        1,
        "the interrupted write left its temporary directory"
    );
    assert!(!c.path().join("checkpoints/step-0000004").exists());
    let o = train(c.path(), &every2);
    ok(&o);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("resuming from checkpoints/step-0000002"),
        "{}",
        text(&o)
    );
    assert!(
        !partial[0].exists(),
        "the partial checkpoint was not cleaned up"
    );
    assert!(
        masters(c.path(), 8) == reference,
        "SIGKILL + resume differs from an uninterrupted run"
    );

    // SIGKILL while step 4 is saved a second time (a crash before `latest` was updated made the
    // run resume from step 2), in the moment its first copy is moved aside: that copy is put
    // back, nothing is lost, and the run still ends where an uninterrupted one does.
    let d = workspace(6);
    let with_max = |n: &'static str| -> Vec<&str> {
        let mut v = vec!["--max-steps", n, "--no-export"];
        v.extend(&every2[2..]);
        v
    };
    assert_eq!(&every2[..2], ["--max-steps", "8"]);
    let four = with_max("4");
    ok(&train(d.path(), &four));
    let first_save = state(d.path(), 4);
    std::fs::write(d.path().join("checkpoints/latest"), "step-0000002\n").unwrap();
    let child = spawn_until(
        d.path(),
        &every2,
        ("VOICECLONE_TEST_PAUSE_IN_CHECKPOINT_WRITE", "4:old-aside"),
        "paused in checkpoint write at step 4 (old-aside)",
    );
    signal(&child, libc::SIGKILL);
    assert!(!child.wait_with_output().unwrap().status.success());
    let names = || -> Vec<String> {
        std::fs::read_dir(d.path().join("checkpoints"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    };
    assert!(!d.path().join("checkpoints/step-0000004").exists());
    assert!(
        names().iter().any(|n| n.starts_with(".old-step-0000004")),
        "{:?}",
        names()
    );
    ok(&train(d.path(), &with_max("2")));
    assert!(
        state(d.path(), 4) == first_save,
        "the checkpoint moved aside was not restored"
    );
    assert!(!names().iter().any(|n| n.starts_with('.')), "{:?}", names());
    ok(&train(d.path(), &every2));
    assert!(
        masters(d.path(), 8) == reference,
        "a crash while re-saving changed the result"
    );
}

#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn a_non_finite_loss_stops_without_saving_the_broken_step() {
    let ws = workspace(6);
    let ws = ws.path();
    let o = command(
        ws,
        &[
            "train",
            "--batch-size",
            "3",
            "--grad-accum",
            "2",
            "--max-steps",
            "5",
            "--save-every",
            "2",
        ],
    )
    .env("VOICECLONE_TEST_NAN_AT_STEP", "3")
    .output()
    .unwrap();
    assert!(!o.status.success());
    let t = text(&o);
    assert!(t.contains("the loss became NaN at step 3"), "{t}");
    assert!(
        t.contains("step-0000002") && t.contains("lower train.lr"),
        "{t}"
    );
    assert_eq!(latest(ws), "step-0000002");
    assert!(!ws.join("checkpoints/step-0000003").exists());
    assert_eq!(metrics(ws).len(), 2);
    // Resuming continues from step 2.
    let o = command(
        ws,
        &[
            "train",
            "--batch-size",
            "3",
            "--grad-accum",
            "2",
            "--max-steps",
            "3",
            "--no-export",
        ],
    )
    .output()
    .unwrap();
    ok(&o);
    assert_eq!(latest(ws), "step-0000003");
    assert!(!ws.join("model").exists(), "--no-export exported");
}

/// Runs `voiceclone ARGS` in `ws` until the test hook pauses it at `point`, then SIGKILLs it.
fn kill_at_point(ws: &Path, args: &[&str], point: &str) {
    let mut child = command(ws, args)
        .env("VOICECLONE_TEST_PAUSE_AT_POINT", point)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = child.stderr.take().unwrap();
    let mut seen = String::new();
    for line in BufReader::new(err).lines() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if line.contains(&format!("paused at {point}")) {
            child.kill().unwrap();
            break;
        }
    }
    let status = child.wait().unwrap();
    assert!(!status.success(), "never paused at {point}:\n{seen}");
}

/// What is left next to `model/` besides it.
fn export_leftovers(ws: &Path) -> Vec<String> {
    std::fs::read_dir(ws)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".model."))
        .collect()
}

/// An export killed while it replaces `model/`: between its two renames (no `model/` at all)
/// the next `speak` puts the previous export back instead of quietly falling back to the base
/// model; after them, the next export removes the previous one's copy.
#[test]
#[cfg_attr(not(feature = "test-hooks"), ignore = "needs --features test-hooks")]
fn an_export_killed_while_replacing_model_is_repaired_by_the_next_run() {
    let ws = workspace(6);
    ok(&train(ws.path(), &["--max-steps", "2"]));
    let model = ws.path().join("model");
    let config = std::fs::read(model.join("config.json")).unwrap();

    kill_at_point(ws.path(), &["export"], "export-old-aside");
    assert!(!model.exists());
    // The complete new export and the previous one moved aside.
    assert_eq!(
        export_leftovers(ws.path()).len(),
        2,
        "{:?}",
        export_leftovers(ws.path())
    );
    let out = ws.path().join("out.wav");
    let o = voiceclone(
        ws.path(),
        &[
            "speak",
            "Hello.",
            "-o",
            out.to_str().unwrap(),
            "--greedy",
            "--max-frames",
            "3",
        ],
    );
    ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("finished an export that was interrupted"),
        "{err}"
    );
    assert_eq!(std::fs::read(model.join("config.json")).unwrap(), config);
    assert!(export_leftovers(ws.path()).is_empty());

    kill_at_point(ws.path(), &["export"], "export-in-place");
    assert!(model.join("config.json").is_file());
    assert_eq!(export_leftovers(ws.path()).len(), 1);
    let o = voiceclone(ws.path(), &["export"]);
    ok(&o);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("removed"),
        "{}",
        text(&o)
    );
    assert!(
        export_leftovers(ws.path()).is_empty(),
        "{:?}",
        export_leftovers(ws.path())
    );
}

/// A rank file's tensors, raw: name → (dtype, shape, bytes).
type RankFile = BTreeMap<String, (String, Vec<usize>, Vec<u8>)>;

/// Every rank file of a checkpoint, raw.
fn every_rank(ws: &Path, step: usize) -> Vec<RankFile> {
    let dir = ws.join(format!("checkpoints/step-{step:07}"));
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("rank-")
        })
        .collect();
    files.sort();
    assert!(!files.is_empty());
    files.iter().map(|f| read_raw(f)).collect()
}

/// A damaged newest checkpoint — a truncated rank file, a garbled or missing `index.json` — is
/// moved aside with a warning naming it and why, and training continues from the newest whole
/// checkpoint to the uninterrupted result (it once stopped with an error, or for a missing
/// index fell back silently). Single-device and sharded.
#[test]
fn a_damaged_newest_checkpoint_is_moved_aside_and_training_continues_from_the_one_before() {
    let args = [
        "--max-steps",
        "6",
        "--save-every",
        "2",
        "--keep",
        "5",
        "--lr",
        "5e-3",
        "--warmup-steps",
        "2",
    ];
    type Damage = fn(&Path);
    let damages: [(&str, Damage); 3] = [
        ("truncated", |d| {
            let f = d.join("rank-00000.safetensors");
            let len = std::fs::metadata(&f).unwrap().len();
            let file = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
            file.set_len(len / 2).unwrap();
        }),
        ("not a voiceclone checkpoint index", |d| {
            std::fs::write(d.join("index.json"), "{\"format\": garbled").unwrap()
        }),
        ("has no index.json", |d| {
            std::fs::remove_file(d.join("index.json")).unwrap()
        }),
    ];
    for ranks in [None, Some("2")] {
        let mut full: Vec<&str> = args.to_vec();
        if let Some(n) = ranks {
            full.extend(["--cpu-ranks", n]);
        }
        let reference = workspace(6);
        ok(&train(reference.path(), &full));
        let want = every_rank(reference.path(), 6);
        for (why, damage) in damages {
            let ws = workspace(6);
            let mut first = full.clone();
            first[1] = "4";
            ok(&train(ws.path(), &first));
            damage(&ws.path().join("checkpoints/step-0000004"));
            let o = train(ws.path(), &full);
            ok(&o);
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(
                err.contains("checkpoints/step-0000004 is damaged") && err.contains(why),
                "{ranks:?} {why}: {err}"
            );
            assert!(
                String::from_utf8_lossy(&o.stdout)
                    .contains("resuming from checkpoints/step-0000002"),
                "{}",
                text(&o)
            );
            // Kept, not deleted; the run ends as the uninterrupted one did.
            assert!(ws.path().join("checkpoints/.damaged-step-0000004").is_dir());
            assert!(
                every_rank(ws.path(), 6) == want,
                "{ranks:?} {why}: the run differs"
            );
        }
    }
}
