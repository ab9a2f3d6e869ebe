//! The GPU collective backend (docs/distributed.md §3): NCCL through `cudarc::nccl`, one
//! communicator per rank process, collectives enqueued on candle's CUDA stream (so they are
//! ordered with the kernels that produce and consume their tensors). The rendezvous, host values
//! (losses, flags), barriers and aborts go through the TCP control plane and ring of
//! [`super::tcp`]; rank 0 creates the NCCL unique id and passes it in the rendezvous.
//!
//! NCCL needs equal chunk sizes on every rank, which the padded flat shards of [`super::unit_packing`]
//! provide. Compiled in CI (`scripts/ci/check_cuda_build.sh`); it runs only where a GPU is.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::cudarc::nccl::{result, sys, NcclType};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{DType, Device, Storage, StorageRef, Tensor};
use half::bf16;

use super::collective::{Collective, ReduceOp};
use super::tcp::{Endpoint, TcpCollective};

/// An NCCL communicator handle that another thread may abort (`ncclCommAbort`), which is how a
/// rank blocked in a GPU collective — waiting on a peer that hung — gets out: the communicator's
/// kernels end and the CUDA synchronisation it waits in returns an error.
struct Communicator {
    /// `None` once aborted. Collectives hold the read lock only while they enqueue (NCCL calls
    /// return once the work is on the stream); an abort takes the write lock, so the handle is
    /// never freed while a call is using it.
    comm: RwLock<Option<CommHandle>>,
}

#[derive(Clone, Copy)]
struct CommHandle(sys::ncclComm_t);

// SAFETY: an `ncclComm_t` is an opaque pointer into NCCL's own state; NCCL allows it to be used
// from any thread, one call at a time (serialised by the lock above), and `ncclCommAbort` to be
// called from another thread.
unsafe impl Send for CommHandle {}
// SAFETY: as above.
unsafe impl Sync for CommHandle {}

impl Communicator {
    /// Runs `f` with the live handle; an error once the communicator was aborted.
    fn with<R>(&self, what: &str, f: impl FnOnce(sys::ncclComm_t) -> Result<R>) -> Result<R> {
        let guard = self
            .comm
            .read()
            .map_err(|_| anyhow::anyhow!("NCCL {what}: the communicator lock is poisoned"))?;
        match *guard {
            Some(h) => f(h.0),
            None => bail!("NCCL {what}: the communicator was aborted (the run was aborted)"),
        }
    }

    /// Aborts the communicator once. Waits up to 5 s for a collective that is being enqueued;
    /// a thread stuck inside an NCCL call for longer is left to the rank's watchdog, which ends
    /// the process (docs/distributed.md §3.4).
    fn abort(&self) {
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            match self.comm.try_write() {
                Ok(mut guard) => {
                    if let Some(h) = guard.take() {
                        // SAFETY: the handle is live (taken out under the write lock: no call is
                        // using it) and is never used again.
                        let _ = unsafe { result::comm_abort(h.0) };
                    }
                    return;
                }
                Err(_) if Instant::now() < until => std::thread::sleep(Duration::from_millis(10)),
                Err(_) => return,
            }
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.abort();
    }
}

/// A rank of a GPU run.
pub struct NcclCollective {
    comm: Arc<Communicator>,
    tcp: TcpCollective,
    device: CudaDevice,
    stream: Arc<CudaStream>,
}

