//! A streaming safetensors writer: the header is written from the tensor list, then each
//! tensor's bytes are produced one at a time, so a multi-gigabyte checkpoint or export never
//! needs all of its data in memory at once.

use std::collections::BTreeMap;
use std::io::Write;

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};

/// One tensor of the file: its name, dtype and shape.
#[derive(Debug, Clone)]
pub struct TensorHeader {
    pub name: String,
    pub dtype: safetensors::Dtype,
    pub shape: Vec<usize>,
}

impl TensorHeader {
    pub fn byte_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

/// Writes a safetensors file: `entries` in order, `data(i)` returning the bytes of entry `i`
/// (exactly [`TensorHeader::byte_len`] long, little-endian).
pub fn write(
    out: &mut impl Write,
    entries: &[TensorHeader],
    metadata: &BTreeMap<String, String>,
    mut data: impl FnMut(usize) -> Result<Vec<u8>>,
) -> Result<()> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), serde_json::to_value(metadata)?);
    }
    let mut offset = 0usize;
    for e in entries {
        let len = e.byte_len();
        header.insert(
            e.name.clone(),
            serde_json::json!({
                "dtype": e.dtype.to_string(),
                "shape": e.shape,
                "data_offsets": [offset, offset + len],
            }),
        );
        offset += len;
    }
    let mut text = serde_json::to_string(&header)?.into_bytes();
    // The data section starts 8-aligned (as the reference implementation pads it).
    while (8 + text.len()) % 8 != 0 {
        text.push(b' ');
    }
    out.write_all(&(text.len() as u64).to_le_bytes())?;
    out.write_all(&text)?;
    for (i, e) in entries.iter().enumerate() {
        let bytes = data(i)?;
        if bytes.len() != e.byte_len() {
            bail!(
                "tensor {}: {} bytes produced, {} expected",
                e.name,
                bytes.len(),
                e.byte_len()
            );
        }
        out.write_all(&bytes)?;
    }
    Ok(())
}

/// Little-endian bytes of an f32 tensor.
pub fn f32_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    Ok(v.iter().flat_map(|x| x.to_le_bytes()).collect())
}

/// Little-endian bf16 bytes of a float tensor (round to nearest even, as `tensor.to(bfloat16)`).
pub fn bf16_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    Ok(v.iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn written_files_read_back() {
        let dev = Device::Cpu;
        let a = Tensor::new(&[[1.0f32, 2.5], [-3.0, 4.0]], &dev).unwrap();
        let b = Tensor::new(&[0.1f32, 1e-3, 7.0], &dev).unwrap();
        let entries = vec![
            TensorHeader {
                name: "a".into(),
                dtype: safetensors::Dtype::F32,
                shape: vec![2, 2],
            },
            TensorHeader {
                name: "b".into(),
                dtype: safetensors::Dtype::BF16,
                shape: vec![3],
            },
        ];
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let mut buf = Vec::new();
        write(&mut buf, &entries, &meta, |i| match i {
            0 => f32_bytes(&a),
            _ => bf16_bytes(&b),
        })
        .unwrap();
        let st = safetensors::SafeTensors::deserialize(&buf).unwrap();
        let (_, m) = safetensors::SafeTensors::read_metadata(&buf).unwrap();
        assert_eq!(m.metadata().as_ref().unwrap()["format"], "pt");
        assert_eq!(st.tensor("a").unwrap().data(), f32_bytes(&a).unwrap());
        let bv = st.tensor("b").unwrap();
        assert_eq!(bv.dtype(), safetensors::Dtype::BF16);
        let back: Vec<f32> = bv
            .data()
            .chunks(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        let exact: Vec<f32> = [0.1f32, 1e-3, 7.0]
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        assert_eq!(back, exact);
        assert_eq!(back[2], 7.0);
        assert!((back[0] - 0.1).abs() < 1e-3 && back[0] != 0.1);
    }
}
