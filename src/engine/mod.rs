//! Executes transfer operations without kernels: a CPU proxy thread per communicator polls
//! the stream flags and runs every op's state machine, moving bytes and exchanging
//! "buffer ready"/"data landed" with the peers through a [`Transport`].
//!
//! Every collective reaches the engine as one [`Op`]: the byte ranges this rank sends to
//! each peer and receives from each peer (several per peer allowed, matched in order), plus
//! the stream handshake that orders it on the caller's stream. The engine knows nothing of
//! collectives, of which device backend it drives, or of how a transport reaches a peer;
//! [`Engine::start`] is the one place that names transports: the same-host one for the
//! ranks of this node and, when ranks span nodes, the socket or the verbs one for the
//! others (as communicator creation chose), joined by a [`Route`] into the one transport
//! the proxy holds.
//!
//! - `proxy`: the proxy thread and the op state machine.
//! - [`streams`]: the per-stream flag pairs and the handshake enqueued on the user's stream.
//! - [`graphs`]: operations captured into CUDA graphs (templates, instances, orphans).
//! - `watchdog`: reports a proxy thread that stopped making progress.
use crate::device::{Allocation, DevPtr, Device, FlagSlab};
use crate::error::{Error, Result};
use crate::transport::relay::RelaySetup;
use crate::transport::route::Route;
use crate::transport::same_host::{Links, SameHost};
use crate::transport::socket::Socket;
use crate::transport::verbs::transport::Verbs;
use crate::transport::Far;
use crate::transport::Transport;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

pub mod graphs;
mod proxy;
pub mod streams;
mod watchdog;

/// One byte range of a transfer. `alloc` is the allocation holding `ptr` (None iff len 0).
#[derive(Clone, Copy, Debug)]
pub struct Transfer {
    pub peer: usize,
    pub ptr: DevPtr,
    pub len: usize,
    pub alloc: Option<Allocation>,
    /// How many of the `len` bytes move.
    pub fill: Fill,
    /// A send that this rank's forwarding peer may carry to a rank of another node, or a
    /// receive from one that it may land (`transport::relay`; set by point-to-point calls).
    pub forward: bool,
}

/// How many bytes of a transfer's range move. Both sides agree on `len` (it is checked
/// against the peer's); a compressed transfer moves a stream of at most `len` bytes whose
/// exact length only the sender's stream knows when it reaches the op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// All `len` bytes.
    Exact,
    /// A send of as many bytes as word `i` of the op's `len_words` holds once the stream
    /// has reached the op (written by work the stream ran before it; at most `len`).
    Word(usize),
    /// A receive that accepts any length up to `len`.
    UpTo,
    /// One segment of a pipelined compressed send (`comm::compressed`): the caller's stream
    /// codes it after the op's start, then raises word `flag` of the op's `len_words` to
    /// `v`; the write starts once the proxy sees that, and moves as many bytes as word
    /// `word` holds (at most `len`). Waiting on the flag never blocks a stream.
    Coded { word: usize, flag: usize, v: u64 },
    /// One segment of a pipelined compressed receive: accepts any length up to `len`, and
    /// once it has landed the proxy raises word `flag` of the op's `len_words` to `v`, which
    /// the caller's stream waits for before decoding it (between the op's start and
    /// finish). The op's release raises it too, so a failed op never leaves its stream
    /// waiting there.
    Landed { flag: usize, v: u64 },
}

impl Fill {
    /// Whether a receive of `len` bytes may deliver `got` bytes.
    pub fn accepts(self, len: usize, got: usize) -> bool {
        match self {
            Fill::UpTo | Fill::Landed { .. } => got <= len,
            Fill::Exact | Fill::Word(_) | Fill::Coded { .. } => got == len,
        }
    }
}

