use super::*;
use crate::error::ErrorCode;

const K: usize = 1 << 10;
const M: usize = 1 << 20;

fn movement(dtype: DataType, bytes: usize) -> CallShape {
    CallShape { class: OpClass::Movement, dtype, bytes, transfers: 1, phases: 1, reduce_read: 0 }
}

/// An AllReduce of `bytes` over `n` ranks as `Communicator` describes it.
fn allreduce(dtype: DataType, bytes: usize, n: usize) -> CallShape {
    CallShape { class: OpClass::Reduction, dtype, bytes: bytes / n, transfers: n - 1, phases: 2, reduce_read: bytes }
}

#[test]
fn choices_on_the_h200_model() {
    use DataType::*;
    use LinkKind::*;
    let m = CostModel::default();
    let table: &[(&str, CallShape, LinkKind, Engine)] = &[
        ("small movement", movement(BF16, 4 * K), NvLink, Engine::Ce),
        ("small movement, slow link", movement(BF16, 4 * K), Nic, Engine::Ce),
        ("below the codec floor", movement(BF16, 60 * K), Nic, Engine::Ce),
        ("large bf16 over the NIC", movement(BF16, 16 * M), Nic, Engine::Compressed),
        ("large bf16 over PCIe", movement(BF16, 256 * M), Pcie, Engine::Compressed),
        ("large f32 over PCIe", movement(F32, 256 * M), Pcie, Engine::Compressed),
        // HBM moves faster than the codec runs: compression never pays on one GPU.
        ("large bf16, same GPU", movement(BF16, 256 * M), SameGpu, Engine::Ce),
        // Compress, move and decompress run one after the other: at 299 GB/s, bf16 at ratio
        // 0.68 does not pay.
        ("large bf16 over NVLink", movement(BF16, 256 * M), NvLink, Engine::Ce),
        ("integers never compress", movement(I32, 256 * M), Nic, Engine::Ce),
        ("integer reduction", allreduce(I32, 256 * M, 4), Nic, Engine::Sm),
        ("u8 reduction", allreduce(U8, 4 * K, 2), SameGpu, Engine::Sm),
        ("small fp reduction", allreduce(BF16, 64 * K, 4), Nic, Engine::Sm),
        ("large fp reduction over a slow link", allreduce(BF16, 256 * M, 4), Nic, Engine::Compressed),
        ("large f32 reduction over PCIe", allreduce(F32, 64 * M, 2), Pcie, Engine::Compressed),
        ("large fp reduction, same GPU", allreduce(BF16, 256 * M, 4), SameGpu, Engine::Sm),
    ];
    for (what, call, link, want) in table {
        assert_eq!(choose(&m, call, *link), *want, "{what}: {call:?} over {link:?}");
        let p = predict(&m, call, *link, None);
        // The chosen engine is the one predicted faster.
        match (*want, p.compressed_us) {
            (Engine::Compressed, Some(c)) => assert!(c < p.raw_us, "{what}: {p:?}"),
            (Engine::Compressed, None) => panic!("{what}: chosen but not predicted"),
            (_, Some(c)) => assert!(c >= p.raw_us, "{what}: {p:?}"),
            (_, None) => {}
        }
    }
}

#[test]
fn overrides_change_choices() {
    let call = movement(DataType::BF16, 16 * M);
    assert_eq!(choose(&CostModel::default(), &call, LinkKind::NvLink), Engine::Ce);
    let slow = CostModel::default().with_overrides("nvlink_gbps=50").unwrap();
    assert_eq!(slow.nvlink_gbps, 50.0);
    assert_eq!(choose(&slow, &call, LinkKind::NvLink), Engine::Compressed);
    // A ratio of 1 saves nothing: never compressed, however slow the link.
    let flat = CostModel::default().with_overrides("bf16_ratio=1, nic_gbps=1").unwrap();
    assert_eq!(choose(&flat, &movement(DataType::BF16, 256 * M), LinkKind::Nic), Engine::Ce);
    assert_eq!(compress_threshold(&flat, DataType::BF16, LinkKind::Nic), None);
    // The CTA count slows the reduce step down, the same for both engines.
    let m = CostModel::default();
    assert_eq!(m.reduce_rate(Some(8)), 8.0 * 19.5);
    assert_eq!(m.reduce_rate(Some(1000)), m.reduce_gbps);
    let r = allreduce(DataType::F32, 64 * M, 4);
    assert!(predict(&m, &r, LinkKind::NvLink, Some(8)).raw_us > predict(&m, &r, LinkKind::NvLink, None).raw_us);
}

/// The per-transfer threshold and `choose` are one rule: a transfer crosses compressed
/// exactly when it is at least the threshold.
#[test]
fn threshold_is_the_choice_boundary() {
    let m = CostModel::default();
    let mut found = 0;
    for dt in [DataType::BF16, DataType::F16, DataType::F32] {
        for link in LinkKind::ALL {
            let Some(t) = compress_threshold(&m, dt, link) else {
                assert!(!compressed_wins(&m, dt, link, 1 << 40), "{dt:?} {link:?}");
                continue;
            };
            found += 1;
            assert!(t >= MIN_COMPRESS_BYTES);
            for b in [t.saturating_sub(4096), t - 1, t, t + 1, t + 4096, 2 * t, 1 << 40] {
                let call = movement(dt, b);
                assert_eq!(choose(&m, &call, link) == Engine::Compressed, b >= t, "{dt:?} {link:?} {b} vs {t}");
            }
        }
    }
    assert!(found >= 4, "the H200 model compresses over PCIe and the NIC");
    let t = compress_threshold(&m, DataType::BF16, LinkKind::Nic).unwrap();
    // 16.2 µs of codec launches against 5.3 µs saved per MB (0.32 of the bytes at 50 GB/s,
    // less the codec's time): about 3 MB.
    assert!((2 * M..4 * M).contains(&t), "bf16 over a 50 GB/s NIC pays from about 3 MB: {t}");
}

