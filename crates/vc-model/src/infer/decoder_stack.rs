//! The Qwen3 decoder stack of the row inference path (docs/model.md §4.1): its layers' weights,
//! its KV cache with the positions and left padding of each row, and the row loops one step runs
//! (RMSNorm, RoPE, causal attention). The talker and the code predictor each own one stack, and
//! [`super::row_step`] steps it row by row. These loops and the cache's layout live here only.

use anyhow::{bail, ensure, Result};

use vc_kernels::{libm, team};

use super::adapters::{AdaptedProjection, AdapterId};
use super::row_math::{dot, rms_norm_row, rms_norm_rows};
use crate::layers::DecoderStackConfig;
use crate::linear::{Input, LinearWeight, WeightFormat};
use crate::weights::MappedWeights;

/// One decoder layer's weights.
pub(super) struct RowLayer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    q: AdaptedProjection,
    k: AdaptedProjection,
    v: AdaptedProjection,
    o: AdaptedProjection,
    gate: AdaptedProjection,
    up: AdaptedProjection,
    down: AdaptedProjection,
}

/// The projections of a layer, named as in the checkpoint after `layers.N.`, in the order
/// [`RowLayer::projections`] gives them.
const PROJECTIONS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

impl RowLayer {
    /// The projections with their names ([`PROJECTIONS`]).
    fn projections(&self) -> impl Iterator<Item = (&'static str, &AdaptedProjection)> {
        let all = [
            &self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down,
        ];
        PROJECTIONS.into_iter().zip(all)
    }

    fn projections_mut(&mut self) -> impl Iterator<Item = (&'static str, &mut AdaptedProjection)> {
        let all = [
            &mut self.q,
            &mut self.k,
            &mut self.v,
            &mut self.o,
            &mut self.gate,
            &mut self.up,
            &mut self.down,
        ];
        PROJECTIONS.into_iter().zip(all)
    }
}

/// A Qwen3 decoder stack (layers, final norm, RoPE frequencies).
pub struct RowDecoderStack {
    pub(super) layers: Vec<RowLayer>,
    pub(super) norm: Vec<f32>,
    pub(super) cfg: DecoderStackConfig,
    pub(super) inv_freq: Vec<f32>,
}

/// KV cache and position bookkeeping of one decoder stack for a batch of rows
/// (docs/model.md §4.1: positions count real tokens; left padding is masked).
pub struct Cache {
    /// Per layer keys and values, `[row][kv head][capacity][head_dim]`.
    pub(super) kv: Vec<(Vec<f32>, Vec<f32>)>,
    rows: usize,
    pub(super) capacity: usize,
    pub(super) len: usize,
    /// `key_valid[row][t]`: cached position t of the row is a real token; `None` while all are.
    pub(super) key_valid: Option<Vec<Vec<bool>>>,
    pub(super) next_pos: Vec<usize>,
    head_dim: usize,
    /// The adapter each row computes with (docs/serving.md §7); empty: every row with the base.
    pub(super) adapters: Vec<Option<AdapterId>>,
}

