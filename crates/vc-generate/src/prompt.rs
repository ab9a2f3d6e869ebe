//! The talker's input for one utterance (docs/model.md §6,
//! `Qwen3TTSForConditionalGeneration.generate` and `generate_icl_prompt`): role tokens, the codec
//! tag prefix with the speaker slot, and one of the four text/codec tails, plus the trailing text
//! fed one vector per generated frame.

use anyhow::{bail, ensure, Result};
use candle_core::{DType, Device, Tensor};

use vc_model::config::Qwen3TtsConfig;
use vc_model::talker::Talker;
use vc_model::text::{AssistantPrompt, RefPrompt};

/// What the prompt builder needs of a talker: its embeddings (docs/model.md §3.3, §5.4), as
/// tensors on its device. Implemented by the candle talker and by the talker of the row
/// inference path ([`vc_model::infer::RowTalker`]).
pub trait Embed {
    /// `text_projection(text_embedding(ids))` `(n, H)`.
    fn text_embed(&self, ids: &[u32]) -> Result<Tensor>;
    /// `codec_embedding(ids)` `(n, H)`.
    fn codec_embed(&self, ids: &[u32]) -> Result<Tensor>;
    /// Frame embeddings of codes `(n, 16)` u32, `(n, H)`.
    fn frame_embed(&self, codes: &Tensor) -> Result<Tensor>;
    fn device(&self) -> &Device;
}

impl Embed for Talker {
    fn text_embed(&self, ids: &[u32]) -> Result<Tensor> {
        Ok(Talker::text_embed(
            self,
            &Tensor::new(ids, Embed::device(self))?,
        )?)
    }
    fn codec_embed(&self, ids: &[u32]) -> Result<Tensor> {
        Ok(Talker::codec_embed(
            self,
            &Tensor::new(ids, Embed::device(self))?,
        )?)
    }
    fn frame_embed(&self, codes: &Tensor) -> Result<Tensor> {
        Ok(Talker::frame_embed(
            self,
            &codes.to_device(Embed::device(self))?,
        )?)
    }
    fn device(&self) -> &Device {
        self.codec_head.device()
    }
}

impl Embed for vc_model::infer::RowTalker {
    fn text_embed(&self, ids: &[u32]) -> Result<Tensor> {
        let h = self.hidden_size();
        let v = vc_model::infer::RowTalker::text_embed(self, ids)?;
        Ok(Tensor::from_vec(v, (ids.len(), h), &Device::Cpu)?)
    }
    fn codec_embed(&self, ids: &[u32]) -> Result<Tensor> {
        let h = self.hidden_size();
        let v = vc_model::infer::RowTalker::codec_embed(self, ids)?;
        Ok(Tensor::from_vec(v, (ids.len(), h), &Device::Cpu)?)
    }
    fn frame_embed(&self, codes: &Tensor) -> Result<Tensor> {
        let rows = codes.to_dtype(DType::U32)?.to_vec2::<u32>()?;
        let frames = rows
            .iter()
            .map(|r| {
                <[u32; 16]>::try_from(r.as_slice())
                    .map_err(|_| anyhow::anyhow!("a frame has {} codes, expected 16", r.len()))
            })
            .collect::<Result<Vec<_>>>()?;
        let v = vc_model::infer::RowTalker::frame_embed(self, &frames)?;
        Ok(Tensor::from_vec(
            v,
            (frames.len(), self.hidden_size()),
            &Device::Cpu,
        )?)
    }
    fn device(&self) -> &Device {
        static CPU: Device = Device::Cpu;
        &CPU
    }
}

/// What fills the speaker slot of the codec prefix (docs/model.md §6 `S`).
#[derive(Debug, Clone)]
pub enum SpeakerSlot {
    /// A speaker-encoder x-vector `(H,)` entering as a raw vector (Base clone, both modes).
    XVector(Tensor),
    /// A row of the codec embedding (CustomVoice / fine-tuned `spk_id`).
    CodecRow(u32),
    /// No speaker vector (VoiceDesign-style prompts).
    None,
}

/// In-context clone material: the reference transcript and its codec frames `(T_ref, 16)` u32.
#[derive(Debug, Clone)]
pub struct IclReference {
    pub ref_prompt: RefPrompt,
    pub ref_codes: Tensor,
}

