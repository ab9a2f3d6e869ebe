//! The training batch layout of the official `collate_fn` (docs/model.md §10.2, `lag_num = -1`):
//! per sample a sequence of `8 + L + T` positions (L = 3 role + Lt text tokens, T frames), right
//! padded to the longest sample of the batch.
//!
//! ```text
//! pos            text channel          codec channel                 masks
//! 0..2           role tokens           -                             text
//! 3,4,5          tts_pad               nothink, think_bos, think_eos text+codec
//! 6              tts_pad               (speaker x-vector added)      text
//! 7              tts_bos               pad                           text+codec
//! 8..8+Lt-1      text tokens           pad                           text+codec
//! 8+Lt           tts_eos               pad                           text+codec
//! 8+Lt+1         tts_pad               bos                           text+codec
//! 8+Lt+2+k       tts_pad               frame k (16 codes)            text+codec+codec_mask
//! 8+Lt+2+T       tts_pad               eos                           text+codec
//! ```
//! `codec_0_labels[p]` is code-0 of the frame input at `p` for the T frame positions and `eos`
//! at `8+Lt+2+T`, `-100` elsewhere. The field names follow `collate_fn`.
//!
//! Each row also records its sample's speaker (`speakers`, `BatchTensors::speaker_index`): the
//! row of the speaker table whose x-vector the loss adds at position 6 (docs/training.md §3.3).

use candle_core::{Device, Result, Tensor};

use crate::data::Sample;
use vc_core::artifacts::codes::CODE_GROUPS;
use vc_model::config::Qwen3TtsConfig;

/// Label value of positions without a target (PyTorch's `ignore_index`).
pub const IGNORE: i64 = -100;
/// Position of the speaker x-vector (docs/model.md §10.2).
pub const SPEAKER_POS: usize = 6;

/// The special ids the layout uses, from `config.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutIds {
    pub tts_pad: u32,
    pub tts_bos: u32,
    pub tts_eos: u32,
    pub codec_nothink: u32,
    pub codec_think_bos: u32,
    pub codec_think_eos: u32,
    pub codec_pad: u32,
    pub codec_bos: u32,
    pub codec_eos: u32,
}

impl LayoutIds {
    /// The text-channel ids a batch uses besides the samples' own: the padding id 0 and the
    /// TTS pad, bos and eos tokens.
    pub fn text_specials(&self) -> [u32; 4] {
        [0, self.tts_pad, self.tts_bos, self.tts_eos]
    }

    pub fn from_config(cfg: &Qwen3TtsConfig) -> Self {
        let t = &cfg.talker_config;
        Self {
            tts_pad: cfg.tts_pad_token_id,
            tts_bos: cfg.tts_bos_token_id,
            tts_eos: cfg.tts_eos_token_id,
            codec_nothink: t.codec_nothink_id,
            codec_think_bos: t.codec_think_bos_id,
            codec_think_eos: t.codec_think_eos_id,
            codec_pad: t.codec_pad_id,
            codec_bos: t.codec_bos_id,
            codec_eos: t.codec_eos_token_id,
        }
    }
}

/// One right-padded batch on the host, `B` rows of `len` positions (row-major).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub rows: usize,
    pub len: usize,
    /// `input_ids[..., 0]`: text-channel ids.
    pub text_ids: Vec<u32>,
    /// `input_ids[..., 1]`: codec-channel ids.
    pub codec_channel_ids: Vec<u32>,
    /// `codec_ids`: the 16 codes of the frame at each frame position, 0 elsewhere, `(B, len, 16)`.
    pub codec_ids: Vec<u32>,
    pub text_embedding_mask: Vec<u8>,
    pub codec_embedding_mask: Vec<u8>,
    /// Frame positions.
    pub codec_mask: Vec<u8>,
    pub attention_mask: Vec<u8>,
    pub codec_0_labels: Vec<i64>,
    /// Frames in the batch (Σ T).
    pub frames: usize,
    /// Per row: the sample's speaker, a row of the speaker table.
    pub speakers: Vec<u32>,
}

