//! Communicator creation steps: exchange what each rank is, agree on an id, connect the
//! proxies' mailboxes (ranks of one node) and set up the transport between nodes (publish
//! the socket addresses, or exchange the verbs channels' setups).
use crate::bootstrap::Bootstrap;
use crate::config::{Config, EngineChoice};
use crate::cost::{CompressFrom, CostModel, LinkKind};
use crate::types::DataType;
use crate::transport::same_host::Links;
use crate::error::{Error, Result};
use crate::topology::{RankRecord, Topology};
use crate::transport::mailbox::{FlagArea, Segment};
use crate::transport::staged::FlagMaps;
use crate::transport::socket::{self, NetLinks};
use crate::transport::verbs::{self, channel::{Channel, Setup}, transport::VerbsLinks};
use crate::transport::Far;

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

/// A communicator id every rank agrees on (rank 0's pick): random, since it names the
/// ranks' mailboxes in `/dev/shm`, which no other process should be able to guess.
pub fn agree_comm_id(b: &dyn Bootstrap) -> Result<u64> {
    let mut r = [0u8; 8];
    crate::bootstrap::tcp::fill_random(&mut r).map_err(|e| e.with_op("Communicator::new"))?;
    let mine = u64::from_le_bytes(r);
    let all = b.all_gather(&mine.to_le_bytes()).map_err(|e| e.with_op("Communicator::new"))?;
    let first = all.first().filter(|r| r.len() == 8).ok_or_else(|| Error::internal("Communicator::new", "bad id record"))?;
    let mut a = [0u8; 8];
    a.copy_from_slice(first);
    Ok(u64::from_le_bytes(a))
}

/// Create this rank's mailbox, wait for everyone's, open the local peers'. With `flag_maps`
/// (the staged path is wanted), also map every local rank's mailbox once more for the staged
/// path's flag words (`transport::staged`), by global rank: the names are unlinked before
/// this returns, so no mapping can be made later. A failed mapping is returned as its error
/// (the staged path then stays off, decided collectively at its setup).
pub fn connect_mailboxes(b: &dyn Bootstrap, topo: &Topology, comm_id: u64, local: &[usize], flag_maps: bool) -> Result<(Links, FlagMaps)> {
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
    let areas = if flag_maps { local.iter().map(|&r| (r, FlagArea::open(&Segment::name(topo.ranks()[r].pid, comm_id, r), local.len()))).collect() } else { Vec::new() };
    b.barrier().map_err(|e| e.with_op(OP))?;
    // Every local rank has mapped every mailbox it needs: the names can go.
    let mut inbox = inbox;
    inbox.unlink();
    Ok((Links { rank, inbox, peers, local_index, local_of }, areas))
}

/// When ranks span several nodes: choose the transport between nodes (`HOCCL_NET`,
/// collectively), and set it up: for sockets, listen for this rank's peers of other nodes
/// and all-gather every rank's address and secret; for verbs, open the NIC, make one
/// channel per rank of another node and all-gather every channel's setup, then connect.
/// None when every rank is on this rank's node. Collective whenever the topology has
/// several nodes (every rank sees the same topology); a rank that cannot take part (its
/// `HOCCL_NET` cannot be met, it cannot listen or open its NIC) fails every rank. On a
/// `backend` whose memory is not host memory the socket transport stages through
/// `HOCCL_NET_STAGING` bytes, and so does the verbs transport.
pub fn listen_for_peers(b: &dyn Bootstrap, topo: &Topology, cfg: &Config, comm_id: u64, backend: crate::device::Backend) -> Result<Option<Far>> {
    const OP: &str = "Communicator::new";
    if topo.nnodes() <= 1 {
        return Ok(None);
    }
    let me = b.rank();
    let mine = verbs::decide(cfg).map_err(|why| Error::invalid_usage(OP, format!("rank {me}: {why}")));
    // Record: 1 sockets, 2 verbs (required), 3 verbs (or sockets); or 0 and the reason.
    let rec = match &mine {
        Ok(c) if !c.verbs => vec![1u8],
        Ok(c) => vec![if c.forced { 2u8 } else { 3 }],
        Err(e) => [&[0u8][..], e.to_string().as_bytes()].concat(),
    };
    let all = b.all_gather(&rec).map_err(|e| e.with_op(OP))?;
    let mine = mine?;
    let mut want = [None::<usize>; 4];
    for (r, rec) in all.iter().enumerate() {
        match rec.split_first() {
            Some((&k @ 1..=3, _)) => {
                want[k as usize].get_or_insert(r);
            }
            Some((_, why)) => return Err(Error::Remote { op: OP, peer: r, what: format!("cannot take part across nodes: {}", String::from_utf8_lossy(why)) }),
            None => return Err(Error::Remote { op: OP, peer: r, what: "sent an empty transport record".into() }),
        }
    }
    let verbs = match (want[1], want[2]) {
        (Some(s), Some(v)) => {
            let what = format!("it takes the socket transport between nodes, and rank {v} requires verbs (HOCCL_NET=ib); set HOCCL_NET alike on every rank");
            return Err(Error::Remote { op: OP, peer: s, what });
        }
        (None, _) => true,
        (Some(_), None) => false,
    };
    if verbs == mine.verbs {
        log::info!("hoccl: rank {me}: inter-node transport: {}", mine.line);
    } else {
        log::info!("hoccl: rank {me}: inter-node transport: socket (HOCCL_NET=auto; rank {} takes sockets)", want[1].unwrap_or(0));
    }
    if verbs {
        connect_channels(b, topo, cfg, backend).map(|l| Some(Far::Verbs(l)))
    } else {
        exchange_addresses(b, topo, cfg, comm_id, backend).map(|l| Some(Far::Socket(l)))
    }
}

