//! What the verbs transport needs from an RDMA NIC, as one small trait ([`Nic`]), with two
//! implementations: [`VerbsNic`] over the libibverbs bindings ([`super::safe`]) and
//! [`fake::FakeNic`], an in-memory reliable-connected fabric.
//!
//! The fake is a test double: it lets the transport's logic (slots, immediates, credits,
//! error completions) be tested by thread ranks of one process without an RDMA device. It
//! is not evidence that the libibverbs path works on hardware.
//!
//! The trait speaks of NIC-owned registered buffers ([`BufId`]) filled and read by copies,
//! never of raw pointers into them, so no caller needs `unsafe`: the protocol above (a
//! credit per slot) guarantees that a range is not copied while the NIC writes it.
use super::safe::{Access, CompletionQueue, Context, Endpoint, MemoryRegion, PathConfig, ProtectionDomain, QpCaps, QueuePair, Sge};
use super::sys;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::Arc;

/// A queue pair of one [`Nic`], by creation order.
pub type QpId = usize;
/// A registered buffer of one [`Nic`], by creation order.
pub type BufId = usize;

/// What a peer needs to RDMA-write into a registered buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteKey {
    pub addr: u64,
    pub rkey: u32,
    pub len: u64,
}

/// A queue pair's state as the transport cares about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// Created, not connected yet.
    Reset,
    /// Connected (RTS): posts may go.
    Ready,
    /// An error completion moved it to the error state: every later post fails.
    Error,
}

/// A completion, as the proxy's poll reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A signalled send or RDMA write of this side completed (its bytes reached the peer).
    Sent { qp: QpId, wr_id: u64 },
    /// A peer's RDMA write with immediate `imm` landed in this side's memory; it consumed
    /// receive `wr_id`.
    WriteLanded { qp: QpId, wr_id: u64, imm: u32 },
    /// A peer's send of `len` bytes landed in the buffer of receive `wr_id`.
    Received { qp: QpId, wr_id: u64, len: u32 },
    /// Work request `wr_id` failed (`why`); the queue pair is in the error state.
    Failed { qp: QpId, wr_id: u64, why: String },
}

/// The RDMA operations the verbs transport uses. Every call returns at once; completions
/// arrive through [`poll`](Nic::poll), in posting order per queue pair and direction.
pub trait Nic: Send {
    /// A new reliable-connected queue pair (not connected).
    fn create_qp(&mut self) -> Result<QpId>;
    /// What the peer needs to connect to `qp` (exchanged out of band).
    fn endpoint(&self, qp: QpId) -> Result<Endpoint>;
    /// Connect `qp` to the peer's `remote` (RESET → INIT → RTR → RTS).
    fn connect(&mut self, qp: QpId, remote: &Endpoint) -> Result<()>;
    fn qp_state(&self, qp: QpId) -> QpState;
    /// A registered buffer of `len` bytes that peers may write (zeroed).
    fn alloc(&mut self, len: usize) -> Result<BufId>;
    fn key(&self, buf: BufId) -> RemoteKey;
    /// Copy `data` into `buf` at `offset` (no work request may target that range).
    fn fill(&mut self, buf: BufId, offset: usize, data: &[u8]) -> Result<()>;
    /// Copy `out.len()` bytes of `buf` at `offset` out (no work request may target that range).
    fn read(&self, buf: BufId, offset: usize, out: &mut [u8]) -> Result<()>;
    /// RDMA-write `len` bytes of `buf` at `offset` to `remote` at `remote_offset`, with
    /// immediate `imm` (consumes a receive on the peer). Always signalled.
    #[allow(clippy::too_many_arguments)]
    fn post_write_imm(&mut self, qp: QpId, wr_id: u64, buf: BufId, offset: usize, len: usize, remote: RemoteKey, remote_offset: u64, imm: u32) -> Result<()>;
    /// Send `len` bytes of `buf` at `offset` (a small control message). Always signalled.
    fn post_send(&mut self, qp: QpId, wr_id: u64, buf: BufId, offset: usize, len: usize) -> Result<()>;
    /// A receive into `len` bytes of `buf` at `offset` (sends land there; a write with
    /// immediate consumes it without touching the buffer).
    fn post_recv(&mut self, qp: QpId, wr_id: u64, buf: BufId, offset: usize, len: usize) -> Result<()>;
    /// Append the completions that arrived to `out`.
    fn poll(&mut self, out: &mut Vec<Event>) -> Result<()>;
}

