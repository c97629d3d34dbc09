//! Where every rank sits: hosts, (virtual) nodes, local ranks, GPUs, which ranks share a GPU,
//! which GPU pairs have peer access, each rank's forwarding peer, and the bandwidth of each
//! domain. Built from the [`RankRecord`]s that ranks all-gather at communicator creation,
//! so every rank computes the same `Topology`. Pure: no FFI, no I/O beyond
//! [`local_hostname`], testable anywhere.
//!
//! Terms:
//! - **host**: ranks with the same host name. GPUs, memory and NICs are per host.
//! - **node**: the unit the schedulers plan for (NVLink inside, NIC between). A host is one
//!   node unless `HOCCL_VIRTUAL_NODES=N` splits its ranks into N nodes (contiguous by rank),
//!   so that the inter-node paths can be tested on one machine. Ranks of different nodes
//!   never use peer access, even on one host.
//! - **local rank**: a rank's index among the ranks of its node (ranks in rank order);
//!   **host-local rank**: its index among the ranks of its host.
//! - **GPU**: `Config.device` if the rank set it (carried in its record), else host-local rank
//!   modulo the GPUs it sees. Several ranks may share a GPU.
//! - **forwarding peer** (`docs/design.md`, paper §3.3): the rank whose staging buffer and NIC carry
//!   a rank's inter-node traffic. `HOCCL_FORWARDING_PEERS` lists, for local rank i of every
//!   node, its forwarding local rank (with one rank per GPU that is "GPU i forwards through
//!   GPU map\[i\]"); it must be an involution (pairs and fixed points). Without it, each
//!   host's NIC-affine map ([`choose_forwarding`], read from sysfs and carried in the rank
//!   records) applies: a rank forwards through the lowest rank of its node on its
//!   forwarding GPU, or itself when its node has none. The map is by GPU ordinal, so it
//!   assumes the processes of a host see the same GPUs in the same order (one GPU visible
//!   per process gives a one-entry map: identity). Without either: identity.
#![forbid(unsafe_code)]

use crate::config::Config;
use crate::error::{Error, Result};
use std::collections::HashMap;

mod affinity;
mod record;
#[cfg(test)]
mod tests;

pub use affinity::{check_forwarding_map, choose_forwarding, is_pci_function, pci_distance, Affinity, PciClass, PciDistance, PciPath, GDR_LEVEL};
pub use record::{local_hostname, RankRecord};

/// Bytes per second of each domain, the scheduler's and simulator's cost model. Defaults
/// are the H200 measurements in TOOLCHAIN.md and the paper's NIC.
#[derive(Clone, Debug, PartialEq)]
pub struct Bandwidths {
    /// NVLink egress (and ingress) of one GPU, all its copy engines together: 391 GB/s
    /// measured for 3 concurrent fan-out `cuMemcpyAsync` copies on 4×H200 (NV18).
    pub nvlink: f64,
    /// One copy engine doing a peer copy: 273 GB/s measured at 2 MiB (397 GB/s at 1 GiB);
    /// the conservative figure suits chunk-sized copies.
    pub copy_engine: f64,
    /// Async copy engines per GPU (H200 reports 3).
    pub copy_engines_per_gpu: usize,
    /// NIC per GPU and direction: 50 GB/s (400 Gb/s; the paper's one NIC per GPU).
    pub nic: f64,
    /// Pinned host memory to or from a GPU: 55 GB/s measured (host staging, `shm` transport
    /// between virtual nodes).
    pub host_link: f64,
    /// A copy within one GPU's memory (ranks sharing a GPU): 2136 GB/s measured.
    pub local_copy: f64,
}

impl Default for Bandwidths {
    fn default() -> Self {
        Bandwidths {
            nvlink: 391e9,
            copy_engine: 273e9,
            copy_engines_per_gpu: 3,
            nic: 50e9,
            host_link: 55e9,
            local_copy: 2136e9,
        }
    }
}

