//! The one entry point of every operation: [`Communicator::enqueue`] validates an
//! [`OpDesc`] (ranks, sizes, buffers, overlaps) and turns it into the byte ranges this rank
//! sends to and receives from each peer, which `submit` hands to the engine (or to the open
//! group). Each user buffer is validated once per call.
use super::op::{Collective, OpDesc};
use super::{relay_via, Communicator, Region};
use crate::config::EngineChoice;
use crate::cost::{self, CallKind, CallShape, Engine, LinkKind, OpClass, Prediction};
use crate::device::DevPtr;
use crate::engine::Transfer;
use crate::error::{Error, Result};

/// Whether two ranges share a byte. Either may be unvalidated (a caller's bogus address near
/// the top of the address space), so an end past 2^64 saturates instead of overflowing.
fn overlaps(a: DevPtr, alen: usize, b: DevPtr, blen: usize) -> bool {
    alen > 0 && blen > 0 && a.0 < b.0.saturating_add(blen as u64) && b.0 < a.0.saturating_add(alen as u64)
}

/// What this rank sends and receives for one operation.
type Ranges = (Vec<Transfer>, Vec<Transfer>);

impl Communicator {
    /// Validate `op` and enqueue it on its stream (or add it to the open group). Every
    /// public operation of every surface comes through here.
    pub fn enqueue(&self, op: &OpDesc) -> Result<()> {
        let name = op.coll.name();
        if log::log_enabled!(log::Level::Debug) {
            let (engine, p, link) = self.predicted_engine(op);
            let comp = p.compressed_us.map_or("-".into(), |c| format!("{c:.1}"));
            log::debug!(
                "rank {}: {name} {:?} x{} over {}: engine {} (predicted µs: raw {:.1}, compressed {comp}; HOCCL_ENGINE={:?})",
                self.rank,
                op.dtype,
                op.count,
                link.name(),
                engine.name(),
                p.raw_us,
                self.config.engine
            );
        }
        // Inter-node movement collectives run the planner's stages (`internode.rs`);
        // AlltoAllv's plan needs every rank's counts, exchanged before validation.
        let staged = self.stages(op)?;
        let counts = match op.coll {
            Collective::AllToAllV { send_counts, recv_counts, .. } if staged => Some(self.exchange_counts(send_counts, recv_counts)?),
            _ => None,
        };
        let (sends, recvs) = match op.coll {
            Collective::Send { peer } => self.point_to_point(name, op, peer, true)?,
            Collective::Recv { peer } => self.point_to_point(name, op, peer, false)?,
            Collective::AllGather => self.all_gather_ranges(name, op)?,
            Collective::AllToAll => self.all_to_all_ranges(name, op)?,
            Collective::AllToAllV { send_counts, send_displs, recv_counts, recv_displs } => {
                self.all_to_allv_ranges(name, op, [send_counts, send_displs, recv_counts, recv_displs])?
            }
            Collective::Broadcast { root } => self.broadcast_ranges(name, op, root)?,
            Collective::Gather { root } => self.gather_ranges(name, op, root)?,
            Collective::Scatter { root } => self.scatter_ranges(name, op, root)?,
            Collective::AllReduce { .. } | Collective::ReduceScatter { .. } | Collective::Reduce { .. } => {
                let red = self.reduction(name, op)?;
                return self.submit_reduction(name, red);
            }
        };
        if staged {
            return self.run_staged(name, op, counts.as_ref(), sends, recvs);
        }
        self.submit(name, op.stream, op.dtype, sends, recvs)
    }

