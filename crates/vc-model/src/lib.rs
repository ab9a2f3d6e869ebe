//! `vc-model`: the Qwen3-TTS port (described in docs/model.md). Model code knows nothing of the
//! CLI, the workspace or files beyond the model directory it is given.
//!
//! | module | what |
//! |---|---|
//! | [`config`], [`files`], [`weights`] | `config.json`, the model directory checked before loading, memory-mapped tensors |
//! | [`text`] | the tokenizer and the prompt strings |
//! | [`ops`], [`layers`] | numeric primitives in three modes, the Qwen3 decoder block and its KV cache (`layers::kv_cache`: the cache, positions and masks; `layers::tensor_source`: where weights come from) |
//! | [`talker`], [`code_predictor`] | the two decoders of a frame (candle tensors: training, GPU) |
//! | [`infer`], [`linear`], [`bf16_matmul`] | the row inference path, loops on plain f32 rows (`infer::decoder_stack`, `infer::code_predictor`, `infer::talker`, `infer::row_step`, `infer::adapters`, `infer::row_math`), its weight formats |
//! | [`speaker`], [`mel`] | the speaker encoder and its log-mel front end |
//! | [`codec`] | the 12 Hz speech tokenizer, encoder and decoder, offline and streaming |
//! | [`autograd_ops`] | training ops with hand-written backward passes (their loops: `vc_kernels::grad`) |
//! | [`overlay`], [`adapted_files`] | a checkpoint's tensors changed as they are read: adapters, trained tensors |

pub mod adapted_files;
pub mod autograd_ops;
pub mod bf16_matmul;
pub mod code_predictor;
pub mod codec;
pub mod config;
pub mod files;
pub mod infer;
pub mod layers;
pub mod linear;
pub mod mel;
pub mod ops;
pub mod overlay;
pub mod speaker;
pub mod talker;
pub mod text;
pub mod weights;
