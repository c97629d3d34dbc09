//! Shared-memory mailboxes between the proxies of one host.
//!
//! Every rank owns one segment `/hoccl.<pid>.ctl.<comm>.<rank>` holding one single-producer
//! single-consumer ring per local sender. A sender writes into ring `sender_local` of the
//! receiver's segment; only the receiver reads it. Messages are fixed 128-byte records.
//! A full ring is never waited on: the sender keeps the message and retries (so two proxies
//! can never deadlock on each other's full rings).
//!
//! After the rings, page-aligned, the segment holds the **flag area** of the gated path
//! (`same_host`): per local sender `l`, `ready[l]` and `landed[l]`, 64-bit words a cache
//! line apart. `ready[l]` is written by the owner's proxy (the receiver), `landed[l]` by
//! sender `l`'s gated copy queue; both only grow. Two more words per sender serve the
//! staged path (`staged`): `staged[l]`, the last chunk sender `l`'s staged queue copied into
//! the owner's receive ring for it, and `drained[l]`, the last chunk the owner's streams
//! copied out of that ring. Every process registers its peers' flag
//! areas for its device ([`crate::device::Device::map_host`]) and says so in its header
//! ([`Segment::set_gated`]), so two ranks decide alike whether they use it.
//!
//! The segment is owner-only (0600), named from the communicator's random id, and unlinked
//! once every local rank has mapped it. Everything in it is written by other processes:
//! rings are located from this mapping's own ring count, counters wrap, and records are
//! checked before use (`same_host`).
use crate::error::{Error, Result};
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};

/// Slots per ring (power of two).
pub const RING_SLOTS: usize = 512;
const MAGIC: u64 = 0x484f_4343_4c43_544c; // "HOCCLCTL"

#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MsgKind {
    /// Receiver → sender: my buffer for your k-th send of op `seq` is ready.
    Ready = 1,
    /// Sender → receiver: all bytes of my k-th send of op `seq` have landed.
    Landed = 2,
    /// Either way: op `seq` failed on my side (`code` = ErrorCode, `len` = my byte count).
    Fail = 3,
    /// Sender → receiver: chunks of my k-th send of op `seq` keep landing (at most one per
    /// `same_host::PROGRESS_EVERY` per transfer; it keeps the receiver's op from timing out).
    Progress = 4,
    /// Sender → its forwarding peer (`relay`): carry my send `k` of op `seq` with a rank
    /// of another node (`code`) to its buffer (`len` bytes; the far transport's description
    /// in the region fields). Followed at once by a `RelaySrc` record.
    RelayDst = 5,
    /// Sender → its forwarding peer: the bytes of the send announced just before (`len`
    /// of them, the region fields describing them as in a `Ready`), relay `seq`.
    RelaySrc = 6,
    /// Forwarding peer → sender: every byte of relay `seq` has landed at the receiver.
    RelayDone = 7,
    /// Forwarding peer → sender: relay `seq` failed (`code` = ErrorCode).
    RelayFail = 8,
    /// Sender → forwarding peer: relay `seq` is cancelled (its op failed).
    RelayCancel = 9,
    /// Forwarding peer → sender: bytes of relay `seq` keep leaving (at most one per
    /// `same_host::PROGRESS_EVERY`).
    RelayProgress = 10,
    /// Forwarding peer → sender: relay `seq` cannot be carried (the sender's allocation
    /// cannot be mapped here now): the sender sends it itself.
    RelayRefused = 11,
    /// Receiver → its forwarding peer (`relay`): land my receive (relay `seq`, `len` bytes)
    /// of a send of rank `code` of another node. Followed at once by a `RecvBuf` record.
    RecvDst = 12,
    /// Receiver → its forwarding peer: that receive's transfer (`k` of op `seq` with the
    /// sender) and its buffer (the region fields, as in a `Ready`).
    RecvBuf = 13,
    /// Forwarding peer → receiver: relay `seq` is open there as receive `alloc_id` (its
    /// token with the sender).
    RecvExposed = 14,
    /// Forwarding peer → receiver: all `len` bytes of relay `seq` are in the buffer.
    RecvLanded = 15,
    /// Forwarding peer → receiver: bytes of relay `seq` keep landing.
    RecvProgress = 16,
    /// Receiver → forwarding peer: relay `seq` is cancelled (its op failed).
    RecvCancel = 17,
    /// Forwarding peer → receiver: relay `seq` cannot be landed there now (the buffer's
    /// allocation cannot be mapped): the receiver takes the bytes itself.
    RecvRefused = 18,
    /// Forwarding peer → receiver: relay `seq` failed there (`code` = ErrorCode).
    RecvFail = 19,
}

