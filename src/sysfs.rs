//! The PCIe placement of this host's GPUs and NICs, read from sysfs, and the forwarding
//! choice it leads to ([`crate::topology::choose_forwarding`], which is pure; this module
//! is its I/O). Every reader takes the file-system root (`/` on a real host), so tests run
//! on a fake tree in a temporary directory.
//!
//! NICs: every RDMA device (`/sys/class/infiniband/*`, its ports' state, rate and link
//! layer), and every network interface (`/sys/class/net/*`) whose `device` link leads to a
//! PCI function and that is not the netdev of an RDMA device already listed. Interfaces
//! without a `device` link (loopback, veth, bridges, ifb, tunnels) are virtual and skipped.
//! GPUs: `/sys/bus/pci/devices/<bus id>`, the bus id from the device layer.
#![forbid(unsafe_code)]

use crate::topology::{choose_forwarding, is_pci_function, pci_distance, Affinity, PciDistance, PciPath};
use std::path::{Path, PathBuf};

/// One NIC as sysfs shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct Nic {
    /// The RDMA device (`mlx5_0`) or the interface (`eth0`).
    pub name: String,
    /// True for an RDMA device, false for a plain network interface.
    pub rdma: bool,
    /// The network interfaces on the same PCI function (an RDMA device's RoCE or IPoIB
    /// netdev), ascending.
    pub netdevs: Vec<String>,
    /// `InfiniBand` or `Ethernet` (an RDMA device's chosen port; an interface's `type`).
    pub link_layer: String,
    /// Gb/s, when sysfs states it.
    pub rate_gbps: Option<f64>,
    /// `ACTIVE`, `DOWN`, … (RDMA port) or `up`, `down`, … (interface `operstate`).
    pub state: String,
    /// The port number the fields describe (RDMA devices: the first active port, else the
    /// first port); `None` for an interface.
    pub port: Option<u32>,
    /// Whether traffic can use it: an active RDMA port, or an interface that is up.
    pub usable: bool,
    /// Its PCI placement.
    pub pci: PciPath,
}

/// One GPU's placement: its bus id and, when sysfs has it, its PCI path.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuPci {
    pub bus_id: String,
    pub pci: Option<PciPath>,
}

/// What this host looks like to the forwarding choice.
#[derive(Clone, Debug, PartialEq)]
pub struct HostNics {
    pub gpus: Vec<GpuPci>,
    pub nics: Vec<Nic>,
    /// `distance[g][n]`: GPU `g` to NIC `n`; empty rows when a GPU's path is unknown.
    pub distance: Vec<Vec<PciDistance>>,
    /// The choice; `None` when some GPU's placement is unknown (the topology then keeps
    /// identity forwarding).
    pub affinity: Option<Affinity>,
}

impl HostNics {
    /// Reads the NICs under `root` and places `gpu_bus_ids` (ordinal order) against them.
    pub fn read(root: &Path, gpu_bus_ids: &[String]) -> HostNics {
        let nics = read_nics(root);
        let gpus: Vec<GpuPci> = gpu_bus_ids.iter().map(|id| GpuPci { bus_id: normalize_bus_id(id), pci: pci_path_of(root, id) }).collect();
        let distance: Vec<Vec<PciDistance>> =
            gpus.iter().map(|g| g.pci.as_ref().map_or_else(Vec::new, |p| nics.iter().map(|n| pci_distance(p, &n.pci)).collect())).collect();
        let affinity = if gpus.iter().all(|g| g.pci.is_some()) {
            let usable: Vec<bool> = nics.iter().map(|n| n.usable).collect();
            choose_forwarding(&distance, &usable).ok()
        } else {
            None
        };
        HostNics { gpus, nics, distance, affinity }
    }

    /// The forwarding map for the rank record (GPU ordinal → forwarding GPU ordinal); empty
    /// when no usable NIC exists or a GPU's placement is unknown, which leaves identity.
    pub fn forwarding_map(&self) -> Vec<u32> {
        match &self.affinity {
            Some(a) if a.nic_of_gpu.iter().any(Option::is_some) => a.forwarding.iter().map(|&g| g as u32).collect(),
            _ => Vec::new(),
        }
    }
}

/// This host's forwarding map for GPUs with these bus ids (ordinal order), from `/sys`.
/// Logged at debug level; empty when nothing usable was found.
pub fn forwarding_map(gpu_bus_ids: &[String]) -> Vec<u32> {
    let host = HostNics::read(Path::new("/"), gpu_bus_ids);
    let map = host.forwarding_map();
    log::debug!(
        "hoccl: NICs {:?}, GPU forwarding map {map:?} (empty: identity)",
        host.nics.iter().map(|n| format!("{} {} {}", n.name, n.state, n.pci.bus_id())).collect::<Vec<_>>()
    );
    map
}

