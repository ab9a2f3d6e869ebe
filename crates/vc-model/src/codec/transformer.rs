//! The two small transformers of the codec, on channels-last rows `(T, hidden)` of one sequence:
//! - encoder (`MimiTransformerModel`, docs/model.md §9.1): pre-LayerNorm (with bias), MHA with
//!   rotate_half RoPE, GELU(erf) MLP `fc1/fc2`, LayerScale; full causal mask (the official sdpa
//!   path ignores `sliding_window`);
//! - decoder (`Qwen3TTSTokenizerV2DecoderTransformerModel`, docs/model.md §9.2): RMSNorm, the same
//!   attention with a sliding-window causal mask (key j visible from query i iff
//!   i − window < j ≤ i), SwiGLU MLP, LayerScale.
//!
//! Inference only: q/k/v are one GEMM, the LayerScales are folded into `o_proj` / the MLP's
//! output projection, and attention runs per (head, block of queries) over only the keys the
//! mask lets through (masked scores are never computed).

use anyhow::{ensure, Result};

use rayon::prelude::*;

use super::quantizer::vec_of;
use crate::weights::Weights;
use vc_kernels::act::{gelu_erf_inplace, silu_mul_inplace, softmax_range};
use vc_kernels::conv::Seq;
use vc_kernels::gemm::{gemm, Acc, Par};
use vc_kernels::libm;
use vc_kernels::mat::{MatMut, MatRef};
use vc_kernels::rows_linear::Linear;

/// Queries per attention work item.
const QUERY_BLOCK: usize = 64;

#[derive(Debug, Clone)]
pub enum Norm {
    Layer {
        weight: Vec<f32>,
        bias: Vec<f32>,
        eps: f32,
    },
    Rms {
        weight: Vec<f32>,
        eps: f32,
    },
}

impl Norm {
    /// A normalised copy of `x`.
    pub fn forward(&self, x: &Seq) -> Seq {
        let mut y = x.clone();
        match self {
            Norm::Layer { weight, bias, eps } => layer_norm_rows(&mut y, weight, bias, *eps),
            Norm::Rms { weight, eps } => rms_norm_rows(&mut y, weight, *eps),
        }
        y
    }
}

/// `nn.LayerNorm` over the channels of each row (biased variance), in place.
pub fn layer_norm_rows(x: &mut Seq, w: &[f32], b: &[f32], eps: f32) {
    let c = x.c;
    for row in x.data.chunks_exact_mut(c) {
        let mean = row.iter().sum::<f32>() / c as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / c as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for ((v, &wv), &bv) in row.iter_mut().zip(w).zip(b) {
            *v = (*v - mean) * inv * wv + bv;
        }
    }
}

/// RMSNorm (`weight · x / sqrt(mean(x²) + eps)`, statistics in f32), in place.
pub fn rms_norm_rows(x: &mut Seq, w: &[f32], eps: f32) {
    let c = x.c;
    for row in x.data.chunks_exact_mut(c) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / c as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, &wv) in row.iter_mut().zip(w) {
            *v = wv * (*v * inv);
        }
    }
}

#[derive(Debug, Clone)]
enum Mlp {
    /// `fc2(gelu_erf(fc1(x)))`.
    Gelu { fc1: Linear, fc2: Linear },
    /// `down(silu(gate(x)) · up(x))`; `gate_up` computes both (gate first).
    SwiGlu { gate_up: Linear, down: Linear },
}

#[derive(Debug, Clone)]
struct CodecLayer {
    input_norm: Norm,
    /// q, k, v projections side by side.
    qkv: Linear,
    /// `o_proj` with the attention LayerScale folded in.
    o: Linear,
    post_norm: Norm,
    /// Output projection with the MLP LayerScale folded in.
    mlp: Mlp,
}

/// Which family of layer to load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    /// Mimi: `nn.LayerNorm` + GELU MLP (`mlp.fc1`, `mlp.fc2`).
    Mimi,
    /// Qwen codec decoder: RMSNorm + SwiGLU (`mlp.{gate,up,down}_proj`).
    Qwen,
}

