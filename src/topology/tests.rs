use super::*;
use crate::error::ErrorCode;

fn rec(host: &str, gpu_count: u32) -> RankRecord {
    RankRecord { hostname: host.into(), pid: 7, gpu_count, gpu: None, pci_bus_id: String::new(), forwarding: Vec::new() }
}

fn cfg(virtual_nodes: usize, forwarding: &[usize]) -> Config {
    Config { virtual_nodes, forwarding_peers: forwarding.to_vec(), ..Config::default() }
}

fn all(_: usize, _: usize) -> bool {
    true
}

fn err_code(r: Result<Topology>) -> ErrorCode {
    match r {
        Ok(t) => panic!("expected an error, got {t:?}"),
        Err(e) => e.code(),
    }
}

/// splitmix64: deterministic randomness without a crate.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

// ---------------------------------------------------------------- records ---------------

#[test]
fn records_round_trip() {
    let cases = [
        rec("node-01", 8),
        RankRecord { hostname: "ホスト".into(), pid: u32::MAX, gpu_count: 0, gpu: Some(0), pci_bus_id: "0000:18:00.0".into(), forwarding: vec![0, 0, 2] },
        RankRecord { hostname: "h".into(), pid: 0, gpu_count: 4, gpu: Some(u32::MAX), pci_bus_id: String::new(), forwarding: Vec::new() },
    ];
    for r in cases {
        let bytes = r.to_bytes().unwrap();
        assert_eq!(RankRecord::from_bytes(&bytes).unwrap(), r);
    }
}

