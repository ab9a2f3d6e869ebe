//! Activation rows quantized to 8-bit blocks when they arrive ([`Q8Rows`]): the other operand
//! of a `q8` product, with the per-block scales and the `128 · Σ q` that takes the weights'
//! `+128` back (the **Activations** paragraph of the docs of [`super`]). These are quantized
//! afresh by every call; the weights' format and the products are in [`super`].

use super::{abs_max, check_len, round_q, with_simd, Q8Error, BLOCK};

/// Activation rows quantized to 8-bit blocks (see the docs of [`super`]).
#[derive(Debug, Clone)]
pub struct Q8Rows {
    pub(crate) m: usize,
    pub(crate) k: usize,
    /// `k` rounded up to whole blocks (the padding quantizes to zeros).
    pub(crate) kp: usize,
    /// The quantized values, 4 per word (little-endian bytes), `[row][block][step]`.
    pub(crate) words: Vec<i32>,
    /// Scale per `[row][block]`.
    pub(crate) d: Vec<f32>,
    /// `128 · Σ q` per `[row][block]` (the weights' offset, taken back).
    pub(crate) corr: Vec<i32>,
}

impl Q8Rows {
    /// Quantizes `x (m, k)`.
    pub fn quantize(x: &[f32], m: usize, k: usize) -> Result<Self, Q8Error> {
        check_len(x.len(), m, k)?;
        let kp = k.div_ceil(BLOCK) * BLOCK;
        let padded;
        let x = if kp == k {
            x
        } else {
            let mut p = vec![0f32; m * kp];
            for (d, s) in p.chunks_exact_mut(kp).zip(x.chunks_exact(k.max(1))) {
                d[..k].copy_from_slice(s);
            }
            padded = p;
            &padded[..]
        };
        let blocks = m * kp / BLOCK;
        let mut words = vec![0i32; m * kp / 4];
        let mut d = vec![0f32; blocks];
        let mut corr = vec![0i32; blocks];
        with_simd(|| {
            for (((blk, w), db), cb) in x
                .chunks_exact(BLOCK)
                .zip(words.chunks_exact_mut(BLOCK / 4))
                .zip(d.iter_mut())
                .zip(corr.iter_mut())
            {
                let amax = abs_max(blk);
                let scale = amax / 127.0;
                let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                let mut q = [0i8; BLOCK];
                for (o, v) in q.iter_mut().zip(blk) {
                    *o = round_q(v * inv) as i8;
                }
                let sum: i32 = q.iter().map(|v| *v as i32).sum();
                for (wi, c) in w.iter_mut().zip(q.chunks_exact(4)) {
                    *wi = i32::from_le_bytes([c[0] as u8, c[1] as u8, c[2] as u8, c[3] as u8]);
                }
                *db = scale;
                *cb = 128 * sum;
            }
        });
        Ok(Self {
            m,
            k,
            kp,
            words,
            d,
            corr,
        })
    }

    /// Rows, columns.
    pub fn dims(&self) -> (usize, usize) {
        (self.m, self.k)
    }

    /// Row `r` as the f32 values the kernels compute with.
    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        let kb = self.kp / BLOCK;
        let mut out = Vec::with_capacity(self.kp);
        for b in 0..kb {
            let d = self.d[r * kb + b];
            for w in &self.words[(r * kb + b) * 8..(r * kb + b + 1) * 8] {
                out.extend(w.to_le_bytes().iter().map(|&q| q as i8 as f32 * d));
            }
        }
        out.truncate(self.k);
        out
    }
}
