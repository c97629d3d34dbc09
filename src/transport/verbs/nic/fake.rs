//! An in-memory reliable-connected fabric implementing [`Nic`]: a test double for the verbs
//! transport (`HOCCL_VERBS_FAKE=1`), not a model of any NIC's timing.
//!
//! One process-global fabric holds every fake queue pair (by QP number) and registered
//! buffer (by rkey), so thread ranks of one process reach each other through it. It keeps
//! the RC semantics the transport relies on:
//! - an RDMA write's bytes land in the peer's buffer before the peer sees its immediate;
//! - every write with immediate and every send consumes one posted receive of the peer
//!   queue pair, in posting order; one that finds no receive waits for it (as a receiver-
//!   not-ready retry that never gives up), and so does its sender's completion;
//! - a write outside the peer's registered buffer, a send longer than the receive, a post
//!   on a queue pair in error, or an injected fault ([`FakeNic::inject_error`]) completes
//!   with an error and moves both ends of the connection to the error state, flushing their
//!   posted receives with errors, as a real RC connection does.
use super::{BufId, Event, Nic, QpId, QpState, RemoteKey};
use crate::error::{Error, Result};
use crate::transport::verbs::safe::Endpoint;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

type Mem = Arc<Mutex<Vec<u8>>>;

fn lock(m: &Mem) -> MutexGuard<'_, Vec<u8>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct Recv {
    wr_id: u64,
    mem: Mem,
    offset: usize,
    len: usize,
}

enum Arrival {
    Write { imm: u32, from: u32, wr_id: u64 },
    Send { data: Vec<u8>, from: u32, wr_id: u64 },
}

struct FakeQp {
    nic: u64,
    local: QpId,
    state: QpState,
    peer: Option<u32>,
    recvs: VecDeque<Recv>,
    arrivals: VecDeque<Arrival>,
    /// The next work request posted here fails with this.
    fail_next: Option<String>,
}

#[derive(Default)]
struct Fabric {
    next_qpn: u32,
    next_rkey: u32,
    next_nic: u64,
    qps: HashMap<u32, FakeQp>,
    mems: HashMap<u32, Mem>,
    events: HashMap<u64, Vec<Event>>,
}

fn fabric() -> MutexGuard<'static, Fabric> {
    static F: OnceLock<Mutex<Fabric>> = OnceLock::new();
    F.get_or_init(|| Mutex::new(Fabric { next_qpn: 1, next_rkey: 1, next_nic: 1, ..Fabric::default() }))
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// A fake buffer's address as peers see it: its rkey in the high half.
fn base(rkey: u32) -> u64 {
    u64::from(rkey) << 32
}

const FLUSHED: &str = "work request flushed: queue pair in error";

impl Fabric {
    fn event(&mut self, qpn: u32, ev: impl FnOnce(QpId) -> Event) {
        if let Some(q) = self.qps.get(&qpn) {
            let e = ev(q.local);
            self.events.entry(q.nic).or_default().push(e);
        }
    }

    /// Move `qpn` and its peer to the error state; work request `wr_id` of `qpn` (if any)
    /// completes with `why`; posted receives of both ends are flushed, and so are the
    /// requests still waiting for one.
    fn fail(&mut self, qpn: u32, wr_id: Option<u64>, why: &str) {
        if let Some(w) = wr_id {
            self.event(qpn, |qp| Event::Failed { qp, wr_id: w, why: why.to_string() });
        }
        let peer = self.qps.get(&qpn).and_then(|q| q.peer);
        for n in [Some(qpn), peer].into_iter().flatten() {
            let Some(q) = self.qps.get_mut(&n) else { continue };
            if q.state == QpState::Error {
                continue;
            }
            q.state = QpState::Error;
            let flushed: Vec<u64> = q.recvs.drain(..).map(|r| r.wr_id).collect();
            let waiting: Vec<(u32, u64)> = q
                .arrivals
                .drain(..)
                .map(|a| match a {
                    Arrival::Write { from, wr_id, .. } | Arrival::Send { from, wr_id, .. } => (from, wr_id),
                })
                .collect();
            for w in flushed {
                self.event(n, |qp| Event::Failed { qp, wr_id: w, why: FLUSHED.into() });
            }
            for (from, w) in waiting {
                self.event(from, |qp| Event::Failed { qp, wr_id: w, why: "transport retry counter exceeded: the peer's queue pair is in error".into() });
            }
        }
    }

