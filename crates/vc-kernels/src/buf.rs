//! New output buffers whose values are written exactly once, without a zero-filling pass first
//! (for a 200 MB activation that pass costs as much as a cheap layer), and without `unsafe` in
//! the kernels that fill them.
//!
//! A kernel receives its part of the buffer as an [`Uninit`] and can only turn it into values
//! through methods that write every element ([`Uninit::fill`], [`Uninit::copy_from`],
//! [`Uninit::fill_rows`], [`Uninit::map_from`], [`Uninit::gemm`](super::gemm)); those return
//! an [`Init`], which the kernel hands back. [`new_vec`] and [`par_new_vec`] check that each
//! part came back initialised (same address and length) before the vector's length is set.

use std::mem::MaybeUninit;
use std::ops::{Deref, DerefMut};

use rayon::prelude::*;

/// Part of a new buffer whose values are not written yet.
pub struct Uninit<'t> {
    pub(super) slot: &'t mut [MaybeUninit<f32>],
}

/// Part of a new buffer whose values are all written.
pub struct Init<'t> {
    vals: &'t mut [f32],
}

impl<'t> Uninit<'t> {
    pub fn len(&self) -> usize {
        self.slot.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slot.is_empty()
    }

    /// Every value `v`.
    pub fn fill(self, v: f32) -> Init<'t> {
        for s in self.slot.iter_mut() {
            s.write(v);
        }
        // SAFETY: every element was written by the loop above.
        unsafe { self.assume_init() }
    }

    /// A copy of `src` (same length).
    pub fn copy_from(self, src: &[f32]) -> Init<'t> {
        self.map_from(src, |x| x)
    }

    /// Rows that are copies of `row` (the length must be a multiple of `row.len()`).
    pub fn fill_rows(self, row: &[f32]) -> Init<'t> {
        let n = self.slot.len();
        assert!(
            if row.is_empty() {
                n == 0
            } else {
                n.is_multiple_of(row.len())
            },
            "{n} values are not rows of {}",
            row.len()
        );
        if !row.is_empty() {
            for r in self.slot.chunks_exact_mut(row.len()) {
                for (d, &s) in r.iter_mut().zip(row) {
                    d.write(s);
                }
            }
        }
        // SAFETY: the chunks cover the whole slot (its length is a multiple of the row's) and
        // each was written.
        unsafe { self.assume_init() }
    }

    /// `f(src[i])` for every `i` (same length).
    #[inline(always)]
    pub fn map_from(self, src: &[f32], f: impl Fn(f32) -> f32) -> Init<'t> {
        assert_eq!(self.slot.len(), src.len(), "map_from: lengths differ");
        for (d, &s) in self.slot.iter_mut().zip(src) {
            d.write(f(s));
        }
        // SAFETY: the lengths are equal, so the loop wrote every element.
        unsafe { self.assume_init() }
    }

    /// # Safety
    /// Every element of the slot must have been written.
    pub(super) unsafe fn assume_init(self) -> Init<'t> {
        let (ptr, len) = (self.slot.as_mut_ptr().cast::<f32>(), self.slot.len());
        Init {
            // SAFETY: `MaybeUninit<f32>` has the layout of `f32`, the elements are initialised
            // (guaranteed by the caller), and the slot's unique borrow moves into the result.
            vals: unsafe { std::slice::from_raw_parts_mut(ptr, len) },
        }
    }
}

impl Deref for Init<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        self.vals
    }
}

impl DerefMut for Init<'_> {
    fn deref_mut(&mut self) -> &mut [f32] {
        self.vals
    }
}

fn check_returned(part: &Init<'_>, ptr: *const MaybeUninit<f32>, len: usize) {
    assert!(
        std::ptr::eq(part.vals.as_ptr().cast(), ptr) && part.vals.len() == len,
        "a kernel returned a different part of the buffer than it was given"
    );
}

/// A vector of `len` values written chunk by chunk (`chunk` values each, the last one
/// shorter): `f(i, part)` initialises chunk `i`, serially in order.
pub fn new_vec(
    len: usize,
    chunk: usize,
    mut f: impl for<'t> FnMut(usize, Uninit<'t>) -> Init<'t>,
) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(len);
    if len > 0 {
        for (i, slot) in out.spare_capacity_mut()[..len]
            .chunks_mut(chunk.max(1))
            .enumerate()
        {
            let (ptr, n) = (slot.as_ptr(), slot.len());
            let part = f(i, Uninit { slot });
            check_returned(&part, ptr, n);
        }
    }
    // SAFETY: the chunks cover the first `len` values of the spare capacity, and each came
    // back as an `Init` of the same address and length, which only exists once all of its
    // values are written.
    unsafe { out.set_len(len) };
    out
}

/// [`new_vec`] with the chunks processed in parallel (rayon: dynamic scheduling), each worker
/// job with its own scratch `init()`.
pub fn par_new_vec<S>(
    len: usize,
    chunk: usize,
    init: impl Fn() -> S + Sync + Send,
    f: impl for<'t, 's> Fn(usize, Uninit<'t>, &'s mut S) -> Init<'t> + Sync + Send,
) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(len);
    if len > 0 {
        out.spare_capacity_mut()[..len]
            .par_chunks_mut(chunk.max(1))
            .enumerate()
            .for_each_init(init, |scratch, (i, slot)| {
                let (ptr, n) = (slot.as_ptr(), slot.len());
                let part = f(i, Uninit { slot }, scratch);
                check_returned(&part, ptr, n);
            });
    }
    // SAFETY: as in `new_vec`: every chunk came back initialised (a panic in a chunk
    // propagates out of `for_each_init` before this line).
    unsafe { out.set_len(len) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_constructor_writes_everything() {
        let v = new_vec(10, 4, |i, part| match i {
            0 => part.fill(1.0),
            1 => part.copy_from(&[2.0, 3.0, 4.0, 5.0]),
            _ => part.fill_rows(&[6.0, 7.0]),
        });
        assert_eq!(v, [1.0, 1.0, 1.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
        let src: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        let w = par_new_vec(
            1000,
            64,
            || 0usize,
            |i, part, calls| {
                *calls += 1;
                let mut p = part.map_from(&src[i * 64..(i * 64 + 64).min(1000)], |x| 2.0 * x);
                p[0] += 0.5;
                p
            },
        );
        for (i, &x) in w.iter().enumerate() {
            let want = 2.0 * i as f32 + if i % 64 == 0 { 0.5 } else { 0.0 };
            assert_eq!(x, want);
        }
        assert!(new_vec(0, 0, |_, p| p.fill(0.0)).is_empty());
    }

    #[test]
    #[should_panic(expected = "different part")]
    fn a_part_must_come_back_whole() {
        new_vec(8, 8, |_, part| {
            let (half, _) = part.slot.split_at_mut(4);
            Uninit { slot: half }.fill(0.0)
        });
    }
}