    /// The engine `op` runs on, with the model's prediction and the link it was made for
    /// (the slowest link among the ranks the call involves). Under `auto` this is the
    /// model's choice ([`cost::choose`]); otherwise the engine set. The compressed engine
    /// applies the same rule per transfer ([`cost::CompressFrom`]), which is what a call
    /// whose transfers differ in size (AlltoAllv, a group) follows.
    pub fn predicted_engine(&self, op: &OpDesc) -> (Engine, Prediction, LinkKind) {
        let n = self.size;
        let (kind, peers): (CallKind, Vec<usize>) = match op.coll {
            Collective::Send { peer } | Collective::Recv { peer } => (CallKind::PointToPoint, vec![peer]),
            Collective::AllReduce { .. } => (CallKind::AllReduce, (0..n).collect()),
            Collective::ReduceScatter { .. } => (CallKind::ReduceScatter, (0..n).collect()),
            Collective::Reduce { .. } => (CallKind::Reduce, (0..n).collect()),
            _ => (CallKind::FanOut, (0..n).collect()),
        };
        let count = match op.coll {
            // The largest block: the transfer that decides the call's time.
            Collective::AllToAllV { send_counts, .. } => send_counts.iter().copied().max().unwrap_or(0),
            _ => op.count,
        };
        let link = peers.iter().filter(|&&p| p != self.rank).filter_map(|&p| self.peer_links.get(p).copied()).max().unwrap_or(LinkKind::SameGpu);
        let shape = CallShape::of(kind, op.dtype, count, n, self.config.reduce_scratch);
        let p = cost::predict(&self.cost_model, &shape, link, self.config.reduce_ctas);
        let raw = match shape.class {
            OpClass::Movement => Engine::Ce,
            OpClass::Reduction => Engine::Sm,
        };
        let engine = match self.config.engine {
            EngineChoice::Auto => cost::choose(&self.cost_model, &shape, link),
            EngineChoice::Compressed if p.compressed_us.is_some() => Engine::Compressed,
            EngineChoice::Compressed | EngineChoice::CopyEngine | EngineChoice::Sm => raw,
        };
        (engine, p, link)
    }

