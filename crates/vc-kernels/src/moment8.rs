//! 8-bit block codes for AdamW's moments (docs/training.md §6.5), on slices.
//!
//! A moment tensor is seen as `rows × cols` (its first dimension, the product of the rest);
//! each row is cut into blocks of [`block_width`] values, and each block keeps one f32 scale
//! (its largest magnitude) and one byte per value, a position on a logarithmic grid relative
//! to that scale. Blocks never cross a row, so a row range of a tensor (a rank's shard,
//! docs/distributed.md §4) carries its own codes and scales, whatever the world size.
//!
//! - **First moment, signed**: byte `128 ± k`, `k` in `0..=127`; magnitude `0` for `k = 0`,
//!   else `scale · 2^((k − 127)/8)` (down to 1.8e-5 of the scale, 9 % apart). Magnitudes
//!   below the grid round to 0: a tiny first moment makes a tiny step.
//! - **Second moment, unsigned, stored as √v**: byte `k` in `0..=255`; `0` only for an exact
//!   zero, else `scale · 2^((k − 255)/16)` with `scale` the block's largest √v (down to
//!   1.7e-5 of it, 4.4 % apart), and values below the grid clamp *up* to its first step: a
//!   second moment must never decode to 0 under a non-zero first moment (the step would be
//!   `m / eps`).
//!
//! Rounding is to the nearest grid point in the log domain. The scale follows the block's
//! values exactly, so a block that decays as a whole (`v ← β2·v` with small gradients)
//! decays through its scale even where a single code would not move.

use std::sync::OnceLock;

/// Values per block within a row (rows narrower than this, or not a multiple of it, are one
/// block each).
pub const BLOCK: usize = 256;
/// Tensors with fewer values than this (norms, biases) keep fp32 moments: their bytes are
/// negligible and a block of them would mix unrelated scales.
pub const MIN_VALUES: usize = 4096;

const SIGNED_STEPS: f32 = 8.0;
const UNSIGNED_STEPS: f32 = 16.0;

/// Whether a tensor of `shape` keeps 8-bit moments in the `int8` mode.
pub fn quantizes(shape: &[usize]) -> bool {
    shape.len() >= 2 && shape.iter().product::<usize>() >= MIN_VALUES
}

/// `(rows, cols)` of a tensor of `shape`: its first dimension and the product of the rest.
pub fn rows_cols(shape: &[usize]) -> (usize, usize) {
    match shape.split_first() {
        Some((r, rest)) => (*r, rest.iter().product()),
        None => (1, 1),
    }
}

/// The block width of rows of `cols` values.
pub fn block_width(cols: usize) -> usize {
    if cols > BLOCK && cols.is_multiple_of(BLOCK) {
        BLOCK
    } else {
        cols.max(1)
    }
}

/// Scales per row of `cols` values.
pub fn blocks_per_row(cols: usize) -> usize {
    cols.div_ceil(block_width(cols))
}

/// What a signed byte stands for, relative to its block's scale.
pub fn signed_table() -> &'static [f32; 256] {
    static T: OnceLock<[f32; 256]> = OnceLock::new();
    T.get_or_init(|| {
        let mut t = [0f32; 256];
        for (b, v) in t.iter_mut().enumerate() {
            let d = b as i32 - 128;
            let k = d.unsigned_abs() as f32;
            if d != 0 && d != -128 {
                *v = (d.signum() as f32) * ((k - 127.0) / SIGNED_STEPS).exp2();
            }
        }
        t
    })
}

/// What an unsigned byte stands for (a √v), relative to its block's scale.
pub fn unsigned_table() -> &'static [f32; 256] {
    static T: OnceLock<[f32; 256]> = OnceLock::new();
    T.get_or_init(|| {
        let mut t = [0f32; 256];
        for (k, v) in t.iter_mut().enumerate().skip(1) {
            *v = ((k as f32 - 255.0) / UNSIGNED_STEPS).exp2();
        }
        t
    })
}

/// `ln r` scaled to grid steps: the factor of the signed grid (`8 / ln 2`).
pub fn signed_log_factor() -> f32 {
    (SIGNED_STEPS as f64 / std::f64::consts::LN_2) as f32
}

/// `ln r` scaled to grid steps: the factor of the unsigned grid (`16 / ln 2`).
pub fn unsigned_log_factor() -> f32 {
    (UNSIGNED_STEPS as f64 / std::f64::consts::LN_2) as f32
}