/// Shapes of a transformer stack.
#[derive(Debug, Clone)]
pub struct TransformerDims {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub norm_eps: f64,
    pub rope_theta: f64,
    /// `Some(w)`: sliding-window causal mask of width w; `None`: full causal.
    pub window: Option<usize>,
}

/// Keys and values of the positions [`Transformer::forward_cached`] has seen, per layer:
/// positions `first..len`, `kv_heads · head_dim` values each.
#[derive(Debug, Clone, Default)]
pub struct WindowKvCache {
    layers: Vec<(Vec<f32>, Vec<f32>)>,
    first: usize,
    len: usize,
}

impl WindowKvCache {
    /// Positions seen so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[derive(Debug, Clone)]
pub struct Transformer {
    dims: TransformerDims,
    layers: Vec<CodecLayer>,
    /// `theta^(−2i/head_dim)`, f32 as HF computes it.
    inv_freq: Vec<f32>,
}

fn linear(w: &Weights, name: &str, out: usize, inp: usize) -> Result<Linear> {
    Linear::from_torch(&vec_of(w, name, &[out, inp])?, out, inp, None)
}

impl Transformer {
    /// Loads `{prefix}layers.{i}.*`.
    pub fn load(
        w: &Weights,
        prefix: &str,
        dims: TransformerDims,
        flavour: Flavour,
    ) -> Result<Self> {
        ensure!(
            dims.head_dim.is_multiple_of(2),
            "{prefix}: RoPE needs an even head_dim"
        );
        ensure!(
            dims.kv_heads > 0 && dims.heads.is_multiple_of(dims.kv_heads),
            "{prefix}: heads must be a multiple of kv heads"
        );
        let (h, qd, kvd) = (
            dims.hidden,
            dims.heads * dims.head_dim,
            dims.kv_heads * dims.head_dim,
        );
        let eps = dims.norm_eps as f32;
        let norm = |name: &str| -> Result<Norm> {
            Ok(match flavour {
                Flavour::Mimi => Norm::Layer {
                    weight: vec_of(w, &format!("{name}.weight"), &[h])?,
                    bias: vec_of(w, &format!("{name}.bias"), &[h])?,
                    eps,
                },
                Flavour::Qwen => Norm::Rms {
                    weight: vec_of(w, &format!("{name}.weight"), &[h])?,
                    eps,
                },
            })
        };
        let mut layers = Vec::with_capacity(dims.layers);
        for i in 0..dims.layers {
            let p = format!("{prefix}layers.{i}.");
            let attn_scale = vec_of(w, &format!("{p}self_attn_layer_scale.scale"), &[h])?;
            let mlp_scale = vec_of(w, &format!("{p}mlp_layer_scale.scale"), &[h])?;
            let mlp = match flavour {
                Flavour::Mimi => {
                    let mut fc2 = linear(w, &format!("{p}mlp.fc2.weight"), h, dims.intermediate)?;
                    fc2.scale_outputs(&mlp_scale);
                    Mlp::Gelu {
                        fc1: linear(w, &format!("{p}mlp.fc1.weight"), dims.intermediate, h)?,
                        fc2,
                    }
                }
                Flavour::Qwen => {
                    let mut down =
                        linear(w, &format!("{p}mlp.down_proj.weight"), h, dims.intermediate)?;
                    down.scale_outputs(&mlp_scale);
                    Mlp::SwiGlu {
                        gate_up: Linear::concat(&[
                            linear(w, &format!("{p}mlp.gate_proj.weight"), dims.intermediate, h)?,
                            linear(w, &format!("{p}mlp.up_proj.weight"), dims.intermediate, h)?,
                        ])?,
                        down,
                    }
                }
            };
            let mut o = linear(w, &format!("{p}self_attn.o_proj.weight"), h, qd)?;
            o.scale_outputs(&attn_scale);
            layers.push(CodecLayer {
                input_norm: norm(&format!("{p}input_layernorm"))?,
                qkv: Linear::concat(&[
                    linear(w, &format!("{p}self_attn.q_proj.weight"), qd, h)?,
                    linear(w, &format!("{p}self_attn.k_proj.weight"), kvd, h)?,
                    linear(w, &format!("{p}self_attn.v_proj.weight"), kvd, h)?,
                ])?,
                o,
                post_norm: norm(&format!("{p}post_attention_layernorm"))?,
                mlp,
            });
        }
        let half = dims.head_dim / 2;
        // HF `_compute_default_rope_parameters`: arange in f32, / dim, base ** (…) in f32.
        let inv_freq = (0..half)
            .map(|i| {
                let e = (2 * i) as f32 / dims.head_dim as f32;
                1.0f32 / libm::powf(dims.rope_theta as f32, e)
            })
            .collect();
        Ok(Transformer {
            dims,
            layers,
            inv_freq,
        })
    }

