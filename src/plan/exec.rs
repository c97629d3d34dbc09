//! A plan as the runtime executes it: a sequence of *steps* made of [`Move`]s (a byte
//! range from one GPU to another), which [`dataflow`] turns into one op per GPU whose
//! transfers wait only for those they depend on (or the runtime runs one op per step).
//! docs/design.md, "Inter-node path".
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

/// A transfer of one GPU's [`Dataflow`] op: its send or its receive of that index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dep {
    Send(u32),
    Recv(u32),
}

/// One GPU's part of a lowered plan as a single op whose transfers wait only for the
/// transfers they depend on, instead of one op per step (docs/design.md, "Staged plan"):
///
/// - a send out of a staging slot waits for the receives that filled the slot;
/// - a send out of a receive range (a fan-out or forwarded copy) waits for the receives
///   that wrote the bytes it reads;
/// - a receive into a staging slot waits for the sends that read the slot's last contents
///   (and the receives that wrote them): a slot is idle → filled → on the NIC → idle, and
///   these waits are its states;
/// - a send over the NIC waits for this GPU's NIC sends of the latest earlier step, and a
///   receive over the NIC for its NIC receives of the latest earlier step: each NIC carries
///   the plan's steps in order, one step's pieces at a time each way, as the planner's
///   stages assume (a NIC receiving the next step's piece beside the current one would slow
///   the current one's sender, whose next step waits for it).
///
/// Every wait points at a transfer of an earlier op of [`Steps`], and both ends of a move
/// list it in the same op, so no set of waits on any GPUs can close a cycle. Pure data: both ends of every move list it at
/// the same place among the moves between the two GPUs (plan order).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Dataflow {
    /// The moves from this GPU, in plan order.
    pub sends: Vec<Move>,
    /// The moves to this GPU, in plan order.
    pub recvs: Vec<Move>,
    /// Per send: the transfers that must be complete (a send done, a receive landed) before
    /// it starts.
    pub send_after: Vec<Vec<Dep>>,
    /// Per receive: the transfers that must be complete before its buffer is offered.
    pub recv_after: Vec<Vec<Dep>>,
}

/// A receive range written: its offset, its end and the receive.
type Written = Vec<(u64, u64, Dep)>;

/// GPU `me`'s moves of `steps` as one [`Dataflow`] op, on a cluster of `gpus_per_node` GPUs
/// per node. Moves never go from a GPU to itself (`lower` skips them).
pub fn dataflow(steps: &Steps, gpus_per_node: usize, me: u32) -> Dataflow {
    use std::collections::HashMap;
    let k = gpus_per_node.max(1) as u32;
    // Per slot: the receives that wrote its contents, the sends that read them since.
    let mut writers: [Vec<Dep>; 4] = Default::default();
    let mut readers: [Vec<Dep>; 4] = Default::default();
    // Receive ranges written so far, by flow: (offset, end, receive).
    let mut landed: HashMap<(u32, u32), Written> = HashMap::new();
    let (mut nic_last, mut nic_in_last): (Vec<Dep>, Vec<Dep>) = (Vec::new(), Vec::new());
    let mut df = Dataflow::default();
    for op in &steps.ops {
        let (mut reads, mut writes, mut nic, mut nic_in) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for m in op {
            if m.from == me {
                let d = Dep::Send(df.sends.len() as u32);
                let mut after = Vec::new();
                match m.src {
                    At::Slot { slot, .. } => {
                        after.extend_from_slice(&writers[slot as usize]);
                        reads.push((slot, d));
                    }
                    At::Recv { src, dst, off } => {
                        let end = off + m.bytes;
                        let w = landed.get(&(src, dst)).map_or(&[][..], |v| &v[..]);
                        after.extend(w.iter().filter(|(a, b, _)| *a < end && off < *b).map(|x| x.2));
                    }
                    At::Send { .. } => {}
                }
                df.sends.push(*m);
                df.send_after.push(waits(after, m.from / k != m.to / k, &nic_last, &mut nic, d));
            }
            if m.to == me {
                let d = Dep::Recv(df.recvs.len() as u32);
                let mut after = Vec::new();
                match m.dst {
                    At::Slot { slot, .. } => {
                        after.extend_from_slice(&readers[slot as usize]);
                        after.extend_from_slice(&writers[slot as usize]);
                        writes.push((slot, d));
                    }
                    At::Recv { src, dst, off } => landed.entry((src, dst)).or_default().push((off, off + m.bytes, d)),
                    At::Send { .. } => {}
                }
                df.recvs.push(*m);
                df.recv_after.push(waits(after, m.from / k != m.to / k, &nic_in_last, &mut nic_in, d));
            }
        }
        // The op's reads and writes of a slot take effect after it (the plan never reads and
        // writes one slot in one op): a write after reads starts the slot's next contents.
        for (slot, d) in reads {
            readers[slot as usize].push(d);
        }
        for slot in 0..4u8 {
            let s = slot as usize;
            let mut new = writes.iter().filter(|w| w.0 == slot).map(|w| w.1).peekable();
            if new.peek().is_some() && !readers[s].is_empty() {
                writers[s].clear();
                readers[s].clear();
            }
            writers[s].extend(new);
        }
        if !nic.is_empty() {
            nic_last = nic;
        }
        if !nic_in.is_empty() {
            nic_in_last = nic_in;
        }
    }
    df
}

