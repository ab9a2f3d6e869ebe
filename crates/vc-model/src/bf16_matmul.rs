//! `x @ w^T` for f32 activations and bf16-stored weights on the CPU.
//!
//! Generation is memory-bandwidth bound (docs/performance.md §2): every frame reads all talker and
//! code predictor matrices for a handful of input rows. The official checkpoints are bf16, so
//! keeping the matrices in bf16 halves the bytes read per frame without changing a single
//! weight value; products are accumulated in f32, so results equal the f32 model up to the
//! summation order. candle's CPU GEMM has no fast bf16 path, hence this kernel
//! ([`vc_kernels::matvec::bf16`]): each weight row is widened once (a 16-bit shift) and
//! dotted with every input row, output rows split across threads. Larger inputs (prefill)
//! widen the whole matrix and use the regular GEMM instead.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Storage, Tensor};

use vc_kernels::matvec::bf16::{matmul_t, MAX_ROWS};

/// `x (M, K) f32 @ w (N, K) bf16 ^T -> (M, N) f32`, or `None` when the fast path does not apply
/// (not CPU, other dtypes, non-contiguous weights, many rows); the caller then falls back.
pub fn try_matmul_t(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    if w.dtype() != DType::BF16 || x.dtype() != DType::F32 || !w.device().is_cpu() {
        return Ok(None);
    }
    let (m, k) = x.dims2()?;
    let (n, kw) = w.dims2()?;
    if k != kw {
        candle_core::bail!("matmul: input width {k} does not match weight width {kw}");
    }
    if m > MAX_ROWS {
        let y = x.matmul(&w.to_dtype(DType::F32)?.t()?)?;
        return Ok(Some(y));
    }
    let (storage, layout) = w.storage_and_layout();
    let Storage::Cpu(CpuStorage::BF16(data)) = &*storage else {
        return Ok(None);
    };
    let Some((start, end)) = contiguous_range(layout) else {
        return Ok(None);
    };
    let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
    let out = matmul_t(&xs, m, &data[start..end], n, k);
    Ok(Some(Tensor::from_vec(
        out,
        Shape::from((m, n)),
        x.device(),
    )?))
}

fn contiguous_range(layout: &Layout) -> Option<(usize, usize)> {
    layout
        .contiguous_offsets()
        .filter(|_| layout.is_contiguous())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn matches_f32_matmul_for_every_row_count() {
        let dev = Device::Cpu;
        for (m, k, n) in [
            (1, 37, 5),
            (2, 64, 33),
            (8, 100, 17),
            (9, 16, 3),
            (3, 1024, 70),
        ] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            let want = x
                .matmul(&w.to_dtype(DType::F32).unwrap().t().unwrap())
                .unwrap();
            let got = try_matmul_t(&x, &w).unwrap().expect("fast path");
            assert_eq!(got.dims(), want.dims());
            let err = (got - &want)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let scale = (k as f32).sqrt();
            assert!(err < 1e-5 * scale * 4.0, "m {m} k {k} n {n}: {err}");
        }
    }

    #[test]
    fn other_dtypes_fall_back() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((1, 4), DType::F32, &dev).unwrap();
        let w = Tensor::zeros((3, 4), DType::F32, &dev).unwrap();
        assert!(try_matmul_t(&x, &w).unwrap().is_none());
    }
}