    /// `(T, hidden)` → `(T, hidden)`, positions 0..T. No final norm.
    pub fn forward(&self, x: &Seq) -> Seq {
        let t = x.t;
        let mut h = x.clone();
        if t == 0 {
            return h;
        }
        let (cos, sin) = self.rope_tables(0..t);
        for layer in &self.layers {
            let a = layer.input_norm.forward(&h);
            let mut qkv = layer.qkv.forward(&a, None);
            self.apply_rope(&mut qkv, &cos, &sin);
            let att = self.attention(&qkv);
            h = layer.o.forward(&att, Some(&h));
            h = self.mlp(layer, &h);
        }
        h
    }

    /// `h + MLP(post_norm(h))` (the LayerScale is folded into the output projection).
    fn mlp(&self, layer: &CodecLayer, h: &Seq) -> Seq {
        let m = layer.post_norm.forward(h);
        match &layer.mlp {
            Mlp::Gelu { fc1, fc2 } => {
                let mut u = fc1.forward(&m, None);
                gelu_erf_inplace(&mut u.data);
                fc2.forward(&u, Some(h))
            }
            Mlp::SwiGlu { gate_up, down } => {
                let gu = gate_up.forward(&m, None);
                let n = self.dims.intermediate;
                let mut g = Seq::zeros(h.t, n);
                for (row, src) in g.data.chunks_exact_mut(n).zip(gu.data.chunks_exact(2 * n)) {
                    row.copy_from_slice(&src[..n]);
                    silu_mul_inplace(row, &src[n..]);
                }
                down.forward(&g, Some(h))
            }
        }
    }

    /// A cache for [`Self::forward_cached`].
    pub fn new_cache(&self) -> WindowKvCache {
        WindowKvCache {
            layers: vec![(Vec::new(), Vec::new()); self.layers.len()],
            first: 0,
            len: 0,
        }
    }

    /// The next `x.t` positions of a sequence whose earlier positions are in `cache` (positions
    /// continue from `cache.len()`): the same layers as [`Self::forward`] for the streaming
    /// decoder, giving the same floats for every row (docs/model.md §9.5). With a sliding window
    /// the cache keeps only the keys a later query can still see.
    pub fn forward_cached(&self, x: &Seq, cache: &mut WindowKvCache) -> Seq {
        let mut out = self.forward_cached_many(std::slice::from_ref(x), &mut [cache]);
        out.pop().expect("one sequence in, one out")
    }

