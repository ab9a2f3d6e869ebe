//! A decoder stack's inference state and step bookkeeping (docs/model.md §4.1, §14): the KV
//! cache of each layer, the padding and next RoPE position of each batch row, and the positions
//! and causal/padding mask of one forward pass: the rules every step follows whatever the block
//! computes, which the row inference path repeats (`infer::decoder_stack`'s `plan`).

use candle_core::{DType, Device, Result, Tensor};

use crate::ops::{Numerics, Rope, RopeTables};

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
    pub(super) layers: Vec<KvCache>,
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
pub(super) fn plan_step(
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