/// One node: a host, or a contiguous part of a host's ranks under virtual nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub id: usize,
    /// Index into [`Topology::hostname`].
    pub host: usize,
    /// Global ranks, ascending; `ranks[l]` has local rank `l`.
    pub ranks: Vec<usize>,
}

/// Where one rank sits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankPlacement {
    pub rank: usize,
    pub pid: u32,
    pub host: usize,
    pub node: usize,
    /// Index among the ranks of its node.
    pub local_rank: usize,
    /// Index among the ranks of its host (equals `local_rank` without virtual nodes).
    pub host_local_rank: usize,
    /// GPU ordinal in this rank's process (0 on a host without GPUs).
    pub gpu: usize,
    pub gpu_count: usize,
    /// Lower-cased PCI bus id of `gpu`, empty if unknown.
    pub pci_bus_id: String,
    /// Global rank whose staging buffer and NIC carry this rank's inter-node traffic
    /// (itself under the identity map); always in the same node.
    pub forwarding_peer: usize,
}

/// The placement of every rank. Identical on every rank that built it from the same records.
#[derive(Clone, Debug, PartialEq)]
pub struct Topology {
    hosts: Vec<String>,
    nodes: Vec<Node>,
    ranks: Vec<RankPlacement>,
    /// Per rank: the ranks on the same physical GPU (itself included), ascending.
    sharers: Vec<Vec<usize>>,
    /// Per node: local × local, row-major; the device layer's answer for the two GPUs.
    peer: Vec<Vec<bool>>,
    bandwidths: Bandwidths,
}

const OP: &str = "Topology::build";

impl Topology {
    /// Build from the all-gathered records (index = rank). `config` supplies
    /// `virtual_nodes` and `forwarding_peers`; each rank's `Config.device` travels in its
    /// record. `peer_access(a, b)` answers whether GPU ordinal `a` can access GPU `b` on a
    /// host (the device layer's `cuDeviceCanAccessPeer`, or `|a, b| matrix[a][b]`); hosts are
    /// assumed alike. Every inconsistency is an `InvalidArgument` error.
    pub fn build(records: &[RankRecord], config: &Config, peer_access: impl Fn(usize, usize) -> bool) -> Result<Topology> {
        if records.is_empty() {
            return Err(Error::invalid_arg(OP, "no rank records"));
        }
        let (hosts, host_ranks) = group_by_host(records)?;
        let nodes = split_nodes(&hosts, &host_ranks, config.virtual_nodes)?;
        let mut ranks = place_ranks(records, &host_ranks, &nodes)?;
        if config.forwarding_peers.is_empty() {
            forward_by_affinity(&mut ranks, records, &nodes)?;
        } else {
            assign_forwarding(&mut ranks, &nodes, &config.forwarding_peers)?;
        }
        let sharers = gpu_sharers(&ranks);
        let peer = nodes
            .iter()
            .map(|n| {
                let gpus: Vec<usize> = n.ranks.iter().map(|&r| ranks[r].gpu).collect();
                gpus.iter().flat_map(|&a| gpus.iter().map(move |&b| (a, b))).map(|(a, b)| a == b || peer_access(a, b)).collect()
            })
            .collect();
        Ok(Topology { hosts, nodes, ranks, sharers, peer, bandwidths: Bandwidths::default() })
    }

    /// A made-up cluster for planning and simulation tests: `hosts` hosts of
    /// `ranks_per_host` ranks each seeing `gpus_per_host` GPUs, full peer access.
    pub fn synthetic(hosts: usize, ranks_per_host: usize, gpus_per_host: u32, config: &Config) -> Result<Topology> {
        let records: Vec<RankRecord> = (0..hosts)
            .flat_map(|h| {
                (0..ranks_per_host).map(move |l| RankRecord {
                    hostname: format!("host{h}"),
                    pid: 1000 + l as u32,
                    gpu_count: gpus_per_host,
                    gpu: None,
                    pci_bus_id: String::new(),
                    forwarding: Vec::new(),
                })
            })
            .collect();
        Topology::build(&records, config, |_, _| true)
    }

