//! Text in, 24 kHz audio out: a loaded model (talker, tokenizer, codec, speaker encoder when
//! the model has one) and the official `generate_voice_clone` / `generate_custom_voice`
//! pipelines on top of the prompt builder and the frame loop (docs/model.md §6, §7).

use anyhow::{bail, ensure, Context, Result};
use candle_core::{Device, Tensor};

use super::precision::Precision;
use super::prompt::{self, Embed, IclBranch, IclReference, PromptSpec, SpeakerSlot, SpecialEmbeds};
use super::runaway::{GuardStop, RowGuard, RunawayGuard};
use super::sampling::{Code0Processors, RowRng, Sampling};
use super::talker_loop::{self, Generated, LoopOptions};
use super::text_split;
use vc_core::artifacts::adapter::AdapterDir;
use vc_core::artifacts::codes::{frames_from_rows, CodeFrame};
use vc_core::hub::ModelSource;
use vc_model::codec::Codec;
use vc_model::files::{GenerationConfig, ModelFiles};
use vc_model::infer;
use vc_model::ops::Numerics;
use vc_model::speaker::SpeakerEncoder;
use vc_model::talker::Talker;
use vc_model::text::TextTokenizer;
use vc_model::weights::{MappedWeights, Weights};

/// Whose voice speaks.
#[derive(Debug, Clone)]
pub enum Voice {
    /// Zero-shot clone from a speaker x-vector (`x_vector_only_mode`).
    XVector(Vec<f32>),
    /// In-context clone: x-vector plus the reference clip's codes and transcript.
    Icl {
        xvector: Vec<f32>,
        ref_codes: Vec<CodeFrame>,
        ref_text: String,
    },
    /// A named speaker of a CustomVoice / fine-tuned model (`spk_id`).
    Speaker(String),
    /// A speaker of a low-rank adapter kept beside the base model (docs/serving.md §7): its
    /// x-vector rounded to bf16, as the merged export stores it in the speaker's codec row, and
    /// the adapter its rows compute with ([`Synthesizer::add_adapter`]).
    Adapter {
        adapter: infer::AdapterId,
        xvector: Vec<f32>,
    },
}

impl Voice {
    /// Whether the official default for this voice is `non_streaming_mode` (the
    /// `generate_custom_voice` pipeline: named speakers, and adapter speakers, which are named
    /// speakers of their merged export).
    pub fn custom_voice(&self) -> bool {
        matches!(self, Voice::Speaker(_) | Voice::Adapter { .. })
    }
}

/// One utterance to synthesise.
#[derive(Debug, Clone)]
pub struct Request {
    pub text: String,
    /// "auto" or a key of `codec_language_id` (case-insensitive).
    pub language: String,
    pub voice: Voice,
    /// The official `non_streaming_mode`.
    pub non_streaming: bool,
    /// The voice's speaking pace in frames per text token, which sets each chunk's frame
    /// budget (docs/model.md §7.2); `None`: not known, the model's default pace.
    pub pace: Option<f64>,
}

/// The default most frames in one chunk of streamed audio (`speak.stream_chunk_frames`): a push
/// of 32 frames costs the stream decoder about the offline decoder's share of them
/// (docs/performance.md §10.6).
pub const STREAM_CHUNK_FRAMES: usize = 32;

/// Decoding settings shared by a call.
#[derive(Debug, Clone)]
pub struct DecodeOptions {
    pub code0: Sampling,
    pub sub_codes: Sampling,
    pub repetition_penalty: f64,
    /// At most this many frames per utterance chunk.
    pub max_frames: usize,
    /// The guards that stop a chunk missing its end or looping (docs/model.md §7.2).
    pub runaway: RunawayGuard,
    pub seed: u64,
    /// Rows generated together.
    pub batch_size: usize,
    /// Texts longer than this (characters) are split at sentence boundaries; 0 = never.
    pub max_chunk_chars: usize,
    /// A streamed response's audio goes out in chunks of at most this many frames once it is
    /// under way ([`super::AudioChunks`]).
    pub stream_chunk_frames: usize,
}

