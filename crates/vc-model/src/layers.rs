//! The Qwen3 decoder block shared by the talker (docs/model.md §4.1) and the code predictor
//! (docs/model.md §5.1), its KV cache, the causal/padding mask and position bookkeeping, and where
//! weights come from.
//!
//! Blocks are pure functions of (weights, input): weights are plain [`Tensor`]s, so the same code
//! runs on loaded checkpoint tensors, on gathered FSDP shards, or on `Var`s during training.

use std::collections::BTreeSet;
use std::sync::Mutex;

use anyhow::{bail, Context};
use candle_core::{DType, Device, Result, Tensor};

use super::autograd_ops::{self, RopeHalfTables};
use super::config::{CodePredictorConfig, TalkerConfig};
use super::ops::{self, linear, rms_norm, Numerics, Rope, RopeTables};
use super::weights::Weights;

// ---------------------------------------------------------------------------------------------
// Where weights come from
// ---------------------------------------------------------------------------------------------

/// A named, shape-checked tensor provider: a loaded checkpoint ([`Weights`]) or the trainer's
/// parameter store (trainable [`Var`]s and frozen tensors). Models are built through this trait
/// only, so inference and training share one construction path.
pub trait TensorSource {
    /// The tensor `name`, which must have `shape`.
    fn tensor(&self, name: &str, shape: &[usize]) -> anyhow::Result<Tensor>;
    fn contains(&self, name: &str) -> bool;
    /// The rank and scale of the low-rank adapters this source holds beside its matrices
    /// (`{m}.lora_A.weight` `(r, in)` and `{m}.lora_B.weight` `(out, r)` for the matrix
    /// `{m}.weight`, docs/training.md §13); `None` = no adapters.
    fn adapters(&self) -> Option<AdapterSpec> {
        None
    }
}

/// What the adapters of a source share (docs/training.md §13): their rank and the scale
/// `α / r` their product is added with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdapterSpec {
    pub rank: usize,
    pub scale: f64,
}

/// The names of the two factors of the adapter on the matrix `weight` (`….weight`).
pub fn adapter_names(weight: &str) -> (String, String) {
    let module = weight.strip_suffix(".weight").unwrap_or(weight);
    (
        format!("{module}.lora_A.weight"),
        format!("{module}.lora_B.weight"),
    )
}

impl TensorSource for Weights {
    fn tensor(&self, name: &str, shape: &[usize]) -> anyhow::Result<Tensor> {
        self.get(name, shape)
    }
    fn contains(&self, name: &str) -> bool {
        Weights::contains(self, name)
    }
}

/// [`TensorSource::tensor`] for a set split into trained tensors (`Var`s, or gathered shards)
/// and frozen ones: the trained tensor `name` if there is one, else the frozen one, which must
/// have `shape`.
pub fn trainable_or_frozen(
    name: &str,
    shape: &[usize],
    trained: Option<&Tensor>,
    frozen: Option<&Tensor>,
) -> anyhow::Result<Tensor> {
    let t = match (trained, frozen) {
        (Some(v), _) => v.clone(),
        (None, Some(t)) => t.clone(),
        (None, None) => bail!("the model has no tensor {name}"),
    };
    if t.dims() != shape {
        bail!(
            "tensor {name} has shape {:?} but the model config implies {shape:?}",
            t.dims()
        );
    }
    Ok(t)
}

/// Wraps a source and records which names were read (to check that a model uses every tensor).
pub struct RecordingSource<'a> {
    inner: &'a dyn TensorSource,
    used: Mutex<BTreeSet<String>>,
}

impl<'a> RecordingSource<'a> {
    pub fn new(inner: &'a dyn TensorSource) -> Self {
        Self {
            inner,
            used: Mutex::new(BTreeSet::new()),
        }
    }
    pub fn used(&self) -> BTreeSet<String> {
        self.used.lock().expect("poisoned").clone()
    }
}

