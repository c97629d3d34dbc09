//! The proxy's part of captured ops (`engine::graphs`): polling the live templates' start
//! flags, running one instance per replay, matching the peers' signals for instances.
//! Kept apart from the eager path: an instance is an ordinary op once started (the same
//! transfer state machine, failure and timeout handling), reached by its own key space.
//!
//! **Cost.** Each turn reads the start flag of every live template that has no instance
//! running (one load of a host-mapped word each); a proxy with live templates sleeps
//! `WAIT_SLEEP` per idle turn instead of parking, so a replay is seen within tens of
//! microseconds (host backend, a live template and nothing else: about 7 % of a core).
use super::{OpState, Proxy, Step};
use crate::engine::graphs::{self, instance_key, split_key, Template, INSTANCE};
use crate::engine::Op;
use std::sync::atomic::Ordering;

/// Instance op seqs start here: apart from the communicator's call-order seqs.
const INSTANCE_SEQ: u64 = 1 << 62;

/// A live template and its replays so far.
pub(super) struct Live {
    t: Template,
    replays: u32,
    /// The op seq of its instance while one runs.
    running: Option<u64>,
}

pub(super) struct Templates {
    live: Vec<Live>,
    next_seq: u64,
}

impl Default for Templates {
    fn default() -> Self {
        Templates { live: Vec::new(), next_seq: INSTANCE_SEQ }
    }
}

impl Templates {
    pub(super) fn is_empty(&self) -> bool {
        self.live.is_empty()
    }
}

impl Proxy {
    pub(super) fn add_template(&mut self, t: Template) {
        log::debug!("rank {}: captured {} registered as template {}", self.rank, t.life.name, t.life.id);
        self.templates.live.push(Live { t, replays: 0, running: None });
    }

    /// Template `id`'s graph was destroyed: poll it no more. An instance still running
    /// finishes as any op (it holds its own references).
    pub(super) fn forget_template(&mut self, id: u32) {
        self.templates.live.retain(|l| l.t.life.id != id);
        self.early.retain(|(_, k), _| k & INSTANCE == 0 || split_key(*k).0 != id);
        log::debug!("rank {}: template {id} released (its graph was destroyed)", self.rank);
    }

    /// Start an instance of every live template whose graph reached its op (start == 1)
    /// and that has none running. A replay's `start := 1` comes after its `finish := 0`, and
    /// replays of one executable graph run in order, so the instance's `finish := 1` is the
    /// one its wait reads; a start seen while the previous instance runs (two executable
    /// graphs of one captured graph launched at once, which is not supported) waits for it.
    pub(super) fn poll_templates(&mut self) -> bool {
        let mut any = false;
        for i in 0..self.templates.live.len() {
            let l = &self.templates.live[i];
            if l.running.is_some_and(|s| self.ops.contains_key(&s)) {
                continue;
            }
            let life = &l.t.life;
            if life.flags.load(life.start) != 1 {
                continue;
            }
            life.flags.store(life.start, 0);
            any = true;
            let seq = self.templates.next_seq;
            self.templates.next_seq += 1;
            let l = &mut self.templates.live[i];
            l.replays = l.replays.wrapping_add(1);
            l.running = Some(seq);
            let key = instance_key(l.t.life.id, l.replays);
            let mut peers: Vec<usize> = l.t.sends.iter().chain(l.t.recvs.iter()).map(|x| x.peer).collect();
            peers.sort_unstable();
            peers.dedup();
            let life = l.t.life.clone();
            let op = Op {
                seq,
                name: life.name,
                flags: life.flags.clone(),
                start_flag: life.start,
                finish_flag: life.finish,
                stream_seq: 1,
                sends: l.t.sends.clone(),
                recvs: l.t.recvs.clone(),
                pair_seqs: peers.into_iter().map(|p| (p, key)).collect(),
                len_words: None,
                staged: Vec::new(),
                order: None,
            };
            self.start_instance(op);
        }
        any
    }

    /// Run an instance: counted pending like a submitted op (a forced teardown releases its
    /// stream), started at once (its stream reached it), then handed the signals its peers
    /// sent before this rank's replay got here.
    fn start_instance(&mut self, op: Op) {
        let seq = op.seq;
        log::debug!("rank {}: instance {seq} of template {} ({})", self.rank, split_key(op.pair_seqs[0].1).0, op.name);
        self.shared.releases().insert(seq, super::super::Release { v: 1, ..super::super::Release::of(&op) });
        crate::transport::ipc::op_submitted();
        self.shared.submitted.fetch_add(1, Ordering::AcqRel);
        for &(peer, key) in &op.pair_seqs {
            self.index.insert((peer, key), seq);
        }
        let keys = op.pair_seqs.clone();
        let mut st = OpState::new(op, &mut self.counts);
        if self.trace.is_some_and(|(a, b)| (a..=b).contains(&seq)) {
            st.trace = Some(Box::new([0; super::STEPS]));
            st.mark(Step::Submitted);
        }
        self.ops.insert(seq, st);
        if let Some(e) = self.shared.error() {
            // A communicator with an asynchronous error runs nothing more.
            return self.fail_op(seq, e);
        }
        if let Err(e) = self.start_op(seq) {
            return self.fail_op(seq, e);
        }
        for (peer, key) in keys {
            for signal in self.early.remove(&(peer, key)).unwrap_or_default() {
                self.handle_signal(peer, seq, signal);
            }
        }
    }

    /// Whether a signal with key `key` from `from` that matches no pending op is early (kept
    /// for an op not yet submitted or replayed) rather than late (for one that finished).
    pub(super) fn is_early(&self, from: usize, key: u64) -> bool {
        if key & INSTANCE == 0 {
            return key > self.max_pair.get(&from).copied().unwrap_or(0);
        }
        let (id, replay) = split_key(key);
        match self.templates.live.iter().find(|l| l.t.life.id == id) {
            Some(l) => (replay.wrapping_sub(l.replays) as i32) > 0,
            // Not registered here yet: this rank has not captured it so far.
            None => true,
        }
    }

    /// The proxy stops: templates whose graphs live go to the orphan responder.
    pub(super) fn orphan_templates(&mut self) {
        for l in self.templates.live.drain(..) {
            if l.t.life.detach() {
                graphs::orphan(l.t.life);
            }
        }
    }
}