#[test]
fn compress_from_per_peer() {
    let m = CostModel::default();
    let never = CompressFrom::never(3);
    assert_eq!(never.for_dtype(DataType::BF16), None);
    let always = CompressFrom::always(1, 3);
    assert_eq!(always.for_dtype(DataType::F32), Some(&[MIN_COMPRESS_BYTES, usize::MAX, MIN_COMPRESS_BYTES][..]));
    assert_eq!(always.for_dtype(DataType::I32), None);
    let links = [LinkKind::SameGpu, LinkKind::SameGpu, LinkKind::Nic];
    let auto = CompressFrom::by_model(&m, 0, &links);
    let row = auto.for_dtype(DataType::BF16).unwrap();
    assert_eq!(row[0], usize::MAX);
    assert_eq!(row[1], usize::MAX, "same GPU: never");
    assert_eq!(Some(row[2]), compress_threshold(&m, DataType::BF16, LinkKind::Nic));
    assert_eq!(CompressFrom::by_model(&m, 0, &links[..2]).for_dtype(DataType::BF16), None);
}

#[test]
fn spec_round_trips_and_parses() {
    let m = CostModel::default();
    assert_eq!(CostModel::default().with_overrides(&m.to_spec()).unwrap(), m);
    let odd = CostModel { nvlink_gbps: 123.456, f16: CodecCost { ratio: 0.5, ..m.f16 }, ..m.clone() };
    assert_eq!(CostModel::default().with_overrides(&odd.to_spec()).unwrap(), odd);
    // Separators: commas, spaces, newlines; comments.
    let parsed = CostModel::default().with_overrides("nvlink_gbps=100 pcie_gbps=20,\n# a comment\nNIC_GBPS = 7 # trailing\n").unwrap_err();
    // "NIC_GBPS = 7" splits at the spaces: a clear error, not a silent half-read.
    assert_eq!(parsed.code(), ErrorCode::InvalidArgument);
    let ok = CostModel::default().with_overrides("nvlink_gbps=100 pcie_gbps=20,\n# a comment\nNIC_GBPS=7 # trailing\n").unwrap();
    assert_eq!((ok.nvlink_gbps, ok.pcie_gbps, ok.nic_gbps), (100.0, 20.0, 7.0));
    assert_eq!(CostModel::default().with_overrides("").unwrap(), m);
}

#[test]
fn bad_specs_are_errors() {
    for (spec, says) in [
        ("warp_gbps=3", "unknown key"),
        ("nvlink_gbps", "want key=value"),
        ("nvlink_gbps=fast", "not a number"),
        ("nvlink_gbps=0", "must be > 0"),
        ("ce_fixed_us=-1", ">= 0"),
        ("bf16_ratio=0", "(0, 2]"),
        ("f32_ratio=3", "(0, 2]"),
        ("reduce_gbps=inf", "finite"),
        ("pcie_gbps=NaN", "finite"),
    ] {
        let e = CostModel::default().with_overrides(spec).unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidArgument, "{spec}");
        assert!(e.to_string().contains(says), "{spec}: {e}");
    }
}

/// Ranks of different virtual nodes talk over the NIC transport even on one GPU, so their
/// link is `Nic`; ranks of one node keep theirs.
#[test]
fn virtual_nodes_are_nic_links() {
    let cfg = crate::Config { virtual_nodes: 2, ..crate::Config::default() };
    let topo = Topology::synthetic(1, 4, 1, &cfg).unwrap();
    assert_eq!(links(&topo, 0), vec![LinkKind::SameGpu, LinkKind::SameGpu, LinkKind::Nic, LinkKind::Nic]);
    assert_eq!(links(&topo, 3), vec![LinkKind::Nic, LinkKind::Nic, LinkKind::SameGpu, LinkKind::SameGpu]);
    let one = Topology::synthetic(1, 4, 1, &crate::Config::default()).unwrap();
    assert!(links(&one, 0).iter().all(|l| *l == LinkKind::SameGpu));
}

/// `HOCCL_NET_GBPS` replaces `nic_gbps` (and only it); at 0.25 GB/s bf16 compresses over
/// the NIC from the codec's floor, at the nominal 50 GB/s only from megabytes.
#[test]
fn net_rate_sets_the_nic_figure() {
    let m = CostModel::default();
    assert_eq!(m.clone().with_net_rate(0.0), m);
    let slow = m.clone().with_net_rate(0.25);
    assert_eq!(slow.nic_gbps, 0.25);
    assert_eq!(CostModel { nic_gbps: m.nic_gbps, ..slow.clone() }, m);
    assert_eq!(compress_threshold(&slow, DataType::BF16, LinkKind::Nic), Some(MIN_COMPRESS_BYTES));
    assert!(compress_threshold(&m, DataType::BF16, LinkKind::Nic).unwrap() > M);
    assert_eq!(compress_threshold(&slow, DataType::BF16, LinkKind::Pcie), compress_threshold(&m, DataType::BF16, LinkKind::Pcie));
}
