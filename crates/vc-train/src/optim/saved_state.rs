//! One trained tensor's optimizer state as checkpoint tensors (docs/training.md §7): which
//! entries a mode writes, with their dtypes and shapes, their bytes, and reading a row range
//! of them back into a parameter and its moments — converting when the run's mode is not the
//! checkpoint's (docs/training.md §6.5).
//!
//! | mode | entries per tensor |
//! |---|---|
//! | `fp32` | `master` f32, `exp_avg` f32, `exp_avg_sq` f32 |
//! | `int8` | `master` f32; large tensors `exp_avg` u8 + `exp_avg_scale` f32 `(rows, blocks)`, `exp_avg_sq` u8 (√v codes) + `exp_avg_sq_scale`; small ones f32 moments |
//! | `bf16-compensated` | `master` bf16 (the weight), `comp` bf16, `exp_avg` f32, `exp_avg_sq` f32 |
//!
//! Every entry has the tensor's rows as its first dimension, so any row range of it is a
//! rank's shard, whatever world size wrote it.

use std::ops::Range;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};

use crate::checkpoint::safetensors_stream;
use crate::optim::moments::{Codes8, Moment, Which};
use crate::step::params::Param;
use vc_core::config::OptimizerState;
use vc_kernels::moment8;

/// One checkpoint entry of a tensor: `KIND.NAME`, its dtype, and its shape for `rows` rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedEntry {
    pub kind: &'static str,
    pub dtype: safetensors::Dtype,
    pub shape: Vec<usize>,
}

/// Whether `mode` keeps 8-bit moments for a tensor of (full) `shape`.
pub fn eight_bit(mode: OptimizerState, shape: &[usize]) -> bool {
    mode == OptimizerState::Int8 && moment8::quantizes(shape)
}

/// Whether `mode` keeps a tensor of (full) `shape` as a bf16 weight with a compensation (the
/// large ones; small tensors keep fp32 masters, see [`crate::Backend::masters`]).
pub fn compensated(mode: OptimizerState, shape: &[usize]) -> bool {
    mode == OptimizerState::Bf16Compensated && moment8::quantizes(shape)
}

/// The entries `mode` writes for `rows` rows of a tensor of (full) shape `shape`.
pub fn entries(mode: OptimizerState, shape: &[usize], rows: usize) -> Vec<SavedEntry> {
    use safetensors::Dtype::{BF16, F32, U8};
    let mut part = shape.to_vec();
    if let Some(r) = part.first_mut() {
        *r = rows;
    }
    let e = |kind, dtype, shape: &[usize]| SavedEntry {
        kind,
        dtype,
        shape: shape.to_vec(),
    };
    let mut out = Vec::new();
    if compensated(mode, shape) {
        out.push(e("master", BF16, &part));
        out.push(e("comp", BF16, &part));
    } else {
        out.push(e("master", F32, &part));
    }
    if eight_bit(mode, shape) {
        let (_, cols) = moment8::rows_cols(shape);
        let scales = [rows, moment8::blocks_per_row(cols)];
        out.push(e("exp_avg", U8, &part));
        out.push(e("exp_avg_scale", F32, &scales));
        out.push(e("exp_avg_sq", U8, &part));
        out.push(e("exp_avg_sq_scale", F32, &scales));
    } else {
        out.push(e("exp_avg", F32, &part));
        out.push(e("exp_avg_sq", F32, &part));
    }
    out
}

/// The tensors of [`entries`] for parameter `p` and its moments `(m, v)`, in that order (the
/// form they are in decides; the writer checks it against the mode's entries).
pub fn tensors(p: &Param, m: &Moment, v: &Moment) -> Result<Vec<Tensor>> {
    let mut out = Vec::new();
    match p.compensation() {
        Some(c) => {
            out.push(p.var.as_tensor().to_dtype(DType::BF16)?);
            out.push(c.clone());
        }
        None => out.push(p.master()?),
    }
    for moment in [m, v] {
        match moment {
            Moment::F32(t) => out.push(t.clone()),
            Moment::Codes8(c) => {
                out.push(c.codes.clone());
                out.push(c.scales.clone());
            }
        }
    }
    Ok(out)
}

/// Little-endian bytes of `t` as `dtype` (the dtype the entry was declared with).
pub fn bytes(t: &Tensor, dtype: safetensors::Dtype) -> Result<Vec<u8>> {
    Ok(match dtype {
        safetensors::Dtype::F32 => safetensors_stream::f32_bytes(t)?,
        // Exact for the bf16 weights and compensations this is called with.
        safetensors::Dtype::BF16 => safetensors_stream::bf16_bytes(t)?,
        safetensors::Dtype::U8 => t.to_dtype(DType::U8)?.flatten_all()?.to_vec1::<u8>()?,
        other => anyhow::bail!("no checkpoint entry is {other:?}"),
    })
}

