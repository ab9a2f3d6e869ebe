//! What one micro-batch's forward pass keeps for its backward pass, by backend
//! (docs/training.md §6.9): counted from the operations of `vc_model::layers`, `vc_model::ops`
//! and the training units — every operation's output that the graph holds, in the dtype it is
//! made in.
//!
//! - The CPU kernels (`Numerics::Kernels`): one node per layer function; a node keeps its
//!   inputs and its output, nothing else of size (attention recomputes its probabilities).
//! - Autograd (`Numerics::Autograd`, what CUDA runs): candle keeps the output of every plain op
//!   until the loss is dropped; RMSNorm statistics and softmax are in f32.

use super::shapes::TensorShape;
use crate::sharded::PREDICTOR_CHUNK_FRAMES;
use vc_model::config::Qwen3TtsConfig;

/// How the forward pass computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Graph {
    /// The CPU kernels (f32).
    Kernels,
    /// Plain ops under autograd with activations of `bytes` per value (4 on the CPU, 2 with bf16
    /// on CUDA).
    Autograd { bytes: usize },
}

/// The longest sample of a run, as the batch lays it out (docs/training.md §3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Longest {
    /// Text tokens of the transcript.
    pub text_tokens: usize,
    /// Audio frames (12.5 per second).
    pub frames: usize,
}

impl Longest {
    /// Talker positions a row of this sample runs: `8 + 3 + text + frames` laid out, the last
    /// one only a label.
    pub fn talker_positions(&self) -> usize {
        8 + 3 + self.text_tokens + self.frames - 1
    }
}

/// One decoder stack's shape.
#[derive(Debug, Clone, Copy)]
struct Stack {
    hidden: usize,
    q: usize,
    kv: usize,
    inter: usize,
    heads: usize,
    layers: usize,
}

/// Bytes one layer keeps for `tokens` tokens in rows of `seq` positions (attention is `seq²`
/// per row and head).
fn layer_bytes(graph: Graph, s: &Stack, tokens: usize, seq: usize) -> usize {
    let (h, q, kv, i) = (s.hidden, s.q, s.kv, s.inter);
    let rows = tokens / seq.max(1);
    match graph {
        Graph::Kernels => {
            // Norm, o_proj, residual, norm, down_proj, residual (h); q, rotated q, attention
            // output (q); k, rotated k, v (kv); gate, up, SwiGLU (i); all f32. The attention
            // node also holds its mask as f32 (rows × seq²).
            4 * tokens * (6 * h + 3 * q + 3 * kv + 3 * i) + 4 * rows * seq * seq
        }
        Graph::Autograd { bytes: a } => {
            // RMSNorm over width w: the f32 input (when it is not f32 already), x², the
            // normalised f32 values, their cast back and the product with the weight.
            let norm = |w: usize| w * (4 + 4 + a + a + if a == 4 { 0 } else { 4 });
            // Projection, per-head norm, transposed copy, RoPE (x·cos, −x2, cat, ·sin, sum).
            let rotated = |w: usize| a * w * 2 + norm(w) + a * w * 9 / 2;
            let per_token = 2 * norm(h) + 4 * a * h // norms, o_proj, residual, down_proj, residual
                + rotated(q) + 2 * a * q            // q; probabilities·v and its copy
                + rotated(kv) + 2 * a * kv          // k; v and its transposed copy
                + 4 * a * i; // gate, up, SiLU, product
                             // Scores, scaled, (f32 cast), masked, shifted, exponentiated, normalised, (cast).
            let scores = 4 * 4 + 2 * a + if a == 4 { 0 } else { 4 + a };
            per_token * tokens + scores * s.heads * rows * seq * seq
        }
    }
}

/// What low-rank adapters add to the forward pass, per decoder layer (docs/training.md §13):
/// each adapted projection keeps `rank + 3·out` values per token — `x·Aᵀ`, its product with
/// `Bᵀ`, that product scaled, and the sum that replaces the projection's output.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdapterWidths {
    /// Values per token of each talker layer's adapters, by layer.
    pub talker: Vec<usize>,
    /// The same for the code predictor's layers.
    pub predictor: Vec<usize>,
}

