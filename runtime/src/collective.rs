//! Communicators: how the sessions of a data-parallel group exchange tensors.
//!
//! A session that joins a group ([`crate::device::Session::join`]) runs each `all_reduce` step of
//! its plan through the group's [`Communicator`] instead of the op's single-replica kernel. Every
//! replica runs the same plan, so every rank reaches the group's collectives in the same order.
//!
//! [`HostGroup`] is the group of replicas in one process on the host: the ranks meet at a
//! barrier, one of them reduces every rank's tensor in rank order (in f64, rounded once to the
//! dtype), and all take the same result, so replicas stay bitwise equal. A rank that fails
//! aborts the group ([`Communicator::abort`]): the others' waits return an error instead of
//! waiting forever.
//!
//! CUDA replicas use [`crate::cuda::nccl::NcclRank`] instead: the same trait (its host-tensor
//! collectives stage through device memory), plus [`Communicator::nccl`], through which a CUDA
//! session runs its `all_reduce` steps on device buffers without a host round trip.

use crate::{Result, RuntimeError};
use rustytorch_ops::HostTensor;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex};

/// One rank's handle on a group of replicas.
pub trait Communicator: Send + Sync + fmt::Debug {
    /// This rank (0..world).
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world(&self) -> usize;
    /// The elementwise sum (with `mean`, divided by the world size) of `t` over every rank; every
    /// rank calls it with a tensor of the same type, and every rank gets the same result.
    fn all_reduce(&self, t: &HostTensor, mean: bool) -> Result<HostTensor>;
    /// Rank `root`'s `t` on every rank.
    fn broadcast(&self, t: &HostTensor, root: usize) -> Result<HostTensor>;
    /// Marks the group failed: pending and later collectives of every rank return an error.
    fn abort(&self, why: &str);
    /// This rank's NCCL communicator, for a CUDA session to reduce its device buffers in place
    /// (None for groups on the host).
    fn nccl(&self) -> Option<&crate::cuda::nccl::NcclRank> {
        None
    }
}

/// A group of ranks in this process exchanging host tensors (see the module docs).
#[derive(Debug)]
pub struct HostGroup {
    world: usize,
    state: Mutex<GroupState>,
    turn: Condvar,
}

#[derive(Debug, Default)]
struct GroupState {
    /// Each rank's contribution to the collective in progress.
    slots: Vec<Option<HostTensor>>,
    /// The result of the collective in progress, once the last rank arrived.
    result: Option<Arc<std::result::Result<HostTensor, String>>>,
    arrived: usize,
    /// Counts completed barriers (a waiter leaves when it moves on).
    generation: u64,
    aborted: Option<String>,
}

/// Which collective a rank asked for (all ranks must ask for the same).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    AllReduce { mean: bool },
    Broadcast { root: usize },
}

