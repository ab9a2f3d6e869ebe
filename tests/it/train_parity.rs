//! The corrected objective (docs/model.md §10.3) on the fixture batch of
//! `scripts/reference/make_train_refs.py` (official modules, float32) — the batch layout exactly, the
//! input embeddings and hidden states, L / L_talker / L_sub within 1e-5 relative, the global
//! gradient norm within 1e-4 relative, per-parameter gradients, and (when recorded) a short
//! AdamW trajectory — for both fixture models.

use std::collections::BTreeMap;

use crate::train_support::*;
use candle_core::{DType, Device, IndexOp, Tensor};
use serde_json::Value;
use vc_train::batch::Batch;
use vc_train::optim::Schedule;
use vc_train::step::loss;
use vc_train::{Backend, Storage, Trainer};

struct Refs {
    json: Value,
    t: BTreeMap<String, Tensor>,
}

fn refs(model: &str) -> Refs {
    refs_of(model, "train")
}

/// `tests/fixtures/refs/{model}.{kind}.{json,safetensors}`.
fn refs_of(model: &str, kind: &str) -> Refs {
    let dir = fixtures().join("refs");
    let json_path = dir.join(format!("{model}.{kind}.json"));
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (scripts/reference/make_train_refs.py writes it)",
                json_path.display()
            )
        }))
        .unwrap();
    let t = candle_core::safetensors::load(
        dir.join(format!("{model}.{kind}.safetensors")),
        &Device::Cpu,
    )
    .unwrap()
    .into_iter()
    .collect();
    Refs { json, t }
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

fn i64_rows(t: &Tensor) -> Vec<Vec<i64>> {
    t.to_dtype(DType::I64).unwrap().to_vec2().unwrap()
}

/// A trainer on a workspace holding exactly the reference rows, in one unshuffled batch.
fn trainer(model: &str, r: &Refs, dir: &std::path::Path, backend: Backend) -> Trainer {
    trainer_with(model, r, &r.json["train_steps"], dir, backend, |_| {})
}

/// [`trainer`] with the optimizer settings of `tr` (a reference's `train_steps`) and the
/// configuration changed by `tweak`.
fn trainer_with(
    model: &str,
    r: &Refs,
    tr: &Value,
    dir: &std::path::Path,
    backend: Backend,
    tweak: impl FnOnce(&mut vc_core::config::TrainConfig),
) -> Trainer {
    let rows: Vec<Value> = r.json["rows"].as_array().unwrap().clone();
    let xvec: Vec<f32> = r.t["batch.xvector"].i(0).unwrap().to_vec1().unwrap();
    make_workspace(dir, model, &rows, &xvec, "");
    let mut config = vc_core::config::resolve_layers(vec![])
        .unwrap()
        .config
        .train;
    config.batch_size = rows.len();
    config.grad_accum = 1;
    config.shuffle = false;
    config.warmup_steps = 0;
    config.epochs = 1000;
    if tr.is_object() {
        config.lr = tr["lr"].as_f64().unwrap();
        config.weight_decay = tr["weight_decay"].as_f64().unwrap();
        config.clip_norm = tr["clip"].as_f64().unwrap();
    }
    tweak(&mut config);
    let opts = train_options(dir, model, config, backend);
    let mut t = Trainer::new(opts, false).unwrap();
    // A constant learning rate, as in the reference trajectory.
    t.run.schedule = Schedule {
        peak: t.run.schedule.peak,
        warmup: 0,
        total: usize::MAX / 2,
    };
    t
}

