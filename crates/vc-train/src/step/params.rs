//! The parameter store of a training run: which talker tensors are trained (everything the
//! official recipe updates plus `text_projection`, minus the user's `train.freeze` globs), as
//! `Var`s in the compute dtype with their fp32 masters, and the frozen rest. Models are built
//! from it through [`TensorSource`], so gradients flow into its `Var`s.
//!
//! Masters ([`Masters`]): with the CPU kernels the compute dtype is f32 and the `Var` *is* the
//! master, updated in place. Otherwise (the autograd backend, and CUDA's mixed precision) the
//! `Var`s are copies in the compute dtype (bf16 on CUDA) of separate fp32 masters; the
//! optimizer updates the masters and refreshes the `Var`s (docs/training.md §5.2).

use std::collections::BTreeMap;

use anyhow::{bail, Result};
use candle_core::{DType, Tensor, Var};

use crate::step::lora::Lora;
use crate::step::trainable::TRAINABLE_PREFIX;
use crate::step::units::{unit_of, Unit};
use vc_model::layers::{trainable_or_frozen, AdapterSpec, TensorSource};
use vc_model::weights::Weights;

/// One trained tensor.
pub struct Param {
    pub name: String,
    pub unit: Unit,
    /// What the model computes with (compute dtype).
    pub var: Var,
    /// fp32 master when the compute dtype is not f32; `None` = the var is the master.
    master: Option<Tensor>,
    /// [`Masters::Compensated`]: the bf16 compensation of the bf16-valued var (the master is
    /// their sum).
    comp: Option<Tensor>,
}

impl Param {
    /// A trained tensor (or a rank's shard of one) from its fp32 master; the compute copy is a
    /// separate `dtype` copy with [`Masters::Separate`], the master itself with `Shared` (f32).
    /// The compute copy lives on `device`; with `offload` the optimizer's copy of the weights
    /// (master, or compensated weight and compensation) stays where `master` lies, on the host
    /// (docs/training.md §6.6).
    pub fn new(
        name: String,
        unit: Unit,
        master: Tensor,
        compute: DType,
        masters: Masters,
        device: &candle_core::Device,
        offload: bool,
    ) -> Result<Self> {
        if master.dtype() != DType::F32 {
            bail!("the master of {name} must be f32, not {:?}", master.dtype());
        }
        let copy_of = |t: &Tensor| -> Result<Var> {
            Ok(Var::from_tensor(
                &t.to_dtype(compute)?.to_device(device)?.copy()?,
            )?)
        };
        let (var, master, comp) = match masters {
            Masters::Shared if compute == DType::F32 => {
                (Var::from_tensor(&master.to_device(device)?)?, None, None)
            }
            Masters::Shared => bail!("the trained tensors can only be their own masters in f32"),
            // `copy` so that the master and the var never share storage.
            Masters::Separate => (copy_of(&master)?, Some(master.copy()?), None),
            Masters::Compensated => {
                let (w, c) = split_compensated(&master)?;
                let host_w = offload.then(|| w.to_dtype(DType::F32)).transpose()?;
                (copy_of(&w)?, host_w, Some(c))
            }
        };
        Ok(Self {
            name,
            unit,
            var,
            master,
            comp,
        })
    }

    /// The f32 CPU tensor the CPU kernels update in place, if there is one: the `Var` when it is
    /// its own master, else a master held on the host (offloaded, or any master on the CPU);
    /// with its compensation.
    pub fn host_weights(&self) -> Option<(&Tensor, Option<&Tensor>)> {
        let w = match &self.master {
            Some(m) => m,
            None if self.comp.is_none() || self.var.dtype() == DType::F32 => self.var.as_tensor(),
            None => return None,
        };
        let on_cpu = |t: &Tensor| t.device().is_cpu() && t.is_contiguous();
        (on_cpu(w) && w.dtype() == DType::F32 && self.comp.as_ref().is_none_or(on_cpu))
            .then_some((w, self.comp.as_ref()))
    }

    /// After the CPU kernels updated [`Self::host_weights`]: the compute copy follows them.
    pub fn refresh_from_host(&mut self) -> candle_core::Result<()> {
        if let Some(m) = &self.master {
            let dev = self.var.device().clone();
            self.var
                .set(&m.to_dtype(self.var.dtype())?.to_device(&dev)?)?;
        }
        Ok(())
    }

    /// The device the optimizer state of this parameter lives on (its master's, or its own).
    pub fn state_device(&self) -> candle_core::Device {
        match &self.master {
            Some(m) => m.device().clone(),
            None => self.var.device().clone(),
        }
    }

    /// The bf16 compensation ([`Masters::Compensated`]).
    pub fn compensation(&self) -> Option<&Tensor> {
        self.comp.as_ref()
    }

