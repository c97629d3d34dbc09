//! The plan's output for the engine: per copy engine, the ordered chunk copies; per NIC, the
//! ordered chunk transfers. Within a stage the chunks of the flows that share an engine are
//! interleaved in proportion to flow size (paper: flow-size-aware chunk scheduling), so the
//! stage's flows finish together; stages follow each other in order on every queue.
use super::cluster::CopyKind;
use super::traffic::Hop;
use super::Plan;

/// One chunk copy on a copy engine. `item` is a route index for `Send`/`Recv`, a native
/// flow index for `Native`; `offset` is the byte offset inside that route's bytes (add
/// `Route::offset` for the flow's payload) or native flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyChunk {
    pub stage: u32,
    pub kind: CopyKind,
    pub item: u32,
    pub src: u32,
    pub dst: u32,
    pub offset: u64,
    pub bytes: u64,
}

/// One chunk sent by a NIC: route `route`'s bytes `[offset, offset + bytes)` (from the
/// route's start) from staging GPU `src` to staging GPU `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NicChunk {
    pub stage: u32,
    pub route: u32,
    pub src: u32,
    pub dst: u32,
    pub offset: u64,
    pub bytes: u64,
}

/// `copy[gpu * ce_per_gpu + engine]` and `nic[sending NIC]`, each in execution order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Queues {
    pub copy: Vec<Vec<CopyChunk>>,
    pub nic: Vec<Vec<NicChunk>>,
}

/// Weighted interleaving of flows of `sizes` bytes cut into `chunk`-byte chunks: chunk `j` of
/// a flow with `n` chunks sits at position (j + ½)/n of the stage, so each flow gets engine
/// time in proportion to its size and all end together. Returns (flow, offset, len).
pub fn interleave(sizes: &[u64], chunk: u64) -> Vec<(usize, u64, u64)> {
    let counts: Vec<u64> = sizes.iter().map(|&b| b.div_ceil(chunk)).collect();
    let mut keys: Vec<(usize, u64)> = Vec::with_capacity(counts.iter().sum::<u64>() as usize);
    for (i, &n) in counts.iter().enumerate() {
        keys.extend((0..n).map(|j| (i, j)));
    }
    // Compare (2j+1)/(2n) exactly: (2j+1)·n' against (2j'+1)·n.
    keys.sort_by(|&(i, j), &(k, l)| {
        let lhs = (2 * j as u128 + 1) * counts[k] as u128;
        let rhs = (2 * l as u128 + 1) * counts[i] as u128;
        lhs.cmp(&rhs).then(i.cmp(&k))
    });
    keys.into_iter()
        .map(|(i, j)| {
            let off = j * chunk;
            (i, off, chunk.min(sizes[i] - off))
        })
        .collect()
}

struct CopyFlow {
    kind: CopyKind,
    item: u32,
    src: u32,
    dst: u32,
    offset: u64,
    bytes: u64,
}

impl Plan {
    /// Every engine's and NIC's queue. One pass over the plan.
    pub fn queues(&self) -> Queues {
        let cl = &self.cluster;
        let ce = cl.ce_per_gpu;
        let mut q = Queues { copy: vec![Vec::new(); cl.num_gpus() * ce], nic: vec![Vec::new(); cl.num_nics()] };
        let mut groups: Vec<Vec<CopyFlow>> = (0..cl.num_gpus() * ce).map(|_| Vec::new()).collect();
        let mut touched: Vec<usize> = Vec::new();
        for s in 0..self.stages.len() {
            for x in self.stage_nic(s) {
                let r = &self.traffic.routes[x.route as usize];
                self.traffic.for_each_hop(cl, r, |a, b, hop| match hop {
                    Hop::Nic => {
                        let mut off = 0;
                        while off < x.bytes {
                            let len = self.chunk_bytes.min(x.bytes - off);
                            q.nic[cl.nic_of(a)].push(NicChunk { stage: s as u32, route: x.route, src: a as u32, dst: b as u32, offset: x.offset + off, bytes: len });
                            off += len;
                        }
                    }
                    Hop::Copy(kind) => {
                        let slot = a * ce + cl.engine_for(kind, b);
                        touched.push(slot);
                        groups[slot].push(CopyFlow { kind, item: x.route, src: a as u32, dst: b as u32, offset: x.offset, bytes: x.bytes });
                    }
                });
            }
            for p in self.stage_natives(s) {
                let n = self.traffic.natives[p.native as usize];
                let slot = n.src as usize * ce + cl.engine_for(CopyKind::Native, n.dst as usize);
                touched.push(slot);
                groups[slot].push(CopyFlow { kind: CopyKind::Native, item: p.native, src: n.src, dst: n.dst, offset: p.offset, bytes: p.bytes });
            }
            touched.sort_unstable();
            touched.dedup();
            for &slot in &touched {
                let flows = std::mem::take(&mut groups[slot]);
                let sizes: Vec<u64> = flows.iter().map(|f| f.bytes).collect();
                for (i, off, len) in interleave(&sizes, self.chunk_bytes) {
                    let f = &flows[i];
                    q.copy[slot].push(CopyChunk { stage: s as u32, kind: f.kind, item: f.item, src: f.src, dst: f.dst, offset: f.offset + off, bytes: len });
                }
            }
            touched.clear();
        }
        q
    }
}