#[test]
fn corrupt_records_are_errors_not_panics() {
    let good = RankRecord { hostname: "gpu-node".into(), pid: 42, gpu_count: 4, gpu: Some(2), pci_bus_id: "0000:3b:00.0".into(), forwarding: vec![1, 1, 3, 3] }
        .to_bytes()
        .unwrap();
    for cut in 0..good.len() {
        let e = RankRecord::from_bytes(&good[..cut]).unwrap_err();
        assert_eq!(e.code(), ErrorCode::CorruptData, "truncated at {cut}");
    }
    let mut trailing = good.clone();
    trailing.push(0);
    assert!(RankRecord::from_bytes(&trailing).is_err());
    let mut bad_magic = good.clone();
    bad_magic[0] ^= 1;
    assert!(RankRecord::from_bytes(&bad_magic).is_err());
    let mut bad_utf8 = good.clone();
    bad_utf8[8] = 0xff; // first hostname byte
    assert!(RankRecord::from_bytes(&bad_utf8).is_err());
    let flag_at = 4 + 4 + 8 + 4 + 4;
    let mut bad_flag = good.clone();
    bad_flag[flag_at] = 7;
    assert!(RankRecord::from_bytes(&bad_flag).is_err());
    let mut huge_len = good.clone();
    huge_len[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(RankRecord::from_bytes(&huge_len).is_err());
    // Random garbage, and random single-byte damage: any result but a panic.
    let mut rng = Rng(1);
    for _ in 0..2000 {
        let len = rng.below(64);
        let junk: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        let _ = RankRecord::from_bytes(&junk);
        let mut damaged = good.clone();
        let at = rng.below(damaged.len());
        damaged[at] = rng.next() as u8;
        let _ = RankRecord::from_bytes(&damaged);
    }
}

#[test]
fn record_for_this_process_carries_the_device_override() {
    let c = Config { device: Some(3), ..Config::default() };
    let r = RankRecord::for_this_process(&c, 4, "0000:AB:00.0");
    assert_eq!(r.gpu, Some(3));
    assert_eq!(r.pid, std::process::id());
    assert!(!r.hostname.is_empty());
    assert_eq!(RankRecord::from_bytes(&r.to_bytes().unwrap()).unwrap(), r);
}

// ---------------------------------------------------------------- placement -------------

#[test]
fn one_host_one_rank_per_gpu() {
    let records = vec![rec("a", 4); 4];
    let t = Topology::build(&records, &Config::default(), all).unwrap();
    assert_eq!((t.nranks(), t.nnodes(), t.nhosts()), (4, 1, 1));
    for r in 0..4 {
        let p = t.rank(r).unwrap();
        assert_eq!((p.node, p.local_rank, p.host_local_rank, p.gpu, p.forwarding_peer), (0, r, r, r, r));
        assert_eq!(t.gpu_sharers(r), &[r]);
        assert_eq!(t.local_peers(r), &[0, 1, 2, 3]);
    }
    assert!(t.peer_access(0, 3));
    assert_eq!(t.hostname(0), Some("a"));
    assert_eq!(t.bandwidths(), &Bandwidths::default());
}

#[test]
fn many_ranks_share_one_gpu() {
    let records = vec![rec("a", 1); 4];
    let t = Topology::build(&records, &Config::default(), |_, _| false).unwrap();
    for r in 0..4 {
        assert_eq!(t.gpu(r), Some(0));
        assert_eq!(t.gpu_sharers(r), &[0, 1, 2, 3]);
    }
    // Same GPU: access needs no peer link.
    assert!(t.peer_access(1, 2));
}

#[test]
fn no_gpu_means_the_one_host_device() {
    let t = Topology::build(&[rec("a", 0), rec("a", 0)], &Config::default(), all).unwrap();
    assert_eq!((t.gpu(0), t.gpu(1)), (Some(0), Some(0)));
    assert!(t.shares_gpu(0, 1));
    let mut asks = rec("a", 0);
    asks.gpu = Some(1);
    assert_eq!(err_code(Topology::build(&[asks], &Config::default(), all)), ErrorCode::InvalidArgument);
}

#[test]
fn context_sharers_are_same_process_same_gpu() {
    // Host a: ranks 0-3 in pid 7 (two GPUs: 0,2 on GPU 0, 1,3 on GPU 1), rank 4 in pid 8
    // (GPU 0); host b: rank 5, pid 7 as well.
    let mut records = vec![rec("a", 2); 5];
    records[4].pid = 8;
    records.push(rec("b", 2));
    let t = Topology::build(&records, &Config::default(), all).unwrap();
    assert_eq!(t.gpu_sharers(0), &[0, 2, 4]);
    assert_eq!(t.context_sharers(0), [0, 2]);
    assert_eq!(t.context_sharers(3), [1, 3]);
    assert_eq!(t.context_sharers(4), [4]);
    assert_eq!(t.context_sharers(5), [5]);
    assert!(t.context_sharers(6).is_empty());
}

#[test]
fn gpus_wrap_by_host_local_rank() {
    let records = vec![rec("a", 2); 5];
    let t = Topology::build(&records, &Config::default(), all).unwrap();
    let gpus: Vec<usize> = (0..5).filter_map(|r| t.gpu(r)).collect();
    assert_eq!(gpus, [0, 1, 0, 1, 0]);
    assert_eq!(t.gpu_sharers(2), &[0, 2, 4]);
    assert_eq!(t.gpu_sharers(3), &[1, 3]);
}

#[test]
fn device_override_and_its_bounds() {
    let mut records = vec![rec("a", 4); 2];
    records[0].gpu = Some(3);
    records[1].gpu = Some(3);
    let t = Topology::build(&records, &Config::default(), all).unwrap();
    assert_eq!((t.gpu(0), t.gpu(1)), (Some(3), Some(3)));
    assert!(t.shares_gpu(0, 1));
    records[1].gpu = Some(4);
    assert_eq!(err_code(Topology::build(&records, &Config::default(), all)), ErrorCode::InvalidArgument);
}

#[test]
fn interleaved_hosts_group_by_name() {
    let records = vec![rec("a", 2), rec("b", 2), rec("a", 2), rec("b", 2)];
    let t = Topology::build(&records, &Config::default(), all).unwrap();
    assert_eq!(t.nodes()[0].ranks, [0, 2]);
    assert_eq!(t.nodes()[1].ranks, [1, 3]);
    assert_eq!((t.local_rank(2), t.gpu(2), t.node_of(3)), (Some(1), Some(1), Some(1)));
    assert!(!t.same_node(0, 1) && !t.peer_access(0, 1) && !t.same_host(0, 1));
    // Different hosts never share a GPU, even with equal ordinals and bus ids.
    assert!(!t.shares_gpu(0, 1));
}

#[test]
fn virtual_nodes_split_hosts_contiguously() {
    let records = vec![rec("a", 4); 4];
    let t = Topology::build(&records, &cfg(2, &[]), all).unwrap();
    assert_eq!(t.nnodes(), 2);
    assert_eq!((t.nodes()[0].ranks.clone(), t.nodes()[1].ranks.clone()), (vec![0, 1], vec![2, 3]));
    // GPUs follow the host, local ranks the node.
    assert_eq!((t.gpu(2), t.local_rank(2), t.rank(2).unwrap().host_local_rank), (Some(2), Some(0), 2));
    assert!(t.same_host(1, 2) && !t.same_node(1, 2));
    assert!(!t.peer_access(1, 2), "virtual nodes talk through the emulated NIC");

    let t3 = Topology::build(&records, &cfg(3, &[]), all).unwrap();
    let sizes: Vec<usize> = t3.nodes().iter().map(|n| n.ranks.len()).collect();
    assert_eq!(sizes, [2, 1, 1]);
    assert_eq!(err_code(Topology::build(&records, &cfg(5, &[]), all)), ErrorCode::InvalidArgument);
    assert_eq!(err_code(Topology::build(&records, &cfg(0, &[]), all)), ErrorCode::InvalidArgument);
    // Every host must fit N nodes.
    let uneven = vec![rec("a", 1), rec("a", 1), rec("b", 1)];
    assert_eq!(err_code(Topology::build(&uneven, &cfg(2, &[]), all)), ErrorCode::InvalidArgument);
}

#[test]
fn virtual_nodes_from_the_environment() {
    let env = |k: &str| match k {
        "HOCCL_VIRTUAL_NODES" => Some("2".to_string()),
        "HOCCL_FORWARDING_PEERS" => Some("1,0".to_string()),
        _ => None,
    };
    let c = Config::default().with_env(env).unwrap();
    let t = Topology::build(&vec![rec("a", 4); 4], &c, all).unwrap();
    let fwd: Vec<usize> = (0..4).filter_map(|r| t.forwarding_peer(r)).collect();
    assert_eq!(fwd, [1, 0, 3, 2]);
}

#[test]
fn forwarding_peers_pair_within_each_node() {
    let records: Vec<RankRecord> = ["a", "a", "a", "a", "b", "b", "b", "b"].iter().map(|h| rec(h, 4)).collect();
    let t = Topology::build(&records, &cfg(1, &[1, 0, 3, 2]), all).unwrap();
    let fwd: Vec<usize> = (0..8).filter_map(|r| t.forwarding_peer(r)).collect();
    assert_eq!(fwd, [1, 0, 3, 2, 5, 4, 7, 6]);
    let fixed = Topology::build(&records, &cfg(1, &[0, 2, 1, 3]), all).unwrap();
    assert_eq!(fixed.forwarding_peer(0), Some(0));
    assert_eq!(fixed.forwarding_peer(5), Some(6));
    let star = Topology::build(&records, &cfg(1, &[0, 0, 2, 2]), all).unwrap();
    assert_eq!((0..8).filter_map(|r| star.forwarding_peer(r)).collect::<Vec<_>>(), [0, 0, 2, 2, 4, 4, 6, 6]);
    for bad in [&[1, 2, 3, 0][..], &[1, 0, 3, 4], &[1, 0], &[1, 0, 3, 2, 4], &[1, 2, 2, 3], &[2, 0, 1, 3]] {
        assert_eq!(err_code(Topology::build(&records, &cfg(1, bad), all)), ErrorCode::InvalidArgument, "{bad:?}");
    }
}

#[test]
fn pci_bus_ids_decide_gpu_sharing() {
    // Two ranks with different CUDA_VISIBLE_DEVICES: ordinal 0 in both, different GPUs.
    let mut records = vec![rec("a", 1), rec("a", 1)];
    records[0].pci_bus_id = "0000:18:00.0".into();
    records[1].pci_bus_id = "0000:3B:00.0".into();
    let t = Topology::build(&records, &Config::default(), all).unwrap();
    assert!(!t.shares_gpu(0, 1));
    // The same GPU under two ordinals (case-insensitive id).
    let mut same = vec![rec("a", 2), rec("a", 2)];
    same[0].pci_bus_id = "0000:3b:00.0".into();
    same[1].pci_bus_id = "0000:3B:00.0".into();
    let t = Topology::build(&same, &Config::default(), all).unwrap();
    assert_eq!((t.gpu(0), t.gpu(1)), (Some(0), Some(1)));
    assert!(t.shares_gpu(0, 1));
    // Ids learned after the GPUs were opened.
    let later = Topology::build(&vec![rec("a", 2); 2], &Config::default(), all).unwrap();
    assert!(!later.shares_gpu(0, 1));
    let ids = vec!["0000:18:00.0".to_string(), "0000:18:00.0".to_string()];
    let later = later.with_pci_bus_ids(&ids).unwrap();
    assert!(later.shares_gpu(0, 1));
    assert!(later.clone().with_pci_bus_ids(&ids[..1]).is_err());
}

#[test]
fn peer_matrix_from_the_device_layer() {
    // NVLink pairs (0,1) and (2,3) only.
    let m = [[true, true, false, false], [true, true, false, false], [false, false, true, true], [false, false, true, true]];
    let t = Topology::build(&vec![rec("a", 4); 4], &Config::default(), |a, b| m[a][b]).unwrap();
    assert!(t.peer_access(0, 1) && t.peer_access(3, 2));
    assert!(!t.peer_access(0, 2) && !t.peer_access(1, 3));
}

#[test]
fn bad_inputs_and_queries() {
    assert_eq!(err_code(Topology::build(&[], &Config::default(), all)), ErrorCode::InvalidArgument);
    assert_eq!(err_code(Topology::build(&[rec(" ", 1)], &Config::default(), all)), ErrorCode::InvalidArgument);
    let t = Topology::build(&[rec("a", 1)], &Config::default(), all).unwrap();
    assert_eq!((t.rank(1), t.node(1), t.hostname(1), t.gpu(9)), (None, None, None, None));
    assert!(t.local_peers(5).is_empty() && t.gpu_sharers(5).is_empty());
    assert!(!t.peer_access(0, 5) && !t.same_node(5, 0) && !t.shares_gpu(0, 5));
}

#[test]
fn synthetic_clusters() {
    let t = Topology::synthetic(2, 4, 4, &cfg(1, &[1, 0, 3, 2])).unwrap();
    assert_eq!((t.nnodes(), t.nranks()), (2, 8));
    assert_eq!(t.forwarding_peer(6), Some(7));
    let custom = Bandwidths { nic: 25e9, ..Bandwidths::default() };
    assert_eq!(t.with_bandwidths(custom.clone()).bandwidths(), &custom);
}

// ---------------------------------------------------------------- random ----------------

/// Invariants every topology must satisfy.
fn check_invariants(t: &Topology, records: &[RankRecord], vn: usize) {
    let n = records.len();
    let mut seen = vec![false; n];
    for (id, node) in t.nodes().iter().enumerate() {
        assert_eq!(node.id, id);
        assert!(!node.ranks.is_empty());
        assert!(node.ranks.windows(2).all(|w| w[0] < w[1]), "node ranks ascending");
        for (l, &r) in node.ranks.iter().enumerate() {
            assert!(!std::mem::replace(&mut seen[r], true), "rank {r} in two nodes");
            let p = t.rank(r).unwrap();
            assert_eq!((p.rank, p.node, p.local_rank, p.host), (r, id, l, node.host));
            assert_eq!(t.hostname(p.host), Some(records[r].hostname.as_str()));
        }
    }
    assert!(seen.iter().all(|&s| s), "every rank in a node");
    for h in 0..t.nhosts() {
        let host_nodes: Vec<&Node> = t.nodes().iter().filter(|nd| nd.host == h).collect();
        assert_eq!(host_nodes.len(), vn);
        let sizes: Vec<usize> = host_nodes.iter().map(|nd| nd.ranks.len()).collect();
        assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
        // Contiguous: the nodes of a host, concatenated, are its ranks in order.
        let joined: Vec<usize> = host_nodes.iter().flat_map(|nd| nd.ranks.iter().copied()).collect();
        let expect: Vec<usize> = (0..n).filter(|&r| t.rank(r).unwrap().host == h).collect();
        assert_eq!(joined, expect);
        for (hl, &r) in expect.iter().enumerate() {
            let p = t.rank(r).unwrap();
            assert_eq!(p.host_local_rank, hl);
            let count = records[r].gpu_count as usize;
            assert_eq!(p.gpu, records[r].gpu.map_or(hl % count.max(1), |g| g as usize));
        }
    }
    for a in 0..n {
        let s = t.gpu_sharers(a);
        assert!(s.contains(&a));
        for &b in s {
            assert_eq!(t.gpu_sharers(b), s, "sharing is an equivalence");
            assert!(t.same_host(a, b));
        }
        let f = t.forwarding_peer(a).unwrap();
        assert!(t.same_node(a, f));
        // The override pairs ranks; a NIC-affine forwarder forwards through itself.
        let ff = t.forwarding_peer(f);
        assert!(ff == Some(a) || ff == Some(f), "rank {a} forwards through {f}, which forwards through {ff:?}");
        for b in 0..n {
            assert_eq!(t.peer_access(a, b), t.peer_access(b, a));
            if !t.same_node(a, b) {
                assert!(!t.peer_access(a, b));
            }
        }
    }
}

#[test]
fn random_clusters_keep_every_invariant() {
    let mut rng = Rng(0x5eed);
    let mut built = 0;
    for _ in 0..300 {
        let nhosts = 1 + rng.below(4);
        let n = nhosts + rng.below(12);
        let gpus: Vec<u32> = (0..nhosts).map(|_| rng.below(9) as u32).collect();
        let records: Vec<RankRecord> = (0..n)
            .map(|r| {
                let h = if r < nhosts { r } else { rng.below(nhosts) };
                let mut x = rec(&format!("host-{h}"), gpus[h]);
                x.pid = rng.next() as u32;
                if gpus[h] > 0 && rng.below(5) == 0 {
                    x.gpu = Some(rng.below(gpus[h] as usize) as u32);
                }
                if rng.below(3) == 0 {
                    x.pci_bus_id = format!("0000:{:02x}:00.0", x.gpu.unwrap_or(0));
                }
                // A host's forwarding map (the same on each of its records, as from one
                // sysfs): each GPU forwards through itself or through GPU 0.
                if gpus[h] > 0 && h % 2 == 1 {
                    x.forwarding = (0..gpus[h]).map(|g| if g % 3 == 1 { 0 } else { g }).collect();
                }
                x
            })
            .collect();
        let min_host = (0..nhosts).map(|h| records.iter().filter(|x| x.hostname == format!("host-{h}")).count()).min().unwrap();
        let vn = 1 + rng.below(min_host + 1); // sometimes one too many
        // Symmetric peer access between GPUs of the same parity.
        let result = Topology::build(&records, &cfg(vn, &[]), |a, b| a % 2 == b % 2);
        if vn > min_host {
            assert_eq!(err_code(result), ErrorCode::InvalidArgument);
            continue;
        }
        let t = result.unwrap();
        check_invariants(&t, &records, vn);
        // Deterministic, and the same from records that crossed the wire.
        let wire: Vec<RankRecord> = records.iter().map(|x| RankRecord::from_bytes(&x.to_bytes().unwrap()).unwrap()).collect();
        assert_eq!(Topology::build(&wire, &cfg(vn, &[]), |a, b| a % 2 == b % 2).unwrap(), t);
        built += 1;
    }
    assert!(built > 150, "only {built} random clusters were valid");
}

// ---------------------------------------------------------------- NIC affinity -----------

fn d(class: PciClass, hops: u32) -> PciDistance {
    PciDistance { class, hops }
}

fn path(p: &str, numa: Option<u32>) -> PciPath {
    PciPath::parse(p, numa).unwrap()
}

#[test]
fn pci_distance_classes() {
    // Root complex pci0000:17 → root port 17:01.0 → switch upstream 18:00.0 → downstream
    // ports 19:00.0 / 19:01.0 → GPU 1a:00.0 / NIC 1b:00.0.
    let gpu = path("/sys/devices/pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:00.0/0000:1a:00.0", Some(0));
    let nic = path("pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:01.0/0000:1b:00.0/net/eth2", Some(0));
    assert_eq!(nic.bus_id(), "0000:1b:00.0", "components after the PCI function are dropped");
    assert_eq!(pci_distance(&gpu, &nic), d(PciClass::Pix, 2));
    assert_eq!(pci_distance(&nic, &gpu), d(PciClass::Pix, 2));
    // Two switches under one root port.
    let deep = path("pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:02.0/0000:20:00.0/0000:21:00.0/0000:22:00.0", Some(0));
    assert_eq!(pci_distance(&gpu, &deep).class, PciClass::Pxb);
    // Another root port of the same root complex.
    let other_port = path("pci0000:17/0000:17:02.0/0000:30:00.0", Some(0));
    assert_eq!(pci_distance(&gpu, &other_port).class, PciClass::Phb);
    // Another root complex: same NUMA node PHB, another or unknown SYS.
    let same_cpu = path("pci0000:40/0000:40:01.0/0000:41:00.0", Some(0));
    let other_cpu = path("pci0000:c0/0000:c0:01.0/0000:c1:00.0", Some(1));
    let unknown = path("pci0000:c0/0000:c0:01.0/0000:c1:00.0", None);
    assert_eq!(pci_distance(&gpu, &same_cpu), d(PciClass::Phb, 0));
    assert_eq!(pci_distance(&gpu, &other_cpu), d(PciClass::Sys, 0));
    assert_eq!(pci_distance(&gpu, &unknown), d(PciClass::Sys, 0));
    assert!(d(PciClass::Pix, 9) < d(PciClass::Pxb, 1) && d(PciClass::Pxb, 3) < d(PciClass::Pxb, 4));
    for bad in ["", "/sys/devices/virtual/net/lo", "pci0000:17", "0000:17:01.0/0000:18:00.0", "pcizzzz:17/0000:17:01.0"] {
        assert_eq!(PciPath::parse(bad, None).unwrap_err().code(), ErrorCode::InvalidArgument, "{bad:?}");
    }
}

#[test]
fn each_gpu_with_its_own_nic_forwards_through_itself() {
    // DGX-H100-like: 4 switches, each with GPUs 2s, 2s+1 and NICs 2s, 2s+1.
    let m: Vec<Vec<PciDistance>> =
        (0..8).map(|g| (0..8).map(|n| if g / 2 == n / 2 { d(PciClass::Pix, 2) } else if g / 4 == n / 4 { d(PciClass::Phb, 0) } else { d(PciClass::Sys, 0) }).collect()).collect();
    let a = choose_forwarding(&m, &[true; 8]).unwrap();
    assert_eq!(a.forwarding, (0..8).collect::<Vec<_>>());
    assert_eq!(a.nic_of_gpu, (0..8).map(Some).collect::<Vec<_>>(), "two GPUs beside two NICs spread over both");
    // A NIC that is down is not chosen: its switch's GPUs share the other NIC.
    let mut usable = [true; 8];
    usable[3] = false;
    let a = choose_forwarding(&m, &usable).unwrap();
    assert_eq!(a.nic_of_gpu[2], Some(2));
    assert_eq!(a.nic_of_gpu[3], Some(2));
    assert_eq!(a.forwarding, (0..8).collect::<Vec<_>>());
}

#[test]
fn gpus_without_a_near_nic_forward_through_the_nearest_affine_gpu() {
    // One NIC beside GPUs 0 and 1 (PIX); GPUs 2, 3 behind another root port (PHB).
    let m = vec![vec![d(PciClass::Pix, 2)], vec![d(PciClass::Pix, 2)], vec![d(PciClass::Phb, 3)], vec![d(PciClass::Phb, 3)]];
    let a = choose_forwarding(&m, &[true]).unwrap();
    assert_eq!(a.forwarding, [0, 1, 0, 1], "spread over the affine GPUs");
    assert_eq!(a.nic_of_gpu, [Some(0); 4]);
    // Two NICs, one per CPU, each beside one GPU: the others go to the affine GPU of their
    // own CPU (nearest NIC), not the other one.
    let mut m = vec![vec![d(PciClass::Sys, 0); 2]; 8];
    for g in 0..8 {
        m[g][g / 4] = d(PciClass::Phb, 0);
    }
    m[0][0] = d(PciClass::Pix, 2);
    m[4][1] = d(PciClass::Pxb, 4);
    let a = choose_forwarding(&m, &[true, true]).unwrap();
    assert_eq!(a.forwarding, [0, 0, 0, 0, 4, 4, 4, 4]);
    assert_eq!(a.nic_of_gpu, [Some(0), Some(0), Some(0), Some(0), Some(1), Some(1), Some(1), Some(1)]);
    assert!(check_forwarding_map(&a.forwarding.iter().map(|&g| g as u32).collect::<Vec<_>>()).is_ok());
}

#[test]
fn no_usable_nic_or_no_affine_gpu_means_identity() {
    let far = vec![vec![d(PciClass::Sys, 0), d(PciClass::Phb, 0)]; 3];
    assert_eq!(choose_forwarding(&far, &[false, false]).unwrap(), Affinity::identity(3));
    assert_eq!(choose_forwarding(&[], &[]).unwrap(), Affinity::identity(0));
    let a = choose_forwarding(&far, &[true, true]).unwrap();
    assert_eq!(a.forwarding, [0, 1, 2]);
    assert_eq!(a.nic_of_gpu, [Some(1); 3], "the nearest NIC, even beyond GPUDirect range");
    let ragged = vec![vec![d(PciClass::Pix, 2)], vec![]];
    assert_eq!(choose_forwarding(&ragged, &[true]).unwrap_err().code(), ErrorCode::InvalidArgument);
}

#[test]
fn host_forwarding_maps_become_rank_forwarding() {
    // Host a: 4 GPUs, GPUs 2 and 3 forward through 0 and 1. Host b: no map (identity).
    let mut records: Vec<RankRecord> = ["a", "a", "a", "a", "b", "b"].iter().map(|h| rec(h, 4)).collect();
    for r in &mut records[..4] {
        r.forwarding = vec![0, 1, 0, 1];
    }
    let t = Topology::build(&records, &cfg(1, &[]), all).unwrap();
    let fwd: Vec<usize> = (0..6).filter_map(|r| t.forwarding_peer(r)).collect();
    assert_eq!(fwd, [0, 1, 0, 1, 4, 5]);
    // Two virtual nodes: node {2, 3} has no rank on GPUs 0 or 1, so its ranks stage alone.
    let t = Topology::build(&records[..4], &cfg(2, &[]), all).unwrap();
    assert_eq!((0..4).filter_map(|r| t.forwarding_peer(r)).collect::<Vec<_>>(), [0, 1, 2, 3]);
    // Two ranks per GPU (8 ranks on 4 GPUs): a rank forwards through the lowest rank on its
    // forwarding GPU.
    let mut many: Vec<RankRecord> = (0..8).map(|_| rec("a", 4)).collect();
    many.iter_mut().for_each(|r| r.forwarding = vec![0, 1, 0, 1]);
    let t = Topology::build(&many, &cfg(1, &[]), all).unwrap();
    assert_eq!((0..8).filter_map(|r| t.forwarding_peer(r)).collect::<Vec<_>>(), [0, 1, 0, 1, 4, 5, 0, 1]);
    // HOCCL_FORWARDING_PEERS wins over the map.
    let t = Topology::build(&records[..4], &cfg(1, &[1, 0, 3, 2]), all).unwrap();
    assert_eq!((0..4).filter_map(|r| t.forwarding_peer(r)).collect::<Vec<_>>(), [1, 0, 3, 2]);
    // A map that is not a forwarding map is refused.
    for bad in [vec![1, 2, 2, 3], vec![0, 1, 7, 3]] {
        let mut r = records.clone();
        r[0].forwarding = bad.clone();
        assert_eq!(err_code(Topology::build(&r, &cfg(1, &[]), all)), ErrorCode::InvalidArgument, "{bad:?}");
    }
}