    /// [`Self::forward_cached`] for several independent sequences at once (the streams of a
    /// batched decoding step): their rows share every projection and MLP product (the weights
    /// read once), each attends to its own cache. Each output is the one `forward_cached`
    /// gives for its sequence alone, to the bit (row-invariant products, docs/model.md §9.5).
    pub fn forward_cached_many(&self, xs: &[Seq], caches: &mut [&mut WindowKvCache]) -> Vec<Seq> {
        assert_eq!(xs.len(), caches.len(), "one cache per sequence");
        let d = &self.dims;
        let hd = d.head_dim;
        let rows: Vec<usize> = xs.iter().map(|x| x.t).collect();
        let total: usize = rows.iter().sum();
        let mut h = Seq::stack(xs, d.hidden);
        if total == 0 {
            return h.split(&rows);
        }
        let tables: Vec<(Vec<f32>, Vec<f32>)> = caches
            .iter()
            .zip(&rows)
            .map(|(c, &n)| self.rope_tables(c.len..c.len + n))
            .collect();
        let kvd = d.kv_heads * hd;
        let k_off = d.heads * hd;
        let v_off = k_off + kvd;
        let rep = d.heads / d.kv_heads;
        let out_w = d.heads * hd;
        for (li, layer) in self.layers.iter().enumerate() {
            let a = layer.input_norm.forward(&h);
            let qkv_all = layer.qkv.forward(&a, None);
            let mut att = vec![0.0f32; total * out_w];
            let mut scores = Vec::new();
            let mut at = 0;
            for (((qkv_rows, cache), (cos, sin)), &n) in qkv_all
                .split(&rows)
                .into_iter()
                .zip(caches.iter_mut())
                .zip(&tables)
                .zip(&rows)
            {
                if n == 0 {
                    continue;
                }
                let mut qkv = qkv_rows;
                self.apply_rope(&mut qkv, cos, sin);
                let (keys, vals) = &mut cache.layers[li];
                for row in qkv.data.chunks_exact(qkv.c) {
                    keys.extend_from_slice(&row[k_off..k_off + kvd]);
                    vals.extend_from_slice(&row[v_off..v_off + kvd]);
                }
                // Every cached key so far, head by head through `attend_head` as in `attention`.
                let nk = keys.len() / kvd;
                let rows_att = &mut att[at * out_w..(at + n) * out_w];
                for head in 0..d.heads {
                    let g = head / rep;
                    self.attend_head(
                        MatRef::strided(&qkv.data[head * hd..], n, hd, qkv.c, 1),
                        MatRef::strided(&keys[g * hd..], hd, nk, 1, kvd),
                        MatRef::strided(&vals[g * hd..], nk, hd, kvd, 1),
                        (cache.len, cache.first),
                        &mut scores,
                        MatMut::strided(&mut rows_att[head * hd..], n, hd, out_w),
                    );
                }
                at += n;
            }
            let att = Seq::new(att, total, out_w);
            h = layer.o.forward(&att, Some(&h));
            h = self.mlp(layer, &h);
        }
        for (cache, &n) in caches.iter_mut().zip(&rows) {
            cache.len += n;
            if let Some(w) = d.window {
                // Later queries see positions > len − w only.
                let keep_from = cache.len.saturating_sub(w);
                if keep_from > cache.first {
                    let drop = (keep_from - cache.first) * kvd;
                    for (k, v) in &mut cache.layers {
                        k.drain(..drop);
                        v.drain(..drop);
                    }
                    cache.first = keep_from;
                }
            }
        }
        h.split(&rows)
    }

    /// cos/sin tables `(positions, head_dim/2)`: `freqs = pos · inv_freq` in f32, as HF.
    fn rope_tables(&self, positions: std::ops::Range<usize>) -> (Vec<f32>, Vec<f32>) {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for p in positions {
            for &f in &self.inv_freq {
                let a = p as f32 * f;
                cos.push(libm::cos(a));
                sin.push(libm::sin(a));
            }
        }
        (cos, sin)
    }

    /// rotate_half RoPE on the q and k heads of each `qkv` row, in place.
    fn apply_rope(&self, qkv: &mut Seq, cos: &[f32], sin: &[f32]) {
        let d = &self.dims;
        let half = d.head_dim / 2;
        let rotated = d.heads + d.kv_heads; // q heads then k heads, each head_dim wide
        let width = qkv.c;
        for (t, row) in qkv.data.chunks_exact_mut(width).enumerate() {
            let (c, s) = (
                &cos[t * half..(t + 1) * half],
                &sin[t * half..(t + 1) * half],
            );
            for head in row[..rotated * d.head_dim].chunks_exact_mut(d.head_dim) {
                let (x1, x2) = head.split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (x1[i], x2[i]);
                    x1[i] = a * c[i] - b * s[i];
                    x2[i] = b * c[i] + a * s[i];
                }
            }
        }
    }

