//! The flow-size-aware chunk scheduler of the copy-engine transports: the chunks of every
//! active flow, issued to the device's copy queues a few at a time. The next chunk always
//! goes to the flow that is least far along relative to its size (issued/len), so flows
//! that run together finish together (the paper's flow-size-aware chunk schedule), and a
//! flow that becomes ready late joins at once.
use crate::device::{CopyQueue, DevPtr};
use crate::error::Error;
use crate::transport::FlowId;
use std::collections::VecDeque;

struct Flow {
    id: FlowId,
    src: DevPtr,
    dst: DevPtr,
    len: usize,
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
    chunk: usize,
    /// Chunks kept in flight per queue: enough to hide the proxy's reaction time.
    depth: usize,
}

impl ChunkScheduler {
    pub fn new(queues: Vec<Box<dyn CopyQueue>>, chunk: usize) -> Self {
        ChunkScheduler {
            queues: queues.into_iter().map(|q| Queue { q, inflight: VecDeque::new() }).collect(),
            flows: Vec::new(),
            chunk,
            depth: 2,
        }
    }

    pub fn add(&mut self, id: FlowId, src: DevPtr, dst: DevPtr, len: usize) {
        let f = Flow { id, src, dst, len, issued: 0, outstanding: 0, cancelled: false };
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
            .map(|f| format!("op {}#{} {}/{}B issued, {} in flight{}", f.id.seq, f.id.idx, f.issued, f.len, f.outstanding, if f.cancelled { " (cancelled)" } else { "" }))
            .collect();
        let queues: Vec<usize> = self.queues.iter().map(|q| q.inflight.len()).collect();
        format!("copy queues in flight {queues:?}; flows [{}]", flows.join("; "))
    }

    pub fn is_idle(&self) -> bool {
        self.flows.iter().all(Option::is_none)
    }

    /// Reap completed chunks, issue new ones, and push finished flows to `done`.
    /// An error names the op whose copy failed.
    pub fn poll(&mut self, done: &mut Vec<FlowId>) -> Result<bool, (u64, Error)> {
        let mut progressed = false;
        for qi in 0..self.queues.len() {
            progressed |= self.reap(qi)?;
        }
        for qi in 0..self.queues.len() {
            while self.queues[qi].inflight.len() < self.depth {
                let Some(slot) = self.pick() else { break };
                self.issue(qi, slot)?;
                progressed = true;
            }
        }
        for slot in self.flows.iter_mut() {
            let finished = slot.as_ref().is_some_and(|f| f.outstanding == 0 && (f.cancelled || f.issued == f.len));
            if finished {
                if let Some(f) = slot.take() {
                    done.push(f.id);
                    progressed = true;
                }
            }
        }
        Ok(progressed)
    }

    fn reap(&mut self, qi: usize) -> Result<bool, (u64, Error)> {
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
            }
            any = true;
        }
        Ok(any)
    }

    /// The flow least far along relative to its size (oldest first on ties).
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
        let n = self.chunk.min(f.len - f.issued);
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
