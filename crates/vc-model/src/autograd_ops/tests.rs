//! Each kernel against the same function built from plain candle ops, values and gradients
//! (candle's autograd on the plain ops is the reference).
use super::*;
use candle_core::{Device, Var, D};
use vc_kernels::test_values::vals;

fn randn(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_vec(vals(n, seed), shape, &Device::Cpu).unwrap()
}

fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
    let scale = b
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
    diff.to_scalar::<f32>().unwrap() / scale.max(1e-12)
}

/// Runs `kernel` and `reference` on the same fresh vars, with the loss `Σ y·r`, and compares
/// outputs and every input gradient.
fn check(
    name: &str,
    inputs: &[Tensor],
    kernel: impl Fn(&[Tensor]) -> Result<Tensor>,
    reference: impl Fn(&[Tensor]) -> Result<Tensor>,
    tol: f32,
) {
    let run = |f: &dyn Fn(&[Tensor]) -> Result<Tensor>| {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|t| Var::from_tensor(t).unwrap())
            .collect();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts).unwrap();
        let r = randn(y.dims(), 99);
        let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let g: Vec<Tensor> = ts
            .iter()
            .map(|t| grads.get(t).expect("every input gets a gradient").clone())
            .collect();
        (y, g)
    };
    let (y1, g1) = run(&kernel);
    let (y2, g2) = run(&reference);
    assert_eq!(y1.dims(), y2.dims(), "{name}: output shape");
    let e = max_rel(&y1, &y2);
    assert!(e < tol, "{name}: output differs by {e}");
    for (i, (a, b)) in g1.iter().zip(&g2).enumerate() {
        assert_eq!(a.dims(), b.dims(), "{name}: gradient {i} shape");
        let e = max_rel(a, b);
        assert!(e < tol, "{name}: gradient of input {i} differs by {e}");
        let finite = a
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(
            finite.is_finite() && finite > 0.0,
            "{name}: gradient {i} is {finite}"
        );
    }
}

fn plain_rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let inv = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    x.broadcast_mul(&inv)?.broadcast_mul(w)
}

fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let (a, b) = (
        x.narrow(D::Minus1, 0, d / 2)?,
        x.narrow(D::Minus1, d / 2, d / 2)?,
    );
    Tensor::cat(&[&b.neg()?, &a], D::Minus1)
}

#[test]
fn linear_matches_matmul() {
    let (x, w, b) = (randn(&[2, 5, 12], 1), randn(&[7, 12], 2), randn(&[7], 3));
    check(
        "linear",
        &[x.clone(), w.clone()],
        |t| linear(&t[0], &t[1], None),
        |t| t[0].broadcast_matmul(&t[1].t()?),
        1e-5,
    );
    check(
        "linear+bias",
        &[x, w, b],
        |t| linear(&t[0], &t[1], Some(&t[2])),
        |t| t[0].broadcast_matmul(&t[1].t()?)?.broadcast_add(&t[2]),
        1e-5,
    );
}

#[test]
fn rms_norm_matches_plain_ops() {
    check(
        "rms_norm",
        &[randn(&[3, 130, 16], 4), randn(&[16], 5)],
        |t| rms_norm(&t[0], &t[1], 1e-6),
        |t| plain_rms_norm(&t[0], &t[1], 1e-6),
        1e-5,
    );
}

#[test]
fn norm_rope_matches_plain_ops() {
    let (b, s, heads, d) = (2, 5, 3, 8);
    for rows in [1usize, 2] {
        // Per-row positions when rows = 2 (left-padded batches), shared otherwise.
        let pos: Vec<f32> = (0..rows * s)
            .map(|i| (i % s + 2 * (i / s)) as f32)
            .collect();
        let pos = Tensor::from_vec(pos, (rows, s, 1), &Device::Cpu).unwrap();
        let inv: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / 1e4f32.powf(2.0 * i as f32 / d as f32))
            .collect();
        let freqs = pos
            .broadcast_mul(&Tensor::from_vec(inv, (1, 1, d / 2), &Device::Cpu).unwrap())
            .unwrap();
        let (cos, sin) = (freqs.cos().unwrap(), freqs.sin().unwrap());
        let tables = RopeHalfTables::new(&cos, &sin).unwrap();
        let full = |t: &Tensor| {
            Tensor::cat(&[t, t], D::Minus1)
                .unwrap()
                .unsqueeze(2)
                .unwrap()
        };
        let (cf, sf) = (full(&cos), full(&sin)); // (rows, S, 1, D)
        check(
            "norm_rope",
            &[randn(&[b, s, heads * d], 6), randn(&[d], 7)],
            |t| tables.norm_rope(&t[0], &t[1], 1e-6),
            |t| {
                let x = plain_rms_norm(&t[0].reshape((b, s, heads, d))?, &t[1], 1e-6)?;
                let y = (x.broadcast_mul(&cf)? + rotate_half(&x)?.broadcast_mul(&sf)?)?;
                y.reshape((b, s, heads * d))
            },
            1e-5,
        );
    }
}

fn plain_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dims: (usize, usize, usize, usize),
    bias: &Tensor,
) -> Result<Tensor> {
    let (b, s, heads, d) = dims;
    let kv = k.dim(2)? / d;
    let split = |t: &Tensor, h: usize| t.reshape((b, s, h, d))?.transpose(1, 2)?.contiguous();
    let (q, k, v) = (split(q, heads)?, split(k, kv)?, split(v, kv)?);
    let rep = |t: Tensor| -> Result<Tensor> {
        // HF repeat_kv: kv head g serves q heads g·rep .. g·rep + rep − 1.
        let parts: Vec<Tensor> = (0..heads)
            .map(|h| t.narrow(1, h / (heads / kv), 1))
            .collect::<Result<_>>()?;
        Tensor::cat(&parts, 1)
    };
    let (k, v) = (rep(k)?, rep(v)?);
    let scores = (q.matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?.broadcast_add(bias)?;
    let max = scores.max_keepdim(D::Minus1)?.detach();
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v.contiguous()?)?
        .transpose(1, 2)?
        .reshape((b, s, heads * d))
}

