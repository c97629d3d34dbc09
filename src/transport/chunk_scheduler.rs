//! The flow-size-aware chunk scheduler of the copy-engine transports: the chunks of every
//! active flow, issued to the device's copy queues a few at a time. The next chunk always
//! goes to the flow that is least far along relative to its size (issued/len), so flows
//! that run together finish together (the paper's flow-size-aware chunk schedule), and a
//! flow that becomes ready late joins at once.
//!
//! **Chunk size from the flow.** Every chunk costs a copy, a fence and a poll (5–6 µs of
//! proxy and driver time for the copy and fence under MPS on the H200, `HOCCL_TRACE_OPS`),
//! so a flow is cut only where cutting buys something: a flow up to [`MIN_CHUNK`] is one
//! copy; a larger one is cut into pieces of at least `MIN_CHUNK` and at most the configured chunk (`HOCCL_CHUNK_BYTES`, an upper
//! bound), as many as spread it over the queues its peer traffic may use divided among the
//! peer flows active when it starts. So one large flow alone keeps every queue busy, many
//! flows together each go in few large chunks, and a flow's chunks stay large enough to
//! amortise their fixed cost.
//!
//! Only peer traffic comes here: a rank's copies to itself run on the caller's stream
//! (`engine::streams`), so they never wait behind a link.
use crate::device::{CopyQueue, DevPtr};
use crate::error::Error;
use crate::transport::FlowId;
use std::collections::VecDeque;

/// Flows up to this size are one copy; larger ones are cut into chunks at least this big
/// (or the configured chunk, when that is smaller). Measured on one H200, two processes
/// under MPS, sendrecv: one copy per flow beats spreading it over three queues up to
/// 32 MiB (4 MiB: 28.7 against 46.5 µs; 8 MiB: 30.4 against 57.0 µs), and loses from
/// 64 MiB (`docs/results/h200-1gpu/chunking.txt`).
pub const MIN_CHUNK: usize = 8 << 20;
/// Chunks kept in flight per peer queue: enough to hide the proxy's reaction time behind
/// one chunk crossing a link.
const PEER_DEPTH: usize = 2;
/// Chunk sizes are multiples of this (keeps copies aligned).
const ALIGN: usize = 64 << 10;

struct Flow {
    id: FlowId,
    src: DevPtr,
    dst: DevPtr,
    len: usize,
    /// This flow's chunk size.
    chunk: usize,
    issued: usize,
    outstanding: usize,
    cancelled: bool,
}

struct Queue {
    q: Box<dyn CopyQueue>,
    /// (fence ticket, flow slot) of every chunk issued and not yet seen complete.
    inflight: VecDeque<(u64, usize)>,
}

pub struct ChunkScheduler {
    queues: Vec<Queue>,
    flows: Vec<Option<Flow>>,
    /// Upper bound of a chunk (`HOCCL_CHUNK_BYTES`).
    cap: usize,
    /// Slots of `flows` in use.
    active: usize,
}

impl ChunkScheduler {
    pub fn new(queues: Vec<Box<dyn CopyQueue>>, cap: usize) -> Self {
        ChunkScheduler { queues: queues.into_iter().map(|q| Queue { q, inflight: VecDeque::new() }).collect(), flows: Vec::new(), cap: cap.max(1), active: 0 }
    }

    /// Add a flow of `len` bytes.
    pub fn add(&mut self, id: FlowId, src: DevPtr, dst: DevPtr, len: usize) {
        let flows = 1 + self.flows.iter().flatten().filter(|f| !f.cancelled && f.issued < f.len).count();
        let spread = (self.queues.len() / flows).max(1);
        let f = Flow { id, src, dst, len, chunk: chunk_size(len, spread, self.cap), issued: 0, outstanding: 0, cancelled: false };
        self.active += 1;
        match self.flows.iter().position(Option::is_none) {
            Some(i) => self.flows[i] = Some(f),
            None => self.flows.push(Some(f)),
        }
    }

    /// Stop issuing the flows of op `seq`; chunks already issued still drain (and are then
    /// reported done like the others, so the caller can release mappings).
    pub fn cancel(&mut self, seq: u64) {
        for f in self.flows.iter_mut().flatten() {
            if f.id.seq == seq {
                f.cancelled = true;
            }
        }
    }