impl TensorSource for RecordingSource<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> anyhow::Result<Tensor> {
        self.used.lock().expect("poisoned").insert(name.to_string());
        self.inner.tensor(name, shape)
    }
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
    fn adapters(&self) -> Option<AdapterSpec> {
        self.inner.adapters()
    }
}

// ---------------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------------

/// Shape and numerics of one Qwen3 decoder stack (talker or code predictor).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecoderStackConfig {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
}

impl DecoderStackConfig {
    /// The talker: its interleaved M-RoPE always sees three identical position rows
    /// (docs/model.md §4.1), which is exactly 1-D RoPE, so only the default rope type is accepted.
    pub fn talker(c: &TalkerConfig) -> anyhow::Result<Self> {
        check_act(&c.hidden_act, "talker_config")?;
        if let Some(scaling) = &c.rope_scaling {
            let kind = scaling
                .get("rope_type")
                .or_else(|| scaling.get("type"))
                .and_then(|v| v.as_str())
                .unwrap_or("default");
            if kind != "default" {
                bail!("talker_config.rope_scaling.rope_type {kind:?} is not supported (only \"default\")");
            }
            if let Some(section) = scaling.get("mrope_section").and_then(|v| v.as_array()) {
                let sum: u64 = section.iter().filter_map(|v| v.as_u64()).sum();
                if sum as usize * 2 != c.head_dim {
                    bail!(
                        "talker_config.rope_scaling.mrope_section sums to {sum}, expected head_dim/2 = {}",
                        c.head_dim / 2
                    );
                }
            }
        }
        Ok(Self {
            hidden_size: c.hidden_size,
            num_layers: c.num_hidden_layers,
            num_heads: c.num_attention_heads,
            num_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            intermediate_size: c.intermediate_size,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta: c.rope_theta,
        })
    }

    pub fn code_predictor(c: &CodePredictorConfig) -> anyhow::Result<Self> {
        check_act(&c.hidden_act, "code_predictor_config")?;
        Ok(Self {
            hidden_size: c.hidden_size,
            num_layers: c.num_hidden_layers,
            num_heads: c.num_attention_heads,
            num_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            intermediate_size: c.intermediate_size,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta: c.rope_theta,
        })
    }
}

