//! Level 3: owning verbs types. Every object holds an `Arc` to its parent, so a protection
//! domain cannot outlive its device context, a memory region its protection domain, a queue
//! pair its CQs. Drop never panics: a failing destroy call is logged.
//!
//! All verbs objects are thread-safe in libibverbs (the providers lock internally), so the
//! types here are `Send + Sync`.
use super::result as r;
use super::sys::{self, Verbs};
use crate::error::{Error, Result};
use std::sync::Arc;

mod qp;
pub use qp::{Endpoint, PathConfig, QpCaps, QueuePair, Sge};

/// Memory access rights of a memory region or queue pair (`IBV_ACCESS_*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Access(pub u32);

impl Access {
    pub const LOCAL_WRITE: Access = Access(sys::IBV_ACCESS_LOCAL_WRITE);
    pub const REMOTE_WRITE: Access = Access(sys::IBV_ACCESS_REMOTE_WRITE);
    pub const REMOTE_READ: Access = Access(sys::IBV_ACCESS_REMOTE_READ);
    pub const RELAXED_ORDERING: Access = Access(sys::IBV_ACCESS_RELAXED_ORDERING);
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, o: Access) -> Access {
        Access(self.0 | o.0)
    }
}

/// The device list, freed on drop.
struct DeviceList {
    v: &'static Verbs,
    list: *mut *mut sys::ibv_device,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<DeviceList> {
        let v = r::lib()?;
        let (list, len) = r::get_device_list(v)?;
        Ok(DeviceList { v, list, len })
    }
    fn devices(&self) -> impl Iterator<Item = *mut sys::ibv_device> + '_ {
        // SAFETY: list holds len entries while self lives (null list means len 0).
        (0..self.len).map(move |i| unsafe { *self.list.add(i) })
    }
    fn name(&self, d: *mut sys::ibv_device) -> String {
        // SAFETY: d is an entry of this live list.
        unsafe { r::device_name(self.v, d) }
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once.
        unsafe { r::free_device_list(self.v, self.list) }
    }
}

/// Names of the RDMA devices (`mlx5_0`, ...). Empty when the library loads but finds none;
/// `NoDevice` when libibverbs cannot be loaded.
pub fn device_names() -> Result<Vec<String>> {
    let l = DeviceList::get()?;
    Ok(l.devices().map(|d| l.name(d)).collect())
}

/// What `ibv_query_device` reports, in host order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceAttr {
    pub fw_ver: String,
    pub node_guid: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: i32,
    pub max_qp_wr: i32,
    pub max_sge: i32,
    pub max_cqe: i32,
    pub max_mr_size: u64,
    pub max_qp_rd_atom: i32,
    pub phys_port_cnt: u8,
}

/// What `ibv_query_port` reports.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PortAttr {
    /// `IBV_PORT_*` (4 = ACTIVE).
    pub state: u32,
    /// Active MTU in bytes.
    pub active_mtu: u32,
    /// The `ibv_mtu` code of the active MTU (for queue-pair attributes).
    pub active_mtu_code: u32,
    pub lid: u16,
    /// `IBV_LINK_LAYER_*` (1 InfiniBand, 2 Ethernet).
    pub link_layer: u8,
    pub gid_tbl_len: i32,
    /// Data rate from the active width and speed, Gb/s (0 if unknown).
    pub rate_gbps: f64,
}

impl PortAttr {
    pub fn is_active(&self) -> bool {
        self.state == sys::IBV_PORT_ACTIVE
    }
    pub fn state_name(&self) -> &'static str {
        match self.state {
            sys::IBV_PORT_DOWN => "DOWN",
            sys::IBV_PORT_INIT => "INIT",
            sys::IBV_PORT_ARMED => "ARMED",
            sys::IBV_PORT_ACTIVE => "ACTIVE",
            _ => "NOP",
        }
    }
    pub fn link_layer_name(&self) -> &'static str {
        match self.link_layer as u32 {
            sys::IBV_LINK_LAYER_INFINIBAND => "InfiniBand",
            sys::IBV_LINK_LAYER_ETHERNET => "Ethernet",
            _ => "unspecified",
        }
    }
}