#[test]
fn attention_matches_plain_ops() {
    let (b, s, heads, kv, d) = (2, 6, 4, 2, 8);
    let ninf = f32::NEG_INFINITY;
    // Causal, shared by the batch.
    let causal: Vec<f32> = (0..s * s)
        .map(|i| if i % s > i / s { ninf } else { 0.0 })
        .collect();
    // Row 0 left-padded by two positions (a padded query sees only itself), row 1 causal.
    let mut padded = vec![ninf; 2 * s * s];
    for r in 0..2 {
        for i in 0..s {
            for j in 0..=i {
                if r == 1 || j >= 2 || j == i {
                    padded[(r * s + i) * s + j] = 0.0;
                }
            }
        }
    }
    let biases = [
        Tensor::from_vec(causal, (1, 1, s, s), &Device::Cpu).unwrap(),
        Tensor::from_vec(padded, (2, 1, s, s), &Device::Cpu).unwrap(),
    ];
    for bias in &biases {
        check(
            "attention",
            &[
                randn(&[b, s, heads * d], 8),
                randn(&[b, s, kv * d], 9),
                randn(&[b, s, kv * d], 10),
            ],
            |t| attention(&t[0], &t[1], &t[2], d, 1.0 / (d as f64).sqrt(), Some(bias)),
            |t| plain_attention(&t[0], &t[1], &t[2], (b, s, heads, d), bias),
            1e-5,
        );
    }
}

#[test]
fn swiglu_matches_plain_ops() {
    check(
        "swiglu",
        &[
            randn(&[3, 40, 24], 11).affine(4.0, 0.0).unwrap(),
            randn(&[3, 40, 24], 12),
        ],
        |t| swiglu(&t[0], &t[1]),
        |t| t[0].silu()? * &t[1],
        1e-5,
    );
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let inputs = [randn(&[300, 64], 13), randn(&[64], 14)];
    let grads = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let (x, w) = (
                Var::from_tensor(&inputs[0]).unwrap(),
                Var::from_tensor(&inputs[1]).unwrap(),
            );
            let y = rms_norm(x.as_tensor(), w.as_tensor(), 1e-6).unwrap();
            let g = (&y * &randn(&[300, 64], 15))
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            g.get(w.as_tensor()).unwrap().to_vec1::<f32>().unwrap()
        })
    };
    assert_eq!(grads(1), grads(3));
}

#[test]
fn shifted_heads_match_per_position_products() {
    let (n, g, h, v) = (5, 4, 6, 7);
    let heads = randn(&[g - 1, v, h], 16);
    check(
        "shifted_heads",
        &[randn(&[n, g, h], 17), heads],
        |t| shifted_heads(&t[0], &t[1]),
        |t| {
            let logits = (0..g - 1)
                .map(|j| {
                    t[0].narrow(1, j + 1, 1)?
                        .squeeze(1)?
                        .matmul(&t[1].get(j)?.t()?)
                })
                .collect::<Result<Vec<_>>>()?;
            Tensor::stack(&logits, 0)
        },
        1e-5,
    );
}

/// A kernel of two operands, for [`operands_outside_the_graph_get_no_gradient`].
type Binary = dyn Fn(&Tensor, &Tensor) -> Result<Tensor>;

/// An operand outside the graph (a frozen weight, a LoRA run's input to its first adapted
/// layer) gets no gradient — candle would keep it, unread, until the store is dropped — and the
/// other operands' gradients are those of a run where it is a variable, to the bit.
#[test]
fn operands_outside_the_graph_get_no_gradient() {
    let grads_of = |f: &Binary, a: &Tensor, b: &Tensor| {
        // The two operands as variables, then either one a plain tensor.
        [(true, true), (true, false), (false, true)].map(|(var_a, var_b)| {
            let as_input = |t: &Tensor, var: bool| match var {
                true => Var::from_tensor(t).unwrap().as_tensor().clone(),
                false => t.clone(),
            };
            let (a, b) = (as_input(a, var_a), as_input(b, var_b));
            let y = f(&a, &b).unwrap();
            let r = randn(y.dims(), 98);
            let g = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let values = |t: &Tensor| {
                g.get(t)
                    .map(|g| g.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            };
            (values(&a), values(&b))
        })
    };
    let (n, g, h, v) = (5, 4, 6, 7);
    let cases: [(&str, &Binary, Tensor, Tensor); 2] = [
        (
            "linear",
            &|x, w| linear(x, w, None),
            randn(&[2, 5, 12], 1),
            randn(&[7, 12], 2),
        ),
        (
            "shifted_heads",
            &|x, w| shifted_heads(x, w),
            randn(&[n, g, h], 17),
            randn(&[g - 1, v, h], 16),
        ),
    ];
    for (name, f, a, b) in cases {
        let [(da, db), (da_only, no_b), (no_a, db_only)] = grads_of(f, &a, &b);
        assert!(da.is_some() && db.is_some(), "{name}");
        assert_eq!(no_b, None, "{name}: the plain weight got a gradient");
        assert_eq!(no_a, None, "{name}: the plain input got a gradient");
        assert_eq!(da_only, da, "{name}: input gradient");
        assert_eq!(db_only, db, "{name}: weight gradient");
    }
}