/// Row ranges of a saved checkpoint's entries (`checkpoint::RowReader`): entry `KIND.NAME`,
/// rows `rows`, in the dtype it was saved in.
pub trait SavedRows {
    fn rows(
        &mut self,
        kind: &str,
        name: &str,
        rows: Range<usize>,
        device: &Device,
    ) -> Result<Tensor>;
}

/// What reading a checkpoint in another mode did, for the message at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conversion {
    pub from: OptimizerState,
    pub to: OptimizerState,
}

impl Conversion {
    /// The sentence said at start, or `None` when the modes agree.
    pub fn message(self) -> Option<String> {
        use OptimizerState::*;
        let what = match (self.from, self.to) {
            (a, b) if a == b => return None,
            (Fp32, Int8) => "the fp32 moments are encoded in 8 bits",
            (Int8, Fp32) => "the 8-bit moments are decoded to fp32 (what the codes kept)",
            (Fp32, Bf16Compensated) => {
                "each fp32 master becomes a bf16 weight and its bf16 compensation"
            }
            (Bf16Compensated, Fp32) => "each fp32 master is the bf16 weight plus its compensation",
            (Int8, Bf16Compensated) => {
                "the 8-bit moments are decoded to fp32, each fp32 master becomes a bf16 weight \
                 and its compensation"
            }
            (Bf16Compensated, Int8) => {
                "the moments are encoded in 8 bits, each fp32 master is the bf16 weight plus its \
                 compensation"
            }
            _ => unreachable!("equal modes return above"),
        };
        Some(format!(
            "the checkpoint keeps the optimizer state as {}, this run as {}: {what}",
            self.from.name(),
            self.to.name()
        ))
    }
}

/// Reads rows `rows` of parameter `p` (full shape `shape`) saved in mode `saved` into `p` and
/// returns its moments in mode `now`. Within one mode every bit is kept.
pub fn restore(
    reader: &mut dyn SavedRows,
    saved: OptimizerState,
    now: OptimizerState,
    p: &mut Param,
    shape: &[usize],
    rows: Range<usize>,
    device: &Device,
) -> Result<(Moment, Moment)> {
    let name = p.name.clone();
    let read =
        |reader: &mut dyn SavedRows, kind: &str| reader.rows(kind, &name, rows.clone(), device);
    let master = read(reader, "master")?;
    if compensated(saved, shape) {
        let comp = read(reader, "comp")?;
        if p.compensation().is_some() {
            p.set_compensated(&master, &comp)?;
        } else {
            p.set_master((master.to_dtype(DType::F32)? + comp.to_dtype(DType::F32)?)?)?;
        }
    } else {
        p.set_master(master.to_dtype(DType::F32)?)?;
    }
    let (was8, is8) = (eight_bit(saved, shape), eight_bit(now, shape));
    let mut out = Vec::with_capacity(2);
    for (kind, which) in [("exp_avg", Which::First), ("exp_avg_sq", Which::Second)] {
        let m = if was8 {
            Moment::Codes8(Codes8 {
                codes: read(reader, kind)?,
                scales: read(reader, &format!("{kind}_scale"))?,
                which,
            })
        } else {
            Moment::F32(read(reader, kind)?.to_dtype(DType::F32)?)
        };
        let m = match (was8, is8) {
            (true, false) => Moment::F32(m.decode()?),
            (false, true) => Moment::encode(&m.decode()?, true, which)?,
            _ => m,
        };
        out.push(m);
    }
    let v = out.pop().context("second moment")?;
    let m = out.pop().context("first moment")?;
    Ok((m, v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_per_mode() {
        let kinds =
            |m, s: &[usize]| -> Vec<&str> { entries(m, s, 2).iter().map(|e| e.kind).collect() };
        assert_eq!(
            kinds(OptimizerState::Fp32, &[64, 128]),
            ["master", "exp_avg", "exp_avg_sq"]
        );
        assert_eq!(
            kinds(OptimizerState::Int8, &[64, 128]),
            [
                "master",
                "exp_avg",
                "exp_avg_scale",
                "exp_avg_sq",
                "exp_avg_sq_scale"
            ]
        );
        assert_eq!(
            kinds(OptimizerState::Int8, &[64]),
            ["master", "exp_avg", "exp_avg_sq"]
        );
        assert_eq!(
            kinds(OptimizerState::Bf16Compensated, &[64, 128]),
            ["master", "comp", "exp_avg", "exp_avg_sq"]
        );
        assert_eq!(
            kinds(OptimizerState::Bf16Compensated, &[64]),
            ["master", "exp_avg", "exp_avg_sq"]
        );
        let e = entries(OptimizerState::Int8, &[64, 1024], 3);
        assert_eq!(e[2].shape, [3, 4]);
        assert_eq!(e[1].shape, [3, 1024]);
        assert!(Conversion {
            from: OptimizerState::Fp32,
            to: OptimizerState::Fp32
        }
        .message()
        .is_none());
    }
}