impl Batch {
    pub fn build(samples: &[&Sample], ids: &LayoutIds) -> Self {
        let rows = samples.len();
        let len = samples.iter().map(|s| s.seq_len()).max().unwrap_or(0);
        let n = rows * len;
        let mut b = Batch {
            rows,
            len,
            text_ids: vec![0; n],
            codec_channel_ids: vec![0; n],
            codec_ids: vec![0; n * CODE_GROUPS],
            text_embedding_mask: vec![0; n],
            codec_embedding_mask: vec![0; n],
            codec_mask: vec![0; n],
            attention_mask: vec![0; n],
            codec_0_labels: vec![IGNORE; n],
            frames: samples.iter().map(|s| s.frames()).sum(),
            speakers: samples.iter().map(|s| s.speaker as u32).collect(),
        };
        for (r, s) in samples.iter().enumerate() {
            let o = r * len;
            let lt = s.text_len();
            let t = s.frames();
            let eos_pos = 8 + lt + 2 + t;
            // Text channel.
            b.text_ids[o..o + 3].copy_from_slice(&s.text_ids[..3]);
            b.text_ids[o + 3..o + 7].fill(ids.tts_pad);
            b.text_ids[o + 7] = ids.tts_bos;
            b.text_ids[o + 8..o + 8 + lt].copy_from_slice(&s.text_ids[3..]);
            b.text_ids[o + 8 + lt] = ids.tts_eos;
            b.text_ids[o + 8 + lt + 1..=o + eos_pos].fill(ids.tts_pad);
            b.text_embedding_mask[o..=o + eos_pos].fill(1);
            // Codec channel.
            b.codec_channel_ids[o + 3] = ids.codec_nothink;
            b.codec_channel_ids[o + 4] = ids.codec_think_bos;
            b.codec_channel_ids[o + 5] = ids.codec_think_eos;
            b.codec_channel_ids[o + 7..o + 8 + lt + 1].fill(ids.codec_pad);
            b.codec_channel_ids[o + 8 + lt + 1] = ids.codec_bos;
            for (k, frame) in s.codes.iter().enumerate() {
                let p = o + 8 + lt + 2 + k;
                b.codec_channel_ids[p] = frame[0];
                b.codec_0_labels[p] = frame[0] as i64;
                b.codec_mask[p] = 1;
                b.codec_ids[p * CODE_GROUPS..(p + 1) * CODE_GROUPS].copy_from_slice(&frame.0);
            }
            b.codec_channel_ids[o + eos_pos] = ids.codec_eos;
            b.codec_0_labels[o + eos_pos] = ids.codec_eos as i64;
            b.codec_embedding_mask[o + 3..=o + eos_pos].fill(1);
            b.codec_embedding_mask[o + SPEAKER_POS] = 0;
            b.attention_mask[o..=o + eos_pos].fill(1);
        }
        b
    }