impl AdapterWidths {
    /// From the trained tensors' names and shapes: every `B` factor `(out, rank)` (named like
    /// `talker.model.layers.3.mlp.up_proj.lora_B.weight`) adds `rank + 3·out` to its layer.
    pub fn of<'a>(tensors: impl IntoIterator<Item = (&'a str, &'a [usize])>) -> Self {
        let mut w = Self::default();
        for (name, shape) in tensors {
            let (&[out, rank], true) = (shape, name.ends_with(".lora_B.weight")) else {
                continue;
            };
            let (stack, rest) = match name.strip_prefix("talker.code_predictor.model.layers.") {
                Some(rest) => (&mut w.predictor, rest),
                None => match name.strip_prefix("talker.model.layers.") {
                    Some(rest) => (&mut w.talker, rest),
                    None => continue,
                },
            };
            let Some(layer) = rest.split('.').next().and_then(|l| l.parse::<usize>().ok()) else {
                continue;
            };
            if stack.len() <= layer {
                stack.resize(layer + 1, 0);
            }
            stack[layer] += rank + 3 * out;
        }
        w
    }
}

/// Bytes candle's backward pass keeps for the frozen tensor `t` when the graph meets it (the
/// autograd path; docs/training.md §6.9, §13): candle computes a gradient for every operand of
/// an op whose output needs one, frozen or not, and keeps that of an operand outside the graph
/// in its store until the store is dropped after the micro-batch's backward pass — with the
/// zeros it was added to and the product it came from, whose graph holds the upstream
/// gradient. So a matrix `(out, in)` applied to T tokens keeps `3·out·in + T·out` values; a
/// norm weight, broadcast to the activation's T × width before the product, `4·T·width`; a
/// bias (added, no product) `T·width`. Embedding tables are looked up, never such an operand;
/// the CPU kernels compute no gradient for an operand outside the graph. `frames`: the frames
/// one pass of the code predictor runs.
pub fn frozen_gradient_bytes(
    cfg: &Qwen3TtsConfig,
    graph: Graph,
    rows: usize,
    longest: Longest,
    frames: usize,
    t: &TensorShape,
) -> usize {
    let Graph::Autograd { bytes: a } = graph else {
        return 0;
    };
    let name = t.name.as_str();
    if name.contains("embedding") {
        return 0;
    }
    let talker = &cfg.talker_config;
    let c = &talker.code_predictor_config;
    let (tokens, q, kv) = if name.starts_with("talker.code_predictor.") {
        (
            frames * c.num_code_groups,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        )
    } else {
        (
            rows * longest.talker_positions(),
            talker.num_attention_heads * talker.head_dim,
            talker.num_key_value_heads * talker.head_dim,
        )
    };
    match *t.shape.as_slice() {
        [out, inp] => {
            let applied_to = if name.starts_with("talker.code_predictor.lm_head.") {
                frames
            } else if name.starts_with("talker.codec_head.") {
                rows * (longest.frames + 1)
            } else {
                tokens
            };
            a * (3 * out * inp + applied_to * out)
        }
        [w] => {
            let width = if name.contains(".q_norm.") {
                q
            } else if name.contains(".k_norm.") {
                kv
            } else {
                w
            };
            let copies = if name.ends_with(".bias") { 1 } else { 4 };
            a * copies * tokens * width
        }
        _ => 0,
    }
}

/// Bytes the forward pass of one micro-batch of `rows` copies of `longest` keeps until its
/// backward pass: the talker's input stage, decoder and head, the code predictor's inputs,
/// decoder and heads, with `adapters`' share.
pub fn micro_batch_bytes(
    cfg: &Qwen3TtsConfig,
    graph: Graph,
    rows: usize,
    longest: Longest,
    adapters: &AdapterWidths,
) -> usize {
    let parts = Parts::new(cfg, graph, rows, longest, adapters);
    parts.embeddings + parts.talker_stack + parts.head + parts.predictor
}

/// The pieces of [`micro_batch_bytes`], for a run that keeps one unit's graph at a time.
#[derive(Debug, Clone, Copy)]
pub struct Parts {
    /// The input stage (text projection, embeddings, their sum).
    pub embeddings: usize,
    /// The largest talker layer.
    pub talker_layer: usize,
    pub talker_layers: usize,
    /// Every talker layer.
    pub talker_stack: usize,
    /// Final norm, code-0 logits and their cross-entropy.
    pub head: usize,
    /// The code predictor unit: inputs, its layers, its heads and cross-entropy.
    pub predictor: usize,
    /// The same for one chunk of the recomputation's frames.
    pub predictor_chunk: usize,
    /// A unit's input kept between the passes (the hidden state of every position).
    pub unit_input: usize,
    /// The code predictor unit's input (its teacher-forced input embeddings).
    pub predictor_input: usize,
}

