//! The proxy thread: one per communicator. It never makes a call that can wait for the GPU
//! or for a peer: it polls host flags and its transport, and hands work to the transport.
//!
//! Life of an op on one rank:
//! 1. wait until the stream wrote `start >= stream_seq` (work before the call is done);
//! 2. for every receive: expose the buffer to the sender and tell it "ready";
//! 3. for every send whose receiver said "ready": start the write; the transport tells the
//!    receiver "landed" once every byte has landed, and reports the flow done here;
//! 4. when every send is done and every receive has landed: write `finish := stream_seq`.
//!
//! Any failure writes `finish` too (the stream never hangs), tells the peers, and parks the
//! error in `Shared` for `async_error()`.
//!
//! **Gated transfers** (the transport's [`Transport::gated`]; same-host peers in another
//! process, one-copy flows) skip steps 2–3 on the CPU's critical path: the receiver
//! announces the buffer when the op is submitted and tells the transport when its stream
//! reached the op; the sender hands all of an op's gated transfers to a peer to the
//! transport as soon as it holds their announcements, before its own stream reached the
//! op (the device waits for both streams). Their completion arrives as for the others.
//!
//! **Cost proportional to active work.** Ops wait in one queue per stream, in stream order;
//! a turn reads only the start flag of each stream's first op (a stream reaches its ops in
//! order). A started op is touched only when something concerns it: a signal for it (found
//! through the pair-sequence index), a flow of it completing or a chunk of it landing (both
//! reported by the transport by op). No turn visits every op.
//!
//! **Waiting.** A turn that moved nothing spins for [`SPIN_TURNS`] turns, then yields until
//! [`YIELD_FOR`] has passed since the last turn that moved something ([`STAGED_YIELD_FOR`]
//! while staged ops are pending whose streams only the proxy's store releases, and while
//! pipelined compressed sends wait for their segments, each of which the proxy starts when
//! it sees the stream's flag). Then, with nothing
//! pending, the thread parks ([`IDLE_PARK`]; `Engine::submit` unparks it, so a new op is
//! seen within microseconds), after the transport's [`Transport::idle`] (driver calls that
//! may wait for the device, such as closing stale mappings, belong there); with ops waiting
//! on the GPU or a peer, it sleeps
//! [`WAIT_SLEEP`] per turn (the kernel's timer slack, 50 µs by default, adds to it).
//! What that costs (host backend, per proxy): idle, nothing measurable (no tick of 10 ms
//! in a second); an op pending whose stream has not reached it, about 15 % of a core;
//! back-to-back 4 KiB ops, about a third of a core.
//!
//! The proxy reaches peers only through [`Transport`]; which transport it holds is decided
//! where the engine starts.
use super::{Cmd, Dep, Fill, Op, Shared, Transfer};
use crate::error::{Error, Result};
use crate::transport::{FlowId, GatedWrite, Incoming, Region, RemoteBuffer, Signal, Tag, Transport};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod graphs;
mod staged;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum SendPhase {
    WaitReady,
    Copying,
    Done,
}

struct SendState {
    x: Transfer,
    k: u32,
    /// Where the receiver said the data goes ("ready").
    remote: Option<RemoteBuffer>,
    phase: SendPhase,
    /// Moved by the transport's gated path (`Copying` then means queued on the device).
    gated: bool,
}

struct RecvState {
    x: Transfer,
    k: u32,
    landed: bool,
    /// Announced at submission (the transport's gated path).
    gated: bool,
}

struct OpState {
    op: Op,
    /// The op's timeline, when it is traced (`Config::trace_ops`).
    trace: Option<Box<[u64; STEPS]>>,
    started: bool,
    last_progress: Instant,
    sends: Vec<SendState>,
    recvs: Vec<RecvState>,
    /// The op's staged transfers (`staged.rs`).
    staged: Vec<staged::StagedState>,
    /// The op's [`Order`]: per send and receive, how many of its waits are not complete
    /// yet, and the transfers that wait for it (all empty without an order).
    send_waits: Vec<u32>,
    recv_waits: Vec<u32>,
    after_send: Vec<Vec<Dep>>,
    after_recv: Vec<Vec<Dep>>,
}

impl OpState {
    /// `counts`: one zeroed counter per rank (left zeroed), numbering each peer's transfers.
    fn new(mut op: Op, counts: &mut [u32]) -> Self {
        let sends: Vec<SendState> = op.sends.iter().map(|x| SendState { x: *x, k: next_k(counts, x.peer), remote: None, phase: SendPhase::WaitReady, gated: false }).collect();
        op.sends.iter().for_each(|x| counts[x.peer] = 0);
        let recvs: Vec<RecvState> = op.recvs.iter().map(|x| RecvState { x: *x, k: next_k(counts, x.peer), landed: false, gated: false }).collect();
        op.recvs.iter().for_each(|x| counts[x.peer] = 0);
        let staged = std::mem::take(&mut op.staged).into_iter().map(staged::StagedState::new).collect();
        let (mut send_waits, mut recv_waits, mut after_send, mut after_recv) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        if let Some(o) = op.order.take() {
            // `Engine::submit` checked that the order fits.
            (after_send, after_recv) = (vec![Vec::new(); sends.len()], vec![Vec::new(); recvs.len()]);
            send_waits = o.send_after.iter().map(|a| a.len() as u32).collect();
            recv_waits = o.recv_after.iter().map(|a| a.len() as u32).collect();
            let waiters = o.send_after.iter().enumerate().map(|(i, a)| (Dep::Send(i), a)).chain(o.recv_after.iter().enumerate().map(|(i, a)| (Dep::Recv(i), a)));
            for (waiter, after) in waiters {
                for d in after {
                    match *d {
                        Dep::Send(j) => after_send[j].push(waiter),
                        Dep::Recv(j) => after_recv[j].push(waiter),
                    }
                }
            }
        }
        OpState { op, trace: None, started: false, last_progress: Instant::now(), sends, recvs, staged, send_waits, recv_waits, after_send, after_recv }
    }

