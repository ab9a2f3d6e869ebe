//! The memory plan of a training run (docs/training.md §6.9): from the model's shapes, the
//! trained set, the batch and the longest utterance, the bytes each way of training keeps per
//! device and on the host, by category — predicted before anything is loaded, so that `auto`
//! can choose the most exact mode that fits and a run that cannot fit is refused up front.
//!
//! Modules: [`shapes`] (the tensors a run loads, from `config.json`), [`activations`] (what a
//! forward pass keeps), [`choice`] (the modes worth considering, the one `auto` takes). The
//! arithmetic here mirrors what the trainers allocate (`params`, `moments`,
//! `sharded`); `tests/it/train_plan.rs` holds it to the allocation it predicts.

pub mod activations;
pub mod choice;
pub mod shapes;

use std::collections::BTreeMap;

use crate::optim::saved_state;
use crate::sharded::PREDICTOR_CHUNK_FRAMES;
use crate::step::params::Masters;
use crate::step::units::Unit;
use crate::{Backend, TEXT_EMBEDDING};
use vc_core::config::{Offload, OptimizerState, Recompute, ReduceDtype, Shard};
use vc_dist::shard::RowSplit;
use vc_kernels::moment8;
use vc_model::config::Qwen3TtsConfig;

use self::activations::{AdapterWidths, Graph, Longest, Parts};
use self::shapes::TensorShape;

/// What a CUDA process holds before any tensor: the context, cuBLAS's workspace, the caching
/// of the driver (docs/training.md §6.9).
pub const CUDA_CONTEXT_BYTES: usize = 1 << 30;
/// What the process holds besides the training tensors: code, the tokenizer, the dataset,
/// thread stacks.
pub const PROCESS_BYTES: usize = 256 << 20;

/// The run a plan is for.
#[derive(Debug, Clone)]
pub struct Setup {
    pub cfg: Qwen3TtsConfig,
    /// Every talker tensor, with whether it is trained.
    pub tensors: Vec<(TensorShape, bool)>,
    pub backend: Backend,
    /// Training on CUDA devices (else the CPU is the device).
    pub cuda: bool,
    /// Ranks (1 = one device).
    pub world: usize,
    /// Ranks that shard the state among them (docs/distributed.md §4.7): `world` with flat
    /// sharding, fewer in shard groups.
    pub group: usize,
    /// Units gathered ahead of the one computing (`train.prefetch`).
    pub prefetch: usize,
    pub shard: Shard,
    pub batch_size: usize,
    pub grad_accum: usize,
    pub reduce: ReduceDtype,
    pub longest: Longest,
}

/// One combination of the memory settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Modes {
    pub optimizer_state: OptimizerState,
    pub offload: Offload,
    pub recompute: Recompute,
}

/// Bytes by category (docs/training.md §6.9).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bytes {
    /// Compute copies of the trained tensors (and of their shards), the frozen tensors, and
    /// on the CPU's autograd path the f32 copies it computes with.
    pub weights: usize,
    /// fp32 masters, or the compensations (and the host's f32 weights) of compensated ones.
    pub masters: usize,
    /// AdamW's two moments.
    pub moments: usize,
    /// The step's gradient sums plus the gradients of the backward pass running; on the
    /// autograd path also those candle keeps of the frozen tensors the graph meets.
    pub gradients: usize,
    /// The largest unit gathered whole (sharded `full` runs and `recompute = "layers"`).
    pub gathered: usize,
    /// The largest unit's gradient as the reduce-scatter sends and receives it.
    pub reduce_scatter: usize,
    /// What the forward passes keep for the backward passes.
    pub activations: usize,
    /// The optimizer step's temporaries (the autograd path's tensor-op update of the largest
    /// tensor).
    pub update: usize,
    /// The CUDA context on a device; the process itself on the host.
    pub fixed: usize,
    /// Whether the passes' transients are gone before the update's arrive ([`Self::total`]).
    pub phased: bool,
}

impl Bytes {
    /// The peak of a step. Where the passes' transients (gathered units, reductions in flight,
    /// activations) are freed before the update begins (`phased`: the `full` pass of several
    /// ranks), what stays for the whole step plus the larger of the two phases' transients;
    /// elsewhere every category added.
    pub fn total(&self) -> usize {
        let pass = self.gathered + self.reduce_scatter + self.activations;
        let transients = if self.phased {
            pass.max(self.update)
        } else {
            pass + self.update
        };
        self.weights + self.masters + self.moments + self.gradients + transients + self.fixed
    }

