//! The proxy's part of staged transfers (`transport::staged`): their device operations are
//! enqueued at the call, so the proxy makes no device call for them, except for the entries a
//! caller held back because the staged queue was at its budget (`Lane::flush`, enqueued here
//! as the queue drains). At submission it announces each staged transfer's length to the
//! peer (a message), checks the peer's announcements against its own staged transfers (a
//! transfer is complete only once its peer's announcement matched: a receive must not
//! complete on a shorter send), and loads the transfers' flag words to see progress and
//! completion. Only where a transfer is `hop` does the op's stream wait for the `finish`
//! the proxy then writes; an op staged throughout completes on the device
//! (`Staged::direct_waits`), and its `finish` serves the proxy's bookkeeping: the op's
//! errors and timeout, `wait_idle`, the waiting-stream limit. On a failure it raises the
//! words its own and its senders' device work waits on (host stores): its receives'
//! `staged` and `drained` words; for its sends it drops the held-back entries, raises its
//! own `copied` word for the receiver, and raises the receiver's `drained` word where the
//! receiver's process is gone; so that no stream or queue waits for ever.
//!
//! **Cost.** A direction's (peer, send or receive) transfers complete in call order, so
//! each turn loads one word per direction with transfers pending (the front of its queue,
//! `Proxy::staged_dirs`), steps past the transfers that completed, and locks the staged
//! queue of each sending direction to look for held-back entries: independent of how many
//! ops are queued.
use super::{OpState, Proxy, Step};
use crate::error::Error;
use crate::transport::staged::{StagedWait, RELEASED};
use crate::transport::{RemoteBuffer, Tag, Wire, STAGED_RECV, STAGED_SEND};
use std::time::Instant;

/// One staged transfer of an op, as the proxy follows it.
pub(super) struct StagedState {
    pub(super) w: StagedWait,
    /// The peer's announcement of the transfer matched (length and kind).
    confirmed: bool,
    done: bool,
    /// The word's last value seen (a rise is progress).
    seen: u64,
}

impl StagedState {
    pub(super) fn new(w: StagedWait) -> Self {
        StagedState { confirmed: false, done: false, seen: 0, w }
    }
    pub(super) fn finished(&self) -> bool {
        self.done && self.confirmed
    }
}

impl OpState {
    pub(super) fn staged_pending(&self) -> bool {
        self.staged.iter().any(|s| !s.finished())
    }

    /// What a pending staged transfer waits for (timeout messages).
    pub(super) fn staged_waiting_for(&self) -> Option<String> {
        let s = self.staged.iter().find(|s| !s.finished())?;
        Some(match (s.w.send, s.done) {
            (_, true) => format!("rank {}'s announcement of its side of a staged transfer", s.w.peer),
            (true, false) => format!("staged copies to rank {} (chunk {} of {}; its ring full or this stream not there)", s.w.peer, s.w.value(), s.w.target),
            (false, _) => format!("staged data from rank {} (chunk {} of {} drained)", s.w.peer, s.w.value(), s.w.target),
        })
    }
}

impl Proxy {
    /// At submission: announce op `seq`'s staged transfers to their peers (their lengths)
    /// and follow them.
    pub(super) fn submit_staged(&mut self, seq: u64) {
        let Some(st) = self.ops.get(&seq) else { return };
        if st.staged.is_empty() {
            return;
        }
        for s in &st.staged {
            let wire = Wire { staged: if s.w.send { STAGED_SEND } else { STAGED_RECV }, ..Wire::empty(std::process::id()) };
            let tag = Tag { pair_seq: super::pair_seq(&st.op, s.w.peer), k: s.w.k };
            self.transport.post_ready(s.w.peer, tag, RemoteBuffer { len: s.w.len, wire });
        }
        self.staged_ops.insert(seq);
        if st.staged.iter().any(|s| s.w.hop) {
            self.staged_hop.insert(seq);
        }
        for (i, s) in st.staged.iter().enumerate() {
            self.staged_dirs.entry((s.w.peer, s.w.send)).or_default().push_back((seq, i));
        }
    }

    /// `from` announced its side of staged transfer `k` (`remote.len` bytes; its receive
    /// matches this rank's send, its send this rank's receive).
    pub(super) fn staged_announced(&mut self, from: usize, seq: u64, k: u32, remote: RemoteBuffer) {
        let Some(st) = self.ops.get_mut(&seq) else { return };
        let (name, me, len) = (st.op.name, self.rank, remote.len);
        let mine_sends = remote.wire.staged == STAGED_RECV;
        let (dir, other) = if mine_sends { ("receives from", "send") } else { ("sends to", "receive") };
        let Some(s) = st.staged.iter_mut().find(|s| s.w.send == mine_sends && s.w.peer == from && s.w.k == k) else {
            let e = Error::invalid_usage(name, format!("rank {from} {dir} this rank through the staged path, but this rank's {other} does not go that way (the two ranks decided differently: counts differ between ranks?)"));
            return self.fail_op(seq, e);
        };
        if s.w.len != len {
            let (want, has) = if mine_sends { (len, s.w.len) } else { (s.w.len, len) };
            let (rx, tx) = if mine_sends { (from, me) } else { (me, from) };
            let e = Error::invalid_usage(name, format!("rank {rx} expects {want} bytes from rank {tx} but it sends {has} (counts differ between ranks)"));
            return self.fail_op(seq, e);
        }
        s.confirmed = true;
        st.mark(Step::AnnounceIn);
        self.finish_if_complete(seq);
    }