#[test]
fn loss_gradients_and_batch_match_the_official_modules() {
    for (model, backend) in [
        ("tiny-0b6", Backend::Kernels),
        ("tiny-1b7", Backend::Kernels),
        ("tiny-0b6", Backend::Autograd(Storage::F32)),
        ("tiny-1b7", Backend::Autograd(Storage::F32)),
    ] {
        let r = refs(model);
        let dir = tempfile::tempdir().unwrap();
        let mut tr = trainer(model, &r, dir.path(), backend);
        let model = format!("{model} {backend:?}");
        let model = model.as_str();

        // Tokenization and the batch layout, exactly.
        let want_ids: Vec<Vec<u32>> = serde_json::from_value(r.json["text_ids"].clone()).unwrap();
        let got_ids: Vec<Vec<u32>> = tr
            .run
            .dataset
            .samples
            .iter()
            .map(|s| s.text_ids.clone())
            .collect();
        assert_eq!(got_ids, want_ids, "{model}: text ids");
        let samples: Vec<_> = tr.run.dataset.samples.iter().collect();
        let batch = Batch::build(&samples, &tr.run.layout);
        let (b, s) = (batch.rows, batch.len);
        let mine = |v: Vec<i64>| -> Vec<Vec<i64>> { v.chunks(s).map(<[i64]>::to_vec).collect() };
        let u = |v: &[u32]| mine(v.iter().map(|&x| x as i64).collect());
        let m = |v: &[u8]| mine(v.iter().map(|&x| x as i64).collect());
        assert_eq!(
            u(&batch.text_ids),
            i64_rows(&r.t["batch.text_ids"]),
            "{model}: text_ids"
        );
        assert_eq!(
            u(&batch.codec_channel_ids),
            i64_rows(&r.t["batch.codec_ids"]),
            "{model}: codec_ids"
        );
        assert_eq!(
            m(&batch.text_embedding_mask),
            i64_rows(&r.t["batch.text_mask"])
        );
        assert_eq!(
            m(&batch.codec_embedding_mask),
            i64_rows(&r.t["batch.codec_embedding_mask"])
        );
        assert_eq!(m(&batch.codec_mask), i64_rows(&r.t["batch.codec_mask"]));
        assert_eq!(
            m(&batch.attention_mask),
            i64_rows(&r.t["batch.attention_mask"])
        );
        assert_eq!(
            mine(batch.codec_0_labels.clone()),
            i64_rows(&r.t["batch.labels"]),
            "{model}: labels"
        );
        let codes: Vec<Vec<Vec<i64>>> = r.t["batch.codes"]
            .to_dtype(DType::I64)
            .unwrap()
            .to_vec3()
            .unwrap();
        for (row, sample) in samples.iter().enumerate() {
            let first = 8 + sample.text_len() + 2;
            for (k, want) in codes[row].iter().enumerate() {
                let got: Vec<i64> = if k < sample.frames() {
                    let p = row * s + first + k;
                    batch.codec_ids[p * 16..(p + 1) * 16]
                        .iter()
                        .map(|&c| c as i64)
                        .collect()
                } else {
                    vec![0; 16]
                };
                assert_eq!(&got, want, "{model}: codes of row {row} frame {k}");
            }
        }
        assert_eq!((b, s), (2, r.json["S"].as_u64().unwrap() as usize));

        // Embeddings and hidden states.
        let bt = batch.to_tensors(&Device::Cpu).unwrap();
        let e = loss::input_embeddings(&tr.talker, &bt, &tr.run.speaker).unwrap();
        let de = max_abs(&e, &r.t["inputs_embeds"]);
        let hid = tr
            .talker
            .forward(&e.narrow(1, 0, s - 1).unwrap(), None, None)
            .unwrap();
        // Hidden states of padding positions are not defined the same way (HF masks them).
        let mut dh = 0f32;
        for (row, sample) in samples.iter().enumerate() {
            let n = sample.seq_len() - 1;
            dh = dh.max(max_abs(
                &hid.i((row, ..n)).unwrap(),
                &r.t["hidden"].i((row, ..n)).unwrap(),
            ));
        }
        eprintln!("{model}: inputs_embeds max |diff| {de:.2e}, hidden max |diff| {dh:.2e}");
        assert!(de < 1e-5, "{model}: inputs_embeds differ by {de}");
        assert!(dh < 1e-4, "{model}: hidden states differ by {dh}");

        // Losses.
        let (l, frames) = tr.batch_loss(&[0, 1]).unwrap();
        assert_eq!(frames, r.json["n_frames"].as_u64().unwrap() as usize);
        let (lt, lta, lsu) = (scalar(&l.total), scalar(&l.talker), scalar(&l.sub));
        let want = |k: &str| r.json[k].as_f64().unwrap();
        let errs = [
            rel(lt, want("loss")),
            rel(lta, want("loss_talker")),
            rel(lsu, want("loss_sub")),
        ];
        eprintln!(
            "{model}: L {lt:.8} (ref {:.8}, rel {:.1e}), L_talker rel {:.1e}, L_sub rel {:.1e}",
            want("loss"),
            errs[0],
            errs[1],
            errs[2]
        );
        assert!(
            errs.iter().all(|&e| e < 1e-5),
            "{model}: loss errors {errs:?}"
        );

        // Gradients.
        let grads = l.total.backward().unwrap();
        let gn = r.json["grad_norms"].as_object().unwrap();
        assert_eq!(
            gn.len(),
            tr.params.params.len(),
            "{model}: trained parameter count"
        );
        let mut total = 0f64;
        let mut worst = (0f64, String::new());
        for p in &tr.params.params {
            let g = grads
                .get(p.var.as_tensor())
                .unwrap_or_else(|| panic!("{model}: no grad for {}", p.name));
            let n = g
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64;
            total += n;
            let want = gn[&p.name].as_f64().unwrap();
            let e = rel(n.sqrt(), want);
            if e > worst.0 {
                worst = (e, p.name.clone());
            }
            if let Some(refg) = r.t.get(&format!("grad.{}", p.name)) {
                assert_close_to_scale(g, refg, &format!("{model}: grad of {}", p.name));
            }
            if let Some(rows) = r.t.get(&format!("grad_rows.{}", p.name)) {
                let ids = r.t[&format!("grad_rows.{}.ids", p.name)]
                    .to_dtype(DType::U32)
                    .unwrap();
                let got = g.index_select(&ids, 0).unwrap();
                assert_close_to_scale(&got, rows, &format!("{model}: grad rows of {}", p.name));
            }
        }
        let norm = total.sqrt();
        let e = rel(norm, want("grad_norm"));
        eprintln!(
            "{model}: grad norm {norm:.8} (ref {:.8}, rel {e:.1e}); worst per-parameter norm rel {:.1e} ({})",
            want("grad_norm"),
            worst.0,
            worst.1
        );
        assert!(e < 1e-4, "{model}: grad norm rel error {e}");
        assert!(
            worst.0 < 1e-3,
            "{model}: {} grad norm rel error {}",
            worst.1,
            worst.0
        );

        // The optimizer: a short AdamW trajectory with clipping, when the reference has one.
        let steps = &r.json["train_steps"];
        if !steps.is_object() {
            eprintln!("{model}: the reference has no train_steps yet; trajectory not compared");
            continue;
        }
        assert_trajectory(&mut tr, steps, model);
    }
}

