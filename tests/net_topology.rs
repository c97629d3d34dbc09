//! NIC discovery and the forwarding choice on fake sysfs trees (`hoccl::sysfs` reads under a
//! root directory): a DGX-H100-like host, a host with one NIC, a host with none, virtual and
//! virtio interfaces, RDMA devices with their netdevs, ports that are down.
use hoccl::sysfs::{self, HostNics};
use hoccl::topology::PciClass;
use std::path::{Path, PathBuf};

/// A temporary directory holding `sys/`, removed on drop.
struct FakeSys {
    root: PathBuf,
}

impl FakeSys {
    fn new(tag: &str) -> FakeSys {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let root = std::env::temp_dir().join(format!("hoccl-sysfs-{tag}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("sys/devices")).unwrap();
        FakeSys { root }
    }

    fn write(&self, rel: &str, text: &str) {
        let p = self.root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    /// A symlink at `rel` pointing at `target` (relative to the root), written relative as
    /// sysfs does, so the tree can move.
    fn link(&self, rel: &str, target: &str) {
        let at = self.root.join(rel);
        std::fs::create_dir_all(at.parent().unwrap()).unwrap();
        let depth = Path::new(rel).components().count() - 1;
        let up: PathBuf = std::iter::repeat("..").take(depth).collect();
        std::os::unix::fs::symlink(up.join(target), at).unwrap();
    }

    /// A PCI device at `path` below `sys/devices` with its NUMA node, and its
    /// `sys/bus/pci/devices/<id>` link.
    fn pci(&self, path: &str, numa: i32) {
        let dir = format!("sys/devices/{path}");
        self.write(&format!("{dir}/numa_node"), &format!("{numa}\n"));
        let id = path.rsplit('/').next().unwrap();
        self.link(&format!("sys/bus/pci/devices/{id}"), &dir);
    }

    /// An RDMA device on PCI function `path` with one port per `(state, rate, link layer)`.
    fn rdma(&self, name: &str, path: &str, ports: &[(&str, &str, &str)]) {
        self.link(&format!("sys/class/infiniband/{name}/device"), &format!("sys/devices/{path}"));
        for (i, (state, rate, ll)) in ports.iter().enumerate() {
            let p = format!("sys/class/infiniband/{name}/ports/{}", i + 1);
            self.write(&format!("{p}/state"), &format!("{state}\n"));
            self.write(&format!("{p}/rate"), &format!("{rate}\n"));
            self.write(&format!("{p}/link_layer"), &format!("{ll}\n"));
        }
    }

    /// A network interface; `device`: the path below `sys/devices` its `device` link
    /// resolves to (`None`: a virtual interface without one).
    fn net(&self, name: &str, device: Option<&str>, operstate: &str, speed: &str, kind: &str) {
        let dir = format!("sys/class/net/{name}");
        self.write(&format!("{dir}/operstate"), &format!("{operstate}\n"));
        self.write(&format!("{dir}/speed"), &format!("{speed}\n"));
        self.write(&format!("{dir}/type"), &format!("{kind}\n"));
        if let Some(d) = device {
            std::fs::create_dir_all(self.root.join(format!("sys/devices/{d}"))).unwrap();
            self.link(&format!("{dir}/device"), &format!("sys/devices/{d}"));
        }
    }
}

impl Drop for FakeSys {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

const NDR: (&str, &str, &str) = ("4: ACTIVE", "400 Gb/sec (4X NDR)", "InfiniBand");

/// DGX-H100-like: two CPUs, two PCIe switches per CPU, each switch with two GPUs and two
/// ConnectX NICs (InfiniBand NDR), GPU bus ids `0000:g1:00.0`-style. Returns the GPUs' bus
/// ids in ordinal order.
fn dgx(s: &FakeSys) -> Vec<String> {
    let mut gpus = Vec::new();
    for sw in 0..4 {
        let (root_bus, numa) = (0x10 + 0x40 * sw, (sw / 2) as i32);
        let up = format!("pci0000:{root_bus:02x}/0000:{root_bus:02x}:01.0/0000:{:02x}:00.0", root_bus + 1);
        for j in 0..2 {
            let gpu = format!("0000:{:02x}:00.0", root_bus + 3 + j);
            s.pci(&format!("{up}/0000:{:02x}:0{j}.0/{gpu}", root_bus + 2), numa);
            gpus.push(gpu);
            let nic = format!("0000:{:02x}:00.0", root_bus + 5 + j);
            let path = format!("{up}/0000:{:02x}:0{}.0/{nic}", root_bus + 2, j + 2);
            s.pci(&path, numa);
            s.rdma(&format!("mlx5_{}", 2 * sw + j), &path, &[NDR]);
            s.net(&format!("ibp{}s0", root_bus + 5 + j), Some(&format!("{path}/net/ibp{}s0", root_bus + 5 + j)), "up", "400000", "32");
        }
    }
    // The management NIC on CPU 0's root complex, and virtual interfaces.
    s.pci("pci0000:00/0000:00:1c.0/0000:02:00.0", 0);
    s.net("eno1", Some("pci0000:00/0000:00:1c.0/0000:02:00.0"), "up", "25000", "1");
    s.net("lo", None, "unknown", "-1", "772");
    s.net("docker0", None, "down", "-1", "1");
    gpus
}

#[test]
fn dgx_like_host_each_gpu_on_its_own_nic() {
    let s = FakeSys::new("dgx");
    let gpus = dgx(&s);
    let h = HostNics::read(&s.root, &gpus);
    let names: Vec<&str> = h.nics.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7", "eno1"], "RDMA devices, then physical interfaces; virtual ones skipped");
    let ib = &h.nics[0];
    assert!(ib.rdma && ib.usable);
    assert_eq!((ib.state.as_str(), ib.link_layer.as_str(), ib.rate_gbps, ib.port), ("ACTIVE", "InfiniBand", Some(400.0), Some(1)));
    assert_eq!(ib.netdevs, ["ibp21s0"], "the IPoIB netdev belongs to its RDMA device");
    let eno = &h.nics[8];
    assert!(!eno.rdma && eno.usable);
    assert_eq!((eno.link_layer.as_str(), eno.rate_gbps), ("Ethernet", Some(25.0)));
    for g in 0..8 {
        for n in 0..8 {
            let want = if g / 2 == n / 2 {
                PciClass::Pix
            } else if g / 4 == n / 4 {
                PciClass::Phb
            } else {
                PciClass::Sys
            };
            assert_eq!(h.distance[g][n].class, want, "GPU {g} NIC {n}");
        }
        assert_eq!(h.distance[g][8].class, if g < 4 { PciClass::Phb } else { PciClass::Sys });
    }
    let a = h.affinity.as_ref().unwrap();
    assert_eq!(a.nic_of_gpu, (0..8).map(Some).collect::<Vec<_>>());
    assert_eq!(h.forwarding_map(), (0..8).collect::<Vec<u32>>(), "identity: every GPU has its own NIC");
}

#[test]
fn one_nic_host_forwards_through_the_gpu_beside_it() {
    let s = FakeSys::new("one");
    // Root port 01.0 → switch → GPUs 0, 1 and the NIC; root port 02.0 → switch → GPUs 2, 3.
    let mut gpus = Vec::new();
    for (port, sw) in [(1, 0x20), (2, 0x30)] {
        for j in 0..2 {
            let gpu = format!("0000:{:02x}:00.0", sw + 2 + j);
            s.pci(&format!("pci0000:10/0000:10:0{port}.0/0000:{sw:02x}:00.0/0000:{:02x}:0{j}.0/{gpu}", sw + 1), 0);
            gpus.push(gpu.to_uppercase()); // CUDA's spelling
        }
    }
    let nic = "pci0000:10/0000:10:01.0/0000:20:00.0/0000:21:05.0/0000:28:00.0";
    s.pci(nic, 0);
    s.rdma("rocep40s0", nic, &[("1: DOWN", "10 Gb/sec (1X SDR)", "Ethernet"), ("4: ACTIVE", "100 Gb/sec (4X EDR)", "Ethernet")]);
    s.net("enp40s0", Some(nic), "up", "100000", "1");
    let h = HostNics::read(&s.root, &gpus);
    assert_eq!(h.nics.len(), 1, "the RoCE netdev is the RDMA device's");
    let n = &h.nics[0];
    assert_eq!((n.port, n.rate_gbps, n.link_layer.as_str(), n.netdevs.clone()), (Some(2), Some(100.0), "Ethernet", vec!["enp40s0".to_string()]), "the active port");
    let classes: Vec<PciClass> = h.distance.iter().map(|r| r[0].class).collect();
    assert_eq!(classes, [PciClass::Pix, PciClass::Pix, PciClass::Phb, PciClass::Phb]);
    assert_eq!(h.forwarding_map(), [0, 1, 0, 1]);
    assert_eq!(h.gpus[2].bus_id, "0000:32:00.0");
}

#[test]
fn no_nic_or_no_placement_leaves_identity() {
    let s = FakeSys::new("none");
    s.pci("pci0000:00/0000:00:02.0/0000:03:00.0", -1);
    s.net("lo", None, "unknown", "-1", "772");
    s.net("veth1", None, "up", "10000", "1");
    let gpus = vec!["0000:03:00.0".to_string()];
    let h = HostNics::read(&s.root, &gpus);
    assert!(h.nics.is_empty());
    assert!(h.forwarding_map().is_empty());
    // A GPU sysfs does not know: no choice at all.
    let h = HostNics::read(&s.root, &["0000:99:00.0".to_string()]);
    assert!(h.gpus[0].pci.is_none() && h.affinity.is_none() && h.forwarding_map().is_empty());
    // A NIC that is down: listed, not used.
    s.pci("pci0000:00/0000:00:03.0", -1);
    s.net("eth0", Some("pci0000:00/0000:00:03.0/virtio2"), "down", "-1", "1");
    let h = HostNics::read(&s.root, &gpus);
    assert_eq!(h.nics.len(), 1);
    assert_eq!((h.nics[0].name.as_str(), h.nics[0].pci.bus_id(), h.nics[0].usable, h.nics[0].rate_gbps), ("eth0", "0000:00:03.0", false, None));
    assert!(h.forwarding_map().is_empty());
}

#[test]
fn bus_ids_normalize() {
    assert_eq!(sysfs::normalize_bus_id("00000000:1A:00.0"), "0000:1a:00.0");
    assert_eq!(sysfs::normalize_bus_id(" 0000:1a:00.0\n"), "0000:1a:00.0");
    assert!(sysfs::pci_path_of(Path::new("/nonexistent"), "not-a-bus-id").is_none());
}

/// This machine's own sysfs: whatever it has, reading it neither fails nor panics, and every
/// NIC it lists has a PCI function.
#[test]
fn this_host_reads() {
    let h = HostNics::read(Path::new("/"), &[]);
    for n in &h.nics {
        assert!(hoccl::topology::is_pci_function(n.pci.bus_id()), "{n:?}");
    }
}

/// `hoccl-info` lists this host's NICs as `HostNics` reads them, and the override.
#[test]
fn hoccl_info_lists_the_nics() {
    let run = |env: &[(&str, &str)], args: &[&str]| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_hoccl-info"));
        c.args(args).env_remove("HOCCL_FORWARDING_PEERS");
        env.iter().for_each(|(k, v)| {
            c.env(k, v);
        });
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    // Binaries copied to another machine (scripts/gpu/build.sh) leave this path behind.
    let exe = Path::new(env!("CARGO_BIN_EXE_hoccl-info"));
    if !exe.exists() {
        eprintln!("skipped: no hoccl-info at {}", exe.display());
        return;
    }
    let here = HostNics::read(Path::new("/"), &[]);
    let text = run(&[], &[]);
    assert!(text.contains(&format!("NICs (sysfs): {}", here.nics.len())), "{text}");
    for n in &here.nics {
        assert!(text.contains(&format!("  {}", n.name)), "{} missing:\n{text}", n.name);
    }
    assert!(!text.contains("HOCCL_FORWARDING_PEERS"));
    let text = run(&[("HOCCL_FORWARDING_PEERS", "1,0")], &[]);
    assert!(text.contains("HOCCL_FORWARDING_PEERS overrides the choice: 0->1, 1->0"), "{text}");
    let json = run(&[("HOCCL_FORWARDING_PEERS", "1,0")], &["--json"]);
    assert!(json.contains("\"forwarding_override\":[1,0]"), "{json}");
    assert_eq!(json.matches("\"usable\":").count(), here.nics.len(), "{json}");
}

/// On a machine with GPUs (`--ignored`, as the other CUDA bodies): every GPU the driver shows
/// is found in sysfs, so the forwarding choice is made (and is a valid map) whenever a NIC
/// is usable. Reports skipped without a driver.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpus_are_in_sysfs() {
    let probe = match hoccl::device::cuda::probe() {
        Ok(p) if p.count > 0 => p,
        other => {
            eprintln!("skipped: no GPU ({:?})", other.err().map(|e| e.to_string()));
            return;
        }
    };
    let ids: Vec<String> = probe.gpus.iter().map(|g| g.pci_bus_id.clone()).collect();
    let h = HostNics::read(Path::new("/"), &ids);
    for g in &h.gpus {
        assert!(g.pci.is_some(), "GPU {} is not in /sys/bus/pci/devices", g.bus_id);
    }
    let a = h.affinity.as_ref().expect("every GPU placed, so a choice");
    let map = h.forwarding_map();
    assert!(hoccl::topology::check_forwarding_map(&map).is_ok(), "{map:?}");
    if h.nics.iter().any(|n| n.usable) {
        assert_eq!(map.len(), ids.len());
        assert!(a.nic_of_gpu.iter().all(Option::is_some));
    }
    eprintln!("NICs {:?}; forwarding {:?}", h.nics.iter().map(|n| (&n.name, &n.state, n.pci.bus_id())).collect::<Vec<_>>(), a.forwarding);
}