    /// Load the flag word of each direction with staged transfers pending and finish the
    /// ops that are complete. A direction's transfers complete in call order (its word only
    /// grows and their targets grow with the call order), so only the front of each
    /// direction's queue is looked at: a turn costs one load per direction plus one step per
    /// transfer that completed, however many ops are queued. Whether any word moved.
    pub(super) fn poll_staged(&mut self) -> bool {
        if self.staged_ops.is_empty() {
            return false;
        }
        if self.failed_any {
            // A failure released staged words, which every later chunk of the direction
            // then passes: no pending staged op can complete with its data.
            let e = self.shared.error().unwrap_or(Error::Aborted { op: "staged transfer" });
            let seqs = std::mem::take(&mut self.staged_ops);
            self.staged_dirs.clear();
            for seq in seqs {
                self.fail_op(seq, e.clone());
            }
            return true;
        }
        let mut any = false;
        let (mut failed, mut finished) = (Vec::new(), Vec::new());
        let mut flush_err = None;
        let mut dirs = std::mem::take(&mut self.staged_dirs);
        for queue in dirs.values_mut() {
            // Entries of ops that failed or finished by other means are gone from `ops`.
            while queue.front().is_some_and(|&(seq, _)| !self.ops.contains_key(&seq)) {
                queue.pop_front();
            }
            let Some(&(seq, i)) = queue.front() else { continue };
            let Some(w) = self.ops.get(&seq).and_then(|st| st.staged.get(i)).map(|s| s.w.clone()) else {
                queue.pop_front();
                continue;
            };
            // Staged queues with entries their callers held back: enqueue what now fits.
            if let Some(lane) = &w.lane {
                let mut l = lane.lock().unwrap_or_else(|e| e.into_inner());
                if l.holds() {
                    match l.flush() {
                        Ok(moved) => any |= moved,
                        Err(e) => flush_err = flush_err.or(Some((seq, e))),
                    }
                }
            }
            let v = w.value();
            while let Some(&(seq, i)) = queue.front() {
                let Some(st) = self.ops.get_mut(&seq) else {
                    queue.pop_front();
                    continue;
                };
                let Some(s) = st.staged.get_mut(i) else {
                    queue.pop_front();
                    continue;
                };
                // The peer raised the word after a failure (the receiver its `staged`, the
                // sender its `drained`): the transfer did not complete.
                if v >= RELEASED {
                    failed.push((seq, s.w.peer));
                }
                if v > s.seen {
                    s.seen = v;
                    any = true;
                    st.last_progress = Instant::now();
                }
                s.done = v >= s.w.target;
                if !s.done {
                    break;
                }
                queue.pop_front();
                if !st.staged_pending() {
                    st.mark(Step::StagedSeen);
                    finished.push(seq);
                }
            }
        }
        dirs.retain(|_, q| !q.is_empty());
        self.staged_dirs = dirs;
        if let Some((seq, e)) = flush_err {
            self.fail_op(seq, e);
            return true;
        }
        for (seq, peer) in failed {
            let name = self.ops.get(&seq).map_or("staged transfer", |st| st.op.name);
            self.fail_op(seq, Error::Remote { op: name, peer, what: "it released its staged flags after a failure".into() });
        }
        for seq in finished {
            self.finish_if_complete(seq);
        }
        any
    }

    /// A failed op: release its receives' streams (their `staged` and `drained` words, host
    /// stores, which also release the senders' queues) and drop its sends' held-back entries,
    /// raising the receiver's `drained` word where the receiver's process is gone; keep doing
    /// so at the periodic checks (a live peer's queue or stream may still store a lower chunk
    /// number over them, and a receiver may die later).
    pub(super) fn release_staged(&mut self, st: &OpState) {
        for s in st.staged.iter() {
            s.w.release(self.transport.peer_health(s.w.peer).is_some());
            let same_lane = |r: &StagedWait| match (&r.lane, &s.w.lane) {
                (Some(a), Some(b)) => std::sync::Arc::ptr_eq(a, b),
                (a, b) => a.is_none() && b.is_none(),
            };
            let known = self.released.iter().any(|r| std::sync::Arc::ptr_eq(&r.area, &s.w.area) && r.release == s.w.release && same_lane(r));
            if !known {
                self.released.push(s.w.clone());
            }
        }
    }

    pub(super) fn rerelease_staged(&self) {
        self.released.iter().for_each(|w| w.release(self.transport.peer_health(w.peer).is_some()));
    }
}
