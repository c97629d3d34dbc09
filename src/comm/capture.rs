//! Operations between ranks enqueued on a stream that is being captured into a CUDA graph
//! (docs/nccl.md, "CUDA graphs"). Such an op is not run: it becomes a *template* on the
//! proxy (`engine::graphs`) with a flag pair of its own, and the graph records the
//! reset-based handshake around the work that stays on the stream:
//!
//! ```text
//!   write finish := 0 ; write start := 1 ; (copies to self) ; wait finish >= 1
//! ```
//!
//! Every replay then runs one instance of the template. Template ids count the captured ops
//! of the communicator, so every rank that captures the same calls in the same order gives
//! each the same id. Captured reductions have a scratch of their own (a replay may run while
//! eager reductions use the communicator's), shared by the reductions captured on one stream
//! in one capture sequence: the graph orders those one after another, as a stream orders
//! eager reductions, and replays of one graph run in order. A reduction that needs more
//! than that stream's scratch holds gets a larger one, which the later ones share. The
//! reduce steps are recorded like any kernel. A graph's release hook (`Device::capture_retain`) returns the
//! flag pair and the scratch to this communicator's pool for later captures; the pool is
//! freed with the communicator. What a graph still holds when its communicator is destroyed
//! stays allocated: a later replay reads it (the orphan responder releases its stream).
use super::reduction::Reduction;
use super::{Communicator, Region, State};
use crate::device::{DevPtr, FlagSlab, StreamHandle};
use crate::engine::graphs::MAX_TEMPLATES;
use crate::engine::Transfer;
use crate::error::{Error, Result};
use crate::types::DataType;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Flags per slab of template flag pairs.
const SLAB_FLAGS: usize = 64;

/// Flag pairs and scratches that released graphs gave back (filled by the graphs' release
/// hooks, which make no device call).
#[derive(Default)]
struct Pool {
    pairs: Vec<(Arc<FlagSlab>, usize)>,
    scratch: Vec<Region>,
}

type SharedPool = Arc<Mutex<Pool>>;

#[derive(Default)]
pub(super) struct CaptureState {
    /// The next template id (captured ops of this communicator so far).
    next_id: u32,
    /// The slab that fresh pairs are cut from, and its next free word.
    current: Option<(Arc<FlagSlab>, usize)>,
    pool: SharedPool,
    /// Per capturing stream: the capture sequence and the scratch its reductions share.
    scratch_for: HashMap<StreamHandle, (u64, Region)>,
}

fn lock_pool(p: &SharedPool) -> std::sync::MutexGuard<'_, Pool> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

impl Communicator {
    /// Whether an op whose work crosses to a peer (`crosses`) is being captured on `stream`.
    pub(super) fn capturing(&self, name: &'static str, stream: StreamHandle, crosses: bool) -> Result<bool> {
        capture_verdict(crosses, || self.dev.stream_capturing(stream).map_err(|e| e.with_op(name)))
    }

    /// Refuse what cannot be replayed: an op the compressed engine would move (its
    /// encoder's output length and staging are decided per call on the host side).
    fn capturable(&self, name: &'static str, dtype: Option<DataType>) -> Result<()> {
        if dtype.is_some_and(|dt| self.compress_from.for_dtype(dt).is_some()) {
            return Err(Error::invalid_usage(
                name,
                "the stream is being captured into a CUDA graph, and an operation the compressed engine moves cannot be captured \
                 (its staging is planned per call); use HOCCL_ENGINE=ce for captured collectives",
            ));
        }
        Ok(())
    }