impl Cache {
    /// Binds the rows of this (empty) cache to adapters, one entry per row (`None`: the base
    /// model). The binding outlives [`Self::reset`]: keys and values are only ever computed
    /// with the adapter of their row.
    pub fn bind_adapters(&mut self, rows: &[Option<AdapterId>]) -> Result<()> {
        ensure!(
            self.is_empty(),
            "a cache holding positions cannot change the adapters of its rows"
        );
        self.adapters = if rows.iter().all(Option::is_none) {
            Vec::new()
        } else {
            rows.to_vec()
        };
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Empties the cache, keeping its buffers and its rows' adapters.
    pub fn reset(&mut self) {
        self.len = 0;
        self.key_valid = None;
        self.next_pos.clear();
    }

    /// Room for `need` positions of `rows` rows of `kv_width` (= kv heads · head_dim) values.
    pub(super) fn reserve(&mut self, rows: usize, need: usize, kv_width: usize) {
        let allocated = self.kv.first().is_some_and(|(k, _)| !k.is_empty());
        if allocated && rows == self.rows && need <= self.capacity {
            return;
        }
        let keep = allocated && rows == self.rows && self.len > 0;
        let cap = if keep {
            need.max(2 * self.capacity)
        } else {
            need.max(self.capacity)
        };
        let hd = self.head_dim;
        let groups = rows * kv_width / hd;
        let (old_cap, len) = (self.capacity, self.len);
        let grow = |old: &[f32]| -> Vec<f32> {
            let mut v = vec![0f32; groups * cap * hd];
            if keep {
                for (d, s) in v
                    .chunks_exact_mut(cap * hd)
                    .zip(old.chunks_exact(old_cap * hd))
                {
                    d[..len * hd].copy_from_slice(&s[..len * hd]);
                }
            }
            v
        };
        for (k, v) in self.kv.iter_mut() {
            *k = grow(k);
            *v = grow(v);
        }
        self.rows = rows;
        self.capacity = cap;
    }
}

impl RowDecoderStack {
    /// Loads `{prefix}.layers.N.*` and `{prefix}.norm.weight`.
    pub fn load(
        src: &MappedWeights,
        prefix: &str,
        cfg: DecoderStackConfig,
        format: WeightFormat,
    ) -> Result<Self> {
        if cfg.num_kv_heads == 0 || !cfg.num_heads.is_multiple_of(cfg.num_kv_heads) {
            bail!(
                "{prefix}: {} attention heads is not a multiple of {} kv heads",
                cfg.num_heads,
                cfg.num_kv_heads
            );
        }
        if !cfg.head_dim.is_multiple_of(2) {
            bail!(
                "{prefix}: RoPE needs an even head_dim, got {}",
                cfg.head_dim
            );
        }
        let (h, hd, i) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
        let (q, kv) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let layers = (0..cfg.num_layers)
            .map(|l| {
                let p = format!("{prefix}.layers.{l}");
                let lin = |name: &str, n: usize, k: usize| {
                    LinearWeight::load(src, &format!("{p}.{name}"), n, k, format)
                        .map(AdaptedProjection::new)
                };
                let vec = |name: &str, n: usize| src.f32(&format!("{p}.{name}"), &[n]);
                Ok(RowLayer {
                    input_norm: vec("input_layernorm.weight", h)?,
                    post_norm: vec("post_attention_layernorm.weight", h)?,
                    q_norm: vec("self_attn.q_norm.weight", hd)?,
                    k_norm: vec("self_attn.k_norm.weight", hd)?,
                    q: lin("self_attn.q_proj.weight", q, h)?,
                    k: lin("self_attn.k_proj.weight", kv, h)?,
                    v: lin("self_attn.v_proj.weight", kv, h)?,
                    o: lin("self_attn.o_proj.weight", h, q)?,
                    gate: lin("mlp.gate_proj.weight", i, h)?,
                    up: lin("mlp.up_proj.weight", i, h)?,
                    down: lin("mlp.down_proj.weight", h, i)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = src.f32(&format!("{prefix}.norm.weight"), &[h])?;
        let half = hd / 2;
        let inv_freq = (0..half)
            .map(|i| (1.0 / cfg.rope_theta.powf(2.0 * i as f64 / hd as f64)) as f32)
            .collect();
        Ok(Self {
            layers,
            norm,
            cfg,
            inv_freq,
        })
    }

    pub fn config(&self) -> &DecoderStackConfig {
        &self.cfg
    }

    /// Bytes of the matrices one step reads.
    pub fn weight_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| l.projections())
            .map(|(_, p)| p.weight.bytes())
            .sum()
    }

    /// The projection named `{prefix}.layers.N.NAME.weight`, for putting an adapter on it.
    pub(super) fn projection_mut(
        &mut self,
        prefix: &str,
        name: &str,
    ) -> Option<&mut AdaptedProjection> {
        let rest = name.strip_prefix(prefix)?.strip_prefix(".layers.")?;
        let (layer, rest) = rest.split_once('.')?;
        let which = rest.strip_suffix(".weight")?;
        let layer = self.layers.get_mut(layer.parse::<usize>().ok()?)?;
        layer
            .projections_mut()
            .find(|(n, _)| *n == which)
            .map(|(_, p)| p)
    }

    /// The matrices, named as in the checkpoint under `prefix`.
    pub fn matrices(&self, prefix: &str) -> Vec<(String, &LinearWeight)> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            for (name, p) in l.projections() {
                out.push((format!("{prefix}.layers.{i}.{name}.weight"), &p.weight));
            }
        }
        out
    }