    /// One head's attention: `queries` are the rows of positions `q0, q0 + 1, …`, `keys_t`
    /// (`(head_dim, nk)`) and `values` (`(nk, head_dim)`) those of positions `k0 ..`; each query
    /// sees the keys of its causal window (the others get weight 0). [`Self::forward`] and
    /// [`Self::forward_cached`] both go through here, so with row-invariant GEMMs a row's output
    /// is the same floats however the sequence is cut (docs/model.md §9.5).
    fn attend_head(
        &self,
        queries: MatRef<'_>,
        keys_t: MatRef<'_>,
        values: MatRef<'_>,
        (q0, k0): (usize, usize),
        scores: &mut Vec<f32>,
        out: MatMut<'_>,
    ) {
        let (n, nk) = (queries.rows(), keys_t.cols());
        let scale = 1.0 / (self.dims.head_dim as f32).sqrt();
        scores.clear();
        scores.resize(n * nk, 0.0);
        gemm(
            MatMut::new(scores, n, nk),
            queries,
            keys_t,
            Acc::Set,
            scale,
            Par::Seq,
        );
        for (r, row) in scores.chunks_exact_mut(nk).enumerate() {
            let p = q0 + r;
            let lo = match self.dims.window {
                Some(w) => (p + 1).saturating_sub(w).max(k0),
                None => k0,
            };
            softmax_range(row, lo - k0, p + 1 - k0);
        }
        gemm(
            out,
            MatRef::new(scores, n, nk),
            values,
            Acc::Set,
            1.0,
            Par::Seq,
        );
    }