impl DecodeOptions {
    /// The model's generation defaults (docs/model.md §2; `max_new_tokens` N gives N−1 frames,
    /// docs/model.md §14).
    pub fn from_generation_config(g: &GenerationConfig) -> Self {
        DecodeOptions {
            code0: Sampling {
                do_sample: g.do_sample,
                temperature: g.temperature,
                top_k: g.top_k,
                top_p: g.top_p,
            },
            sub_codes: Sampling {
                do_sample: g.subtalker_dosample,
                temperature: g.subtalker_temperature,
                top_k: g.subtalker_top_k,
                top_p: g.subtalker_top_p,
            },
            repetition_penalty: g.repetition_penalty,
            max_frames: g.max_new_tokens.saturating_sub(1).max(1),
            runaway: RunawayGuard::ON,
            seed: 0,
            batch_size: 8,
            max_chunk_chars: 0,
            stream_chunk_frames: STREAM_CHUNK_FRAMES,
        }
    }
}

/// The result of one request.
#[derive(Debug, Clone)]
pub struct Speech {
    /// Generated frames (all chunks in order; ICL reference codes not included).
    pub frames: Vec<CodeFrame>,
    /// Per chunk: the EOS step, or `None` when the frame limit or a guard stopped it.
    pub eos_steps: Vec<Option<usize>>,
    /// The chunks a runaway guard stopped (docs/model.md §7.2).
    pub guard_stops: Vec<GuardStop>,
    /// 24 kHz mono samples.
    pub wav: Vec<f32>,
    /// ICL alignment branch per chunk (streaming ICL only).
    pub icl_branches: Vec<Option<IclBranch>>,
}

/// One row of the frame loop for a caller that drives it (see [`Synthesizer::row_plans`]).
#[derive(Debug, Clone)]
pub struct RowPlan {
    pub prompt: prompt::TalkerPrompt,
    /// In-context cloning: the reference codes decoded in front of the generated frames and
    /// cut off again (docs/model.md §7).
    pub ref_codes: Option<Vec<CodeFrame>>,
    /// Tokens of the text's assistant prompt (usage reporting).
    pub text_tokens: usize,
    /// The adapter the row computes with ([`Voice::Adapter`]).
    pub adapter: Option<infer::AdapterId>,
    /// The chunk's text (for a guard's report).
    pub text: String,
    /// What ends the row besides EOS: its frame budget or limit, the loop guard.
    pub guard: RowGuard,
}

/// Which implementation runs the talker.
enum TalkerBackend {
    /// The candle modules (CUDA, and `bf16` on a CPU).
    Candle(Box<Talker>),
    /// The row inference path ([`infer::RowTalker`]).
    Row(Box<infer::RowTalker>),
}

/// Pause inserted between the chunks of a split text (seconds).
const CHUNK_PAUSE_SECONDS: f32 = 0.12;

pub struct Synthesizer {
    pub files: ModelFiles,
    backend: TalkerBackend,
    precision: Precision,
    device: Device,
    pub tokenizer: TextTokenizer,
    pub codec: Codec,
    special: SpecialEmbeds,
    speaker_encoder: Option<SpeakerEncoder>,
}

impl Synthesizer {
    /// Loads a model directory or hub repository for inference on `device`.
    pub fn load(source: &ModelSource, precision: Precision, device: &Device) -> Result<Self> {
        Self::from_files(ModelFiles::resolve(source)?, precision, device)
    }

    /// Loads resolved model files for inference on `device` in `precision`.
    pub fn from_files(files: ModelFiles, precision: Precision, device: &Device) -> Result<Self> {
        let source = files.source.clone();
        let tokenizer = files.text_tokenizer()?;
        let backend = match precision.row_format(device) {
            Some(format) => {
                let mapped = MappedWeights::open(&files.checkpoint.shards)?
                    .with_overlay(files.overlay.clone());
                let talker = infer::RowTalker::load(&mapped, &files.config, format)
                    .with_context(|| format!("cannot build the talker of {}", source.describe()))?;
                TalkerBackend::Row(Box::new(talker))
            }
            None => {
                ensure!(
                    !matches!(precision, Precision::Q8 | Precision::Q4),
                    "precision {precision} runs on the CPU only (this build uses {device:?}); \
                     choose bf16 or f32"
                );
                let mut weights = Weights::load_as(
                    &files.checkpoint.shards,
                    precision.activations(),
                    device,
                    |n| n.starts_with("talker.").then(|| precision.dtype_of(n)),
                )?;
                if let Some(overlay) = &files.overlay {
                    // What an adapter changes, as the checkpoint would store it merged.
                    let mapped = MappedWeights::open(&files.checkpoint.shards)?
                        .with_overlay(Some(overlay.clone()));
                    for name in overlay.names().filter(|n| n.starts_with("talker.")) {
                        let shape = weights.get_any(name)?.dims().to_vec();
                        let v = mapped.f32(name, &shape)?;
                        weights.replace(name, Tensor::from_vec(v, shape.as_slice(), device)?)?;
                    }
                }
                let talker = Talker::load(&weights, &files.config, Numerics::Fused)
                    .with_context(|| format!("cannot build the talker of {}", source.describe()))?;
                TalkerBackend::Candle(Box::new(talker))
            }
        };
        let codec = Codec::from_files(&files.speech_tokenizer()?)?;
        let special = SpecialEmbeds::new(Self::embedder_of(&backend), &files.config)?;
        Ok(Synthesizer {
            files,
            backend,
            precision,
            device: device.clone(),
            tokenizer,
            codec,
            special,
            speaker_encoder: None,
        })
    }