/// Bytes of an `ibv_mtu` code (0 for an unknown code).
pub fn mtu_bytes(code: u32) -> u32 {
    match code {
        1..=5 => 128 << code,
        _ => 0,
    }
}

/// Gb/s of `active_width` × `active_speed` codes (IBTA encoding; 0 if unknown).
fn rate_gbps(width: u8, speed: u8) -> f64 {
    let lanes = match width {
        1 => 1.0,
        2 => 4.0,
        4 => 8.0,
        8 => 12.0,
        16 => 2.0,
        _ => 0.0,
    };
    let per_lane = match speed {
        1 => 2.5,
        2 => 5.0,
        4 | 8 => 10.0,
        16 => 14.0,
        32 => 25.0,
        64 => 50.0,
        128 => 100.0,
        _ => 0.0,
    };
    lanes * per_lane
}

/// An open device (`ibv_context`).
pub struct Context {
    raw: *mut sys::ibv_context,
    v: &'static Verbs,
    name: String,
}

// SAFETY: libibverbs contexts may be used from any thread; the pointer is only closed in Drop.
unsafe impl Send for Context {}
// SAFETY: as above; all verbs on a context are thread-safe.
unsafe impl Sync for Context {}

impl Context {
    /// Open the device called `name`.
    pub fn open(name: &str) -> Result<Arc<Context>> {
        const OP: &str = "verbs::Context::open";
        let l = DeviceList::get().map_err(|e| e.with_op(OP))?;
        let Some(dev) = l.devices().find(|&d| l.name(d) == name) else {
            return Err(Error::NoDevice { op: OP, what: format!("no RDMA device named {name}") });
        };
        // SAFETY: dev is an entry of the live list; the opened context stays valid after
        // the list is freed (libibverbs keeps the device referenced).
        let raw = unsafe { r::open_device(l.v, dev) }.map_err(|e| e.with_op(OP))?;
        Ok(Arc::new(Context { raw, v: l.v, name: name.to_string() }))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn query_device(&self) -> Result<DeviceAttr> {
        // SAFETY: raw is live while self lives.
        let a = unsafe { r::query_device(self.v, self.raw) }.map_err(|e| e.with_op("verbs::Context::query_device"))?;
        let fw: Vec<u8> = a.fw_ver.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        Ok(DeviceAttr {
            fw_ver: String::from_utf8_lossy(&fw).into_owned(),
            node_guid: u64::from_be(a.node_guid),
            vendor_id: a.vendor_id,
            vendor_part_id: a.vendor_part_id,
            hw_ver: a.hw_ver,
            max_qp: a.max_qp,
            max_qp_wr: a.max_qp_wr,
            max_sge: a.max_sge,
            max_cqe: a.max_cqe,
            max_mr_size: a.max_mr_size,
            max_qp_rd_atom: a.max_qp_rd_atom,
            phys_port_cnt: a.phys_port_cnt,
        })
    }

    /// Port `port` (1-based).
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        // SAFETY: raw is live while self lives.
        let a = unsafe { r::query_port(self.v, self.raw, port) }.map_err(|e| e.with_op("verbs::Context::query_port"))?;
        Ok(PortAttr {
            state: a.state,
            active_mtu: mtu_bytes(a.active_mtu),
            active_mtu_code: a.active_mtu,
            lid: a.lid,
            link_layer: a.link_layer,
            gid_tbl_len: a.gid_tbl_len,
            rate_gbps: rate_gbps(a.active_width, a.active_speed),
        })
    }

    /// GID `index` of port `port`.
    pub fn query_gid(&self, port: u8, index: i32) -> Result<[u8; 16]> {
        // SAFETY: raw is live while self lives.
        unsafe { r::query_gid(self.v, self.raw, port, index) }.map_err(|e| e.with_op("verbs::Context::query_gid"))
    }

    pub fn alloc_pd(self: &Arc<Self>) -> Result<Arc<ProtectionDomain>> {
        // SAFETY: raw is live; the PD keeps this context alive through its Arc.
        let raw = unsafe { r::alloc_pd(self.v, self.raw) }.map_err(|e| e.with_op("verbs::Context::alloc_pd"))?;
        Ok(Arc::new(ProtectionDomain { raw, ctx: self.clone() }))
    }