/// `after`, and for a transfer `d` over the NIC (`nic`) the NIC's transfers of the latest
/// earlier step (`prev`), sorted, each once; `d` joins this step's (`cur`).
fn waits(mut after: Vec<Dep>, nic: bool, prev: &[Dep], cur: &mut Vec<Dep>, d: Dep) -> Vec<Dep> {
    if nic {
        after.extend_from_slice(prev);
        cur.push(d);
    }
    after.sort_unstable();
    after.dedup();
    after
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

    /// Plays every GPU's [`dataflow`] op of `c`'s plan in a random interleaving (`seed`):
    /// a transfer starts once its send's and its receive's waits are complete, runs for a
    /// while beside others and ends. Checks that no transfer starts while another running
    /// one writes what it reads or touches what it writes, that no byte is read before it
    /// is there, that nothing deadlocks, and that every byte of every flow arrives.
    fn check_dataflow(cl: &Cluster, c: &Collective, slot: u64, seed: u64) {
        check_dataflow_with(cl, c, slot, seed, |_| {})
    }

    /// [`check_dataflow`] with each GPU's op changed by `edit` first.
    fn check_dataflow_with(cl: &Cluster, c: &Collective, slot: u64, seed: u64, edit: impl Fn(&mut Dataflow)) {
        use crate::plan::rng::Rng;
        use std::collections::HashSet;
        let plan = build(cl, c, &PlanOptions { chunk_bytes: 16 }).unwrap();
        let steps = lower(&plan, Some(slot));
        let g = cl.num_gpus() as u32;
        let shared = c.shared_payload();
        let tag = |u: u32, v: u32, off: u64| (u, if shared { u32::MAX } else { v }, off);
        let dfs: Vec<Dataflow> = (0..g)
            .map(|me| {
                let mut df = dataflow(&steps, cl.gpus_per_node, me);
                edit(&mut df);
                df
            })
            .collect();
        for df in &dfs {
            assert_eq!(df.sends.len(), df.send_after.len());
            assert_eq!(df.recvs.len(), df.recv_after.len());
        }
        // Transfers: (sender, send index, receiver, receive index), the n-th send of u to v
        // meeting the n-th receive of v from u.
        let mut xs: Vec<(u32, usize, u32, usize)> = Vec::new();
        for u in 0..g {
            for v in (0..g).filter(|v| *v != u) {
                let s: Vec<usize> = (0..dfs[u as usize].sends.len()).filter(|&i| dfs[u as usize].sends[i].to == v).collect();
                let r: Vec<usize> = (0..dfs[v as usize].recvs.len()).filter(|&j| dfs[v as usize].recvs[j].from == u).collect();
                assert_eq!(s.len(), r.len(), "{u} -> {v}: sends and receives differ");
                for (i, j) in s.into_iter().zip(r) {
                    assert_eq!(dfs[u as usize].sends[i], dfs[v as usize].recvs[j], "{u} -> {v}: the ends list different moves");
                    xs.push((u, i, v, j));
                }
            }
        }
        // A byte's place: (gpu, region, index).
        let place = |gpu: u32, at: At, i: u64| -> (u32, At, u64) {
            match at {
                At::Slot { slot, off } => (gpu, At::Slot { slot, off: 0 }, off + i),
                At::Send { src, dst, off } => (gpu, At::Send { src, dst: if shared { u32::MAX } else { dst }, off: 0 }, off + i),
                At::Recv { src, dst, off } => (gpu, At::Recv { src, dst, off: 0 }, off + i),
            }
        };
        let mut mem: HashMap<(u32, At, u64), Tag> = HashMap::new();
        let mut done_s: Vec<Vec<bool>> = dfs.iter().map(|d| vec![false; d.sends.len()]).collect();
        let mut done_r: Vec<Vec<bool>> = dfs.iter().map(|d| vec![false; d.recvs.len()]).collect();
        let complete = |ds: &Vec<Vec<bool>>, dr: &Vec<Vec<bool>>, gpu: u32, after: &[Dep]| {
            after.iter().all(|d| match *d {
                Dep::Send(i) => ds[gpu as usize][i as usize],
                Dep::Recv(i) => dr[gpu as usize][i as usize],
            })
        };
        let mut rng = Rng::new(seed);
        let mut waiting: Vec<usize> = (0..xs.len()).collect();
        let mut running: Vec<usize> = Vec::new();
        let (mut reading, mut writing) = (HashSet::<(u32, At, u64)>::new(), HashSet::<(u32, At, u64)>::new());
        while !waiting.is_empty() || !running.is_empty() {
            let ready: Vec<usize> = (0..waiting.len())
                .filter(|&w| {
                    let (u, i, v, j) = xs[waiting[w]];
                    complete(&done_s, &done_r, u, &dfs[u as usize].send_after[i]) && complete(&done_s, &done_r, v, &dfs[v as usize].recv_after[j])
                })
                .collect();
            assert!(!ready.is_empty() || !running.is_empty(), "{}: deadlock with {} transfers waiting", c.name(), waiting.len());
            if !ready.is_empty() && (running.is_empty() || rng.below(2) == 0) {
                let x = waiting.swap_remove(ready[rng.below(ready.len() as u64) as usize]);
                let (u, i, v, _) = xs[x];
                let m = dfs[u as usize].sends[i];
                for b in 0..m.bytes {
                    let (r, w) = (place(u, m.src, b), place(v, m.dst, b));
                    assert!(!writing.contains(&r), "{}: {m:?} reads {r:?} while another transfer writes it", c.name());
                    assert!(!writing.contains(&w) && !reading.contains(&w), "{}: {m:?} writes {w:?} while another transfer uses it", c.name());
                    reading.insert(r);
                    writing.insert(w);
                }
                running.push(x);
            } else {
                let x = running.swap_remove(rng.below(running.len() as u64) as usize);
                let (u, i, v, j) = xs[x];
                let m = dfs[u as usize].sends[i];
                for b in 0..m.bytes {
                    let (r, w) = (place(u, m.src, b), place(v, m.dst, b));
                    let val = match m.src {
                        At::Send { src, dst, off } => tag(src, dst, off + b),
                        _ => *mem.get(&r).unwrap_or_else(|| panic!("{}: {m:?} read {r:?} before it arrived", c.name())),
                    };
                    reading.remove(&r);
                    writing.remove(&w);
                    mem.insert(w, val);
                }
                done_s[u as usize][i] = true;
                done_r[v as usize][j] = true;
            }
        }
        c.for_each_flow(g as usize, |u, v, b| {
            for i in 0..b {
                let got = mem.get(&(v as u32, At::Recv { src: u as u32, dst: v as u32, off: 0 }, i));
                assert_eq!(got, Some(&tag(u as u32, v as u32, i)), "flow {u} -> {v} byte {i} ({})", c.name());
            }
        });
    }

    /// The single-op form of every plan of `every_byte_arrives_through_the_slots` (and the
    /// split routes) is correct in any order its waits allow.
    #[test]
    fn dataflow_ops_arrive_in_any_order() {
        for (n, cl) in clusters().into_iter().enumerate() {
            let g = cl.num_gpus();
            let cs = [
                Collective::AllGather { bytes: 40 * g as u64 },
                Collective::AlltoAll { bytes: 24 * g as u64 },
                Collective::AlltoAllv { sizes: zipf_sizes(g, 120, 1.2, 7) },
                Collective::Broadcast { root: g - 1, bytes: 50 },
                Collective::AlltoAllv { sizes: zipf_sizes(g, 400, 3.0, 5) },
            ];
            for (i, c) in cs.iter().enumerate() {
                for (j, slot) in [16, 7].into_iter().enumerate() {
                    for seed in 0..3 {
                        check_dataflow(&cl, c, slot, (n * 100 + i * 10 + j) as u64 * 7 + seed);
                    }
                }
            }
        }
    }

    /// Without a slot's waits, some interleaving overwrites a piece before it left: the
    /// check above can fail.
    #[test]
    fn dataflow_without_slot_waits_races() {
        let cl = Cluster::new(2, 2);
        let c = Collective::AlltoAll { bytes: 64 * 4 };
        let plan = build(&cl, &c, &PlanOptions { chunk_bytes: 16 }).unwrap();
        let steps = lower(&plan, Some(16));
        let df = dataflow(&steps, 2, 1);
        // GPU 1 forwards GPU 0's pieces: its slot fills wait for the slot's last sends.
        let waits = df.recvs.iter().zip(&df.recv_after).filter(|(m, a)| matches!(m.dst, At::Slot { .. }) && a.iter().any(|d| matches!(d, Dep::Send(_)))).count();
        assert!(waits > 0, "no receive into a slot waits for the slot's previous send");
        let r = std::panic::catch_unwind(|| {
            for seed in 0..40 {
                check_dataflow_with(&cl, &c, 16, seed, |df| df.recv_after.iter_mut().for_each(|a| a.retain(|d| !matches!(d, Dep::Send(_)))));
            }
        });
        assert!(r.is_err(), "dropping the slots' waits went unnoticed");
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