    fn embedder_of(backend: &TalkerBackend) -> &dyn Embed {
        match backend {
            TalkerBackend::Candle(t) => t.as_ref(),
            TalkerBackend::Row(t) => t.as_ref(),
        }
    }

    /// The precision the model runs in.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Which implementation and kernels run the talker and how many bytes its per-frame
    /// matrices hold, for logs (e.g. "q8 on the CPU (avx512-vnni kernels, 1760.2 MB read per
    /// frame, 621345678 bytes)": the bytes a frame reads, then those the matrices hold).
    pub fn describe_backend(&self) -> String {
        let isa = vc_kernels::isa::Isa::detected();
        match &self.backend {
            TalkerBackend::Candle(_) => format!("{} on {:?} (candle)", self.precision, self.device),
            TalkerBackend::Row(t) => {
                let bytes: usize = t.matrices().iter().map(|(_, w)| w.bytes()).sum();
                let per_frame = t.step_weight_bytes() + t.code_predictor.weight_bytes_per_frame();
                let kernels = match self.precision {
                    Precision::Q8 => isa.q8_path(),
                    Precision::Q4 => isa.q4_path(),
                    _ => isa.bf16_path(),
                };
                let widened = t
                    .matrices()
                    .iter()
                    .any(|(_, w)| matches!(w, vc_model::linear::LinearWeight::Bf16 { .. }));
                format!(
                    "{} on the CPU ({kernels} kernels{}, {:.1} MB read per frame, {bytes} bytes)",
                    self.precision,
                    if widened {
                        ", bf16 matrices widened to f32 in registers"
                    } else {
                        ""
                    },
                    per_frame as f64 / 1e6
                )
            }
        }
    }

    /// The talker of the row inference path, when that path runs.
    pub fn row_talker(&self) -> Option<&infer::RowTalker> {
        match &self.backend {
            TalkerBackend::Row(t) => Some(t),
            TalkerBackend::Candle(_) => None,
        }
    }

    /// The candle talker, when that path runs.
    pub fn candle_talker(&self) -> Option<&Talker> {
        match &self.backend {
            TalkerBackend::Candle(t) => Some(t),
            TalkerBackend::Row(_) => None,
        }
    }

    pub fn config(&self) -> &vc_model::config::Qwen3TtsConfig {
        &self.files.config
    }

    /// Speaker names of a CustomVoice / fine-tuned model (empty for Base models).
    pub fn speakers(&self) -> Vec<String> {
        self.config().talker_config.spk_id.keys().cloned().collect()
    }