/// One operation as the proxy runs it.
pub struct Op {
    /// Position in the communicator's call order (equal on every rank for the same call).
    pub seq: u64,
    pub name: &'static str,
    pub flags: Arc<FlagSlab>,
    pub start_flag: usize,
    pub finish_flag: usize,
    /// Value the stream writes to `start_flag` when it reaches the op, and waits for in
    /// `finish_flag` before it moves on.
    pub stream_seq: u64,
    pub sends: Vec<Transfer>,
    pub recvs: Vec<Transfer>,
    /// For every peer this op talks to: the number of ops so far (this one included) that
    /// involve this rank and that peer. Both sides count the same calls, so this matches
    /// the peer's op even when other ranks take no part (point-to-point).
    pub pair_seqs: Vec<(usize, u64)>,
    /// The words `Fill::Word` and `Fill::Coded` sends read their length from (host-visible,
    /// written by the stream), and the flags of `Fill::Coded` and `Fill::Landed`.
    pub len_words: Option<Arc<FlagSlab>>,
    /// The op's staged transfers (`transport::staged`), enqueued at the call: the proxy
    /// only watches their flags.
    pub staged: Vec<crate::transport::staged::StagedWait>,
    /// Waits between the op's transfers ([`Order`]); None: every transfer may go at once.
    pub order: Option<Arc<Order>>,
}

/// A transfer of an op that others wait for ([`Order`]): its send or receive of that index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dep {
    Send(usize),
    Recv(usize),
}

/// Waits between an op's transfers: a send starts, and a receive's buffer is offered to its
/// sender, only once the transfers listed for it are complete (a send done, a receive
/// landed). A staged plan runs as one op this way, each staging slot's state kept by these
/// waits (docs/design.md, "Staged plan"). The lists index the op's `sends` and `recvs`; an
/// op with an order has no transfer to itself, none gated and none staged (the proxy keeps
/// the waits, so it moves every transfer), and every wait must point at a transfer that
/// needs no wait of its own to complete first, directly or not (else the op times out).
/// `Communicator::launch_op` checks that an order [`fits`](Order::fits) before the op's
/// handshake goes on the stream.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Order {
    pub send_after: Vec<Vec<Dep>>,
    pub recv_after: Vec<Vec<Dep>>,
}

impl Order {
    /// Whether the order fits an op of `sends` sends and `recvs` receives.
    pub fn fits(&self, sends: usize, recvs: usize) -> bool {
        let ok = |d: &Dep| match *d {
            Dep::Send(i) => i < sends,
            Dep::Recv(i) => i < recvs,
        };
        self.send_after.len() == sends && self.recv_after.len() == recvs && self.send_after.iter().chain(&self.recv_after).flatten().all(ok)
    }
}

/// `Fill::Landed` flags: their slab (the op's `len_words`) and (word, value) of each.
type LandedFlags = (Arc<FlagSlab>, Vec<(usize, u64)>);

/// How to release one op's stream: its flags, finish flag and stream seq, and the
/// `Fill::Landed` flags its stream may wait for before the finish (raised first).
struct Release {
    flags: Arc<FlagSlab>,
    finish: usize,
    v: u64,
    landed: Option<LandedFlags>,
}

impl Release {
    fn of(op: &Op) -> Release {
        let landed: Vec<(usize, u64)> = op.recvs.iter().filter_map(|x| if let Fill::Landed { flag, v } = x.fill { Some((flag, v)) } else { None }).collect();
        let landed = op.len_words.clone().filter(|_| !landed.is_empty()).map(|w| (w, landed));
        Release { flags: op.flags.clone(), finish: op.finish_flag, v: op.stream_seq, landed }
    }
}

/// State shared between the communicator and its proxy.
#[derive(Default)]
pub struct Shared {
    /// First asynchronous error (NCCL's `asyncResult`); sticky.
    error: Mutex<Option<Error>>,
    pub aborted: AtomicBool,
    /// Ops submitted / finished (succeeded or failed).
    pub submitted: AtomicU64,
    pub finished: AtomicU64,
    /// Iterations of the proxy loop (it turns at least every 20 ms, its idle park, unless a
    /// call blocks it);
    /// read by the watchdog.
    pub heartbeat: AtomicU64,
    /// How to release the stream of every op submitted and not finished, by op seq: its
    /// flags, finish flag and stream seq. Whoever removes an entry (the proxy finishing the
    /// op, or a teardown forced past a stuck proxy) counts the op as finished.
    releases: Mutex<BTreeMap<u64, Release>>,
    /// The compressed engine's decompression status words (`comm::compressed`), scanned for
    /// rejected input by the proxy's periodic checks and by `scan_codec_status`.
    pub codec_status: Mutex<Option<Arc<FlagSlab>>>,
    /// Sends relayed through the forwarding peer, both ways (`transport::relay`).
    pub relays: Arc<crate::transport::relay::RelayStats>,
}