/// Everything that shapes one talker prompt.
#[derive(Debug, Clone)]
pub struct PromptSpec {
    pub text: AssistantPrompt,
    /// `None` = "auto" (the nothink prefix), else the codec language id (docs/model.md §6).
    pub language_id: Option<u32>,
    pub speaker: SpeakerSlot,
    pub icl: Option<IclReference>,
    /// Whole instruction prompt ids, prepended before the role tokens.
    pub instruct: Option<Vec<u32>>,
    /// The official `non_streaming_mode`: the whole text before the first frame.
    pub non_streaming: bool,
}

/// Prefill embeddings `(L, H)` and trailing text `(K, H)` of one row; frame `k` of the
/// generation adds `trailing[k]` (or `tts_pad` past the end, docs/model.md §5.4).
#[derive(Debug, Clone)]
pub struct TalkerPrompt {
    pub embeds: Tensor,
    pub trailing: Tensor,
}

/// Which ICL alignment a prompt took (docs/model.md §6 tail C, streaming).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IclBranch {
    TextLonger,
    CodesLonger,
}

/// The three special text embeddings `tts_bos`, `tts_eos`, `tts_pad`, each `(1, H)`.
#[derive(Debug, Clone)]
pub struct SpecialEmbeds {
    pub bos: Tensor,
    pub eos: Tensor,
    pub pad: Tensor,
}

impl SpecialEmbeds {
    pub fn new(talker: &dyn Embed, cfg: &Qwen3TtsConfig) -> Result<Self> {
        let ids = [
            cfg.tts_bos_token_id,
            cfg.tts_eos_token_id,
            cfg.tts_pad_token_id,
        ];
        let e = talker.text_embed(&ids)?;
        Ok(Self {
            bos: e.narrow(0, 0, 1)?,
            eos: e.narrow(0, 1, 1)?,
            pad: e.narrow(0, 2, 1)?,
        })
    }
}

