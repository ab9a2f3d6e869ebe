//! The combinations a plan lists and the one `train.memory = "auto"` takes
//! (docs/training.md §6.9): the most exact that fits — fp32 before bf16-compensated before int8 optimizer state,
//! no offload before offload, no recompute before recompute — among those the user left open.

use std::fmt::Write;

use super::{estimate, Estimate, Modes, Setup};
use vc_core::config::{Offload, OptimizerState, Recompute};

/// The settings the user fixed (a config file or a flag); `auto` chooses only the others.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pinned {
    pub optimizer_state: Option<OptimizerState>,
    pub offload: Option<Offload>,
    pub recompute: Option<Recompute>,
}

/// Every combination that makes sense for `setup`, most exact first: offloading only where
/// there is a device to relieve (on the CPU it changes nothing).
pub fn candidates(setup: &Setup, pinned: Pinned) -> Vec<Modes> {
    let states = [
        OptimizerState::Fp32,
        OptimizerState::Bf16Compensated,
        OptimizerState::Int8,
    ];
    let offloads: &[Offload] = if setup.cuda {
        &[Offload::None, Offload::Optimizer]
    } else {
        &[Offload::None]
    };
    let mut out = Vec::new();
    for &optimizer_state in &states {
        for &offload in offloads {
            for recompute in [Recompute::None, Recompute::Layers] {
                let m = Modes {
                    optimizer_state,
                    offload,
                    recompute,
                };
                let open = pinned.optimizer_state.is_none_or(|p| p == optimizer_state)
                    && pinned.offload.is_none_or(|p| p == offload)
                    && pinned.recompute.is_none_or(|p| p == recompute);
                if open {
                    out.push(m);
                }
            }
        }
    }
    // A pinned offload on the CPU is still the user's setting: keep it listed.
    if out.is_empty() {
        out.push(Modes {
            optimizer_state: pinned.optimizer_state.unwrap_or(OptimizerState::Fp32),
            offload: pinned.offload.unwrap_or(Offload::None),
            recompute: pinned.recompute.unwrap_or(Recompute::None),
        });
    }
    out
}

/// The estimates of every candidate, and the first that fits `capacity` bytes per device.
pub fn plan(setup: &Setup, pinned: Pinned, capacity: usize) -> (Vec<Estimate>, Option<usize>) {
    let all: Vec<Estimate> = candidates(setup, pinned)
        .into_iter()
        .map(|m| estimate(setup, m))
        .collect();
    let chosen = all.iter().position(|e| e.device_total() <= capacity);
    (all, chosen)
}

/// Why nothing fits, and what would: the smallest world size (up to 64) or batch size at
/// which some combination open to the user fits, and the smallest combination the user's pins
/// excluded.
pub fn refusal(setup: &Setup, pinned: Pinned, capacity: usize, device: &str) -> String {
    let (all, _) = plan(setup, pinned, capacity);
    let best = all
        .iter()
        .min_by_key(|e| e.device_total())
        .expect("at least one candidate");
    let gb = |b: usize| b as f64 / 1e9;
    let mut msg = format!(
        "training does not fit: the smallest plan ({}) needs {:.1} GB per {device}, which has \
         {:.1} GB (`voiceclone train --plan` shows every category)",
        describe(best.modes),
        gb(best.device_total()),
        gb(capacity)
    );
    let mut ways = Vec::new();
    if pinned != Pinned::default() {
        if let (_, Some(i)) = plan(setup, Pinned::default(), capacity) {
            let free = candidates(setup, Pinned::default())[i];
            ways.push(format!("the memory settings {}", describe(free)));
        }
    }
    // More ranks: GPUs, or CPU processes (each with `capacity`, as train.gpu_memory gives it);
    // in shard groups more ranks add groups, which shard nothing further.
    let flag = if setup.cuda { "--gpus" } else { "--cpu-ranks" };
    let flat = setup.group >= setup.world;
    for world in (setup.world.max(1) + 1..=64).filter(|_| flat) {
        let s = Setup {
            world,
            group: world,
            ..setup.clone()
        };
        if plan(&s, pinned, capacity).1.is_some() {
            ways.push(format!("{flag} {world}"));
            break;
        }
    }
    for batch in (1..setup.batch_size).rev() {
        let s = Setup {
            batch_size: batch,
            ..setup.clone()
        };
        if plan(&s, pinned, capacity).1.is_some() {
            ways.push(format!(
                "--batch-size {batch} (with --grad-accum for the same effective batch)"
            ));
            break;
        }
    }
    if ways.is_empty() {
        msg += "; nothing this plan can change fits";
    } else {
        let _ = write!(msg, "; it would fit with {}", ways.join(", or "));
    }
    msg
}

/// `optimizer_state int8, offload none, recompute layers`.
pub fn describe(m: Modes) -> String {
    format!(
        "optimizer_state {}, offload {}, recompute {}",
        m.optimizer_state.name(),
        m.offload.name(),
        m.recompute.name()
    )
}
