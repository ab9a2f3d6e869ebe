//! Weights of the row inference path ([`super::infer`]) that are not candle tensors: a matrix in
//! the format its precision asks for — f32, bf16 (in place in the mapped checkpoint where the
//! file stores bf16) or 8- or 4-bit blocks quantized at load time — and embedding tables, whose rows
//! are widened to f32 when gathered (docs/performance.md §2.2).
//!
//! The training path never sees these: it builds the talker from candle tensors
//! ([`super::layers::TensorSource`]).

use std::cell::OnceCell;

use anyhow::{Context, Result};

use super::weights::{Bf16Data, MappedWeights};
use vc_kernels::bf16_dot::{self, Dense, Rows};
use vc_kernels::q4::{Q4Kind, Q4Matrix};
use vc_kernels::q8::{Q8Matrix, Q8Rows};

/// How the matrices of the row inference path are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// f32 (exact for every checkpoint; a bf16-stored matrix is held as [`Self::Bf16`] holds
    /// it, since its f32 values are its bf16 bits widened).
    F32,
    /// bf16: the stored values of a bf16 checkpoint, read in place; rounded from f32 otherwise.
    /// The arithmetic is f32 either way: the kernels widen the weights in registers.
    Bf16,
    /// 8-bit blocks with an f16 scale per 32 weights ([`vc_kernels::q8`]).
    Q8,
    /// 4-bit blocks with an f16 scale per 32 weights ([`vc_kernels::q4`], its symmetric kind:
    /// docs/performance.md §2.6 has why).
    Q4,
}

/// One `(n, k)` matrix (PyTorch layout: `y = x · Wᵀ`).
#[derive(Debug, Clone)]
pub enum LinearWeight {
    F32 {
        w: Vec<f32>,
        n: usize,
        k: usize,
    },
    /// bf16 bits (in place in the mapped checkpoint where it stores bf16), widened to f32 in
    /// registers by the kernels: the f32 precision over a bf16-stored matrix, and `bf16-weights`.
    Bf16 {
        w: Bf16Data,
        n: usize,
        k: usize,
    },
    Q8(Q8Matrix),
    Q4(Q4Matrix),
}

impl LinearWeight {
    /// Loads `name` `(n, k)` in `format`. For [`WeightFormat::Q8`] and [`WeightFormat::Q4`]
    /// the source pages are given back after quantizing.
    pub fn load(
        src: &MappedWeights,
        name: &str,
        n: usize,
        k: usize,
        format: WeightFormat,
    ) -> Result<Self> {
        let shape = [n, k];
        Ok(match format {
            WeightFormat::F32 if src.stored_dtype(name) != Some(safetensors::Dtype::BF16) => {
                LinearWeight::F32 {
                    w: src.f32(name, &shape)?,
                    n,
                    k,
                }
            }
            WeightFormat::F32 | WeightFormat::Bf16 => {
                let w = src.bf16(name, &shape)?;
                if w.is_mapped() {
                    src.populate(name);
                }
                LinearWeight::Bf16 { w, n, k }
            }
            WeightFormat::Q8 => {
                let q = if src.stored_dtype(name) == Some(safetensors::Dtype::BF16) {
                    let b = src.bf16(name, &shape)?;
                    Q8Matrix::from_bf16(b.bits(), n, k)
                } else {
                    Q8Matrix::from_f32(&src.f32(name, &shape)?, n, k)
                }
                .with_context(|| format!("quantizing {name}"))?;
                src.release(name);
                LinearWeight::Q8(q)
            }
            WeightFormat::Q4 => {
                let kind = Q4Kind::Symmetric;
                let q = if src.stored_dtype(name) == Some(safetensors::Dtype::BF16) {
                    let b = src.bf16(name, &shape)?;
                    Q4Matrix::from_bf16(b.bits(), n, k, kind)
                } else {
                    Q4Matrix::from_f32(&src.f32(name, &shape)?, n, k, kind)
                }
                .with_context(|| format!("quantizing {name}"))?;
                src.release(name);
                LinearWeight::Q4(q)
            }
        })
    }

    /// `(n, k)`.
    pub fn dims(&self) -> (usize, usize) {
        match self {
            LinearWeight::F32 { n, k, .. } | LinearWeight::Bf16 { n, k, .. } => (*n, *k),
            LinearWeight::Q8(q) => q.dims(),
            LinearWeight::Q4(q) => q.dims(),
        }
    }

    /// Bytes read by one product (the matrix as stored for the kernels).
    pub fn bytes(&self) -> usize {
        match self {
            LinearWeight::F32 { w, .. } => 4 * w.len(),
            LinearWeight::Bf16 { w, .. } => 2 * w.bits().len(),
            LinearWeight::Q8(q) => q.bytes(),
            LinearWeight::Q4(q) => q.bytes(),
        }
    }