impl HostGroup {
    /// A group of `world` ranks; returns one [`HostRank`] per rank.
    pub fn ranks(world: usize) -> Result<Vec<Arc<HostRank>>> {
        if world == 0 {
            return Err(RuntimeError::Invalid(
                "a group needs at least one rank".into(),
            ));
        }
        let group = Arc::new(HostGroup {
            world,
            state: Mutex::new(GroupState {
                slots: vec![None; world],
                ..GroupState::default()
            }),
            turn: Condvar::new(),
        });
        Ok((0..world)
            .map(|rank| {
                Arc::new(HostRank {
                    rank,
                    group: group.clone(),
                })
            })
            .collect())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GroupState> {
        // A rank that panicked while holding the lock left the state consistent: every update
        // below is a plain assignment.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Deposits `t`; the last rank to arrive computes the result; returns it to every rank once
    /// all arrived (or an error if the group was aborted).
    fn exchange(&self, rank: usize, t: &HostTensor, kind: Kind) -> Result<HostTensor> {
        let mut st = self.lock();
        if let Some(why) = &st.aborted {
            return Err(aborted(why));
        }
        st.slots[rank] = Some(t.clone());
        st.arrived += 1;
        let generation = st.generation;
        if st.arrived == self.world {
            let inputs: Vec<HostTensor> = st.slots.iter_mut().filter_map(Option::take).collect();
            st.result = Some(Arc::new(reduce(&inputs, kind).map_err(|e| e.to_string())));
            st.arrived = 0;
            st.generation += 1;
            self.turn.notify_all();
        } else {
            while st.generation == generation && st.aborted.is_none() {
                st = self.turn.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            if st.generation == generation {
                let why = st.aborted.clone().unwrap_or_default();
                return Err(aborted(&why));
            }
        }
        // The result stays until the next collective's last rank replaces it, which cannot
        // happen before this rank has arrived there, that is, after it read this one.
        let result = st.result.clone().expect("the last rank stored a result");
        drop(st);
        match &*result {
            Ok(t) => Ok(t.clone()),
            Err(e) => Err(RuntimeError::Invalid(format!("collective: {e}"))),
        }
    }

    fn abort(&self, why: &str) {
        let mut st = self.lock();
        if st.aborted.is_none() {
            st.aborted = Some(why.to_string());
        }
        self.turn.notify_all();
    }
}

/// What every communicator checks before an `all_reduce`: float elements.
pub(crate) fn check_all_reduce(t: &HostTensor) -> Result<()> {
    if t.dtype().is_float() {
        Ok(())
    } else {
        Err(RuntimeError::Invalid(format!(
            "all_reduce takes floating-point tensors, got {}",
            t.ty()
        )))
    }
}

/// What every communicator checks before a `broadcast`: the root is a rank of the group.
pub(crate) fn check_root(root: usize, world: usize) -> Result<()> {
    if root < world {
        Ok(())
    } else {
        Err(RuntimeError::Invalid(format!(
            "broadcast from rank {root} in a group of {world}"
        )))
    }
}

fn aborted(why: &str) -> RuntimeError {
    RuntimeError::Invalid(format!("the data-parallel group was aborted: {why}"))
}

/// The collective's result from every rank's tensor, in rank order.
fn reduce(inputs: &[HostTensor], kind: Kind) -> Result<HostTensor> {
    let first = &inputs[0];
    let ty = first.ty();
    if let Some((r, t)) = inputs.iter().enumerate().find(|(_, t)| t.ty() != ty) {
        return Err(RuntimeError::Invalid(format!(
            "ranks disagree on the tensor: rank 0 has {ty}, rank {r} has {}",
            t.ty()
        )));
    }
    match kind {
        Kind::Broadcast { root } => Ok(inputs[root].clone()),
        Kind::AllReduce { mean } => {
            let mut acc = first.to_f64_vec();
            for t in &inputs[1..] {
                for (a, b) in acc.iter_mut().zip(t.to_f64_vec()) {
                    *a += b;
                }
            }
            if mean {
                let n = inputs.len() as f64;
                acc.iter_mut().for_each(|a| *a /= n);
            }
            HostTensor::from_f64_slice(&ty, &acc).map_err(|e| RuntimeError::Invalid(e.to_string()))
        }
    }
}

/// One rank of a [`HostGroup`].
#[derive(Debug)]
pub struct HostRank {
    rank: usize,
    group: Arc<HostGroup>,
}

impl Communicator for HostRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.group.world
    }

    fn all_reduce(&self, t: &HostTensor, mean: bool) -> Result<HostTensor> {
        check_all_reduce(t)?;
        self.group.exchange(self.rank, t, Kind::AllReduce { mean })
    }

    fn broadcast(&self, t: &HostTensor, root: usize) -> Result<HostTensor> {
        check_root(root, self.group.world)?;
        self.group.exchange(self.rank, t, Kind::Broadcast { root })
    }

    fn abort(&self, why: &str) {
        self.group.abort(why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustytorch_ops::testing::rand_tensor;
    use rustytorch_ops::{DType, TensorType};

    #[test]
    fn ranks_get_the_same_sum_and_mean() {
        let ranks = HostGroup::ranks(3).unwrap();
        let ty = TensorType::new(DType::F32, vec![4, 5]);
        let xs: Vec<HostTensor> = (0..3).map(|r| rand_tensor(&ty, r, -1.0, 1.0)).collect();
        let want: Vec<f64> = (0..20)
            .map(|i| xs.iter().map(|x| x.to_f64_vec()[i]).sum::<f64>() / 3.0)
            .collect();
        let got: Vec<HostTensor> = std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .iter()
                .zip(&xs)
                .map(|(r, x)| s.spawn(move || r.all_reduce(x, true).unwrap()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for g in &got {
            assert_eq!(g.to_f64_vec(), got[0].to_f64_vec(), "ranks differ");
            for (a, b) in g.to_f64_vec().iter().zip(&want) {
                assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{a} vs {b}");
            }
        }
        // Several collectives in a row keep their order.
        let got: Vec<Vec<f64>> = std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .iter()
                .map(|r| {
                    s.spawn(move || {
                        let mut out = vec![];
                        for k in 0..50 {
                            let t = HostTensor::from_vec(vec![(r.rank() * 100 + k) as f64], [1])
                                .unwrap();
                            out.push(r.all_reduce(&t, false).unwrap().to_f64_vec()[0]);
                        }
                        out
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for g in &got {
            let want: Vec<f64> = (0..50).map(|k| (300 + 3 * k) as f64).collect();
            assert_eq!(g, &want);
        }
    }

    #[test]
    fn broadcast_takes_the_roots_tensor() {
        let ranks = HostGroup::ranks(2).unwrap();
        let got: Vec<Vec<f64>> = std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .iter()
                .map(|r| {
                    s.spawn(move || {
                        let t = HostTensor::from_vec(vec![r.rank() as f32 + 1.5; 3], [3]).unwrap();
                        r.broadcast(&t, 1).unwrap().to_f64_vec()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(got, vec![vec![2.5; 3], vec![2.5; 3]]);
    }

    #[test]
    fn an_aborted_group_fails_instead_of_waiting() {
        let ranks = HostGroup::ranks(2).unwrap();
        let t = HostTensor::from_vec(vec![1.0f32], [1]).unwrap();
        std::thread::scope(|s| {
            let waiting = s.spawn(|| ranks[0].all_reduce(&t, false));
            std::thread::sleep(std::time::Duration::from_millis(20));
            ranks[1].abort("rank 1 failed");
            let e = waiting.join().unwrap().unwrap_err().to_string();
            assert!(e.contains("rank 1 failed"), "{e}");
        });
        assert!(ranks[1].all_reduce(&t, false).is_err());
    }

    #[test]
    fn mismatched_tensors_are_an_error_on_every_rank() {
        let ranks = HostGroup::ranks(2).unwrap();
        let errs: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .iter()
                .map(|r| {
                    s.spawn(move || {
                        let t = HostTensor::from_vec(vec![1.0f32; r.rank() + 1], [r.rank() + 1])
                            .unwrap();
                        r.all_reduce(&t, false).unwrap_err().to_string()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for e in errs {
            assert!(e.contains("ranks disagree"), "{e}");
        }
    }
}
