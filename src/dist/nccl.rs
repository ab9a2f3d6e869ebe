//! The GPU collective backend (docs/distributed.md §3): NCCL through `cudarc::nccl`, one
//! communicator per rank process, collectives enqueued on candle's CUDA stream (so they are
//! ordered with the kernels that produce and consume their tensors). The rendezvous, host values
//! (losses, flags), barriers and aborts go through the TCP control plane and ring of
//! [`super::tcp`]; rank 0 creates the NCCL unique id and passes it in the rendezvous.
//!
//! NCCL needs equal chunk sizes on every rank, which the padded flat shards of [`super::flat`]
//! provide. Compiled in CI (`scripts/check_cuda_build.sh`); it runs only where a GPU is.

use anyhow::{bail, Context, Result};
use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, ReduceOp as NcclOp};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{DType, Device, Storage, StorageRef, Tensor};
use half::bf16;

use super::collective::{Collective, ReduceOp};
use super::tcp::{Endpoint, TcpCollective};

/// A rank of a GPU run.
pub struct NcclCollective {
    comm: Comm,
    tcp: TcpCollective,
    device: CudaDevice,
}

// SAFETY: the communicator is only used from the rank's training thread; the control plane's
// threads never touch it (they only shut the TCP sockets down).
unsafe impl Send for NcclCollective {}
// SAFETY: as above — shared references are only used by the one thread that drives the run.
unsafe impl Sync for NcclCollective {}

impl NcclCollective {
    /// Joins the run at `ep` on `device` (the GPU of this rank).
    pub fn connect(ep: &Endpoint, device: &Device) -> Result<Self> {
        let Device::Cuda(cuda) = device else {
            bail!("the NCCL backend needs a CUDA device, not {device:?}");
        };
        let payload = if ep.rank == 0 {
            let id = Id::new().map_err(|e| anyhow::anyhow!("ncclGetUniqueId failed: {e:?}"))?;
            id.internal().iter().map(|&c| c as u8).collect()
        } else {
            Vec::new()
        };
        let tcp = TcpCollective::connect(ep, payload)?;
        let bytes = tcp.payload();
        anyhow::ensure!(
            bytes.len() == 128,
            "rank {}: the NCCL id from rank 0 has {} bytes, expected 128",
            ep.rank,
            bytes.len()
        );
        let mut internal = [0 as std::ffi::c_char; 128];
        for (d, &b) in internal.iter_mut().zip(bytes) {
            *d = b as std::ffi::c_char;
        }
        let comm = Comm::from_rank(cuda.cuda_stream(), ep.rank, ep.world, Id::uninit(internal))
            .map_err(|e| anyhow::anyhow!("rank {}: ncclCommInitRank failed: {e:?}", ep.rank))?;
        Ok(Self {
            comm,
            tcp,
            device: cuda.clone(),
        })
    }

    fn wrap<T: candle_core::cuda_backend::CudaDType>(
        &self,
        slice: candle_core::cuda_backend::cudarc::driver::CudaSlice<T>,
        shape: &[usize],
    ) -> Tensor {
        let storage = CudaStorage::wrap_cuda_slice(slice, self.device.clone());
        Tensor::from_storage(
            Storage::Cuda(storage),
            shape,
            candle_core::op::BackpropOp::none(),
            false,
        )
    }
}

/// The contiguous CUDA storage of `t` and its element range.
fn cuda_parts(t: &Tensor) -> Result<(StorageRef<'_>, usize, usize)> {
    let (storage, layout) = t.storage_and_layout();
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("NCCL collectives need contiguous tensors");
    };
    if !matches!(&*storage, Storage::Cuda(_)) {
        bail!("NCCL collectives need CUDA tensors");
    }
    Ok((storage, start, end))
}

fn nccl_err(what: &str, e: impl std::fmt::Debug) -> anyhow::Error {
    anyhow::anyhow!("NCCL {what} failed: {e:?}")
}

