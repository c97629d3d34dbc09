//! A plan as the runtime executes it: a sequence of *steps*, each one engine op on every
//! GPU that has work in it, made of [`Move`]s (a byte range from one GPU to another, or a
//! copy within one GPU). docs/design.md, "Inter-node path".
//!
//! A route u → v whose NIC piece is in step t moves in three ops, a software pipeline:
//! op t − 1 copies the piece from u into a send slot of its forwarder ū (skipped when ū = u),
//! op t sends it from ū over the NIC to v̄ (into a receive slot, or into the receive buffer
//! when v̄ = v or the payload fans out), op t + 1 copies it from v̄ to v (fan-out: to every
//! GPU of v's node). So in one op a forwarder fills the slot of step t + 1 while the NIC
//! carries step t and the copy-out drains step t − 1: the copy of one chunk overlaps the
//! send of the previous one. A step has at most one outgoing and one incoming NIC piece per
//! NIC (the planner's stages), and each staging GPU owns one NIC, so two send slots and two
//! receive slots (by step parity) are all a forwarder needs: a slot is filled in op t − 1,
//! on the NIC in op t and idle from op t + 1, and the next piece that uses it is filled no
//! earlier than op t + 1. Stages whose NIC pieces exceed a slot are cut into several steps.
//! A route that is one part of a split flow reads and writes the flow's send and receive
//! ranges at its offset in the flow (`Route::offset`); its slot ranges are its own.
//! Pure data: every rank lowers the same plan to the same steps.
use super::Plan;

/// Where a move reads or writes on its GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum At {
    /// The send range of logical flow `src → dst`, on GPU `src`, at `off`.
    Send { src: u32, dst: u32, off: u64 },
    /// The receive range of logical flow `src → dst`, on GPU `dst`, at `off`.
    Recv { src: u32, dst: u32, off: u64 },
    /// Staging slot `slot` of the GPU (0, 1: sending, by step parity; 2, 3: receiving), at
    /// `off`.
    Slot { slot: u8, off: u64 },
}

/// `bytes` from `src` on GPU `from` to `dst` on GPU `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Move {
    pub from: u32,
    pub to: u32,
    pub src: At,
    pub dst: At,
    pub bytes: u64,
}

impl Move {
    /// Whether this move reads or writes a staging slot.
    pub fn staged(&self) -> bool {
        matches!(self.src, At::Slot { .. }) || matches!(self.dst, At::Slot { .. })
    }
}

/// The ops of one plan, in order (an op with no move for a GPU is skipped there).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Steps {
    pub ops: Vec<Vec<Move>>,
    /// Planner stages before cutting.
    pub stages: usize,
    /// Steps after cutting NIC pieces to the slot size.
    pub steps: usize,
}

