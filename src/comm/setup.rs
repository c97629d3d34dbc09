//! Communicator creation steps: exchange what each rank is, agree on an id, connect the
//! proxies' mailboxes.
use crate::bootstrap::Bootstrap;
use crate::config::Config;
use crate::engine::Links;
use crate::error::{Error, Result};
use crate::transport::mailbox::Segment;

/// What one rank reported at creation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankInfo {
    pub host: String,
    pub pid: u32,
    /// Node index (ranks of one host, split further by `HOCCL_VIRTUAL_NODES`).
    pub node: usize,
    pub local_rank: usize,
    /// GPU ordinal this rank drives (0 on the host backend).
    pub gpu: usize,
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: buf is writable for its length; gethostname NUL-terminates within it or
    // truncates, and we stop at the first NUL.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if r != 0 {
        return "unknown-host".into();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// All-gather (host, pid, GPU count) and derive nodes, local ranks and GPUs.
pub fn exchange_rank_info(b: &dyn Bootstrap, cfg: &Config) -> Result<Vec<RankInfo>> {
    const OP: &str = "Communicator::new";
    let gpus = match cfg.backend {
        crate::config::BackendChoice::Host => 0,
        _ => crate::device::cuda::probe().map(|p| p.count).unwrap_or(0),
    };
    let rec = format!("{}\n{}\n{}", hostname(), std::process::id(), gpus);
    let all = b.all_gather(rec.as_bytes()).map_err(|e| e.with_op(OP))?;
    let mut parsed = Vec::with_capacity(all.len());
    for (r, raw) in all.iter().enumerate() {
        let s = String::from_utf8_lossy(raw);
        let mut it = s.split('\n');
        let (Some(host), Some(pid), Some(g)) = (it.next(), it.next(), it.next()) else {
            return Err(Error::internal(OP, format!("bad rank record from rank {r}")));
        };
        let pid: u32 = pid.parse().map_err(|_| Error::internal(OP, format!("bad pid from rank {r}")))?;
        let g: usize = g.parse().map_err(|_| Error::internal(OP, format!("bad GPU count from rank {r}")))?;
        parsed.push((host.to_string(), pid, g));
    }
    // Hosts in order of first appearance; each host's ranks split into virtual nodes.
    let mut hosts: Vec<&str> = Vec::new();
    for (h, _, _) in &parsed {
        if !hosts.contains(&h.as_str()) {
            hosts.push(h);
        }
    }
    let vn = cfg.virtual_nodes;
    let mut out = vec![None; parsed.len()];
    for (hi, h) in hosts.iter().enumerate() {
        let ranks: Vec<usize> = (0..parsed.len()).filter(|r| parsed[*r].0 == *h).collect();
        if vn > ranks.len() {
            return Err(Error::invalid_arg(OP, format!("HOCCL_VIRTUAL_NODES={vn} exceeds the {} ranks on host {h}", ranks.len())));
        }
        let per = ranks.len().div_ceil(vn);
        for (i, &r) in ranks.iter().enumerate() {
            let (host, pid, g) = &parsed[r];
            let sub = i / per;
            let local_rank = i % per;
            let gpu = cfg.device.unwrap_or(if *g > 0 { i % g } else { 0 });
            out[r] = Some(RankInfo { host: host.clone(), pid: *pid, node: hi * vn + sub, local_rank, gpu });
        }
    }
    out.into_iter().map(|o| o.ok_or_else(|| Error::internal(OP, "rank without node"))).collect()
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
pub fn connect_mailboxes(b: &dyn Bootstrap, info: &[RankInfo], comm_id: u64, local: &[usize]) -> Result<Links> {
    const OP: &str = "Communicator::new";
    let rank = b.rank();
    let local_index = local.iter().position(|r| *r == rank).ok_or_else(|| Error::internal(OP, "rank not in its node"))?;
    let inbox = Segment::create(&Segment::name(info[rank].pid, comm_id, rank), local.len());
    // Everyone must learn whether everyone succeeded, or a failing rank leaves the rest
    // waiting: all-gather the outcome.
    let ok = b.all_gather(&[inbox.is_ok() as u8]).map_err(|e| e.with_op(OP))?;
    let inbox = inbox?;
    if let Some(bad) = ok.iter().position(|r| r.first() != Some(&1)) {
        return Err(Error::Remote { op: OP, peer: bad, what: "could not create its mailbox".into() });
    }
    let mut peers: Vec<Option<Segment>> = (0..info.len()).map(|_| None).collect();
    let mut local_of = vec![None; info.len()];
    for (li, &r) in local.iter().enumerate() {
        local_of[r] = Some(li);
        if r != rank {
            peers[r] = Some(Segment::open(&Segment::name(info[r].pid, comm_id, r), local.len())?);
        }
    }
    b.barrier().map_err(|e| e.with_op(OP))?;
    Ok(Links { rank, inbox, peers, local_index, local_of })
}