/// The socket transport's setup: listen, all-gather every rank's address, secret and
/// largest payload taken.
fn exchange_addresses(b: &dyn Bootstrap, topo: &Topology, cfg: &Config, comm_id: u64, backend: crate::device::Backend) -> Result<NetLinks> {
    const OP: &str = "Communicator::new";
    let me = b.rank();
    let mine = socket::listen(topo.nhosts() == 1, cfg.socket_ifname.as_deref());
    // The host backend's device memory is host memory: the sockets use it directly.
    let staging = (backend != crate::device::Backend::Host || cfg.net_stage_host_memory).then_some(cfg.net_staging_bytes);
    let addr = mine.as_ref().ok().map(|(l, _)| l.local_addr());
    // Record: status (1 listening), secret, largest payload taken, address as text; or 0
    // and the reason.
    let rec = match (&mine, addr) {
        (Ok((_, secret)), Some(Ok(a))) => [&[1u8][..], &secret[..], &(socket::max_chunk(staging) as u64).to_le_bytes(), a.to_string().as_bytes()].concat(),
        (Err(e), _) => [&[0u8][..], e.to_string().as_bytes()].concat(),
        (_, _) => [&[0u8][..], b"could not read its listening address"].concat(),
    };
    let all = b.all_gather(&rec).map_err(|e| e.with_op(OP))?;
    let (listener, secret) = mine?;
    let mut peers = vec![None; topo.nranks()];
    for (r, rec) in all.iter().enumerate() {
        match rec.split_first() {
            Some((1, rest)) if rest.len() > 24 => {
                if topo.same_node(me, r) {
                    continue;
                }
                let secret: [u8; 16] = rest[..16].try_into().expect("16 bytes");
                let max_chunk = u64::from_le_bytes(rest[16..24].try_into().expect("8 bytes")) as usize;
                let addr = std::str::from_utf8(&rest[24..]).ok().and_then(|s| s.parse().ok());
                let addr = addr.ok_or_else(|| Error::Remote { op: OP, peer: r, what: "published a bad socket address".into() })?;
                peers[r] = Some(socket::Remote { addr, secret, max_chunk: max_chunk.max(1) });
            }
            Some((_, why)) => return Err(Error::Remote { op: OP, peer: r, what: format!("cannot take part across nodes: {}", String::from_utf8_lossy(why)) }),
            None => return Err(Error::Remote { op: OP, peer: r, what: "sent an empty address record".into() }),
        }
    }
    // Every rank's forwarding peer may carry that rank's point-to-point sends (`relay`).
    let forwarder_of = topo.ranks().iter().map(|r| r.forwarding_peer).collect();
    Ok(NetLinks { rank: me, comm_id, listener, peers, secret, qps: cfg.qps_per_peer, gbps: cfg.net_gbps, staging, timeout: cfg.timeout, forwarder_of })
}