/// Lowers `plan` into ops. `slot`: bytes of one staging slot; NIC pieces are cut so that no
/// piece exceeds it (`None`: no cutting, for clusters where every GPU stages through itself
/// and no slot is used).
pub fn lower(plan: &Plan, slot: Option<u64>) -> Steps {
    let cl = &plan.cluster;
    let fan = plan.traffic.fan_out;
    let k = cl.gpus_per_node as u32;
    // Steps: each stage's NIC slices, cut into pieces that fit a slot. The slices one NIC
    // sends in a stage (several routes between one NIC pair may share it) are laid end to
    // end in its slot, so a step's pieces of one NIC fill at most one slot.
    struct Step {
        nic: Vec<(u32, u64, u64, u64)>, // route, offset in the route, bytes, offset in the slot
        native: Vec<(u32, u64, u64)>,
    }
    let mut steps: Vec<Step> = Vec::new();
    let cap = slot.map(|c| c.max(1));
    for s in 0..plan.stages.len() {
        let nic = plan.stage_nic(s);
        let first = steps.len();
        let mut pos: Vec<(u32, u64)> = Vec::new(); // per sending staging GPU: bytes laid out
        let put = |steps: &mut Vec<Step>, i: usize, piece: (u32, u64, u64, u64)| {
            while steps.len() <= first + i {
                steps.push(Step { nic: Vec::new(), native: Vec::new() });
            }
            steps[first + i].nic.push(piece);
        };
        for x in nic {
            let ub = plan.traffic.routes[x.route as usize].su;
            let p = match pos.iter().position(|e| e.0 == ub) {
                Some(i) => i,
                None => {
                    pos.push((ub, 0));
                    pos.len() - 1
                }
            };
            let mut at = 0;
            while at < x.bytes {
                let laid = pos[p].1;
                let (i, in_slot, room) = match cap {
                    Some(c) => ((laid / c) as usize, laid % c, c - laid % c),
                    None => (0, 0, u64::MAX),
                };
                let b = room.min(x.bytes - at);
                put(&mut steps, i, (x.route, x.offset + at, b, in_slot));
                at += b;
                pos[p].1 += b;
            }
        }
        if steps.len() == first {
            steps.push(Step { nic: Vec::new(), native: Vec::new() });
        }
        for p in plan.stage_natives(s) {
            steps[first].native.push((p.native, p.offset, p.bytes));
        }
    }
    // Op j holds step j − 1's NIC pieces: op 0 the first copies in, the last op the last
    // copies out.
    let nops = steps.len() + 2;
    let mut ops: Vec<Vec<Move>> = vec![Vec::new(); nops];
    for (t, st) in steps.iter().enumerate() {
        let par = (t % 2) as u8;
        for &(r, at, bytes, so) in &st.nic {
            let route = plan.traffic.routes[r as usize];
            // The piece's place in the flow: a split route's part starts at its offset.
            let off = route.offset + at;
            let u = route.src;
            let (ub, vb) = (route.su, route.rv);
            // The flow that names u's send range: fan-out reads the one payload.
            let v_named = if fan { vb } else { route.dst };
            let from_user = At::Send { src: u, dst: v_named, off };
            let src = if ub == u {
                from_user
            } else {
                ops[t].push(Move { from: u, to: ub, src: from_user, dst: At::Slot { slot: par, off: so }, bytes });
                At::Slot { slot: par, off: so }
            };
            let dst = if fan || vb == route.dst { At::Recv { src: u, dst: vb, off } } else { At::Slot { slot: 2 + par, off: so } };
            ops[t + 1].push(Move { from: ub, to: vb, src, dst, bytes });
            if fan {
                let node = route.dst * k;
                for v in (node..node + k).filter(|v| *v != vb) {
                    ops[t + 2].push(Move { from: vb, to: v, src: dst, dst: At::Recv { src: u, dst: v, off }, bytes });
                }
            } else if vb != route.dst {
                ops[t + 2].push(Move { from: vb, to: route.dst, src: dst, dst: At::Recv { src: u, dst: route.dst, off }, bytes });
            }
        }
        for &(nat, off, bytes) in &st.native {
            let n = plan.traffic.natives[nat as usize];
            ops[t + 1].push(Move { from: n.src, to: n.dst, src: At::Send { src: n.src, dst: n.dst, off }, dst: At::Recv { src: n.src, dst: n.dst, off }, bytes });
        }
    }
    Steps { ops, stages: plan.stages.len(), steps: steps.len() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{build, zipf_sizes, Cluster, Collective, PlanOptions};
    use std::collections::HashMap;

    /// A byte's identity: the flow it belongs to (`u32::MAX` as destination for a shared
    /// payload) and its offset.
    type Tag = (u32, u32, u64);

    /// Executes `steps` on symbolic memory and checks that every byte of every logical
    /// flow of `c` arrives at its place, written there once, that no op reads what it
    /// writes or writes a byte twice, and that a slot is never overwritten before its piece
    /// has left. Returns the steps and how many routes are parts of a split flow.
    fn check(cl: &Cluster, c: &Collective, slot: Option<u64>) -> (Steps, usize) {
        let plan = build(cl, c, &PlanOptions { chunk_bytes: 16 }).unwrap();
        plan.verify().unwrap();
        let parts = plan.traffic.routes.iter().filter(|r| r.offset > 0 || plan.traffic.routes.iter().any(|o| (o.src, o.dst) == (r.src, r.dst) && o.offset > 0)).count();
        let steps = lower(&plan, slot);
        let g = cl.num_gpus();
        let shared = c.shared_payload();
        let tag = |u: u32, v: u32, off: u64| (u, if shared { u32::MAX } else { v }, off);
        // Memory: (gpu, region, byte) → tag. Send ranges are read from the collective.
        let mut mem: HashMap<(u32, At), Tag> = HashMap::new();
        let key = |at: At, i: u64| match at {
            At::Send { src, dst, off } => At::Send { src, dst: if shared { u32::MAX } else { dst }, off: off + i },
            At::Recv { src, dst, off } => At::Recv { src, dst, off: off + i },
            slot @ At::Slot { .. } => slot,
        };
        let mut slot_mem: HashMap<(u32, u8, u64), Option<Tag>> = HashMap::new();
        for ops in &steps.ops {
            let mut writes: Vec<((u32, At, u64), Tag)> = Vec::new();
            for m in ops {
                for at in [m.src, m.dst] {
                    if let (Some(c), At::Slot { off, .. }) = (slot, at) {
                        assert!(off + m.bytes <= c, "piece of {} bytes at {off} in a slot of {c}", m.bytes);
                    }
                }
                for i in 0..m.bytes {
                    let v = match m.src {
                        At::Send { src, dst, off } => {
                            assert_eq!(src, m.from);
                            tag(src, dst, off + i)
                        }
                        At::Slot { slot, off } => slot_mem.get(&(m.from, slot, off + i)).copied().flatten().expect("read of an empty slot byte"),
                        at @ At::Recv { .. } => *mem.get(&(m.from, key(at, i))).expect("forwarded a byte that had not arrived"),
                    };
                    let w = match m.dst {
                        At::Slot { slot, off } => (m.to, At::Slot { slot, off: 0 }, off + i),
                        at => (m.to, key(at, i), 0),
                    };
                    assert!(!writes.iter().any(|(k, _)| *k == w), "byte written twice in one op: {w:?}");
                    writes.push((w, v));
                }
            }
            // Reads above saw the memory before the op; a read of a byte this op writes
            // would race.
            for m in ops {
                for i in 0..m.bytes {
                    let r = match m.src {
                        At::Slot { slot, off } => (m.from, At::Slot { slot, off: 0 }, off + i),
                        At::Send { .. } => continue,
                        at => (m.from, key(at, i), 0),
                    };
                    assert!(!writes.iter().any(|(k, _)| *k == r), "op reads a byte it writes: {r:?}");
                }
            }
            for ((gpu, at, i), v) in writes {
                match at {
                    At::Slot { slot, .. } => {
                        slot_mem.insert((gpu, slot, i), Some(v));
                    }
                    _ => {
                        assert!(mem.insert((gpu, at), v).is_none(), "byte written twice: {gpu} {at:?}");
                    }
                }
            }
        }
        c.for_each_flow(g, |u, v, b| {
            for i in 0..b {
                let got = mem.get(&(v as u32, At::Recv { src: u as u32, dst: v as u32, off: i }));
                assert_eq!(got, Some(&tag(u as u32, v as u32, i)), "flow {u} -> {v} byte {i} ({})", c.name());
            }
        });
        (steps, parts)
    }

    fn clusters() -> Vec<Cluster> {
        let mut v = Vec::new();
        for (n, k) in [(2, 1), (2, 2), (3, 2), (4, 2), (2, 4), (3, 3)] {
            v.push(Cluster::new(n, k).with_identity_forwarding());
            v.push(Cluster::new(n, k));
            // A star: every GPU of a node forwards through local GPU 0.
            let mut star = Cluster::new(n, k);
            star.forwarding_peer = vec![0; k];
            v.push(star);
            // Routes on any NIC of their nodes.
            for fwd in [(0..k).collect(), Cluster::new(n, k).forwarding_peer] {
                let mut b = Cluster::new(n, k);
                b.forwarding_peer = fwd;
                b.balance_nics = true;
                v.push(b);
            }
        }
        v
    }

    #[test]
    fn every_byte_arrives_through_the_slots() {
        for cl in clusters() {
            let g = cl.num_gpus();
            let cs = [
                Collective::AllGather { bytes: 40 * g as u64 },
                Collective::AlltoAll { bytes: 24 * g as u64 },
                Collective::AlltoAllv { sizes: zipf_sizes(g, 120, 1.2, 7) },
                Collective::Broadcast { root: g - 1, bytes: 50 },
                Collective::AlltoAllv { sizes: (0..g * g).map(|i| if i % g == 1 { 37 } else { 0 }).collect() },
            ];
            for c in &cs {
                for slot in [Some(16), Some(7), None] {
                    let fwd = cl.forwarding_peer.iter().enumerate().any(|(l, f)| l != *f) || cl.balance_nics;
                    if fwd && slot.is_none() {
                        continue;
                    }
                    check(&cl, c, slot);
                }
            }
        }
    }

    /// Identity forwarding never touches a slot; forwarding does, and cuts pieces.
    #[test]
    fn slots_only_with_forwarding() {
        let c = Collective::AlltoAll { bytes: 64 * 4 };
        let direct = check(&Cluster::new(2, 2).with_identity_forwarding(), &c, Some(16)).0;
        assert!(direct.ops.iter().flatten().all(|m| !m.staged()));
        let fwd = check(&Cluster::new(2, 2), &c, Some(16)).0;
        assert!(fwd.ops.iter().flatten().any(|m| m.staged()));
        assert!(fwd.steps > fwd.stages, "64-byte pieces in 16-byte slots take several steps");
    }

    /// Flows split over several NIC pairs (balanced NICs, one dominant flow per node pair):
    /// each part's bytes land at their offsets in the flow, through the slots or directly.
    #[test]
    fn split_routes_arrive_at_their_offsets() {
        let mut split = 0;
        for cl in clusters().into_iter().filter(|c| c.balance_nics && c.nodes > 1) {
            let g = cl.num_gpus();
            let k = cl.gpus_per_node;
            // GPU u sends 300 + 41·u bytes to the first GPU of the next node, 3 to the others.
            let sizes = (0..g * g).map(|i| if i / g == i % g { 0 } else if i % g == ((i / g) / k + 1) % cl.nodes * k { 300 + 41 * (i / g) as u64 } else { 3 }).collect();
            let skewed = Collective::AlltoAllv { sizes };
            for c in [&skewed, &Collective::AlltoAllv { sizes: zipf_sizes(g, 400, 3.0, 5) }] {
                for slot in [Some(16), Some(7), Some(1000)] {
                    split += check(&cl, c, slot).1;
                }
            }
        }
        assert!(split > 0, "no flow was split");
    }
}
