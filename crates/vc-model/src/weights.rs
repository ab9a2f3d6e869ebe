//! Loading checkpoint tensors from memory-mapped safetensors files.
//!
//! Every tensor is converted to the compute dtype as it is read (bf16 on disk -> f32 on CPU),
//! and the mapped pages of the source are released right after, so peak memory is the
//! converted weights plus one tensor, not weights plus the whole mapped file.
//! Lookups check shapes against what the config implies and name the tensor and the file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};

use super::overlay::WeightOverlay;

/// For a tensor (name, shape on disk): the dtype to load it in and the rows of dimension 0 to load,
/// or `None` to skip it.
type LoadSelect<'a> = dyn Fn(&str, &[usize]) -> Option<(DType, std::ops::Range<usize>)> + 'a;

/// All tensors of one or more safetensors files, converted to `dtype` on `device`.
pub struct Weights {
    tensors: HashMap<String, Tensor>,
    /// Which file each tensor came from, for error messages.
    origin: HashMap<String, PathBuf>,
    files: Vec<PathBuf>,
    dtype: DType,
    device: Device,
}

impl Weights {
    /// Loads every tensor of `files` whose name passes `keep`.
    pub fn load(
        files: &[PathBuf],
        dtype: DType,
        device: &Device,
        keep: impl Fn(&str) -> bool,
    ) -> Result<Self> {
        Self::load_as(files, dtype, device, |name| keep(name).then_some(dtype))
    }

    /// Loads the tensors for which `dtype_of` names a dtype, each converted to that dtype
    /// (e.g. f16 matrices next to f32 norms); [`Self::dtype`] reports `dtype`, the activation
    /// dtype.
    pub fn load_as(
        files: &[PathBuf],
        dtype: DType,
        device: &Device,
        dtype_of: impl Fn(&str) -> Option<DType>,
    ) -> Result<Self> {
        Self::load_selected(files, dtype, device, |name, shape| {
            dtype_of(name).map(|d| (d, 0..shape.first().copied().unwrap_or(1)))
        })
    }

    /// Loads, of each tensor for which `rows_of(name, shape)` names rows, only those rows of
    /// dimension 0 (a rank's shard of a sharded run), in `dtype`. Tensors keep the names of the
    /// checkpoint; a rank that owns no rows of a tensor gets it with 0 rows.
    pub fn load_rows(
        files: &[PathBuf],
        dtype: DType,
        device: &Device,
        rows_of: impl Fn(&str, &[usize]) -> Option<std::ops::Range<usize>>,
    ) -> Result<Self> {
        Self::load_selected(files, dtype, device, |name, shape| {
            rows_of(name, shape).map(|r| (dtype, r))
        })
    }

    fn load_selected(
        files: &[PathBuf],
        dtype: DType,
        device: &Device,
        select: impl Fn(&str, &[usize]) -> Option<(DType, std::ops::Range<usize>)>,
    ) -> Result<Self> {
        let mut w = Weights {
            tensors: HashMap::new(),
            origin: HashMap::new(),
            files: files.to_vec(),
            dtype,
            device: device.clone(),
        };
        for file in files {
            w.load_file(file, &select)
                .with_context(|| format!("cannot load checkpoint {}", file.display()))?;
        }
        Ok(w)
    }