impl NcclCollective {
    /// Joins the run at `ep` on `device` (the GPU of this rank).
    pub fn connect(ep: &Endpoint, device: &Device) -> Result<Self> {
        let Device::Cuda(cuda) = device else {
            bail!("the NCCL backend needs a CUDA device, not {device:?}");
        };
        let payload = if ep.rank == 0 {
            let id = result::get_uniqueid()
                .map_err(|e| anyhow::anyhow!("ncclGetUniqueId failed: {e:?}"))?;
            id.internal.iter().map(|&c| c as u8).collect()
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
        let stream = cuda.cuda_stream();
        let mut raw = std::mem::MaybeUninit::<sys::ncclComm_t>::uninit();
        let world = i32::try_from(ep.world).context("world size")?;
        let rank = i32::try_from(ep.rank).context("rank")?;
        // SAFETY: `raw` is written by a successful ncclCommInitRank before it is read.
        let handle = unsafe {
            result::comm_init_rank(
                raw.as_mut_ptr(),
                world,
                sys::ncclUniqueId { internal },
                rank,
            )
            .map_err(|e| anyhow::anyhow!("rank {}: ncclCommInitRank failed: {e:?}", ep.rank))?;
            raw.assume_init()
        };
        let comm = Arc::new(Communicator {
            comm: RwLock::new(Some(CommHandle(handle))),
        });
        // Whoever learns first that the run is aborted (this rank's error, another rank's, a
        // silent rank noticed by the heartbeats) aborts the communicator, so that a collective
        // this rank is blocked in returns.
        let for_abort = comm.clone();
        tcp.on_abort(move || for_abort.abort());
        Ok(Self {
            comm,
            tcp,
            device: cuda.clone(),
            stream,
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

    /// `ncclAllGather` of `send` (n values) into `recv` (world × n values) on the stream.
    fn all_gather_into<T: NcclType>(
        &self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        self.comm.with("all-gather", |comm| {
            let (src, _s) = send.device_ptr(&self.stream);
            let (dst, _d) = recv.device_ptr_mut(&self.stream);
            // SAFETY: both buffers are live device allocations of the given lengths on this
            // rank's device, used in stream order; `comm` is live (held under the lock).
            unsafe {
                result::all_gather(
                    src as _,
                    dst as _,
                    send.len(),
                    T::as_nccl_type(),
                    comm,
                    self.stream.cu_stream() as _,
                )
            }
            .map_err(|e| nccl_err("all-gather", e))?;
            Ok(())
        })
    }

    /// `ncclReduceScatter` (sum) of `send` (world × n values) into `recv` (n values) on the
    /// stream.
    fn reduce_scatter_into<T: NcclType>(
        &self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        let n = recv.len();
        self.comm.with("reduce-scatter", |comm| {
            let (src, _s) = send.device_ptr(&self.stream);
            let (dst, _d) = recv.device_ptr_mut(&self.stream);
            // SAFETY: `send` holds world × n values and `recv` n, both live allocations on this
            // rank's device used in stream order; `comm` is live (held under the lock).
            unsafe {
                result::reduce_scatter(
                    src as _,
                    dst as _,
                    n,
                    T::as_nccl_type(),
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    self.stream.cu_stream() as _,
                )
            }
            .map_err(|e| nccl_err("reduce-scatter", e))?;
            Ok(())
        })
    }

    /// `ncclBroadcast` of `root`'s `send` into every rank's `recv` (same length) on the stream.
    fn broadcast_into<T: NcclType>(
        &self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
        root: i32,
    ) -> Result<()> {
        self.comm.with("broadcast", |comm| {
            let count = recv.len();
            let (src, _s) = send.device_ptr(&self.stream);
            let (dst, _d) = recv.device_ptr_mut(&self.stream);
            // SAFETY: as in `all_gather_into`.
            unsafe {
                result::broadcast(
                    src as _,
                    dst as _,
                    count,
                    T::as_nccl_type(),
                    root,
                    comm,
                    self.stream.cu_stream() as _,
                )
            }
            .map_err(|e| nccl_err("broadcast", e))?;
            Ok(())
        })
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
        anyhow::ensure!(
            shard.elem_count() > 0,
            "all-gather of an empty tensor (docs/distributed.md §4.5)"
        );
        shape[0] *= world;
        let (storage, start, end) = cuda_parts(&shard)?;
        let n = end - start;
        match shard.dtype() {
            DType::F32 => with_slice!(storage, f32, start, end, |view| {
                let mut out = self.device.alloc_zeros::<f32>(n * world)?;
                self.all_gather_into(&view, &mut out)?;
                Ok(self.wrap(out, &shape))
            }),
            DType::BF16 => with_slice!(storage, bf16, start, end, |view| {
                let mut out = self.device.alloc_zeros::<bf16>(n * world)?;
                self.all_gather_into(&view, &mut out)?;
                Ok(self.wrap(out, &shape))
            }),
            other => bail!("NCCL all-gather of {other:?} tensors is not supported"),
        }
    }

    fn reduce_scatter(&self, full: &Tensor) -> Result<Tensor> {
        let full = full.contiguous()?;
        let world = self.world();
        let mut shape = full.dims().to_vec();
        anyhow::ensure!(
            !shape.is_empty() && shape[0].is_multiple_of(world) && full.elem_count() > 0,
            "reduce-scatter: dimension 0 must split into {world} equal, non-empty chunks"
        );
        shape[0] /= world;
        let (storage, start, end) = cuda_parts(&full)?;
        let n = (end - start) / world;
        match full.dtype() {
            DType::F32 => with_slice!(storage, f32, start, end, |view| {
                let mut out = self.device.alloc_zeros::<f32>(n)?;
                self.reduce_scatter_into(&view, &mut out)?;
                Ok(self.wrap(out, &shape))
            }),
            DType::BF16 => with_slice!(storage, bf16, start, end, |view| {
                let mut out = self.device.alloc_zeros::<bf16>(n)?;
                self.reduce_scatter_into(&view, &mut out)?;
                Ok(self.wrap(out, &shape))
            }),
            other => bail!("NCCL reduce-scatter of {other:?} tensors is not supported"),
        }
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let t = t.contiguous()?;
        anyhow::ensure!(t.elem_count() > 0, "broadcast of an empty tensor");
        let (storage, start, end) = cuda_parts(&t)?;
        let n = end - start;
        let root = i32::try_from(root).context("broadcast root")?;
        match t.dtype() {
            DType::F32 => with_slice!(storage, f32, start, end, |view| {
                let mut out = self.device.alloc_zeros::<f32>(n)?;
                self.broadcast_into(&view, &mut out, root)?;
                Ok(self.wrap(out, t.dims()))
            }),
            DType::BF16 => with_slice!(storage, bf16, start, end, |view| {
                let mut out = self.device.alloc_zeros::<bf16>(n)?;
                self.broadcast_into(&view, &mut out, root)?;
                Ok(self.wrap(out, t.dims()))
            }),
            other => bail!("NCCL broadcast of {other:?} tensors is not supported"),
        }
    }

    fn all_reduce_host(&self, values: &[f64], op: ReduceOp) -> Result<Vec<f64>> {
        self.tcp.all_reduce_host(values, op)
    }

    fn abort(&self, why: &str) {
        // The control plane runs the communicator's abort (registered in `connect`).
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