fn check_act(act: &str, what: &str) -> anyhow::Result<()> {
    if act != "silu" {
        bail!("{what}.hidden_act {act:?} is not supported (only \"silu\")");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// KV cache
// ---------------------------------------------------------------------------------------------

/// Keys and values of one attention layer, `(B, kv_heads, T, head_dim)`, in a preallocated buffer
/// that grows by doubling; appends write in place (no per-step re-concatenation).
#[derive(Debug, Clone)]
pub struct KvCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
    len: usize,
    initial_capacity: usize,
}

impl KvCache {
    pub fn new(initial_capacity: usize) -> Self {
        Self {
            k: None,
            v: None,
            len: 0,
            initial_capacity: initial_capacity.max(1),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets the contents but keeps the buffers for reuse.
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Appends `k`, `v` `(B, kv_heads, S, head_dim)` and returns views of all keys and values.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, h, s, d) = k.dims4()?;
        let need = self.len + s;
        let fits = |buf: &Option<Tensor>| -> Result<bool> {
            Ok(match buf {
                Some(t) => {
                    let (tb, th, _, td) = t.dims4()?;
                    tb == b && th == h && td == d && t.dtype() == k.dtype()
                }
                None => false,
            })
        };
        if !fits(&self.k)? {
            if self.len > 0 {
                candle_core::bail!(
                    "KV cache: appended keys {:?} do not match the cached ones",
                    k.dims()
                );
            }
            let cap = self.initial_capacity.max(need);
            self.k = Some(Tensor::zeros((b, h, cap, d), k.dtype(), k.device())?);
            self.v = Some(Tensor::zeros((b, h, cap, d), v.dtype(), v.device())?);
        }
        let (kb, vb) = (
            self.k.as_mut().expect("allocated"),
            self.v.as_mut().expect("allocated"),
        );
        let cap = kb.dim(2)?;
        if need > cap {
            let extra = need.max(2 * cap) - cap;
            let grow = |t: &Tensor| -> Result<Tensor> {
                let z = Tensor::zeros((b, h, extra, d), t.dtype(), t.device())?;
                Tensor::cat(&[t, &z], 2)
            };
            *kb = grow(kb)?;
            *vb = grow(vb)?;
        }
        kb.slice_set(&k.contiguous()?, 2, self.len)?;
        vb.slice_set(&v.contiguous()?, 2, self.len)?;
        self.len = need;
        Ok((kb.narrow(2, 0, need)?, vb.narrow(2, 0, need)?))
    }
}

/// Inference state of one decoder stack: per-layer KV caches plus, per batch row, which cached
/// positions are padding and the next RoPE position (docs/model.md §4.1: positions count real
/// tokens).
#[derive(Debug, Clone)]
pub struct DecoderCache {
    layers: Vec<KvCache>,
    /// `key_valid[b][t]`: cached position t of row b is a real token; `None` while all are.
    key_valid: Option<Vec<Vec<bool>>>,
    /// Next RoPE position of each row (= number of real tokens seen).
    next_pos: Vec<usize>,
}

impl DecoderCache {
    pub fn new(num_layers: usize, initial_capacity: usize) -> Self {
        Self {
            layers: (0..num_layers)
                .map(|_| KvCache::new(initial_capacity))
                .collect(),
            key_valid: None,
            next_pos: Vec::new(),
        }
    }

    /// Number of cached positions (including left padding).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, KvCache::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Empties the cache, keeping its buffers for the next sequence.
    pub fn reset(&mut self) {
        self.layers.iter_mut().for_each(KvCache::reset);
        self.key_valid = None;
        self.next_pos.clear();
    }
}

// ---------------------------------------------------------------------------------------------
// Positions and masks
// ---------------------------------------------------------------------------------------------

/// RoPE tables and additive attention bias for one forward pass.
pub struct StepContext {
    pub rope: RopeTables,
    /// `(B or 1, 1, S, T)` f32, 0 where attention is allowed and `-inf` elsewhere; `None` when
    /// every query may see every key (a single new token without padding).
    pub bias: Option<Tensor>,
}

impl StepContext {
    /// The context of a cache-less causal pass over `s` positions of right-padded rows (the
    /// training layout: causal attention never looks ahead, so the padding needs no mask and
    /// every row's positions are `0..s`), shared by every layer of the pass.
    pub fn causal(
        rope: &Rope,
        b: usize,
        s: usize,
        dtype: DType,
        numerics: Numerics,
        device: &Device,
    ) -> Result<Self> {
        let (positions, bias) = plan_step(b, s, None, None, device)?;
        Ok(StepContext {
            rope: rope.tables(&positions, dtype, numerics)?,
            bias,
        })
    }
}

/// Reads a `(B, S)` 0/1 attention mask to host booleans.
fn mask_rows(mask: &Tensor) -> Result<Vec<Vec<bool>>> {
    let rows = mask.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    Ok(rows
        .into_iter()
        .map(|r| r.into_iter().map(|v| v != 0.0).collect())
        .collect())
}

/// Positions and mask for `s` new tokens of `b` rows, given the `(B, S)` padding mask of the new
/// tokens (1 = real) and the cache, which is updated (padding, next positions).
/// docs/model.md §4.1/§14: a row's positions are `cumsum(mask) - 1` continuing from its cached real
/// tokens, padded positions get position 1. A query may see the causal past except padded keys; a
/// padded query sees only itself, so rows of pure padding stay finite (zero for zero inputs, as in
/// HF).
fn plan_step(
    b: usize,
    s: usize,
    mask: Option<&Tensor>,
    cache: Option<&mut DecoderCache>,
    device: &Device,
) -> Result<(Tensor, Option<Tensor>)> {
    let new_valid = match mask {
        Some(m) => {
            if m.dims() != [b, s] {
                candle_core::bail!(
                    "attention mask has shape {:?}, expected [{b}, {s}]",
                    m.dims()
                );
            }
            let rows = mask_rows(m)?;
            (!rows.iter().all(|r| r.iter().all(|&v| v))).then_some(rows)
        }
        None => None,
    };
    let mut fresh = DecoderCache::new(0, 1);
    let cache = cache.unwrap_or(&mut fresh);
    let past = cache.len();
    if past == 0 {
        cache.next_pos = vec![0; b];
        cache.key_valid = None;
    } else if cache.next_pos.len() != b {
        candle_core::bail!(
            "batch size {b} differs from the cached batch size {}",
            cache.next_pos.len()
        );
    }

    // Positions.
    let mut positions = Vec::with_capacity(b * s);
    for (r, next) in cache.next_pos.iter_mut().enumerate() {
        for i in 0..s {
            if new_valid.as_ref().is_none_or(|v| v[r][i]) {
                positions.push(*next as f32);
                *next += 1;
            } else {
                positions.push(1.0);
            }
        }
    }
    let rows_equal = new_valid.is_none() && cache.key_valid.is_none();
    let positions = if rows_equal {
        // Every row has the same positions: one row of tables broadcasts over the batch.
        Tensor::from_vec(positions[..s].to_vec(), (1, s), device)?
    } else {
        Tensor::from_vec(positions, (b, s), device)?
    };

    // Key validity over all T = past + s positions.
    if new_valid.is_some() || cache.key_valid.is_some() {
        let kv = cache
            .key_valid
            .get_or_insert_with(|| vec![vec![true; past]; b]);
        for (r, row) in kv.iter_mut().enumerate() {
            match &new_valid {
                Some(v) => row.extend_from_slice(&v[r]),
                None => row.extend(std::iter::repeat_n(true, s)),
            }
        }
    }
    let t = past + s;
    let bias = match &cache.key_valid {
        None if s == 1 => None,
        None => {
            let mut m = vec![0f32; s * t];
            for i in 0..s {
                m[i * t + past + i + 1..(i + 1) * t].fill(f32::NEG_INFINITY);
            }
            Some(Tensor::from_vec(m, (1, 1, s, t), device)?)
        }
        Some(kv) => {
            let mut m = vec![f32::NEG_INFINITY; b * s * t];
            for (r, row) in kv.iter().enumerate() {
                for i in 0..s {
                    let q = past + i;
                    let out = &mut m[(r * s + i) * t..(r * s + i + 1) * t];
                    for (j, o) in out.iter_mut().enumerate().take(q + 1) {
                        if row[j] || j == q {
                            *o = 0.0;
                        }
                    }
                }
            }
            Some(Tensor::from_vec(m, (b, 1, s, t), device)?)
        }
    };
    Ok((positions, bias))
}

// ---------------------------------------------------------------------------------------------
// Decoder layer and stack
// ---------------------------------------------------------------------------------------------

/// One `Qwen3TTSDecoderLayer` / `Qwen3TTSTalkerDecoderLayer` (docs/model.md §4.1): pre-norm
/// attention with per-head q/k RMSNorm before RoPE, GQA, then a pre-norm SwiGLU MLP. No biases.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    pub input_layernorm: Tensor,
    pub q_proj: Projection,
    pub k_proj: Projection,
    pub v_proj: Projection,
    pub o_proj: Projection,
    pub q_norm: Tensor,
    pub k_norm: Tensor,
    pub post_attention_layernorm: Tensor,
    pub gate_proj: Projection,
    pub up_proj: Projection,
    pub down_proj: Projection,
    pub cfg: DecoderStackConfig,
    pub numerics: Numerics,
}