    /// A completion queue with room for at least `min_entries` completions.
    pub fn create_cq(self: &Arc<Self>, min_entries: u32) -> Result<Arc<CompletionQueue>> {
        let cqe = i32::try_from(min_entries.max(1)).unwrap_or(i32::MAX);
        // SAFETY: raw is live; the CQ keeps this context alive through its Arc.
        let raw = unsafe { r::create_cq(self.v, self.raw, cqe) }.map_err(|e| e.with_op("verbs::Context::create_cq"))?;
        Ok(Arc::new(CompletionQueue { raw, ctx: self.clone() }))
    }

    fn verbs(&self) -> &'static Verbs {
        self.v
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every child holds an Arc to self, so none is alive; closed once.
        if let Err(e) = unsafe { r::close_device(self.v, self.raw) } {
            log::warn!("hoccl: closing RDMA device {}: {e}", self.name);
        }
    }
}

/// A protection domain.
pub struct ProtectionDomain {
    raw: *mut sys::ibv_pd,
    ctx: Arc<Context>,
}

// SAFETY: as for Context.
unsafe impl Send for ProtectionDomain {}
// SAFETY: as for Context.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Register `[addr, addr + len)` (host memory, or GPU memory where the peer-memory
    /// kernel module is loaded).
    ///
    /// # Safety
    /// The memory must stay allocated and mapped until the returned region is dropped, and
    /// with `LOCAL_WRITE`/`REMOTE_WRITE` the NIC may write it at any time while a receive or
    /// a peer's RDMA write is pending: the caller must not read it as Rust data meanwhile.
    pub unsafe fn reg_mr(self: &Arc<Self>, addr: *mut u8, len: usize, access: Access) -> Result<MemoryRegion> {
        // SAFETY: raw is live; memory contract from the caller.
        let raw = unsafe { r::reg_mr(self.ctx.verbs(), self.raw, addr.cast(), len, access.0) }
            .map_err(|e| e.with_op("verbs::ProtectionDomain::reg_mr"))?;
        Ok(MemoryRegion { raw, pd: self.clone(), _owned: None })
    }

    /// Register a heap buffer that the region then owns (freed after deregistration).
    pub fn reg_owned(self: &Arc<Self>, mut buf: Box<[u8]>, access: Access) -> Result<MemoryRegion> {
        let (addr, len) = (buf.as_mut_ptr(), buf.len());
        // SAFETY: the box is moved into the region (its heap address does not change) and
        // freed only after deregistration (MemoryRegion's Drop runs before its fields drop).
        let mut mr = unsafe { self.reg_mr(addr, len, access) }?;
        mr._owned = Some(buf);
        Ok(mr)
    }

    /// Register `len` bytes at `offset` of dma-buf `fd` (GPU memory exported by the CUDA
    /// driver), seen by the NIC at `iova`.
    ///
    /// # Safety
    /// `fd` must stay a valid dma-buf of at least `offset + len` bytes until the region is
    /// dropped.
    pub unsafe fn reg_dmabuf_mr(self: &Arc<Self>, fd: i32, offset: u64, len: usize, iova: u64, access: Access) -> Result<MemoryRegion> {
        // SAFETY: raw is live; fd contract from the caller.
        let raw = unsafe { r::reg_dmabuf_mr(self.ctx.verbs(), self.raw, offset, len, iova, fd, access.0) }
            .map_err(|e| e.with_op("verbs::ProtectionDomain::reg_dmabuf_mr"))?;
        Ok(MemoryRegion { raw, pd: self.clone(), _owned: None })
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: every child holds an Arc to self, so none is alive; freed once.
        if let Err(e) = unsafe { r::dealloc_pd(self.ctx.verbs(), self.raw) } {
            log::warn!("hoccl: ibv_dealloc_pd on {}: {e}", self.ctx.name);
        }
    }
}

/// A registered memory region. Work requests reference it through [`Sge`]s; keep it alive
/// until their completions are polled (dropping it earlier makes them fail with a
/// protection error instead of touching the memory).
pub struct MemoryRegion {
    raw: *mut sys::ibv_mr,
    pd: Arc<ProtectionDomain>,
    /// A buffer this region owns (`reg_owned`); dropped after deregistration.
    _owned: Option<Box<[u8]>>,
}

