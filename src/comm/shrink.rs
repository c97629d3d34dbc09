//! `Communicator::shrink`: the ranks that are not excluded form a new communicator without
//! the excluded ones taking part (they may be dead), as NCCL's `ncclCommShrink`.
//!
//! The lowest survivor creates a fresh TCP unique id and sends it, with the survivor list it
//! computed, to every other survivor over the parent's bootstrap, point to point; nothing
//! goes through a collective of the parent's bootstrap, so an excluded rank is never waited
//! for. Each survivor checks that list against its own (a mismatch is `InvalidArgument`),
//! then joins the id with its rank among the survivors. Every wait is bounded: the id's
//! arrival by the parent bootstrap's timeout, the rendezvous by `config.timeout`; survivors
//! that disagree on the leader therefore end in `Timeout`, never a hang.
//!
//! What each bootstrap supports: TCP (pairwise links; a dead peer's link closing affects no
//! other) and thread ranks, whether the excluded ranks are alive or dead. An MPI bootstrap
//! made with a timeout (`MpiBootstrap::with_timeout`) carries the id as well, around live
//! ranks; after a process's death the MPI runtime usually ends the whole job. A bootstrap
//! without a timeout (MPI's by default) is refused with `InvalidUsage`: a survivor could
//! wait forever for a leader that disagrees.
use super::Communicator;
use crate::bootstrap::tcp::UniqueId;
use crate::config::Config;
use crate::error::{Error, Result};

/// Tag base of the shrink message over the parent's bootstrap (its user messages), plus the
/// call's number on the parent modulo `SHRINK_TAGS`: at most 32767, the least `MPI_TAG_UB`
/// MPI allows, and apart from the NCCL layer's split tags (`0x4e43_53xx`).
const SHRINK_TAG: u32 = 0x7000;
const SHRINK_TAGS: u32 = 0x1000;

/// The parent ranks that remain, in order, after excluding `exclude` from `size` ranks;
/// an entry out of range, a repeated entry, or the caller (`me`) in the list is an error.
pub fn survivors(op: &'static str, size: usize, me: usize, exclude: &[usize]) -> Result<Vec<usize>> {
    let mut out = vec![true; size];
    for &x in exclude {
        if x >= size {
            return Err(Error::invalid_arg(op, format!("excluded rank {x} out of {size} ranks")));
        }
        if !out[x] {
            return Err(Error::invalid_arg(op, format!("rank {x} is excluded twice")));
        }
        out[x] = false;
    }
    if !out[me] {
        return Err(Error::invalid_arg(op, format!("rank {me} excludes itself: excluded ranks do not call shrink")));
    }
    Ok((0..size).filter(|&r| out[r]).collect())
}

/// The message the leader sends: the id's 128 bytes, then the survivors (u32 LE each).
fn encode(id: &UniqueId, members: &[usize]) -> Vec<u8> {
    let mut v = id.internal.to_vec();
    v.extend(members.iter().flat_map(|&m| (m as u32).to_le_bytes()));
    v
}

fn decode(op: &'static str, b: &[u8]) -> Result<(UniqueId, Vec<usize>)> {
    if b.len() < 128 || (b.len() - 128) % 4 != 0 {
        return Err(Error::internal(op, format!("shrink message of {} bytes", b.len())));
    }
    let internal: [u8; 128] = b[..128].try_into().map_err(|_| Error::internal(op, "shrink id"))?;
    let members = b[128..].chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize).collect();
    Ok((UniqueId { internal }, members))
}

impl Communicator {
    /// Every rank not in `exclude` calls this (the excluded ranks do not; they may be
    /// dead): the survivors form a new communicator, ranks renumbered in parent-rank order,
    /// on this rank's device, with `config` (its timeout bounds the rendezvous). The parent
    /// is untouched: its pending operations go on or fail as they would (abort it first to
    /// stop them). Works after the parent's asynchronous error and after `abort()`. Every
    /// survivor must pass the same list: a different one is `InvalidArgument` on the ranks
    /// that detect it and `Timeout` on the rest.
    ///
    /// Each call on a parent, failed ones included, has its own message tag, so survivors
    /// that retry after a failed attempt (every one calling again) never read its leftovers.
    pub fn shrink(&self, exclude: &[usize], config: Config) -> Result<Communicator> {
        const OP: &str = "Communicator::shrink";
        let tag = SHRINK_TAG + self.shrinks.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % SHRINK_TAGS;
        config.validate()?;
        let members = survivors(OP, self.size, self.rank, exclude)?;
        let new_rank = members.iter().position(|&p| p == self.rank).ok_or_else(|| Error::internal(OP, "caller not a survivor"))?;
        let leader = members[0];
        let b = self.bootstrap();
        if b.timeout().is_none() {
            return Err(Error::invalid_usage(
                OP,
                "the parent's bootstrap waits without a timeout (an MPI bootstrap made without MpiBootstrap::with_timeout), so a survivor could wait forever for the leader's message; create the communicator over a bootstrap with a timeout, or from a unique id",
            ));
        }
        let id = if self.rank == leader {
            let id = UniqueId::with_ifname(config.socket_ifname.as_deref())?;
            let msg = encode(&id, &members);
            for &p in &members[1..] {
                b.send(p, tag, &msg).map_err(|e| e.with_op(OP))?;
            }
            id
        } else {
            let got = b.recv(leader, tag).map_err(|e| match e {
                Error::Timeout { after, .. } => Error::Timeout { op: OP, after, what: format!("no shrink id from rank {leader}, the lowest survivor (does every survivor pass the same exclude list?)") },
                e => e.with_op(OP),
            })?;
            let (id, theirs) = decode(OP, &got)?;
            if theirs != members {
                return Err(Error::invalid_arg(
                    OP,
                    format!("survivors differ between callers: rank {leader} keeps {theirs:?}, rank {} keeps {members:?} (every survivor must pass the same exclude list)", self.rank),
                ));
            }
            id
        };
        log::info!("rank {}/{}: shrinking to {} ranks {members:?} (new rank {new_rank})", self.rank, self.size, members.len());
        Self::from_unique_id_on(&id, members.len(), new_rank, Some(self.dev.clone()), config).map_err(|e| e.with_op(OP))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    #[test]
    fn survivors_keep_order_and_refuse_bad_lists() {
        assert_eq!(survivors("t", 5, 0, &[3, 1]).unwrap(), vec![0, 2, 4]);
        assert_eq!(survivors("t", 3, 2, &[]).unwrap(), vec![0, 1, 2]);
        for bad in [&[5usize][..], &[1, 1], &[0]] {
            assert_eq!(survivors("t", 5, 0, bad).unwrap_err().code(), ErrorCode::InvalidArgument, "{bad:?}");
        }
    }

    #[test]
    fn message_roundtrip() {
        let id = UniqueId { internal: [7; 128] };
        let (back, m) = decode("t", &encode(&id, &[0, 2, 9])).unwrap();
        assert_eq!((back.internal, m), (id.internal, vec![0, 2, 9]));
        assert!(decode("t", &[0; 130]).is_err());
    }
}