    /// Whether send `i` still waits for other transfers of the op ([`Order`]).
    fn send_held(&self, i: usize) -> bool {
        self.send_waits.get(i).is_some_and(|w| *w > 0)
    }

    /// Whether receive `i` still waits for other transfers of the op ([`Order`]).
    fn recv_held(&self, i: usize) -> bool {
        self.recv_waits.get(i).is_some_and(|w| *w > 0)
    }

    /// Whether the op has an [`Order`].
    fn ordered(&self) -> bool {
        !self.send_waits.is_empty() || !self.recv_waits.is_empty()
    }

    /// Which stream the op runs on: its start flag.
    fn stream(&self) -> StreamKey {
        (Arc::as_ptr(&self.op.flags) as usize, self.op.start_flag)
    }

    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        self.sends.iter().map(|s| s.x.peer).chain(self.recvs.iter().map(|r| r.x.peer))
    }

    /// Whether the op still needs a message or flag from `peer` (its buffer-ready or
    /// data-landed; a queued gated copy waits for the peer's ready flag).
    fn waits_on(&self, peer: usize) -> bool {
        self.sends.iter().any(|s| s.x.peer == peer && (s.phase == SendPhase::WaitReady || s.gated && s.phase == SendPhase::Copying))
            || self.recvs.iter().any(|r| r.x.peer == peer && !r.landed)
            || self.staged.iter().any(|s| s.w.peer == peer && !s.finished())
    }

    fn complete(&self) -> bool {
        self.started && self.sends.iter().all(|s| s.phase == SendPhase::Done) && self.recvs.iter().all(|r| r.landed) && !self.staged_pending()
    }

    /// The op's state for failure reports: where its stream is (the flags) and each
    /// transfer's phase.
    fn describe(&self) -> String {
        let (start, finish) = (self.op.flags.load(self.op.start_flag), self.op.flags.load(self.op.finish_flag));
        let g = |gated: bool| if gated { "(gated)" } else { "" };
        let held = |n: Option<&u32>| match n {
            Some(&w) if w > 0 => format!("(after {w})"),
            _ => String::new(),
        };
        let sends: Vec<String> = self.sends.iter().enumerate().map(|(i, s)| format!("{}:{:?}{}{}", s.x.peer, s.phase, g(s.gated), held(self.send_waits.get(i)))).collect();
        let recvs: Vec<String> =
            self.recvs.iter().enumerate().map(|(i, r)| format!("{}:{}{}{}", r.x.peer, if r.landed { "landed" } else { "waiting" }, g(r.gated), held(self.recv_waits.get(i)))).collect();
        let staged: Vec<String> = self.staged.iter().map(|s| format!("{}{}:{}/{}", if s.w.send { "to " } else { "from " }, s.w.peer, s.w.value(), s.w.target)).collect();
        format!(
            "op {} {}: stream seq {} (stream flags start {start} finish {finish}), {}, idle {:.1?}, sends [{}], recvs [{}], staged [{}]",
            self.op.seq,
            self.op.name,
            self.op.stream_seq,
            if self.started { "started" } else { "not started" },
            self.last_progress.elapsed(),
            sends.join(" "),
            recvs.join(" "),
            staged.join(" ")
        )
    }

    /// Note that the op reached `step` now (the first time for the steps that happen once
    /// per transfer and are traced at their first: buffer-ready sent and received, writes
    /// handed; the last time for sends done and data landed).
    fn mark(&mut self, step: Step) {
        if let Some(t) = self.trace.as_mut() {
            let i = step as usize;
            if t[i] == 0 || matches!(step, Step::SendsDone | Step::LandedIn | Step::LandedSeen) {
                t[i] = monotonic_ns();
            }
        }
    }

    /// What the op still waits for (for timeout messages).
    fn waiting_for(&self) -> String {
        if !self.started {
            return "the stream to reach the operation".into();
        }
        if let Some(s) = self.sends.iter().enumerate().find(|(i, s)| s.phase == SendPhase::WaitReady && !self.send_held(*i)).map(|x| x.1) {
            if s.remote.is_some() {
                return format!("the stream to code its segment to rank {} (compressed engine)", s.x.peer);
            }
            return format!("rank {}'s receive buffer (buffer-ready)", s.x.peer);
        }
        if let Some(s) = self.sends.iter().find(|s| s.phase == SendPhase::Copying) {
            if s.gated {
                return format!("gated copies to rank {} (queued behind this stream's start and rank {}'s ready flag)", s.x.peer, s.x.peer);
            }
            return format!("copies to rank {} to complete", s.x.peer);
        }
        match self.recvs.iter().enumerate().find(|(i, r)| !r.landed && !self.recv_held(*i)).map(|x| x.1) {
            Some(r) => format!("data from rank {} (data-landed)", r.x.peer),
            None if self.ordered() => {
                let held = |w: &[u32]| w.iter().filter(|w| **w > 0).count();
                format!("earlier transfers of the operation ({} sends and {} receives wait for them)", held(&self.send_waits), held(&self.recv_waits))
            }
            None => self.staged_waiting_for().unwrap_or_else(|| "completion".into()),
        }
    }
}

