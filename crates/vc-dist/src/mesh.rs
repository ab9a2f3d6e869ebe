//! A rank's communicators (docs/distributed.md §4.7): the whole run's, for host values,
//! barriers and aborts; its shard group's, which gathers weights and reduce-scatters gradients;
//! and, under hybrid sharding, its replicas', which all-reduce the group's gradient shards across
//! groups. With one group (flat sharding, the default) the group's communicator is the run's.

use std::sync::Arc;

use super::collective::{Collective, LinkBytes};
use super::topology::Groups;

#[derive(Clone)]
pub struct Mesh {
    /// Every rank of the run.
    pub world: Arc<dyn Collective>,
    /// The ranks this rank shards the trained state with (its group).
    pub shard: Arc<dyn Collective>,
    /// The ranks holding the same shard in the other groups, this rank among them; `None` with
    /// one group.
    pub replicas: Option<Arc<dyn Collective>>,
}

impl Mesh {
    /// One group of every rank.
    pub fn flat(world: Arc<dyn Collective>) -> Self {
        Self {
            shard: world.clone(),
            world,
            replicas: None,
        }
    }

    /// How the ranks group.
    pub fn groups(&self) -> Groups {
        Groups {
            world: self.world.world(),
            size: self.shard.world(),
        }
    }

    /// Tensor bytes this rank has sent so far, by where they went: through its group's
    /// communicator and its replicas' (the run's communicator carries host values only, or is
    /// the group's).
    pub fn sent(&self) -> LinkBytes {
        self.shard.sent() + self.replicas.as_ref().map(|r| r.sent()).unwrap_or_default()
    }
}
