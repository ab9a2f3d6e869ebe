//! The GPU collective backend (docs/distributed.md §3): NCCL through `cudarc::nccl`, one NCCL
//! communicator per communicator of the rank (the run's, or under hybrid sharding its shard
//! group's and its replicas', docs/distributed.md §4.7), each running its collectives on a CUDA
//! stream of its own beside the compute stream (docs/distributed.md §3.5). cudarc's per-buffer events order them with the kernels
//! that write and read their buffers: a collective waits for the kernels that wrote its input,
//! the kernels that read its output wait for it, and a buffer is freed only after both — so a
//! started collective needs no host wait, and it overlaps whatever the compute stream does
//! meanwhile. The rendezvous, host values (losses, flags), barriers and aborts go through the
//! TCP control plane and ring of [`super::tcp`]; rank 0 creates the NCCL unique ids and passes
//! them in the rendezvous.
//!
//! NCCL needs equal chunk sizes on every rank, which the padded flat shards of
//! [`super::unit_packing`] provide. Compiled in CI (`scripts/ci/check_cuda_build.sh`); it runs
//! only where a GPU is (`scripts/gpu-check.sh`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::cudarc::nccl::{result, sys, NcclType};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{DType, Device, Storage, StorageRef, Tensor};
use half::bf16;

use super::collective::{Collective, LinkBytes, Pending, ReduceOp};
use super::mesh::Mesh;
use super::tcp::{Endpoint, TcpCollective};
use super::topology::Groups;

/// Bytes of an NCCL unique id.
const ID_BYTES: usize = 128;

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

/// One communicator of a GPU rank.
pub struct NcclCollective {
    comm: Arc<Communicator>,
    /// The run's TCP communicator: host values, barriers, aborts, the end.
    tcp: Arc<TcpCollective>,
    device: CudaDevice,
    /// The stream this communicator's collectives run on.
    stream: Arc<CudaStream>,
    /// This rank's place in the communicator.
    rank: usize,
    world: usize,
    /// Whether the next rank of the communicator's ring is on another node: where the bytes
    /// that NCCL's ring algorithm sends go (docs/distributed.md §8.1).
    next_across: bool,
    within: AtomicU64,
    across: AtomicU64,
    /// The communicator of every rank, which ends the run.
    whole: bool,
}