    /// Replace the default [`Bandwidths`].
    pub fn with_bandwidths(mut self, bandwidths: Bandwidths) -> Topology {
        self.bandwidths = bandwidths;
        self
    }

    /// Set every rank's PCI bus id once the GPUs are open (ids indexed by rank, all-gathered),
    /// which refines which ranks share a GPU.
    pub fn with_pci_bus_ids(mut self, ids: &[String]) -> Result<Topology> {
        if ids.len() != self.ranks.len() {
            return Err(Error::invalid_arg("Topology::with_pci_bus_ids", format!("{} ids for {} ranks", ids.len(), self.ranks.len())));
        }
        for (p, id) in self.ranks.iter_mut().zip(ids) {
            p.pci_bus_id = id.trim().to_ascii_lowercase();
        }
        self.sharers = gpu_sharers(&self.ranks);
        Ok(self)
    }

    // ---------------------------------------------------------------- queries ----------

    pub fn nranks(&self) -> usize {
        self.ranks.len()
    }
    pub fn nnodes(&self) -> usize {
        self.nodes.len()
    }
    pub fn nhosts(&self) -> usize {
        self.hosts.len()
    }
    pub fn ranks(&self) -> &[RankPlacement] {
        &self.ranks
    }
    pub fn rank(&self, rank: usize) -> Option<&RankPlacement> {
        self.ranks.get(rank)
    }
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }
    pub fn node(&self, node: usize) -> Option<&Node> {
        self.nodes.get(node)
    }
    pub fn hostname(&self, host: usize) -> Option<&str> {
        self.hosts.get(host).map(String::as_str)
    }
    pub fn node_of(&self, rank: usize) -> Option<usize> {
        self.rank(rank).map(|p| p.node)
    }
    pub fn local_rank(&self, rank: usize) -> Option<usize> {
        self.rank(rank).map(|p| p.local_rank)
    }
    pub fn gpu(&self, rank: usize) -> Option<usize> {
        self.rank(rank).map(|p| p.gpu)
    }
    pub fn forwarding_peer(&self, rank: usize) -> Option<usize> {
        self.rank(rank).map(|p| p.forwarding_peer)
    }
    /// The ranks of `rank`'s node (itself included), ascending; empty for a bad rank.
    pub fn local_peers(&self, rank: usize) -> &[usize] {
        self.node_of(rank).and_then(|n| self.nodes.get(n)).map_or(&[], |n| &n.ranks)
    }
    pub fn same_node(&self, a: usize, b: usize) -> bool {
        matches!((self.rank(a), self.rank(b)), (Some(x), Some(y)) if x.node == y.node)
    }
    pub fn same_host(&self, a: usize, b: usize) -> bool {
        matches!((self.rank(a), self.rank(b)), (Some(x), Some(y)) if x.host == y.host)
    }
    /// The ranks on `rank`'s physical GPU (itself included), ascending; empty for a bad rank.
    pub fn gpu_sharers(&self, rank: usize) -> &[usize] {
        self.sharers.get(rank).map_or(&[], Vec::as_slice)
    }
    /// The ranks that drive `rank`'s GPU from the same process (itself included), so share
    /// its CUDA context; ascending, empty for a bad rank.
    pub fn context_sharers(&self, rank: usize) -> Vec<usize> {
        let Some(me) = self.rank(rank) else { return Vec::new() };
        self.gpu_sharers(rank).iter().copied().filter(|&r| self.rank(r).is_some_and(|p| p.host == me.host && p.pid == me.pid)).collect()
    }
    pub fn shares_gpu(&self, a: usize, b: usize) -> bool {
        self.gpu_sharers(a).binary_search(&b).is_ok()
    }
    /// Whether `a` may copy straight into `b`'s GPU memory: same node, and the same GPU or a
    /// peer-accessible pair. False for ranks of different (even virtual) nodes.
    pub fn peer_access(&self, a: usize, b: usize) -> bool {
        let (Some(x), Some(y)) = (self.rank(a), self.rank(b)) else { return false };
        if x.node != y.node {
            return false;
        }
        if self.shares_gpu(a, b) {
            return true;
        }
        let n = self.nodes[x.node].ranks.len();
        self.peer[x.node].get(x.local_rank * n + y.local_rank).copied().unwrap_or(false)
    }
    pub fn bandwidths(&self) -> &Bandwidths {
        &self.bandwidths
    }
}

