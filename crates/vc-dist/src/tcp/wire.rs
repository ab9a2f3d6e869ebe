//! The bytes the TCP collectives carry (docs/distributed.md §3): a tensor's values as raw
//! little-endian bytes on the host and a tensor rebuilt from them, in every dtype the ring moves
//! (f32, bf16, f64, u32), and plain values copied out of a received buffer whatever its
//! alignment. These conversions are the one place the ring meets dtypes; the ring itself
//! moves bytes.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

pub(super) fn f32_bytes(v: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

pub(super) fn f32_from(bytes: &[u8]) -> Vec<f32> {
    pod_vec(bytes)
}

/// `bytes` (a whole number of `T`s, any alignment) copied into a `Vec<T>`.
pub(super) fn pod_vec<T: bytemuck::Pod + Default>(bytes: &[u8]) -> Vec<T> {
    let n = bytes.len() / std::mem::size_of::<T>();
    let mut v = vec![T::default(); n];
    bytemuck::cast_slice_mut(&mut v).copy_from_slice(&bytes[..n * std::mem::size_of::<T>()]);
    v
}

/// A contiguous tensor's raw bytes on the host, and how to rebuild one from them.
pub(super) fn to_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.to_device(&Device::Cpu)?.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => f32_bytes(&t.to_vec1::<f32>()?),
        DType::BF16 => {
            let v: Vec<u16> = t
                .to_vec1::<half::bf16>()?
                .iter()
                .map(|x| x.to_bits())
                .collect();
            bytemuck::cast_slice(&v).to_vec()
        }
        DType::F64 => bytemuck::cast_slice(&t.to_vec1::<f64>()?).to_vec(),
        DType::U32 => bytemuck::cast_slice(&t.to_vec1::<u32>()?).to_vec(),
        other => bail!("the TCP collectives do not carry {other:?} tensors"),
    })
}

pub(super) fn from_bytes(
    bytes: &[u8],
    dtype: DType,
    shape: &[usize],
    device: &Device,
) -> Result<Tensor> {
    let t = match dtype {
        DType::F32 => Tensor::from_vec(f32_from(bytes), shape, &Device::Cpu)?,
        DType::BF16 => {
            let v: Vec<u16> = pod_vec(bytes);
            let v: Vec<half::bf16> = v.into_iter().map(half::bf16::from_bits).collect();
            Tensor::from_vec(v, shape, &Device::Cpu)?
        }
        DType::F64 => Tensor::from_vec(pod_vec::<f64>(bytes), shape, &Device::Cpu)?,
        DType::U32 => Tensor::from_vec(pod_vec::<u32>(bytes), shape, &Device::Cpu)?,
        other => bail!("the TCP collectives do not carry {other:?} tensors"),
    };
    Ok(t.to_device(device)?)
}