/// The steps of an op's timeline (`Config::trace_ops`), in the order they are logged.
#[derive(Clone, Copy)]
enum Step {
    Submitted,
    StreamReached,
    ReadySent,
    ReadyIn,
    /// A gated transfer's announcement received (sender).
    AnnounceIn,
    /// The gated copies queued on the device (sender).
    Queued,
    WriteHanded,
    Issued,
    SendsDone,
    /// A gated transfer's landing flag seen (either side).
    LandedSeen,
    LandedIn,
    /// Every staged transfer's flag word seen at its target (either side).
    StagedSeen,
    Released,
}
const STEPS: usize = 13;
/// `copies_issued`: the return of the first transport turn after the writes were handed
/// (that turn issues their first chunks). `ready_sent` of a gated receive is its
/// announcement at submission, before the stream reached the op (a negative time).
const STEP_NAMES: [&str; STEPS] = [
    "submitted",
    "stream_reached",
    "ready_sent",
    "ready_in",
    "announce_in",
    "gated_queued",
    "writes_handed",
    "copies_issued",
    "sends_done",
    "landed_seen",
    "landed_in",
    "staged_seen",
    "released",
];

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process of the host, so the
/// timelines of two ranks line up.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// One traced op's log line: each step's time relative to when its stream reached the op
/// (the absolute time of that is given), "-" for steps the op did not have.
fn timeline(rank: usize, st: &OpState, t: &[u64; STEPS]) -> String {
    let t0 = t[Step::StreamReached as usize];
    let bytes: usize = st.op.sends.iter().chain(st.op.recvs.iter()).map(|x| x.len).sum();
    let steps: Vec<String> = STEP_NAMES
        .iter()
        .zip(t.iter())
        .map(|(n, &v)| if v == 0 { format!("{n} -") } else { format!("{n} {:+.1}", (v as i64 - t0 as i64) as f64 / 1e3) })
        .collect();
    format!("hoccl trace: rank {rank} op {} {} ({bytes} B moved by this rank): stream reached it at {t0} ns; us from then: {}", st.op.seq, st.op.name, steps.join(", "))
}

/// Turns without progress spent spinning before the proxy yields.
const SPIN_TURNS: u32 = 64;
/// How long after the last turn that moved something the proxy yields (instead of
/// sleeping): a reply or completion this soon is seen at once.
const YIELD_FOR: Duration = Duration::from_micros(50);
/// How long after the last turn that moved something the proxy keeps yielding while staged
/// ops whose streams wait for its `finish` store are pending (it writes it once it sees the
/// staged words) or pipelined compressed sends wait for their segments' flags, so that a
/// sleeping proxy (WAIT_SLEEP plus the kernel's timer slack, about 70 µs) is not the op's
/// latency (per segment). Staged ops that complete without the proxy
/// (`Staged::direct_waits`) do not keep it yielding. Bounded so that ops queued far ahead
/// of their streams do not keep a core busy.
const STAGED_YIELD_FOR: Duration = Duration::from_millis(2);
/// The sleep per turn while ops wait on the GPU or a peer.
const WAIT_SLEEP: Duration = Duration::from_micros(20);
/// The park of an idle proxy (no op, no data in flight); `Engine::submit` and shutdown
/// unpark it. It bounds the heartbeat's period.
const IDLE_PARK: Duration = Duration::from_millis(20);

/// The park of an idle proxy that carries other ranks' relayed sends
/// (`transport::relay`): their records arrive in its mailbox with nothing to unpark it, so
/// a relay starts within this long (the wake-ups cost about 1 % of a core).
const RELAY_PARK: Duration = Duration::from_micros(200);

/// A stream, as the proxy tells them apart: its flag slab and start flag.
type StreamKey = (usize, usize);

/// The not-yet-started ops of one stream, by stream seq: (stream seq, op seq).
struct StreamQueue {
    key: StreamKey,
    ops: VecDeque<(u64, u64)>,
}

pub(super) struct Proxy {
    rank: usize,
    nranks: usize,
    transport: Box<dyn Transport>,
    rx: Receiver<Cmd>,
    shared: Arc<Shared>,
    timeout: Duration,
    ops: HashMap<u64, OpState>,
    /// Ops not started yet, per stream.
    streams: Vec<StreamQueue>,
    /// (peer, pair seq) -> op seq, for the ops in `ops`.
    index: HashMap<(usize, u64), u64>,
    /// Highest pair seq submitted per peer: signals beyond it are early.
    max_pair: HashMap<usize, u64>,
    early: HashMap<(usize, u64), Vec<Signal>>,
    stopping: Option<(bool, Instant)>,
    /// Whether the state was logged at a failure (once per communicator).
    reported: bool,
    last_check: Instant,
    /// Ops whose timeline is logged (`Config::trace_ops`).
    trace: Option<(u64, u64)>,
    /// Ops captured into graphs (`graphs.rs`).
    templates: graphs::Templates,
    /// Reused buffers: these serve every op or every turn.
    counts: Vec<u32>,
    ready: Vec<(usize, Tag, RemoteBuffer)>,
    gated: Vec<GatedWrite>,
    /// Gated batches held back while their receiver's queue is full (op, peer), in the order
    /// they became ready to queue; a peer's batches leave in that order.
    gated_held: VecDeque<(u64, usize)>,
    incoming: Vec<Incoming>,
    done: Vec<FlowId>,
    advanced: Vec<u64>,
    /// Ops with staged transfers pending, and the receives whose streams a failure
    /// released (`staged.rs`).
    staged_ops: std::collections::BTreeSet<u64>,
    /// Those of them whose streams wait for the proxy's `finish` store.
    staged_hop: std::collections::BTreeSet<u64>,
    /// The pending staged transfers of each direction (peer, send), in call order:
    /// (op seq, index in the op's staged transfers).
    staged_dirs: std::collections::HashMap<(usize, bool), VecDeque<(u64, usize)>>,
    released: Vec<crate::transport::staged::StagedWait>,
    /// An op failed: pending staged ops fail too (`staged.rs`).
    failed_any: bool,
    /// Pipelined compressed sends (`Fill::Coded`) waiting for their stream to code their
    /// segment: (op seq, send index).
    coded: Vec<(u64, usize)>,
}