    /// `x (m, k) · Wᵀ → (m, n)`.
    pub fn forward(&self, x: &Input<'_>) -> Vec<f32> {
        let (n, k) = self.dims();
        assert_eq!(
            x.k, k,
            "linear layer of width {k} given rows of width {}",
            x.k
        );
        let mut out = vec![0f32; x.m * n];
        match self {
            LinearWeight::F32 { w, .. } => {
                bf16_dot::matmul_t(Dense::F32(w), n, x.dense(), &mut out)
            }
            LinearWeight::Bf16 { w, .. } => {
                bf16_dot::matmul_t(Dense::Bf16(w.bits()), n, x.dense(), &mut out)
            }
            LinearWeight::Q8(q) => q.matmul_t(x.q8(), &mut out),
            LinearWeight::Q4(q) => q.matmul_t(x.q8(), &mut out),
        }
        out
    }

    /// [`Self::forward`] with a bias added to every row.
    pub fn forward_bias(&self, x: &Input<'_>, bias: &[f32]) -> Vec<f32> {
        let mut y = self.forward(x);
        for row in y.chunks_exact_mut(bias.len()) {
            row.iter_mut().zip(bias).for_each(|(a, b)| *a += b);
        }
        y
    }
}

/// Activation rows `(m, k)` for one or more products, prepared for each kernel once (the bf16
/// parts or the 8-bit blocks, which the 8- and 4-bit matrices share), when first needed.
pub struct Input<'a> {
    x: &'a [f32],
    m: usize,
    k: usize,
    dense: OnceCell<Rows<'a>>,
    q8: OnceCell<Q8Rows>,
}

impl<'a> Input<'a> {
    pub fn new(x: &'a [f32], m: usize, k: usize) -> Self {
        assert_eq!(x.len(), m * k, "{} activations for ({m}, {k})", x.len());
        Self {
            x,
            m,
            k,
            dense: OnceCell::new(),
            q8: OnceCell::new(),
        }
    }

    fn dense(&self) -> &Rows<'a> {
        self.dense.get_or_init(|| Rows::new(self.x, self.m, self.k))
    }

    fn q8(&self) -> &Q8Rows {
        self.q8.get_or_init(|| {
            Q8Rows::quantize(self.x, self.m, self.k).expect("length checked in Input::new")
        })
    }
}

/// An embedding table `(rows, width)`: f32, or bf16 (in place where the file stores bf16).
#[derive(Debug, Clone)]
pub enum Table {
    F32 {
        w: Vec<f32>,
        rows: usize,
        width: usize,
    },
    Bf16 {
        w: Bf16Data,
        rows: usize,
        width: usize,
    },
}

impl Table {
    /// Loads `name` `(rows, width)`: kept bf16 when stored so (rows are widened exactly when
    /// gathered), f32 otherwise.
    pub fn load(src: &MappedWeights, name: &str, rows: usize, width: usize) -> Result<Self> {
        let shape = [rows, width];
        Ok(
            if src.stored_dtype(name) == Some(safetensors::Dtype::BF16) {
                Table::Bf16 {
                    w: src.bf16(name, &shape)?,
                    rows,
                    width,
                }
            } else {
                Table::F32 {
                    w: src.f32(name, &shape)?,
                    rows,
                    width,
                }
            },
        )
    }

    pub fn width(&self) -> usize {
        match self {
            Table::F32 { width, .. } | Table::Bf16 { width, .. } => *width,
        }
    }

    pub fn rows(&self) -> usize {
        match self {
            Table::F32 { rows, .. } | Table::Bf16 { rows, .. } => *rows,
        }
    }

    /// Adds row `id` to `out` (`width` values).
    pub fn add_row(&self, id: usize, out: &mut [f32]) -> Result<()> {
        anyhow::ensure!(
            id < self.rows(),
            "embedding id {id} is out of range for a table of {} rows",
            self.rows()
        );
        let w = self.width();
        match self {
            Table::F32 { w: t, .. } => out
                .iter_mut()
                .zip(&t[id * w..(id + 1) * w])
                .for_each(|(o, v)| *o += v),
            Table::Bf16 { w: t, .. } => out
                .iter_mut()
                .zip(&t.bits()[id * w..(id + 1) * w])
                .for_each(|(o, v)| *o += f32::from_bits((*v as u32) << 16)),
        }
        Ok(())
    }

    /// Rows `ids` stacked, `(ids.len(), width)`.
    pub fn gather(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let w = self.width();
        let mut out = vec![0f32; ids.len() * w];
        for (o, id) in out.chunks_exact_mut(w).zip(ids) {
            self.add_row(*id as usize, o)?;
        }
        Ok(out)
    }
}