    /// Record one op between ranks into the graph `stream` is captured into: a template
    /// on the proxy, the handshake and `local` copies on the stream, the release hook.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_captured(
        &self,
        st: &mut State,
        name: &'static str,
        stream: StreamHandle,
        dtype: Option<DataType>,
        sends: Vec<Transfer>,
        recvs: Vec<Transfer>,
        local: &[(DevPtr, DevPtr, usize)],
    ) -> Result<()> {
        self.capturable(name, dtype)?;
        let id = st.capture.next_id;
        if id > MAX_TEMPLATES {
            return Err(Error::invalid_usage(name, format!("more than {MAX_TEMPLATES} operations captured on this communicator")));
        }
        let (slab, i) = self.template_pair(&mut st.capture, name)?;
        let pool = st.capture.pool.clone();
        let life = match self.engine.register_template(id, name, (slab.clone(), i, i + 1), sends, recvs) {
            Ok(l) => l,
            Err(e) => {
                lock_pool(&pool).pairs.push((slab, i));
                return Err(e);
            }
        };
        st.capture.next_id += 1;
        let hook = {
            let (life, slab, pool) = (life.clone(), slab.clone(), pool.clone());
            Box::new(move || {
                life.graph_released();
                lock_pool(&pool).pairs.push((slab, i));
            })
        };
        if let Err(e) = self.dev.capture_retain(stream, hook) {
            // Nothing recorded yet: the template goes at once.
            life.graph_released();
            lock_pool(&pool).pairs.push((slab, i));
            return Err(e.with_op(name));
        }
        let dev = self.dev.as_ref();
        dev.write_value(stream, slab.dev_addr(i + 1), 0)
            .and_then(|_| dev.write_value(stream, slab.dev_addr(i), 1))
            .and_then(|_| local.iter().try_for_each(|&(dst, src, len)| dev.memcpy_async(stream, dst, src, len)))
            .and_then(|_| dev.wait_value_geq(stream, slab.dev_addr(i + 1), 1))
            .map_err(|e| e.with_op(name))?;
        log::debug!("rank {}: {name} captured as template {id}", self.rank);
        Ok(())
    }

    /// A zeroed flag pair for a template: one a released graph gave back, or a fresh one.
    fn template_pair(&self, cs: &mut CaptureState, name: &'static str) -> Result<(Arc<FlagSlab>, usize)> {
        let (slab, i) = match lock_pool(&cs.pool).pairs.pop() {
            Some(p) => p,
            None => match &mut cs.current {
                Some((slab, next)) if *next + 2 <= slab.len() => {
                    *next += 2;
                    (slab.clone(), *next - 2)
                }
                _ => {
                    let mut made = None;
                    self.dev.relaxed_capture(&mut || {
                        made = Some(Arc::new(self.dev.alloc_flags(SLAB_FLAGS)?));
                        Ok(())
                    })
                    .map_err(|e| e.with_op(name))?;
                    let slab = made.ok_or_else(|| Error::internal(name, "flag slab not made"))?;
                    cs.current = Some((slab.clone(), 2));
                    (slab, 0)
                }
            },
        };
        slab.store(i, 0);
        slab.store(i + 1, 0);
        Ok((slab, i))
    }

    /// Capture reduction `red` (more than one rank, a nonempty count): the flat plan with the
    /// scratch of its stream's capture sequence (a new one, attached to the graph, when it
    /// has none or one too small), whose release hook returns it to the pool.
    pub(super) fn capture_reduction(&self, st: &mut State, red: &Reduction, slot: usize) -> Result<()> {
        let name = red.name;
        if self.node_chain(red.op).is_ok() {
            return Err(Error::invalid_usage(
                name,
                "the stream is being captured into a CUDA graph, and a reduction across nodes (the hierarchical plan) cannot be captured",
            ));
        }
        self.capturable(name, Some(red.dtype))?;
        let len = slot * self.size;
        let seq = self.dev.capture_id(red.stream).map_err(|e| e.with_op(name))?;
        if let Some(&(s, region)) = st.capture.scratch_for.get(&red.stream) {
            if s == seq && region.len >= len {
                return self.run_reduction_captured(st, red, region, slot);
            }
        }
        let taken = {
            let mut p = lock_pool(&st.capture.pool);
            let at = p.scratch.iter().position(|r| r.len >= len);
            at.map(|i| p.scratch.swap_remove(i))
        };
        let region = match taken {
            Some(r) => r,
            None => {
                let mut made = None;
                self.dev
                    .relaxed_capture(&mut || {
                        let base = self.dev.alloc(len)?;
                        match self.dev.allocation(base) {
                            Ok(a) => {
                                made = Some(Region { op: "reduction", what: "captured scratch", ptr: base, len, alloc: Some(a) });
                                Ok(())
                            }
                            Err(e) => {
                                let _ = self.dev.free(base);
                                Err(e)
                            }
                        }
                    })
                    .map_err(|e| e.with_op(name))?;
                made.ok_or_else(|| Error::internal(name, "scratch not made"))?
            }
        };
        let pool = st.capture.pool.clone();
        let hook = {
            let pool = pool.clone();
            Box::new(move || lock_pool(&pool).scratch.push(region))
        };
        if let Err(e) = self.dev.capture_retain(red.stream, hook) {
            lock_pool(&pool).scratch.push(region);
            return Err(e.with_op(name));
        }
        log::debug!("rank {}: {name} captured with a scratch of {len} bytes ({} slots of {slot})", self.rank, self.size);
        st.capture.scratch_for.insert(red.stream, (seq, region));
        // The hook owns the scratch from here: a failure below leaves it to the graph.
        self.run_reduction_captured(st, red, region, slot)
    }

    /// Free what released graphs gave back (teardown: no graph uses them any more).
    pub(super) fn release_captured(&self, st: &mut State) {
        let scratch = std::mem::take(&mut lock_pool(&st.capture.pool).scratch);
        for r in scratch {
            if let Err(e) = self.dev.free(r.ptr) {
                log::warn!("hoccl: rank {}: freeing a captured reduction's scratch: {e}", self.rank);
            }
        }
    }
}

/// The capture rule: whether an op takes the captured path. `capturing` is asked only for
/// an op that crosses to a peer (work that stays on the caller's stream is recorded like
/// any stream work, so one-rank ops pay nothing).
fn capture_verdict(crosses: bool, capturing: impl FnOnce() -> Result<bool>) -> Result<bool> {
    if !crosses {
        return Ok(false);
    }
    capturing()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    #[test]
    fn only_ops_that_cross_to_a_peer_ask_whether_the_stream_captures() {
        assert!(capture_verdict(true, || Ok(true)).unwrap());
        assert!(!capture_verdict(true, || Ok(false)).unwrap());
        // A one-rank op never asks the device, so it costs nothing and cannot fail here.
        assert!(!capture_verdict(false, || panic!("asked for an op that stays local")).unwrap());
        // A failing query is reported, not taken for "not capturing".
        let e = capture_verdict(true, || Err(Error::internal("q", "driver"))).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Internal);
    }
}