impl Proxy {
    /// The proxy of rank `rank` of `nranks`, reaching its peers through `transport`.
    pub(super) fn new(rank: usize, nranks: usize, transport: Box<dyn Transport>, timeout: Duration, rx: Receiver<Cmd>, shared: Arc<Shared>) -> Self {
        Proxy {
            rank,
            nranks,
            transport,
            rx,
            shared,
            timeout,
            ops: HashMap::new(),
            streams: Vec::new(),
            index: HashMap::new(),
            max_pair: HashMap::new(),
            early: HashMap::new(),
            stopping: None,
            reported: false,
            last_check: Instant::now(),
            trace: None,
            templates: graphs::Templates::default(),
            counts: vec![0; nranks],
            ready: Vec::new(),
            gated: Vec::new(),
            gated_held: VecDeque::new(),
            incoming: Vec::new(),
            done: Vec::new(),
            advanced: Vec::new(),
            staged_ops: std::collections::BTreeSet::new(),
            staged_hop: std::collections::BTreeSet::new(),
            staged_dirs: std::collections::HashMap::new(),
            released: Vec::new(),
            failed_any: false,
            coded: Vec::new(),
        }
    }

    /// Log the timelines of ops `range` (call order, inclusive).
    pub(super) fn trace(mut self, range: Option<(u64, u64)>) -> Self {
        self.trace = range;
        self
    }

    pub(super) fn run(mut self) {
        // Every device call of this thread is counted (`device::calls`): the staged path's
        // tests check that its ops cost none.
        crate::device::calls::count_calls_here();
        let mut idle = 0u32;
        let mut last_active = Instant::now();
        loop {
            self.shared.heartbeat.fetch_add(1, Ordering::Relaxed);
            let mut progressed = self.drain_commands();
            progressed |= self.poll_starts();
            progressed |= self.poll_templates();
            progressed |= self.poll_signals();
            progressed |= self.progress_transport();
            progressed |= self.release_held_gated();
            progressed |= self.poll_staged();
            progressed |= self.poll_coded();
            self.periodic_checks();
            if self.should_exit() {
                break;
            }
            if progressed {
                idle = 0;
                last_active = Instant::now();
                continue;
            }
            idle = idle.saturating_add(1);
            if idle < SPIN_TURNS {
                std::hint::spin_loop();
            } else if last_active.elapsed() < YIELD_FOR || ((!self.staged_hop.is_empty() || !self.coded.is_empty()) && last_active.elapsed() < STAGED_YIELD_FOR) {
                std::thread::yield_now();
            } else if self.ops.is_empty() && self.templates.is_empty() && !self.transport.data_in_flight() && !self.transport.signals_queued() && self.stopping.is_none() {
                // Nothing pending: a command unparks the thread. Mappings retired meanwhile
                // are closed first (nothing of this communicator waits for the proxy).
                if !self.failed_any {
                    self.transport.idle();
                }
                // Other ranks' relayed sends reach a forwarding peer without an op of its own.
                std::thread::park_timeout(if self.transport.wake_often() { RELAY_PARK } else { IDLE_PARK });
            } else {
                std::thread::park_timeout(WAIT_SLEEP);
            }
        }
        self.orphan_templates();
        self.transport.close();
    }

