//! The proxy thread: one per communicator. It never makes a device call that can wait for
//! the GPU: it polls host flags, mailboxes and copy-queue fences, and enqueues copies.
//!
//! Life of an op on one rank:
//! 1. wait until the stream wrote `start >= stream_seq` (work before the call is done);
//! 2. for every receive: export the buffer's allocation and tell the sender "ready";
//! 3. for every send whose receiver said "ready": map the receiver's allocation (cached)
//!    and hand the flow to the copy-engine scheduler; when its chunks have completed, tell
//!    the receiver "landed";
//! 4. when every send is done and every receive has landed: write `finish := stream_seq`.
//! Any failure writes `finish` too (the stream never hangs), tells the peers, and parks the
//! error in `Shared` for `async_error()`.
use super::ce::{CeScheduler, FlowId};
use super::{Cmd, EngineConfig, Links, Op, Shared, Transfer};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::transport::ipc::{ExportCache, ImportCache, Mapped};
use crate::transport::mailbox::{pid_alive, Msg, MsgKind};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum SendPhase {
    WaitReady,
    Copying,
    Done,
}

struct SendSt {
    x: Transfer,
    k: u32,
    /// The receiver's "ready" record (its allocation and our region in it).
    remote: Option<Msg>,
    mapped: Option<Mapped>,
    phase: SendPhase,
}

struct RecvSt {
    x: Transfer,
    k: u32,
    landed: bool,
}

struct OpState {
    op: Op,
    started: bool,
    last_progress: Instant,
    sends: Vec<SendSt>,
    recvs: Vec<RecvSt>,
}

impl OpState {
    fn new(op: Op) -> Self {
        let number = |xs: &[Transfer]| -> Vec<u32> {
            let mut per_peer: HashMap<usize, u32> = HashMap::new();
            xs.iter()
                .map(|x| {
                    let k = per_peer.entry(x.peer).or_insert(0);
                    *k += 1;
                    *k - 1
                })
                .collect()
        };
        let sk = number(&op.sends);
        let rk = number(&op.recvs);
        let sends = op.sends.iter().zip(sk).map(|(x, k)| SendSt { x: *x, k, remote: None, mapped: None, phase: SendPhase::WaitReady }).collect();
        let recvs = op.recvs.iter().zip(rk).map(|(x, k)| RecvSt { x: *x, k, landed: false }).collect();
        OpState { op, started: false, last_progress: Instant::now(), sends, recvs }
    }

    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        self.sends.iter().map(|s| s.x.peer).chain(self.recvs.iter().map(|r| r.x.peer))
    }

    /// Whether the op still needs a message from `peer` (its buffer-ready or data-landed).
    fn waits_on(&self, peer: usize) -> bool {
        self.sends.iter().any(|s| s.x.peer == peer && s.phase == SendPhase::WaitReady)
            || self.recvs.iter().any(|r| r.x.peer == peer && !r.landed)
    }

    fn complete(&self) -> bool {
        self.started && self.sends.iter().all(|s| s.phase == SendPhase::Done) && self.recvs.iter().all(|r| r.landed)
    }

    /// The op's state for failure reports: where its stream is (the flags) and each
    /// transfer's phase.
    fn describe(&self) -> String {
        let (start, finish) = (self.op.flags.load(self.op.start_flag), self.op.flags.load(self.op.finish_flag));
        let sends: Vec<String> = self.sends.iter().map(|s| format!("{}:{:?}", s.x.peer, s.phase)).collect();
        let recvs: Vec<String> = self.recvs.iter().map(|r| format!("{}:{}", r.x.peer, if r.landed { "landed" } else { "waiting" })).collect();
        format!(
            "op {} {}: stream seq {} (stream flags start {start} finish {finish}), {}, idle {:.1?}, sends [{}], recvs [{}]",
            self.op.seq,
            self.op.name,
            self.op.stream_seq,
            if self.started { "started" } else { "not started" },
            self.last_progress.elapsed(),
            sends.join(" "),
            recvs.join(" ")
        )
    }

    /// What the op still waits for (for timeout messages).
    fn waiting_for(&self) -> String {
        if !self.started {
            return "the stream to reach the operation".into();
        }
        if let Some(s) = self.sends.iter().find(|s| s.phase == SendPhase::WaitReady) {
            return format!("rank {}'s receive buffer (buffer-ready)", s.x.peer);
        }
        if let Some(s) = self.sends.iter().find(|s| s.phase == SendPhase::Copying) {
            return format!("copies to rank {} to complete", s.x.peer);
        }
        match self.recvs.iter().find(|r| !r.landed) {
            Some(r) => format!("data from rank {} (data-landed)", r.x.peer),
            None => "completion".into(),
        }
    }
}

