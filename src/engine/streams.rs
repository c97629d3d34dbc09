//! Stream manager: two host-visible 64-bit flags per user stream. The protocol is the
//! paper's handshake with monotonic sequence numbers instead of resets:
//!
//! ```text
//!   stream:  write start := s      ; wait finish >= s      ; (work after the call)
//!   proxy:   sees start >= s → moves the bytes → writes finish := s
//! ```
//!
//! Nothing is ever reset, so several ops of one stream can be enqueued at once; the stream
//! itself serialises them (op s+1's start is written only after op s's finish). Work before
//! the call completes before start is written; work after the call waits for finish.
use crate::device::{Backend, Device, FlagSlab, StreamHandle};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Flags per slab (two per stream).
const SLAB_FLAGS: usize = 64;

struct Slot {
    slab: Arc<FlagSlab>,
    start: usize,
    seq: u64,
}

/// Flag pairs outlive communicators. After a communicator is gone, a stream may still have
/// to execute the wait of its last op (queued behind the user's work); the memory must stay
/// mapped and its value must never drop below that wait's target. So pairs are never freed:
/// a clean teardown returns them here with their last sequence number, and the next user
/// continues counting from it. The user's streams are never queried or touched.
struct PooledPair {
    key: (Backend, usize),
    slab: Arc<FlagSlab>,
    start: usize,
    seq: u64,
}

static POOL: Mutex<Vec<PooledPair>> = Mutex::new(Vec::new());

#[derive(Default)]
pub struct StreamManager {
    slots: HashMap<StreamHandle, Slot>,
    /// Slab with free pairs, and the next free index in it.
    current: Option<(Arc<FlagSlab>, usize)>,
    /// Every slab ever made (kept until the communicator is torn down).
    slabs: Vec<Arc<FlagSlab>>,
}

/// The handshake enqueued for one op.
pub struct Handshake {
    pub flags: Arc<FlagSlab>,
    pub start_flag: usize,
    pub finish_flag: usize,
    pub stream_seq: u64,
}

impl StreamManager {
    /// Enqueue `write start := s; wait finish >= s` on `stream` and return the flags.
    pub fn enqueue(&mut self, dev: &dyn Device, stream: StreamHandle, op: &'static str) -> Result<Handshake> {
        if !self.slots.contains_key(&stream) {
            let (slab, idx, seq) = self.take_pair(dev)?;
            self.slots.insert(stream, Slot { slab, start: idx, seq });
        }
        let slot = self.slots.get_mut(&stream).ok_or_else(|| Error::internal(op, "stream slot vanished"))?;
        let s = slot.seq + 1;
        dev.write_value(stream, slot.slab.dev_addr(slot.start), s).map_err(|e| e.with_op(op))?;
        dev.wait_value_geq(stream, slot.slab.dev_addr(slot.start + 1), s).map_err(|e| e.with_op(op))?;
        slot.seq = s;
        Ok(Handshake { flags: slot.slab.clone(), start_flag: slot.start, finish_flag: slot.start + 1, stream_seq: s })
    }

    fn take_pair(&mut self, dev: &dyn Device) -> Result<(Arc<FlagSlab>, usize, u64)> {
        let key = (dev.backend(), dev.ordinal());
        if let Ok(mut pool) = POOL.lock() {
            if let Some(i) = pool.iter().position(|p| p.key == key) {
                let p = pool.swap_remove(i);
                self.slabs.push(p.slab.clone());
                return Ok((p.slab, p.start, p.seq));
            }
        }
        self.take_new_pair(dev).map(|(slab, i)| (slab, i, 0))
    }

    fn take_new_pair(&mut self, dev: &dyn Device) -> Result<(Arc<FlagSlab>, usize)> {
        match &mut self.current {
            Some((slab, next)) if *next + 2 <= slab.len() => {
                let i = *next;
                *next += 2;
                Ok((slab.clone(), i))
            }
            _ => {
                let slab = Arc::new(dev.alloc_flags(SLAB_FLAGS)?);
                self.slabs.push(slab.clone());
                self.current = Some((slab.clone(), 2));
                Ok((slab, 0))
            }
        }
    }

    /// Give the flag pairs back at teardown. `clean`: every op finished after its start
    /// flag was written, so nothing but reads of finish flags (targets <= the pair's last
    /// value) can still be queued on any stream: the pairs are recycled. Otherwise a start
    /// write may still be queued; the pairs are kept out of use forever.
    pub fn release(&mut self, dev: &dyn Device, clean: bool) {
        let key = (dev.backend(), dev.ordinal());
        let mut back: Vec<PooledPair> = Vec::new();
        if clean {
            back.extend(self.slots.drain().map(|(_, sl)| PooledPair { key, slab: sl.slab, start: sl.start, seq: sl.seq }));
            if let Some((slab, next)) = self.current.take() {
                back.extend((next..slab.len() / 2 * 2).step_by(2).map(|i| PooledPair { key, slab: slab.clone(), start: i, seq: 0 }));
            }
        }
        match POOL.lock() {
            Ok(mut pool) => pool.extend(back),
            Err(_) => back.into_iter().for_each(|p| std::mem::forget(p.slab)),
        }
        for s in self.slabs.drain(..) {
            // Pooled pairs hold their own reference; the rest are never freed (see above).
            std::mem::forget(s);
        }
        self.slots.clear();
        self.current = None;
    }
}