    /// A cache with room for `capacity` positions.
    pub fn new_cache(&self, capacity: usize) -> Cache {
        Cache {
            kv: (0..self.layers.len())
                .map(|_| (Vec::new(), Vec::new()))
                .collect(),
            rows: 0,
            capacity: capacity.max(1),
            len: 0,
            key_valid: None,
            next_pos: Vec::new(),
            head_dim: self.cfg.head_dim,
            adapters: Vec::new(),
        }
    }

    /// `x` `(b, s, H)` row-major → final-norm hidden states `(b, s, H)`. `valid[r][i]` marks the
    /// real (1) and left-padding (0) tokens among the new ones (`None` = all real); the new
    /// tokens are appended to `cache`, and row `r` computes with the adapter `cache` binds it to.
    pub fn forward(
        &self,
        x: &[f32],
        b: usize,
        s: usize,
        valid: Option<&[Vec<bool>]>,
        cache: &mut Cache,
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let h = c.hidden_size;
        ensure!(
            x.len() == b * s * h,
            "decoder input has {} values, expected ({b}, {s}, {h})",
            x.len()
        );
        ensure!(
            cache.adapters.is_empty() || cache.adapters.len() == b,
            "the cache binds {} rows to adapters, the batch has {b}",
            cache.adapters.len()
        );
        let tokens: Vec<Option<AdapterId>> = match cache.adapters.is_empty() {
            true => Vec::new(),
            false => (0..b * s).map(|t| cache.adapters[t / s]).collect(),
        };
        let positions = plan(b, s, valid, cache)?;
        let past = cache.len;
        let kv_width = c.num_kv_heads * c.head_dim;
        cache.reserve(b, past + s, kv_width);
        // RoPE tables per token: freqs = pos · inv_freq in f32, then cos/sin (docs/model.md §4.1).
        let half = c.head_dim / 2;
        let mut cos = vec![0f32; b * s * half];
        let mut sin = vec![0f32; b * s * half];
        for (t, pos) in positions.iter().enumerate() {
            for (i, f) in self.inv_freq.iter().enumerate() {
                let a = pos * f;
                cos[t * half + i] = libm::cos(a);
                sin[t * half + i] = libm::sin(a);
            }
        }
        let rope = RopeRows {
            cos: &cos,
            sin: &sin,
            half,
        };
        let mut x = x.to_vec();
        for (li, layer) in self.layers.iter().enumerate() {
            self.layer(layer, li, &mut x, b, s, &rope, cache, past, &tokens);
        }
        cache.len = past + s;
        rms_norm_rows(&mut x, &self.norm, c.rms_norm_eps);
        Ok(x)
    }

    #[allow(clippy::too_many_arguments)]
    fn layer(
        &self,
        l: &RowLayer,
        li: usize,
        x: &mut [f32],
        b: usize,
        s: usize,
        rope: &RopeRows<'_>,
        cache: &mut Cache,
        past: usize,
        adapters: &[Option<AdapterId>],
    ) {
        let c = &self.cfg;
        let hd = c.head_dim;
        let (nh, nkv) = (c.num_heads, c.num_kv_heads);
        let rows = b * s;

        // Attention block.
        let (q, k, v) = self.qkv(l, x, rows, rope, adapters);
        let cap = cache.capacity;
        {
            let (kc, vc) = &mut cache.kv[li];
            for r in 0..b {
                for i in 0..s {
                    let t = r * s + i;
                    for g in 0..nkv {
                        let dst = ((r * nkv + g) * cap + past + i) * hd;
                        kc[dst..dst + hd]
                            .copy_from_slice(&k[(t * nkv + g) * hd..(t * nkv + g + 1) * hd]);
                        vc[dst..dst + hd]
                            .copy_from_slice(&v[(t * nkv + g) * hd..(t * nkv + g + 1) * hd]);
                    }
                }
            }
        }
        let total = past + s;
        let scale = 1.0 / (hd as f32).sqrt();
        let rep = nh / nkv;
        let (kc, vc) = &cache.kv[li];
        let key_valid = cache.key_valid.as_ref();
        // One task per (row, head): its s queries against the row's cached keys, on the team
        // that runs the products (docs/performance.md §2.5).
        let mut heads = vec![0f32; b * nh * s * hd];
        team::for_each_chunk(&mut heads, s * hd, |rh, out| {
            let (r, head) = (rh / nh, rh % nh);
            let g = head / rep;
            let base = (r * nkv + g) * cap * hd;
            attend(
                s,
                past,
                hd,
                scale,
                |i| &q[((r * s + i) * nh + head) * hd..((r * s + i) * nh + head + 1) * hd],
                &kc[base..base + total * hd],
                &vc[base..base + total * hd],
                key_valid.map(|kv| kv[r].as_slice()),
                out,
            );
        });
        let mut att = vec![0f32; rows * nh * hd];
        for (rh, out) in heads.chunks_exact(s * hd).enumerate() {
            let (r, head) = (rh / nh, rh % nh);
            for i in 0..s {
                let dst = ((r * s + i) * nh + head) * hd;
                att[dst..dst + hd].copy_from_slice(&out[i * hd..(i + 1) * hd]);
            }
        }
        self.finish_layer(l, x, &att, rows, adapters);
    }