    /// The categories by name, in the order of the fields (the plan's JSON keys).
    pub fn named(&self) -> [(&'static str, usize); 9] {
        [
            ("weights", self.weights),
            ("masters", self.masters),
            ("moments", self.moments),
            ("gradients", self.gradients),
            ("gathered", self.gathered),
            ("reduce_scatter", self.reduce_scatter),
            ("activations", self.activations),
            ("update", self.update),
            ("fixed", self.fixed),
        ]
    }
}

/// The prediction for one combination: per device (each rank's, the largest) and on the host
/// (of the whole machine: every rank's host share). On a CPU run the host is the device and
/// `device` is `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimate {
    pub modes: Modes,
    pub device: Option<Bytes>,
    pub host: Bytes,
}

impl Estimate {
    /// What must fit on one device: the device's bytes, or the host's on a CPU run.
    pub fn device_total(&self) -> usize {
        self.device.as_ref().unwrap_or(&self.host).total()
    }
}

/// Bytes of one 8-bit or f32 moment of `rows` rows of a tensor of full shape `shape`
/// (`moments`: one code per value and an f32 scale per block of a row).
fn moment_bytes(shape: &[usize], rows: usize, eight_bit: bool) -> usize {
    let (_, cols) = moment8::rows_cols(shape);
    if eight_bit {
        rows * (cols + moment8::blocks_per_row(cols) * 4)
    } else {
        rows * cols * 4
    }
}

/// What the reductions in flight add to the backward pass's peak (docs/distributed.md §4.6):
/// `units` are (values, graph bytes) in forward order; the backward pass takes them in reverse,
/// each unit's graph alive while it computes, and its gradient (`bytes` per value) on its way
/// from its end until the reductions after it hold more than `budget` values. The most the
/// graph and the reductions in flight hold together, beyond the largest graph alone.
fn reductions_over_graphs(units: &[(usize, usize)], budget: usize, bytes: usize) -> usize {
    let mut in_flight: std::collections::VecDeque<usize> = std::collections::VecDeque::new();
    let (mut peak, mut largest) = (0usize, 0usize);
    for &(values, graph) in units.iter().rev() {
        peak = peak.max(graph + bytes * in_flight.iter().sum::<usize>());
        largest = largest.max(graph);
        in_flight.push_back(values);
        while in_flight.iter().rev().skip(1).sum::<usize>() > budget {
            in_flight.pop_front();
        }
    }
    peak - largest
}