/// The codec language id for a user's language (case-insensitive; "auto" → `None`), with the
/// dialect rule of docs/model.md §6: a dialect speaker under "chinese"/"auto" uses its dialect's
/// id.
pub fn language_id(
    cfg: &Qwen3TtsConfig,
    language: &str,
    speaker: Option<&str>,
) -> Result<Option<u32>> {
    let t = &cfg.talker_config;
    let lang = language.to_lowercase();
    let mut id = if lang == "auto" {
        None
    } else {
        match t.codec_language_id.get(&lang) {
            Some(&id) => Some(id),
            None => bail!(
                "unknown language {language:?}; this model knows: auto, {}",
                t.codec_language_id
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    };
    if let Some(name) = speaker {
        let dialect = t.spk_is_dialect.get(&name.to_lowercase());
        if let (true, Some(serde_json::Value::String(d))) =
            (lang == "chinese" || lang == "auto", dialect)
        {
            match t.codec_language_id.get(d) {
                Some(&did) => id = Some(did),
                None => {
                    bail!("speaker {name:?} has dialect {d:?}, which is not in codec_language_id")
                }
            }
        }
    }
    Ok(id)
}

/// Builds the prompt of one row exactly as the official `generate` does.
pub fn build(
    talker: &dyn Embed,
    cfg: &Qwen3TtsConfig,
    special: &SpecialEmbeds,
    spec: &PromptSpec,
) -> Result<(TalkerPrompt, Option<IclBranch>)> {
    let t = &cfg.talker_config;
    let text_embed = |v: &[u32]| talker.text_embed(v);
    let codec_embed = |v: &[u32]| talker.codec_embed(v);
    let text = spec.text.text();
    ensure!(!text.is_empty(), "the text to speak is empty");

    // codec_seq = P ++ [S] ++ [pad, bos]; the prefix uses all but its last entry.
    let tags: Vec<u32> = match spec.language_id {
        None => vec![
            t.codec_nothink_id,
            t.codec_think_bos_id,
            t.codec_think_eos_id,
        ],
        Some(lang) => vec![
            t.codec_think_id,
            t.codec_think_bos_id,
            lang,
            t.codec_think_eos_id,
        ],
    };
    let mut codec_parts = vec![codec_embed(&tags)?];
    match &spec.speaker {
        SpeakerSlot::XVector(x) => {
            codec_parts.push(x.to_dtype(special.pad.dtype())?.reshape((1, ()))?)
        }
        SpeakerSlot::CodecRow(row) => codec_parts.push(codec_embed(&[*row])?),
        SpeakerSlot::None => {}
    }
    codec_parts.push(codec_embed(&[t.codec_pad_id])?);
    let codec_prefix = Tensor::cat(&codec_parts, 0)?; // n-1 rows
    let n_prefix = codec_prefix.dim(0)?;
    let text_prefix = Tensor::cat(
        &[special.pad.repeat((n_prefix - 1, 1))?, special.bos.clone()],
        0,
    )?;

    let mut parts = Vec::new();
    if let Some(instruct) = &spec.instruct {
        parts.push(text_embed(instruct)?);
    }
    parts.push(text_embed(spec.text.role())?);
    parts.push((text_prefix + codec_prefix)?);
    let bos = codec_embed(&[t.codec_bos_id])?;
    let mut branch = None;

    let trailing = if let Some(icl) = &spec.icl {
        // text_blk = t(ref ++ T) ++ tts_eos ; codec_blk = c(bos) ++ Σ16 embed(R[k]).
        let mut all_text = icl.ref_prompt.text().to_vec();
        all_text.extend_from_slice(text);
        let text_blk = Tensor::cat(&[text_embed(&all_text)?, special.eos.clone()], 0)?;
        let codec_blk = Tensor::cat(&[bos, talker.frame_embed(&icl.ref_codes)?], 0)?;
        let (lt, lc) = (text_blk.dim(0)?, codec_blk.dim(0)?);
        if spec.non_streaming {
            let pads = codec_embed(&vec![t.codec_pad_id; lt])?;
            parts.push((text_blk + pads)?);
            parts.push(codec_blk.broadcast_add(&special.pad)?);
            special.pad.clone()
        } else if lt > lc {
            branch = Some(IclBranch::TextLonger);
            parts.push((text_blk.narrow(0, 0, lc)? + codec_blk)?);
            text_blk.narrow(0, lc, lt - lc)?
        } else {
            branch = Some(IclBranch::CodesLonger);
            let padded = Tensor::cat(&[text_blk, special.pad.repeat((lc - lt, 1))?], 0)?;
            parts.push((padded + codec_blk)?);
            special.pad.clone()
        }
    } else if spec.non_streaming {
        // (t(T) ++ tts_eos) + c(pad), then tts_pad + c(bos).
        let text_blk = Tensor::cat(&[text_embed(text)?, special.eos.clone()], 0)?;
        let pads = codec_embed(&vec![t.codec_pad_id; text.len() + 1])?;
        parts.push((text_blk + pads)?);
        parts.push((special.pad.clone() + bos)?);
        special.pad.clone()
    } else {
        parts.push((text_embed(&text[..1])? + bos)?);
        Tensor::cat(&[text_embed(&text[1..])?, special.eos.clone()], 0)?
    };
    let embeds = Tensor::cat(&parts, 0)?;
    Ok((TalkerPrompt { embeds, trailing }, branch))
}

/// Left-pads row prompts into a batch: embeddings `(B, L, H)` (zero vectors in front), the
/// attention mask `(B, L)` u8, and the trailing text `(B, K, H)` right-padded with `tts_pad`.
pub fn batch(prompts: &[TalkerPrompt], pad: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    ensure!(!prompts.is_empty(), "no prompts to batch");
    let device: Device = prompts[0].embeds.device().clone();
    let max_len = prompts
        .iter()
        .map(|p| p.embeds.dim(0))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let max_trailing = prompts
        .iter()
        .map(|p| p.trailing.dim(0))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let (l, k) = (
        *max_len.iter().max().unwrap_or(&0),
        *max_trailing.iter().max().unwrap_or(&0),
    );
    let mut embeds = Vec::with_capacity(prompts.len());
    let mut trailing = Vec::with_capacity(prompts.len());
    let mut mask = Vec::with_capacity(prompts.len() * l);
    for p in prompts {
        let (n, h) = p.embeds.dims2()?;
        let e = if n < l {
            let zeros = Tensor::zeros((l - n, h), p.embeds.dtype(), &device)?;
            Tensor::cat(&[&zeros, &p.embeds], 0)?
        } else {
            p.embeds.clone()
        };
        embeds.push(e);
        mask.extend(std::iter::repeat_n(0u8, l - n).chain(std::iter::repeat_n(1u8, n)));
        let m = p.trailing.dim(0)?;
        trailing.push(if m < k {
            Tensor::cat(&[&p.trailing, &pad.repeat((k - m, 1))?], 0)?
        } else {
            p.trailing.clone()
        });
    }
    let mask = Tensor::from_vec(mask, (prompts.len(), l), &device)?.to_dtype(DType::U8)?;
    Ok((
        Tensor::stack(&embeds, 0)?,
        mask,
        Tensor::stack(&trailing, 0)?,
    ))
}