/// The path CUDA takes (autograd over plain ops, compute `Var`s copied from separate fp32
/// masters, a dense text-embedding gradient, AdamW in tensor ops) and the CPU kernels' path
/// train the same: equal losses, gradient norms and master weights over three AdamW steps.
#[test]
fn the_autograd_path_trains_like_the_cpu_kernels() {
    for model in ["tiny-0b6", "tiny-1b7"] {
        let r = refs(model);
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let mut kernels = trainer(model, &r, da.path(), Backend::Kernels);
        let mut autograd = trainer(model, &r, db.path(), Backend::Autograd(Storage::F32));
        for step in 1..=3 {
            let a = kernels.step(&[vec![0, 1]]).unwrap();
            let b = autograd.step(&[vec![0, 1]]).unwrap();
            let (el, en) = (rel(b.loss, a.loss), rel(b.grad_norm, a.grad_norm));
            eprintln!("{model}: step {step}: loss rel {el:.1e}, grad norm rel {en:.1e}");
            assert!(
                el <= 1e-5,
                "{model}: step {step}: loss {} vs {}",
                b.loss,
                a.loss
            );
            assert!(
                en <= 1e-5,
                "{model}: step {step}: grad norm {} vs {}",
                b.grad_norm,
                a.grad_norm
            );
        }
        let mut worst = (0f64, String::new());
        for (p, q) in kernels.params.params.iter().zip(&autograd.params.params) {
            assert_eq!(p.name, q.name);
            let (pm, qm) = (p.master().unwrap(), q.master().unwrap());
            let d = max_abs(&pm, &qm) as f64;
            let norm = pm
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                .sqrt();
            let e = d / (norm as f64).max(1e-30);
            if e > worst.0 {
                worst = (e, p.name.clone());
            }
            // The compute copy follows the master on the autograd path.
            assert_eq!(
                max_abs(q.var.as_tensor(), &qm),
                0.0,
                "{model}: {} var",
                q.name
            );
        }
        eprintln!(
            "{model}: masters after 3 steps: worst max|diff|/norm {:.1e} ({})",
            worst.0, worst.1
        );
        assert!(
            worst.0 <= 1e-5,
            "{model}: {} differs by {:.1e}",
            worst.1,
            worst.0
        );
        assert_eq!(kernels.adam.step, 3);
        assert_eq!(autograd.adam.step, 3);
    }
}