    /// Sets a compensated parameter's weight and compensation as saved (bf16 each), without
    /// the rounding of a sum and a split: resuming keeps every bit.
    pub fn set_compensated(&mut self, w: &Tensor, comp: &Tensor) -> Result<()> {
        let Some(c) = &mut self.comp else {
            bail!("{} is not a compensated parameter", self.name);
        };
        let dev = self.var.device().clone();
        *c = comp
            .to_dtype(DType::BF16)?
            .to_device(&c.device().clone())?
            .copy()?;
        if let Some(m) = &mut self.master {
            *m = w
                .to_dtype(DType::F32)?
                .to_device(&m.device().clone())?
                .copy()?;
        }
        self.var
            .set(&w.to_dtype(self.var.dtype())?.to_device(&dev)?)?;
        Ok(())
    }

    /// The fp32 master weights (for a compensated parameter, weight plus compensation). Never
    /// part of a graph: a value computed from the `Var` would otherwise carry its history into
    /// the next step's master and compensation, and every step's tensors would stay alive.
    pub fn master(&self) -> candle_core::Result<Tensor> {
        match (&self.master, &self.comp) {
            (Some(m), Some(c)) => m + c.to_dtype(DType::F32)?,
            (Some(m), None) => Ok(m.clone()),
            (None, Some(c)) => {
                self.var.as_tensor().detach().to_dtype(DType::F32)? + c.to_dtype(DType::F32)?
            }
            (None, None) => Ok(self.var.as_tensor().detach()),
        }
    }

    /// Replaces the master (fp32, same shape; on any device) and refreshes the compute copy; a
    /// compensated parameter keeps the bf16 rounding as its weight and the rest as its
    /// compensation.
    pub fn set_master(&mut self, value: Tensor) -> candle_core::Result<()> {
        let dev = self.var.device().clone();
        let dtype = self.var.dtype();
        match (&mut self.master, &mut self.comp) {
            (Some(m), None) => {
                self.var.set(&value.to_dtype(dtype)?.to_device(&dev)?)?;
                *m = value.to_device(&m.device().clone())?;
            }
            (host, Some(c)) => {
                let (w, rest) = split_compensated(&value)?;
                self.var.set(&w.to_dtype(dtype)?.to_device(&dev)?)?;
                *c = rest.to_device(&c.device().clone())?;
                if let Some(m) = host {
                    *m = w.to_dtype(DType::F32)?.to_device(&m.device().clone())?;
                }
            }
            (None, None) => self.var.set(&value.to_device(&dev)?)?,
        }
        Ok(())
    }

    /// Bytes of the optimizer's copy of the weights beyond the compute copy: the fp32 master,
    /// or the bf16 compensation.
    pub fn master_bytes(&self) -> usize {
        self.master.as_ref().map_or(0, |m| m.elem_count() * 4)
            + self.comp.as_ref().map_or(0, |c| c.elem_count() * 2)
    }

    pub fn shape(&self) -> &[usize] {
        self.var.dims()
    }

    pub fn elem_count(&self) -> usize {
        self.var.elem_count()
    }
}

/// Whether the trained `Var`s are their own fp32 masters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Masters {
    /// The `Var` is the master (f32 compute; updated in place).
    Shared,
    /// A separate fp32 master; the `Var` is a copy in the compute dtype.
    Separate,
    /// No fp32 master: the `Var` holds bf16 values (stored in the compute dtype) and a bf16
    /// compensation keeps what bf16 cannot (docs/training.md §6.5).
    Compensated,
}

/// Where a run keeps its weights: the compute copies on `device`, and with `offload` the
/// optimizer's copies where the weights were loaded (the host, docs/training.md §6.6).
#[derive(Debug, Clone)]
pub struct Placement {
    pub device: candle_core::Device,
    pub offload: bool,
}

impl Placement {
    /// Where the masters are loaded and the moments kept.
    pub fn state_device(&self) -> candle_core::Device {
        if self.offload {
            candle_core::Device::Cpu
        } else {
            self.device.clone()
        }
    }
}

/// `value` (f32) as a bf16 weight and the bf16 rest: `w = bf16(value)`, `comp = bf16(value − w)`.
pub fn split_compensated(value: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let value = value.to_dtype(DType::F32)?;
    let w = value.to_dtype(DType::BF16)?;
    let comp = (value - w.to_dtype(DType::F32)?)?.to_dtype(DType::BF16)?;
    Ok((w, comp))
}

/// The trained parameters (ordered by unit, then name) and the frozen talker tensors; builds
/// the model through [`TensorSource`].
pub struct ParamStore {
    pub params: Vec<Param>,
    frozen: BTreeMap<String, Tensor>,
    index: BTreeMap<String, usize>,
    adapters: Option<AdapterSpec>,
}