/// Predicts what `setup` keeps with `modes`.
pub fn estimate(setup: &Setup, modes: Modes) -> Estimate {
    let mut dev = Bytes::default();
    let mut host = Bytes {
        fixed: PROCESS_BYTES,
        ..Bytes::default()
    };
    let backend = setup.backend;
    let storage = backend.storage_dtype().size_in_bytes();
    let arith = if setup.cuda { storage } else { 4 };
    let grad = crate::reduce_dtype(setup.reduce).size_in_bytes();
    let world = setup.world.max(1);
    // The state is sharded over the group; the groups replicate it (docs/distributed.md §4.7).
    let group = setup.group.clamp(1, world);
    // The one-device trainer unless something makes it the sharded one (a world of one rank
    // recomputing, docs/training.md §6.7).
    let sharded = world > 1 || modes.recompute == Recompute::Layers;
    // Units gathered ahead, and reductions left running behind the computation
    // (docs/distributed.md §4.6): only where there is something to send.
    let ahead = if group > 1 { setup.prefetch } else { 0 };
    let overlap = setup.prefetch > 0 && world > 1;
    let full = sharded && (world == 1 || setup.shard == Shard::Full);
    let offload = modes.offload == Offload::Optimizer && backend != Backend::Kernels;
    // Where the optimizer's copies live: the host when offloaded, and always on a CPU run.
    let on_host_state = offload || !setup.cuda;
    let sparse_text = backend == Backend::Kernels || sharded;
    // The optimizer's copies of the trained tensors: masters (or compensations) and moments,
    // of the rows this rank owns (rank 0 owns the most).
    let state = if on_host_state { &mut host } else { &mut dev };
    let own_rows = |rows: usize| {
        if sharded {
            RowSplit::new(rows, group).shard_rows().min(rows)
        } else {
            rows
        }
    };
    for (t, _) in setup.tensors.iter().filter(|(_, trained)| *trained) {
        let (rows, cols) = t.rows_cols();
        let own = own_rows(rows) * cols;
        state.masters += match backend.masters(modes.optimizer_state, &t.shape) {
            // With the kernels the `Var` is the master; otherwise a separate fp32 master.
            Masters::Shared | Masters::Separate => 4 * own,
            // The bf16 compensation, and offloaded the host's f32 copy of the weight.
            Masters::Compensated => 2 * own + if offload { 4 * own } else { 0 },
        };
        let eight = saved_state::eight_bit(modes.optimizer_state, &t.shape);
        state.moments += 2 * moment_bytes(&t.shape, own_rows(rows), eight);
    }
    // What the model computes with, and the sizes the transients follow.
    let compute = if setup.cuda { &mut dev } else { &mut host };
    let mut unit_values: BTreeMap<Unit, usize> = BTreeMap::new();
    let (mut dense_trained, mut own_dense, mut largest_tensor) = (0usize, 0usize, 0usize);
    for (t, trained) in &setup.tensors {
        let n = t.elem_count();
        let (rows, cols) = t.rows_cols();
        let text = t.name == TEXT_EMBEDDING;
        if !trained {
            // Held as the model computes with them (`ParamStore::add_frozen`): on the CPU's
            // autograd path in f32, but the text table, looked up as stored; a sharded run casts
            // a unit's as it computes.
            let held = if !setup.cuda && storage != arith && !text && !sharded {
                arith
            } else {
                storage
            };
            compute.weights += held * n;
            continue;
        }
        let own = own_rows(rows) * cols;
        // The compute copy of the owned rows (the kernels' `Var` is the master, counted above);
        // `grad-op` replicas hold every row.
        if backend.masters(modes.optimizer_state, &t.shape) != Masters::Shared {
            compute.weights += storage * own;
        }
        if sharded && !full {
            compute.weights += storage * n;
        }
        // The CPU's autograd path computes with f32 copies of bf16 weights, made once per step
        // (not of the text table, whose rows are cast as they are looked up).
        if !setup.cuda && storage != arith && !text && !sharded {
            compute.weights += arith * n;
        }
        // The text table's gradient is row-sparse with the kernels and in sharded runs.
        if !(text && sparse_text) {
            dense_trained += n;
            own_dense += own;
            *unit_values.entry(t.unit).or_default() += n;
        }
        largest_tensor = largest_tensor.max(n);
    }
    let largest_unit = unit_values.values().copied().max().unwrap_or(0);
    // The most values `1 + ahead` units in a row hold: the unit computing and those gathered
    // ahead of it (the units in forward order; the backward pass takes them in reverse).
    let sizes: Vec<usize> = unit_values.values().copied().collect();
    let window = sizes
        .windows((1 + ahead).min(sizes.len()).max(1))
        .map(|w| w.iter().sum::<usize>())
        .max()
        .unwrap_or(0);
    let graph = match backend {
        Backend::Kernels => Graph::Kernels,
        Backend::Autograd(_) => Graph::Autograd { bytes: arith },
    };
    let adapters = AdapterWidths::of(
        setup
            .tensors
            .iter()
            .filter(|(_, trained)| *trained)
            .map(|(t, _)| (t.name.as_str(), t.shape.as_slice())),
    );
    let parts = Parts::new(
        &setup.cfg,
        graph,
        setup.batch_size,
        setup.longest,
        &adapters,
    );
    // The gradients the autograd path keeps of the frozen tensors the graph meets
    // (`activations::frozen_gradient_bytes`), by unit. A graph begins at the first unit holding
    // a trained tensor (that unit counted whole, though its first inputs need no gradient); in
    // a `full` pass every unit but the embeddings begins at its input, a variable, and keeps
    // its own until its backward pass ends, the code predictor a chunk of frames at a time.
    let first_trained = setup
        .tensors
        .iter()
        .filter(|(_, trained)| *trained)
        .map(|(t, _)| t.unit)
        .min();
    let frames = setup.batch_size * setup.longest.frames;
    let mut frozen_grads: BTreeMap<Unit, usize> = BTreeMap::new();
    for (t, _) in setup.tensors.iter().filter(|(_, trained)| !*trained) {
        let met = if full {
            t.unit != Unit::Embeddings || first_trained == Some(Unit::Embeddings)
        } else {
            first_trained.is_some_and(|u| t.unit >= u)
        };
        let frames = match (full, t.unit) {
            (true, Unit::CodePredictor) => frames.min(PREDICTOR_CHUNK_FRAMES),
            _ => frames,
        };
        if met {
            *frozen_grads.entry(t.unit).or_default() += activations::frozen_gradient_bytes(
                &setup.cfg,
                graph,
                setup.batch_size,
                setup.longest,
                frames,
                t,
            );
        }
    }
    // Micro-batches one rank runs per step.
    let local_micro = setup.grad_accum.div_ceil(world).max(1);
    if !sharded || !full {
        // One graph of a whole micro-batch at a time; the sums of the step (reduce dtype) and
        // the gradients of the backward pass running (the weights' dtype).
        compute.activations += activations::micro_batch_bytes(
            &setup.cfg,
            graph,
            setup.batch_size,
            setup.longest,
            &adapters,
        );
        compute.gradients +=
            grad * dense_trained + storage * dense_trained + frozen_grads.values().sum::<usize>();
        if sharded {
            // grad-op: the whole sum is reduce-scattered once per step, a unit at a time; with
            // overlap the next unit is packed while one is on its way.
            compute.reduce_scatter += grad * largest_unit * if overlap { 2 } else { 1 };
        }
    } else {
        // `full`: every unit's input of every local micro-batch is kept, one unit's graph is
        // rebuilt at a time; the gathered unit (storage dtype, and its compute copy on the
        // CPU's autograd path); the owned gradient sums and one unit's backward gradients.
        compute.activations += parts.kept_inputs() * local_micro + parts.largest_unit();
        // The unit computing and those gathered ahead, in the storage dtype; the compute
        // copy of the one computing; on CPU ranks also the bytes the TCP ring receives before
        // they are a tensor.
        compute.gathered += storage * window
            + if storage != arith {
                arith * largest_unit
            } else {
                0
            }
            + if !setup.cuda && group > 1 {
                storage * largest_unit
            } else {
                0
            };
        compute.gradients += grad * own_dense
            + storage * largest_unit
            + frozen_grads.values().copied().max().unwrap_or(0);
        // The unit's gradient flattened for the reduce-scatter and the result (a world of one
        // rank copies too); with overlap the reductions still on their way, up to `1 + prefetch`
        // largest units (as the f32 values the CPU ranks' rings sum, the flat buffers a GPU's
        // stream reads; the all-reduces across groups that follow them hold a group's share).
        if overlap {
            let bytes = if setup.cuda { grad } else { 4 };
            let graphs: Vec<(usize, usize)> = unit_values
                .iter()
                .map(|(u, &n)| {
                    let graph = match u {
                        Unit::Embeddings => parts.embeddings,
                        Unit::Layer(_) => parts.talker_layer,
                        Unit::Head => parts.head,
                        Unit::CodePredictor => parts.predictor_chunk,
                    };
                    (n, graph)
                })
                .collect();
            compute.reduce_scatter +=
                reductions_over_graphs(&graphs, (1 + setup.prefetch) * largest_unit, bytes);
        }
        compute.reduce_scatter += 2 * grad * largest_unit;
        // Every unit's buffers go as the pass ends, before the update.
        compute.phased = world > 1;
    }
    let largest_own = largest_tensor.div_ceil(group);
    if offload || backend == Backend::Kernels {
        // The CPU kernels update in place; offloaded, one tensor's gradient comes to the host
        // as f32 at a time.
        if offload {
            host.update += 4 * largest_own;
        }
    } else {
        // The tensor-op update of the largest tensor: its f32 gradient, the new master and
        // moments with their temporaries; 8-bit moments add their decoded and re-encoded
        // f32 forms.
        let temporaries = match modes.optimizer_state {
            OptimizerState::Int8 => 8,
            _ => 4,
        };
        compute.update += temporaries * 4 * largest_own;
    }
    if setup.cuda {
        dev.fixed = CUDA_CONTEXT_BYTES;
        // Every rank of the machine has its own process and host state.
        host.masters *= world;
        host.moments *= world;
        host.update *= world;
        host.fixed *= world;
    }
    Estimate {
        modes,
        device: setup.cuda.then_some(dev),
        host,
    }
}