    /// The attention inputs of `rows` token rows: input RMSNorm, q/k/v projections, the per-head
    /// q/k norms and RoPE (token t of the rope tables for row t). Token row `t` computes with
    /// adapter `adapters[t]` (empty: none).
    pub(super) fn qkv(
        &self,
        l: &RowLayer,
        x: &[f32],
        rows: usize,
        rope: &RopeRows<'_>,
        adapters: &[Option<AdapterId>],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let c = &self.cfg;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (nh, nkv) = (c.num_heads, c.num_kv_heads);
        let eps = c.rms_norm_eps;
        let mut hn = x.to_vec();
        rms_norm_rows(&mut hn, &l.input_norm, eps);
        let inp = Input::new(&hn, rows, h);
        let mut q = l.q.forward(&inp, &hn, adapters);
        let mut k = l.k.forward(&inp, &hn, adapters);
        let v = l.v.forward(&inp, &hn, adapters);
        drop(inp);
        for (t, row) in q.chunks_exact_mut(nh * hd).enumerate() {
            for head in row.chunks_exact_mut(hd) {
                rms_norm_row(head, &l.q_norm, eps);
                rope.apply(t, head);
            }
        }
        for (t, row) in k.chunks_exact_mut(nkv * hd).enumerate() {
            for head in row.chunks_exact_mut(hd) {
                rms_norm_row(head, &l.k_norm, eps);
                rope.apply(t, head);
            }
        }
        (q, k, v)
    }

    /// The rest of a layer once the attention output `att` `(rows, heads · head_dim)` is known:
    /// `o_proj` and the residual, then the MLP block.
    pub(super) fn finish_layer(
        &self,
        l: &RowLayer,
        x: &mut [f32],
        att: &[f32],
        rows: usize,
        adapters: &[Option<AdapterId>],
    ) {
        let c = &self.cfg;
        let h = c.hidden_size;
        let o = l.o.forward(
            &Input::new(att, rows, c.num_heads * c.head_dim),
            att,
            adapters,
        );
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);

        // MLP block.
        let mut hn = x.to_vec();
        rms_norm_rows(&mut hn, &l.post_norm, c.rms_norm_eps);
        let inp = Input::new(&hn, rows, h);
        let gate = l.gate.forward(&inp, &hn, adapters);
        let mut up = l.up.forward(&inp, &hn, adapters);
        drop(inp);
        up.iter_mut()
            .zip(&gate)
            .for_each(|(u, &g)| *u *= g / (1.0 + libm::exp(-g)));
        let down = l
            .down
            .forward(&Input::new(&up, rows, c.intermediate_size), &up, adapters);
        x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
    }
}