    /// Keeps `adapter` beside the base model on the row inference path, factored
    /// (docs/serving.md §7), and returns its speakers as voices, in row order. The base must be
    /// the Base model the adapter was trained on (the caller checks its identity); adapters
    /// that also replace whole modules (`train.lora_full`) would need a copy of each such module
    /// per adapter and are refused.
    /// The factors move into the talker: the adapter is held once.
    pub fn add_adapter(&mut self, adapter: AdapterDir) -> Result<Vec<(String, Voice)>> {
        let what = format!("the adapter {}", adapter.dir.display());
        ensure!(
            self.config().tts_model_type == "base",
            "{what} goes on a Base model, but {} is a {} model",
            self.files.source.describe(),
            self.config().tts_model_type
        );
        if !adapter.saved.is_empty() {
            bail!(
                "{what} also replaces whole modules ({}, train.lora_full): kept beside a shared \
                 base, only adapters of decoder-layer matrices are served; serve its merged \
                 export (`voiceclone export`) or speak with `voiceclone speak --adapter`",
                adapter.saved.keys().cloned().collect::<Vec<_>>().join(", ")
            );
        }
        ensure!(
            !adapter.speakers.is_empty(),
            "{what} holds no speaker (its speakers.safetensors is empty)"
        );
        let h = self.config().talker_config.hidden_size;
        let TalkerBackend::Row(talker) = &mut self.backend else {
            bail!(
                "{what}: adapters kept beside the base model run on the row inference path \
                 (precision f32, bf16-weights, q8 or q4), not {}",
                self.precision
            );
        };
        let scale = adapter.scale();
        let id = talker
            .add_adapter(adapter.factors, scale)
            .with_context(|| what.clone())?;
        adapter
            .speakers
            .into_iter()
            .map(|(name, x)| {
                ensure!(
                    x.len() == h,
                    "{what}: the x-vector of {name:?} has {} values, the model needs {h}",
                    x.len()
                );
                let xvector = x
                    .iter()
                    .map(|v| half::bf16::from_f32(*v).to_f32())
                    .collect();
                Ok((
                    name,
                    Voice::Adapter {
                        adapter: id,
                        xvector,
                    },
                ))
            })
            .collect()
    }

    /// The x-vector of a 24 kHz reference waveform (loads the speaker encoder on first use).
    pub fn xvector(&mut self, wav24: &[f32]) -> Result<Vec<f32>> {
        if self.speaker_encoder.is_none() {
            self.speaker_encoder = Some(SpeakerEncoder::from_model(
                &self.files.source,
                &Device::Cpu,
            )?);
        }
        let enc = self.speaker_encoder.as_ref().expect("loaded above");
        enc.embed(wav24, 24_000)
    }

    /// `create_voice_clone_prompt` on a 24 kHz waveform: ICL when a transcript is given,
    /// x-vector only otherwise.
    pub fn clone_voice(&mut self, wav24: &[f32], ref_text: Option<&str>) -> Result<Voice> {
        let xvector = self.xvector(wav24)?;
        Ok(match ref_text {
            None => Voice::XVector(xvector),
            Some(text) => {
                ensure!(!text.trim().is_empty(), "the reference transcript is empty");
                let ref_codes = frames_from_rows(&self.codec.encode(wav24)?)?;
                Voice::Icl {
                    xvector,
                    ref_codes,
                    ref_text: text.to_string(),
                }
            }
        })
    }