impl DecoderLayer {
    /// Loads `{prefix}.self_attn.*`, `{prefix}.mlp.*` and the two norms.
    pub fn load(
        src: &dyn TensorSource,
        prefix: &str,
        cfg: DecoderStackConfig,
        numerics: Numerics,
    ) -> anyhow::Result<Self> {
        let (h, hd, i) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
        let (q, kv) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let get = |name: &str, shape: &[usize]| src.tensor(&format!("{prefix}.{name}"), shape);
        let proj = |name: &str, out: usize, inp: usize| {
            Projection::load(src, &format!("{prefix}.{name}.weight"), out, inp)
        };
        Ok(Self {
            input_layernorm: get("input_layernorm.weight", &[h])?,
            q_proj: proj("self_attn.q_proj", q, h)?,
            k_proj: proj("self_attn.k_proj", kv, h)?,
            v_proj: proj("self_attn.v_proj", kv, h)?,
            o_proj: proj("self_attn.o_proj", h, q)?,
            q_norm: get("self_attn.q_norm.weight", &[hd])?,
            k_norm: get("self_attn.k_norm.weight", &[hd])?,
            post_attention_layernorm: get("post_attention_layernorm.weight", &[h])?,
            gate_proj: proj("mlp.gate_proj", i, h)?,
            up_proj: proj("mlp.up_proj", i, h)?,
            down_proj: proj("mlp.down_proj", h, i)?,
            cfg,
            numerics,
        })
    }

