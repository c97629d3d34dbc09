//! The route of a same-host transfer whose receive allocation the sender cannot import:
//! a bounce ring in host memory that both processes map.
//!
//! CUDA maps an import at its owner's address, so a cached mapping of an allocation the
//! receiver freed blocks the import of a new allocation of it at an overlapping address
//! (`ipc`, [`crate::transport::ipc::Acquire::Stale`]); the stale mapping cannot be closed
//! while the op is pending. Such a transfer is moved without any import: the sender owns,
//! per receiver, a POSIX shared-memory segment of [`BOUNCE_SLOTS`] slots of
//! [`BOUNCE_SLOT`] bytes, registered for its device (`Device::map_host`); the receiver maps
//! the same segment by name at the first chunk, registers it for its own device and unlinks
//! the name. Host memory registered this way lies outside the device's address ranges, so
//! it never meets a stale mapping. Per chunk (one copy each, on the transport's copy
//! queues):
//!
//! ```text
//!   sender:    free slot → copy src+off into it → on completion: Ready(BOUNCE) {k, off, len, slot}
//!   receiver:  copy slot out to dst+off → on completion: Landed(FREED) {slot}; last byte → Landed to its engine
//!   sender:    slot free again; every byte freed → the flow is done
//! ```
//!
//! The receiver knows each handshake receive's buffer from its own `Ready` (`expect`), so
//! no message names an address in the other process. A chunk is two copies over the host
//! link and two control records, so this route is slower than a direct copy; it serves only
//! transfers that hit a stale mapping, and the proxy closes the stale mappings once it has
//! no op pending (`ImportCache::close_retired`). Both sides free every slot they were told
//! of, cancelled ops included, so a ring stays consistent after a failed op.
use crate::device::{DevPtr, Device};
use crate::error::{Error, Result};
use crate::transport::chunk_scheduler::ChunkScheduler;
use crate::transport::mailbox::{Msg, MsgKind};
use crate::transport::{FlowId, Incoming, Signal, Tag};
use std::collections::{HashMap, VecDeque};
use std::ffi::CString;

/// Slots of a bounce ring.
pub const BOUNCE_SLOTS: usize = 4;
/// Bytes of a slot (a chunk; one copy on a copy queue).
pub const BOUNCE_SLOT: usize = 2 << 20;
/// `Msg::code` of a `Ready` record carrying a bounce chunk (sender to receiver); beside
/// `mailbox::READY_GATED` and `READY_STAGED`.
pub const READY_BOUNCE: u32 = 8;
/// `Msg::code` of a `Landed` record freeing a bounce slot (receiver to sender).
pub const LANDED_FREED: u32 = 8;
/// Flow indices of chunk copies in the chunk scheduler (above any send index).
const CHUNK_FLOW: usize = 1 << 62;

/// A shared host segment mapped here and registered for the device.
struct Ring {
    name: String,
    host: *mut u8,
    len: usize,
    dev: DevPtr,
    owner: bool,
}

// SAFETY: the mapping is plain shared memory that only copy queues read and write; the
// pointer is used by the thread that owns the value (the proxy) to unmap it.
unsafe impl Send for Ring {}

impl Ring {
    fn bytes() -> usize {
        BOUNCE_SLOTS * BOUNCE_SLOT
    }

    /// A new owner-only segment, unguessably named.
    fn create(dev: &dyn Device) -> Result<Ring> {
        const OP: &str = "ipc_bounce::create";
        let mut key = [0u8; 8];
        crate::bootstrap::tcp::fill_random(&mut key).map_err(|e| e.with_op(OP))?;
        let name = format!("/hoccl.{}.bnc.{:016x}", std::process::id(), u64::from_le_bytes(key));
        Self::map(dev, &name, true)
    }

    fn open(dev: &dyn Device, name: &str) -> Result<Ring> {
        let r = Self::map(dev, name, false)?;
        // Both processes map it now: the name is not needed any more.
        unlink(name);
        Ok(r)
    }