fn range_check(op: &'static str, have: usize, offset: usize, len: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= have => Ok(()),
        _ => Err(Error::invalid_arg(op, format!("[{offset}, +{len}) outside a {have}-byte buffer"))),
    }
}

/// Send-queue and receive-queue depth of every queue pair [`VerbsNic`] creates.
pub const QP_DEPTH: u32 = 256;

/// [`Nic`] over one port of a libibverbs device.
///
/// One completion queue serves every queue pair's sends and receives, sized for all of
/// them (`max_qps` × 2 × [`QP_DEPTH`]) so it cannot overrun while the transport keeps each
/// queue within its depth. Every work request is signalled: the transport accounts slots
/// and credits per completion. Nothing is posted inline (`max_inline_data` 0): control
/// messages come from a registered buffer, which every provider takes.
pub struct VerbsNic {
    ctx: Arc<Context>,
    pd: Arc<ProtectionDomain>,
    cq: Arc<CompletionQueue>,
    path: PathConfig,
    max_qps: usize,
    qps: Vec<(QueuePair, u32, QpState)>,
    by_qpn: HashMap<u32, QpId>,
    bufs: Vec<MemoryRegion>,
    scratch: Vec<super::safe::Completion>,
}

impl VerbsNic {
    /// Open device `name`'s `port`, addressing peers by GID index `gid_index` on Ethernet
    /// (RoCE) ports and by LID on InfiniBand ports; room for `max_qps` queue pairs.
    pub fn open(name: &str, port: u8, gid_index: u8, max_qps: usize) -> Result<VerbsNic> {
        const OP: &str = "verbs::VerbsNic::open";
        let ctx = Context::open(name)?;
        let p = ctx.query_port(port)?;
        if !p.is_active() {
            return Err(Error::invalid_usage(OP, format!("{name} port {port} is {}", p.state_name())));
        }
        let roce = p.link_layer_name() == "Ethernet";
        if roce {
            // A RoCE path needs the GID; an all-zero one means the index is unpopulated.
            let gid = ctx.query_gid(port, gid_index as i32)?;
            if gid == [0; 16] {
                return Err(Error::invalid_usage(OP, format!("{name} port {port}: GID index {gid_index} is empty (HOCCL_IB_GID_INDEX)")));
            }
        }
        let path = PathConfig { port, gid_index: roce.then_some(gid_index), ..PathConfig::default() };
        let pd = ctx.alloc_pd()?;
        let entries = u32::try_from(max_qps.max(1)).unwrap_or(u32::MAX).saturating_mul(2 * QP_DEPTH);
        let cq = ctx.create_cq(entries)?;
        Ok(VerbsNic { ctx, pd, cq, path, max_qps: max_qps.max(1), qps: Vec::new(), by_qpn: HashMap::new(), bufs: Vec::new(), scratch: Vec::new() })
    }

    pub fn device_name(&self) -> &str {
        self.ctx.name()
    }

    fn qp(&self, op: &'static str, qp: QpId) -> Result<&QueuePair> {
        match self.qps.get(qp) {
            Some((q, _, QpState::Ready)) => Ok(q),
            Some((_, _, s)) => Err(Error::invalid_usage(op, format!("queue pair {qp} is {s:?}"))),
            None => Err(Error::invalid_arg(op, format!("no queue pair {qp}"))),
        }
    }

    fn buf(&self, op: &'static str, buf: BufId) -> Result<&MemoryRegion> {
        self.bufs.get(buf).ok_or_else(|| Error::invalid_arg(op, format!("no buffer {buf}")))
    }
}

