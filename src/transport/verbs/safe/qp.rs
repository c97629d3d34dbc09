//! Reliable-connected queue pairs: creation, the RESET → INIT → RTR → RTS transitions given
//! the peer's [`Endpoint`], and posting sends, receives and RDMA writes.
//!
//! Connection recipe (both sides): create the QP, exchange [`Endpoint`]s out of band (the
//! bootstrap), then `connect(path, local_psn, &remote)`. InfiniBand addresses the peer by
//! LID (`PathConfig::gid_index = None`); RoCE needs a GID index (usually 3 for RoCE v2).
use super::{Access, CompletionQueue, MemoryRegion, ProtectionDomain};
use crate::error::{Error, Result};
use crate::transport::verbs::result as r;
use crate::transport::verbs::sys;
use std::sync::Arc;

/// Queue sizes requested at creation (the provider may round them up).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps { max_send_wr: 256, max_recv_wr: 256, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 }
    }
}

/// What a peer needs to connect to a queue pair; exchanged through the bootstrap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Endpoint {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
}

impl Endpoint {
    pub const BYTES: usize = 26;

    /// Fixed little-endian encoding: qpn, psn, lid, gid.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[0..4].copy_from_slice(&self.qpn.to_le_bytes());
        b[4..8].copy_from_slice(&self.psn.to_le_bytes());
        b[8..10].copy_from_slice(&self.lid.to_le_bytes());
        b[10..26].copy_from_slice(&self.gid);
        b
    }

    pub fn from_bytes(b: &[u8]) -> Result<Endpoint> {
        let b: &[u8; Self::BYTES] =
            b.try_into().map_err(|_| Error::invalid_arg("verbs::Endpoint::from_bytes", format!("{} bytes, want {}", b.len(), Self::BYTES)))?;
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[10..26]);
        Ok(Endpoint {
            qpn: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            psn: u32::from_le_bytes([b[4], b[5], b[6], b[7]]) & 0x00ff_ffff,
            lid: u16::from_le_bytes([b[8], b[9]]),
            gid,
        })
    }
}

/// Path and timing parameters of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PathConfig {
    /// Local port, 1-based.
    pub port: u8,
    /// Source GID index for a routed (GRH) path; required on RoCE, `None` on InfiniBand.
    pub gid_index: Option<u8>,
    /// Path MTU as an `ibv_mtu` code; 0 takes the port's active MTU.
    pub mtu_code: u32,
    pub service_level: u8,
    pub traffic_class: u8,
    /// Local ACK timeout exponent (4.096 µs × 2^timeout).
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    /// Outstanding RDMA reads/atomics (initiator and responder).
    pub max_rd_atomic: u8,
}

impl Default for PathConfig {
    fn default() -> Self {
        PathConfig {
            port: 1,
            gid_index: None,
            mtu_code: 0,
            service_level: 0,
            traffic_class: 0,
            timeout: 18,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
        }
    }
}

/// A scatter/gather element: `len` bytes at `offset` into a memory region.
#[derive(Clone, Copy)]
pub struct Sge<'a> {
    mr: &'a MemoryRegion,
    offset: usize,
    len: u32,
}

impl<'a> Sge<'a> {
    /// Bounds-checked against the region.
    pub fn new(mr: &'a MemoryRegion, offset: usize, len: usize) -> Result<Sge<'a>> {
        let in_bounds = offset.checked_add(len).is_some_and(|end| end <= mr.len());
        let len32 = u32::try_from(len).ok();
        match (in_bounds, len32) {
            (true, Some(len)) => Ok(Sge { mr, offset, len }),
            _ => Err(Error::invalid_arg("verbs::Sge::new", format!("[{offset}, +{len}) outside a {}-byte region", mr.len()))),
        }
    }

    fn raw(&self) -> sys::ibv_sge {
        sys::ibv_sge { addr: self.mr.addr() + self.offset as u64, length: self.len, lkey: self.mr.lkey() }
    }
}

/// A reliable-connected queue pair.
pub struct QueuePair {
    raw: *mut sys::ibv_qp,
    pd: Arc<ProtectionDomain>,
    _send_cq: Arc<CompletionQueue>,
    _recv_cq: Arc<CompletionQueue>,
}

// SAFETY: libibverbs QPs may be used from any thread (providers lock post and modify).
unsafe impl Send for QueuePair {}
// SAFETY: as above.
unsafe impl Sync for QueuePair {}

impl ProtectionDomain {
    /// A new RC queue pair in RESET state; completions go to `send_cq` / `recv_cq`.
    pub fn create_rc_qp(self: &Arc<Self>, send_cq: &Arc<CompletionQueue>, recv_cq: &Arc<CompletionQueue>, caps: QpCaps) -> Result<QueuePair> {
        let mut attr = sys::ibv_qp_init_attr {
            send_cq: send_cq.raw(),
            recv_cq: recv_cq.raw(),
            cap: sys::ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: caps.max_recv_wr,
                max_send_sge: caps.max_send_sge,
                max_recv_sge: caps.max_recv_sge,
                max_inline_data: caps.max_inline_data,
            },
            qp_type: sys::IBV_QPT_RC,
            sq_sig_all: 0,
            ..Default::default()
        };
        // SAFETY: the PD and both CQs are live and outlive the QP (it holds Arcs to them).
        let raw = unsafe { r::create_qp(self.context().verbs(), self.raw, &mut attr) }
            .map_err(|e| e.with_op("verbs::ProtectionDomain::create_rc_qp"))?;
        Ok(QueuePair { raw, pd: self.clone(), _send_cq: send_cq.clone(), _recv_cq: recv_cq.clone() })
    }
}