// SAFETY: as for Context; the owned buffer is only reachable through raw pointers.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    fn mr(&self) -> &sys::ibv_mr {
        // SAFETY: raw is a live ibv_mr while self lives; its public fields are immutable.
        unsafe { &*self.raw }
    }
    pub fn lkey(&self) -> u32 {
        self.mr().lkey
    }
    pub fn rkey(&self) -> u32 {
        self.mr().rkey
    }
    /// Start address of the region (what a peer uses as `remote_addr` base).
    pub fn addr(&self) -> u64 {
        self.mr().addr as u64
    }
    pub fn len(&self) -> usize {
        self.mr().length
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once; the PD is alive through self.pd.
        if let Err(e) = unsafe { r::dereg_mr(self.pd.ctx.verbs(), self.raw) } {
            log::warn!("hoccl: ibv_dereg_mr: {e}");
        }
    }
}

/// One work completion.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    /// `IBV_WC_*` status; 0 is success.
    pub status: u32,
    /// `IBV_WC_*` opcode (`IBV_WC_RECV_RDMA_WITH_IMM`, ...).
    pub opcode: u32,
    pub byte_len: u32,
    /// Immediate data (host order) when the completion carries it.
    pub imm: Option<u32>,
    pub qp_num: u32,
    pub vendor_err: u32,
    /// `ibv_wc_status_str` for a failed completion.
    pub error: Option<String>,
}

impl Completion {
    pub fn is_success(&self) -> bool {
        self.status == sys::IBV_WC_SUCCESS
    }
}

/// A completion queue (no completion channel: the proxy polls).
pub struct CompletionQueue {
    raw: *mut sys::ibv_cq,
    ctx: Arc<Context>,
}

// SAFETY: as for Context; ibv_poll_cq is thread-safe.
unsafe impl Send for CompletionQueue {}
// SAFETY: as above.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// Append up to `max` completions to `out`; returns how many. Never blocks.
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        let mut wc = [sys::ibv_wc::default(); 16];
        let mut total = 0;
        while total < max {
            let want = (max - total).min(wc.len());
            // SAFETY: raw is live while self lives.
            let n = unsafe { r::poll_cq(self.raw, &mut wc[..want]) }.map_err(|e| e.with_op("verbs::CompletionQueue::poll"))?.min(want);
            out.extend(wc[..n].iter().map(|w| self.completion(w)));
            total += n;
            if n < want {
                break;
            }
        }
        Ok(total)
    }

    fn completion(&self, w: &sys::ibv_wc) -> Completion {
        let ok = w.status == sys::IBV_WC_SUCCESS;
        let imm = (w.wc_flags & sys::IBV_WC_WITH_IMM != 0)
            // SAFETY: with IBV_WC_WITH_IMM the union holds imm_data (network order).
            .then(|| u32::from_be(unsafe { w.__bindgen_anon_1.imm_data }));
        Completion {
            wr_id: w.wr_id,
            status: w.status,
            opcode: w.opcode,
            byte_len: w.byte_len,
            imm,
            qp_num: w.qp_num,
            vendor_err: w.vendor_err,
            error: (!ok).then(|| r::wc_status_str(self.ctx.verbs(), w.status)),
        }
    }

    fn raw(&self) -> *mut sys::ibv_cq {
        self.raw
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds an Arc to it, so none is alive; destroyed once.
        if let Err(e) = unsafe { r::destroy_cq(self.ctx.verbs(), self.raw) } {
            log::warn!("hoccl: ibv_destroy_cq: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_decode() {
        assert_eq!(mtu_bytes(sys::IBV_MTU_4096), 4096);
        assert_eq!(mtu_bytes(sys::IBV_MTU_256), 256);
        assert_eq!(mtu_bytes(0), 0);
        assert_eq!(rate_gbps(2, 64), 200.0); // 4x HDR
        assert_eq!(rate_gbps(2, 128), 400.0); // 4x NDR
        assert_eq!((Access::LOCAL_WRITE | Access::REMOTE_WRITE).0, 3);
    }

    #[test]
    fn opening_an_absent_device_is_an_error() {
        match Context::open("hoccl-no-such-device") {
            Err(Error::NoDevice { .. }) => {}
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("opened a device that does not exist"),
        }
    }
}