    fn map(dev: &dyn Device, name: &str, create: bool) -> Result<Ring> {
        const OP: &str = "ipc_bounce::map";
        let len = Self::bytes();
        let c = CString::new(name).map_err(|_| Error::invalid_arg(OP, "name has a NUL"))?;
        let flags = if create { libc::O_CREAT | libc::O_EXCL | libc::O_RDWR } else { libc::O_RDWR };
        // SAFETY: valid C string.
        let fd = unsafe { libc::shm_open(c.as_ptr(), flags, 0o600) };
        if fd < 0 {
            return Err(Error::last_os(OP, "shm_open"));
        }
        let sized = if create {
            // SAFETY: fd is ours.
            (unsafe { libc::ftruncate(fd, len as libc::off_t) } == 0).then_some(()).ok_or_else(|| Error::last_os(OP, "ftruncate"))
        } else {
            // Mapping past the object's end would fault on access: refuse a short one.
            // SAFETY: st is plain data filled by fstat on our fd.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: fd is open; st is writable.
            if unsafe { libc::fstat(fd, &mut st) } != 0 {
                Err(Error::last_os(OP, "fstat"))
            } else if (st.st_size as u64) < len as u64 {
                Err(Error::invalid_arg(OP, format!("{name} holds {} bytes, a bounce ring {len}", st.st_size)))
            } else {
                Ok(())
            }
        };
        let p = sized.and_then(|()| {
            // SAFETY: a new shared mapping of an fd we own.
            let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
            if p == libc::MAP_FAILED {
                Err(Error::last_os(OP, "mmap"))
            } else {
                Ok(p as *mut u8)
            }
        });
        // SAFETY: fd is ours; a mapping survives its close.
        unsafe { libc::close(fd) };
        let p = p.inspect_err(|_| {
            if create {
                unlink(name);
            }
        })?;
        let mut ring = Ring { name: name.to_string(), host: p, len, dev: DevPtr(0), owner: create };
        match dev.map_host(p, len) {
            Ok(d) => ring.dev = d,
            Err(e) => {
                ring.unmap();
                return Err(e);
            }
        }
        Ok(ring)
    }

    fn slot(&self, i: usize) -> DevPtr {
        self.dev.add(i * BOUNCE_SLOT)
    }

    fn handle(&self) -> [u8; 64] {
        let mut h = [0u8; 64];
        h[..self.name.len()].copy_from_slice(self.name.as_bytes());
        h
    }

    /// Unregister and unmap (no copy may use it any more).
    fn release(mut self, dev: &dyn Device) {
        if self.dev.0 != 0 {
            if let Err(e) = dev.unmap_host(self.host) {
                log::warn!("hoccl: unregistering bounce ring {}: {e}", self.name);
            }
        }
        self.unmap();
    }

    fn unmap(&mut self) {
        if !self.host.is_null() {
            // SAFETY: our own mapping of `len` bytes, unmapped once.
            unsafe { libc::munmap(self.host as *mut libc::c_void, self.len) };
            self.host = std::ptr::null_mut();
        }
        if self.owner {
            unlink(&self.name);
        }
    }
}