    fn load_file(&mut self, path: &Path, select: &LoadSelect) -> Result<()> {
        let file = std::fs::File::open(path)?;
        // SAFETY: the mapping is read-only and private to this function; checkpoint files are
        // not expected to change while they load (as with every mmap-based loader).
        let mmap = unsafe { Mmap::map(&file)? };
        let st = SafeTensors::deserialize(&mmap)
            .map_err(|e| anyhow::anyhow!("not a valid safetensors file: {e}"))?;
        let base = mmap.as_ptr() as usize;
        for (name, view) in st.iter() {
            let Some((dtype, rows)) = select(name, view.shape()) else {
                continue;
            };
            let mut shape = view.shape().to_vec();
            let all = shape.first().copied().unwrap_or(1);
            let (data, shape) = if rows == (0..all) {
                (view.data(), shape)
            } else {
                anyhow::ensure!(
                    !shape.is_empty() && rows.start <= rows.end && rows.end <= all,
                    "tensor {name} {:?} has no rows {rows:?}",
                    view.shape()
                );
                let row_bytes = view.data().len() / all.max(1);
                shape[0] = rows.len();
                (
                    &view.data()[rows.start * row_bytes..rows.end * row_bytes],
                    shape,
                )
            };
            let tensor = to_tensor(view.dtype(), &shape, data, dtype, &self.device)
                .with_context(|| format!("tensor {name}"))?;
            // Give the mapped pages of this tensor back now that it has been converted.
            let data = view.data();
            let start = data.as_ptr() as usize - base;
            let page = 4096;
            let aligned = start.div_ceil(page) * page;
            let end = (start + data.len()) / page * page;
            if end > aligned {
                // SAFETY: read-only file mapping; dropped pages are re-read from the file if
                // touched again, and nothing borrows them after the conversion above.
                unsafe {
                    let _ = mmap.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        aligned,
                        end - aligned,
                    );
                }
            }
            self.origin.insert(name.to_string(), path.to_path_buf());
            self.tensors.insert(name.to_string(), tensor);
        }
        Ok(())
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The tensor `name`, which must have `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.get_any(name)?;
        if t.dims() != shape {
            bail!(
                "checkpoint {}: tensor {name} has shape {:?} but the model config implies {:?}",
                self.origin_of(name),
                t.dims(),
                shape
            );
        }
        Ok(t)
    }

    /// The tensor `name`, whatever its shape.
    pub fn get_any(&self, name: &str) -> Result<Tensor> {
        match self.tensors.get(name) {
            Some(t) => Ok(t.clone()),
            None => bail!(
                "checkpoint {} has no tensor {name} (does it match its config.json?)",
                self.files_display()
            ),
        }
    }

    /// Replaces the tensor `name` (which must be loaded, with the same shape) by `t`, converted
    /// to its dtype and device.
    pub fn replace(&mut self, name: &str, t: Tensor) -> Result<()> {
        let Some(old) = self.tensors.get_mut(name) else {
            bail!(
                "checkpoint {} has no tensor {name} to replace",
                self.files_display()
            );
        };
        if old.dims() != t.dims() {
            bail!(
                "{name}: a {:?} tensor cannot replace a {:?} one",
                t.dims(),
                old.dims()
            );
        }
        *old = t.to_dtype(old.dtype())?.to_device(old.device())?;
        Ok(())
    }

    /// Takes the tensor `name` out (its memory goes with the caller), whatever its shape.
    pub fn take(&mut self, name: &str) -> Result<Tensor> {
        match self.tensors.remove(name) {
            Some(t) => Ok(t),
            None => bail!(
                "checkpoint {} has no tensor {name} (does it match its config.json?)",
                self.files_display()
            ),
        }
    }

    /// Names of the loaded tensors that start with `prefix`, sorted.
    pub fn names_with_prefix(&self, prefix: &str) -> Vec<String> {
        let mut names: Vec<String> = self
            .tensors
            .keys()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect();
        names.sort();
        names
    }

    fn origin_of(&self, name: &str) -> String {
        self.origin
            .get(name)
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| self.files_display())
    }

    fn files_display(&self) -> String {
        self.files
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Converts raw little-endian safetensors bytes into a tensor of `dtype`.
fn to_tensor(
    src: StDtype,
    shape: &[usize],
    data: &[u8],
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let src_dtype = match src {
        StDtype::BF16 => DType::BF16,
        StDtype::F16 => DType::F16,
        StDtype::F32 => DType::F32,
        StDtype::F64 => DType::F64,
        StDtype::I64 => DType::I64,
        StDtype::U8 => DType::U8,
        StDtype::U32 => DType::U32,
        other => bail!("unsupported tensor dtype {other:?}"),
    };
    if src_dtype == DType::BF16 && dtype == DType::F32 {
        // Straight to f32 without an intermediate bf16 tensor: halves peak memory per tensor.
        let values: Vec<f32> = data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        return Ok(Tensor::from_vec(values, shape, device)?);
    }
    let t = Tensor::from_raw_buffer(data, src_dtype, shape, device)?;
    if src_dtype.is_float() && src_dtype != dtype {
        Ok(t.to_dtype(dtype)?)
    } else {
        Ok(t)
    }
}

// ---------------------------------------------------------------------------------------------
// Memory-mapped checkpoints read in place (the row inference path, docs/performance.md §2.2)
// ---------------------------------------------------------------------------------------------

/// One tensor's place in a mapped file.
#[derive(Debug, Clone)]
struct MappedEntry {
    shard: usize,
    dtype: StDtype,
    shape: Vec<usize>,
    /// Byte range in the shard.
    start: usize,
    end: usize,
}

/// Checkpoint files kept memory-mapped, for the row inference path: bf16 matrices are used where
/// they lie in the page cache ([`Bf16Data`]), without a converted copy; other tensors are
/// converted on request. Lookups check shapes and name the tensor and the file, like
/// [`Weights::get`].
pub struct MappedWeights {
    maps: Vec<Arc<Mmap>>,
    files: Vec<PathBuf>,
    tensors: HashMap<String, MappedEntry>,
    /// Tensors an adapter changes: read through it and kept in the stored dtype.
    overlay: Option<Arc<WeightOverlay>>,
}

/// bf16 values, either in place in a mapped checkpoint or owned (converted from another dtype).
#[derive(Clone)]
pub struct Bf16Data(Bf16Storage);

#[derive(Clone)]
enum Bf16Storage {
    Mapped {
        map: Arc<Mmap>,
        start: usize,
        len: usize,
    },
    Owned(Vec<u16>),
}

impl std::fmt::Debug for Bf16Data {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Bf16Storage::Mapped { len, .. } => write!(f, "Bf16Data(mapped, {len} values)"),
            Bf16Storage::Owned(v) => write!(f, "Bf16Data(owned, {} values)", v.len()),
        }
    }
}

impl Bf16Data {
    /// The raw bf16 bits.
    pub fn bits(&self) -> &[u16] {
        match &self.0 {
            Bf16Storage::Mapped { map, start, len } => {
                bytemuck::cast_slice(&map[*start..*start + 2 * *len])
            }
            Bf16Storage::Owned(v) => v,
        }
    }

    /// Whether the values are read in place from the mapped file.
    pub fn is_mapped(&self) -> bool {
        matches!(self.0, Bf16Storage::Mapped { .. })
    }

    /// Owned values (rounded to bf16 by the caller).
    pub fn owned(bits: Vec<u16>) -> Self {
        Bf16Data(Bf16Storage::Owned(bits))
    }
}

impl MappedWeights {
    /// Maps every file and reads the headers (nothing else is read yet).
    pub fn open(files: &[PathBuf]) -> Result<Self> {
        let mut w = MappedWeights {
            maps: Vec::new(),
            files: files.to_vec(),
            tensors: HashMap::new(),
            overlay: None,
        };
        for (shard, path) in files.iter().enumerate() {
            let file = std::fs::File::open(path)
                .with_context(|| format!("cannot open checkpoint {}", path.display()))?;
            // SAFETY: the mapping is read-only; checkpoint files are not expected to change
            // while a model uses them (as with every mmap-based loader). A file truncated by
            // someone else while mapped would fault, not corrupt memory safety of the Rust side
            // beyond that process-level hazard, which all mmap loaders share.
            let mmap = unsafe { Mmap::map(&file) }
                .with_context(|| format!("cannot map checkpoint {}", path.display()))?;
            let st = SafeTensors::deserialize(&mmap).map_err(|e| {
                anyhow::anyhow!(
                    "checkpoint {}: not a valid safetensors file: {e}",
                    path.display()
                )
            })?;
            let base = mmap.as_ptr() as usize;
            for (name, view) in st.iter() {
                let start = view.data().as_ptr() as usize - base;
                w.tensors.insert(
                    name.to_string(),
                    MappedEntry {
                        shard,
                        dtype: view.dtype(),
                        shape: view.shape().to_vec(),
                        start,
                        end: start + view.data().len(),
                    },
                );
            }
            drop(st);
            w.maps.push(Arc::new(mmap));
        }
        Ok(w)
    }

    /// Reads the tensors `overlay` changes through it (docs/training.md §13); each is then
    /// held as the checkpoint stores it (rounded to bf16 where it stores bf16).
    pub fn with_overlay(mut self, overlay: Option<Arc<WeightOverlay>>) -> Self {
        self.overlay = overlay;
        self
    }

    fn changed(&self, name: &str) -> bool {
        self.overlay.as_ref().is_some_and(|o| o.contains(name))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The stored dtype of `name`.
    pub fn stored_dtype(&self, name: &str) -> Option<StDtype> {
        self.tensors.get(name).map(|e| e.dtype)
    }

    fn entry(&self, name: &str, shape: &[usize]) -> Result<&MappedEntry> {
        let Some(e) = self.tensors.get(name) else {
            bail!(
                "checkpoint {} has no tensor {name} (does it match its config.json?)",
                self.files_display()
            );
        };
        if e.shape != shape {
            bail!(
                "checkpoint {}: tensor {name} has shape {:?} but the model config implies {:?}",
                self.files[e.shard].display(),
                e.shape,
                shape
            );
        }
        Ok(e)
    }

    fn bytes(&self, e: &MappedEntry) -> &[u8] {
        &self.maps[e.shard][e.start..e.end]
    }

    /// `name` (of `shape`) converted to f32 (exact from bf16, f16 and f32); a tensor the
    /// overlay changes, changed and rounded to its stored dtype.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let stored = self.stored_f32(name, shape)?;
        let Some(overlay) = self.overlay.as_ref().filter(|o| o.contains(name)) else {
            return Ok(stored);
        };
        let mut v = overlay.apply(name, shape, stored)?;
        match self.entry(name, shape)?.dtype {
            StDtype::BF16 => v
                .iter_mut()
                .for_each(|x| *x = half::bf16::from_f32(*x).to_f32()),
            StDtype::F16 => v
                .iter_mut()
                .for_each(|x| *x = half::f16::from_f32(*x).to_f32()),
            _ => {}
        }
        Ok(v)
    }

    fn stored_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let e = self.entry(name, shape)?;
        let b = self.bytes(e);
        Ok(match e.dtype {
            StDtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            StDtype::BF16 => b
                .chunks_exact(2)
                .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
                .collect(),
            StDtype::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => bail!(
                "checkpoint {}: tensor {name} is {other:?}, expected a float type",
                self.files[e.shard].display()
            ),
        })
    }

    /// `name` as bf16: in place when the file stores bf16 (and the data is 2-byte aligned),
    /// else rounded from its stored values.
    pub fn bf16(&self, name: &str, shape: &[usize]) -> Result<Bf16Data> {
        let e = self.entry(name, shape)?;
        if e.dtype == StDtype::BF16
            && e.start.is_multiple_of(2)
            && cfg!(target_endian = "little")
            && !self.changed(name)
        {
            return Ok(Bf16Data(Bf16Storage::Mapped {
                map: self.maps[e.shard].clone(),
                start: e.start,
                len: (e.end - e.start) / 2,
            }));
        }
        let v = self.f32(name, shape)?;
        Ok(Bf16Data::owned(
            v.iter()
                .map(|x| half::bf16::from_f32(*x).to_bits())
                .collect(),
        ))
    }

    /// Maps `name`'s pages in now (read from the page cache or the file), so that the first
    /// use does not take a page fault per 4 KiB; for matrices read every frame in place.
    pub fn populate(&self, name: &str) {
        if self.changed(name) {
            return;
        }
        if let Some(e) = self.tensors.get(name) {
            let (start, len) = (e.start / 4096 * 4096, e.end - e.start / 4096 * 4096);
            let map = &self.maps[e.shard];
            #[cfg(target_os = "linux")]
            let populated = map
                .advise_range(memmap2::Advice::PopulateRead, start, len)
                .is_ok();
            #[cfg(not(target_os = "linux"))]
            let populated = false;
            if !populated {
                // Kernels before 5.14 (or other systems): at least start reading ahead.
                let _ = map.advise_range(memmap2::Advice::WillNeed, start, len);
            }
        }
    }

    /// Gives back the resident pages of `name` (after it was converted or quantized; nothing
    /// may still borrow them — owned conversions do not, [`Bf16Data`] in place does).
    pub fn release(&self, name: &str) {
        let Some(e) = self.tensors.get(name) else {
            return;
        };
        let page = 4096;
        let aligned = e.start.div_ceil(page) * page;
        let end = e.end / page * page;
        if end > aligned {
            // SAFETY: read-only private file mapping: dropped pages are re-read from the file
            // if touched again, so any borrow (a mapped Bf16Data) stays valid and sees the same
            // bytes; the advice only costs a re-read.
            unsafe {
                let _ = self.maps[e.shard].unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    aligned,
                    end - aligned,
                );
            }
        }
    }

    fn files_display(&self) -> String {
        self.files
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }
}