    /// The tensors the loss needs, on `device`.
    pub fn to_tensors(&self, device: &Device) -> Result<BatchTensors> {
        let (b, n) = (self.rows, self.len);
        let mask = |m: &[u8]| -> Result<Tensor> {
            let v: Vec<f32> = m.iter().map(|&x| x as f32).collect();
            Tensor::from_vec(v, (b, n, 1), device)
        };
        // Hidden state p predicts the label of input p + 1 (a single shift, docs/model.md §10.3).
        let mut label_rows = Vec::new();
        let mut labels = Vec::new();
        let mut frame_rows = Vec::new();
        let mut frame_codes = Vec::new();
        for r in 0..b {
            for p in 0..n - 1 {
                let next = r * n + p + 1;
                if self.codec_0_labels[next] != IGNORE {
                    label_rows.push((r * (n - 1) + p) as u32);
                    labels.push(self.codec_0_labels[next] as u32);
                }
                if self.codec_mask[next] != 0 {
                    frame_rows.push((r * (n - 1) + p) as u32);
                    frame_codes.extend_from_slice(
                        &self.codec_ids[next * CODE_GROUPS..(next + 1) * CODE_GROUPS],
                    );
                }
            }
        }
        let frames = frame_rows.len();
        let n_labels = labels.len();
        Ok(BatchTensors {
            text_ids: Tensor::from_slice(&self.text_ids, (b, n), device)?,
            codec_channel_ids: Tensor::from_slice(&self.codec_channel_ids, (b, n), device)?,
            codec_ids: Tensor::from_slice(&self.codec_ids, (b, n, CODE_GROUPS), device)?,
            text_mask: mask(&self.text_embedding_mask)?,
            codec_embedding_mask: mask(&self.codec_embedding_mask)?,
            codec_mask: mask(&self.codec_mask)?,
            speaker_mask: {
                let mut v = vec![0f32; b * n];
                for r in 0..b {
                    v[r * n + SPEAKER_POS] = 1.0;
                }
                Tensor::from_vec(v, (b, n, 1), device)?
            },
            speaker_index: Tensor::from_slice(&self.speakers, b, device)?,
            label_rows: Tensor::from_vec(label_rows, n_labels, device)?,
            labels: Tensor::from_vec(labels, n_labels, device)?,
            frame_rows: Tensor::from_vec(frame_rows, frames, device)?,
            frame_codes: Tensor::from_vec(frame_codes, (frames, CODE_GROUPS), device)?,
            rows: b,
            len: n,
        })
    }
}

/// A batch as tensors: the inputs of both channels and masks `(B, N[, …])`, and the gathered
/// targets of the loss (rows index the flattened `(B, N-1)` hidden states).
#[derive(Debug, Clone)]
pub struct BatchTensors {
    pub text_ids: Tensor,
    pub codec_channel_ids: Tensor,
    pub codec_ids: Tensor,
    /// Masks as `(B, N, 1)` in f32 (multiplied onto embeddings).
    pub text_mask: Tensor,
    pub codec_embedding_mask: Tensor,
    pub codec_mask: Tensor,
    /// 1 at position 6 of every row, where the row's x-vector goes.
    pub speaker_mask: Tensor,
    /// `(B,)` u32: each row's speaker, a row of the speaker table the loss gets.
    pub speaker_index: Tensor,
    /// Hidden rows with a code-0 target (the T frames and EOS of every sample), and the targets.
    pub label_rows: Tensor,
    pub labels: Tensor,
    /// Hidden rows that predicted code-0 of a frame (`codec_mask[:, 1:]`), and those frames.
    pub frame_rows: Tensor,
    pub frame_codes: Tensor,
    pub rows: usize,
    pub len: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use vc_core::artifacts::codes::CodeFrame;

    fn ids() -> LayoutIds {
        LayoutIds {
            tts_pad: 151671,
            tts_bos: 151672,
            tts_eos: 151673,
            codec_nothink: 2155,
            codec_think_bos: 2156,
            codec_think_eos: 2157,
            codec_pad: 2148,
            codec_bos: 2149,
            codec_eos: 2150,
        }
    }

