//! An in-process world of ranks: each rank is a thread, and every collective exchanges through
//! shared memory with the semantics of [`Collective`] (rank-ordered sums, so the results are
//! those of the TCP backend at the same world size up to summation order). The unit tests of the
//! sharded step run on it, and a one-device run that recomputes is a world of one
//! (docs/training.md §6.7). Its collectives complete when they are started: nothing to overlap.

use std::sync::{Arc, Barrier, Mutex};

use anyhow::Result;
use candle_core::Tensor;

use super::collective::{Collective, LinkBytes, Pending, ReduceOp};
use super::mesh::Mesh;
use super::topology::Groups;

/// One rank of an in-process world.
pub struct Local {
    rank: usize,
    world: usize,
    shared: Arc<WorldState>,
}

struct WorldState {
    tensors: Mutex<Vec<Option<Tensor>>>,
    values: Mutex<Vec<Vec<f64>>>,
    barrier: Barrier,
}

impl Local {
    /// The `n` ranks of a new world (move each to its own thread).
    pub fn world(n: usize) -> Vec<Local> {
        let shared = Arc::new(WorldState {
            tensors: Mutex::new(vec![None; n]),
            values: Mutex::new(vec![Vec::new(); n]),
            barrier: Barrier::new(n),
        });
        (0..n)
            .map(|rank| Local {
                rank,
                world: n,
                shared: shared.clone(),
            })
            .collect()
    }

    /// The communicators of the `n` ranks of a new world in shard groups of `size`
    /// (docs/distributed.md §4.7), in rank order.
    pub fn mesh(n: usize, size: usize) -> Result<Vec<Mesh>> {
        let groups = Groups::new(n, size)?;
        let world: Vec<Arc<dyn Collective>> = Self::world(n)
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Collective>)
            .collect();
        if size == n {
            return Ok(world.into_iter().map(Mesh::flat).collect());
        }
        let mut shards: Vec<Vec<Local>> = (0..groups.count()).map(|_| Self::world(size)).collect();
        let mut replicas: Vec<Vec<Local>> =
            (0..size).map(|_| Self::world(groups.count())).collect();
        let mut out = Vec::with_capacity(n);
        // Taken from the back: each group's and each replica set's ranks in reverse order.
        for (r, w) in world.into_iter().enumerate().rev() {
            let shard = shards[groups.group(r)].pop().expect("a rank of the group");
            let replica = replicas[groups.index(r)].pop().expect("a replica");
            out.push(Mesh {
                world: w,
                shard: Arc::new(shard),
                replicas: Some(Arc::new(replica)),
            });
        }
        out.reverse();
        Ok(out)
    }

    /// Every rank's `t`, in rank order.
    fn everyone(&self, t: &Tensor) -> Vec<Tensor> {
        let s = &self.shared;
        // Detached, as the bytes that other backends send are: in a world of one the result
        // would otherwise be the caller's tensor with its graph (a row lookup on a `Var`), and
        // every activation computed from it would record a graph too.
        s.tensors.lock().expect("local world")[self.rank] = Some(t.detach());
        s.barrier.wait();
        let all: Vec<Tensor> = s
            .tensors
            .lock()
            .expect("local world")
            .iter()
            .map(|t| t.clone().expect("every rank contributed"))
            .collect();
        s.barrier.wait();
        all
    }
}

impl Collective for Local {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn start_all_gather(&self, shard: &Tensor) -> Result<Pending> {
        Ok(Pending::ready(Tensor::cat(&self.everyone(shard), 0)?))
    }
    fn start_reduce_scatter(&self, full: &Tensor) -> Result<Pending> {
        let all = self.everyone(full);
        let n = full.dim(0)? / self.world;
        let mut sum = all[0].narrow(0, self.rank * n, n)?;
        for t in &all[1..] {
            sum = (sum + t.narrow(0, self.rank * n, n)?)?;
        }
        Ok(Pending::ready(sum))
    }
    fn start_all_reduce(&self, t: &Tensor) -> Result<Pending> {
        let all = self.everyone(t);
        let mut sum = all[0].clone();
        for t in &all[1..] {
            sum = (sum + t)?;
        }
        Ok(Pending::ready(sum))
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        Ok(self.everyone(t)[root].clone())
    }
    fn all_reduce_host(&self, values: &[f64], op: ReduceOp) -> Result<Vec<f64>> {
        let s = &self.shared;
        s.values.lock().expect("local world")[self.rank] = values.to_vec();
        s.barrier.wait();
        let all = s.values.lock().expect("local world").clone();
        s.barrier.wait();
        let mut out = all[0].clone();
        for v in &all[1..] {
            for (o, x) in out.iter_mut().zip(v) {
                *o = op.apply(*o, *x);
            }
        }
        Ok(out)
    }
    fn sent(&self) -> LinkBytes {
        LinkBytes::default()
    }
    fn abort(&self, _why: &str) {}
    fn aborted(&self) -> Option<String> {
        None
    }
    fn finish(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// A world of one hands back values, not the caller's graph: a lookup on a `Var` gathered
    /// through it must not make the recomputing pass record (and keep) every activation.
    #[test]
    fn results_record_no_graph() {
        let v = Var::from_tensor(&Tensor::arange(0f32, 6., &Device::Cpu).unwrap()).unwrap();
        let rows = v.as_tensor().reshape((3, 2)).unwrap();
        assert!(rows.track_op());
        let c = Local::world(1).remove(0);
        for t in [
            c.all_gather(&rows).unwrap(),
            c.reduce_scatter(&rows).unwrap(),
            c.broadcast(&rows, 0).unwrap(),
        ] {
            assert!(!t.track_op());
            assert_eq!(t.to_vec2::<f32>().unwrap(), rows.to_vec2::<f32>().unwrap());
        }
    }
}
