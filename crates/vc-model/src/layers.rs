//! The Qwen3 decoder block shared by the talker (docs/model.md §4.1) and the code predictor
//! (docs/model.md §5.1), its KV cache, the causal/padding mask and position bookkeeping, and where
//! weights come from.
//!
//! Blocks are pure functions of (weights, input): weights are plain [`Tensor`]s, so the same code
//! runs on loaded checkpoint tensors, on gathered FSDP shards, or on `Var`s during training.
//!
//! This module holds the stack's configuration, the block ([`DecoderLayer`], [`Projection`]) and
//! the stack ([`DecoderStack`]); `kv_cache` holds the KV cache and each step's positions and mask
//! ([`KvCache`], [`DecoderCache`], [`StepContext`]), and `tensor_source` where weights come from
//! ([`TensorSource`] and its adapters). Both are re-exported here.

use anyhow::{bail, Context};
use candle_core::{DType, Result, Tensor};

use super::autograd_ops::{self, RopeHalfTables};
use super::config::{CodePredictorConfig, TalkerConfig};
use super::ops::{self, linear, rms_norm, Numerics, Rope};

mod kv_cache;
mod tensor_source;

use kv_cache::plan_step;
pub use kv_cache::{DecoderCache, KvCache, StepContext};
pub use tensor_source::{
    adapter_names, trainable_or_frozen, AdapterSpec, RecordingSource, TensorSource,
};

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
        let mlp = if n == Numerics::Kernels {
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
            // Only built for Numerics::Kernels.
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
        let n = Numerics::Kernels;
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