macro_rules! with_slice {
    ($storage:expr, $t:ty, $start:expr, $end:expr, |$view:ident| $body:expr) => {{
        let Storage::Cuda(cs) = &*$storage else {
            unreachable!("checked by cuda_parts")
        };
        let slice = cs.as_cuda_slice::<$t>()?;
        let $view = slice.slice($start..$end);
        $body
    }};
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.tcp.rank()
    }

    fn world(&self) -> usize {
        self.tcp.world()
    }

    fn all_gather(&self, shard: &Tensor) -> Result<Tensor> {
        let shard = shard.contiguous()?;
        let world = self.world();
        let mut shape = shard.dims().to_vec();
        anyhow::ensure!(!shape.is_empty(), "all-gather needs at least one dimension");
        shape[0] *= world;
        let (storage, start, end) = cuda_parts(&shard)?;
        let n = end - start;
        match shard.dtype() {
            DType::F32 => with_slice!(storage, f32, start, end, |view| {
                let mut out = self.device.alloc_zeros::<f32>(n * world)?;
                self.comm
                    .all_gather(&view, &mut out)
                    .map_err(|e| nccl_err("all-gather", e))?;
                Ok(self.wrap(out, &shape))
            }),
            DType::BF16 => with_slice!(storage, bf16, start, end, |view| {
                let mut out = self.device.alloc_zeros::<bf16>(n * world)?;
                self.comm
                    .all_gather(&view, &mut out)
                    .map_err(|e| nccl_err("all-gather", e))?;
                Ok(self.wrap(out, &shape))
            }),
            other => bail!("NCCL all-gather of {other:?} tensors is not supported"),
        }
    }

    fn reduce_scatter(&self, full: &Tensor) -> Result<Tensor> {
        let full = full.contiguous()?;
        anyhow::ensure!(
            full.dtype() == DType::F32,
            "reduce-scatter sums f32 tensors"
        );
        let world = self.world();
        let mut shape = full.dims().to_vec();
        anyhow::ensure!(
            !shape.is_empty() && shape[0].is_multiple_of(world),
            "reduce-scatter: dimension 0 must split into {world} equal chunks"
        );
        shape[0] /= world;
        let (storage, start, end) = cuda_parts(&full)?;
        let n = (end - start) / world;
        with_slice!(storage, f32, start, end, |view| {
            let mut out = self.device.alloc_zeros::<f32>(n)?;
            self.comm
                .reduce_scatter(&view, &mut out, &NcclOp::Sum)
                .map_err(|e| nccl_err("reduce-scatter", e))?;
            Ok(self.wrap(out, &shape))
        })
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let t = t.contiguous()?;
        let (storage, start, end) = cuda_parts(&t)?;
        let n = end - start;
        let root = i32::try_from(root).context("broadcast root")?;
        match t.dtype() {
            DType::F32 => with_slice!(storage, f32, start, end, |view| {
                let mut out = self.device.alloc_zeros::<f32>(n)?;
                self.comm
                    .broadcast(Some(&view), &mut out, root)
                    .map_err(|e| nccl_err("broadcast", e))?;
                Ok(self.wrap(out, t.dims()))
            }),
            DType::BF16 => with_slice!(storage, bf16, start, end, |view| {
                let mut out = self.device.alloc_zeros::<bf16>(n)?;
                self.comm
                    .broadcast(Some(&view), &mut out, root)
                    .map_err(|e| nccl_err("broadcast", e))?;
                Ok(self.wrap(out, t.dims()))
            }),
            other => bail!("NCCL broadcast of {other:?} tensors is not supported"),
        }
    }

    fn all_reduce_host(&self, values: &[f64], op: ReduceOp) -> Result<Vec<f64>> {
        self.tcp.all_reduce_host(values, op)
    }

    fn abort(&self, why: &str) {
        self.tcp.abort(why);
    }

    fn aborted(&self) -> Option<String> {
        self.tcp.aborted()
    }

    fn finish(&self) -> Result<()> {
        self.device
            .synchronize()
            .map_err(|e| anyhow::anyhow!("CUDA synchronize failed: {e}"))?;
        self.tcp.finish()
    }
}