    fn should_exit(&mut self) -> bool {
        let Some((graceful, since)) = self.stopping else { return false };
        if !self.ops.is_empty() && (!graceful || since.elapsed() > self.timeout) {
            let what = if graceful { "communicator destroyed with operations pending" } else { "communicator aborted" };
            let mut seqs: Vec<u64> = self.ops.keys().copied().collect();
            seqs.sort_unstable();
            for s in seqs {
                let e = if graceful {
                    Error::Timeout { op: "Communicator::destroy", after: self.timeout, what: what.into() }
                } else {
                    Error::Aborted { op: "Communicator::abort" }
                };
                self.fail_op(s, e);
            }
        }
        // Leave only when no data still moves into mapped memory.
        self.ops.is_empty() && !self.transport.data_in_flight() || since_too_long(since, self.timeout)
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
            Cmd::Template(t) => self.add_template(t),
            Cmd::Forget(id) => self.forget_template(id),
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
        log::debug!("rank {}: op {seq} {} submitted: {} sends, {} recvs", self.rank, op.name, op.sends.len(), op.recvs.len());
        for &(peer, ps) in &op.pair_seqs {
            self.index.insert((peer, ps), seq);
            let m = self.max_pair.entry(peer).or_insert(0);
            *m = (*m).max(ps);
        }
        let mut st = OpState::new(op, &mut self.counts);
        let me = self.rank;
        // An ordered op's waits are the proxy's: none of its transfers is gated (its peers'
        // ops of the same plan are ordered too, so both ends agree).
        let gate = !st.ordered();
        for s in st.sends.iter_mut().filter(|s| gate && s.x.peer != me && s.x.fill == Fill::Exact) {
            s.gated = self.transport.gated(s.x.peer, s.x.len);
        }
        for r in st.recvs.iter_mut().filter(|r| gate && r.x.peer != me && r.x.fill == Fill::Exact) {
            r.gated = self.transport.gated(r.x.peer, r.x.len);
        }
        if self.trace.is_some_and(|(a, b)| (a..=b).contains(&seq)) {
            st.trace = Some(Box::new([0; STEPS]));
            st.mark(Step::Submitted);
        }
        let (key, stream_seq) = (st.stream(), st.op.stream_seq);
        let q = match self.streams.iter().position(|q| q.key == key) {
            Some(i) => &mut self.streams[i],
            None => {
                self.streams.push(StreamQueue { key, ops: VecDeque::new() });
                self.streams.last_mut().expect("just pushed")
            }
        };
        // Calls reach the proxy in stream order; keep the queue sorted should two threads'
        // submissions to one stream cross.
        let at = q.ops.iter().rposition(|&(s, _)| s <= stream_seq).map_or(0, |i| i + 1);
        q.ops.insert(at, (stream_seq, seq));
        self.ops.insert(seq, st);
        if let Some(e) = self.shared.error() {
            // A communicator with an asynchronous error runs nothing more (as NCCL).
            self.fail_op(seq, e);
            return;
        }
        if let Err(e) = self.announce(seq) {
            self.fail_op(seq, e);
            return;
        }
        self.submit_staged(seq);
        if self.early.is_empty() {
            return;
        }
        for i in 0..self.ops.get(&seq).map_or(0, |st| st.op.pair_seqs.len()) {
            let Some(&(peer, ps)) = self.ops.get(&seq).and_then(|st| st.op.pair_seqs.get(i)) else { break };
            for signal in self.early.remove(&(peer, ps)).unwrap_or_default() {
                self.handle_signal(peer, seq, signal);
            }
        }
    }

    /// Announce op `seq`'s gated receives to their senders (at submission: the sender
    /// queues its copies before either stream reached the op).
    fn announce(&mut self, seq: u64) -> Result<()> {
        let Some(st) = self.ops.get_mut(&seq) else { return Ok(()) };
        let mut any = false;
        for r in st.recvs.iter().filter(|r| r.gated) {
            let remote = self.transport.expose(r.x.peer, Region { seq, ptr: r.x.ptr, len: r.x.len, alloc: r.x.alloc })?;
            self.transport.announce(r.x.peer, Tag { pair_seq: pair_seq(&st.op, r.x.peer), k: r.k }, remote)?;
            any = true;
        }
        if any {
            st.mark(Step::ReadySent);
        }
        Ok(())
    }

    /// Hand op `seq`'s gated sends to `peer` to the transport once every one of them has
    /// its announcement (they go as one batch, in pair order per peer: announcements and
    /// ops both arrive in call order).
    fn start_gated(&mut self, seq: u64, peer: usize) -> Result<()> {
        let Some(st) = self.ops.get(&seq) else { return Ok(()) };
        if st.sends.iter().filter(|s| s.gated && s.x.peer == peer).any(|s| s.remote.is_none() || s.phase != SendPhase::WaitReady) {
            return Ok(());
        }
        if self.gated_held.iter().any(|&(_, p)| p == peer) || !self.transport.gated_room(peer) {
            self.gated_held.push_back((seq, peer));
            return Ok(());
        }
        self.queue_gated(seq, peer)
    }

    /// Queue the batches held back for a full queue, each peer's in order, while there is
    /// room; whether any left.
    fn release_held_gated(&mut self) -> bool {
        if self.gated_held.is_empty() {
            return false;
        }
        let mut moved = false;
        let mut i = 0;
        while i < self.gated_held.len() {
            let (seq, peer) = self.gated_held[i];
            if !self.ops.contains_key(&seq) {
                // Failed meanwhile: nothing to queue.
                self.gated_held.remove(i);
                continue;
            }
            // Entries before `i` are the ones kept: one for this peer holds this one back too.
            if self.gated_held.range(..i).any(|&(_, p)| p == peer) || !self.transport.gated_room(peer) {
                i += 1;
                continue;
            }
            self.gated_held.remove(i);
            moved = true;
            if let Err(e) = self.queue_gated(seq, peer) {
                self.fail_op(seq, e);
            }
        }
        moved
    }

    fn queue_gated(&mut self, seq: u64, peer: usize) -> Result<()> {
        let Some(st) = self.ops.get_mut(&seq) else { return Ok(()) };
        let mut writes = std::mem::take(&mut self.gated);
        writes.clear();
        for (idx, s) in st.sends.iter().enumerate().filter(|(_, s)| s.gated && s.x.peer == peer) {
            let Some(remote) = s.remote else { continue };
            writes.push(GatedWrite { id: FlowId { seq, idx }, src: s.x.ptr, remote, len: s.x.len });
        }
        let start = st.op.flags.dev_addr(st.op.start_flag);
        let r = self.transport.gated_write(peer, pair_seq(&st.op, peer), start, st.op.stream_seq, &writes);
        self.gated = writes;
        r?;
        for s in st.sends.iter_mut().filter(|s| s.gated && s.x.peer == peer) {
            s.phase = SendPhase::Copying;
        }
        st.mark(Step::Queued);
        Ok(())
    }

    // ---------------------------------------------------------------- starts -------------