/// `Msg::code` of a `Ready` record announcing a gated transfer (`same_host`).
pub const READY_GATED: u32 = 1;
/// `Msg::code` of a `Ready` that announces a staged receive or send (its length only): this
/// plus `Wire::staged` minus one (2: a receive, 3: a send).
pub const READY_STAGED: u32 = 2;

/// One control record. `repr(C)`, exactly 128 bytes, plain data.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Msg {
    pub kind: u32,
    /// (`seq` is the pair sequence number: the count of ops between the two ranks.)
    /// Index of this transfer among the op's transfers between the same two ranks.
    pub k: u32,
    pub seq: u64,
    pub len: u64,
    /// Offset of the receive region inside its allocation.
    pub offset: u64,
    pub alloc_len: u64,
    pub alloc_id: u64,
    /// The allocation's base in the receiver's address space (used when both ranks share
    /// one process, where importing would fail).
    pub base: u64,
    pub pid: u32,
    pub code: u32,
    pub handle: [u8; 64],
}

const _: () = assert!(std::mem::size_of::<Msg>() == 128);

impl Msg {
    pub fn new(kind: MsgKind, seq: u64, k: u32) -> Msg {
        Msg {
            kind: kind as u32,
            k,
            seq,
            len: 0,
            offset: 0,
            alloc_len: 0,
            alloc_id: 0,
            base: 0,
            pid: std::process::id(),
            code: 0,
            handle: [0; 64],
        }
    }
    pub fn kind(&self) -> Option<MsgKind> {
        match self.kind {
            1 => Some(MsgKind::Ready),
            2 => Some(MsgKind::Landed),
            3 => Some(MsgKind::Fail),
            4 => Some(MsgKind::Progress),
            5 => Some(MsgKind::RelayDst),
            6 => Some(MsgKind::RelaySrc),
            7 => Some(MsgKind::RelayDone),
            8 => Some(MsgKind::RelayFail),
            9 => Some(MsgKind::RelayCancel),
            10 => Some(MsgKind::RelayProgress),
            11 => Some(MsgKind::RelayRefused),
            12 => Some(MsgKind::RecvDst),
            13 => Some(MsgKind::RecvBuf),
            14 => Some(MsgKind::RecvExposed),
            15 => Some(MsgKind::RecvLanded),
            16 => Some(MsgKind::RecvProgress),
            17 => Some(MsgKind::RecvCancel),
            18 => Some(MsgKind::RecvRefused),
            19 => Some(MsgKind::RecvFail),
            _ => None,
        }
    }
}

#[repr(C, align(64))]
struct Counter(AtomicU64);

#[repr(C)]
struct RingHeader {
    head: Counter,
    tail: Counter,
}

#[repr(C, align(64))]
struct SegHeader {
    magic: AtomicU64,
    pid: AtomicU64,
    nrings: AtomicU64,
    /// Set to 1 by the owner when it aborts or is destroyed.
    closed: AtomicU64,
    /// Set to 1 by the owner once its device reaches every peer's flag area (before the
    /// communicator's creation returns on any rank: a barrier follows the engine's start).
    gated: AtomicU64,
}

fn ring_bytes() -> usize {
    std::mem::size_of::<RingHeader>() + RING_SLOTS * 128
}

const PAGE: usize = 4096;
/// Bytes between one sender's `ready` and `landed` words, and between two senders' pairs.
const FLAG_STRIDE: usize = 64;

/// Where the flag area starts: after the rings, on a page boundary (registration pins
/// whole pages; the rings' pages stay out of it).
fn flags_offset(nrings: usize) -> usize {
    (std::mem::size_of::<SegHeader>() + nrings * ring_bytes()).div_ceil(PAGE) * PAGE
}