pub(super) struct Proxy {
    dev: Arc<dyn Device>,
    links: Links,
    global_of_local: Vec<usize>,
    sched: CeScheduler,
    rx: Receiver<Cmd>,
    shared: Arc<Shared>,
    timeout: Duration,
    ops: BTreeMap<u64, OpState>,
    /// (peer, pair seq) -> op seq, for the ops in `ops`.
    index: HashMap<(usize, u64), u64>,
    /// Highest pair seq submitted per peer: messages beyond it are early.
    max_pair: HashMap<usize, u64>,
    early: HashMap<(usize, u64), Vec<Msg>>,
    outbox: VecDeque<(usize, Msg)>,
    imports: ImportCache,
    exports: ExportCache,
    /// Mappings of failed ops whose chunks are still draining.
    orphans: HashMap<(u64, usize), Mapped>,
    stopping: Option<(bool, Instant)>,
    /// By global rank: whether that rank lives in this process (from its mailbox).
    in_process: Vec<bool>,
    /// Whether the state was logged at a failure (once per communicator).
    reported: bool,
    last_check: Instant,
    scratch: Vec<u64>,
}

impl Proxy {
    pub(super) fn new(dev: Arc<dyn Device>, links: Links, cfg: EngineConfig, rx: Receiver<Cmd>, shared: Arc<Shared>) -> Result<Self> {
        dev.bind_thread()?;
        let queues = (0..cfg.copy_queues).map(|_| dev.create_copy_queue()).collect::<Result<Vec<_>>>()?;
        let mut global_of_local = vec![usize::MAX; links.local_of.iter().flatten().count()];
        for (g, l) in links.local_of.iter().enumerate() {
            if let Some(l) = l {
                global_of_local[*l] = g;
            }
        }
        let pid = std::process::id();
        let in_process = links.peers.iter().map(|p| p.as_ref().is_some_and(|seg| seg.owner_pid() == pid)).collect();
        Ok(Proxy {
            dev,
            links,
            global_of_local,
            sched: CeScheduler::new(queues, cfg.chunk_bytes),
            rx,
            shared,
            timeout: cfg.timeout,
            ops: BTreeMap::new(),
            index: HashMap::new(),
            max_pair: HashMap::new(),
            early: HashMap::new(),
            outbox: VecDeque::new(),
            imports: ImportCache::default(),
            exports: ExportCache::default(),
            orphans: HashMap::new(),
            stopping: None,
            in_process,
            reported: false,
            last_check: Instant::now(),
            scratch: Vec::new(),
        })
    }

    pub(super) fn run(mut self) {
        let mut idle = 0u32;
        loop {
            self.shared.heartbeat.fetch_add(1, Ordering::Relaxed);
            let mut progressed = self.drain_commands();
            progressed |= self.poll_inbox();
            progressed |= self.progress_ops();
            progressed |= self.poll_copies();
            self.flush_outbox();
            self.periodic_checks();
            if self.should_exit() {
                break;
            }
            if progressed {
                idle = 0;
            } else if self.ops.is_empty() && self.sched.is_idle() && self.outbox.is_empty() && self.stopping.is_none() {
                // Nothing in flight: sleep until a command arrives (or a periodic check).
                match self.rx.recv_timeout(Duration::from_millis(20)) {
                    Ok(cmd) => self.command(cmd),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => self.stopping = Some((false, Instant::now())),
                }
            } else {
                idle = idle.saturating_add(1);
                backoff(idle);
            }
        }
        self.imports.clear(self.dev.as_ref());
        self.links.inbox.mark_closed();
    }