    /// Start the first op of every stream whose stream has reached it.
    fn poll_starts(&mut self) -> bool {
        let mut any = false;
        for i in 0..self.streams.len() {
            while let Some(&(stream_seq, seq)) = self.streams[i].ops.front() {
                let Some(st) = self.ops.get(&seq) else {
                    // Failed before its stream reached it.
                    self.streams[i].ops.pop_front();
                    continue;
                };
                if st.op.flags.load(st.op.start_flag) < stream_seq {
                    break;
                }
                self.streams[i].ops.pop_front();
                any = true;
                if let Err(e) = self.start_op(seq) {
                    self.fail_op(seq, e);
                }
            }
        }
        any
    }

    /// The stream reached op `seq` (work before the call is done): expose and announce its
    /// receives and start the writes whose receivers are ready.
    fn start_op(&mut self, seq: u64) -> Result<()> {
        let me = self.rank;
        let Some(st) = self.ops.get_mut(&seq) else { return Ok(()) };
        st.started = true;
        st.mark(Step::StreamReached);
        st.last_progress = Instant::now();
        log::debug!("rank {me}: op {seq} {} started (stream seq {})", st.op.name, st.op.stream_seq);
        // Every receive is exposed before any is announced: a failure then leaves the
        // peers with the op's failure only.
        let mut ready = std::mem::take(&mut self.ready);
        ready.clear();
        let mut exposed = Ok(());
        // A receive that waits for other transfers ([`Order`]) is offered once they are
        // complete (`release_after`).
        for r in st.recvs.iter().enumerate().filter(|(i, r)| r.x.peer != me && !r.gated && !st.recv_held(*i)).map(|x| x.1) {
            match expose(self.transport.as_mut(), seq, &r.x) {
                Ok(remote) => ready.push((r.x.peer, Tag { pair_seq: pair_seq(&st.op, r.x.peer), k: r.k }, remote)),
                Err(e) => {
                    exposed = Err(e);
                    break;
                }
            }
        }
        if exposed.is_ok() {
            for (peer, tag, remote) in ready.drain(..) {
                self.transport.post_ready(peer, tag, remote);
            }
            if !st.recvs.is_empty() {
                st.mark(Step::ReadySent);
            }
        }
        self.ready = ready;
        exposed?;
        // Gated receives were announced at submission: their senders' copies may run now.
        for i in 0..st.recvs.len() {
            let (peer, gated) = (st.recvs[i].x.peer, st.recvs[i].gated);
            if gated && !st.recvs[..i].iter().any(|r| r.gated && r.x.peer == peer) {
                self.transport.reached(peer, pair_seq(&st.op, peer));
            }
        }
        let n = self.ops.get(&seq).map_or(0, |st| st.sends.len());
        for idx in 0..n {
            self.start_write(seq, idx)?;
        }
        self.finish_if_complete(seq);
        Ok(())
    }

    /// Start send `idx` of started op `seq` if its receiver is ready and it waits for that.
    fn start_write(&mut self, seq: u64, idx: usize) -> Result<()> {
        let Some(st) = self.ops.get_mut(&seq) else { return Ok(()) };
        if st.send_held(idx) {
            // `release_after` starts it once what it waits for is complete.
            return Ok(());
        }
        let s = &mut st.sends[idx];
        let (SendPhase::WaitReady, Some(remote), true, false) = (s.phase, s.remote, st.started, s.gated) else { return Ok(()) };
        let tag = Tag { pair_seq: pair_seq(&st.op, s.x.peer), k: s.k };
        let word = match s.x.fill {
            Fill::Word(i) => Some(i),
            Fill::Coded { word, flag, v } => {
                if st.op.len_words.as_ref().map_or(0, |w| w.load(flag)) < v {
                    // The stream has not coded this segment yet: `poll_coded` tries again.
                    self.coded.push((seq, idx));
                    return Ok(());
                }
                Some(word)
            }
            Fill::Exact | Fill::UpTo | Fill::Landed { .. } => None,
        };
        let len = match word {
            Some(i) => {
                let n = st.op.len_words.as_ref().map_or(u64::MAX, |w| w.load(i));
                if n > s.x.len as u64 {
                    return Err(Error::internal(st.op.name, format!("send of {n} bytes into a {}-byte range (length word {i})", s.x.len)));
                }
                n as usize
            }
            None => s.x.len,
        };
        if s.x.forward {
            self.transport.start_forwarded(FlowId { seq, idx }, s.x.peer, tag, s.x.ptr, &remote, len)?;
        } else {
            self.transport.start_write(FlowId { seq, idx }, s.x.peer, tag, s.x.ptr, &remote, len)?;
        }
        s.phase = SendPhase::Copying;
        st.mark(Step::WriteHanded);
        Ok(())
    }

    /// Start the pipelined sends (`Fill::Coded`) whose segments the stream has coded since
    /// they were last tried; the others stay listed. Visits only those sends. A segment
    /// coded counts as the op's progress: the timeout bounds the coding of one segment, not
    /// of all of them.
    fn poll_coded(&mut self) -> bool {
        if self.coded.is_empty() {
            return false;
        }
        let waiting = std::mem::take(&mut self.coded);
        let mut any = false;
        for &(seq, idx) in &waiting {
            let before = self.coded.len();
            if let Err(e) = self.start_write(seq, idx) {
                self.fail_op(seq, e);
            }
            if self.coded.len() == before {
                any = true;
                if let Some(st) = self.ops.get_mut(&seq) {
                    st.last_progress = Instant::now();
                }
            }
        }
        any
    }