/// LoRA (docs/training.md §13) against PEFT on the official modules (`make_lora_refs.py`):
/// from the same first adapter values (ours, which the reference loaded into PEFT, compared
/// bit for bit here), the loss (the base model's), the gradient of every adapter factor and of
/// the fully trained head, and three AdamW steps with clipping, within the tolerances of the
/// full fine-tune's parity; both fixture models, both backends.
#[test]
fn lora_matches_peft_on_the_official_modules() {
    for (model, backend) in [
        ("tiny-0b6", Backend::Kernels),
        ("tiny-1b7", Backend::Kernels),
        ("tiny-0b6", Backend::Autograd(Storage::F32)),
        ("tiny-1b7", Backend::Autograd(Storage::F32)),
    ] {
        let r = refs(model);
        let l = refs_of(model, "lora");
        let dir = tempfile::tempdir().unwrap();
        let mut tr = trainer_with(
            model,
            &r,
            &l.json["train_steps"],
            dir.path(),
            backend,
            |c| {
                c.lora_rank = l.json["rank"].as_u64().unwrap() as usize;
                c.lora_alpha = l.json["alpha"].as_f64().unwrap();
                c.lora_full = serde_json::from_value(l.json["full"].clone()).unwrap();
                c.seed = l.json["seed"].as_u64().unwrap();
            },
        );
        let tag = format!("{model} {backend:?} LoRA");
        let mut names: Vec<String> = tr.params.params.iter().map(|p| p.name.clone()).collect();
        names.sort();
        let want: Vec<String> = serde_json::from_value(l.json["trained"].clone()).unwrap();
        assert_eq!(names, want, "{tag}: the trained set");
        let mut first_values = 0;
        for p in &tr.params.params {
            if let Some(init) = l.t.get(&format!("init.{}", p.name)) {
                first_values += 1;
                let (a, b): (Vec<f32>, Vec<f32>) = (
                    p.master()
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap(),
                    init.flatten_all().unwrap().to_vec1().unwrap(),
                );
                assert!(
                    a.iter()
                        .map(|x| x.to_bits())
                        .eq(b.iter().map(|x| x.to_bits())),
                    "{tag}: the first values of {} differ from the reference's",
                    p.name
                );
            }
        }
        let targets = l.json["targets"].as_array().unwrap().len();
        assert_eq!(first_values, targets, "{tag}: first values compared");
        let (loss, _) = tr.batch_loss(&[0, 1]).unwrap();
        for (key, t) in [
            ("loss", &loss.total),
            ("loss_talker", &loss.talker),
            ("loss_sub", &loss.sub),
        ] {
            let (got, want) = (scalar(t), l.json[key].as_f64().unwrap());
            assert!(rel(got, want) < 1e-5, "{tag}: {key} {got} vs {want}");
        }
        let grads = loss.total.backward().unwrap();
        let mut total = 0f64;
        for p in &tr.params.params {
            let g = grads
                .get(p.var.as_tensor())
                .unwrap_or_else(|| panic!("{tag}: no gradient for {}", p.name));
            assert_close_to_scale(
                g,
                &l.t[&format!("grad.{}", p.name)],
                &format!("{tag}: grad of {}", p.name),
            );
            total += g
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64;
        }
        let e = rel(total.sqrt(), l.json["grad_norm"].as_f64().unwrap());
        assert!(e < 1e-4, "{tag}: grad norm rel error {e}");
        assert_trajectory(&mut tr, &l.json["train_steps"], &tag);
        // And every value within 1e-3 of its tensor's largest.
        let mut worst = (0f64, String::new());
        for p in &tr.params.params {
            let want = &l.t[&format!("after.{}", p.name)];
            let scale = want
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64;
            let e = max_abs(&p.master().unwrap(), want) as f64 / scale;
            if e > worst.0 {
                worst = (e, p.name.clone());
            }
        }
        eprintln!(
            "{tag}: loss {:.8} (rel {:.1e} to PEFT); values after the steps within {:.1e} of the \
             tensor's largest ({})",
            scalar(&loss.total),
            rel(scalar(&loss.total), l.json["loss"].as_f64().unwrap()),
            worst.0,
            worst.1
        );
        assert!(
            worst.0 < 1e-3,
            "{tag}: {} after the steps differs by {:.2e}",
            worst.1,
            worst.0
        );
    }
}