    /// Synthesises every request. Rows (requests, or chunks of long ones) are generated
    /// `batch_size` at a time; each has its own random stream, so the result does not depend on
    /// the grouping. `progress(rows_done, rows_total, frames_of_current_batch)` is called after
    /// every generated step.
    pub fn synthesize(
        &self,
        requests: &[Request],
        opts: &DecodeOptions,
        mut progress: impl FnMut(usize, usize, usize),
    ) -> Result<Vec<Speech>> {
        ensure!(opts.max_frames > 0, "the frame limit must be at least 1");
        ensure!(opts.batch_size > 0, "the batch size must be at least 1");
        ensure!(
            !requests
                .iter()
                .any(|r| matches!(r.voice, Voice::Adapter { .. })),
            "adapter voices kept beside the base model are spoken by `voiceclone serve`; \
             `voiceclone speak --adapter DIR` puts one adapter on at load"
        );
        // (request, chunk, spec, chunk text)
        let mut rows = Vec::new();
        for (i, req) in requests.iter().enumerate() {
            let text = req.text.trim();
            if text.is_empty() {
                bail!("text {} is empty", i + 1);
            }
            for (c, chunk) in text_split::split(text, opts.max_chunk_chars)
                .into_iter()
                .enumerate()
            {
                let spec = self.prompt_spec(req, &chunk)?;
                rows.push((i, c, spec, chunk));
            }
        }
        let loop_opts = self.loop_options(opts);
        let mut generated: Vec<(Generated, Option<IclBranch>)> = Vec::with_capacity(rows.len());
        let mut done = 0;
        for group in rows.chunks(opts.batch_size) {
            let mut prompts = Vec::with_capacity(group.len());
            let mut branches = Vec::with_capacity(group.len());
            let mut guards = Vec::with_capacity(group.len());
            for (i, _, spec, _) in group {
                guards.push(Self::row_guard(opts, spec, requests[*i].pace));
                let (p, branch) = prompt::build(
                    Self::embedder_of(&self.backend),
                    self.config(),
                    &self.special,
                    spec,
                )?;
                prompts.push(p);
                branches.push(branch);
            }
            let mut rngs: Vec<RowRng> = group
                .iter()
                .map(|(i, c, _, _)| RowRng::new(opts.seed, *i as u64, *c as u64))
                .collect();
            let observe = |frames| progress(done, rows.len(), frames);
            let out = match &self.backend {
                TalkerBackend::Candle(t) => talker_loop::generate(
                    t.as_ref(),
                    &prompts,
                    &self.special.pad,
                    &loop_opts,
                    &mut guards,
                    &mut rngs,
                    observe,
                )?,
                TalkerBackend::Row(t) => talker_loop::generate(
                    t.as_ref(),
                    &prompts,
                    &self.special.pad,
                    &loop_opts,
                    &mut guards,
                    &mut rngs,
                    observe,
                )?,
            };
            generated.extend(out.into_iter().zip(branches));
            done += group.len();
            progress(done, rows.len(), 0);
        }

        let mut speech: Vec<Speech> = requests
            .iter()
            .map(|_| Speech {
                frames: Vec::new(),
                eos_steps: Vec::new(),
                guard_stops: Vec::new(),
                wav: Vec::new(),
                icl_branches: Vec::new(),
            })
            .collect();
        let pause = vec![0.0f32; self.chunk_pause_samples()];
        for ((i, c, spec, chunk), (g, branch)) in rows.iter().zip(generated) {
            let wav = self.decode(&g.frames, spec.icl.as_ref())?;
            let s = &mut speech[*i];
            if !s.eos_steps.is_empty() {
                s.wav.extend_from_slice(&pause);
            }
            s.wav.extend(wav);
            if let Some(why) = g.stopped {
                s.guard_stops
                    .push(GuardStop::new(*c, chunk, g.frames.len(), why));
            }
            s.frames.extend(g.frames);
            s.eos_steps.push(g.eos_step);
            s.icl_branches.push(branch);
        }
        Ok(speech)
    }

    /// The frame loop's settings for `opts` (docs/model.md §7).
    pub fn loop_options(&self, opts: &DecodeOptions) -> LoopOptions {
        let t = &self.config().talker_config;
        LoopOptions {
            code0: opts.code0,
            sub_codes: opts.sub_codes,
            processors: Code0Processors {
                repetition_penalty: opts.repetition_penalty,
                eos: t.codec_eos_token_id,
                min_new_tokens: 2,
                suppress_from: t.vocab_size.saturating_sub(1024),
            },
            max_frames: opts.max_frames,
        }
    }

    /// What ends a row of `spec` besides EOS under `opts`, for a voice of `pace` frames per
    /// text token: the chunk's frame budget or the frame limit, and the loop guard
    /// (docs/model.md §7.2).
    fn row_guard(opts: &DecodeOptions, spec: &PromptSpec, pace: Option<f64>) -> RowGuard {
        RowGuard::new(opts.runaway, spec.text.text().len(), pace, opts.max_frames)
    }

    /// The rows [`Self::synthesize`] generates for one request — its text split into chunks
    /// by `opts.max_chunk_chars` — with their prompts, for a caller that runs the frame loop
    /// itself (`voiceclone serve`'s continuous batching, `crate::continuous_batch`). Row `c` of
    /// request line `i` draws from `RowRng::new(seed, i, c)`.
    pub fn row_plans(&self, req: &Request, opts: &DecodeOptions) -> Result<Vec<RowPlan>> {
        let text = req.text.trim();
        ensure!(!text.is_empty(), "the text is empty");
        let ref_codes = match &req.voice {
            Voice::Icl { ref_codes, .. } => Some(ref_codes.clone()),
            _ => None,
        };
        let adapter = match &req.voice {
            Voice::Adapter { adapter, .. } => Some(*adapter),
            _ => None,
        };
        text_split::split(text, opts.max_chunk_chars)
            .into_iter()
            .map(|chunk| {
                let spec = self.prompt_spec(req, &chunk)?;
                let guard = Self::row_guard(opts, &spec, req.pace);
                let (prompt, _) = prompt::build(
                    Self::embedder_of(&self.backend),
                    self.config(),
                    &self.special,
                    &spec,
                )?;
                Ok(RowPlan {
                    prompt,
                    ref_codes: ref_codes.clone(),
                    text_tokens: spec.text.ids.len(),
                    adapter,
                    text: chunk,
                    guard,
                })
            })
            .collect()
    }