/// Encodes one block of a first moment; returns its scale.
pub fn encode_signed(x: &[f32], codes: &mut [u8]) -> f32 {
    debug_assert_eq!(x.len(), codes.len());
    let scale = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    if scale == 0.0 {
        codes.fill(128);
        return 0.0;
    }
    let a = signed_log_factor();
    for (c, &v) in codes.iter_mut().zip(x) {
        let r = v.abs() / scale;
        let k = (r.ln() * a + 127.0).round().clamp(0.0, 127.0) as u8;
        *c = if v < 0.0 { 128 - k } else { 128 + k };
    }
    scale
}

/// Decodes one block of a first moment.
pub fn decode_signed(codes: &[u8], scale: f32, out: &mut [f32]) {
    debug_assert_eq!(out.len(), codes.len());
    let t = signed_table();
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = t[c as usize] * scale;
    }
}

/// Encodes one block of a second moment `v` (as √v); returns its scale (the largest √v).
pub fn encode_sqrt(v: &[f32], codes: &mut [u8]) -> f32 {
    debug_assert_eq!(v.len(), codes.len());
    let scale = v.iter().fold(0f32, |a, v| a.max(v.sqrt()));
    if scale == 0.0 {
        codes.fill(0);
        return 0.0;
    }
    let a = unsigned_log_factor();
    for (c, &v) in codes.iter_mut().zip(v) {
        let r = v.sqrt() / scale;
        *c = if r > 0.0 {
            (r.ln() * a + 255.0).round().clamp(1.0, 255.0) as u8
        } else {
            0
        };
    }
    scale
}

/// Decodes one block of a second moment (the squares of the decoded √v).
pub fn decode_sqrt(codes: &[u8], scale: f32, out: &mut [f32]) {
    debug_assert_eq!(out.len(), codes.len());
    let t = unsigned_table();
    for (o, &c) in out.iter_mut().zip(codes) {
        let s = t[c as usize] * scale;
        *o = s * s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_within_half_a_grid_step() {
        let x: Vec<f32> = (0..BLOCK)
            .map(|i| ((i as f32 * 0.731).sin() * 3.0).powi(3) * if i % 7 == 0 { 1e-3 } else { 1.0 })
            .collect();
        let mut codes = vec![0u8; x.len()];
        let s = encode_signed(&x, &mut codes);
        let mut back = vec![0f32; x.len()];
        decode_signed(&codes, s, &mut back);
        let half_step = (0.5 / SIGNED_STEPS).exp2();
        for (a, b) in x.iter().zip(&back) {
            if a.abs() >= s * (-126.0 / SIGNED_STEPS).exp2() {
                assert!(a.signum() == b.signum(), "{a} {b}");
                let r = (b / a).abs();
                assert!(
                    r <= half_step * 1.0001 && r >= 1.0 / half_step / 1.0001,
                    "{a} {b}"
                );
            } else {
                assert!(b.abs() <= s * (-126.0 / SIGNED_STEPS).exp2(), "{a} {b}");
            }
        }
        assert_eq!(back.iter().fold(0f32, |m, v| m.max(v.abs())), s);

        let v: Vec<f32> = x.iter().map(|a| a * a * 1e-4).collect();
        let s = encode_sqrt(&v, &mut codes);
        decode_sqrt(&codes, s, &mut back);
        let half_step = (1.0 / UNSIGNED_STEPS).exp2(); // of v: twice the √v half-step
        for (a, b) in v.iter().zip(&back) {
            if *a == 0.0 {
                assert_eq!(*b, 0.0);
                continue;
            }
            assert!(*b > 0.0, "a non-zero second moment decodes to 0");
            if a.sqrt() >= s * (-254.0 / UNSIGNED_STEPS).exp2() {
                let r = b / a;
                assert!(
                    r <= half_step * 1.0001 && r >= 1.0 / half_step / 1.0001,
                    "{a} {b}"
                );
            } else {
                assert!(b >= a, "below the grid a second moment rounds up: {a} {b}");
            }
        }
    }

    #[test]
    fn zero_blocks_and_block_shapes() {
        let mut codes = [7u8; 4];
        assert_eq!(encode_signed(&[0.0; 4], &mut codes), 0.0);
        let mut out = [1f32; 4];
        decode_signed(&codes, 0.0, &mut out);
        assert_eq!(out, [0.0; 4]);
        assert_eq!(encode_sqrt(&[0.0, 0.0, 0.0, 0.0], &mut codes), 0.0);
        assert_eq!(codes, [0; 4]);
        assert_eq!(block_width(1024), 256);
        assert_eq!(block_width(100), 100);
        assert_eq!(block_width(300), 300);
        assert_eq!(blocks_per_row(2048), 8);
        assert!(quantizes(&[64, 64]) && !quantizes(&[4096]) && !quantizes(&[8, 8]));
        assert_eq!(rows_cols(&[3, 4, 5]), (3, 20));
    }
}