    /// `x` `(B, S, H)` -> `(B, S, H)`.
    pub fn forward(
        &self,
        x: &Tensor,
        step: &StepContext,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let eps = self.cfg.rms_norm_eps;
        let h = rms_norm(x, &self.input_layernorm, eps, self.numerics)?;
        let x = (x + self.attention(&h, step, cache)?)?;
        let h = rms_norm(&x, &self.post_attention_layernorm, eps, self.numerics)?;
        let n = self.numerics;
        let (gate, up) = (self.gate_proj.forward(&h, n)?, self.up_proj.forward(&h, n)?);
        let mlp = if n == Numerics::CpuKernels {
            autograd_ops::swiglu(&gate, &up)?
        } else {
            (gate.silu()? * up)?
        };
        x + self.down_proj.forward(&mlp, n)?
    }

    fn attention(
        &self,
        x: &Tensor,
        step: &StepContext,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        if let (None, Some(rope)) = (&cache, step.rope.token_major()) {
            // Only built for Numerics::CpuKernels.
            return self.attention_cpu_grad(x, step, rope);
        }
        let c = &self.cfg;
        let (b, s, _) = x.dims3()?;
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let n = self.numerics;
        // (B, S, heads, hd) -> per-head RMSNorm -> (B, heads, S, hd) -> RoPE.
        let heads = |w: &Projection, norm: Option<&Tensor>, count: usize| -> Result<Tensor> {
            let t = w.forward(x, n)?.reshape((b, s, count, hd))?;
            let t = match norm {
                Some(w) => rms_norm(&t, w, c.rms_norm_eps, n)?,
                None => t,
            };
            t.transpose(1, 2)?.contiguous()
        };
        let q = step
            .rope
            .apply(&heads(&self.q_proj, Some(&self.q_norm), nh)?)?;
        let k = step
            .rope
            .apply(&heads(&self.k_proj, Some(&self.k_norm), nkv)?)?;
        let v = heads(&self.v_proj, None, nkv)?;
        let (k, v) = match cache {
            Some(cache) => cache.append(&k, &v)?,
            None => (k, v),
        };
        let t = k.dim(2)?;
        // GQA without materialising repeated keys: q head g*rep+r uses kv head g (HF repeat_kv),
        // so the q heads of one kv group are stacked along the sequence axis.
        let rep = nh / nkv;
        let q = q.reshape((b, nkv, rep * s, hd))?;
        let scores = (q.matmul(&k.t()?)? * (1.0 / (hd as f64).sqrt()))?;
        // Softmax in f32 (docs/model.md §12).
        let scores = scores.to_dtype(DType::F32)?.reshape((b, nh, s, t))?;
        let scores = match &step.bias {
            Some(bias) => scores.broadcast_add(bias)?,
            None => scores,
        };
        let probs = ops::softmax_last_dim(&scores, n)?
            .to_dtype(v.dtype())?
            .reshape((b, nkv, rep * s, t))?;
        let out = probs.matmul(&v)?.reshape((b, nh, s, hd))?.transpose(1, 2)?;
        self.o_proj.forward(&out.reshape((b, s, nh * hd))?, n)
    }