    /// `tts_pad_embed` `(1, H)`: the text vector of frames after the text (docs/model.md §5.4).
    pub fn pad_embed(&self) -> &Tensor {
        &self.special.pad
    }

    /// Samples of silence between the chunks of a split text.
    pub fn chunk_pause_samples(&self) -> usize {
        (CHUNK_PAUSE_SECONDS * self.codec.output_sample_rate() as f32) as usize
    }

    /// Waveform of generated frames; for ICL the reference codes are decoded in front and the
    /// reference part is cut off exactly as the official wrapper does (docs/model.md §7).
    fn decode(&self, frames: &[CodeFrame], icl: Option<&IclReference>) -> Result<Vec<f32>> {
        let Some(icl) = icl else {
            return self.codec.decode(frames);
        };
        let ref_codes: Vec<Vec<u32>> = icl.ref_codes.to_vec2::<u32>()?;
        let ref_len = ref_codes.len();
        let mut all: Vec<Vec<u32>> = ref_codes;
        all.extend(frames.iter().map(|f| f.to_vec()));
        let total = all.len();
        let wav = self.codec.decode(&all)?;
        // `int(ref_len / max(total_len, 1) * wav.shape[0])`, in float64 like Python.
        let cut = (ref_len as f64 / total.max(1) as f64 * wav.len() as f64) as usize;
        Ok(wav[cut.min(wav.len())..].to_vec())
    }

    fn prompt_spec(&self, req: &Request, text: &str) -> Result<PromptSpec> {
        let cfg = self.config();
        let device = &self.device;
        let speaker_name = match &req.voice {
            Voice::Speaker(name) => Some(name.as_str()),
            _ => None,
        };
        let language_id = prompt::language_id(cfg, &req.language, speaker_name)?;
        let (speaker, icl) = match &req.voice {
            Voice::XVector(x) | Voice::Adapter { xvector: x, .. } => {
                (SpeakerSlot::XVector(self.xvector_tensor(x)?), None)
            }
            Voice::Icl {
                xvector,
                ref_codes,
                ref_text,
            } => {
                ensure!(
                    !ref_codes.is_empty(),
                    "the reference clip has no codec frames"
                );
                let flat: Vec<u32> = ref_codes.iter().flatten().copied().collect();
                let codes = Tensor::from_vec(flat, (ref_codes.len(), 16), device)?;
                (
                    SpeakerSlot::XVector(self.xvector_tensor(xvector)?),
                    Some(IclReference {
                        ref_prompt: self.tokenizer.ref_prompt(ref_text)?,
                        ref_codes: codes,
                    }),
                )
            }
            Voice::Speaker(name) => {
                let spk = &cfg.talker_config.spk_id;
                match spk.get(&name.to_lowercase()) {
                    Some(&row) => (SpeakerSlot::CodecRow(row), None),
                    None if spk.is_empty() => bail!(
                        "this model has no named speakers (tts_model_type {:?}); clone a voice \
                         with --ref-audio instead of --speaker",
                        cfg.tts_model_type
                    ),
                    None => bail!(
                        "unknown speaker {name:?}; this model has: {}",
                        spk.keys().cloned().collect::<Vec<_>>().join(", ")
                    ),
                }
            }
        };
        Ok(PromptSpec {
            text: self.tokenizer.assistant_prompt(text)?,
            language_id,
            speaker,
            icl,
            instruct: None,
            non_streaming: req.non_streaming,
        })
    }

    fn xvector_tensor(&self, x: &[f32]) -> Result<Tensor> {
        let h = self.config().talker_config.hidden_size;
        ensure!(
            x.len() == h,
            "the speaker embedding has {} values but this model's talker expects {h} \
             (was it made with another model?)",
            x.len()
        );
        Ok(Tensor::new(x, &self.device)?)
    }
}