    pub(super) fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.size {
            return Err(Error::invalid_arg(op, format!("root {root} out of range (size {})", self.size)));
        }
        Ok(())
    }

    pub(super) fn total(&self, op: &'static str, bytes: usize) -> Result<usize> {
        bytes.checked_mul(self.size).filter(|t| *t <= isize::MAX as usize).ok_or_else(|| Error::invalid_arg(op, "count times ranks overflows"))
    }

    /// One block of `len` bytes per rank, block p at `p * len` of `r`, to or from rank p.
    fn blocks(&self, r: &Region, len: usize) -> Result<Vec<Transfer>> {
        (0..self.size).map(|p| r.part(p * len, len, p)).collect()
    }

    /// All of `r` to (or from) every rank.
    fn to_every_rank(&self, r: &Region) -> Result<Vec<Transfer>> {
        (0..self.size).map(|p| r.whole(p)).collect()
    }

    fn point_to_point(&self, name: &'static str, op: &OpDesc, peer: usize, send: bool) -> Result<Ranges> {
        self.check_peer(name, peer)?;
        let len = Self::bytes(name, op.count, op.dtype)?;
        let (what, ptr) = if send { ("send", op.send) } else { ("receive", op.recv) };
        let mut x = self.region(name, what, ptr, len)?.whole(peer)?;
        // Through the forwarding peer (`transport::relay`): with another node, and at least a
        // socket chunk (a smaller transfer crosses as one frame either way, and the relay's
        // records would only add to its latency).
        x.forward = !self.topo.same_node(self.rank, peer)
            && (self.config.stage_every_call || len >= self.config.staged_min_flow_bytes)
            && relay_via(&self.topo, self.rank, &self.config).is_some();
        Ok(if send { (vec![x], vec![]) } else { (vec![], vec![x]) })
    }

    fn all_gather_ranges(&self, name: &'static str, op: &OpDesc) -> Result<Ranges> {
        let (send, recv) = (op.send, op.recv);
        let len = Self::bytes(name, op.count, op.dtype)?;
        let total = self.total(name, len)?;
        let r = self.region(name, "receive", recv, total)?;
        let own = recv.add(self.rank * len);
        let s = if send == own { r.sub(self.rank * len, len)? } else { self.region(name, "send", send, len)? };
        if send != own && overlaps(send, len, recv, total) {
            return Err(Error::invalid_arg(name, "send buffer overlaps the receive buffer but is not this rank's slot"));
        }
        Ok((self.to_every_rank(&s)?, self.blocks(&r, len)?))
    }

    fn all_to_all_ranges(&self, name: &'static str, op: &OpDesc) -> Result<Ranges> {
        let len = Self::bytes(name, op.count, op.dtype)?;
        let total = self.total(name, len)?;
        if overlaps(op.send, total, op.recv, total) && self.size > 1 {
            return Err(Error::invalid_arg(name, "send and receive buffers overlap (in-place AlltoAll is not supported)"));
        }
        let s = self.region(name, "send", op.send, total)?;
        let r = self.region(name, "receive", op.recv, total)?;
        Ok((self.blocks(&s, len)?, self.blocks(&r, len)?))
    }

    /// `v`: send counts, send displacements, receive counts, receive displacements.
    fn all_to_allv_ranges(&self, name: &'static str, op: &OpDesc, v: [&[usize]; 4]) -> Result<Ranges> {
        for (what, a) in ["send_counts", "send_displs", "recv_counts", "recv_displs"].into_iter().zip(v) {
            if a.len() != self.size {
                return Err(Error::invalid_arg(name, format!("{what} has {} entries, expected {}", a.len(), self.size)));
            }
        }
        let [send_counts, send_displs, recv_counts, recv_displs] = v;
        let dtype = op.dtype;
        // Extent of each buffer in bytes: the furthest end of any block.
        let extent = |counts: &[usize], displs: &[usize]| -> Result<usize> {
            counts.iter().zip(displs).try_fold(0usize, |m, (c, d)| {
                let end = c.checked_add(*d).ok_or_else(|| Error::invalid_arg(name, "count + displacement overflows"))?;
                Ok(if *c == 0 { m } else { m.max(Self::bytes(name, end, dtype)?) })
            })
        };
        let s = self.region(name, "send", op.send, extent(send_counts, send_displs)?)?;
        let r = self.region(name, "receive", op.recv, extent(recv_counts, recv_displs)?)?;
        // A displacement is refused when its byte offset overflows, even for an empty block
        // (whose extent is not checked above).
        let offset = |d: usize| Self::bytes(name, d, dtype).map_err(|_| Error::invalid_arg(name, format!("displacement {d} overflows")));
        let mut sends = Vec::with_capacity(self.size);
        let mut recvs = Vec::with_capacity(self.size);
        for p in 0..self.size {
            sends.push(s.part(offset(send_displs[p])?, Self::bytes(name, send_counts[p], dtype)?, p)?);
            recvs.push(r.part(offset(recv_displs[p])?, Self::bytes(name, recv_counts[p], dtype)?, p)?);
        }
        for x in &sends {
            if recvs.iter().any(|y| overlaps(x.ptr, x.len, y.ptr, y.len)) {
                return Err(Error::invalid_arg(name, "a send range overlaps a receive range"));
            }
        }
        Ok((sends, recvs))
    }

    fn broadcast_ranges(&self, name: &'static str, op: &OpDesc, root: usize) -> Result<Ranges> {
        let (send, recv) = (op.send, op.recv);
        self.check_root(name, root)?;
        let len = Self::bytes(name, op.count, op.dtype)?;
        let r = self.region(name, "receive", recv, len)?;
        let mut sends = Vec::new();
        if self.rank == root {
            if send != recv && overlaps(send, len, recv, len) {
                return Err(Error::invalid_arg(name, "send and receive buffers partially overlap"));
            }
            let s = if send == recv { r.sub(0, len)? } else { self.region(name, "send", send, len)? };
            sends = self.to_every_rank(&s)?;
        }
        Ok((sends, vec![r.whole(root)?]))
    }

    fn gather_ranges(&self, name: &'static str, op: &OpDesc, root: usize) -> Result<Ranges> {
        let (s, recvs) = self.rooted_blocks(name, op, root, (op.send, "send"), (op.recv, "receive"))?;
        Ok((vec![s.whole(root)?], recvs))
    }

    fn scatter_ranges(&self, name: &'static str, op: &OpDesc, root: usize) -> Result<Ranges> {
        let (r, sends) = self.rooted_blocks(name, op, root, (op.recv, "receive"), (op.send, "send"))?;
        Ok((sends, vec![r.whole(root)?]))
    }

    /// Gather and Scatter: every rank's `count` elements at `own`, and on the root one such
    /// block per rank in `all` (in place when the root's `own` is its block of `all`).
    /// Returns `own` and, on the root, the blocks of `all` by rank.
    fn rooted_blocks(
        &self,
        name: &'static str,
        op: &OpDesc,
        root: usize,
        own: (DevPtr, &'static str),
        all: (DevPtr, &'static str),
    ) -> Result<(Region, Vec<Transfer>)> {
        self.check_root(name, root)?;
        let len = Self::bytes(name, op.count, op.dtype)?;
        if self.rank != root {
            return Ok((self.region(name, own.1, own.0, len)?, Vec::new()));
        }
        let total = self.total(name, len)?;
        let a = self.region(name, all.1, all.0, total)?;
        let slot = all.0.add(root * len);
        if own.0 != slot && overlaps(own.0, len, all.0, total) {
            return Err(Error::invalid_arg(name, format!("{} buffer overlaps the {} buffer but is not the root's slot", own.1, all.1)));
        }
        let o = if own.0 == slot { a.sub(root * len, len)? } else { self.region(name, own.1, own.0, len)? };
        Ok((o, self.blocks(&a, len)?))
    }
}