    /// The same attention through the CPU kernels with hand-written backward passes
    /// ([`autograd_ops`]), token-major throughout (no transposes); the training path on a CPU.
    fn attention_cpu_grad(
        &self,
        x: &Tensor,
        step: &StepContext,
        rope: &RopeHalfTables,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let hd = c.head_dim;
        let eps = c.rms_norm_eps;
        let n = Numerics::CpuKernels;
        let q = rope.norm_rope(&self.q_proj.forward(x, n)?, &self.q_norm, eps)?;
        let k = rope.norm_rope(&self.k_proj.forward(x, n)?, &self.k_norm, eps)?;
        let v = self.v_proj.forward(x, n)?;
        let scale = 1.0 / (hd as f64).sqrt();
        let out = autograd_ops::attention(&q, &k, &v, hd, scale, step.bias.as_ref())?;
        self.o_proj.forward(&out, n)
    }
}

/// A bias-free projection `x · Wᵀ` and, when the source holds one, its low-rank adapter: then
/// `x · Wᵀ + scale · (x · Aᵀ) · Bᵀ`, as PEFT's `lora.Linear` computes it (docs/training.md §13).
#[derive(Debug, Clone)]
pub struct Projection {
    pub weight: Tensor,
    pub adapter: Option<LowRank>,
}

/// The two factors of an adapter, `a` `(r, in)` and `b` `(out, r)`, and its scale `α / r`.
#[derive(Debug, Clone)]
pub struct LowRank {
    pub a: Tensor,
    pub b: Tensor,
    pub scale: f64,
}

impl Projection {
    /// The `(out, inp)` matrix `weight` (a name ending in `.weight`) and its adapter, if the
    /// source has adapters and one for this matrix.
    pub fn load(
        src: &dyn TensorSource,
        weight: &str,
        out: usize,
        inp: usize,
    ) -> anyhow::Result<Self> {
        let w = src.tensor(weight, &[out, inp])?;
        let adapter = match src.adapters() {
            Some(spec) => {
                let (a, b) = adapter_names(weight);
                match (src.contains(&a), src.contains(&b)) {
                    (true, true) => Some(LowRank {
                        a: src.tensor(&a, &[spec.rank, inp])?,
                        b: src.tensor(&b, &[out, spec.rank])?,
                        scale: spec.scale,
                    }),
                    (false, false) => None,
                    _ => bail!("the adapter of {weight} has only one of {a} and {b}"),
                }
            }
            None => None,
        };
        Ok(Self { weight: w, adapter })
    }

    /// `x` `(..., in)` → `(..., out)`.
    pub fn forward(&self, x: &Tensor, numerics: Numerics) -> Result<Tensor> {
        let y = linear(x, &self.weight, None, numerics)?;
        match &self.adapter {
            None => Ok(y),
            Some(ad) => {
                let low = linear(&linear(x, &ad.a, None, numerics)?, &ad.b, None, numerics)?;
                y + (low * ad.scale)?
            }
        }
    }
}

/// A decoder stack: layers, final RMSNorm and RoPE. Input embeddings in, normed hidden out.
#[derive(Debug, Clone)]
pub struct DecoderStack {
    pub layers: Vec<DecoderLayer>,
    pub norm: Tensor,
    pub cfg: DecoderStackConfig,
    rope: Rope,
    numerics: Numerics,
}