    #[test]
    fn layout_matches_spec_table() {
        let a = Sample {
            line: 1,
            text_ids: vec![151644, 77091, 198, 11, 12],
            codes: vec![CodeFrame([5; 16]), CodeFrame([6; 16]), CodeFrame([7; 16])],
            speaker: 0,
        };
        let b = Sample {
            line: 2,
            text_ids: vec![151644, 77091, 198, 13],
            codes: vec![CodeFrame([9; 16])],
            speaker: 0,
        };
        let batch = Batch::build(&[&a, &b], &ids());
        // Lt = 2, T = 3: 8 + 5 + 3 = 16 positions; the second row (Lt 1, T 1) is 13 long.
        assert_eq!((batch.rows, batch.len, batch.frames), (2, 16, 4));
        let (pad, bos, eos) = (151671, 151672, 151673);
        assert_eq!(
            &batch.text_ids[..16],
            &[151644, 77091, 198, pad, pad, pad, pad, bos, 11, 12, eos, pad, pad, pad, pad, pad]
        );
        assert_eq!(
            &batch.codec_channel_ids[..16],
            &[0, 0, 0, 2155, 2156, 2157, 0, 2148, 2148, 2148, 2148, 2149, 5, 6, 7, 2150]
        );
        assert_eq!(
            &batch.codec_0_labels[..16],
            &[
                -100, -100, -100, -100, -100, -100, -100, -100, -100, -100, -100, -100, 5, 6, 7,
                2150
            ]
        );
        assert_eq!(
            &batch.codec_mask[..16],
            &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0]
        );
        assert_eq!(
            &batch.codec_embedding_mask[..16],
            &[0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1]
        );
        // Row 2: 13 real positions then padding.
        assert_eq!(
            &batch.attention_mask[16..],
            &[1; 13].iter().chain(&[0; 3]).copied().collect::<Vec<u8>>()[..]
        );
        assert_eq!(
            &batch.text_ids[16 + 7..16 + 13],
            &[bos, 13, eos, pad, pad, pad]
        );
        assert_eq!(
            &batch.codec_channel_ids[16 + 9..16 + 13],
            &[2148, 2149, 9, 2150]
        );
        assert_eq!(&batch.codec_ids[(16 + 11) * 16..(16 + 12) * 16], &[9; 16]);

        let t = batch.to_tensors(&Device::Cpu).unwrap();
        // Targets: hidden p predicts input p+1. Row 1: p = 11..14, row 2: p = 10, 11 (of 15).
        let rows: Vec<u32> = t.label_rows.to_vec1().unwrap();
        assert_eq!(rows, vec![11, 12, 13, 14, 15 + 10, 15 + 11]);
        let labels: Vec<u32> = t.labels.to_vec1().unwrap();
        assert_eq!(labels, vec![5, 6, 7, 2150, 9, 2150]);
        let frames: Vec<u32> = t.frame_rows.to_vec1().unwrap();
        assert_eq!(frames, vec![11, 12, 13, 15 + 10]);
        assert_eq!(t.frame_codes.dims(), &[4, 16]);
        assert_eq!(t.speaker_index.to_vec1::<u32>().unwrap(), vec![0, 0]);
    }

    #[test]
    fn every_row_carries_its_own_speaker() {
        let s = |speaker: usize, lt: usize| Sample {
            line: speaker + 1,
            text_ids: [151644, 77091, 198]
                .into_iter()
                .chain(10..10 + lt as u32)
                .collect(),
            codes: vec![CodeFrame([3; 16]); 2],
            speaker,
        };
        let (x, y, z) = (s(2, 1), s(0, 3), s(1, 2));
        let batch = Batch::build(&[&x, &y, &z], &ids());
        assert_eq!(batch.speakers, vec![2, 0, 1]);
        // The layout itself does not depend on the speaker: the same rows with speaker 0.
        let plain: Vec<Sample> = [&x, &y, &z]
            .iter()
            .map(|s| Sample {
                speaker: 0,
                ..(*s).clone()
            })
            .collect();
        let p = Batch::build(&plain.iter().collect::<Vec<_>>(), &ids());
        assert_eq!(
            Batch {
                speakers: batch.speakers.clone(),
                ..p
            },
            batch
        );
        let t = batch.to_tensors(&Device::Cpu).unwrap();
        assert_eq!(t.speaker_index.to_vec1::<u32>().unwrap(), vec![2, 0, 1]);
        let mask: Vec<Vec<f32>> = t.speaker_mask.squeeze(2).unwrap().to_vec2().unwrap();
        for row in &mask {
            let ones: Vec<usize> = (0..row.len()).filter(|&p| row[p] == 1.0).collect();
            assert_eq!(ones, vec![SPEAKER_POS]);
        }
    }
}