/// The reference's AdamW trajectory `steps` (its `train_steps`) from `tr`'s current state, one
/// step per reference step on the fixture batch: each step's loss within 1e-5 and gradient norm
/// within 1e-4, the loss after the steps within 1e-4, and each tensor's update norm within 1e-4
/// (an element whose gradient is far below AdamW's eps moves chaotically, its norm does not).
fn assert_trajectory(tr: &mut Trainer, steps: &Value, tag: &str) {
    // A copy: the CPU kernels update their masters in place.
    let before: BTreeMap<String, Tensor> = tr
        .params
        .params
        .iter()
        .map(|p| (p.name.clone(), p.master().unwrap().copy().unwrap()))
        .collect();
    let losses: Vec<f64> = serde_json::from_value(steps["losses"].clone()).unwrap();
    let norms: Vec<f64> = serde_json::from_value(steps["grad_norms_preclip"].clone()).unwrap();
    for (t, (wl, wn)) in losses.iter().zip(&norms).enumerate() {
        let m = tr.step(&[vec![0, 1]]).unwrap();
        eprintln!(
            "{tag}: step {}: loss {:.8} (rel {:.1e}), grad norm {:.6} (rel {:.1e})",
            t + 1,
            m.loss,
            rel(m.loss, *wl),
            m.grad_norm,
            rel(m.grad_norm, *wn)
        );
        assert!(
            rel(m.loss, *wl) < 1e-5,
            "{tag}: step {} loss {} vs {wl}",
            t + 1,
            m.loss
        );
        assert!(
            rel(m.grad_norm, *wn) < 1e-4,
            "{tag}: step {} grad norm {} vs {wn}",
            t + 1,
            m.grad_norm
        );
    }
    let (after, _) = tr.batch_loss(&[0, 1]).unwrap();
    let la = scalar(&after.total);
    let wa = steps["loss_after"].as_f64().unwrap();
    eprintln!(
        "{tag}: loss after {} steps {la:.8} (ref {wa:.8}, rel {:.1e})",
        losses.len(),
        rel(la, wa)
    );
    assert!(
        rel(la, wa) < 1e-4,
        "{tag}: loss after the steps {la} vs {wa}"
    );
    let dn = steps["delta_norms"].as_object().unwrap();
    let mut worst = (0f64, String::new());
    for p in &tr.params.params {
        let d = (p.master().unwrap() - &before[&p.name]).unwrap();
        let n = d
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            .sqrt() as f64;
        let e = rel(n, dn[&p.name].as_f64().unwrap());
        if e > worst.0 {
            worst = (e, p.name.clone());
        }
    }
    eprintln!(
        "{tag}: update norms: worst rel {:.1e} ({})",
        worst.0, worst.1
    );
    assert!(
        worst.0 < 1e-4,
        "{tag}: update of {} differs by {:.2e} relative",
        worst.1,
        worst.0
    );
}

/// `got` within 1e-4 of the largest magnitude of `want` (at least 1e-7 absolute).
fn assert_close_to_scale(got: &Tensor, want: &Tensor, what: &str) {
    let d = max_abs(got, want);
    let scale = want
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(
        d <= 1e-4 * scale.max(1e-3),
        "{what} differs by {d} (max {scale})"
    );
}

fn scalar(t: &Tensor) -> f64 {
    t.to_scalar::<f32>().unwrap() as f64
}

fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
    (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap()
}