// ---------------------------------------------------------------- construction steps -----

/// Hosts in order of their lowest rank, and each host's ranks ascending.
fn group_by_host(records: &[RankRecord]) -> Result<(Vec<String>, Vec<Vec<usize>>)> {
    let mut index: HashMap<&str, usize> = HashMap::new();
    let mut hosts: Vec<String> = Vec::new();
    let mut host_ranks: Vec<Vec<usize>> = Vec::new();
    for (r, rec) in records.iter().enumerate() {
        if rec.hostname.trim().is_empty() {
            return Err(Error::invalid_arg(OP, format!("rank {r} has an empty host name")));
        }
        let h = *index.entry(rec.hostname.as_str()).or_insert_with(|| {
            hosts.push(rec.hostname.clone());
            host_ranks.push(Vec::new());
            hosts.len() - 1
        });
        host_ranks[h].push(r);
    }
    Ok((hosts, host_ranks))
}

/// Each host's ranks into `virtual_nodes` contiguous nodes whose sizes differ by at most one
/// (the first ones take the remainder).
fn split_nodes(hosts: &[String], host_ranks: &[Vec<usize>], virtual_nodes: usize) -> Result<Vec<Node>> {
    if virtual_nodes == 0 {
        return Err(Error::invalid_arg(OP, "virtual_nodes must be at least 1"));
    }
    let mut nodes = Vec::new();
    for (h, ranks) in host_ranks.iter().enumerate() {
        if virtual_nodes > ranks.len() {
            return Err(Error::invalid_arg(
                OP,
                format!(
                    "HOCCL_VIRTUAL_NODES={virtual_nodes} but host {} has only {} rank(s)",
                    hosts.get(h).map_or("?", String::as_str),
                    ranks.len()
                ),
            ));
        }
        let (base, extra) = (ranks.len() / virtual_nodes, ranks.len() % virtual_nodes);
        let mut at = 0;
        for v in 0..virtual_nodes {
            let len = base + usize::from(v < extra);
            nodes.push(Node { id: nodes.len(), host: h, ranks: ranks[at..at + len].to_vec() });
            at += len;
        }
    }
    Ok(nodes)
}

fn place_ranks(records: &[RankRecord], host_ranks: &[Vec<usize>], nodes: &[Node]) -> Result<Vec<RankPlacement>> {
    let mut placed: Vec<Option<RankPlacement>> = vec![None; records.len()];
    for node in nodes {
        for (local_rank, &r) in node.ranks.iter().enumerate() {
            let rec = &records[r];
            let host_local_rank = host_ranks[node.host].binary_search(&r).map_err(|_| Error::internal(OP, "rank not on its host"))?;
            let count = rec.gpu_count as usize;
            let gpu = match rec.gpu {
                Some(g) if (g as usize) < count.max(1) => g as usize,
                Some(g) => {
                    return Err(Error::invalid_arg(OP, format!("rank {r} asks for GPU {g} but sees {count} GPU(s)")));
                }
                None => host_local_rank % count.max(1),
            };
            placed[r] = Some(RankPlacement {
                rank: r,
                pid: rec.pid,
                host: node.host,
                node: node.id,
                local_rank,
                host_local_rank,
                gpu,
                gpu_count: count,
                pci_bus_id: rec.pci_bus_id.trim().to_ascii_lowercase(),
                forwarding_peer: r,
            });
        }
    }
    placed
        .into_iter()
        .enumerate()
        .map(|(r, p)| p.ok_or_else(|| Error::internal(OP, format!("rank {r} in no node"))))
        .collect()
}

