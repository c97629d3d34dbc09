//! GPU ↔ NIC affinity and the forwarding choice (paper §3.3), from PCIe placement alone.
//! Pure: the caller (`crate::sysfs`) reads the PCI paths; this module classifies distances
//! and chooses, so every choice is testable with made-up machines.
//!
//! Distances follow NCCL's classes, nearest first:
//! - **PIX**: both devices below one PCIe switch (at most two bridges up from either);
//! - **PXB**: below one root port through several switches, without the host bridge;
//! - **PHB**: through a PCIe host bridge of one CPU (different root ports, or different
//!   root complexes on one NUMA node);
//! - **SYS**: across the interconnect between CPUs (different NUMA nodes, or unknown).
//!
//! GPUDirect RDMA is worth it up to PXB (NCCL's default `NCCL_NET_GDR_LEVEL`): a GPU with
//! a NIC that near stages its own inter-node traffic; a GPU without one forwards it over
//! NVLink to the NIC-affine GPU whose NIC is nearest to it.
use crate::error::{Error, Result};
use std::fmt;

/// NCCL's PCIe distance classes, nearest first (the order is the comparison).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PciClass {
    Pix,
    Pxb,
    Phb,
    Sys,
}

impl PciClass {
    pub fn name(self) -> &'static str {
        match self {
            PciClass::Pix => "PIX",
            PciClass::Pxb => "PXB",
            PciClass::Phb => "PHB",
            PciClass::Sys => "SYS",
        }
    }
}

/// A distance: the class, then the bridges from the farther device up to the common
/// ancestor (0 when the devices are in different PCI trees). Ordered nearest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciDistance {
    pub class: PciClass,
    pub hops: u32,
}

impl fmt::Display for PciDistance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.class.name())
    }
}

/// Where a PCI device hangs: the components of its `/sys/devices` path from the root
/// complex down (`["pci0000:17", "0000:17:01.0", "0000:18:00.0", …, the device]`) and the
/// NUMA node its root reports (`None`: unknown, as sysfs' `-1`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciPath {
    pub components: Vec<String>,
    pub numa_node: Option<u32>,
}

impl PciPath {
    /// From a path below `/sys/devices` (`pci0000:17/0000:17:01.0/…`, or the whole
    /// `/sys/devices/pci0000:17/…`). Components after the last PCI function are dropped (a
    /// net device's `virtio2`); a path with no root complex (`pciDDDD:BB`) or no PCI function
    /// is an `InvalidArgument` error.
    pub fn parse(path: &str, numa_node: Option<u32>) -> Result<PciPath> {
        const OP: &str = "PciPath::parse";
        let parts: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
        let root = parts.iter().position(|c| is_pci_root(c)).ok_or_else(|| Error::invalid_arg(OP, format!("{path:?} has no PCI root complex (pciDDDD:BB)")))?;
        let last = parts.iter().rposition(|c| is_pci_function(c)).filter(|&l| l > root).ok_or_else(|| Error::invalid_arg(OP, format!("{path:?} names no PCI function below its root")))?;
        Ok(PciPath { components: parts[root..=last].iter().map(|c| c.to_ascii_lowercase()).collect(), numa_node })
    }

    /// The device's own PCI address (the last component).
    pub fn bus_id(&self) -> &str {
        self.components.last().map_or("", String::as_str)
    }
}

/// `pciDDDD:BB` (a root complex in `/sys/devices`).
fn is_pci_root(c: &str) -> bool {
    c.strip_prefix("pci").is_some_and(|r| r.len() == 7 && r.as_bytes()[4] == b':' && r.chars().filter(|&x| x != ':').all(|x| x.is_ascii_hexdigit()))
}

/// `DDDD:BB:DD.F`, a PCI function.
pub fn is_pci_function(c: &str) -> bool {
    let b = c.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && c.chars().enumerate().all(|(i, x)| matches!(i, 4 | 7 | 10) || x.is_ascii_hexdigit())
}

/// The distance between two PCI devices (symmetric).
pub fn pci_distance(a: &PciPath, b: &PciPath) -> PciDistance {
    let common = a.components.iter().zip(&b.components).take_while(|(x, y)| x == y).count();
    if common == 0 {
        // Different root complexes: one CPU's host bridges, or two CPUs.
        let same_cpu = matches!((a.numa_node, b.numa_node), (Some(x), Some(y)) if x == y);
        return PciDistance { class: if same_cpu { PciClass::Phb } else { PciClass::Sys }, hops: 0 };
    }
    let hops = (a.components.len().max(b.components.len()) - common) as u32;
    let class = if common == 1 {
        PciClass::Phb // only the root complex in common: different root ports
    } else if hops <= 2 {
        PciClass::Pix // device → downstream port → the switch's upstream port
    } else {
        PciClass::Pxb
    };
    PciDistance { class, hops }
}