#[cfg(test)]
mod tests {
    use super::reductions_over_graphs;

    /// The backward pass takes the units in reverse: the first (here the largest, with the
    /// largest graph) computes with nothing in flight; the ones after it compute while its
    /// reduction is on its way, until the reductions after it hold more than the budget.
    #[test]
    fn reductions_in_flight_add_to_the_graphs_they_meet() {
        // (values, graph bytes), forward order: embeddings, two layers, a large last unit.
        let units = [(6, 10), (1, 40), (1, 40), (10, 100)];
        // Budget of 10 values: the last unit's 10 stay in flight while both layers compute
        // (40 + 4·10 = 80 < 100), then the layers' push it over and it is waited for.
        assert_eq!(reductions_over_graphs(&units, 10, 4), 0);
        // A graph large enough to meet the reductions on their way (the last unit's and the
        // layer's before it): 90 + 4·11 = 134.
        let units = [(6, 10), (1, 90), (1, 40), (10, 100)];
        assert_eq!(reductions_over_graphs(&units, 10, 4), 34);
        // With room for everything, the embeddings compute beside every reduction: 10 + 4·12.
        let units = [(6, 90), (1, 40), (1, 40), (10, 100)];
        assert_eq!(reductions_over_graphs(&units, 100, 4), 38);
    }
}