impl DecoderStack {
    /// Loads `{prefix}.layers.N.*` and `{prefix}.norm.weight`.
    pub fn load(
        src: &dyn TensorSource,
        prefix: &str,
        cfg: DecoderStackConfig,
        numerics: Numerics,
    ) -> anyhow::Result<Self> {
        if cfg.num_kv_heads == 0 || !cfg.num_heads.is_multiple_of(cfg.num_kv_heads) {
            bail!(
                "{prefix}: {} attention heads is not a multiple of {} kv heads",
                cfg.num_heads,
                cfg.num_kv_heads
            );
        }
        let layers = (0..cfg.num_layers)
            .map(|i| DecoderLayer::load(src, &format!("{prefix}.layers.{i}"), cfg, numerics))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let norm = src.tensor(&format!("{prefix}.norm.weight"), &[cfg.hidden_size])?;
        let rope = Rope::new(cfg.head_dim, cfg.rope_theta, norm.device()).context("RoPE tables")?;
        Ok(Self {
            layers,
            norm,
            cfg,
            rope,
            numerics,
        })
    }

    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    pub fn set_numerics(&mut self, numerics: Numerics) {
        self.numerics = numerics;
        self.layers.iter_mut().for_each(|l| l.numerics = numerics);
    }

    /// A cache for this stack, with room for `initial_capacity` positions before it grows.
    pub fn new_cache(&self, initial_capacity: usize) -> DecoderCache {
        DecoderCache::new(self.layers.len(), initial_capacity)
    }

    /// RoPE tables and mask for `s` new tokens of `b` rows (updates the cache bookkeeping).
    pub fn step_context(
        &self,
        b: usize,
        s: usize,
        attention_mask: Option<&Tensor>,
        cache: Option<&mut DecoderCache>,
    ) -> Result<StepContext> {
        let (positions, bias) = plan_step(b, s, attention_mask, cache, self.norm.device())?;
        let rope = self
            .rope
            .tables(&positions, self.norm.dtype(), self.numerics)?;
        Ok(StepContext { rope, bias })
    }

    /// `inputs_embeds` `(B, S, H)` -> final-norm hidden states `(B, S, H)`.
    ///
    /// `attention_mask` `(B, S)` marks real tokens (1) and left padding (0) of the new tokens;
    /// `None` = all real. Right padding needs no mask (causal attention never looks ahead and
    /// real positions are 0..n-1 either way). With a cache, the new tokens are appended to it.
    pub fn forward(
        &self,
        inputs_embeds: &Tensor,
        attention_mask: Option<&Tensor>,
        cache: Option<&mut DecoderCache>,
    ) -> Result<Tensor> {
        self.run(inputs_embeds, attention_mask, cache, None)
    }

    /// Like [`Self::forward`], also returning HF's `output_hidden_states` tuple
    /// (docs/model.md §14): the inputs, the outputs of layers `0..L-1` (all but the last), and the
    /// final-norm output.
    pub fn forward_hidden_states(
        &self,
        inputs_embeds: &Tensor,
        attention_mask: Option<&Tensor>,
        cache: Option<&mut DecoderCache>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let mut states = vec![inputs_embeds.clone()];
        let out = self.run(inputs_embeds, attention_mask, cache, Some(&mut states))?;
        states.pop(); // the last layer's pre-norm output is not part of HF's tuple
        states.push(out.clone());
        Ok((out, states))
    }

    /// The layers without the final norm (the training step applies the norm in its head unit).
    pub fn forward_layers(&self, x: &Tensor, step: &StepContext) -> Result<Tensor> {
        let mut x = x.clone();
        for layer in &self.layers {
            x = layer.forward(&x, step, None)?;
        }
        Ok(x)
    }