fn unlink(name: &str) {
    if let Ok(c) = CString::new(name) {
        // SAFETY: valid C string; a name already unlinked is harmless.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

/// A bounce ring's name as a record carries it (NUL-padded), checked before use.
fn name_of(h: &[u8; 64]) -> std::result::Result<String, String> {
    let end = h.iter().position(|b| *b == 0).unwrap_or(64);
    let name = std::str::from_utf8(&h[..end]).map_err(|_| "bounce ring name is not UTF-8".to_string())?;
    if !name.starts_with("/hoccl.") || !name.contains(".bnc.") || name[1..].contains('/') {
        return Err(format!("{name:?} is not a bounce ring name"));
    }
    Ok(name.to_string())
}

/// A transfer bounced to one receiver.
struct OutXfer {
    id: FlowId,
    tag: Tag,
    src: DevPtr,
    len: usize,
    issued: usize,
    freed: usize,
    cancelled: bool,
}

/// The sender's ring to one receiver.
struct Out {
    ring: Ring,
    free: Vec<usize>,
    xfers: VecDeque<OutXfer>,
}

/// A handshake receive of this rank, as its `Ready` described it.
struct Dest {
    seq: u64,
    dst: DevPtr,
    /// The buffer's length (what the receive takes at most).
    len: u64,
    /// The length the sender moves (its first chunk says; a receive of `Fill::UpTo` may get
    /// less than `len`, and the engine checks it against the receive's rule).
    total: Option<u64>,
    got: u64,
}

/// A chunk copy in the chunk scheduler.
struct Chunk {
    peer: usize,
    /// Sender side (into the ring) or receiver side (out of it).
    out: bool,
    slot: usize,
    pair_seq: u64,
    k: u32,
    off: u64,
    len: usize,
    /// Receiver side: the bytes go to a live receive (false: a cancelled one).
    live: bool,
}

#[derive(Default)]
pub struct Bounce {
    /// By receiver.
    out: HashMap<usize, Out>,
    /// By sender: its ring, mapped here.
    rings_in: HashMap<usize, Ring>,
    /// (sender, pair seq, k) of every pending handshake receive.
    dests: HashMap<(usize, u64, u32), Dest>,
    chunks: HashMap<usize, Chunk>,
    next_chunk: usize,
    /// Sender flows whose every byte was copied out by the receiver.
    done: Vec<FlowId>,
    /// Receiver: landings to report to the engine.
    landed: Vec<Incoming>,
    /// Records to post: (peer, record).
    pub outbox: Vec<(usize, Msg)>,
}

impl Bounce {
    /// Receiver: the handshake receive `tag` from `peer` of op `seq` lands at `dst`.
    pub fn expect(&mut self, peer: usize, tag: Tag, seq: u64, dst: DevPtr, len: u64) {
        self.dests.insert((peer, tag.pair_seq, tag.k), Dest { seq, dst, len, total: None, got: 0 });
    }

    /// Receiver: `peer` reported the receive landed (a direct copy), or failed op `pair_seq`.
    pub fn forget(&mut self, peer: usize, pair_seq: u64, k: Option<u32>) {
        match k {
            Some(k) => {
                self.dests.remove(&(peer, pair_seq, k));
            }
            None => self.dests.retain(|key, _| !(key.0 == peer && key.1 == pair_seq)),
        }
    }

    /// Sender: move `len` bytes from `src` for flow `id` (transfer `tag` to `peer`) through
    /// the ring to `peer` (made at its first use).
    pub fn start(&mut self, dev: &dyn Device, id: FlowId, peer: usize, tag: Tag, src: DevPtr, len: usize) -> Result<()> {
        if !self.out.contains_key(&peer) {
            let ring = Ring::create(dev)?;
            log::info!("hoccl: bounce ring {} to rank {peer} ({BOUNCE_SLOTS} x {BOUNCE_SLOT} B of host memory)", ring.name);
            self.out.insert(peer, Out { ring, free: (0..BOUNCE_SLOTS).rev().collect(), xfers: VecDeque::new() });
        }
        let o = self.out.get_mut(&peer).expect("made above");
        o.xfers.push_back(OutXfer { id, tag, src, len, issued: 0, freed: 0, cancelled: false });
        crate::transport::ipc::note_bounced();
        Ok(())
    }

    /// Sender: hand the scheduler a chunk for every free slot (transfers in order per
    /// receiver); whether any was.
    pub fn pump(&mut self, sched: &mut ChunkScheduler) -> bool {
        let mut any = false;
        for (&peer, o) in self.out.iter_mut() {
            for x in o.xfers.iter_mut().filter(|x| !x.cancelled) {
                while x.issued < x.len {
                    let Some(slot) = o.free.pop() else { break };
                    let n = BOUNCE_SLOT.min(x.len - x.issued);
                    let idx = CHUNK_FLOW | self.next_chunk;
                    self.next_chunk = (self.next_chunk + 1) % CHUNK_FLOW;
                    sched.add(FlowId { seq: x.id.seq, idx }, x.src.add(x.issued), o.ring.slot(slot), n);
                    self.chunks.insert(idx, Chunk { peer, out: true, slot, pair_seq: x.tag.pair_seq, k: x.tag.k, off: x.issued as u64, len: n, live: true });
                    x.issued += n;
                    any = true;
                }
                if o.free.is_empty() {
                    break;
                }
            }
        }
        any
    }

    /// Whether flow `id` of the scheduler is a chunk copy of this route.
    pub fn owns(&self, id: &FlowId) -> bool {
        id.idx & CHUNK_FLOW != 0 && self.chunks.contains_key(&id.idx)
    }

    /// A chunk copy completed (or was cancelled before it ran): tell the other side.
    pub fn chunk_done(&mut self, id: &FlowId) {
        let Some(c) = self.chunks.remove(&id.idx) else { return };
        if c.out {
            let Some(o) = self.out.get(&c.peer) else { return };
            let mut m = Msg::new(MsgKind::Ready, c.pair_seq, c.k);
            (m.code, m.offset, m.len, m.base, m.pid, m.handle) = (READY_BOUNCE, c.off, c.len as u64, c.slot as u64, std::process::id(), o.ring.handle());
            if let Some(x) = o.xfers.iter().find(|x| x.tag.pair_seq == c.pair_seq && x.tag.k == c.k) {
                m.alloc_len = x.len as u64;
            }
            self.outbox.push((c.peer, m));
            return;
        }
        let mut m = Msg::new(MsgKind::Landed, c.pair_seq, c.k);
        (m.code, m.offset, m.len, m.base) = (LANDED_FREED, c.off, c.len as u64, c.slot as u64);
        self.outbox.push((c.peer, m));
        if !c.live {
            return;
        }
        let key = (c.peer, c.pair_seq, c.k);
        if let Some(d) = self.dests.get_mut(&key) {
            d.got += c.len as u64;
            if Some(d.got) == d.total {
                let len = d.got;
                self.dests.remove(&key);
                self.landed.push(Incoming { from: c.peer, pair_seq: c.pair_seq, signal: Signal::Landed { k: c.k, len } });
            }
        }
    }

    /// Whether `m` (from `from`) is a record of this route.
    pub fn is_ours(m: &Msg) -> bool {
        (m.kind == MsgKind::Ready as u32 && m.code == READY_BOUNCE) || (m.kind == MsgKind::Landed as u32 && m.code == LANDED_FREED)
    }

    /// Take a record of this route from `from`; an error says why it is malformed.
    pub fn take(&mut self, dev: &dyn Device, sched: &mut ChunkScheduler, from: usize, m: &Msg) -> std::result::Result<(), String> {
        let (slot, len) = (m.base, m.len);
        if slot >= BOUNCE_SLOTS as u64 || len == 0 || len > BOUNCE_SLOT as u64 {
            return Err(format!("bounce record for op {} names slot {slot} with {len} bytes", m.seq));
        }
        let slot = slot as usize;
        if m.kind == MsgKind::Landed as u32 {
            // Sender: the receiver copied the slot out.
            let Some(o) = self.out.get_mut(&from) else { return Err("it freed a bounce slot it was never sent".into()) };
            if o.free.contains(&slot) {
                return Err(format!("it freed bounce slot {slot}, which is free"));
            }
            o.free.push(slot);
            if let Some(i) = o.xfers.iter().position(|x| x.tag.pair_seq == m.seq && x.tag.k == m.k) {
                let x = &mut o.xfers[i];
                x.freed += len as usize;
                if x.freed >= x.issued && (x.cancelled || x.freed == x.len) {
                    if !x.cancelled {
                        self.done.push(x.id);
                    }
                    o.xfers.remove(i);
                }
            }
            return Ok(());
        }
        // Receiver: a chunk waits in the slot.
        let name = name_of(&m.handle)?;
        if self.rings_in.get(&from).is_none_or(|r| r.name != name) {
            let ring = Ring::open(dev, &name).map_err(|e| format!("its bounce ring {name} cannot be mapped: {e}"))?;
            if let Some(old) = self.rings_in.insert(from, ring) {
                old.release(dev);
            }
        }
        let src = self.rings_in.get(&from).map_or(DevPtr(0), |r| r.slot(slot));
        let key = (from, m.seq, m.k);
        let idx = CHUNK_FLOW | self.next_chunk;
        self.next_chunk = (self.next_chunk + 1) % CHUNK_FLOW;
        let mut c = Chunk { peer: from, out: false, slot, pair_seq: m.seq, k: m.k, off: m.offset, len: len as usize, live: false };
        let Some(d) = self.dests.get_mut(&key) else {
            // The receive failed here: free the slot without a copy.
            self.chunks.insert(idx, c);
            self.chunk_done(&FlowId { seq: 0, idx });
            return Ok(());
        };
        let total = *d.total.get_or_insert(m.alloc_len);
        match m.offset.checked_add(len) {
            Some(end) if end <= total && total == m.alloc_len && total <= d.len => {}
            _ => return Err(format!("bounce chunk of {len} bytes at {} of a {}-byte transfer (first announced as {total}; this receive takes {})", m.offset, m.alloc_len, d.len)),
        }
        c.live = true;
        sched.add(FlowId { seq: d.seq, idx }, src, d.dst.add(m.offset as usize), len as usize);
        self.chunks.insert(idx, c);
        Ok(())
    }

    /// Sender flows completed since the last call.
    pub fn take_done(&mut self, done: &mut Vec<FlowId>, advanced: &mut Vec<u64>) -> bool {
        let any = !self.done.is_empty();
        for id in self.done.drain(..) {
            advanced.push(id.seq);
            done.push(id);
        }
        any
    }

    /// Receiver: landings for the engine.
    pub fn take_landed(&mut self, out: &mut Vec<Incoming>) -> bool {
        let any = !self.landed.is_empty();
        out.append(&mut self.landed);
        any
    }

    /// Op `seq` failed: its transfers issue no more chunks and its receives take none.
    pub fn cancel(&mut self, seq: u64) {
        for o in self.out.values_mut() {
            for x in o.xfers.iter_mut().filter(|x| x.id.seq == seq) {
                x.cancelled = true;
            }
            o.xfers.retain(|x| !(x.cancelled && x.freed >= x.issued));
        }
        self.dests.retain(|_, d| d.seq != seq);
        for c in self.chunks.values_mut().filter(|c| !c.out) {
            if self.dests.get(&(c.peer, c.pair_seq, c.k)).is_none() {
                c.live = false;
            }
        }
    }

    pub fn describe(&self) -> String {
        let out: Vec<String> = self.out.iter().map(|(p, o)| format!("to {p}: {} transfers, {} slots free", o.xfers.len(), o.free.len())).collect();
        format!("bounce [{}] {} chunks in flight", out.join(", "), self.chunks.len())
    }

    /// Unmap every ring (no chunk copy may still run).
    pub fn close(&mut self, dev: &dyn Device) {
        for (_, o) in self.out.drain() {
            o.ring.release(dev);
        }
        for (_, r) in self.rings_in.drain() {
            r.release(dev);
        }
    }
}