impl Parts {
    pub fn new(
        cfg: &Qwen3TtsConfig,
        graph: Graph,
        rows: usize,
        longest: Longest,
        adapters: &AdapterWidths,
    ) -> Self {
        let t = &cfg.talker_config;
        let c = &t.code_predictor_config;
        let a = match graph {
            Graph::Kernels => 4,
            Graph::Autograd { bytes } => bytes,
        };
        let seq = longest.talker_positions();
        let tokens = rows * seq;
        let talker = Stack {
            hidden: t.hidden_size,
            q: t.num_attention_heads * t.head_dim,
            kv: t.num_key_value_heads * t.head_dim,
            inter: t.intermediate_size,
            heads: t.num_attention_heads,
            layers: t.num_hidden_layers,
        };
        let predictor = Stack {
            hidden: c.hidden_size,
            q: c.num_attention_heads * c.head_dim,
            kv: c.num_key_value_heads * c.head_dim,
            inter: c.intermediate_size,
            heads: c.num_attention_heads,
            layers: c.num_hidden_layers,
        };
        let (h, th) = (t.hidden_size, t.text_hidden_size);
        // Text rows, fc1, SiLU, fc2 on every position; codec rows, masks, the sums (about
        // four hidden-wide tensors).
        let embeddings = a * tokens * (th * 3 + h * 5);
        // Labelled positions: the frames and EOS of each row.
        let labelled = rows * (longest.frames + 1);
        let vocab = t.vocab_size;
        // Final norm over every position; logits of the labelled ones, their f32 log-softmax
        // (shifted, exponentiated, normalised).
        let head = a * tokens * h * 3 + labelled * vocab * (a + 4 * 3);
        let groups = c.num_code_groups;
        let pv = c.vocab_size;
        // The predictor's graph for `frames` frames (each a sequence of 16 positions).
        let predictor_of = |frames: usize| {
            let ptokens = frames * groups;
            let heads_out = frames * (groups - 1) * pv * (a + 4 * 3);
            // Inputs: the hidden state, 15 looked-up code embeddings and their stack (talker
            // width), projected to the predictor width when the widths differ.
            let proj = if cfg.has_mtp_projection() {
                a * ptokens * c.hidden_size
            } else {
                0
            };
            let pinputs = a * ptokens * h * 2 + proj;
            // The kernels stack the 15 head matrices into one operand.
            let stacked = match graph {
                Graph::Kernels => 4 * (groups - 1) * pv * c.hidden_size,
                Graph::Autograd { .. } => 0,
            };
            pinputs
                + layer_bytes(graph, &predictor, ptokens, groups) * predictor.layers
                + a * ptokens * adapters.predictor.iter().sum::<usize>()
                + a * ptokens * c.hidden_size
                + heads_out
                + stacked
        };
        let frames = rows * longest.frames;
        let layer = layer_bytes(graph, &talker, tokens, seq);
        let widest = adapters.talker.iter().copied().max().unwrap_or(0);
        Parts {
            embeddings,
            talker_layer: layer + a * tokens * widest,
            talker_layers: talker.layers,
            talker_stack: layer * talker.layers
                + a * tokens * adapters.talker.iter().sum::<usize>(),
            head,
            predictor: predictor_of(frames),
            predictor_chunk: predictor_of(frames.min(PREDICTOR_CHUNK_FRAMES)),
            unit_input: a * tokens * h,
            predictor_input: a * frames * groups * h,
        }
    }

    /// The largest graph one unit keeps when a `full` pass recomputes one unit at a time (the
    /// code predictor a chunk of frames at a time).
    pub fn largest_unit(&self) -> usize {
        self.embeddings
            .max(self.talker_layer)
            .max(self.head)
            .max(self.predictor_chunk)
    }

    /// The inputs a `full` pass keeps of every unit for the backward pass.
    pub fn kept_inputs(&self) -> usize {
        self.unit_input * (self.talker_layers + 2) + self.predictor_input
    }
}