    /// The RoPE tables of this stack.
    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    fn run(
        &self,
        x: &Tensor,
        attention_mask: Option<&Tensor>,
        mut cache: Option<&mut DecoderCache>,
        mut collect: Option<&mut Vec<Tensor>>,
    ) -> Result<Tensor> {
        let (b, s, h) = x.dims3()?;
        if h != self.cfg.hidden_size {
            candle_core::bail!(
                "decoder input has width {h}, expected {}",
                self.cfg.hidden_size
            );
        }
        if let Some(c) = cache.as_deref() {
            if c.layers.len() != self.layers.len() {
                candle_core::bail!(
                    "cache has {} layers, the decoder {}",
                    c.layers.len(),
                    self.layers.len()
                );
            }
        }
        let step = self.step_context(b, s, attention_mask, cache.as_deref_mut())?;
        let mut x = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            let kv = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            x = layer.forward(&x, &step, kv)?;
            if let Some(states) = collect.as_deref_mut() {
                states.push(x.clone());
            }
        }
        rms_norm(&x, &self.norm, self.cfg.rms_norm_eps, self.numerics)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(t: &Tensor) -> Vec<Vec<f32>> {
        t.to_vec2::<f32>().unwrap()
    }

    #[test]
    fn positions_and_mask_left_padding() {
        let dev = Device::Cpu;
        let mask = Tensor::new(&[[0u32, 0, 1, 1], [1, 1, 1, 1]], &dev).unwrap();
        let mut cache = DecoderCache::new(1, 4);
        let (pos, bias) = plan_step(2, 4, Some(&mask), Some(&mut cache), &dev).unwrap();
        assert_eq!(rows(&pos), vec![vec![1., 1., 0., 1.], vec![0., 1., 2., 3.]]);
        let bias = bias.unwrap().squeeze(1).unwrap().to_vec3::<f32>().unwrap();
        let ninf = f32::NEG_INFINITY;
        assert_eq!(
            bias[0],
            vec![
                vec![0., ninf, ninf, ninf], // padded query sees itself only
                vec![ninf, 0., ninf, ninf],
                vec![ninf, ninf, 0., ninf],
                vec![ninf, ninf, 0., 0.],
            ]
        );
        assert_eq!(bias[1][1], vec![0., 0., ninf, ninf]);
        // Pretend the layers cached the 4 positions, then decode one token.
        cache.layers[0].len = 4;
        let (pos, bias) = plan_step(2, 1, None, Some(&mut cache), &dev).unwrap();
        assert_eq!(rows(&pos), vec![vec![2.], vec![4.]]);
        let bias = bias
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(bias, vec![ninf, ninf, 0., 0., 0., 0., 0., 0., 0., 0.]);
    }

    #[test]
    fn unpadded_steps_share_positions() {
        let dev = Device::Cpu;
        let mut cache = DecoderCache::new(1, 4);
        let (pos, bias) = plan_step(3, 2, None, Some(&mut cache), &dev).unwrap();
        assert_eq!(rows(&pos), vec![vec![0., 1.]]);
        let bias = bias
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(bias, vec![0., f32::NEG_INFINITY, 0., 0.]);
        cache.layers[0].len = 2;
        let (pos, bias) = plan_step(3, 1, None, Some(&mut cache), &dev).unwrap();
        assert_eq!(rows(&pos), vec![vec![2.]]);
        assert!(bias.is_none());
    }

    #[test]
    fn kv_cache_grows_and_resets() {
        let dev = Device::Cpu;
        let mut c = KvCache::new(2);
        let mk = |start: f32, s: usize| {
            Tensor::arange(start, start + s as f32, &dev)
                .unwrap()
                .reshape((1, 1, s, 1))
                .unwrap()
        };
        c.append(&mk(0., 1), &mk(0., 1)).unwrap();
        let (k, _) = c.append(&mk(1., 3), &mk(1., 3)).unwrap();
        assert_eq!(
            k.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![0., 1., 2., 3.]
        );
        c.reset();
        let (k, v) = c.append(&mk(7., 1), &mk(8., 1)).unwrap();
        assert_eq!(k.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![7.]);
        assert_eq!(v.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![8.]);
    }
}