/// `00000000:18:00.0` (CUDA's 8-digit domain) or upper case → `0000:18:00.0`.
pub fn normalize_bus_id(id: &str) -> String {
    let id = id.trim().to_ascii_lowercase();
    match id.split_once(':') {
        Some((dom, rest)) if dom.len() == 8 && dom.starts_with("0000") => format!("{}:{rest}", &dom[4..]),
        _ => id,
    }
}

/// The PCI path of the device with this bus id (`/sys/bus/pci/devices/<id>`), `None` when
/// sysfs does not have it.
pub fn pci_path_of(root: &Path, bus_id: &str) -> Option<PciPath> {
    let id = normalize_bus_id(bus_id);
    if !is_pci_function(&id) {
        return None;
    }
    pci_path_at(root, &root.join("sys/bus/pci/devices").join(id))
}

/// The PCI path of the PCI function that `link` (a `device` link, or a device directory)
/// resolves to, walking up past non-PCI children such as `virtio2`.
fn pci_path_at(root: &Path, link: &Path) -> Option<PciPath> {
    let real = std::fs::canonicalize(link).ok()?;
    let devices = std::fs::canonicalize(root.join("sys/devices")).ok()?;
    let rel = real.strip_prefix(&devices).ok()?;
    let mut dir = real.clone();
    while dir.file_name().and_then(|f| f.to_str()).is_some_and(|f| !is_pci_function(f)) {
        if !dir.pop() {
            return None;
        }
    }
    PciPath::parse(&rel.to_string_lossy(), numa_node(&dir)).ok()
}

/// `numa_node` of a PCI device directory (`-1` or unreadable: unknown).
fn numa_node(dir: &Path) -> Option<u32> {
    read_trim(&dir.join("numa_node")).and_then(|s| s.parse::<i64>().ok()).and_then(|n| u32::try_from(n).ok())
}

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

fn sorted_entries(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut v: Vec<(String, PathBuf)> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| (e.file_name().to_string_lossy().into_owned(), e.path())).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Every RDMA device, then every physical network interface not on an RDMA device's PCI
/// function, each in name order.
pub fn read_nics(root: &Path) -> Vec<Nic> {
    let mut nics: Vec<Nic> = sorted_entries(&root.join("sys/class/infiniband")).into_iter().filter_map(|(name, dir)| rdma_nic(root, name, &dir)).collect();
    for (name, dir) in sorted_entries(&root.join("sys/class/net")) {
        let Some(pci) = pci_path_at(root, &dir.join("device")) else { continue };
        if let Some(owner) = nics.iter_mut().find(|n| n.rdma && n.pci == pci) {
            owner.netdevs.push(name);
            continue;
        }
        let state = read_trim(&dir.join("operstate")).unwrap_or_else(|| "unknown".into());
        let link_layer = match read_trim(&dir.join("type")).as_deref() {
            Some("32") => "InfiniBand",
            _ => "Ethernet",
        };
        // `speed` is Mb/s; virtual and down links report -1 or fail to read.
        let rate_gbps = read_trim(&dir.join("speed")).and_then(|s| s.parse::<f64>().ok()).filter(|&m| m > 0.0).map(|m| m / 1000.0);
        nics.push(Nic { name, rdma: false, netdevs: Vec::new(), link_layer: link_layer.into(), rate_gbps, usable: state == "up", state, port: None, pci });
    }
    nics
}

/// An RDMA device from `/sys/class/infiniband/<name>`: the first active port's fields (or
/// the first port's when none is active).
fn rdma_nic(root: &Path, name: String, dir: &Path) -> Option<Nic> {
    let pci = pci_path_at(root, &dir.join("device"))?;
    let mut ports: Vec<(u32, PathBuf)> = sorted_entries(&dir.join("ports")).into_iter().filter_map(|(n, p)| n.parse().ok().map(|n| (n, p))).collect();
    ports.sort_by_key(|p| p.0);
    // `state` reads "4: ACTIVE"; `rate` reads "400 Gb/sec (4X NDR)".
    let state_of = |p: &Path| read_trim(&p.join("state")).map(|s| s.rsplit(':').next().unwrap_or("").trim().to_string()).unwrap_or_else(|| "unknown".into());
    let chosen = ports.iter().find(|(_, p)| state_of(p) == "ACTIVE").or(ports.first());
    let (port, state, rate_gbps, link_layer) = match chosen {
        Some((n, p)) => (
            Some(*n),
            state_of(p),
            read_trim(&p.join("rate")).and_then(|r| r.split_whitespace().next().and_then(|x| x.parse::<f64>().ok())),
            read_trim(&p.join("link_layer")).unwrap_or_else(|| "unknown".into()),
        ),
        None => (None, "no ports".to_string(), None, "unknown".to_string()),
    };
    Some(Nic { name, rdma: true, netdevs: Vec::new(), link_layer, rate_gbps, usable: state == "ACTIVE", state, port, pci })
}
