//! Executes transfer operations without kernels: a CPU proxy thread per communicator polls
//! the stream flags, exchanges "buffer ready"/"data landed" with the peers' proxies and
//! drives the copy-engine queues.
//!
//! Every collective reaches the engine as one [`Op`]: the byte ranges this rank sends to
//! each peer and receives from each peer (several per peer allowed, matched in order), plus
//! the stream handshake that orders it on the caller's stream. The engine knows nothing of
//! collectives and nothing of which device backend it drives.
use crate::device::{Allocation, DevPtr, Device, FlagSlab};
use crate::error::{Error, Result};
use crate::transport::mailbox::Segment;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

mod ce;
mod proxy;
pub mod streams;
mod watchdog;

/// One byte range of a transfer. `alloc` is the allocation holding `ptr` (None iff len 0).
#[derive(Clone, Copy, Debug)]
pub struct Xfer {
    pub peer: usize,
    pub ptr: DevPtr,
    pub len: usize,
    pub alloc: Option<Allocation>,
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
    pub sends: Vec<Xfer>,
    pub recvs: Vec<Xfer>,
    /// For every peer this op talks to: the number of ops so far (this one included) that
    /// involve this rank and that peer. Both sides count the same calls, so this matches
    /// the peer's op even when other ranks take no part (point-to-point).
    pub pair_seqs: Vec<(usize, u64)>,
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
    /// Iterations of the proxy loop (it turns at least every 20 ms unless a call blocks it);
    /// read by the watchdog.
    pub heartbeat: AtomicU64,
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
}

/// What the proxy needs to reach the other ranks of its host.
pub struct Links {
    pub rank: usize,
    /// Own mailbox (rings indexed by the sender's local index).
    pub inbox: Segment,
    /// Peer mailboxes by global rank (None for self and for ranks on other nodes).
    pub peers: Vec<Option<Segment>>,
    /// Local index of this rank (its ring in every peer's mailbox).
    pub local_index: usize,
    /// Local index of every rank (None for other nodes).
    pub local_of: Vec<Option<usize>>,
}

pub struct EngineConfig {
    pub chunk_bytes: usize,
    pub copy_queues: usize,
    pub timeout: Duration,
}

enum Cmd {
    Submit(Op),
    /// Stop after pending ops finish (graceful) or fail them now.
    Shutdown { graceful: bool },
}

pub struct Engine {
    tx: Mutex<Option<Sender<Cmd>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    pub shared: Arc<Shared>,
}

impl Engine {
    /// Start the proxy thread; returns once it has bound the device and made its queues.
    pub fn start(dev: Arc<dyn Device>, links: Links, cfg: EngineConfig) -> Result<Engine> {
        const OP: &str = "Engine::start";
        let shared = Arc::new(Shared::default());
        let (tx, rx) = channel();
        let (ready_tx, ready_rx) = sync_channel(1);
        let sh = shared.clone();
        let (rank, timeout) = (links.rank, cfg.timeout);
        let thread = std::thread::Builder::new()
            .name(format!("hoccl-proxy-r{}", links.rank))
            .spawn(move || match proxy::Proxy::new(dev, links, cfg, rx, sh) {
                Ok(p) => {
                    let _ = ready_tx.send(Ok(()));
                    p.run();
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| Error::io(OP, "thread spawn", e))?;
        ready_rx.recv().map_err(|_| Error::internal(OP, "proxy thread died during start"))??;
        watchdog::watch(&shared, rank, timeout);
        Ok(Engine { tx: Mutex::new(Some(tx)), thread: Mutex::new(Some(thread)), shared })
    }

    pub fn submit(&self, op: Op) -> Result<()> {
        let g = self.tx.lock().map_err(|_| Error::internal("Engine::submit", "poisoned"))?;
        let tx = g.as_ref().ok_or_else(|| Error::invalid_usage(op.name, "communicator was destroyed"))?;
        self.shared.submitted.fetch_add(1, Ordering::AcqRel);
        tx.send(Cmd::Submit(op)).map_err(|_| Error::internal("Engine::submit", "proxy thread is gone"))
    }

    /// Stop the proxy. Graceful: pending ops finish first (each bounded by the timeout);
    /// otherwise they fail now and their streams are released.
    pub fn shutdown(&self, graceful: bool) {
        if let Ok(mut g) = self.tx.lock() {
            if let Some(tx) = g.take() {
                let _ = tx.send(Cmd::Shutdown { graceful });
            }
        }
        if let Some(h) = self.thread.lock().ok().and_then(|mut g| g.take()) {
            if h.join().is_err() {
                log::error!("hoccl: proxy thread panicked");
            }
        }
    }

    /// Ops submitted but not finished.
    pub fn pending(&self) -> u64 {
        self.shared.submitted.load(Ordering::Acquire) - self.shared.finished.load(Ordering::Acquire)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown(true);
    }
}