    /// The queue pair that work requests from `qpn` go to, if one may be posted now;
    /// otherwise completes `wr_id` with an error and returns None.
    fn sendable(&mut self, qpn: u32, wr_id: u64) -> Option<u32> {
        let q = self.qps.get_mut(&qpn)?;
        if let Some(why) = q.fail_next.take() {
            self.fail(qpn, Some(wr_id), &why);
            return None;
        }
        match (q.state, q.peer) {
            (QpState::Ready, Some(p)) if self.qps.get(&p).is_some_and(|pq| pq.state == QpState::Ready) => Some(p),
            (QpState::Ready, _) => {
                self.fail(qpn, Some(wr_id), "transport retry counter exceeded: the peer's queue pair is gone");
                None
            }
            _ => {
                self.event(qpn, |qp| Event::Failed { qp, wr_id, why: FLUSHED.into() });
                None
            }
        }
    }

    /// Pair `qpn`'s arrivals with its posted receives, in order.
    fn deliver(&mut self, qpn: u32) {
        loop {
            let Some(q) = self.qps.get_mut(&qpn) else { return };
            if q.state != QpState::Ready {
                return;
            }
            let (Some(r), Some(a)) = (q.recvs.front(), q.arrivals.front()) else { return };
            if let Arrival::Send { data, from, wr_id } = a {
                if data.len() > r.len {
                    let (rw, n, rlen, from, wr_id) = (r.wr_id, data.len(), r.len, *from, *wr_id);
                    q.recvs.pop_front();
                    q.arrivals.pop_front();
                    self.event(qpn, |qp| Event::Failed { qp, wr_id: rw, why: format!("local length error: {n}-byte send into a {rlen}-byte receive") });
                    self.fail(from, Some(wr_id), "remote invalid request error");
                    return;
                }
            }
            let (Some(r), Some(a)) = (q.recvs.pop_front(), q.arrivals.pop_front()) else { return };
            match a {
                Arrival::Write { imm, from, wr_id } => {
                    self.event(qpn, |qp| Event::WriteLanded { qp, wr_id: r.wr_id, imm });
                    self.event(from, |qp| Event::Sent { qp, wr_id });
                }
                Arrival::Send { data, from, wr_id } => {
                    lock(&r.mem)[r.offset..r.offset + data.len()].copy_from_slice(&data);
                    self.event(qpn, |qp| Event::Received { qp, wr_id: r.wr_id, len: data.len() as u32 });
                    self.event(from, |qp| Event::Sent { qp, wr_id });
                }
            }
        }
    }
}

/// One rank's NIC on the fake fabric.
pub struct FakeNic {
    id: u64,
    qpns: Vec<u32>,
    bufs: Vec<(u32, Mem)>,
    /// Sends and writes to post before one fails ([`FakeNic::fail_at`]), and with what.
    fail_at: Option<(u64, String)>,
}

impl FakeNic {
    pub fn new() -> FakeNic {
        let mut f = fabric();
        let id = f.next_nic;
        f.next_nic += 1;
        FakeNic { id, qpns: Vec::new(), bufs: Vec::new(), fail_at: None }
    }

    /// The `n`th send or write posted from now on (counted from 1) completes with the error
    /// `why`, as [`inject_error`](Self::inject_error) on its queue pair would make it.
    pub fn fail_at(&mut self, n: u64, why: &str) {
        self.fail_at = (n > 0).then(|| (n, why.to_string()));
    }