    fn should_exit(&mut self) -> bool {
        let Some((graceful, since)) = self.stopping else { return false };
        if !self.ops.is_empty() && (!graceful || since.elapsed() > self.timeout) {
            let what = if graceful { "communicator destroyed with operations pending" } else { "communicator aborted" };
            let seqs: Vec<u64> = self.ops.keys().copied().collect();
            for s in seqs {
                let e = if graceful {
                    Error::Timeout { op: "Communicator::destroy", after: self.timeout, what: what.into() }
                } else {
                    Error::Aborted { op: "Communicator::abort" }
                };
                self.fail_op(s, e);
            }
        }
        // Leave only when no copy still writes into mapped memory.
        self.ops.is_empty() && self.sched.is_idle() || since_too_long(since, self.timeout)
    }

    // ---------------------------------------------------------------- commands -----------

    fn drain_commands(&mut self) -> bool {
        let mut any = false;
        loop {
            match self.rx.try_recv() {
                Ok(cmd) => {
                    self.command(cmd);
                    any = true;
                }
                Err(TryRecvError::Empty) => return any,
                Err(TryRecvError::Disconnected) => {
                    if self.stopping.is_none() {
                        self.stopping = Some((false, Instant::now()));
                    }
                    return any;
                }
            }
        }
    }

    fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Submit(op) => self.submit(op),
            Cmd::Shutdown { graceful } => {
                if !graceful {
                    self.shared.aborted.store(true, Ordering::Release);
                }
                self.stopping = Some((graceful, Instant::now()));
            }
        }
    }

    fn submit(&mut self, op: Op) {
        let seq = op.seq;
        log::debug!("rank {}: op {seq} {} submitted: {} sends, {} recvs", self.links.rank, op.name, op.sends.len(), op.recvs.len());
        let pairs = op.pair_seqs.clone();
        for &(peer, ps) in &pairs {
            self.index.insert((peer, ps), seq);
            let m = self.max_pair.entry(peer).or_insert(0);
            *m = (*m).max(ps);
        }
        self.ops.insert(seq, OpState::new(op));
        if let Some(e) = self.shared.error() {
            // A communicator with an asynchronous error runs nothing more (as NCCL).
            self.fail_op(seq, e);
            return;
        }
        for (peer, ps) in pairs {
            for m in self.early.remove(&(peer, ps)).unwrap_or_default() {
                self.handle_msg(peer, seq, m);
            }
        }
    }

    /// The pair seq of op `seq` with `peer` (what messages to that peer carry).
    fn pair_seq(&self, seq: u64, peer: usize) -> u64 {
        self.ops.get(&seq).and_then(|st| st.op.pair_seqs.iter().find(|(p, _)| *p == peer)).map_or(0, |(_, s)| *s)
    }

    // ---------------------------------------------------------------- messages -----------

    fn poll_inbox(&mut self) -> bool {
        let mut any = false;
        for l in 0..self.global_of_local.len() {
            while let Some(m) = self.links.inbox.try_pop(l) {
                let from = self.global_of_local[l];
                if let Some(&seq) = self.index.get(&(from, m.seq)) {
                    self.handle_msg(from, seq, m);
                } else if m.seq > self.max_pair.get(&from).copied().unwrap_or(0) {
                    self.early.entry((from, m.seq)).or_default().push(m);
                } else {
                    log::debug!("rank {}: late message {:?} from {from} for finished op {}", self.links.rank, m.kind(), m.seq);
                }
                any = true;
            }
        }
        any
    }

    /// Queue `m` (whose `seq` holds the op seq) for `to`, rewritten to the pair seq.
    fn send_msg(&mut self, to: usize, mut m: Msg) {
        m.seq = self.pair_seq(m.seq, to);
        self.outbox.push_back((to, m));
    }

    fn flush_outbox(&mut self) {
        let me = self.links.local_index;
        while let Some((to, m)) = self.outbox.front() {
            let Some(seg) = self.links.peers.get(*to).and_then(|s| s.as_ref()) else {
                log::error!("rank {}: no mailbox for rank {to}", self.links.rank);
                self.outbox.pop_front();
                continue;
            };
            if !seg.try_push(me, m) {
                return; // ring full: retry on the next turn
            }
            self.outbox.pop_front();
        }
    }

    fn handle_msg(&mut self, from: usize, seq: u64, m: Msg) {
        let Some(st) = self.ops.get_mut(&seq) else { return };
        st.last_progress = Instant::now();
        let name = st.op.name;
        match m.kind() {
            Some(MsgKind::Ready) => {
                let Some(s) = st.sends.iter_mut().find(|s| s.x.peer == from && s.k == m.k) else {
                    let e = Error::invalid_usage(name, format!("rank {from} posted a receive from this rank that no send of this call matches (mismatched calls?)"));
                    return self.fail_op(seq, e);
                };
                if m.len as usize != s.x.len {
                    let e = Error::invalid_usage(
                        name,
                        format!("rank {from} expects {} bytes from rank {} but it sends {} (counts differ between ranks)", m.len, self.links.rank, s.x.len),
                    );
                    return self.fail_op(seq, e);
                }
                s.remote = Some(m);
            }
            Some(MsgKind::Landed) => match st.recvs.iter_mut().find(|r| r.x.peer == from && r.k == m.k) {
                Some(r) if r.x.len == m.len as usize => r.landed = true,
                _ => {
                    let e = Error::invalid_usage(name, format!("rank {from} delivered data this rank did not expect (mismatched calls?)"));
                    self.fail_op(seq, e);
                }
            },
            Some(MsgKind::Fail) => {
                let code = m.code;
                let e = Error::Remote { op: name, peer: from, what: format!("the operation failed there (code {code})") };
                self.fail_op(seq, e);
            }
            None => log::error!("rank {}: unknown message kind {} from {from}", self.links.rank, m.kind),
        }
    }

    // ---------------------------------------------------------------- ops ----------------

    fn progress_ops(&mut self) -> bool {
        let mut any = false;
        // Reused buffer: this runs on every turn of the proxy loop.
        let mut seqs = std::mem::take(&mut self.scratch);
        seqs.clear();
        seqs.extend(self.ops.keys().copied());
        for &seq in &seqs {
            match self.progress_op(seq) {
                Ok(p) => any |= p,
                Err(e) => {
                    self.fail_op(seq, e);
                    any = true;
                }
            }
        }
        self.scratch = seqs;
        any
    }

    fn progress_op(&mut self, seq: u64) -> Result<bool> {
        let me = self.links.rank;
        let dev = self.dev.clone();
        let Some(st) = self.ops.get_mut(&seq) else { return Ok(false) };
        let mut progressed = false;
        if !st.started {
            if st.op.flags.load(st.op.start_flag) < st.op.stream_seq {
                return Ok(false);
            }
            st.started = true;
            st.last_progress = Instant::now();
            log::debug!("rank {me}: op {seq} {} started (stream seq {})", st.op.name, st.op.stream_seq);
            progressed = true;
            let mut msgs = Vec::new();
            for r in &st.recvs {
                if r.x.peer != me {
                    // A sender in this process writes to the buffer's own address: no
                    // IPC export (a driver call on the allocation) is needed for it.
                    let export = !self.in_process.get(r.x.peer).copied().unwrap_or(false);
                    msgs.push((r.x.peer, ready_msg(dev.as_ref(), &mut self.exports, seq, r, export)?));
                }
            }
            for (to, m) in msgs {
                self.send_msg(to, m);
            }
            self.match_self_sends(seq)?;
        }
        let Some(st) = self.ops.get_mut(&seq) else { return Ok(progressed) };
        let mut landed_now = Vec::new();
        for (idx, s) in st.sends.iter_mut().enumerate() {
            if s.phase != SendPhase::WaitReady {
                continue;
            }
            let Some(remote) = s.remote else { continue };
            progressed = true;
            if s.x.len == 0 {
                s.phase = SendPhase::Done;
                landed_now.push((s.x.peer, s.k, 0));
                continue;
            }
            let mapped = self.imports.acquire(dev.as_ref(), s.x.peer, &remote)?;
            let dst = mapped.base.add(remote.offset as usize);
            s.mapped = Some(mapped);
            s.phase = SendPhase::Copying;
            self.sched.add(FlowId { seq, idx }, s.x.ptr, dst, s.x.len);
        }
        for (to, k, len) in landed_now {
            let mut m = Msg::new(MsgKind::Landed, seq, k);
            m.len = len;
            self.send_msg(to, m);
        }
        if self.ops.get(&seq).is_some_and(OpState::complete) {
            self.finish_op(seq, None);
            progressed = true;
        }
        Ok(progressed)
    }

    /// Sends to self become local copies into the matching receive from self.
    fn match_self_sends(&mut self, seq: u64) -> Result<()> {
        let me = self.links.rank;
        let Some(st) = self.ops.get_mut(&seq) else { return Ok(()) };
        for idx in 0..st.sends.len() {
            let s = &st.sends[idx];
            if s.x.peer != me {
                continue;
            }
            let Some(r) = st.recvs.iter().find(|r| r.x.peer == me && r.k == s.k) else {
                return Err(Error::invalid_usage(st.op.name, "a send to self has no matching receive from self"));
            };
            if r.x.len != s.x.len {
                return Err(Error::invalid_usage(st.op.name, format!("send to self of {} bytes but receive from self of {}", s.x.len, r.x.len)));
            }
            let (src, dst, len) = (s.x.ptr, r.x.ptr, s.x.len);
            let s = &mut st.sends[idx];
            if len == 0 || src == dst {
                s.phase = SendPhase::Done; // in place: nothing to move
            } else {
                s.phase = SendPhase::Copying;
                self.sched.add(FlowId { seq, idx }, src, dst, len);
            }
        }
        if let Some(r) = st.recvs.iter().find(|r| r.x.peer == me && !st.sends.iter().any(|s| s.x.peer == me && s.k == r.k)) {
            return Err(Error::invalid_usage(st.op.name, format!("a receive from self ({} bytes) has no matching send to self", r.x.len)));
        }
        self.mark_self_landed(seq);
        Ok(())
    }

    fn mark_self_landed(&mut self, seq: u64) {
        let me = self.links.rank;
        let Some(st) = self.ops.get_mut(&seq) else { return };
        let done: Vec<u32> = st.sends.iter().filter(|s| s.x.peer == me && s.phase == SendPhase::Done).map(|s| s.k).collect();
        for r in st.recvs.iter_mut().filter(|r| r.x.peer == me) {
            if done.contains(&r.k) {
                r.landed = true;
            }
        }
    }

    fn poll_copies(&mut self) -> bool {
        let mut done = Vec::new();
        let progressed = match self.sched.poll(&mut done) {
            Ok(p) => p,
            Err((seq, e)) => {
                self.fail_op(seq, e);
                true
            }
        };
        let me = self.links.rank;
        for id in done {
            if let Some(m) = self.orphans.remove(&(id.seq, id.idx)) {
                self.imports.release(&m);
                continue;
            }
            let Some(st) = self.ops.get_mut(&id.seq) else { continue };
            st.last_progress = Instant::now();
            let s = &mut st.sends[id.idx];
            s.phase = SendPhase::Done;
            if let Some(m) = s.mapped.take() {
                self.imports.release(&m);
            }
            let (peer, k, len) = (s.x.peer, s.k, s.x.len);
            if peer == me {
                self.mark_self_landed(id.seq);
            } else {
                let mut m = Msg::new(MsgKind::Landed, id.seq, k);
                m.len = len as u64;
                self.send_msg(peer, m);
            }
            if self.ops.get(&id.seq).is_some_and(OpState::complete) {
                self.finish_op(id.seq, None);
            }
        }
        progressed
    }

    /// Release the stream (finish flag) and forget the op.
    fn finish_op(&mut self, seq: u64, err: Option<&Error>) {
        let Some(mut st) = self.ops.remove(&seq) else { return };
        for (peer, ps) in &st.op.pair_seqs {
            self.index.remove(&(*peer, *ps));
        }
        if err.is_some() {
            self.sched.cancel(seq);
            for (idx, s) in st.sends.iter_mut().enumerate() {
                if let Some(m) = s.mapped.take() {
                    if s.phase == SendPhase::Copying {
                        self.orphans.insert((seq, idx), m);
                    } else {
                        self.imports.release(&m);
                    }
                }
            }
        }
        log::debug!("rank {}: op {seq} {} finished{}", self.links.rank, st.op.name, if err.is_some() { " (failed)" } else { "" });
        self.shared.release_op(st.op.seq);
    }

    fn fail_op(&mut self, seq: u64, e: Error) {
        let Some(st) = self.ops.get(&seq) else { return };
        let me = self.links.rank;
        let mut peers: Vec<usize> = st.peers().filter(|p| *p != me).collect();
        peers.sort_unstable();
        peers.dedup();
        for p in peers {
            let mut m = Msg::new(MsgKind::Fail, seq, 0);
            m.code = e.code() as u32;
            self.send_msg(p, m);
        }
        self.shared.set_error(e.clone());
        if !self.reported && !matches!(e, Error::Aborted { .. }) {
            self.reported = true;
            self.log_state(&e);
        }
        self.finish_op(seq, Some(&e));
    }

    /// Log what every pending op waits for, at the communicator's first failure: which
    /// rank's stream or proxy held things up is then visible from any rank's log.
    fn log_state(&self, e: &Error) {
        let mut lines = vec![format!("rank {}: state at the first failure ({e}):", self.links.rank)];
        lines.extend(self.ops.values().take(8).map(|st| format!("  {}", st.describe())));
        if self.ops.len() > 8 {
            lines.push(format!("  ... {} more pending ops", self.ops.len() - 8));
        }
        lines.push(format!("  {}; {} messages queued out, {} early", self.sched.describe(), self.outbox.len(), self.early.len()));
        log::error!("hoccl: {}", lines.join("\n"));
    }

    // ---------------------------------------------------------------- health -------------

    fn periodic_checks(&mut self) {
        if self.last_check.elapsed() < Duration::from_millis(50) {
            return;
        }
        self.last_check = Instant::now();
        // A peer may have sent its last messages and then closed: read them first, so only
        // ops that still wait on a gone peer fail.
        let gone: Vec<(usize, String)> = (0..self.links.peers.len()).filter_map(|p| self.peer_problem(p)).collect();
        if !gone.is_empty() {
            self.poll_inbox();
        }
        let now = Instant::now();
        let mut failures = Vec::new();
        for (seq, st) in &self.ops {
            if let Some((peer, what)) = gone.iter().find(|(p, _)| st.waits_on(*p)) {
                failures.push((*seq, Error::Remote { op: st.op.name, peer: *peer, what: what.clone() }));
            } else if st.started && now - st.last_progress > self.timeout {
                failures.push((*seq, Error::Timeout { op: st.op.name, after: self.timeout, what: format!("waiting for {}", st.waiting_for()) }));
            }
        }
        for (seq, e) in failures {
            self.fail_op(seq, e);
        }
    }

    fn peer_problem(&self, peer: usize) -> Option<(usize, String)> {
        let seg = self.links.peers.get(peer)?.as_ref()?;
        if !pid_alive(seg.owner_pid()) {
            return Some((peer, format!("process {} exited", seg.owner_pid())));
        }
        // A closed mailbox means its communicator was destroyed or aborted.
        seg.is_closed().then(|| (peer, "its communicator was aborted or destroyed".to_string()))
    }
}

fn since_too_long(since: Instant, timeout: Duration) -> bool {
    since.elapsed() > timeout + Duration::from_secs(5)
}

fn ready_msg(dev: &dyn Device, exports: &mut ExportCache, seq: u64, r: &RecvSt, export: bool) -> Result<Msg> {
    let mut m = Msg::new(MsgKind::Ready, seq, r.k);
    m.len = r.x.len as u64;
    if let Some(a) = r.x.alloc {
        if export {
            m.handle = exports.get(dev, &a)?.0;
        }
        m.alloc_id = a.id;
        m.alloc_len = a.len as u64;
        m.base = a.base.0;
        m.offset = r.x.ptr.0 - a.base.0;
    }
    Ok(m)
}

fn backoff(idle: u32) {
    if idle < 64 {
        std::hint::spin_loop();
    } else if idle < 4096 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}