    /// One line for failure reports: active flows and chunks in flight per queue.
    pub fn describe(&self) -> String {
        let flows: Vec<String> = self
            .flows
            .iter()
            .flatten()
            .map(|f| {
                format!(
                    "op {}#{} {}/{}B issued in {}B chunks, {} in flight{}",
                    f.id.seq,
                    f.id.idx,
                    f.issued,
                    f.len,
                    f.chunk,
                    f.outstanding,
                    if f.cancelled { " (cancelled)" } else { "" }
                )
            })
            .collect();
        let queues: Vec<usize> = self.queues.iter().map(|q| q.inflight.len()).collect();
        format!("copy queues in flight {queues:?}; flows [{}]", flows.join("; "))
    }

    pub fn is_idle(&self) -> bool {
        self.active == 0
    }

    /// Reap completed chunks, issue new ones, push the flows that had a chunk complete to
    /// `advanced` (a flow may appear more than once) and the finished flows to `done`.
    /// An error names the op whose copy failed.
    pub fn poll(&mut self, done: &mut Vec<FlowId>, advanced: &mut Vec<FlowId>) -> Result<bool, (u64, Error)> {
        if self.active == 0 {
            return Ok(false);
        }
        let mut progressed = false;
        for qi in 0..self.queues.len() {
            progressed |= self.reap(qi, advanced)?;
        }
        for qi in 0..self.queues.len() {
            while self.queues[qi].inflight.len() < PEER_DEPTH {
                let Some(slot) = self.pick() else { break };
                self.issue(qi, slot)?;
                progressed = true;
            }
        }
        for slot in self.flows.iter_mut() {
            let finished = slot.as_ref().is_some_and(|f| f.outstanding == 0 && (f.cancelled || f.issued == f.len));
            if finished {
                if let Some(f) = slot.take() {
                    self.active -= 1;
                    done.push(f.id);
                    progressed = true;
                }
            }
        }
        Ok(progressed)
    }

    fn reap(&mut self, qi: usize, advanced: &mut Vec<FlowId>) -> Result<bool, (u64, Error)> {
        let q = &mut self.queues[qi];
        let Some(&(_, first_slot)) = q.inflight.front() else { return Ok(false) };
        let completed = match q.q.completed() {
            Ok(c) => c,
            Err(e) => return Err((self.flows[first_slot].as_ref().map_or(0, |f| f.id.seq), e)),
        };
        let mut any = false;
        while let Some(&(t, slot)) = q.inflight.front() {
            if t > completed {
                break;
            }
            q.inflight.pop_front();
            if let Some(f) = self.flows[slot].as_mut() {
                f.outstanding -= 1;
                advanced.push(f.id);
            }
            any = true;
        }
        Ok(any)
    }

    /// The flow least far along relative to its size (oldest slot first on ties).
    fn pick(&self) -> Option<usize> {
        let mut best: Option<(usize, usize, usize)> = None; // (slot, issued, len)
        for (i, f) in self.flows.iter().enumerate() {
            let Some(f) = f else { continue };
            if f.cancelled || f.issued == f.len {
                continue;
            }
            // issued_f/len_f < issued_b/len_b, compared without division.
            let better = best.is_none_or(|(_, bi, bl)| (f.issued as u128) * (bl as u128) < (bi as u128) * (f.len as u128));
            if better {
                best = Some((i, f.issued, f.len));
            }
        }
        best.map(|(i, _, _)| i)
    }

    fn issue(&mut self, qi: usize, slot: usize) -> Result<(), (u64, Error)> {
        let Some(f) = self.flows[slot].as_mut() else { return Ok(()) };
        let n = f.chunk.min(f.len - f.issued);
        let q = &mut self.queues[qi];
        let seq = f.id.seq;
        q.q.copy(f.dst.add(f.issued), f.src.add(f.issued), n).map_err(|e| (seq, e))?;
        let t = q.q.fence().map_err(|e| (seq, e))?;
        f.issued += n;
        f.outstanding += 1;
        q.inflight.push_back((t, slot));
        Ok(())
    }
}

