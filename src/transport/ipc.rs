//! Peer allocations of the same-host transport: the receiver exports the allocation that
//! holds its buffer, the sender maps it once and copies straight into it.
//!
//! Mappings are cached per (peer rank, allocation id). Allocation ids change when memory is
//! freed and reallocated, so a reused address is never served a stale mapping. But CUDA maps
//! an import at its owner's address: while a mapping of a freed allocation stays cached, a
//! new allocation of that peer overlapping it cannot be imported (`CUDA_ERROR_ALREADY_MAPPED`,
//! the op fails; docs/design.md, "Current limits"). Entries in use by in-flight copies are
//! pinned (`refs > 0`) and never evicted.
use crate::device::{Allocation, DevPtr, Device, ExportHandle};
use crate::error::Result;
use crate::transport::Wire;
use std::collections::HashMap;

/// Bound on cached peer mappings before unused ones are closed.
pub const IMPORT_CACHE_CAP: usize = 1024;

struct Entry {
    base: DevPtr,
    len: usize,
    refs: usize,
    last_use: u64,
    imported: bool,
}

#[derive(Default)]
pub struct ImportCache {
    entries: HashMap<(usize, u64), Entry>,
    clock: u64,
}

/// A pinned mapping; give it back with [`ImportCache::release`].
#[derive(Clone, Copy, Debug)]
pub struct Mapped {
    pub key: (usize, u64),
    pub base: DevPtr,
}

impl ImportCache {
    /// Map the allocation `m` (from `peer`'s `Ready`) describes; returns its base here.
    pub fn acquire(&mut self, dev: &dyn Device, peer: usize, m: &Wire) -> Result<Mapped> {
        self.clock += 1;
        let key = (peer, m.alloc_id);
        if let Some(e) = self.entries.get_mut(&key) {
            // The mapping was made for the length announced first; a later announcement of
            // the same allocation may not claim more.
            if m.alloc_len > e.len as u64 {
                return Err(crate::error::Error::Remote {
                    op: "same-host transport",
                    peer,
                    what: format!("allocation {} announced as {} bytes, mapped as {}", m.alloc_id, m.alloc_len, e.len),
                });
            }
            e.refs += 1;
            e.last_use = self.clock;
            return Ok(Mapped { key, base: e.base });
        }
        self.evict(dev);
        // Ranks in one process share an address space, and CUDA refuses to import a handle
        // into the process that exported it: use the exporter's address directly.
        let (base, imported) = if m.pid == std::process::id() {
            (DevPtr(m.base), false)
        } else {
            // CUDA maps an import at its owner's address, so a cached mapping of an allocation
            // the peer has freed (this cache cannot know) that overlaps a new allocation of it
            // makes this import fail with CUDA_ERROR_ALREADY_MAPPED. Closing it here is not
            // safe: the close can wait for device work that waits for this proxy. The failure
            // is reported with the overlapping mappings.
            let (lo, hi) = (m.base, m.base.saturating_add(m.alloc_len));
            let p = dev.import(&ExportHandle(m.handle), m.alloc_len as usize).inspect_err(|e| {
                let near: Vec<String> = self
                    .entries
                    .iter()
                    .filter(|(_, x)| x.base.0 < hi && lo < x.base.0 + x.len as u64)
                    .map(|(k, x)| format!("peer {} id {} at {:#x}+{} (refs {})", k.0, k.1, x.base.0, x.len, x.refs))
                    .collect();
                log::warn!("hoccl: mapping rank {peer}'s allocation {} ({:#x}+{}) failed: {e}; cached mappings over that range: {near:?}", m.alloc_id, m.base, m.alloc_len);
            })?;
            (p, true)
        };
        self.entries.insert(key, Entry { base, len: m.alloc_len as usize, refs: 1, last_use: self.clock, imported });
        Ok(Mapped { key, base })
    }

    pub fn release(&mut self, m: &Mapped) {
        if let Some(e) = self.entries.get_mut(&m.key) {
            e.refs = e.refs.saturating_sub(1);
        }
    }

    fn evict(&mut self, dev: &dyn Device) {
        while self.entries.len() >= IMPORT_CACHE_CAP {
            let victim = self.entries.iter().filter(|(_, e)| e.refs == 0).min_by_key(|(_, e)| e.last_use).map(|(k, _)| *k);
            let Some(k) = victim else { return };
            if let Some(e) = self.entries.remove(&k) {
                Self::close(dev, &e);
            }
        }
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
        for (_, e) in self.entries.drain() {
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