    /// Transfer `done` of op `seq` is complete: offer the receives and start the sends that
    /// waited only for it and the other complete ones ([`Order`]).
    fn release_after(&mut self, seq: u64, done: Dep) {
        let Some(st) = self.ops.get_mut(&seq) else { return };
        // Each transfer completes once: its waiters are taken, not kept.
        let waiters = match done {
            Dep::Send(i) => st.after_send.get_mut(i).map(std::mem::take),
            Dep::Recv(i) => st.after_recv.get_mut(i).map(std::mem::take),
        };
        for w in waiters.unwrap_or_default() {
            let Some(st) = self.ops.get_mut(&seq) else { return };
            let left = match w {
                Dep::Send(i) => st.send_waits.get_mut(i),
                Dep::Recv(i) => st.recv_waits.get_mut(i),
            };
            let Some(left) = left else { continue };
            *left = left.saturating_sub(1);
            if *left > 0 {
                continue;
            }
            let r = match w {
                Dep::Send(i) => self.start_write(seq, i),
                Dep::Recv(i) => self.offer(seq, i),
            };
            if let Err(e) = r {
                return self.fail_op(seq, e);
            }
        }
    }

    /// Expose receive `i` of op `seq`, whose last wait just completed, and tell its sender it
    /// is ready. Before the op started, `start_op` offers it (its waits are complete then).
    fn offer(&mut self, seq: u64, i: usize) -> Result<()> {
        let Some(st) = self.ops.get_mut(&seq) else { return Ok(()) };
        let Some(r) = st.recvs.get(i).filter(|_| st.started) else { return Ok(()) };
        let remote = expose(self.transport.as_mut(), seq, &r.x)?;
        self.transport.post_ready(r.x.peer, Tag { pair_seq: pair_seq(&st.op, r.x.peer), k: r.k }, remote);
        st.mark(Step::ReadySent);
        Ok(())
    }

    fn finish_if_complete(&mut self, seq: u64) {
        if self.ops.get(&seq).is_some_and(OpState::complete) {
            self.finish_op(seq, None);
        }
    }

    // ---------------------------------------------------------------- signals ------------

    fn poll_signals(&mut self) -> bool {
        let mut incoming = std::mem::take(&mut self.incoming);
        incoming.clear();
        let any = self.transport.poll_signals(&mut incoming);
        for m in incoming.drain(..) {
            let from = m.from;
            if let Some(&seq) = self.index.get(&(from, m.pair_seq)) {
                self.handle_signal(from, seq, m.signal);
            } else if self.is_early(from, m.pair_seq) {
                self.early.entry((from, m.pair_seq)).or_default().push(m.signal);
            } else {
                log::debug!("rank {}: late signal {:?} from {from} for finished op {}", self.rank, m.signal, m.pair_seq);
            }
        }
        self.incoming = incoming;
        any
    }

    fn handle_signal(&mut self, from: usize, seq: u64, signal: Signal) {
        let Some(st) = self.ops.get_mut(&seq) else { return };
        st.last_progress = Instant::now();
        let name = st.op.name;
        match signal {
            Signal::Ready { k, remote } if remote.wire.staged != 0 => self.staged_announced(from, seq, k, remote),
            Signal::Ready { k, remote } => {
                let Some(idx) = st.sends.iter().position(|s| s.x.peer == from && s.k == k) else {
                    let e = Error::invalid_usage(name, format!("rank {from} posted a receive from this rank that no send of this call matches (mismatched calls?)"));
                    return self.fail_op(seq, e);
                };
                let s = &mut st.sends[idx];
                if remote.len as usize != s.x.len {
                    let e = Error::invalid_usage(
                        name,
                        format!("rank {from} expects {} bytes from rank {} but it sends {} (counts differ between ranks)", remote.len, self.rank, s.x.len),
                    );
                    return self.fail_op(seq, e);
                }
                s.remote = Some(remote);
                let r = if s.gated {
                    st.mark(Step::AnnounceIn);
                    self.start_gated(seq, from)
                } else {
                    st.mark(Step::ReadyIn);
                    // Before its start the write waits: work before the call may still run.
                    self.start_write(seq, idx)
                };
                if let Err(e) = r {
                    self.fail_op(seq, e);
                }
            }
            Signal::Landed { k, len } => match st.recvs.iter_mut().enumerate().find(|(_, r)| r.x.peer == from && r.k == k) {
                Some((i, r)) if r.x.fill.accepts(r.x.len, len as usize) => {
                    r.landed = true;
                    if let (Fill::Landed { flag, v }, Some(w)) = (r.x.fill, &st.op.len_words) {
                        // The stream decodes this segment once it sees the flag.
                        w.raise(flag, v);
                    }
                    if r.gated {
                        st.mark(Step::LandedSeen);
                    }
                    st.mark(Step::LandedIn);
                    self.release_after(seq, Dep::Recv(i));
                    self.finish_if_complete(seq);
                }
                _ => {
                    let e = Error::invalid_usage(name, format!("rank {from} delivered data this rank did not expect (mismatched calls?)"));
                    self.fail_op(seq, e);
                }
            },
            // Counted as progress above.
            Signal::Progress { k } => log::trace!("rank {}: op {seq}: rank {from}'s send {k} keeps landing", self.rank),
            Signal::Failed { code } => {
                let e = Error::Remote { op: name, peer: from, what: format!("the operation failed there (code {code})") };
                self.fail_op(seq, e);
            }
        }
    }

    // ---------------------------------------------------------------- ops ----------------