/// A fresh NCCL unique id's bytes.
fn new_id() -> Result<Vec<u8>> {
    let id =
        result::get_uniqueid().map_err(|e| anyhow::anyhow!("ncclGetUniqueId failed: {e:?}"))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// Starts an NCCL communicator of `world` ranks from the unique id `id`, as rank `rank`.
fn init_comm(id: &[u8], world: usize, rank: usize, who: usize) -> Result<Arc<Communicator>> {
    let mut internal = [0 as std::ffi::c_char; ID_BYTES];
    for (d, &b) in internal.iter_mut().zip(id) {
        *d = b as std::ffi::c_char;
    }
    let mut raw = std::mem::MaybeUninit::<sys::ncclComm_t>::uninit();
    let n = i32::try_from(world).context("world size")?;
    let r = i32::try_from(rank).context("rank")?;
    // SAFETY: `raw` is written by a successful ncclCommInitRank before it is read.
    let handle = unsafe {
        result::comm_init_rank(raw.as_mut_ptr(), n, sys::ncclUniqueId { internal }, r)
            .map_err(|e| anyhow::anyhow!("rank {who}: ncclCommInitRank failed: {e:?}"))?;
        raw.assume_init()
    };
    Ok(Arc::new(Communicator {
        comm: RwLock::new(Some(CommHandle(handle))),
    }))
}

impl NcclCollective {
    /// Joins the run at `ep` on `device` (the GPU of this rank) as one group of every rank.
    pub fn connect(ep: &Endpoint, device: &Device) -> Result<Self> {
        let mesh = Self::connect_parts(ep, device, Groups::flat(ep.world))?;
        Ok(mesh.0)
    }

    /// Joins the run at `ep` on `device` with shard groups `groups` (docs/distributed.md §4.7):
    /// the run's communicator is the TCP one (host values only), the group's and the
    /// replicas' are NCCL communicators of their own.
    pub fn connect_mesh(ep: &Endpoint, device: &Device, groups: Groups) -> Result<Mesh> {
        let (shard, replicas, tcp) = Self::connect_parts(ep, device, groups)?;
        let shard: Arc<dyn Collective> = Arc::new(shard);
        Ok(match replicas {
            None => Mesh::flat(shard),
            Some(r) => Mesh {
                world: tcp,
                shard,
                replicas: Some(Arc::new(r)),
            },
        })
    }

    /// The group's communicator, the replicas' (with more than one group) and the run's TCP one.
    #[allow(clippy::type_complexity)]
    fn connect_parts(
        ep: &Endpoint,
        device: &Device,
        groups: Groups,
    ) -> Result<(Self, Option<Self>, Arc<dyn Collective>)> {
        let Device::Cuda(cuda) = device else {
            bail!("the NCCL backend needs a CUDA device, not {device:?}");
        };
        // Rank 0 makes one unique id per group and, with several groups, one per set of
        // replicas.
        let ids = if groups.size == groups.world {
            1
        } else {
            groups.count() + groups.size
        };
        let payload = if ep.rank == 0 {
            let mut p = Vec::with_capacity(ids * ID_BYTES);
            for _ in 0..ids {
                p.extend(new_id()?);
            }
            p
        } else {
            Vec::new()
        };
        let tcp = Arc::new(TcpCollective::connect(ep, payload)?);
        let bytes = tcp.payload().to_vec();
        anyhow::ensure!(
            bytes.len() == ids * ID_BYTES,
            "rank {}: the NCCL ids from rank 0 have {} bytes, expected {}",
            ep.rank,
            bytes.len(),
            ids * ID_BYTES
        );
        let id = |k: usize| &bytes[k * ID_BYTES..(k + 1) * ID_BYTES];
        let next_of = |ranks: Vec<usize>| {
            let p = ranks.iter().position(|&r| r == ep.rank).expect("a member");
            ranks[(p + 1) % ranks.len()]
        };
        // Every rank starts its group's communicator, then its replicas': in the same order
        // everywhere, so that no start waits for a rank busy starting another.
        let make =
            |k: usize, rank: usize, world: usize, next: usize, whole: bool| -> Result<Self> {
                let comm = init_comm(id(k), world, rank, ep.rank)?;
                // Whoever learns first that the run is aborted (this rank's error, another rank's, a
                // silent rank noticed by the heartbeats) aborts the communicator, so that a
                // collective this rank is blocked in returns.
                let for_abort = comm.clone();
                tcp.on_abort(move || for_abort.abort());
                let stream =
                    cuda.cuda_stream().context().new_stream().map_err(|e| {
                        anyhow::anyhow!("cannot create a CUDA stream for NCCL: {e:?}")
                    })?;
                Ok(Self {
                    comm,
                    tcp: tcp.clone(),
                    device: cuda.clone(),
                    stream,
                    rank,
                    world,
                    next_across: !ep.nodes.same_node(ep.rank, next),
                    within: AtomicU64::new(0),
                    across: AtomicU64::new(0),
                    whole,
                })
            };
        if ids == 1 {
            let world = make(0, ep.rank, ep.world, (ep.rank + 1) % ep.world, true)?;
            return Ok((world, None, tcp));
        }
        let (g, i) = (groups.group(ep.rank), groups.index(ep.rank));
        let shard = make(g, i, groups.size, next_of(groups.members(ep.rank)), false)?;
        let replicas = make(
            groups.count() + i,
            g,
            groups.count(),
            next_of(groups.replicas(ep.rank)),
            false,
        )?;
        let world: Arc<dyn Collective> = tcp;
        Ok((shard, Some(replicas), world))
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

    /// Counts `bytes` this rank's part of a collective sends (NCCL's ring algorithm).
    fn count(&self, bytes: usize) {
        let c = if self.next_across {
            &self.across
        } else {
            &self.within
        };
        c.fetch_add(bytes as u64, Ordering::Relaxed);
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
            // rank's device, ordered with their other uses by their events; `comm` is live
            // (held under the lock).
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
            // rank's device ordered by their events; `comm` is live (held under the lock).
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

    /// `ncclAllReduce` (sum) of `send` into `recv` (the same length) on the stream.
    fn all_reduce_into<T: NcclType>(
        &self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        let n = recv.len();
        self.comm.with("all-reduce", |comm| {
            let (src, _s) = send.device_ptr(&self.stream);
            let (dst, _d) = recv.device_ptr_mut(&self.stream);
            // SAFETY: as in `reduce_scatter_into`, both buffers of n values.
            unsafe {
                result::all_reduce(
                    src as _,
                    dst as _,
                    n,
                    T::as_nccl_type(),
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    self.stream.cu_stream() as _,
                )
            }
            .map_err(|e| nccl_err("all-reduce", e))?;
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

/// A collective enqueued on its stream, `out` its result. The output is ordered by its buffer's
/// events and ready for the compute stream as it is; the input is kept until the wait, since
/// freeing it makes the compute stream wait for the collective to have read it (cudarc's
/// events): dropped any earlier, it would stall the computation the collective should overlap.
fn in_flight(input: Tensor, out: Tensor) -> Pending {
    Pending::later(move || {
        drop(input);
        Ok(out)
    })
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

impl NcclCollective {
    /// `ncclReduceScatter` of `full` enqueued: the (contiguous) input, kept until the wait, and
    /// the output.
    fn reduce_scatter_parts(&self, full: &Tensor) -> Result<(Tensor, Tensor)> {
        let full = full.contiguous()?;
        let world = self.world;
        let mut shape = full.dims().to_vec();
        anyhow::ensure!(
            !shape.is_empty() && shape[0].is_multiple_of(world) && full.elem_count() > 0,
            "reduce-scatter: dimension 0 must split into {world} equal, non-empty chunks"
        );
        shape[0] /= world;
        let (storage, start, end) = cuda_parts(&full)?;
        let n = (end - start) / world;
        self.count((world - 1) * n * full.dtype().size_in_bytes());
        let out = match full.dtype() {
            DType::F32 => with_slice!(storage, f32, start, end, |view| {
                let mut out = self.device.alloc_zeros::<f32>(n)?;
                self.reduce_scatter_into(&view, &mut out)?;
                self.wrap(out, &shape)
            }),
            DType::BF16 => with_slice!(storage, bf16, start, end, |view| {
                let mut out = self.device.alloc_zeros::<bf16>(n)?;
                self.reduce_scatter_into(&view, &mut out)?;
                self.wrap(out, &shape)
            }),
            other => bail!("NCCL reduce-scatter of {other:?} tensors is not supported"),
        };
        drop(storage);
        Ok((full, out))
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn start_all_gather(&self, shard: &Tensor) -> Result<Pending> {
        let shard = shard.contiguous()?;
        let world = self.world;
        let mut shape = shard.dims().to_vec();
        anyhow::ensure!(!shape.is_empty(), "all-gather needs at least one dimension");
        anyhow::ensure!(
            shard.elem_count() > 0,
            "all-gather of an empty tensor (docs/distributed.md §4.5)"
        );
        shape[0] *= world;
        let (storage, start, end) = cuda_parts(&shard)?;
        let n = end - start;
        self.count((world - 1) * n * shard.dtype().size_in_bytes());
        let out: Tensor = match shard.dtype() {
            DType::F32 => with_slice!(storage, f32, start, end, |view| {
                let mut out = self.device.alloc_zeros::<f32>(n * world)?;
                self.all_gather_into(&view, &mut out)?;
                self.wrap(out, &shape)
            }),
            DType::BF16 => with_slice!(storage, bf16, start, end, |view| {
                let mut out = self.device.alloc_zeros::<bf16>(n * world)?;
                self.all_gather_into(&view, &mut out)?;
                self.wrap(out, &shape)
            }),
            other => bail!("NCCL all-gather of {other:?} tensors is not supported"),
        };
        drop(storage);
        Ok(in_flight(shard, out))
    }

    fn start_reduce_scatter(&self, full: &Tensor) -> Result<Pending> {
        let (input, out) = self.reduce_scatter_parts(full)?;
        Ok(in_flight(input, out))
    }

    fn start_reduce_scatter_across(
        &self,
        full: &Tensor,
        across: Arc<dyn Collective>,
    ) -> Result<Pending> {
        // Both enqueued now: the all-reduce, on the replicas' stream, waits for the
        // reduce-scatter's output by its buffer's event.
        let (input, out) = self.reduce_scatter_parts(full)?;
        let summed = across.start_all_reduce(&out)?;
        Ok(Pending::later(move || {
            drop(input);
            drop(out);
            summed.wait()
        }))
    }

    fn start_all_reduce(&self, t: &Tensor) -> Result<Pending> {
        let t = t.contiguous()?;
        anyhow::ensure!(t.elem_count() > 0, "all-reduce of an empty tensor");
        let (storage, start, end) = cuda_parts(&t)?;
        let n = end - start;
        let world = self.world;
        self.count(2 * (world - 1) * n.div_ceil(world) * t.dtype().size_in_bytes());
        let out = match t.dtype() {
            DType::F32 => with_slice!(storage, f32, start, end, |view| {
                let mut out = self.device.alloc_zeros::<f32>(n)?;
                self.all_reduce_into(&view, &mut out)?;
                self.wrap(out, t.dims())
            }),
            DType::BF16 => with_slice!(storage, bf16, start, end, |view| {
                let mut out = self.device.alloc_zeros::<bf16>(n)?;
                self.all_reduce_into(&view, &mut out)?;
                self.wrap(out, t.dims())
            }),
            other => bail!("NCCL all-reduce of {other:?} tensors is not supported"),
        };
        drop(storage);
        Ok(in_flight(t, out))
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let t = t.contiguous()?;
        anyhow::ensure!(t.elem_count() > 0, "broadcast of an empty tensor");
        let (storage, start, end) = cuda_parts(&t)?;
        let n = end - start;
        if (self.rank + 1) % self.world != root {
            self.count(n * t.dtype().size_in_bytes());
        }
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
        anyhow::ensure!(
            self.whole,
            "host values are combined over the run's communicator, not a group's"
        );
        self.tcp.all_reduce_host(values, op)
    }

    fn sent(&self) -> LinkBytes {
        LinkBytes {
            within_node: self.within.load(Ordering::Relaxed),
            across_nodes: self.across.load(Ordering::Relaxed),
        }
    }

    fn abort(&self, why: &str) {
        // The control plane runs the communicators' aborts (registered in `connect_parts`).
        self.tcp.abort(why);
    }

    fn aborted(&self) -> Option<String> {
        self.tcp.aborted()
    }

    fn finish(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| anyhow::anyhow!("CUDA synchronize failed: {e:?}"))?;
        self.device
            .synchronize()
            .map_err(|e| anyhow::anyhow!("CUDA synchronize failed: {e}"))?;
        if self.whole {
            self.tcp.finish()
        } else {
            Ok(())
        }
    }
}
