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
use crate::device::{Device, FlagSlab, StreamHandle};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::Arc;

/// Flags per slab (two per stream).
const SLAB_FLAGS: usize = 64;

struct Slot {
    slab: Arc<FlagSlab>,
    start: usize,
    seq: u64,
}

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
            let (slab, idx) = self.take_pair(dev)?;
            self.slots.insert(stream, Slot { slab, start: idx, seq: 0 });
        }
        let slot = self.slots.get_mut(&stream).ok_or_else(|| Error::internal(op, "stream slot vanished"))?;
        let s = slot.seq + 1;
        dev.write_value(stream, slot.slab.dev_addr(slot.start), s).map_err(|e| e.with_op(op))?;
        dev.wait_value_geq(stream, slot.slab.dev_addr(slot.start + 1), s).map_err(|e| e.with_op(op))?;
        slot.seq = s;
        Ok(Handshake { flags: slot.slab.clone(), start_flag: slot.start, finish_flag: slot.start + 1, stream_seq: s })
    }

    fn take_pair(&mut self, dev: &dyn Device) -> Result<(Arc<FlagSlab>, usize)> {
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

    /// The streams this communicator has used.
    pub fn streams(&self) -> impl Iterator<Item = StreamHandle> + '_ {
        self.slots.keys().copied()
    }

    /// Give up the flag memory without freeing it: a stream may still have to execute a
    /// wait on it, and freeing memory a queued stream operation reads is undefined.
    pub fn leak(&mut self) {
        for s in self.slabs.drain(..) {
            std::mem::forget(s);
        }
        self.slots.clear();
        self.current = None;
    }
}