/// The verbs transport's setup: open the NIC, make a channel (`HOCCL_QPS_PER_PEER` queue
/// pairs, slots from `HOCCL_NET_STAGING`) per rank of another node, all-gather every
/// rank's setups (one per peer, each peer reads its own), connect, and all-gather the
/// outcome, so no rank writes to a peer whose queue pairs are not connected yet.
fn connect_channels(b: &dyn Bootstrap, topo: &Topology, cfg: &Config, backend: crate::device::Backend) -> Result<VerbsLinks> {
    const OP: &str = "Communicator::new";
    let (me, n) = (b.rank(), topo.nranks());
    let remote: Vec<usize> = (0..n).filter(|r| !topo.same_node(me, *r)).collect();
    let (nslots, slot_bytes) = verbs::slots_for(cfg.net_staging_bytes, remote.len());
    let opened = (|| -> Result<_> {
        let (mut nic, name) = verbs::open_nic(cfg, cfg.qps_per_peer * remote.len())?;
        let mut channels: Vec<Option<Channel>> = (0..n).map(|_| None).collect();
        let mut setups: Vec<Vec<u8>> = vec![Vec::new(); n];
        for &r in &remote {
            let (ch, setup) = Channel::new(nic.as_mut(), cfg.qps_per_peer, nslots, slot_bytes)?;
            channels[r] = Some(ch);
            setups[r] = setup.to_bytes();
        }
        Ok((nic, name, channels, setups))
    })();
    // Record: 1 and, per rank, a u32 length and the setup of the channel to it; or 0 and
    // the reason.
    let rec = match &opened {
        Ok((_, _, _, setups)) => {
            let mut v = vec![1u8];
            for s in setups {
                v.extend_from_slice(&(s.len() as u32).to_le_bytes());
                v.extend_from_slice(s);
            }
            v
        }
        Err(e) => [&[0u8][..], format!("cannot open its verbs NIC: {e}").as_bytes()].concat(),
    };
    let all = b.all_gather(&rec).map_err(|e| e.with_op(OP))?;
    let mut theirs: Vec<Option<&[u8]>> = vec![None; n];
    for (r, rec) in all.iter().enumerate() {
        match rec.split_first() {
            Some((1, mut rest)) => {
                for q in 0..n {
                    let len = rest.get(..4).map(|l| u32::from_le_bytes(l.try_into().expect("4 bytes")) as usize);
                    let Some(s) = len.and_then(|l| rest.get(4..4 + l)) else {
                        return Err(Error::Remote { op: OP, peer: r, what: "sent a truncated verbs setup record".into() });
                    };
                    if q == me {
                        theirs[r] = Some(s);
                    }
                    rest = &rest[4 + s.len()..];
                }
            }
            Some((_, why)) => return Err(Error::Remote { op: OP, peer: r, what: String::from_utf8_lossy(why).into_owned() }),
            None => return Err(Error::Remote { op: OP, peer: r, what: "sent an empty verbs setup record".into() }),
        }
    }
    let (mut nic, nic_name, mut channels, _) = opened?;
    let connected = (|| -> Result<()> {
        for &r in &remote {
            let setup = Setup::from_bytes(theirs[r].unwrap_or_default()).map_err(|e| Error::Remote { op: OP, peer: r, what: format!("its verbs setup: {e}") })?;
            let ch = channels[r].as_mut().expect("made above");
            ch.connect(nic.as_mut(), &setup).map_err(|e| Error::Remote { op: OP, peer: r, what: format!("connecting to its queue pairs: {e}") })?;
        }
        Ok(())
    })();
    let rec = match &connected {
        Ok(()) => vec![1u8],
        Err(e) => [&[0u8][..], e.to_string().as_bytes()].concat(),
    };
    let all = b.all_gather(&rec).map_err(|e| e.with_op(OP))?;
    connected?;
    if let Some(r) = all.iter().position(|x| x.first() != Some(&1)) {
        return Err(Error::Remote { op: OP, peer: r, what: format!("could not connect its verbs channels: {}", String::from_utf8_lossy(all[r].get(1..).unwrap_or_default())) });
    }
    // As for sockets: the host backend's device memory is host memory, copied directly.
    let staging = (backend != crate::device::Backend::Host || cfg.net_stage_host_memory).then_some(cfg.net_staging_bytes);
    Ok(VerbsLinks { rank: me, nic, channels, gbps: cfg.net_gbps, nic_name, staging })
}

/// The engine setting resolved for rank `b.rank()`: the link to every rank, the cost model
/// (rank 0's, so every rank chooses alike; a rank whose own differs says so at warn level)
/// and, per dtype and peer, the smallest transfer that crosses compressed. Collective (one
/// all-gather of the model), whatever the engine, so ranks whose settings differ still
/// create the communicator together.
pub fn resolve_engine(b: &dyn Bootstrap, topo: &Topology, cfg: &Config) -> Result<(Vec<LinkKind>, CostModel, CompressFrom)> {
    const OP: &str = "Communicator::new";
    let (me, n) = (b.rank(), b.size());
    // The transport's rate limit is what crosses between nodes (cost::CostModel::with_net_rate).
    let own = cfg.cost_model.clone().with_net_rate(cfg.net_gbps);
    let spec = own.to_spec();
    let all = b.all_gather(spec.as_bytes()).map_err(|e| e.with_op(OP))?;
    let root = std::str::from_utf8(&all[0]).map_err(|_| Error::internal(OP, "rank 0's cost model is not text"))?;
    let model = CostModel::default().with_overrides(root).map_err(|e| e.with_op(OP))?;
    if model != own {
        log::warn!("hoccl: rank {me}: HOCCL_COST_MODEL (with HOCCL_NET_GBPS as the NIC rate) differs from rank 0's; using rank 0's ({root})");
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