impl ParamStore {
    /// `weights` holds the talker in f32 (the masters); `trained` names the trained tensors;
    /// the model will compute in `compute` (f32 on CPU, bf16 on CUDA); `masters(shape)` says
    /// how each tensor keeps its master (`Masters::Shared` needs f32 compute). With `lora` the
    /// adapter factors among `trained` start from their first values (docs/training.md §13).
    pub fn new(
        weights: &Weights,
        trained: &[String],
        compute: DType,
        masters: impl Fn(&[usize]) -> Masters,
        place: Placement,
        lora: Option<&Lora>,
    ) -> Result<Self> {
        if weights.dtype() != DType::F32 {
            bail!("training needs the checkpoint loaded in f32 (the master weights)");
        }
        let mut params = Vec::with_capacity(trained.len());
        for name in trained {
            let t = match lora {
                Some(l) => l.initial(name, weights.device())?,
                None => None,
            };
            let t = match t {
                Some(t) => t,
                None => weights.get_any(name)?,
            };
            let kind = masters(t.dims());
            params.push(Param::new(
                name.clone(),
                unit_of(name)?,
                t,
                compute,
                kind,
                &place.device,
                place.offload,
            )?);
        }
        params.sort_by(|a, b| (a.unit, &a.name).cmp(&(b.unit, &b.name)));
        let mut frozen = BTreeMap::new();
        for name in weights.names_with_prefix(TRAINABLE_PREFIX) {
            if !trained.contains(&name) {
                let t = weights.get_any(&name)?.to_dtype(compute)?;
                frozen.insert(name.clone(), t.to_device(&place.device)?);
            }
        }
        let index = params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.clone(), i))
            .collect();
        Ok(Self {
            params,
            frozen,
            index,
            adapters: lora.map(Lora::spec),
        })
    }

    /// Every talker tensor of `weights` (f32) passing `trainable` becomes a trained parameter
    /// that is its own master; the rest is frozen (for tests and tools that need gradients of
    /// a model).
    pub fn from_weights(weights: &Weights, trainable: impl Fn(&str) -> bool) -> Result<Self> {
        let trained: Vec<String> = weights
            .names_with_prefix(TRAINABLE_PREFIX)
            .into_iter()
            .filter(|n| trainable(n))
            .collect();
        let place = Placement {
            device: weights.device().clone(),
            offload: false,
        };
        Self::new(
            weights,
            &trained,
            DType::F32,
            |_| Masters::Shared,
            place,
            None,
        )
    }

    /// The trained `Var` named `name`.
    pub fn var(&self, name: &str) -> Option<&Var> {
        self.get(name).map(|p| &p.var)
    }

    pub fn get(&self, name: &str) -> Option<&Param> {
        self.index.get(name).map(|&i| &self.params[i])
    }

    pub fn get_mut(&mut self, name: &str) -> Option<&mut Param> {
        self.index.get(name).map(|&i| &mut self.params[i])
    }

    /// Trained element count.
    pub fn elem_count(&self) -> usize {
        self.params.iter().map(Param::elem_count).sum()
    }

    /// Adds every talker tensor of `frozen` (in the storage dtype, on the training device) to
    /// the frozen set, each as the model computes with it in `arith` ([`at_arith`]): on the
    /// CPU's autograd path the f32 of its bf16 values, which the model would otherwise cast
    /// anew at every step and hold beside the bf16 copy (docs/training.md §13); the text table
    /// stays as stored. A name already trained or frozen is an error.
    pub fn add_frozen(&mut self, frozen: &Weights, arith: DType) -> Result<()> {
        for name in frozen.names_with_prefix(TRAINABLE_PREFIX) {
            if self.index.contains_key(&name) || self.frozen.contains_key(&name) {
                bail!("{name} is already part of the model");
            }
            let t = at_arith(&name, frozen.get_any(&name)?, arith)?;
            self.frozen.insert(name.clone(), t);
        }
        Ok(())
    }

    /// The frozen tensor `name`, as the model reads it.
    pub fn frozen_tensor(&self, name: &str) -> Option<&Tensor> {
        self.frozen.get(name)
    }

    pub fn frozen_names(&self) -> impl Iterator<Item = &str> {
        self.frozen.keys().map(String::as_str)
    }
}

impl TensorSource for ParamStore {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        trainable_or_frozen(
            name,
            shape,
            self.get(name).map(|p| p.var.as_tensor()),
            self.frozen.get(name),
        )
    }
    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name) || self.frozen.contains_key(name)
    }
    fn adapters(&self) -> Option<AdapterSpec> {
        self.adapters
    }
}

/// A model's weights cast to the dtype it computes in as they are read: on the CPU the
/// autograd backend stores bf16 and computes in f32 (docs/training.md §5.5). The cast is a
/// differentiable op, so the stored `Var` receives its gradient in its own dtype. The text
/// table is passed through uncast: the model casts the rows it looks up, not 151 936 of them.
pub struct ArithSource<'a> {
    inner: &'a dyn TensorSource,
    arith: DType,
}

impl<'a> ArithSource<'a> {
    pub fn new(inner: &'a dyn TensorSource, arith: DType) -> Self {
        Self { inner, arith }
    }
}

/// Weight `t` (named `name`) as the model computes with it in `arith` (see [`ArithSource`]).
pub fn at_arith(name: &str, t: Tensor, arith: DType) -> Result<Tensor> {
    if t.dtype() == arith || name == crate::TEXT_EMBEDDING {
        Ok(t)
    } else {
        Ok(t.to_dtype(arith)?)
    }
}

impl TensorSource for ArithSource<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        at_arith(name, self.inner.tensor(name, shape)?, self.arith)
    }
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
    fn adapters(&self) -> Option<AdapterSpec> {
        self.inner.adapters()
    }
}
