//! Unit tests of the sharded step, on in-process worlds of ranks (threads sharing memory,
//! `vc_dist::local`): each concern against a world of one rank, which computes the single-device
//! result through the same code.

use std::path::Path;

use candle_core::{DType, Device, Tensor};

use super::{Pass, ShardedTrainer, PREDICTOR_CHUNK_FRAMES};
use crate::checkpoint::RowReader;
use crate::test_support::{options, workspace};
use crate::{Backend, Storage};
use vc_core::config::Shard as ShardMode;
use vc_dist::local::Local;
use vc_dist::shard::RowSplit;

const BACKENDS: [Backend; 2] = [Backend::Kernels, Backend::Autograd(Storage::Bf16)];

/// Runs `f` on every rank of a new world of `n` ranks, each with its own trainer on the
/// workspace `ws`; returns the ranks' results in rank order.
fn on_ranks<T: Send>(
    n: usize,
    ws: &Path,
    model: &str,
    backend: Backend,
    mode: ShardMode,
    f: impl Fn(&mut ShardedTrainer) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|s| {
        let hs: Vec<_> = Local::mesh(n, n)
            .unwrap()
            .into_iter()
            .map(|mesh| {
                let f = &f;
                s.spawn(move || {
                    let opts = options(ws, model, backend, 3);
                    let mut t = ShardedTrainer::new(opts, mesh, mode, "test".into(), false)
                        .expect("a sharded trainer");
                    f(&mut t)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    })
}

pub(super) fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// max |a − b| / max(max |b|, 1e-12).
pub(super) fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max);
    let s = b.iter().map(|y| y.abs() as f64).fold(0.0, f64::max);
    d / s.max(1e-12)
}

/// ‖a − b‖ / ‖b‖ (Frobenius): the relative error of a whole gradient.
fn rel_norm(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let s: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (d / s.max(1e-24)).sqrt()
}

/// One step's pass on every rank: (its rows of every gradient, the loss sum).
/// The next step's inputs on this rank: its micro-batches, their text rows, the step's batches.
#[allow(clippy::type_complexity)]
fn next_inputs(t: &mut ShardedTrainer) -> (Vec<super::Micro>, Option<Tensor>, Vec<Vec<usize>>) {
    let micro = t.run.sampler.next_step(3);
    let text_ids = t.step_text_ids(&t.run.dataset, &micro);
    let mine: Vec<_> = (0..micro.len())
        .filter(|i| i % t.world() == t.rank())
        .map(|i| {
            t.build_micro(i, &t.run.dataset, &micro[i], &text_ids)
                .unwrap()
        })
        .collect();
    let rows = t.text.map(|i| t.gather_text_rows(i, &text_ids).unwrap());
    (mine, rows, micro)
}

/// A pass's gradients (this rank's rows of each, empty where there is none) and loss sum.
type Grads = (Vec<Vec<f32>>, f64);

fn flat(p: Pass) -> Grads {
    let g = p
        .grads
        .iter()
        .map(|g| g.as_ref().map(values).unwrap_or_default())
        .collect();
    (g, p.sums.loss)
}

fn passes(n: usize, ws: &Path, backend: Backend, mode: ShardMode) -> Vec<(Vec<Vec<f32>>, f64)> {
    on_ranks(n, ws, "tiny-0b6", backend, mode, |t| {
        let (mine, rows, micro) = next_inputs(t);
        flat(match mode {
            ShardMode::Full => t.full_pass(&mine, rows.as_ref(), &micro, 0).unwrap(),
            ShardMode::GradOp => t.grad_op_pass(&mine, rows.as_ref(), &micro, 0).unwrap(),
        })
    })
}

/// Recomputing (docs/training.md §6.7) changes no gradient beyond rounding: on the same
/// trainer, the recomputing pass over the replicas gives the gradients of the grad-op pass
/// (one rank and two), and the `full` pass of a world of one — what a one-device run with
/// `recompute = "layers"` takes — those of one rank's grad-op pass. Both with the code
/// predictor recomputed in one chunk per utterance and in chunks of 4 frames (2 to 4 per
/// utterance of the fixture). In f32 (the CPU kernels, autograd with f32 storage) the whole
/// gradient is within 1e-6 relative (‖Δ‖ / ‖g‖) and every tensor within 4e-6 of its largest
/// element (the worst are 8-element norm weights, whose gradient sums many terms of both
/// signs: 1.2e-6 measured on an AVX2 machine, 2.2e-6 on an AVX-512 one, whose matrix kernels
/// sum in another order). With bf16 storage a gradient is rounded to bf16 once per backward it comes out of:
/// a tensor read by two units (the code predictor's codec embeddings: by the embeddings unit,
/// for the talker's input, and by the code predictor) once per unit, the code predictor's
/// weights once per chunk, so there the bound is a bf16 step (2⁻⁸) per chunk of the longest
/// utterance.
#[test]
fn recomputing_gives_the_gradients_of_the_pass_that_keeps_everything() {
    let dir = tempfile::tempdir().unwrap();
    workspace(dir.path(), "tiny-0b6", 7);
    // `roundings`: chunks of the longest utterance.
    let check = |tag: &str, a: &Grads, b: &Grads, bf16: bool, roundings: usize| {
        let (whole_tol, tensor_tol) = if bf16 {
            let t = roundings as f64 * 2f64.powi(-8);
            (t, t)
        } else {
            (1e-6, 4e-6)
        };
        assert!(
            (a.1 - b.1).abs() <= 1e-6 * b.1.abs(),
            "{tag}: loss {} vs {}",
            a.1,
            b.1
        );
        let mut worst = 0f64;
        for (i, (x, y)) in a.0.iter().zip(&b.0).enumerate() {
            if y.is_empty() {
                continue;
            }
            let e = rel(x, y);
            worst = worst.max(e);
            assert!(
                e <= tensor_tol,
                "{tag}: param {i}: max |Δ| / max |g| = {e:e}"
            );
        }
        let whole = rel_norm(&a.0.concat(), &b.0.concat());
        assert!(whole <= whole_tol, "{tag}: ‖Δ‖ / ‖g‖ = {whole:e}");
        eprintln!("{tag}: gradient within {whole:.1e} (norm), each tensor within {worst:.1e}");
    };
    for backend in [
        Backend::Kernels,
        Backend::Autograd(Storage::F32),
        Backend::Autograd(Storage::Bf16),
    ] {
        let bf16 = backend == Backend::Autograd(Storage::Bf16);
        for chunk in [PREDICTOR_CHUNK_FRAMES, 4] {
            let chunks = |mine: &[super::Micro]| {
                let longest = mine.iter().map(|m| m.frames).max().unwrap();
                longest.div_ceil(chunk)
            };
            let both = |t: &mut ShardedTrainer| {
                t.predictor_chunk = chunk;
                let (mine, rows, micro) = next_inputs(t);
                let kept = flat(t.grad_op_pass(&mine, rows.as_ref(), &micro, 0).unwrap());
                let recomputed = flat(t.full_pass(&mine, rows.as_ref(), &micro, 0).unwrap());
                (kept, recomputed, chunks(&mine))
            };
            for n in [1, 2] {
                for (r, (kept, recomputed, k)) in
                    on_ranks(n, dir.path(), "tiny-0b6", backend, ShardMode::GradOp, both)
                        .iter()
                        .enumerate()
                {
                    let tag = format!("{backend:?} chunks of {chunk} grad-op ×{n} rank {r}");
                    check(&tag, recomputed, kept, bf16, *k);
                }
            }
            let one = on_ranks(1, dir.path(), "tiny-0b6", backend, ShardMode::Full, |t| {
                t.predictor_chunk = chunk;
                let (mine, rows, micro) = next_inputs(t);
                let pass = flat(t.full_pass(&mine, rows.as_ref(), &micro, 0).unwrap());
                (pass, chunks(&mine))
            })
            .remove(0);
            let kept = passes(1, dir.path(), backend, ShardMode::GradOp).remove(0);
            let tag = format!("{backend:?} chunks of {chunk} full ×1");
            check(&tag, &one.0, &kept, bf16, one.1);
        }
    }
}

#[test]
fn both_passes_give_each_rank_the_rows_of_the_one_rank_gradient() {
    let dir = tempfile::tempdir().unwrap();
    workspace(dir.path(), "tiny-0b6", 7);
    for backend in BACKENDS {
        for mode in [ShardMode::Full, ShardMode::GradOp] {
            let one = passes(1, dir.path(), backend, mode).remove(0);
            let shapes = on_ranks(1, dir.path(), "tiny-0b6", backend, mode, |t| {
                t.shapes.clone()
            })
            .remove(0);
            for n in [2, 3] {
                let ranks = passes(n, dir.path(), backend, mode);
                for (r, (grads, loss)) in ranks.iter().enumerate() {
                    assert!(
                        (loss - one.1).abs() <= 1e-5 * one.1.abs(),
                        "{backend:?} {mode:?} ×{n}: loss {loss} vs {}",
                        one.1
                    );
                    for (i, g) in grads.iter().enumerate() {
                        if one.0[i].is_empty() {
                            continue; // the text table: reduced in the update
                        }
                        let own = RowSplit::new(shapes[i][0], n).owned(r);
                        let w: usize = shapes[i].iter().skip(1).product();
                        let want = &one.0[i][own.start * w..own.end * w];
                        let e = rel(g, want);
                        assert!(
                            e <= 1e-5,
                            "{backend:?} {mode:?} ×{n} rank {r} param {i}: {e:e}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn an_update_on_shards_equals_the_update_on_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    workspace(dir.path(), "tiny-0b6", 7);
    for backend in BACKENDS {
        let masters = |n: usize| {
            on_ranks(n, dir.path(), "tiny-0b6", backend, ShardMode::Full, |t| {
                for _ in 0..2 {
                    let micro = t.run.sampler.next_step(3);
                    t.step(&micro).unwrap();
                }
                assert_eq!(t.adam.step, 2);
                t.params
                    .iter()
                    .map(|p| values(&p.master().unwrap()))
                    .collect::<Vec<_>>()
            })
        };
        let one = masters(1).remove(0);
        let shapes = on_ranks(1, dir.path(), "tiny-0b6", backend, ShardMode::Full, |t| {
            t.shapes.clone()
        })
        .remove(0);
        for (r, rank) in masters(2).iter().enumerate() {
            for (i, m) in rank.iter().enumerate() {
                let own = RowSplit::new(shapes[i][0], 2).owned(r);
                let w: usize = shapes[i].iter().skip(1).product();
                let e = rel(m, &one[i][own.start * w..own.end * w]);
                assert!(
                    e <= 1e-5,
                    "{backend:?}: rank {r} param {i} after 2 steps: {e:e}"
                );
            }
        }
    }
}

#[test]
fn a_saved_checkpoint_reads_back_every_rank_s_rows_exactly() {
    let dir = tempfile::tempdir().unwrap();
    workspace(dir.path(), "tiny-0b6", 7);
    let saved = on_ranks(
        3,
        dir.path(),
        "tiny-0b6",
        Backend::Kernels,
        ShardMode::GradOp,
        |t| {
            let micro = t.run.sampler.next_step(3);
            t.step(&micro).unwrap();
            let at = t.save().unwrap();
            assert_eq!(
                at.is_some(),
                t.rank() == 0,
                "only rank 0 reports the directory"
            );
            let rows: Vec<_> = t
                .params
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    (
                        p.name.clone(),
                        t.splits[i].owned(t.rank()),
                        values(&p.master().unwrap()),
                        values(&t.adam.v[i].decode().unwrap()),
                    )
                })
                .collect();
            (at, rows)
        },
    );
    let dir = saved[0].0.clone().expect("rank 0 saved");
    let mut reader = RowReader::open(&dir).unwrap();
    assert_eq!(reader.index.world_size, 3);
    for (_, rows) in &saved {
        for (name, own, master, v) in rows {
            if own.is_empty() {
                continue;
            }
            let m = reader
                .rows("master", name, own.clone(), &Device::Cpu)
                .unwrap();
            let s = reader
                .rows("exp_avg_sq", name, own.clone(), &Device::Cpu)
                .unwrap();
            assert!(values(&m) == *master, "{name}: master rows differ");
            assert!(values(&s) == *v, "{name}: exp_avg_sq rows differ");
        }
    }
}

#[test]
fn ranks_own_disjoint_rows_and_empty_shards_stay_off_the_device() {
    let dir = tempfile::tempdir().unwrap();
    workspace(dir.path(), "tiny-1b7", 7);
    // 8 ranks: tiny-1b7 has tensors of 4 rows, so ranks 4..8 own none of them.
    let owned = on_ranks(
        8,
        dir.path(),
        "tiny-1b7",
        Backend::Autograd(Storage::Bf16),
        ShardMode::Full,
        |t| {
            let micro = t.run.sampler.next_step(3);
            t.step(&micro).unwrap();
            t.params
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let own = t.splits[i].owned(t.rank());
                    assert_eq!(p.shape()[0], own.len(), "{}", p.name);
                    if own.is_empty() {
                        assert!(p.var.device().is_cpu() && p.elem_count() == 0, "{}", p.name);
                    } else {
                        assert_eq!(p.var.dtype(), DType::BF16, "{}: bf16 storage", p.name);
                    }
                    (t.shapes[i][0], own)
                })
                .collect::<Vec<_>>()
        },
    );
    let mut empty = 0;
    for i in 0..owned[0].len() {
        let rows = owned[0][i].0;
        let mut covered: Vec<_> = owned.iter().map(|r| r[i].1.clone()).collect();
        covered.sort_by_key(|r| r.start);
        let mut next = 0;
        for r in covered.iter().filter(|r| !r.is_empty()) {
            assert_eq!(r.start, next);
            next = r.end;
        }
        assert_eq!(next, rows);
        empty += covered.iter().filter(|r| r.is_empty()).count();
    }
    assert!(empty > 0, "the fixture must give some rank an empty shard");
}

#[test]
fn the_bf16_storage_rounds_only_what_cuda_stores_in_bf16() {
    // The compute copies hold exactly the masters rounded to bf16, and the masters stay f32.
    let dir = tempfile::tempdir().unwrap();
    workspace(dir.path(), "tiny-0b6", 7);
    on_ranks(
        2,
        dir.path(),
        "tiny-0b6",
        Backend::Autograd(Storage::Bf16),
        ShardMode::GradOp,
        |t| {
            let micro = t.run.sampler.next_step(3);
            t.step(&micro).unwrap();
            for p in t.params.iter().filter(|p| p.elem_count() > 0) {
                assert_eq!(p.master().unwrap().dtype(), DType::F32);
                let rounded = values(&p.master().unwrap().to_dtype(DType::BF16).unwrap());
                assert!(values(p.var.as_tensor()) == rounded, "{}", p.name);
            }
        },
    );
}
