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

/// Why nothing fits, and what would: another world size (fewer ranks of a machine, which
/// share its memory, or more, which shard the state further; up to 64), a smaller batch, or the
/// combination the user's pins excluded. `capacity_of(world)`: the bytes per device of a run of
/// `world` ranks (a GPU's memory whatever the count; CPU ranks share the machine's).
pub fn refusal(
    setup: &Setup,
    pinned: Pinned,
    capacity_of: impl Fn(usize) -> usize,
    device: &str,
) -> String {
    let capacity = capacity_of(setup.world.max(1));
    let (all, _) = plan(setup, pinned, capacity);
    let best = all
        .iter()
        .min_by_key(|e| e.device_total())
        .expect("at least one candidate");
    let (need, has) = distinct_sizes(best.device_total(), capacity);
    let mut msg = format!(
        "training does not fit: the smallest plan ({}) needs {need} per {device}, which has \
         {has} (`voiceclone train --plan` shows every category)",
        describe(best.modes),
    );
    let mut ways = Vec::new();
    if pinned != Pinned::default() {
        if let (_, Some(i)) = plan(setup, Pinned::default(), capacity) {
            let free = candidates(setup, Pinned::default())[i];
            ways.push(format!("the memory settings {}", describe(free)));
        }
    }
    let flag = if setup.cuda { "--gpus" } else { "--cpu-ranks" };
    let fits_with = |world: usize| {
        let s = Setup {
            world,
            group: world,
            ..setup.clone()
        };
        plan(&s, pinned, capacity_of(world)).1.is_some()
    };
    // In shard groups more ranks add groups, which shard nothing further: only a flat run's
    // world size is worth changing. Fewer ranks first (the nearest), then more.
    let world = setup.world.max(1);
    if setup.group >= world {
        if let Some(fewer) = (1..world).rev().find(|&w| fits_with(w)) {
            ways.push(if fewer == 1 {
                format!("one {device} (no {flag})")
            } else {
                format!("{flag} {fewer}")
            });
        }
        if let Some(more) = (world + 1..=64).find(|&w| fits_with(w)) {
            ways.push(format!("{flag} {more}"));
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

/// `need` and `has` in GB with as many decimals (up to 3) as it takes for them to read
/// differently, so that a refusal never says "needs 0.3 GB, which has 0.3 GB"; in MB below that.
fn distinct_sizes(need: usize, has: usize) -> (String, String) {
    let gb = |b: usize, d: usize| format!("{:.d$} GB", b as f64 / 1e9);
    for d in 1..=3 {
        let (n, h) = (gb(need, d), gb(has, d));
        if n != h {
            return (n, h);
        }
    }
    let mb = |b: usize| format!("{:.1} MB", b as f64 / 1e6);
    (mb(need), mb(has))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::activations::Longest;
    use crate::plan::shapes::talker_tensors;
    use crate::Backend;
    use vc_core::config::{ReduceDtype, Shard};
    use vc_model::config::Qwen3TtsConfig;

    /// The released 0.6B's shapes trained fully on `world` CPU ranks.
    fn setup(world: usize) -> Setup {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../configs/models/qwen3-tts-12hz-0.6b-base/config.json");
        let cfg = Qwen3TtsConfig::from_file(&path).unwrap();
        let tensors = talker_tensors(&cfg)
            .unwrap()
            .into_iter()
            .map(|t| (t, true))
            .collect();
        Setup {
            cfg,
            tensors,
            backend: Backend::Kernels,
            cuda: false,
            world,
            group: world,
            prefetch: 1,
            shard: Shard::Full,
            batch_size: 1,
            grad_accum: 4,
            reduce: ReduceDtype::Fp32,
            longest: Longest {
                text_tokens: 40,
                frames: 150,
            },
        }
    }

    fn smallest(s: &Setup, capacity: usize) -> usize {
        let (all, _) = plan(s, Pinned::default(), capacity);
        all.iter().map(Estimate::device_total).min().unwrap()
    }

    /// CPU ranks share the machine: on a machine just large enough for two, four ranks do not
    /// fit and the refusal suggests two, not more.
    #[test]
    fn fewer_cpu_ranks_are_suggested_where_they_fit() {
        let machine = 2 * smallest(&setup(2), usize::MAX);
        let share = |w: usize| machine / w;
        assert!(smallest(&setup(4), usize::MAX) > share(4));
        let msg = refusal(&setup(4), Pinned::default(), share, "CPU process");
        assert!(msg.contains("it would fit with --cpu-ranks 2"), "{msg}");
        assert!(!msg.contains("--cpu-ranks 5"), "{msg}");
    }

    #[test]
    fn sizes_are_shown_with_the_decimals_that_tell_them_apart() {
        let pair = |a: &str, b: &str| (a.to_string(), b.to_string());
        assert_eq!(
            distinct_sizes(5_000_000_000, 3_000_000_000),
            pair("5.0 GB", "3.0 GB")
        );
        assert_eq!(
            distinct_sizes(340_000_000, 260_000_000),
            pair("0.34 GB", "0.26 GB")
        );
        assert_eq!(
            distinct_sizes(2_000_400_000, 2_000_100_000),
            pair("2000.4 MB", "2000.1 MB")
        );
    }
}