/// Flag words per sender: ready, landed, staged, drained.
const WORDS: usize = 4;

/// The flag area's length: four words per sender, a cache line each, in whole pages.
fn flags_bytes(nrings: usize) -> usize {
    (nrings * WORDS * FLAG_STRIDE).div_ceil(PAGE).max(1) * PAGE
}

fn seg_bytes(nrings: usize) -> usize {
    flags_offset(nrings) + flags_bytes(nrings)
}

/// A mapped segment (own or a peer's).
pub struct Segment {
    base: *mut u8,
    len: usize,
    /// The ring count this mapping was sized for. Rings are located from it, never from the
    /// header's copy, which a peer can overwrite.
    nrings: usize,
    name: String,
    /// Whether dropping this unlinks the name (the owner's mapping, until `unlink`).
    owner: bool,
}

// SAFETY: the mapping is shared memory accessed only through atomics and whole-record copies
// guarded by the ring protocol; the pointer itself may move between threads.
unsafe impl Send for Segment {}

impl Segment {
    /// The mailbox name of `rank` (living in process `pid`) in communicator `comm_id`.
    pub fn name(pid: u32, comm_id: u64, rank: usize) -> String {
        format!("/hoccl.{pid}.ctl.{comm_id:016x}.{rank}")
    }

    /// Create this rank's segment with `nrings` rings (one per local sender).
    pub fn create(name: &str, nrings: usize) -> Result<Segment> {
        let seg = Self::map(name, nrings, true)?;
        let h = seg.header();
        h.pid.store(std::process::id() as u64, Ordering::Relaxed);
        h.nrings.store(nrings as u64, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Open a peer's segment by name, checking that it is one.
    pub fn open(name: &str, nrings: usize) -> Result<Segment> {
        let seg = Self::map(name, nrings, false)?;
        let h = seg.header();
        if h.magic.load(Ordering::Acquire) != MAGIC || h.nrings.load(Ordering::Relaxed) != nrings as u64 {
            return Err(Error::internal("mailbox::open", format!("{name} is not a hoccl mailbox of {nrings} rings")));
        }
        Ok(seg)
    }

    fn map(name: &str, nrings: usize, create: bool) -> Result<Segment> {
        const OP: &str = "mailbox::map";
        let len = seg_bytes(nrings);
        let c = CString::new(name).map_err(|_| Error::invalid_arg(OP, "name has a NUL"))?;
        let flags = if create { libc::O_CREAT | libc::O_EXCL | libc::O_RDWR } else { libc::O_RDWR };
        // SAFETY: valid C string.
        let fd = unsafe { libc::shm_open(c.as_ptr(), flags, 0o600) };
        if fd < 0 {
            return Err(Error::last_os(OP, "shm_open"));
        }
        // SAFETY: fd is ours.
        if create && unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            let e = Error::last_os(OP, "ftruncate");
            // SAFETY: fd is ours; name was created by us.
            unsafe {
                libc::close(fd);
                libc::shm_unlink(c.as_ptr());
            }
            return Err(e);
        }
        // SAFETY: new shared mapping of an fd we own.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
        // SAFETY: fd is ours; the mapping survives close.
        unsafe { libc::close(fd) };
        if p == libc::MAP_FAILED {
            let e = Error::last_os(OP, "mmap");
            if create {
                // SAFETY: valid C string.
                unsafe { libc::shm_unlink(c.as_ptr()) };
            }
            return Err(e);
        }
        Ok(Segment { base: p as *mut u8, len, nrings, name: name.to_string(), owner: create })
    }

    fn header(&self) -> &SegHeader {
        // SAFETY: the mapping is at least one header long, page aligned, zero-initialised by
        // ftruncate; fields are atomics.
        unsafe { &*(self.base as *const SegHeader) }
    }

    fn ring(&self, i: usize) -> (&RingHeader, *mut Msg) {
        // `i` is a local index the caller derived from the topology, never from a record.
        assert!(i < self.nrings, "ring {i} out of {}", self.nrings);
        let off = std::mem::size_of::<SegHeader>() + i * ring_bytes();
        // SAFETY: off + ring_bytes() <= len by construction of seg_bytes; 64-aligned.
        unsafe {
            let h = &*(self.base.add(off) as *const RingHeader);
            (h, self.base.add(off + std::mem::size_of::<RingHeader>()) as *mut Msg)
        }
    }

    /// Producer side: append to ring `i`; `false` if it is full (retry later).
    pub fn try_push(&self, i: usize, m: &Msg) -> bool {
        let (h, slots) = self.ring(i);
        let head = h.head.0.load(Ordering::Relaxed);
        let tail = h.tail.0.load(Ordering::Acquire);
        // Wrapping: counters a peer corrupted (tail past head) read as a full ring, so the
        // message waits and the op times out, instead of an overflow.
        if head.wrapping_sub(tail) >= RING_SLOTS as u64 {
            return false;
        }
        // SAFETY: slot index < RING_SLOTS; the consumer does not read it until head moves.
        unsafe { std::ptr::write_volatile(slots.add(head as usize % RING_SLOTS), *m) };
        h.head.0.store(head.wrapping_add(1), Ordering::Release);
        true
    }

    /// Consumer side: take the next message of ring `i`.
    pub fn try_pop(&self, i: usize) -> Option<Msg> {
        let (h, slots) = self.ring(i);
        let tail = h.tail.0.load(Ordering::Relaxed);
        if h.head.0.load(Ordering::Acquire) == tail {
            return None;
        }
        // SAFETY: the producer published this slot with the Release store of head.
        let m = unsafe { std::ptr::read_volatile(slots.add(tail as usize % RING_SLOTS)) };
        h.tail.0.store(tail.wrapping_add(1), Ordering::Release);
        Some(m)
    }

    /// The flag area: its address in this mapping and its length (page-aligned both).
    pub fn flag_area(&self) -> (*mut u8, usize) {
        let n = self.nrings();
        // SAFETY: flags_offset(n) + flags_bytes(n) == len (seg_bytes), inside the mapping.
        (unsafe { self.base.add(flags_offset(n)) }, flags_bytes(n))
    }

    /// Offset of sender `l`'s `ready` word in the flag area.
    pub fn ready_offset(l: usize) -> usize {
        l * WORDS * FLAG_STRIDE
    }

    /// Offset of sender `l`'s `landed` word in the flag area.
    pub fn landed_offset(l: usize) -> usize {
        l * WORDS * FLAG_STRIDE + FLAG_STRIDE
    }

    /// Offset of sender `l`'s `staged` word (the staged path).
    pub fn staged_offset(l: usize) -> usize {
        l * WORDS * FLAG_STRIDE + 2 * FLAG_STRIDE
    }

    /// Offset of sender `l`'s `drained` word (the staged path).
    pub fn drained_offset(l: usize) -> usize {
        l * WORDS * FLAG_STRIDE + 3 * FLAG_STRIDE
    }

    /// The flag word at `offset` of the flag area (one of the offsets above).
    pub fn word(&self, offset: usize) -> &AtomicU64 {
        self.flag(offset)
    }

    fn flag(&self, offset: usize) -> &AtomicU64 {
        let (area, len) = self.flag_area();
        assert!(offset + 8 <= len, "flag offset {offset} out of {len}");
        // SAFETY: inside the flag area (asserted), 8-aligned (FLAG_STRIDE multiples of a
        // page-aligned base), zero-initialised by ftruncate; accessed only atomically here
        // and by device stream operations of 8 bytes.
        unsafe { &*(area.add(offset) as *const AtomicU64) }
    }

    /// Sender `l`'s `ready` word (the highest pair number the owner is ready for).
    pub fn ready(&self, l: usize) -> &AtomicU64 {
        assert!(l < self.nrings(), "sender {l} out of {}", self.nrings());
        self.flag(Self::ready_offset(l))
    }

    /// Sender `l`'s `landed` word (the highest pair number whose gated copies landed).
    pub fn landed(&self, l: usize) -> &AtomicU64 {
        assert!(l < self.nrings(), "sender {l} out of {}", self.nrings());
        self.flag(Self::landed_offset(l))
    }

    fn nrings(&self) -> usize {
        self.nrings
    }

    /// Say that this rank's device reaches every peer's flag area.
    pub fn set_gated(&self) {
        self.header().gated.store(1, Ordering::Release);
    }

    /// Whether the owner's device reaches every peer's flag area.
    pub fn gated(&self) -> bool {
        self.header().gated.load(Ordering::Acquire) != 0
    }

    /// Remove the segment's name once every rank has mapped it (the mappings stay): no
    /// process can open it afterwards, and nothing is left in `/dev/shm` if this process
    /// dies. Only the owner's call unlinks; a peer's mapping has nothing to remove.
    pub fn unlink(&mut self) {
        if std::mem::take(&mut self.owner) {
            unlink_name(&self.name);
        }
    }

    pub fn owner_pid(&self) -> u32 {
        self.header().pid.load(Ordering::Relaxed) as u32
    }
    pub fn mark_closed(&self) {
        self.header().closed.store(1, Ordering::Release);
    }
    pub fn is_closed(&self) -> bool {
        self.header().closed.load(Ordering::Acquire) != 0
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: our own mapping of `len` bytes.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
        if self.owner {
            unlink_name(&self.name);
        }
    }
}

fn unlink_name(name: &str) {
    if let Ok(c) = CString::new(name) {
        // SAFETY: valid C string; a missing name is harmless.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

/// Another mapping of a segment, of which only the flag area is used: the staged path's
/// words, read by the proxy and the calling threads of one process at once.
pub struct FlagArea(Segment);

// SAFETY: only the flag area's atomic words are reachable through a `FlagArea` (no ring
// access), so sharing it between threads is sound; the mapping lives as long as the value.
unsafe impl Sync for FlagArea {}

impl FlagArea {
    /// Map the segment `name` (made with `nrings` rings) once more.
    pub fn open(name: &str, nrings: usize) -> Result<FlagArea> {
        Segment::open(name, nrings).map(FlagArea)
    }
    /// The flag area's address in this mapping and its length.
    pub fn area(&self) -> (*mut u8, usize) {
        self.0.flag_area()
    }
    /// The word at `offset` ([`Segment::staged_offset`], [`Segment::drained_offset`]).
    pub fn word(&self, offset: usize) -> &AtomicU64 {
        self.0.word(offset)
    }
}

/// Whether process `pid` still exists.
pub fn pid_alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence/permission.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_round_trip_and_full() {
        let name = format!("/hoccl.{}.ctl.test{}.0", std::process::id(), line!());
        let own = Segment::create(&name, 2).unwrap();
        let peer = Segment::open(&name, 2).unwrap();
        assert!(Segment::open(&name, 3).is_err());
        for i in 0..RING_SLOTS as u64 {
            let mut m = Msg::new(MsgKind::Ready, i, 1);
            m.len = i * 3;
            assert!(peer.try_push(1, &m));
        }
        assert!(!peer.try_push(1, &Msg::new(MsgKind::Landed, 0, 0)), "ring must report full");
        assert!(own.try_pop(0).is_none());
        for i in 0..RING_SLOTS as u64 {
            let m = own.try_pop(1).unwrap();
            assert_eq!((m.seq, m.len, m.kind()), (i, i * 3, Some(MsgKind::Ready)));
        }
        assert!(own.try_pop(1).is_none());
        assert!(peer.try_push(1, &Msg::new(MsgKind::Fail, 9, 0)));
        assert_eq!(own.try_pop(1).unwrap().kind(), Some(MsgKind::Fail));
    }

    /// The flag area lies on its own pages past the rings, its words a cache line apart,
    /// shared by both mappings and zero at first.
    #[test]
    fn flag_area_is_shared_and_apart() {
        let name = format!("/hoccl.{}.ctl.test{}.0", std::process::id(), line!());
        let own = Segment::create(&name, 3).unwrap();
        let peer = Segment::open(&name, 3).unwrap();
        let (area, len) = own.flag_area();
        assert_eq!((area as usize % PAGE, len % PAGE), (0, 0));
        assert!(area as usize >= own.base as usize + std::mem::size_of::<SegHeader>() + 3 * ring_bytes());
        assert_eq!(area as usize + len, own.base as usize + own.len);
        let offsets: Vec<usize> = (0..3).flat_map(|l| [Segment::ready_offset(l), Segment::landed_offset(l), Segment::staged_offset(l), Segment::drained_offset(l)]).collect();
        assert!(offsets.windows(2).all(|w| w[1] - w[0] >= 64), "{offsets:?}");
        assert!(offsets.last().is_some_and(|o| o + 8 <= len));
        peer.word(Segment::drained_offset(2)).store(11, Ordering::Release);
        assert_eq!((own.word(Segment::drained_offset(2)).load(Ordering::Acquire), own.word(Segment::staged_offset(2)).load(Ordering::Acquire)), (11, 0));
        assert_eq!((own.ready(2).load(Ordering::Relaxed), own.landed(2).load(Ordering::Relaxed)), (0, 0));
        peer.landed(1).store(7, Ordering::Release);
        own.ready(1).store(5, Ordering::Release);
        assert_eq!((own.landed(1).load(Ordering::Acquire), peer.ready(1).load(Ordering::Acquire)), (7, 5));
        assert_eq!(own.landed(0).load(Ordering::Acquire), 0);
        assert!(!peer.gated());
        own.set_gated();
        assert!(peer.gated());
    }

    /// The segment is created owner-only, and once unlinked no process can open it while
    /// the mappings made before keep working.
    #[test]
    fn owner_only_and_unlinked_after_mapping() {
        use std::os::unix::fs::PermissionsExt;
        let name = format!("/hoccl.{}.ctl.test{}.0", std::process::id(), line!());
        let mut own = Segment::create(&name, 1).unwrap();
        let mode = std::fs::metadata(format!("/dev/shm{name}")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "mailbox mode {mode:o}");
        let peer = Segment::open(&name, 1).unwrap();
        own.unlink();
        assert!(!std::path::Path::new(&format!("/dev/shm{name}")).exists(), "the name outlived the mapping");
        assert!(Segment::open(&name, 1).is_err(), "an unlinked mailbox opened");
        assert!(peer.try_push(0, &Msg::new(MsgKind::Landed, 1, 0)));
        assert_eq!(own.try_pop(0).map(|m| m.seq), Some(1));
    }

    /// A peer that overwrites the shared header or ring counters gets neither an
    /// out-of-bounds access nor a panic here: rings are located from this mapping's own
    /// ring count, slots by index modulo the ring size, and corrupt counters read as a full
    /// ring (the sender holds its message) or as records the receiver then validates.
    #[test]
    fn corrupt_counters_stay_in_bounds() {
        let name = format!("/hoccl.{}.ctl.test{}.0", std::process::id(), line!());
        let own = Segment::create(&name, 2).unwrap();
        let peer = Segment::open(&name, 2).unwrap();
        own.header().nrings.store(u64::MAX, Ordering::Relaxed);
        assert!(peer.try_push(1, &Msg::new(MsgKind::Ready, 5, 0)));
        assert_eq!(own.try_pop(1).map(|m| m.seq), Some(5));
        own.header().nrings.store(0, Ordering::Relaxed);
        assert!(own.try_pop(1).is_none());
        let (h, _) = own.ring(1);
        // Tail past head: full for the sender, no underflow.
        h.tail.0.store(h.head.0.load(Ordering::Relaxed) + 1000, Ordering::Relaxed);
        assert!(!peer.try_push(1, &Msg::new(MsgKind::Ready, 6, 0)));
        // Head far ahead of tail, near the counter's end: every read stays in the ring.
        h.head.0.store(u64::MAX, Ordering::Relaxed);
        h.tail.0.store(u64::MAX - 3, Ordering::Relaxed);
        for _ in 0..3 {
            assert!(own.try_pop(1).is_some());
        }
        assert!(own.try_pop(1).is_none());
        h.head.0.store(1, Ordering::Relaxed);
        assert!(own.try_pop(1).is_some(), "the counters wrap");
    }
}
