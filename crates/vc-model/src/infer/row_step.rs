//! One decoder step for rows that each own their cache: the continuous batching of
//! `voiceclone serve` (docs/serving.md §3), where requests join and leave the running batch at
//! frame boundaries, so their caches have different lengths.
//!
//! Every row gets exactly the arithmetic of [`RowDecoderStack::forward`] on that row alone with one new
//! token: the matrix products are shared (one pass over the weights for all rows) but the
//! kernels compute each output row on its own, in the same order whatever the number of rows
//! (`crates/vc-kernels/src/`), and norms, RoPE and attention run per row through the same functions. So a
//! row's codes do not depend on what else is in the batch.

use anyhow::{ensure, Result};

use vc_kernels::{libm, team};

use super::adapters::AdapterId;
use super::decoder_stack::{attend, plan, Cache, RopeRows, RowDecoderStack, RowLayer};
use super::row_math::rms_norm_rows;

impl RowDecoderStack {
    /// `x` `(n, H)`: one new token for each of `n` rows, row `i` with its own one-row cache
    /// `caches[i]` (prefilled by [`RowDecoderStack::forward`] with `b = 1`) and the adapter that cache
    /// binds it to. Returns the final-norm hidden states `(n, H)` and appends each token to its
    /// row's cache.
    pub fn step_rows(&self, x: &[f32], caches: &mut [&mut Cache]) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let h = c.hidden_size;
        let n = caches.len();
        ensure!(
            x.len() == n * h,
            "decoder input has {} values, expected ({n}, {h})",
            x.len()
        );
        let kv_width = c.num_kv_heads * c.head_dim;
        let half = c.head_dim / 2;
        let mut cos = vec![0f32; n * half];
        let mut sin = vec![0f32; n * half];
        let mut past = Vec::with_capacity(n);
        for (r, cache) in caches.iter_mut().enumerate() {
            ensure!(
                cache.len > 0 && cache.next_pos.len() == 1 && cache.adapters.len() <= 1,
                "row {r}: a stepped row's cache must hold its own prefilled prompt"
            );
            let pos = plan(1, 1, None, cache)?;
            past.push(cache.len);
            cache.reserve(1, cache.len + 1, kv_width);
            for (i, f) in self.inv_freq.iter().enumerate() {
                let a = pos[0] * f;
                cos[r * half + i] = libm::cos(a);
                sin[r * half + i] = libm::sin(a);
            }
        }
        let rope = RopeRows {
            cos: &cos,
            sin: &sin,
            half,
        };
        let mut adapters: Vec<Option<AdapterId>> = caches
            .iter()
            .map(|c| c.adapters.first().copied().flatten())
            .collect();
        if adapters.iter().all(Option::is_none) {
            adapters.clear();
        }
        let mut x = x.to_vec();
        for (li, layer) in self.layers.iter().enumerate() {
            self.layer_rows(layer, li, &mut x, &rope, caches, &past, &adapters);
        }
        for (cache, p) in caches.iter_mut().zip(&past) {
            cache.len = p + 1;
        }
        rms_norm_rows(&mut x, &self.norm, c.rms_norm_eps);
        Ok(x)
    }

    /// [`RowDecoderStack::layer`] for one token per row, each row attending to its own cache.
    #[allow(clippy::too_many_arguments)]
    fn layer_rows(
        &self,
        l: &RowLayer,
        li: usize,
        x: &mut [f32],
        rope: &RopeRows<'_>,
        caches: &mut [&mut Cache],
        past: &[usize],
        adapters: &[Option<AdapterId>],
    ) {
        let c = &self.cfg;
        let hd = c.head_dim;
        let (nh, nkv) = (c.num_heads, c.num_kv_heads);
        let n = caches.len();
        let (q, k, v) = self.qkv(l, x, n, rope, adapters);
        for (r, cache) in caches.iter_mut().enumerate() {
            let cap = cache.capacity;
            let (kc, vc) = &mut cache.kv[li];
            for g in 0..nkv {
                let dst = (g * cap + past[r]) * hd;
                kc[dst..dst + hd].copy_from_slice(&k[(r * nkv + g) * hd..(r * nkv + g + 1) * hd]);
                vc[dst..dst + hd].copy_from_slice(&v[(r * nkv + g) * hd..(r * nkv + g + 1) * hd]);
            }
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let rep = nh / nkv;
        let shared: Vec<&Cache> = caches.iter().map(|c| &**c).collect();
        // One task per (row, head), on the team that runs the products
        // (docs/performance.md §2.5); `(row, head)`-major is the layout `finish_layer` takes.
        let mut att = vec![0f32; n * nh * hd];
        team::for_each_chunk(&mut att, hd, |rh, out| {
            let (r, head) = (rh / nh, rh % nh);
            let cache = shared[r];
            let (kc, vc) = &cache.kv[li];
            let base = (head / rep) * cache.capacity * hd;
            let total = past[r] + 1;
            attend(
                1,
                past[r],
                hd,
                scale,
                |_| &q[(r * nh + head) * hd..(r * nh + head + 1) * hd],
                &kc[base..base + total * hd],
                &vc[base..base + total * hd],
                cache.key_valid.as_ref().map(|kv| kv[0].as_slice()),
                out,
            );
        });
        self.finish_layer(l, x, &att, n, adapters);
    }
}