/// The chunk of a flow of `len` bytes spread over `spread` queues, at most `cap`: one copy
/// up to `MIN_CHUNK` (or `cap`, if smaller); otherwise `len / spread` rounded up to
/// `ALIGN`, clamped to `[MIN_CHUNK, cap]`.
pub fn chunk_size(len: usize, spread: usize, cap: usize) -> usize {
    let floor = MIN_CHUNK.min(cap);
    if len <= floor {
        return len.max(1);
    }
    len.div_ceil(spread.max(1)).next_multiple_of(ALIGN).clamp(floor, cap)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Result;
    use std::sync::{Arc, Mutex};

    /// A queue that records every copy (queue index, source, length) and completes each
    /// fence at once.
    struct Recorder(usize, Arc<Mutex<Vec<(usize, u64, usize)>>>, u64);
    impl CopyQueue for Recorder {
        fn copy(&mut self, _dst: DevPtr, src: DevPtr, len: usize) -> Result<()> {
            self.1.lock().unwrap().push((self.0, src.0, len));
            Ok(())
        }
        fn fence(&mut self) -> Result<u64> {
            self.2 += 1;
            Ok(self.2)
        }
        fn completed(&mut self) -> Result<u64> {
            Ok(self.2)
        }
    }

    /// Run flows (id, src, len) on `queues` recording queues with chunk cap `cap`; every
    /// copy made and the order flows finished.
    fn run(queues: usize, cap: usize, flows: &[(usize, u64, usize)]) -> (Vec<(usize, u64, usize)>, Vec<usize>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let qs: Vec<Box<dyn CopyQueue>> = (0..queues).map(|i| Box::new(Recorder(i, log.clone(), 0)) as Box<dyn CopyQueue>).collect();
        let mut s = ChunkScheduler::new(qs, cap);
        for &(idx, src, len) in flows {
            s.add(FlowId { seq: 1, idx }, DevPtr(src), DevPtr(0), len);
        }
        let (mut done, mut advanced) = (Vec::new(), Vec::new());
        while !s.is_idle() {
            s.poll(&mut done, &mut advanced).unwrap();
        }
        let copies = log.lock().unwrap().clone();
        (copies, done.iter().map(|f| f.idx).collect())
    }

    /// A large flow alone spreads over every queue, a small flow is one copy, flows that
    /// run together finish together, and every byte is copied once.
    #[test]
    fn flows_spread_over_the_queues() {
        const M: usize = 1 << 20;
        let (a, b) = (1u64 << 40, 1u64 << 41);
        let (copies, done) = run(3, M, &[(0, a, 8 * M), (1, 0, 8 * M), (2, b, 4096)]);
        assert_eq!(done.len(), 3);
        for q in 0..3 {
            assert!(copies.iter().any(|c| c.0 == q), "queue {q} unused: {copies:?}");
        }
        let small: Vec<_> = copies.iter().filter(|c| c.1 == b).collect();
        assert_eq!(small.len(), 1, "a small flow is one copy: {copies:?}");
        for (src, len) in [(a, 8 * M), (0, 8 * M)] {
            let total: usize = copies.iter().filter(|c| c.1 >= src && c.1 < src + len as u64).map(|c| c.2).sum();
            assert_eq!(total, len);
        }
    }

    #[test]
    fn chunks_follow_the_flow_size() {
        const M: usize = MIN_CHUNK;
        let cap = 4 * M;
        // Small flows: one copy.
        assert_eq!(chunk_size(4096, 2, cap), 4096);
        assert_eq!(chunk_size(M, 2, cap), M);
        // A mid flow alone spreads over the queues, never below the floor.
        assert_eq!(chunk_size(2 * M, 2, cap), M);
        assert_eq!(chunk_size(3 * M, 2, cap), 3 * M / 2);
        assert_eq!(chunk_size(M + 1, 2, cap), M);
        // Large flows: the cap.
        assert_eq!(chunk_size(1 << 34, 2, cap), cap);
        // The cap bounds everything, the floor included.
        assert_eq!(chunk_size(M, 1, 64 << 10), 64 << 10);
        assert_eq!(chunk_size(8 * M, 1, M / 2), M / 2);
    }
}