impl Nic for VerbsNic {
    fn create_qp(&mut self) -> Result<QpId> {
        if self.qps.len() >= self.max_qps {
            return Err(Error::invalid_usage("verbs::VerbsNic::create_qp", format!("the completion queue is sized for {} queue pairs", self.max_qps)));
        }
        let caps = QpCaps { max_send_wr: QP_DEPTH, max_recv_wr: QP_DEPTH, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let q = self.pd.create_rc_qp(&self.cq, &self.cq, caps)?;
        // A random-enough start PSN per QP (24 bits), as perftest does.
        let psn = (q.qp_num().wrapping_mul(2_654_435_761) ^ std::process::id()) & 0x00ff_ffff;
        self.by_qpn.insert(q.qp_num(), self.qps.len());
        self.qps.push((q, psn, QpState::Reset));
        Ok(self.qps.len() - 1)
    }

    fn endpoint(&self, qp: QpId) -> Result<Endpoint> {
        let (q, psn, _) = self.qps.get(qp).ok_or_else(|| Error::invalid_arg("verbs::VerbsNic::endpoint", format!("no queue pair {qp}")))?;
        q.local_endpoint(&self.path, *psn)
    }

    fn connect(&mut self, qp: QpId, remote: &Endpoint) -> Result<()> {
        let path = self.path;
        let (q, psn, state) = self.qps.get_mut(qp).ok_or_else(|| Error::invalid_arg("verbs::VerbsNic::connect", format!("no queue pair {qp}")))?;
        // Remote writes only: the transport never reads from or does atomics on a peer.
        q.to_init(&path, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
        q.to_rtr(&path, remote)?;
        q.to_rts(&path, *psn)?;
        *state = QpState::Ready;
        Ok(())
    }

    fn qp_state(&self, qp: QpId) -> QpState {
        self.qps.get(qp).map_or(QpState::Error, |(_, _, s)| *s)
    }

    fn alloc(&mut self, len: usize) -> Result<BufId> {
        let mr = self.pd.reg_owned(vec![0u8; len].into_boxed_slice(), Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
        self.bufs.push(mr);
        Ok(self.bufs.len() - 1)
    }

    fn key(&self, buf: BufId) -> RemoteKey {
        self.bufs.get(buf).map_or(RemoteKey { addr: 0, rkey: 0, len: 0 }, |m| RemoteKey { addr: m.addr(), rkey: m.rkey(), len: m.len() as u64 })
    }

    fn fill(&mut self, buf: BufId, offset: usize, data: &[u8]) -> Result<()> {
        const OP: &str = "verbs::VerbsNic::fill";
        let mr = self.buf(OP, buf)?;
        range_check(OP, mr.len(), offset, data.len())?;
        // SAFETY: in bounds (checked); the Nic contract says no work request targets the range.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), (mr.addr() as usize + offset) as *mut u8, data.len()) };
        Ok(())
    }

    fn read(&self, buf: BufId, offset: usize, out: &mut [u8]) -> Result<()> {
        const OP: &str = "verbs::VerbsNic::read";
        let mr = self.buf(OP, buf)?;
        range_check(OP, mr.len(), offset, out.len())?;
        // SAFETY: in bounds (checked); no work request targets the range (Nic contract).
        unsafe { std::ptr::copy_nonoverlapping((mr.addr() as usize + offset) as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn post_write_imm(&mut self, qp: QpId, wr_id: u64, buf: BufId, offset: usize, len: usize, remote: RemoteKey, remote_offset: u64, imm: u32) -> Result<()> {
        const OP: &str = "verbs::VerbsNic::post_write_imm";
        if remote_offset.checked_add(len as u64).is_none_or(|end| end > remote.len) {
            return Err(Error::invalid_arg(OP, format!("[{remote_offset}, +{len}) outside the peer's {}-byte buffer", remote.len)));
        }
        let sge = Sge::new(self.buf(OP, buf)?, offset, len)?;
        self.qp(OP, qp)?.post_write(wr_id, sge, remote.addr + remote_offset, remote.rkey, Some(imm), true)
    }

    fn post_send(&mut self, qp: QpId, wr_id: u64, buf: BufId, offset: usize, len: usize) -> Result<()> {
        const OP: &str = "verbs::VerbsNic::post_send";
        let sge = Sge::new(self.buf(OP, buf)?, offset, len)?;
        self.qp(OP, qp)?.post_send(wr_id, Some(sge), None, true)
    }

    fn post_recv(&mut self, qp: QpId, wr_id: u64, buf: BufId, offset: usize, len: usize) -> Result<()> {
        const OP: &str = "verbs::VerbsNic::post_recv";
        let sge = Sge::new(self.buf(OP, buf)?, offset, len)?;
        self.qp(OP, qp)?.post_recv(wr_id, Some(sge))
    }

    fn poll(&mut self, out: &mut Vec<Event>) -> Result<()> {
        self.scratch.clear();
        self.cq.poll(&mut self.scratch, 64)?;
        for c in self.scratch.drain(..) {
            let Some(&qp) = self.by_qpn.get(&c.qp_num) else {
                log::warn!("hoccl: verbs completion for unknown QP {}", c.qp_num);
                continue;
            };
            if !c.is_success() {
                // The opcode of a failed completion is undefined: report by wr_id only.
                self.qps[qp].2 = QpState::Error;
                let why = format!("{} (status {}, vendor error {:#x})", c.error.as_deref().unwrap_or("error"), c.status, c.vendor_err);
                out.push(Event::Failed { qp, wr_id: c.wr_id, why });
                continue;
            }
            out.push(match c.opcode {
                sys::IBV_WC_RECV_RDMA_WITH_IMM => Event::WriteLanded { qp, wr_id: c.wr_id, imm: c.imm.unwrap_or(0) },
                sys::IBV_WC_RECV => Event::Received { qp, wr_id: c.wr_id, len: c.byte_len },
                _ => Event::Sent { qp, wr_id: c.wr_id },
            });
        }
        Ok(())
    }
}

pub mod fake;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Two queue pairs of one device connected to each other: a write with immediate and a
    /// send cross the real NIC. Needs an RDMA device with an active port (soft-RoCE will
    /// do: `rdma link add rxe0 type rxe netdev eth0`); prints that it skipped otherwise.
    #[test]
    fn real_device_loopback() {
        let (dev, port) = match super::super::pick(None) {
            Ok(x) => x,
            Err(why) => {
                println!("skipped: no RDMA device usable here: {why}");
                return;
            }
        };
        // GID index: HOCCL_IB_GID_INDEX as the product reads it (default 3).
        let gid_index = crate::config::Config::from_env().map(|c| c.ib_gid_index).unwrap_or(3);
        let mut nic = VerbsNic::open(&dev.name, port.port, gid_index, 2).expect("open the device");
        let (a, b) = (nic.create_qp().unwrap(), nic.create_qp().unwrap());
        let (ea, eb) = (nic.endpoint(a).unwrap(), nic.endpoint(b).unwrap());
        nic.connect(a, &eb).unwrap();
        nic.connect(b, &ea).unwrap();
        let (src, dst, ctl) = (nic.alloc(1 << 20).unwrap(), nic.alloc(1 << 20).unwrap(), nic.alloc(64).unwrap());
        let pattern: Vec<u8> = (0..1 << 20).map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        nic.fill(src, 0, &pattern).unwrap();
        nic.post_recv(b, 100, ctl, 0, 64).unwrap();
        nic.post_recv(b, 101, ctl, 0, 64).unwrap();
        nic.post_write_imm(a, 1, src, 0, 1 << 20, nic.key(dst), 0, 0xdead_beef).unwrap();
        let mut events = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while events.len() < 2 && Instant::now() < deadline {
            nic.poll(&mut events).unwrap();
        }
        assert!(events.contains(&Event::WriteLanded { qp: b, wr_id: 100, imm: 0xdead_beef }), "{events:?}");
        assert!(events.contains(&Event::Sent { qp: a, wr_id: 1 }), "{events:?}");
        let mut got = vec![0u8; 1 << 20];
        nic.read(dst, 0, &mut got).unwrap();
        assert!(got == pattern, "the written bytes differ");
        nic.post_send(a, 2, ctl, 0, 8).unwrap();
        events.clear();
        while events.len() < 2 && Instant::now() < deadline + Duration::from_secs(10) {
            nic.poll(&mut events).unwrap();
        }
        assert!(events.contains(&Event::Received { qp: b, wr_id: 101, len: 8 }), "{events:?}");
    }
}
