//! Invariant checks of a plan, used by the property tests and available to the engine as a
//! cheap sanity check before executing a plan received from elsewhere.
use super::cluster::CopyKind;
use super::traffic::Hop;
use super::Plan;
use crate::error::{Error, Result};

const OP: &str = "plan::verify";

fn fail(what: String) -> Error {
    Error::internal(OP, what)
}

/// Checks that `pieces` (item, offset, bytes), sorted, tile `[0, size(item))` for each item.
fn check_cover(what: &str, mut pieces: Vec<(u32, u64, u64)>, sizes: &[u64]) -> Result<()> {
    pieces.sort_unstable();
    let mut at = vec![0u64; sizes.len()];
    for (item, off, len) in pieces {
        let i = item as usize;
        if off != at[i] || len == 0 {
            return Err(fail(format!("{what} {item}: piece at {off} (+{len}) but covered up to {}", at[i])));
        }
        at[i] += len;
    }
    match (0..sizes.len()).find(|&i| at[i] != sizes[i]) {
        Some(i) => Err(fail(format!("{what} {i}: {} of {} bytes covered", at[i], sizes[i]))),
        None => Ok(()),
    }
}

impl Plan {
    /// Every invariant of a plan: per-stage NIC degree ≤ 1 each way; the parts of a split
    /// flow (its routes) tile its bytes from 0 without gap or overlap; NIC pieces and native
    /// pieces tile every route and native flow exactly once; the queues deliver every byte of every route once
    /// through its sender copy, its NIC transfer and each of its receiver copies, with the
    /// three hops of a chunk in the same stage and every queue in stage order.
    pub fn verify(&self) -> Result<()> {
        self.verify_degree()?;
        let t = &self.traffic;
        let rsize: Vec<u64> = t.routes.iter().map(|r| r.bytes).collect();
        let nsize: Vec<u64> = t.natives.iter().map(|n| n.bytes).collect();
        self.verify_parts()?;
        check_cover("route", self.nic.iter().map(|x| (x.route, x.offset, x.bytes)).collect(), &rsize)?;
        check_cover("native", self.native_pieces.iter().map(|p| (p.native, p.offset, p.bytes)).collect(), &nsize)?;
        self.verify_queues()
    }

    /// The routes of each flow (src, dst), by offset, follow each other from 0; a flow whose
    /// routes all start at 0 is whole (point-to-point batches may send one pair several
    /// transfers, each its own route).
    fn verify_parts(&self) -> Result<()> {
        let mut parts: Vec<(u32, u32, u64, u64)> = self.traffic.routes.iter().map(|r| (r.src, r.dst, r.offset, r.bytes)).collect();
        parts.sort_unstable();
        for flow in parts.chunk_by(|a, b| (a.0, a.1) == (b.0, b.1)).filter(|f| f.iter().any(|p| p.2 > 0)) {
            let mut at = 0;
            for &(src, dst, off, len) in flow {
                if off != at {
                    return Err(fail(format!("flow {src} → {dst}: part at {off} (+{len}) but the parts before end at {at}")));
                }
                at += len;
            }
        }
        Ok(())
    }

    fn verify_degree(&self) -> Result<()> {
        let cl = &self.cluster;
        let n = cl.num_nics();
        let (mut out, mut inn) = (vec![usize::MAX; n], vec![usize::MAX; n]);
        for s in 0..self.stages.len() {
            let mut touched = Vec::new();
            for x in self.stage_nic(s) {
                let r = &self.traffic.routes[x.route as usize];
                if x.stage as usize != s {
                    return Err(fail(format!("slice of route {} in stage {s} says stage {}", x.route, x.stage)));
                }
                let (a, b) = (cl.nic_of(r.su as usize), cl.nic_of(r.rv as usize));
                if cl.node_of_nic(a) == cl.node_of_nic(b) {
                    return Err(fail(format!("route {} crosses no node boundary", x.route)));
                }
                if (out[a] != usize::MAX && out[a] != b) || (inn[b] != usize::MAX && inn[b] != a) {
                    return Err(fail(format!("stage {s}: NIC {a} → {b} breaks the one-in/one-out rule")));
                }
                out[a] = b;
                inn[b] = a;
                touched.push((a, b));
            }
            for (a, b) in touched {
                out[a] = usize::MAX;
                inn[b] = usize::MAX;
            }
        }
        Ok(())
    }

    fn verify_queues(&self) -> Result<()> {
        let cl = &self.cluster;
        let q = self.queues();
        let mut nic = Vec::new();
        for (a, chunks) in q.nic.iter().enumerate() {
            if chunks.windows(2).any(|w| w[0].stage > w[1].stage) {
                return Err(fail(format!("NIC {a}: queue out of stage order")));
            }
            for c in chunks {
                if cl.nic_of(c.src as usize) != a || c.bytes > self.chunk_bytes {
                    return Err(fail(format!("NIC {a}: foreign or oversized chunk {c:?}")));
                }
                nic.push((c.route, c.offset, c.bytes, c.stage));
            }
        }
        let (mut send, mut recv) = (Vec::new(), Vec::new());
        for (slot, chunks) in q.copy.iter().enumerate() {
            if chunks.windows(2).any(|w| w[0].stage > w[1].stage) {
                return Err(fail(format!("engine slot {slot}: queue out of stage order")));
            }
            for c in chunks {
                if c.src as usize != slot / cl.ce_per_gpu || c.bytes > self.chunk_bytes {
                    return Err(fail(format!("engine slot {slot}: foreign or oversized chunk {c:?}")));
                }
                match c.kind {
                    CopyKind::Send => send.push((c.item, c.offset, c.bytes, c.stage)),
                    CopyKind::Recv => recv.push((c.item, c.dst, c.offset, c.bytes, c.stage)),
                    CopyKind::Native => {}
                }
            }
        }
        nic.sort_unstable();
        send.sort_unstable();
        if nic != send {
            return Err(fail("sender copies and NIC chunks differ (bytes, offsets or stages)".into()));
        }
        // Every destination of every route gets each NIC chunk once, in the same stage.
        let mut expect = Vec::new();
        for &(route, off, len, st) in &nic {
            let r = &self.traffic.routes[route as usize];
            self.traffic.for_each_hop(cl, r, |_, d, h| {
                if h == Hop::Copy(CopyKind::Recv) {
                    expect.push((route, d as u32, off, len, st));
                }
            });
        }
        expect.sort_unstable();
        recv.sort_unstable();
        if expect != recv {
            return Err(fail("receiver copies do not match the NIC chunks of their routes".into()));
        }
        Ok(())
    }
}
