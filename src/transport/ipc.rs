//! Peer allocations of the same-host transport: the receiver exports the allocation that
//! holds its buffer, the sender maps it once and copies straight into it.
//!
//! Mappings are cached per (peer rank, allocation id). Allocation ids change when memory is
//! freed and reallocated, so a reused address is never served a stale mapping. Entries in
//! use by in-flight copies are pinned (`refs > 0`).
//!
//! **Stale mappings.** A peer's new allocation that overlaps, in its owner's address space,
//! an allocation this cache still maps proves the peer freed the old one (a process's live
//! allocations never overlap). CUDA may map an import at its owner's address: then, while
//! the stale mapping stays open, the new allocation cannot be imported
//! (`CUDA_ERROR_ALREADY_MAPPED`, [`already_mapped`]); [`ImportCache::acquire`] retires the
//! overlapping mappings (never served again) and reports [`Acquire::Stale`], and the
//! transport moves that transfer without the import (`ipc_bounce`). When the import succeeds
//! beside them (also seen on the H200), it retires them all the same. Closing a mapping (`cuIpcCloseMemHandle`) can wait
//! for device work, and work of a pending op waits for the proxy, so retired mappings (and
//! those evicted beyond [`IMPORT_CACHE_CAP`]) are closed only by
//! [`ImportCache::close_retired`], which the proxy calls when no op of this communicator is
//! pending and which closes only under [`quiet`]: no hoccl op of the process holds a
//! stream, and none was captured into a graph or failed.
use crate::device::{Allocation, DevPtr, Device, ExportHandle};
use crate::error::{Error, Result};
use crate::transport::Wire;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Bound on cached peer mappings before unused ones are retired.
pub const IMPORT_CACHE_CAP: usize = 1024;

/// `CUDA_ERROR_ALREADY_MAPPED`: the range an import needs is mapped already (on CUDA, by a
/// mapping of an allocation its owner freed; the host backend reports it when asked to
/// emulate CUDA's fixed-address imports, `HOCCL_HOST_FIXED_ADDRESS_IMPORTS`).
pub const CUDA_ERROR_ALREADY_MAPPED: i32 = 208;

/// Whether `e` says that an import's address range is mapped already.
pub fn already_mapped(e: &Error) -> bool {
    matches!(e, Error::Cuda { code, .. } if *code == CUDA_ERROR_ALREADY_MAPPED)
}

// ---------------------------------------------------------------- process-wide quiet ----

/// Held shared by every application thread from before it enqueues an op's stream work
/// until the op is counted in [`BUSY`] (`Communicator::launch_op`), and exclusively by a
/// proxy that closes mappings: a close never starts between a stream's wait being enqueued
/// and its op being counted.
static GATE: RwLock<()> = RwLock::new(());
/// Ops of every communicator of this process submitted and not released: while one is, a
/// stream may wait for a proxy, and a close that waits for device work may wait for it.
static BUSY: AtomicU64 = AtomicU64::new(0);
/// Some op of this process was captured into a graph (a replay may start at any time
/// without a call into hoccl), or failed (its gated and staged queues are let run to their
/// end, which may never come): no mapping is closed before its communicator's end.
static UNSAFE: AtomicBool = AtomicBool::new(false);
/// Transfers moved through a bounce ring, and retired mappings closed (process-wide, for
/// tests and logs).
static BOUNCED: AtomicU64 = AtomicU64::new(0);
static CLOSED: AtomicU64 = AtomicU64::new(0);

/// Taken by an application thread around an op's enqueue and submission.
pub fn enqueue_guard() -> RwLockReadGuard<'static, ()> {
    GATE.read().unwrap_or_else(|e| e.into_inner())
}

/// An op was submitted to a proxy (its stream may wait for it).
pub fn op_submitted() {
    BUSY.fetch_add(1, Ordering::AcqRel);
}

/// An op's stream was released.
pub fn op_released() {
    BUSY.fetch_sub(1, Ordering::AcqRel);
}

/// An op was captured into a graph.
pub fn op_captured() {
    UNSAFE.store(true, Ordering::Release);
}

/// An op failed.
pub fn op_failed() {
    UNSAFE.store(true, Ordering::Release);
}

