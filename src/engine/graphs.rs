//! Operations captured into CUDA graphs (docs/nccl.md, "CUDA graphs"). A captured op is a
//! *template* on the proxy: its byte ranges and peers, and a flag pair of its own that the
//! graph resets on every replay:
//!
//! ```text
//!   graph:  write finish := 0 ; write start := 1 ; (copies to self) ; wait finish >= 1
//!   proxy:  sees start == 1 → writes start := 0 → runs one instance → writes finish := 1
//! ```
//!
//! Each replay the proxy observes is an *instance* of the template, matched with the peers'
//! instances by (template id, replay count): a matching space apart from the pair sequence
//! numbers of eager ops (the key's top bit, [`instance_key`]), so replays and eager calls
//! interleave in any order. A template lives until its graph is destroyed (the release
//! hook the graph retains, [`TemplateLife::graph_released`]) or its communicator is: a
//! template whose graph outlives the communicator is handed to the process-wide *orphan*
//! responder, which answers each later replay at once (the instance fails, logged; the
//! stream is released) until the graph is destroyed, so a replay never hangs and never
//! touches freed flags.
use super::{Cmd, Transfer};
use crate::device::FlagSlab;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::thread::Thread;
use std::time::Duration;

/// The bit that sets instance keys apart from eager pair sequence numbers (which never
/// reach it).
pub(crate) const INSTANCE: u64 = 1 << 63;

/// Template ids: 31 bits (the key's bits 32..63).
pub const MAX_TEMPLATES: u32 = (1 << 31) - 1;

/// The matching key of replay `replay` of template `id`: the place of a pair sequence
/// number in signals. Replay counts wrap at 2^32 (instances further apart than that are
/// never pending together).
pub(crate) fn instance_key(id: u32, replay: u32) -> u64 {
    INSTANCE | (id as u64) << 32 | replay as u64
}

/// (template id, replay) of an instance key.
pub(crate) fn split_key(key: u64) -> (u32, u32) {
    (((key >> 32) & MAX_TEMPLATES as u64) as u32, key as u32)
}

/// A captured op as the proxy keeps it.
pub struct Template {
    pub life: Arc<TemplateLife>,
    pub sends: Vec<Transfer>,
    pub recvs: Vec<Transfer>,
}

/// What a captured op's graph, its proxy and the orphan responder share.
pub struct TemplateLife {
    /// Equal on every rank for the same captured call (a per-communicator count).
    pub id: u32,
    pub name: &'static str,
    pub flags: Arc<FlagSlab>,
    pub start: usize,
    pub finish: usize,
    graph_alive: AtomicBool,
    /// The proxy that answers replays, until the graph or the communicator goes.
    owner: Mutex<Option<(Sender<Cmd>, Thread)>>,
}

impl TemplateLife {
    pub(super) fn new(id: u32, name: &'static str, flags: Arc<FlagSlab>, start: usize, finish: usize, owner: (Sender<Cmd>, Thread)) -> Self {
        TemplateLife { id, name, flags, start, finish, graph_alive: AtomicBool::new(true), owner: Mutex::new(Some(owner)) }
    }

    /// The graph and its executable graphs are destroyed and their launches done (the
    /// graph's release hook): the proxy stops polling the template. Makes no device call.
    pub fn graph_released(&self) {
        self.graph_alive.store(false, Ordering::Release);
        let owner = self.owner.lock().ok().and_then(|mut g| g.take());
        if let Some((tx, proxy)) = owner {
            // A proxy already gone has orphaned nothing of ours (it found the owner taken).
            if tx.send(Cmd::Forget(self.id)).is_ok() {
                proxy.unpark();
            }
        }
    }

    pub fn graph_alive(&self) -> bool {
        self.graph_alive.load(Ordering::Acquire)
    }

    /// The proxy stops (its communicator is torn down): whether the graph still lives and
    /// the template must go to the orphan responder. Exactly one of this and
    /// `graph_released` finds the owner.
    pub(super) fn detach(&self) -> bool {
        let had = self.owner.lock().ok().and_then(|mut g| g.take()).is_some();
        had && self.graph_alive()
    }
}

/// Templates whose communicator is gone while their graph lives.
static ORPHANS: Mutex<Vec<Arc<TemplateLife>>> = Mutex::new(Vec::new());
/// Whether the orphan responder thread runs (changed only under the `ORPHANS` lock).
static RESPONDING: AtomicBool = AtomicBool::new(false);
/// The responder's poll period: a replay after its communicator's destroy waits this long
/// at most before its stream is released.
const ORPHAN_POLL: Duration = Duration::from_micros(200);

/// Answer `t`'s replays from now on (its proxy stopped): each fails at once and releases its
/// stream. The responder thread runs while there are orphans and exits when the last
/// one's graph is destroyed.
pub(super) fn orphan(t: Arc<TemplateLife>) {
    let Ok(mut g) = ORPHANS.lock() else { return };
    log::debug!("hoccl: captured {} (template {}) outlives its communicator: later replays fail", t.name, t.id);
    g.push(t);
    if RESPONDING.swap(true, Ordering::AcqRel) {
        return;
    }
    let spawned = std::thread::Builder::new().name("hoccl-graph-orphans".into()).spawn(respond);
    if let Err(e) = spawned {
        RESPONDING.store(false, Ordering::Release);
        log::error!("hoccl: cannot start the thread that answers replays after a communicator's destroy: {e}");
    }
}

fn respond() {
    loop {
        {
            let Ok(mut g) = ORPHANS.lock() else { return };
            g.retain(|t| t.graph_alive());
            for t in g.iter().filter(|t| t.flags.load(t.start) == 1) {
                t.flags.store(t.start, 0);
                log::error!(
                    "hoccl: a replay of captured {} (template {}) after its communicator was destroyed: the operation fails, its stream is released",
                    t.name,
                    t.id
                );
                t.flags.raise(t.finish, 1);
            }
            if g.is_empty() {
                RESPONDING.store(false, Ordering::Release);
                return;
            }
        }
        std::thread::sleep(ORPHAN_POLL);
    }
}