impl Shared {
    pub fn set_error(&self, e: Error) {
        if let Ok(mut g) = self.error.lock() {
            if g.is_none() {
                log::error!("hoccl: {e}");
                *g = Some(e);
            }
        }
    }
    pub fn error(&self) -> Option<Error> {
        self.error.lock().ok().and_then(|g| g.clone())
    }

    /// `e` as the async error if none is set yet, logged either way (`set_error` logs only
    /// the first).
    fn report(&self, e: Error) {
        if self.error().is_some() {
            log::error!("hoccl: {e}");
        }
        self.set_error(e);
    }

    /// Report the first decompression that rejected its input as the asynchronous error.
    pub fn scan_codec_status(&self) {
        let ring = self.codec_status.lock().ok().and_then(|g| g.clone());
        if let Some(e) = ring.and_then(|r| crate::compress::first_rejection(&r)) {
            self.report(e);
        }
    }

    /// Ops submitted but not finished.
    fn pending(&self) -> u64 {
        self.submitted.load(Ordering::Acquire).saturating_sub(self.finished.load(Ordering::Acquire))
    }

    fn releases(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Release>> {
        self.releases.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Release op `seq`'s stream (raise its finish flag) and count it finished, unless that
    /// was done already.
    pub(crate) fn release_op(&self, seq: u64) {
        let entry = self.releases().remove(&seq);
        if let Some(r) = entry {
            self.release(r);
        }
    }

    /// Release the streams of every op not finished (a teardown that cannot wait for the
    /// proxy); returns how many.
    fn release_all(&self) -> usize {
        let all = std::mem::take(&mut *self.releases());
        let n = all.len();
        all.into_values().for_each(|r| self.release(r));
        n
    }

    /// Raise a removed entry's finish flag and count its op finished.
    fn release(&self, r: Release) {
        if let Some((words, landed)) = &r.landed {
            landed.iter().for_each(|&(i, v)| words.raise(i, v));
        }
        r.flags.raise(r.finish, r.v);
        self.finished.fetch_add(1, Ordering::AcqRel);
        crate::transport::ipc::op_released();
    }
}

pub struct EngineConfig {
    /// The same-host transport's chunk size and copy queues (`Config::chunk_bytes`,
    /// `Config::copy_queues`).
    pub chunk_bytes: usize,
    pub copy_queues: usize,
    /// An op making no progress for this long fails.
    pub timeout: Duration,
    /// Ops (call order, inclusive) whose timeline the proxy logs (`Config::trace_ops`).
    pub trace_ops: Option<(u64, u64)>,
    /// The same-host transport's gated path (`Config::gated`).
    pub gated: Option<bool>,
    /// Relays over the socket transport (`transport::relay`): this rank's forwarding peer
    /// when it is another rank of this node, and whether another rank of this node
    /// forwards through this one.
    pub relay_via: Option<usize>,
    pub relay_serves: bool,
    /// Refuse every relay (`Config::relay_refuse`, tests).
    pub relay_refuse: bool,
}

enum Cmd {
    Submit(Op),
    /// A captured op (`graphs`): poll its start flag from now on.
    Template(graphs::Template),
    /// Its graph was destroyed: stop polling template `id`.
    Forget(u32),
    /// Stop after pending ops finish (graceful) or fail them now.
    Shutdown { graceful: bool },
}

pub struct Engine {
    tx: Mutex<Option<Sender<Cmd>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The proxy thread, to unpark it when a command is sent (an idle proxy parks).
    proxy: Thread,
    pub shared: Arc<Shared>,
    timeout: Duration,
}

/// How long an abort waits for the proxy to stop before it releases the streams itself.
const ABORT_WAIT: Duration = Duration::from_secs(1);
/// What a graceful stop allows beyond the timeout that bounds the pending ops.
const STOP_MARGIN: Duration = Duration::from_secs(2);

impl Engine {
    /// Start the proxy thread, reaching the ranks of this node through `links` and those of
    /// other nodes through `net` (None: every peer is on this node); returns once the thread
    /// has bound the device and its transports are connected (the socket connections are
    /// made there, bounded by the socket links' timeout; verbs channels arrive connected).
    pub fn start(dev: Arc<dyn Device>, links: Links, net: Option<Far>, cfg: EngineConfig) -> Result<Engine> {
        const OP: &str = "Engine::start";
        let shared = Arc::new(Shared::default());
        let (tx, rx) = channel();
        let (ready_tx, ready_rx) = sync_channel(1);
        let sh = shared.clone();
        let (rank, nranks, timeout, trace) = (links.rank, links.peers.len(), cfg.timeout, cfg.trace_ops);
        let relay = (cfg.relay_via.is_some() || cfg.relay_serves).then(|| RelaySetup { via: cfg.relay_via, serves: cfg.relay_serves, refuse: cfg.relay_refuse, stats: shared.relays.clone() });
        let dev_for_mode = dev.clone();
        // The transport is made on the proxy thread: its device resources (copy queues)
        // belong to the thread that binds the device.
        let connect = move || -> Result<Box<dyn Transport>> {
            dev.bind_thread()?;
            let near = SameHost::connect(dev.clone(), links, cfg.copy_queues, cfg.chunk_bytes, cfg.gated)?;
            let (far, is_far, relay): (Box<dyn Transport>, Vec<bool>, _) = match net {
                None => return Ok(Box::new(near)),
                Some(Far::Socket(net)) => {
                    let far = Socket::connect(dev, net)?;
                    let is_far = (0..nranks).map(|p| far.reaches(p)).collect();
                    (Box::new(far), is_far, relay)
                }
                // Relays need the receiver to take a sender's bytes from its forwarding
                // peer's connections, which only the socket transport does.
                Some(Far::Verbs(net)) => {
                    let far = Verbs::new(dev, net)?;
                    let is_far = (0..nranks).map(|p| far.reaches(p)).collect();
                    (Box::new(far), is_far, None)
                }
            };
            Ok(Box::new(Route::new(near, far, is_far, relay)))
        };
        let body = move || match connect() {
            Ok(t) => {
                let _ = ready_tx.send(Ok(()));
                proxy::Proxy::new(rank, nranks, t, timeout, rx, sh).trace(trace).run();
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
            }
        };
        let relaxed = dev_for_mode;
        let thread = std::thread::Builder::new()
            .name(format!("hoccl-proxy-r{rank}"))
            .spawn(move || {
                // The proxy never captures work: in relaxed capture mode its driver calls
                // (copy queues, fence queries, imports) stay allowed while an application
                // thread captures a graph in global mode (`torch.cuda.graph`'s default),
                // which would otherwise refuse them and invalidate that capture.
                let mut body = Some(body);
                let mode = relaxed.relaxed_capture(&mut || {
                    if let Some(b) = body.take() {
                        b();
                    }
                    Ok(())
                });
                if let Err(e) = mode {
                    log::warn!("hoccl: rank {rank}: the proxy's capture mode: {e}");
                }
                // Run anyway if the mode could not be set.
                if let Some(b) = body.take() {
                    b();
                }
            })
            .map_err(|e| Error::io(OP, "thread spawn", e))?;
        ready_rx.recv().map_err(|_| Error::internal(OP, "proxy thread died during start"))??;
        watchdog::watch(&shared, rank, timeout);
        let proxy = thread.thread().clone();
        Ok(Engine { tx: Mutex::new(Some(tx)), thread: Mutex::new(Some(thread)), proxy, shared, timeout })
    }

    pub fn submit(&self, op: Op) -> Result<()> {
        let g = self.tx.lock().map_err(|_| Error::internal("Engine::submit", "poisoned"))?;
        let tx = g.as_ref().ok_or_else(|| Error::invalid_usage(op.name, "communicator was destroyed"))?;
        let seq = op.seq;
        self.shared.releases().insert(seq, Release::of(&op));
        crate::transport::ipc::op_submitted();
        self.shared.submitted.fetch_add(1, Ordering::AcqRel);
        tx.send(Cmd::Submit(op)).map_err(|_| {
            // Never enqueued on the proxy: release its stream here.
            self.shared.release_op(seq);
            Error::internal("Engine::submit", "proxy thread is gone")
        })?;
        // An atomic swap when the proxy is awake; one futex wake when it is parked.
        self.proxy.unpark();
        Ok(())
    }

    /// Register a captured op (`graphs`) whose stream side (the reset-based handshake on
    /// `flags`' words `start` and `finish`, both zero at the call) is recorded in a graph: the proxy
    /// runs one instance of it per replay it observes. The returned life's
    /// `graph_released` must be called once the graph is destroyed.
    pub fn register_template(
        &self,
        id: u32,
        name: &'static str,
        (flags, start, finish): (Arc<FlagSlab>, usize, usize),
        sends: Vec<Transfer>,
        recvs: Vec<Transfer>,
    ) -> Result<Arc<graphs::TemplateLife>> {
        let g = self.tx.lock().map_err(|_| Error::internal("Engine::register_template", "poisoned"))?;
        let tx = g.as_ref().ok_or_else(|| Error::invalid_usage(name, "communicator was destroyed"))?;
        // A replay needs no call into hoccl: retired mappings are closed only at the end.
        crate::transport::ipc::op_captured();
        let life = Arc::new(graphs::TemplateLife::new(id, name, flags, start, finish, (tx.clone(), self.proxy.clone())));
        tx.send(Cmd::Template(graphs::Template { life: life.clone(), sends, recvs }))
            .map_err(|_| Error::internal("Engine::register_template", "proxy thread is gone"))?;
        self.proxy.unpark();
        Ok(life)
    }

    /// Stop the proxy. Graceful: pending ops finish first (each bounded by the timeout);
    /// otherwise they fail now and their streams are released. Bounded either way: a proxy
    /// stuck in a device call (behind another thread's cuMemFree, say) that has not stopped
    /// after `ABORT_WAIT` (abort) or the timeout and `STOP_MARGIN` (graceful) is left to
    /// exit on its own once it can; the pending ops' streams are released here and the ops
    /// fail. A copy that the stuck proxy was issuing at that moment may still land in that
    /// op's buffers afterwards.
    pub fn shutdown(&self, graceful: bool) {
        if let Ok(mut g) = self.tx.lock() {
            if let Some(tx) = g.take() {
                let _ = tx.send(Cmd::Shutdown { graceful });
                self.proxy.unpark();
            }
        }
        let Some(h) = self.thread.lock().ok().and_then(|mut g| g.take()) else { return };
        let bound = if graceful { self.timeout + STOP_MARGIN } else { ABORT_WAIT };
        let t0 = std::time::Instant::now();
        while !h.is_finished() && t0.elapsed() < bound {
            std::thread::sleep(Duration::from_millis(1));
        }
        if h.is_finished() {
            if h.join().is_err() {
                log::error!("hoccl: proxy thread panicked");
            }
            // A proxy that panicked released nothing.
            self.shared.release_all();
            return;
        }
        let n = self.shared.release_all();
        let e = Error::Timeout {
            op: if graceful { "Communicator::destroy" } else { "Communicator::abort" },
            after: bound,
            what: format!("the proxy thread did not stop (stuck in a device call); {n} pending operation(s) failed and their streams were released without it"),
        };
        self.shared.report(e);
        // `h` is dropped: the thread detaches and exits once its call returns.
    }

    /// Ops submitted but not finished.
    pub fn pending(&self) -> u64 {
        self.shared.pending()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown(true);
    }
}