    /// Multi-head attention of the rotated `qkv` rows → `(T, heads·head_dim)`.
    fn attention(&self, qkv: &Seq) -> Seq {
        let d = &self.dims;
        let (t, hd) = (qkv.t, d.head_dim);
        let width = qkv.c;
        let k_off = d.heads * hd;
        let v_off = k_off + d.kv_heads * hd;
        let rep = d.heads / d.kv_heads;
        let out_w = d.heads * hd;
        let blocks = t.div_ceil(QUERY_BLOCK);
        // Work items (head, block of queries), each writing its own rows of a head-major
        // `(heads, T, head_dim)` buffer, transposed to `(T, heads·head_dim)` at the end.
        let mut by_head = vec![0.0f32; d.heads * t * hd];
        let items: Vec<(usize, usize, &mut [f32])> = by_head
            .chunks_mut((t * hd).max(1))
            .enumerate()
            .flat_map(|(head, plane)| {
                let rows = plane.chunks_mut(QUERY_BLOCK * hd).enumerate();
                rows.map(move |(blk, o)| (head, blk, o))
            })
            .collect();
        debug_assert_eq!(items.len(), d.heads * blocks);
        items
            .into_par_iter()
            .for_each_init(Vec::new, |scores, (head, blk, o)| {
                let kvh = head / rep;
                let a = blk * QUERY_BLOCK;
                let b = (a + QUERY_BLOCK).min(t);
                // Keys any query in [a, b) can see.
                let k0 = match d.window {
                    Some(w) => (a + 1).saturating_sub(w),
                    None => 0,
                };
                let nk = b - k0;
                let data = &qkv.data;
                self.attend_head(
                    MatRef::strided(&data[a * width + head * hd..], b - a, hd, width, 1),
                    // Keys k0..b of this head, transposed: (hd, nk).
                    MatRef::strided(&data[k0 * width + k_off + kvh * hd..], hd, nk, 1, width),
                    MatRef::strided(&data[k0 * width + v_off + kvh * hd..], nk, hd, width, 1),
                    (a, k0),
                    scores,
                    MatMut::new(o, b - a, hd),
                );
            });
        let mut out = vec![0.0f32; t * out_w];
        out.par_chunks_mut(out_w * QUERY_BLOCK)
            .enumerate()
            .for_each(|(blk, rows)| {
                for (r, row) in rows.chunks_exact_mut(out_w).enumerate() {
                    let i = blk * QUERY_BLOCK + r;
                    for (head, dst) in row.chunks_exact_mut(hd).enumerate() {
                        dst.copy_from_slice(&by_head[(head * t + i) * hd..(head * t + i + 1) * hd]);
                    }
                }
            });
        Seq::new(out, t, out_w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vc_kernels::test_values::rand_vec;

    /// Plain f64 attention with an explicit mask, for one sequence.
    fn reference_attention(
        qkv: &Seq,
        heads: usize,
        kv_heads: usize,
        hd: usize,
        window: Option<usize>,
    ) -> Vec<f32> {
        let (t, w) = (qkv.t, qkv.c);
        let mut out = vec![0.0f32; t * heads * hd];
        for h in 0..heads {
            let kvh = h / (heads / kv_heads);
            for i in 0..t {
                let q = &qkv.data[i * w + h * hd..i * w + (h + 1) * hd];
                let visible: Vec<usize> = (0..t)
                    .filter(|&j| j <= i && window.is_none_or(|win| j + win > i))
                    .collect();
                let s: Vec<f64> = visible
                    .iter()
                    .map(|&j| {
                        let k = &qkv.data[j * w + heads * hd + kvh * hd..][..hd];
                        q.iter()
                            .zip(k)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for dd in 0..hd {
                    let mut acc = 0.0;
                    for (n, &j) in visible.iter().enumerate() {
                        acc += e[n] / z
                            * qkv.data[j * w + (heads + kv_heads) * hd + kvh * hd + dd] as f64;
                    }
                    out[i * heads * hd + h * hd + dd] = acc as f32;
                }
            }
        }
        out
    }

    #[test]
    fn windowed_and_causal_attention_match_reference() {
        for (t, heads, kv_heads, window) in [
            (150usize, 2usize, 2usize, Some(72usize)),
            (130, 4, 2, None),
            (5, 2, 1, Some(3)),
        ] {
            let hd = 8;
            let dims = TransformerDims {
                hidden: 8,
                layers: 0,
                heads,
                kv_heads,
                head_dim: hd,
                intermediate: 8,
                norm_eps: 1e-5,
                rope_theta: 1e4,
                window,
            };
            let tr = Transformer {
                dims,
                layers: vec![],
                inv_freq: vec![],
            };
            let width = (heads + 2 * kv_heads) * hd;
            let qkv = Seq::new(rand_vec(t * width, t as u64), t, width);
            let got = tr.attention(&qkv);
            let want = reference_attention(&qkv, heads, kv_heads, hd, window);
            let err = got
                .data
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(err < 1e-5, "t={t} window={window:?}: {err}");
        }
    }

    #[test]
    fn rope_rotates_halves() {
        let dims = TransformerDims {
            hidden: 4,
            layers: 0,
            heads: 1,
            kv_heads: 1,
            head_dim: 4,
            intermediate: 4,
            norm_eps: 1e-5,
            rope_theta: 1e4,
            window: None,
        };
        let tr = Transformer {
            inv_freq: vec![1.0, 0.01],
            dims,
            layers: vec![],
        };
        let (cos, sin) = tr.rope_tables(0..3);
        let mut qkv = Seq::new((0..36).map(|i| i as f32).collect(), 3, 12);
        let orig = qkv.clone();
        tr.apply_rope(&mut qkv, &cos, &sin);
        for t in 0..3 {
            let p = t as f32;
            for (base, rotated) in [(0, true), (4, true), (8, false)] {
                let x = &orig.row(t)[base..base + 4];
                let y = &qkv.row(t)[base..base + 4];
                if !rotated {
                    assert_eq!(x, y);
                    continue;
                }
                for (i, f) in [1.0f32, 0.01].iter().enumerate() {
                    let (c, s) = ((p * f).cos(), (p * f).sin());
                    assert!((y[i] - (x[i] * c - x[i + 2] * s)).abs() < 1e-4);
                    assert!((y[i + 2] - (x[i + 2] * c + x[i] * s)).abs() < 1e-4);
                }
            }
        }
    }
}