/// Apply the forwarding map (local rank → local rank, the same for every node) after
/// checking that it fits every node and that every entry is a pair or a rank that forwards
/// through itself.
fn assign_forwarding(ranks: &mut [RankPlacement], nodes: &[Node], map: &[usize]) -> Result<()> {
    if map.is_empty() {
        return Ok(()); // identity: every rank stages its own traffic
    }
    for (i, &j) in map.iter().enumerate() {
        if j >= map.len() {
            return Err(Error::invalid_arg(OP, format!("HOCCL_FORWARDING_PEERS: entry {i} is {j}, beyond the {} entries", map.len())));
        }
        // A pair (j forwards through i), or a forwarder of its own (the form of the map
        // from NIC affinity, where several GPUs forward through one NIC-affine GPU).
        if map[j] != i && map[j] != j {
            return Err(Error::invalid_arg(
                OP,
                format!("HOCCL_FORWARDING_PEERS: {i} forwards through {j}, which forwards through {} (neither {i} nor itself)", map[j]),
            ));
        }
    }
    for node in nodes {
        if node.ranks.len() != map.len() {
            return Err(Error::invalid_arg(
                OP,
                format!(
                    "HOCCL_FORWARDING_PEERS has {} entries but node {} has {} local rank(s)",
                    map.len(),
                    node.id,
                    node.ranks.len()
                ),
            ));
        }
        for (l, &r) in node.ranks.iter().enumerate() {
            ranks[r].forwarding_peer = node.ranks[map[l]];
        }
    }
    Ok(())
}

/// Apply each host's GPU-level forwarding map (the lowest rank's record of the host): a
/// rank on GPU `g` forwards through the lowest rank of its node on GPU `map[g]`, or through
/// itself when its node has no rank there (a virtual node without the forwarding GPU) or
/// the map does not cover `g`. A map that is not a valid forwarding map is an error.
fn forward_by_affinity(ranks: &mut [RankPlacement], records: &[RankRecord], nodes: &[Node]) -> Result<()> {
    for node in nodes {
        let Some(&first) = node.ranks.first() else { continue };
        let host_first = ranks.iter().position(|p| p.host == ranks[first].host).unwrap_or(first);
        let map = &records[host_first].forwarding;
        affinity::check_forwarding_map(map).map_err(|why| Error::invalid_arg(OP, format!("rank {host_first}'s forwarding map: {why}")))?;
        for &r in &node.ranks {
            let Some(&h) = map.get(ranks[r].gpu) else { continue };
            let h = h as usize;
            if h != ranks[r].gpu {
                if let Some(&f) = node.ranks.iter().find(|&&x| ranks[x].gpu == h) {
                    ranks[r].forwarding_peer = f;
                }
            }
        }
    }
    Ok(())
}

/// Ranks on the same physical GPU: same host and the same PCI bus id. Ranks whose id is
/// unknown are grouped with each other by ordinal.
fn gpu_sharers(ranks: &[RankPlacement]) -> Vec<Vec<usize>> {
    let key = |p: &RankPlacement| {
        if p.pci_bus_id.is_empty() {
            (p.host, format!("#{}", p.gpu))
        } else {
            (p.host, p.pci_bus_id.clone())
        }
    };
    let mut groups: HashMap<(usize, String), Vec<usize>> = HashMap::new();
    for p in ranks {
        groups.entry(key(p)).or_default().push(p.rank);
    }
    // Ranks were visited in ascending order, so each group is sorted.
    ranks.iter().map(|p| groups.get(&key(p)).cloned().unwrap_or_else(|| vec![p.rank])).collect()
}