/// Causal attention of one (row, head) into `out` (`s × head_dim`, overwritten): queries
/// `query(i)`, i < s, at positions `past + i` against the row's first `past + s` cached `keys` /
/// `vals` (`head_dim` each); `valid[j]` false masks cached left padding (`None`: every key is
/// real).
#[allow(clippy::too_many_arguments)]
pub(super) fn attend<'q>(
    s: usize,
    past: usize,
    hd: usize,
    scale: f32,
    query: impl Fn(usize) -> &'q [f32],
    keys: &[f32],
    vals: &[f32],
    valid: Option<&[bool]>,
    out: &mut [f32],
) {
    let total = past + s;
    assert_eq!(
        out.len(),
        s * hd,
        "attention output of {} values",
        out.len()
    );
    out.fill(0.0);
    let mut scores = vec![0f32; total];
    for i in 0..s {
        let qpos = past + i;
        let qv = query(i);
        let mut max = f32::NEG_INFINITY;
        for (j, sc) in scores.iter_mut().enumerate().take(qpos + 1) {
            let allowed = j == qpos || valid.is_none_or(|kv| kv[j]);
            *sc = if allowed {
                dot(qv, &keys[j * hd..(j + 1) * hd]) * scale
            } else {
                f32::NEG_INFINITY
            };
            max = max.max(*sc);
        }
        let mut sum = 0f32;
        for sc in scores.iter_mut().take(qpos + 1) {
            *sc = if *sc == f32::NEG_INFINITY {
                0.0
            } else {
                libm::exp(*sc - max)
            };
            sum += *sc;
        }
        let o = &mut out[i * hd..(i + 1) * hd];
        for (j, p) in scores.iter().enumerate().take(qpos + 1) {
            if *p != 0.0 {
                let p = p / sum;
                o.iter_mut()
                    .zip(&vals[j * hd..(j + 1) * hd])
                    .for_each(|(a, v)| *a += p * v);
            }
        }
    }
}

/// Positions of the new tokens, updating the cache's padding and next positions — the rules of
/// `layers::kv_cache::plan_step` (docs/model.md §4.1, §14).
pub(super) fn plan(
    b: usize,
    s: usize,
    valid: Option<&[Vec<bool>]>,
    cache: &mut Cache,
) -> Result<Vec<f32>> {
    if let Some(v) = valid {
        ensure!(
            v.len() == b && v.iter().all(|r| r.len() == s),
            "attention mask does not have shape [{b}, {s}]"
        );
    }
    let valid = valid.filter(|v| !v.iter().all(|r| r.iter().all(|&x| x)));
    let past = cache.len;
    if past == 0 {
        cache.next_pos = vec![0; b];
        cache.key_valid = None;
    } else if cache.next_pos.len() != b {
        bail!(
            "batch size {b} differs from the cached batch size {}",
            cache.next_pos.len()
        );
    }
    let mut positions = Vec::with_capacity(b * s);
    for (r, next) in cache.next_pos.iter_mut().enumerate() {
        for i in 0..s {
            if valid.is_none_or(|v| v[r][i]) {
                positions.push(*next as f32);
                *next += 1;
            } else {
                positions.push(1.0);
            }
        }
    }
    if valid.is_some() || cache.key_valid.is_some() {
        let kv = cache
            .key_valid
            .get_or_insert_with(|| vec![vec![true; past]; b]);
        for (r, row) in kv.iter_mut().enumerate() {
            match valid {
                Some(v) => row.extend_from_slice(&v[r]),
                None => row.extend(std::iter::repeat_n(true, s)),
            }
        }
    }
    Ok(positions)
}

pub(super) struct RopeRows<'a> {
    pub(super) cos: &'a [f32],
    pub(super) sin: &'a [f32],
    pub(super) half: usize,
}

impl RopeRows<'_> {
    /// `x·cos + rotate_half(x)·sin` for token `t` (NeoX layout, docs/model.md §4.1).
    fn apply(&self, t: usize, x: &mut [f32]) {
        let h = self.half;
        let (cos, sin) = (&self.cos[t * h..(t + 1) * h], &self.sin[t * h..(t + 1) * h]);
        let (a, b) = x.split_at_mut(h);
        for i in 0..h {
            let (x1, x2) = (a[i], b[i]);
            a[i] = x1 * cos[i] - x2 * sin[i];
            b[i] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_grows_and_keeps_positions() {
        let mut c = Cache {
            kv: vec![(Vec::new(), Vec::new())],
            rows: 0,
            capacity: 2,
            len: 0,
            key_valid: None,
            next_pos: Vec::new(),
            head_dim: 2,
            adapters: Vec::new(),
        };
        // 1 row, 2 kv heads of width 2.
        c.reserve(1, 2, 4);
        for (i, v) in c.kv[0].0.iter_mut().enumerate() {
            *v = i as f32;
        }
        c.len = 2;
        c.reserve(1, 3, 4);
        assert_eq!(c.capacity, 4);
        // Head 0 positions 0,1 then head 1 positions 0,1 (old layout [head][cap 2][2]).
        assert_eq!(&c.kv[0].0[..4], &[0., 1., 2., 3.]);
        assert_eq!(&c.kv[0].0[8..12], &[4., 5., 6., 7.]);
    }
}