    /// Count a send or write about to be posted on `qp`: the one [`fail_at`](Self::fail_at)
    /// names gets the injected error.
    fn count_post(&mut self, qp: QpId) {
        if let Some((n, why)) = self.fail_at.as_mut() {
            *n -= 1;
            if *n == 0 {
                let why = std::mem::take(why);
                self.fail_at = None;
                self.inject_error(qp, &why);
            }
        }
    }

    /// The next work request posted on `qp` completes with the error `why`, and the
    /// connection goes to the error state (as after a pulled cable or a peer's QP error).
    pub fn inject_error(&self, qp: QpId, why: &str) {
        if let Some(n) = self.qpns.get(qp) {
            if let Some(q) = fabric().qps.get_mut(n) {
                q.fail_next = Some(why.to_string());
            }
        }
    }

    fn qpn(&self, op: &'static str, qp: QpId) -> Result<u32> {
        self.qpns.get(qp).copied().ok_or_else(|| Error::invalid_arg(op, format!("no queue pair {qp}")))
    }

    fn mem(&self, op: &'static str, buf: BufId, offset: usize, len: usize) -> Result<&Mem> {
        let (_, m) = self.bufs.get(buf).ok_or_else(|| Error::invalid_arg(op, format!("no buffer {buf}")))?;
        super::range_check(op, lock(m).len(), offset, len)?;
        Ok(m)
    }

    /// The bytes of `len` at `offset` of `buf`, for a post (a local range error is a call
    /// error, as a bad SGE is for `ibv_post_send`).
    fn gather(&self, op: &'static str, buf: BufId, offset: usize, len: usize) -> Result<Vec<u8>> {
        Ok(lock(self.mem(op, buf, offset, len)?)[offset..offset + len].to_vec())
    }
}

impl Default for FakeNic {
    fn default() -> Self {
        FakeNic::new()
    }
}

impl Drop for FakeNic {
    fn drop(&mut self) {
        let mut f = fabric();
        for &n in &self.qpns {
            f.fail(n, None, "queue pair destroyed");
            f.qps.remove(&n);
        }
        for (k, _) in &self.bufs {
            f.mems.remove(k);
        }
        f.events.remove(&self.id);
    }
}

impl Nic for FakeNic {
    fn create_qp(&mut self) -> Result<QpId> {
        let mut f = fabric();
        let qpn = f.next_qpn;
        f.next_qpn += 1;
        let local = self.qpns.len();
        let q = FakeQp { nic: self.id, local, state: QpState::Reset, peer: None, recvs: VecDeque::new(), arrivals: VecDeque::new(), fail_next: None };
        f.qps.insert(qpn, q);
        self.qpns.push(qpn);
        Ok(local)
    }

    fn endpoint(&self, qp: QpId) -> Result<Endpoint> {
        let qpn = self.qpn("verbs::FakeNic::endpoint", qp)?;
        let mut gid = [0u8; 16];
        gid[..4].copy_from_slice(b"FAKE");
        gid[8..].copy_from_slice(&self.id.to_le_bytes());
        Ok(Endpoint { qpn, psn: qpn & 0x00ff_ffff, lid: (self.id & 0xffff) as u16, gid })
    }

    fn connect(&mut self, qp: QpId, remote: &Endpoint) -> Result<()> {
        const OP: &str = "verbs::FakeNic::connect";
        let qpn = self.qpn(OP, qp)?;
        let mut f = fabric();
        if &remote.gid[..4] != b"FAKE" || !f.qps.contains_key(&remote.qpn) {
            return Err(Error::invalid_usage(OP, format!("no fake queue pair {} (endpoint {remote:?})", remote.qpn)));
        }
        let q = f.qps.get_mut(&qpn).ok_or_else(|| Error::internal(OP, "queue pair left the fabric"))?;
        if q.state != QpState::Reset {
            return Err(Error::invalid_usage(OP, format!("queue pair {qp} is {:?}, not RESET", q.state)));
        }
        q.peer = Some(remote.qpn);
        q.state = QpState::Ready;
        Ok(())
    }