/// The exclusive gate when no op of the process holds a stream (never blocks: None while
/// an application thread enqueues, or while any op is pending).
pub fn quiet() -> Option<RwLockWriteGuard<'static, ()>> {
    let g = GATE.try_write().ok()?;
    (BUSY.load(Ordering::Acquire) == 0 && !UNSAFE.load(Ordering::Acquire)).then_some(g)
}

/// Transfers moved through a bounce ring so far in this process.
pub fn bounced_transfers() -> u64 {
    BOUNCED.load(Ordering::Relaxed)
}

pub(crate) fn note_bounced() {
    BOUNCED.fetch_add(1, Ordering::Relaxed);
}

/// Retired peer mappings closed so far in this process.
pub fn retired_closed() -> u64 {
    CLOSED.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------- the cache -------------

struct Entry {
    base: DevPtr,
    /// The allocation's address in its owner's process.
    remote_base: u64,
    len: usize,
    refs: usize,
    last_use: u64,
    imported: bool,
}

#[derive(Default)]
pub struct ImportCache {
    entries: HashMap<(usize, u64), Entry>,
    /// Mappings never served again, open until `close_retired` (with their keys: pinned
    /// ones are released by key).
    retired: Vec<((usize, u64), Entry)>,
    clock: u64,
}

/// A pinned mapping; give it back with [`ImportCache::release`].
#[derive(Clone, Copy, Debug)]
pub struct Mapped {
    pub key: (usize, u64),
    pub base: DevPtr,
}

/// What [`ImportCache::acquire`] found.
#[derive(Debug)]
pub enum Acquire {
    Mapped(Mapped),
    /// The import failed because mappings still open overlap the new allocation (of
    /// allocations the peer freed); those of this cache are retired. The failure (what to
    /// report if no other route works) is kept.
    Stale(Error),
}

impl ImportCache {
    /// Map the allocation `m` (from `peer`'s `Ready`) describes; returns its base here, or
    /// [`Acquire::Stale`] when stale mappings of `peer` block the import.
    pub fn acquire(&mut self, dev: &dyn Device, peer: usize, m: &Wire) -> Result<Acquire> {
        self.clock += 1;
        let key = (peer, m.alloc_id);
        if let Some(e) = self.entries.get_mut(&key) {
            // The mapping was made for the length announced first; a later announcement of
            // the same allocation may not claim more.
            if m.alloc_len > e.len as u64 {
                return Err(Error::Remote {
                    op: "same-host transport",
                    peer,
                    what: format!("allocation {} announced as {} bytes, mapped as {}", m.alloc_id, m.alloc_len, e.len),
                });
            }
            e.refs += 1;
            e.last_use = self.clock;
            return Ok(Acquire::Mapped(Mapped { key, base: e.base }));
        }
        self.evict();
        // Ranks in one process share an address space, and CUDA refuses to import a handle
        // into the process that exported it: use the exporter's address directly.
        let (base, imported) = if m.pid == std::process::id() {
            (DevPtr(m.base), false)
        } else {
            let (lo, hi) = (m.base, m.base.saturating_add(m.alloc_len));
            match dev.import(&ExportHandle(m.handle), m.alloc_len as usize) {
                Ok(p) => {
                    // CUDA may map the new allocation beside stale mappings of the peer's
                    // freed ones: they are retired all the same.
                    self.retire_overlapping(peer, lo, hi);
                    (p, true)
                }
                Err(e) => {
                    let near: Vec<String> = self
                        .entries
                        .iter()
                        .chain(self.retired.iter().map(|(k, x)| (k, x)))
                        .filter(|(_, x)| x.remote_base < hi && lo < x.remote_base + x.len as u64)
                        .map(|(k, x)| format!("peer {} id {} at {:#x}+{} (refs {})", k.0, k.1, x.remote_base, x.len, x.refs))
                        .collect();
                    if already_mapped(&e) {
                        // Refused over mappings of the peer's freed allocations; with none
                        // of this cache there, the one in the way is another communicator's
                        // of this process, which only that one closes.
                        self.retire_overlapping(peer, lo, hi);
                        log::debug!("hoccl: rank {peer}'s allocation {} ({lo:#x}+{}) overlaps mappings still open {near:?}: the overlapping ones of this cache are retired, the transfer takes another route", m.alloc_id, m.alloc_len);
                        return Ok(Acquire::Stale(e));
                    }
                    log::warn!("hoccl: mapping rank {peer}'s allocation {} ({lo:#x}+{}) failed: {e}; cached mappings over that range: {near:?}", m.alloc_id, m.alloc_len);
                    return Err(e);
                }
            }
        };
        self.entries.insert(key, Entry { base, remote_base: m.base, len: m.alloc_len as usize, refs: 1, last_use: self.clock, imported });
        Ok(Acquire::Mapped(Mapped { key, base }))
    }

    /// Retire this cache's mappings of `peer` that overlap `[lo, hi)` in the peer's address
    /// space: a process's live allocations never overlap, so a new allocation there proves
    /// the peer freed them.
    fn retire_overlapping(&mut self, peer: usize, lo: u64, hi: u64) {
        let stale: Vec<(usize, u64)> = self
            .entries
            .iter()
            .filter(|(k, x)| k.0 == peer && x.imported && x.remote_base < hi && lo < x.remote_base + x.len as u64)
            .map(|(k, _)| *k)
            .collect();
        for k in stale {
            if let Some(x) = self.entries.remove(&k) {
                log::debug!("hoccl: rank {peer}'s allocation {k:?} ({:#x}+{}) lies under a newer one ({lo:#x}..{hi:#x}): its mapping is retired", x.remote_base, x.len);
                self.retired.push((k, x));
            }
        }
    }

    pub fn release(&mut self, m: &Mapped) {
        if let Some(e) = self.entries.get_mut(&m.key) {
            e.refs = e.refs.saturating_sub(1);
        } else if let Some((_, e)) = self.retired.iter_mut().find(|(k, _)| *k == m.key) {
            e.refs = e.refs.saturating_sub(1);
        }
    }

    /// Retire the least recently used unpinned entries beyond the cap (closed later, by
    /// `close_retired`: this runs while an op is pending).
    fn evict(&mut self) {
        while self.entries.len() >= IMPORT_CACHE_CAP {
            let victim = self.entries.iter().filter(|(_, e)| e.refs == 0).min_by_key(|(_, e)| e.last_use).map(|(k, _)| *k);
            let Some(k) = victim else { return };
            if let Some(e) = self.entries.remove(&k) {
                self.retired.push((k, e));
            }
        }
    }

    /// Mappings retired and not closed yet.
    pub fn retired(&self) -> usize {
        self.retired.len()
    }

    /// Close the retired mappings no copy uses, if the process is [`quiet`]. The caller
    /// (the proxy) has no op pending and no data in flight. Returns how many it closed.
    pub fn close_retired(&mut self, dev: &dyn Device) -> usize {
        if !self.retired.iter().any(|(_, e)| e.refs == 0) {
            return 0;
        }
        let Some(_quiet) = quiet() else { return 0 };
        let mut n = 0;
        let mut i = 0;
        while i < self.retired.len() {
            if self.retired[i].1.refs > 0 {
                i += 1;
                continue;
            }
            let (_, e) = self.retired.swap_remove(i);
            Self::close(dev, &e);
            n += 1;
        }
        CLOSED.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    fn close(dev: &dyn Device, e: &Entry) {
        if e.imported {
            if let Err(err) = dev.unimport(e.base, e.len) {
                log::warn!("closing a peer mapping: {err}");
            }
        }
    }

    /// Close every mapping (proxy shutdown).
    pub fn clear(&mut self, dev: &dyn Device) {
        for (_, e) in self.entries.drain().chain(self.retired.drain(..)) {
            Self::close(dev, &e);
        }
    }
}

/// Export handles of this rank's allocations, cached by allocation id.
#[derive(Default)]
pub struct ExportCache {
    handles: HashMap<u64, ExportHandle>,
}

impl ExportCache {
    pub fn get(&mut self, dev: &dyn Device, a: &Allocation) -> Result<ExportHandle> {
        if let Some(h) = self.handles.get(&a.id) {
            return Ok(*h);
        }
        if self.handles.len() >= IMPORT_CACHE_CAP {
            self.handles.clear();
        }
        let h = dev.export(a)?;
        self.handles.insert(a.id, h);
        Ok(h)
    }
}