impl QueuePair {
    pub fn qp_num(&self) -> u32 {
        // SAFETY: raw is a live ibv_qp while self lives; qp_num is immutable.
        unsafe { (*self.raw).qp_num }
    }

    /// This side's endpoint for the peer: QP number, `psn`, the port's LID and (with a GID
    /// index) its GID.
    pub fn local_endpoint(&self, path: &PathConfig, psn: u32) -> Result<Endpoint> {
        let ctx = self.pd.context();
        let port = ctx.query_port(path.port)?;
        let gid = match path.gid_index {
            Some(i) => ctx.query_gid(path.port, i as i32)?,
            None => [0; 16],
        };
        Ok(Endpoint { qpn: self.qp_num(), psn: psn & 0x00ff_ffff, lid: port.lid, gid })
    }

    fn modify(&self, op: &'static str, attr: &mut sys::ibv_qp_attr, mask: u32) -> Result<()> {
        // SAFETY: raw is live while self lives; attr is valid for the call.
        unsafe { r::modify_qp(self.pd.context().verbs(), self.raw, attr, mask) }.map_err(|e| e.with_op(op))
    }

    /// RESET → INIT, allowing the peer the given remote accesses.
    pub fn to_init(&self, path: &PathConfig, access: Access) -> Result<()> {
        let mut a = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: path.port,
            qp_access_flags: access.0,
            ..Default::default()
        };
        let mask = sys::IBV_QP_STATE | sys::IBV_QP_PKEY_INDEX | sys::IBV_QP_PORT | sys::IBV_QP_ACCESS_FLAGS;
        self.modify("verbs::QueuePair::to_init", &mut a, mask)
    }

    /// INIT → RTR (ready to receive) towards `remote`.
    pub fn to_rtr(&self, path: &PathConfig, remote: &Endpoint) -> Result<()> {
        let mtu = if path.mtu_code != 0 { path.mtu_code } else { self.pd.context().query_port(path.port)?.active_mtu_code };
        let mut ah = sys::ibv_ah_attr { dlid: remote.lid, sl: path.service_level, port_num: path.port, ..Default::default() };
        if let Some(i) = path.gid_index {
            ah.is_global = 1;
            ah.grh.dgid = sys::ibv_gid { raw: remote.gid };
            ah.grh.sgid_index = i;
            ah.grh.hop_limit = 255;
            ah.grh.traffic_class = path.traffic_class;
        }
        let mut a = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_RTR,
            path_mtu: mtu,
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn & 0x00ff_ffff,
            max_dest_rd_atomic: path.max_rd_atomic,
            min_rnr_timer: 12,
            ah_attr: ah,
            ..Default::default()
        };
        let mask = sys::IBV_QP_STATE
            | sys::IBV_QP_AV
            | sys::IBV_QP_PATH_MTU
            | sys::IBV_QP_DEST_QPN
            | sys::IBV_QP_RQ_PSN
            | sys::IBV_QP_MAX_DEST_RD_ATOMIC
            | sys::IBV_QP_MIN_RNR_TIMER;
        self.modify("verbs::QueuePair::to_rtr", &mut a, mask)
    }

    /// RTR → RTS (ready to send), starting at `local_psn`.
    pub fn to_rts(&self, path: &PathConfig, local_psn: u32) -> Result<()> {
        let mut a = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_RTS,
            timeout: path.timeout,
            retry_cnt: path.retry_cnt,
            rnr_retry: path.rnr_retry,
            sq_psn: local_psn & 0x00ff_ffff,
            max_rd_atomic: path.max_rd_atomic,
            ..Default::default()
        };
        let mask = sys::IBV_QP_STATE
            | sys::IBV_QP_TIMEOUT
            | sys::IBV_QP_RETRY_CNT
            | sys::IBV_QP_RNR_RETRY
            | sys::IBV_QP_SQ_PSN
            | sys::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify("verbs::QueuePair::to_rts", &mut a, mask)
    }

    /// INIT (remote write and read allowed) → RTR → RTS in one call.
    pub fn connect(&self, path: &PathConfig, local_psn: u32, remote: &Endpoint) -> Result<()> {
        self.to_init(path, Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ)?;
        self.to_rtr(path, remote)?;
        self.to_rts(path, local_psn)
    }

    fn post(&self, op: &'static str, mut wr: sys::ibv_send_wr) -> Result<()> {
        // SAFETY: raw is live; wr's SGE points to memory of a live region (Sge borrows it)
        // and is copied by the provider during the call.
        unsafe { r::post_send(self.raw, &mut wr) }.map_err(|e| e.with_op(op))
    }

    /// RDMA write of `src` to `remote_addr` (rkey `rkey`) of the peer, with optional
    /// immediate data (which consumes a receive on the peer and completes there).
    pub fn post_write(&self, wr_id: u64, src: Sge<'_>, remote_addr: u64, rkey: u32, imm: Option<u32>, signaled: bool) -> Result<()> {
        let mut sge = src.raw();
        let mut wr = send_wr(wr_id, &mut sge, signaled);
        wr.opcode = if imm.is_some() { sys::IBV_WR_RDMA_WRITE_WITH_IMM } else { sys::IBV_WR_RDMA_WRITE };
        wr.__bindgen_anon_1.imm_data = imm.unwrap_or(0).to_be();
        wr.wr.rdma = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
        self.post("verbs::QueuePair::post_write", wr)
    }

    /// A two-sided send of `src` (or a zero-byte message), with optional immediate data.
    pub fn post_send(&self, wr_id: u64, src: Option<Sge<'_>>, imm: Option<u32>, signaled: bool) -> Result<()> {
        let mut sge = src.map(|s| s.raw()).unwrap_or_default();
        let mut wr = send_wr(wr_id, &mut sge, signaled);
        if src.is_none() {
            wr.sg_list = std::ptr::null_mut();
            wr.num_sge = 0;
        }
        wr.opcode = if imm.is_some() { sys::IBV_WR_SEND_WITH_IMM } else { sys::IBV_WR_SEND };
        wr.__bindgen_anon_1.imm_data = imm.unwrap_or(0).to_be();
        self.post("verbs::QueuePair::post_send", wr)
    }

    /// A receive into `dst` (or a zero-byte receive, enough for write-with-immediate).
    pub fn post_recv(&self, wr_id: u64, dst: Option<Sge<'_>>) -> Result<()> {
        let mut sge = dst.map(|s| s.raw()).unwrap_or_default();
        let mut wr = sys::ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: if dst.is_some() { &mut sge } else { std::ptr::null_mut() },
            num_sge: i32::from(dst.is_some()),
        };
        // SAFETY: raw is live; the SGE points into a live region and is copied during the call.
        unsafe { r::post_recv(self.raw, &mut wr) }.map_err(|e| e.with_op("verbs::QueuePair::post_recv"))
    }
}

fn send_wr(wr_id: u64, sge: &mut sys::ibv_sge, signaled: bool) -> sys::ibv_send_wr {
    sys::ibv_send_wr {
        wr_id,
        next: std::ptr::null_mut(),
        sg_list: sge,
        num_sge: 1,
        send_flags: if signaled { sys::IBV_SEND_SIGNALED } else { 0 },
        ..Default::default()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once; the PD and CQs are alive through self's Arcs.
        if let Err(e) = unsafe { r::destroy_qp(self.pd.context().verbs(), self.raw) } {
            log::warn!("hoccl: ibv_destroy_qp: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_round_trips() {
        let e = Endpoint { qpn: 0x1234, psn: 0xabcdef, lid: 7, gid: [9; 16] };
        assert_eq!(Endpoint::from_bytes(&e.to_bytes()).ok(), Some(e));
        assert!(Endpoint::from_bytes(&[0; 3]).is_err());
    }
}