    fn qp_state(&self, qp: QpId) -> QpState {
        self.qpns.get(qp).and_then(|n| fabric().qps.get(n).map(|q| q.state)).unwrap_or(QpState::Error)
    }

    fn alloc(&mut self, len: usize) -> Result<BufId> {
        let mut f = fabric();
        let rkey = f.next_rkey;
        f.next_rkey += 1;
        let m: Mem = Arc::new(Mutex::new(vec![0; len]));
        f.mems.insert(rkey, m.clone());
        self.bufs.push((rkey, m));
        Ok(self.bufs.len() - 1)
    }

    fn key(&self, buf: BufId) -> RemoteKey {
        self.bufs.get(buf).map_or(RemoteKey { addr: 0, rkey: 0, len: 0 }, |(k, m)| RemoteKey { addr: base(*k), rkey: *k, len: lock(m).len() as u64 })
    }

    fn fill(&mut self, buf: BufId, offset: usize, data: &[u8]) -> Result<()> {
        let m = self.mem("verbs::FakeNic::fill", buf, offset, data.len())?;
        lock(m)[offset..offset + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn read(&self, buf: BufId, offset: usize, out: &mut [u8]) -> Result<()> {
        let m = self.mem("verbs::FakeNic::read", buf, offset, out.len())?;
        out.copy_from_slice(&lock(m)[offset..offset + out.len()]);
        Ok(())
    }

    fn post_write_imm(&mut self, qp: QpId, wr_id: u64, buf: BufId, offset: usize, len: usize, remote: RemoteKey, remote_offset: u64, imm: u32) -> Result<()> {
        const OP: &str = "verbs::FakeNic::post_write_imm";
        let qpn = self.qpn(OP, qp)?;
        self.count_post(qp);
        let data = self.gather(OP, buf, offset, len)?;
        let mut f = fabric();
        let Some(peer) = f.sendable(qpn, wr_id) else { return Ok(()) };
        // The responder checks the rkey and the range against its registration.
        let target = f.mems.get(&remote.rkey).cloned();
        let at = remote.addr.checked_add(remote_offset).and_then(|a| a.checked_sub(base(remote.rkey)));
        let landed = match (target, at) {
            (Some(m), Some(at)) => {
                let mut m = lock(&m);
                let at = at as usize;
                let ok = at.checked_add(len).is_some_and(|end| end <= m.len());
                if ok {
                    m[at..at + len].copy_from_slice(&data);
                }
                ok
            }
            _ => false,
        };
        if !landed {
            f.fail(qpn, Some(wr_id), "remote access error");
            return Ok(());
        }
        if let Some(q) = f.qps.get_mut(&peer) {
            q.arrivals.push_back(Arrival::Write { imm, from: qpn, wr_id });
        }
        f.deliver(peer);
        Ok(())
    }

    fn post_send(&mut self, qp: QpId, wr_id: u64, buf: BufId, offset: usize, len: usize) -> Result<()> {
        const OP: &str = "verbs::FakeNic::post_send";
        let qpn = self.qpn(OP, qp)?;
        self.count_post(qp);
        let data = self.gather(OP, buf, offset, len)?;
        let mut f = fabric();
        let Some(peer) = f.sendable(qpn, wr_id) else { return Ok(()) };
        if let Some(q) = f.qps.get_mut(&peer) {
            q.arrivals.push_back(Arrival::Send { data, from: qpn, wr_id });
        }
        f.deliver(peer);
        Ok(())
    }

    fn post_recv(&mut self, qp: QpId, wr_id: u64, buf: BufId, offset: usize, len: usize) -> Result<()> {
        const OP: &str = "verbs::FakeNic::post_recv";
        let qpn = self.qpn(OP, qp)?;
        let mem = self.mem(OP, buf, offset, len)?.clone();
        let mut f = fabric();
        let Some(q) = f.qps.get_mut(&qpn) else { return Err(Error::internal(OP, "queue pair left the fabric")) };
        if q.state == QpState::Error {
            f.event(qpn, |qp| Event::Failed { qp, wr_id, why: FLUSHED.into() });
        } else {
            q.recvs.push_back(Recv { wr_id, mem, offset, len });
            f.deliver(qpn);
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Event>) -> Result<()> {
        if let Some(evs) = fabric().events.get_mut(&self.id) {
            out.append(evs);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (FakeNic, FakeNic, QpId, QpId) {
        let (mut a, mut b) = (FakeNic::new(), FakeNic::new());
        let (qa, qb) = (a.create_qp().unwrap(), b.create_qp().unwrap());
        let (ea, eb) = (a.endpoint(qa).unwrap(), b.endpoint(qb).unwrap());
        // Endpoints travel as bytes through the bootstrap.
        a.connect(qa, &Endpoint::from_bytes(&eb.to_bytes()).unwrap()).unwrap();
        b.connect(qb, &Endpoint::from_bytes(&ea.to_bytes()).unwrap()).unwrap();
        (a, b, qa, qb)
    }

    fn poll(n: &mut FakeNic) -> Vec<Event> {
        let mut v = Vec::new();
        n.poll(&mut v).unwrap();
        v
    }

    #[test]
    fn write_with_immediate_lands_before_its_completion_and_in_order() {
        let (mut a, mut b, qa, qb) = pair();
        let (src, dst, ctl) = (a.alloc(64).unwrap(), b.alloc(64).unwrap(), b.alloc(8).unwrap());
        a.fill(src, 0, &(0..64).collect::<Vec<u8>>()).unwrap();
        let key = b.key(dst);
        a.post_write_imm(qa, 1, src, 0, 16, key, 0, 0xa).unwrap();
        a.post_write_imm(qa, 2, src, 16, 16, key, 48, 0xb).unwrap();
        // No receive posted: nothing completes on either side, but the bytes have landed.
        assert!(poll(&mut a).is_empty() && poll(&mut b).is_empty());
        b.post_recv(qb, 10, ctl, 0, 0).unwrap();
        b.post_recv(qb, 11, ctl, 0, 0).unwrap();
        assert_eq!(poll(&mut b), vec![Event::WriteLanded { qp: qb, wr_id: 10, imm: 0xa }, Event::WriteLanded { qp: qb, wr_id: 11, imm: 0xb }]);
        assert_eq!(poll(&mut a), vec![Event::Sent { qp: qa, wr_id: 1 }, Event::Sent { qp: qa, wr_id: 2 }]);
        let mut got = [0u8; 64];
        b.read(dst, 0, &mut got).unwrap();
        assert_eq!(&got[..16], &(0..16).collect::<Vec<u8>>()[..]);
        assert_eq!(&got[48..], &(16..32).collect::<Vec<u8>>()[..]);
        assert!(got[16..48].iter().all(|&x| x == 0));
    }

    #[test]
    fn send_lands_in_the_posted_receive() {
        let (mut a, mut b, qa, qb) = pair();
        let (src, dst) = (a.alloc(32).unwrap(), b.alloc(32).unwrap());
        a.fill(src, 0, b"credit:7").unwrap();
        b.post_recv(qb, 5, dst, 8, 16).unwrap();
        a.post_send(qa, 9, src, 0, 8).unwrap();
        assert_eq!(poll(&mut b), vec![Event::Received { qp: qb, wr_id: 5, len: 8 }]);
        let mut got = [0u8; 8];
        b.read(dst, 8, &mut got).unwrap();
        assert_eq!(&got, b"credit:7");
        assert_eq!(poll(&mut a), vec![Event::Sent { qp: qa, wr_id: 9 }]);
    }

    #[test]
    fn a_send_longer_than_the_receive_fails_both_ends() {
        let (mut a, mut b, qa, qb) = pair();
        let (src, dst) = (a.alloc(32).unwrap(), b.alloc(32).unwrap());
        b.post_recv(qb, 5, dst, 0, 4).unwrap();
        a.post_send(qa, 9, src, 0, 8).unwrap();
        assert!(matches!(&poll(&mut b)[..], [Event::Failed { wr_id: 5, why, .. }] if why.contains("length")));
        assert!(matches!(&poll(&mut a)[..], [Event::Failed { wr_id: 9, .. }]));
        assert_eq!((a.qp_state(qa), b.qp_state(qb)), (QpState::Error, QpState::Error));
    }

    #[test]
    fn a_write_outside_the_peer_buffer_fails_the_connection() {
        let (mut a, mut b, qa, qb) = pair();
        let (src, dst, ctl) = (a.alloc(64).unwrap(), b.alloc(32).unwrap(), b.alloc(8).unwrap());
        b.post_recv(qb, 3, ctl, 0, 0).unwrap();
        a.post_write_imm(qa, 1, src, 0, 64, b.key(dst), 0, 0).unwrap();
        assert!(matches!(&poll(&mut a)[..], [Event::Failed { wr_id: 1, why, .. }] if why.contains("remote access")));
        assert!(matches!(&poll(&mut b)[..], [Event::Failed { wr_id: 3, .. }]));
        assert_eq!((a.qp_state(qa), b.qp_state(qb)), (QpState::Error, QpState::Error));
        // Later posts are flushed.
        a.post_send(qa, 2, src, 0, 4).unwrap();
        assert!(matches!(&poll(&mut a)[..], [Event::Failed { wr_id: 2, why, .. }] if why.contains("flushed")));
        // A local range error is a call error, not a completion.
        assert!(a.post_send(qa, 2, src, 60, 8).is_err());
    }

    #[test]
    fn an_injected_error_completes_the_next_request_with_it() {
        let (mut a, mut b, qa, qb) = pair();
        let (src, ctl) = (a.alloc(8).unwrap(), b.alloc(8).unwrap());
        b.post_recv(qb, 1, ctl, 0, 8).unwrap();
        a.inject_error(qa, "retry exceeded");
        a.post_send(qa, 4, src, 0, 8).unwrap();
        assert!(matches!(&poll(&mut a)[..], [Event::Failed { wr_id: 4, why, .. }] if why == "retry exceeded"));
        assert!(matches!(&poll(&mut b)[..], [Event::Failed { wr_id: 1, .. }]));
        assert_eq!(b.qp_state(qb), QpState::Error);
    }

    #[test]
    fn fail_at_counts_sends_and_writes() {
        let (mut a, mut b, qa, qb) = pair();
        let (src, ctl) = (a.alloc(8).unwrap(), b.alloc(64).unwrap());
        for i in 0..3 {
            b.post_recv(qb, i, ctl, 8 * i as usize, 8).unwrap();
        }
        a.fail_at(2, "injected");
        a.post_send(qa, 10, src, 0, 8).unwrap();
        a.post_send(qa, 11, src, 0, 8).unwrap();
        let evs = poll(&mut a);
        assert_eq!(evs[0], Event::Sent { qp: qa, wr_id: 10 });
        assert!(matches!(&evs[1], Event::Failed { wr_id: 11, why, .. } if why == "injected"), "{evs:?}");
    }

    #[test]
    fn a_dropped_peer_fails_later_sends() {
        let (mut a, b, qa, _) = pair();
        let src = a.alloc(8).unwrap();
        drop(b);
        a.post_send(qa, 1, src, 0, 8).unwrap();
        assert!(matches!(&poll(&mut a)[..], [Event::Failed { wr_id: 1, .. }]));
        assert_eq!(a.qp_state(qa), QpState::Error);
    }

    #[test]
    fn connect_refuses_an_unknown_endpoint() {
        let mut a = FakeNic::new();
        let qa = a.create_qp().unwrap();
        let e = a.connect(qa, &Endpoint { qpn: u32::MAX, psn: 0, lid: 0, gid: [0; 16] }).unwrap_err();
        assert!(e.to_string().contains("no fake queue pair"), "{e}");
    }
}
