//! What a GEMM call asks for, shared by the two paths that answer it — [`super::gemm`] (the
//! `gemm` crate) and [`super::few_rows`] (products of a few rows) — so that neither imports the
//! other's terms: whether the product may use the pool's threads, whether it overwrites or adds
//! to the destination, and where the inner dimension's sums are cut, which both paths must
//! agree on for their results to be the same bits (docs/model.md §9.5).

/// Whether a product may use several threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Par {
    /// One thread: the caller parallelises (e.g. over row tiles).
    Seq,
    /// Every thread of the current rayon pool.
    Rayon,
}

/// What happens to the destination's previous values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acc {
    /// `dst = β·lhs·rhs` (`dst` is not read).
    Set,
    /// `dst = dst + β·lhs·rhs`.
    Add,
}

/// Terms per block of the inner dimension: each block is one FMA chain per element, whose sum is
/// added to the destination in order. 512 is the `gemm` crate's own block for small outputs.
pub const K_BLOCK: usize = 512;