/// What the forwarding choice decided for the GPUs of one host (indices: GPU ordinals in
/// the order given, NIC indices in the order given).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Affinity {
    /// The NIC that carries each GPU's inter-node traffic (its forwarder's NIC); `None`
    /// when the host has no usable NIC.
    pub nic_of_gpu: Vec<Option<usize>>,
    /// The GPU whose staging buffer and NIC carry each GPU's traffic; a forwarder forwards
    /// through itself. Identity when every GPU has a NIC within PXB, or no NIC is usable.
    pub forwarding: Vec<usize>,
}

impl Affinity {
    /// Every GPU stages its own traffic; no NIC.
    pub fn identity(gpus: usize) -> Affinity {
        Affinity { nic_of_gpu: vec![None; gpus], forwarding: (0..gpus).collect() }
    }
}

/// The farthest NIC a GPU stages through itself (NCCL's default GPUDirect RDMA level).
pub const GDR_LEVEL: PciClass = PciClass::Pxb;

/// Chooses each GPU's NIC and forwarding GPU. `distance[g][n]`: GPU `g` to NIC `n`;
/// `usable[n]`: NIC `n` has an active port. Rules, deterministic in the inputs:
/// 1. each GPU takes its nearest usable NIC; ties go to the NIC serving the fewest GPUs so
///    far, then the lower index; GPUs choose nearest-first (then by ordinal), so GPUs
///    beside two NICs spread over both;
/// 2. a GPU whose NIC is within [`GDR_LEVEL`] forwards through itself;
/// 3. any other GPU forwards through a self-forwarding GPU — the one whose NIC is nearest
///    to it, then the one carrying the fewest GPUs so far, then the lower ordinal — and
///    uses that GPU's NIC. When no GPU is within [`GDR_LEVEL`] of a NIC, every GPU stages
///    its own traffic through its nearest NIC.
///
/// A matrix whose rows differ in length from `usable` is an `InvalidArgument` error.
pub fn choose_forwarding(distance: &[Vec<PciDistance>], usable: &[bool]) -> Result<Affinity> {
    const OP: &str = "topology::choose_forwarding";
    if let Some(g) = distance.iter().position(|row| row.len() != usable.len()) {
        return Err(Error::invalid_arg(OP, format!("GPU {g} has {} distances for {} NICs", distance[g].len(), usable.len())));
    }
    let gpus = distance.len();
    let nics: Vec<usize> = (0..usable.len()).filter(|&n| usable[n]).collect();
    if nics.is_empty() {
        return Ok(Affinity::identity(gpus));
    }
    let best = |g: usize| nics.iter().map(|&n| distance[g][n]).min().unwrap_or(PciDistance { class: PciClass::Sys, hops: u32::MAX });
    let mut order: Vec<usize> = (0..gpus).collect();
    order.sort_by_key(|&g| (best(g), g));
    let mut load = vec![0usize; usable.len()];
    let mut nearest = vec![0usize; gpus];
    for &g in &order {
        let n = *nics.iter().min_by_key(|&&n| (distance[g][n], load[n], n)).expect("nics is not empty");
        load[n] += 1;
        nearest[g] = n;
    }
    let affine: Vec<usize> = (0..gpus).filter(|&g| distance[g][nearest[g]].class <= GDR_LEVEL).collect();
    if affine.is_empty() {
        return Ok(Affinity { nic_of_gpu: nearest.into_iter().map(Some).collect(), forwarding: (0..gpus).collect() });
    }
    let mut forwarding: Vec<usize> = (0..gpus).collect();
    let mut nic_of_gpu: Vec<Option<usize>> = nearest.iter().map(|&n| Some(n)).collect();
    let mut carried = vec![0usize; gpus];
    for &g in &order {
        if affine.contains(&g) {
            continue;
        }
        let h = *affine.iter().min_by_key(|&&h| (distance[g][nearest[h]], carried[h], h)).expect("affine is not empty");
        carried[h] += 1;
        forwarding[g] = h;
        nic_of_gpu[g] = Some(nearest[h]);
    }
    Ok(Affinity { nic_of_gpu, forwarding })
}

/// Checks a host's GPU-level forwarding map as it arrives in a rank record: every entry a
/// GPU of the map, and every forwarder forwarding through itself.
pub fn check_forwarding_map(map: &[u32]) -> std::result::Result<(), String> {
    for (g, &h) in map.iter().enumerate() {
        let h = h as usize;
        if h >= map.len() {
            return Err(format!("GPU {g} forwards through GPU {h}, beyond the {} GPUs", map.len()));
        }
        if map[h] as usize != h {
            return Err(format!("GPU {g} forwards through GPU {h}, which forwards through GPU {}", map[h]));
        }
    }
    Ok(())
}
