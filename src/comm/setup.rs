//! Communicator creation steps: exchange what each rank is, agree on an id, connect the
//! proxies' mailboxes.
use crate::bootstrap::Bootstrap;
use crate::config::{Config, EngineChoice};
use crate::cost::{CompressFrom, CostModel, LinkKind};
use crate::types::DataType;
use crate::transport::same_host::Links;
use crate::error::{Error, Result};
use crate::topology::{RankRecord, Topology};
use crate::transport::mailbox::Segment;

/// All-gather every rank's record (host, pid, GPUs seen, requested GPU, its PCI id) and
/// build the topology: nodes (virtual nodes included), local ranks, GPU per rank, peer
/// access between the GPUs of a node.
pub fn build_topology(b: &dyn Bootstrap, cfg: &Config) -> Result<Topology> {
    const OP: &str = "Communicator::new";
    let probe = match cfg.backend {
        crate::config::BackendChoice::Host => None,
        _ => crate::device::cuda::probe().ok().filter(|p| p.count > 0),
    };
    let gpu_count = probe.as_ref().map_or(0, |p| p.count);
    let pci_of = |g: usize| probe.as_ref().and_then(|p| p.gpus.get(g)).map(|g| g.pci_bus_id.clone()).unwrap_or_default();
    // This host's NIC-affine forwarding map from sysfs (empty without GPUs or a usable NIC).
    let forwarding = probe.as_ref().map(|p| crate::sysfs::forwarding_map(&p.gpus.iter().map(|g| g.pci_bus_id.clone()).collect::<Vec<_>>())).unwrap_or_default();
    let rec = RankRecord::for_this_process(cfg, gpu_count as u32, &cfg.device.map(pci_of).unwrap_or_default()).with_forwarding(forwarding);
    let all = b.all_gather(&rec.to_bytes()?).map_err(|e| e.with_op(OP))?;
    let records = all.iter().map(|r| RankRecord::from_bytes(r)).collect::<Result<Vec<_>>>()?;
    let peer = |a: usize, b: usize| probe.as_ref().and_then(|p| p.peer_access.get(a).and_then(|row| row.get(b)).copied()).unwrap_or(false);
    let topo = Topology::build(&records, cfg, peer)?;
    // Ranks of this host know every GPU's PCI id from the same probe.
    if probe.is_some() {
        let ids: Vec<String> = topo.ranks().iter().map(|r| if topo.same_host(r.rank, b.rank()) { pci_of(r.gpu) } else { String::new() }).collect();
        return topo.with_pci_bus_ids(&ids);
    }
    Ok(topo)
}

/// A communicator id every rank agrees on (rank 0's pick).
pub fn agree_comm_id(b: &dyn Bootstrap) -> Result<u64> {
    use std::time::{SystemTime, UNIX_EPOCH};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let mine = t ^ ((std::process::id() as u64) << 40) ^ COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let all = b.all_gather(&mine.to_le_bytes()).map_err(|e| e.with_op("Communicator::new"))?;
    let first = all.first().filter(|r| r.len() == 8).ok_or_else(|| Error::internal("Communicator::new", "bad id record"))?;
    let mut a = [0u8; 8];
    a.copy_from_slice(first);
    Ok(u64::from_le_bytes(a))
}

/// Create this rank's mailbox, wait for everyone's, open the local peers'.
pub fn connect_mailboxes(b: &dyn Bootstrap, topo: &Topology, comm_id: u64, local: &[usize]) -> Result<Links> {
    const OP: &str = "Communicator::new";
    let rank = b.rank();
    let local_index = local.iter().position(|r| *r == rank).ok_or_else(|| Error::internal(OP, "rank not in its node"))?;
    let inbox = Segment::create(&Segment::name(topo.ranks()[rank].pid, comm_id, rank), local.len());
    // Everyone must learn whether everyone succeeded, or a failing rank leaves the rest
    // waiting: all-gather the outcome.
    let ok = b.all_gather(&[inbox.is_ok() as u8]).map_err(|e| e.with_op(OP))?;
    let inbox = inbox?;
    if let Some(bad) = ok.iter().position(|r| r.first() != Some(&1)) {
        return Err(Error::Remote { op: OP, peer: bad, what: "could not create its mailbox".into() });
    }
    let mut peers: Vec<Option<Segment>> = (0..topo.nranks()).map(|_| None).collect();
    let mut local_of = vec![None; topo.nranks()];
    for (li, &r) in local.iter().enumerate() {
        local_of[r] = Some(li);
        if r != rank {
            peers[r] = Some(Segment::open(&Segment::name(topo.ranks()[r].pid, comm_id, r), local.len())?);
        }
    }
    b.barrier().map_err(|e| e.with_op(OP))?;
    Ok(Links { rank, inbox, peers, local_index, local_of })
}

/// The engine setting resolved for rank `b.rank()`: the link to every rank, the cost model
/// (rank 0's, so every rank chooses alike; a rank whose own differs says so at warn level)
/// and, per dtype and peer, the smallest transfer that crosses compressed. Collective (one
/// all-gather of the model), whatever the engine, so ranks whose settings differ still
/// create the communicator together.
pub fn resolve_engine(b: &dyn Bootstrap, topo: &Topology, cfg: &Config) -> Result<(Vec<LinkKind>, CostModel, CompressFrom)> {
    const OP: &str = "Communicator::new";
    let (me, n) = (b.rank(), b.size());
    let spec = cfg.cost_model.to_spec();
    let all = b.all_gather(spec.as_bytes()).map_err(|e| e.with_op(OP))?;
    let root = std::str::from_utf8(&all[0]).map_err(|_| Error::internal(OP, "rank 0's cost model is not text"))?;
    let model = CostModel::default().with_overrides(root).map_err(|e| e.with_op(OP))?;
    if model != cfg.cost_model {
        log::warn!("hoccl: rank {me}: HOCCL_COST_MODEL differs from rank 0's; using rank 0's ({root})");
    }
    let links = crate::cost::links(topo, me);
    let from = match cfg.engine {
        EngineChoice::Auto => CompressFrom::by_model(&model, me, &links),
        EngineChoice::Compressed => CompressFrom::always(me, n),
        EngineChoice::CopyEngine | EngineChoice::Sm => CompressFrom::never(n),
    };
    if cfg.engine == EngineChoice::Auto {
        for dt in [DataType::BF16, DataType::F16, DataType::F32] {
            let row = from.for_dtype(dt).unwrap_or(&[]);
            log::debug!("rank {me}: HOCCL_ENGINE=auto: {dt:?} transfers cross compressed from (bytes, per peer) {row:?}");
        }
    }
    Ok((links, model, from))
}