    /// Let the transport move data and send signals; account for the flows it completed and
    /// the ops whose chunks landed.
    fn progress_transport(&mut self) -> bool {
        let (mut done, mut advanced) = (std::mem::take(&mut self.done), std::mem::take(&mut self.advanced));
        done.clear();
        advanced.clear();
        let progressed = match self.transport.progress(&mut done, &mut advanced) {
            Ok(p) => p,
            Err((seq, e)) => {
                self.fail_op(seq, e);
                true
            }
        };
        if self.trace.is_some() {
            for st in self.ops.values_mut().filter(|st| st.trace.as_ref().is_some_and(|t| t[Step::WriteHanded as usize] != 0)) {
                st.mark(Step::Issued);
            }
        }
        if !advanced.is_empty() {
            let now = Instant::now();
            for seq in &advanced {
                if let Some(st) = self.ops.get_mut(seq) {
                    st.last_progress = now;
                }
            }
        }
        for id in done.drain(..) {
            let Some(st) = self.ops.get_mut(&id.seq) else { continue };
            st.last_progress = Instant::now();
            st.sends[id.idx].phase = SendPhase::Done;
            if st.sends[id.idx].gated {
                st.mark(Step::LandedSeen);
            }
            st.mark(Step::SendsDone);
            self.release_after(id.seq, Dep::Send(id.idx));
            self.finish_if_complete(id.seq);
        }
        self.done = done;
        self.advanced = advanced;
        progressed
    }

    /// Release the stream (finish flag) and forget the op.
    fn finish_op(&mut self, seq: u64, err: Option<&Error>) {
        let Some(mut st) = self.ops.remove(&seq) else { return };
        self.staged_ops.remove(&seq);
        self.staged_hop.remove(&seq);
        for (peer, ps) in &st.op.pair_seqs {
            self.index.remove(&(*peer, *ps));
        }
        if err.is_some() {
            self.transport.cancel(seq);
            self.release_staged(&st);
        }
        log::debug!("rank {}: op {seq} {} finished{}", self.rank, st.op.name, if err.is_some() { " (failed)" } else { "" });
        self.shared.release_op(st.op.seq);
        if st.trace.is_some() {
            st.mark(Step::Released);
            if let Some(t) = st.trace.as_deref() {
                log::info!("{}", timeline(self.rank, &st, t));
            }
        }
    }

    fn fail_op(&mut self, seq: u64, e: Error) {
        let Some(st) = self.ops.get(&seq) else { return };
        let me = self.rank;
        let mut peers: Vec<usize> = st.peers().filter(|p| *p != me).collect();
        peers.sort_unstable();
        peers.dedup();
        for p in peers {
            self.transport.signal_failure(p, pair_seq(&st.op, p), e.code() as u32);
        }
        self.shared.set_error(e.clone());
        self.failed_any = true;
        crate::transport::ipc::op_failed();
        if !self.reported && !matches!(e, Error::Aborted { .. }) {
            self.reported = true;
            self.log_state(&e);
        }
        self.finish_op(seq, Some(&e));
    }

    /// Log what every pending op waits for, at the communicator's first failure: which
    /// rank's stream or proxy held things up is then visible from any rank's log.
    fn log_state(&self, e: &Error) {
        let mut lines = vec![format!("rank {}: state at the first failure ({e}):", self.rank)];
        let mut seqs: Vec<u64> = self.ops.keys().copied().collect();
        seqs.sort_unstable();
        lines.extend(seqs.iter().take(8).filter_map(|s| self.ops.get(s)).map(|st| format!("  {}", st.describe())));
        if self.ops.len() > 8 {
            lines.push(format!("  ... {} more pending ops", self.ops.len() - 8));
        }
        lines.push(format!("  {}; {} signals early", self.transport.describe(), self.early.len()));
        log::error!("hoccl: {}", lines.join("\n"));
    }

    // ---------------------------------------------------------------- health -------------

    fn periodic_checks(&mut self) {
        if self.last_check.elapsed() < Duration::from_millis(50) {
            return;
        }
        self.last_check = Instant::now();
        self.shared.scan_codec_status();
        self.rerelease_staged();
        self.streams.retain(|q| !q.ops.is_empty());
        // A peer may have sent its last messages and then closed: read them first, so only
        // ops that still wait on a gone peer fail.
        let gone: Vec<(usize, String)> = (0..self.nranks).filter(|p| *p != self.rank).filter_map(|p| Some((p, self.transport.peer_health(p)?))).collect();
        if !gone.is_empty() {
            self.poll_signals();
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
        failures.sort_unstable_by_key(|(seq, _)| *seq);
        for (seq, e) in failures {
            self.fail_op(seq, e);
        }
    }
}

/// Make receive `x` of op `seq` writable by its sender (through the forwarding peer where
/// it may be, [`Transfer::forward`]).
fn expose(t: &mut dyn Transport, seq: u64, x: &Transfer) -> Result<RemoteBuffer> {
    let region = Region { seq, ptr: x.ptr, len: x.len, alloc: x.alloc };
    if x.forward {
        t.expose_forwarded(x.peer, region)
    } else {
        t.expose(x.peer, region)
    }
}

/// The next transfer index with `peer` (counting in `counts`).
fn next_k(counts: &mut [u32], peer: usize) -> u32 {
    counts[peer] += 1;
    counts[peer] - 1
}

fn since_too_long(since: Instant, timeout: Duration) -> bool {
    since.elapsed() > timeout + Duration::from_secs(5)
}

/// The pair seq of `op` with `peer` (what signals about it carry).
fn pair_seq(op: &Op, peer: usize) -> u64 {
    op.pair_seqs.iter().find(|(p, _)| *p == peer).map_or(0, |(_, s)| *s)
}

