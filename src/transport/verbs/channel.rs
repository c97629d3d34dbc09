//! One peer's data path over a [`Nic`]: chunks written with immediate data from a local
//! send staging slot into the peer's receive staging slot, over several queue pairs, with
//! credits returned by small sends so a sender never overwrites a slot the peer has not
//! drained. The piece of the verbs transport that moves bytes; the control signals
//! (Ready, Landed, Failed) and the engine's calls sit above it.
//!
//! **Layout.** Each side registers `slots` × `slot_bytes` of send staging, the same of
//! receive staging (the peer's write target) and a control buffer. A slot starts with a
//! 24-byte header (transfer u32, payload length u32, offset u64, the transfer's total
//! length u64, little-endian), then the payload. The immediate names the slot (high 8 bits) and the low 24 bits of the transfer;
//! the receiver checks them against the header.
//!
//! **Credits.** The sender starts with one credit per receive slot of the peer and spends
//! one per chunk (the credit names the slot it writes). When the receiver has copied a
//! slot out ([`Channel::take`]) it sends the slot's index back (4 bytes): the credit.
//! Chunks go round-robin over the queue pairs; order between chunks is not needed (each
//! names its offset).
//!
//! **Receives.** Both the peer's writes with immediate and its credits consume receives;
//! at most `slots` of each are in flight towards one side, so each queue pair keeps
//! 2 × `slots` receives posted (8-byte control slots), reposted as they are consumed.
//!
//! **Failure.** Any error completion fails the channel: every later call says why.
use super::nic::{BufId, Event, Nic, QpId, RemoteKey};
use super::safe::Endpoint;
use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};

const OP: &str = "verbs channel";
/// Bytes of a slot's header.
pub const HEADER: usize = 24;
/// Bytes of one control receive (a credit is 4).
const CTL: usize = 8;
/// At most this many slots: each queue pair then holds at most 2 × `MAX_SLOTS` posted
/// receives and as many sends (writes and credits), its queues' depth
/// ([`super::nic::QP_DEPTH`]); the immediate's 8 slot bits would take 256.
pub const MAX_SLOTS: usize = super::nic::QP_DEPTH as usize / 2;

const WR_WRITE: u64 = 1 << 60;
const WR_CREDIT: u64 = 2 << 60;
const WR_RECV: u64 = 3 << 60;
const WR_KIND: u64 = 0xf << 60;

/// What the peer needs to reach this side: one endpoint per queue pair and the receive
/// staging's key. Travels as bytes ([`Setup::to_bytes`]) over the bootstrap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setup {
    pub endpoints: Vec<Endpoint>,
    pub slots: RemoteKey,
    pub slot_bytes: u32,
    pub nslots: u32,
}

impl Setup {
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(28 + self.endpoints.len() * Endpoint::BYTES);
        b.extend_from_slice(&self.slots.addr.to_le_bytes());
        b.extend_from_slice(&self.slots.rkey.to_le_bytes());
        b.extend_from_slice(&self.slots.len.to_le_bytes());
        b.extend_from_slice(&self.slot_bytes.to_le_bytes());
        b.extend_from_slice(&self.nslots.to_le_bytes());
        for e in &self.endpoints {
            b.extend_from_slice(&e.to_bytes());
        }
        b
    }

    pub fn from_bytes(b: &[u8]) -> Result<Setup> {
        let bad = || Error::corrupt("verbs::Setup::from_bytes", format!("{} bytes: not a channel setup", b.len()));
        if b.len() < 28 || (b.len() - 28) % Endpoint::BYTES != 0 {
            return Err(bad());
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or_default());
        let endpoints = b[28..].chunks(Endpoint::BYTES).map(Endpoint::from_bytes).collect::<Result<Vec<_>>>()?;
        Ok(Setup { slots: RemoteKey { addr: u64_at(0), rkey: u32_at(8), len: u64_at(12) }, slot_bytes: u32_at(20), nslots: u32_at(24), endpoints })
    }
}

/// A chunk that landed in a receive slot: `len` bytes of transfer `xfer` (of `total` bytes
/// in all) at `offset`. The caller copies it out with [`Channel::take`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arrived {
    pub slot: usize,
    pub xfer: u32,
    pub offset: u64,
    pub total: u64,
    pub len: usize,
}

/// One peer's data path (see the module comment).
pub struct Channel {
    qps: Vec<QpId>,
    send: BufId,
    recv: BufId,
    ctl: BufId,
    nslots: usize,
    slot_bytes: usize,
    remote: Option<(RemoteKey, usize)>,
    free_send: Vec<usize>,
    credits: VecDeque<usize>,
    /// Send slot of each write in flight, by wr_id, with its transfer and payload length.
    writes: HashMap<u64, (usize, u32, usize)>,
    next_qp: usize,
    failed: Option<String>,
}

impl Channel {
    /// Create the queue pairs and staging on `nic`; `qps` queue pairs, `nslots` slots of
    /// `slot_bytes` (header included) each way.
    pub fn new(nic: &mut dyn Nic, qps: usize, nslots: usize, slot_bytes: usize) -> Result<(Channel, Setup)> {
        if qps == 0 || nslots == 0 || nslots > MAX_SLOTS || slot_bytes <= HEADER || u32::try_from(slot_bytes).is_err() {
            return Err(Error::invalid_arg(OP, format!("{qps} queue pairs, {nslots} slots of {slot_bytes} bytes: want 1.., 1..={MAX_SLOTS}, more than {HEADER}")));
        }
        let qp_ids = (0..qps).map(|_| nic.create_qp()).collect::<Result<Vec<_>>>()?;
        let endpoints = qp_ids.iter().map(|&q| nic.endpoint(q)).collect::<Result<Vec<_>>>()?;
        let send = nic.alloc(nslots * slot_bytes)?;
        let recv = nic.alloc(nslots * slot_bytes)?;
        // Per queue pair 2 × nslots receive slots, then one credit message area per slot.
        let ctl = nic.alloc((qps * 2 * nslots + nslots) * CTL)?;
        let setup = Setup { endpoints, slots: nic.key(recv), slot_bytes: slot_bytes as u32, nslots: nslots as u32 };
        let ch = Channel {
            qps: qp_ids,
            send,
            recv,
            ctl,
            nslots,
            slot_bytes,
            remote: None,
            free_send: (0..nslots).rev().collect(),
            credits: VecDeque::new(),
            writes: HashMap::new(),
            next_qp: 0,
            failed: None,
        };
        Ok((ch, setup))
    }

    /// Connect to the peer's `setup` (queue pair i to its queue pair i) and post receives.
    pub fn connect(&mut self, nic: &mut dyn Nic, peer: &Setup) -> Result<()> {
        if peer.endpoints.len() != self.qps.len() || peer.nslots == 0 || peer.slot_bytes as usize <= HEADER {
            return Err(Error::invalid_usage(OP, format!("the peer has {} queue pairs and {} slots of {} bytes; this side {} queue pairs", peer.endpoints.len(), peer.nslots, peer.slot_bytes, self.qps.len())));
        }
        if u64::from(peer.nslots) * u64::from(peer.slot_bytes) > peer.slots.len || peer.nslots as usize > MAX_SLOTS {
            return Err(Error::invalid_usage(OP, "the peer's slots exceed its registration"));
        }
        for (i, e) in peer.endpoints.iter().enumerate() {
            nic.connect(self.qps[i], e)?;
        }
        for i in 0..self.qps.len() {
            for r in 0..2 * self.nslots {
                let idx = i * 2 * self.nslots + r;
                nic.post_recv(self.qps[i], WR_RECV | idx as u64, self.ctl, idx * CTL, CTL)?;
            }
        }
        self.remote = Some((peer.slots, peer.slot_bytes as usize));
        self.credits = (0..peer.nslots as usize).collect();
        Ok(())
    }

    /// Why the channel failed, if it did.
    pub fn failed(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// Largest payload of one chunk (what both sides' slots take).
    pub fn max_payload(&self) -> usize {
        self.remote.map_or(self.slot_bytes, |(_, b)| b.min(self.slot_bytes)) - HEADER
    }

    /// Writes waiting for their completion (a credit spent, a send slot held).
    pub fn in_flight(&self) -> usize {
        self.writes.len()
    }

    fn check(&self) -> Result<(RemoteKey, usize)> {
        if let Some(why) = &self.failed {
            return Err(Error::internal(OP, format!("failed: {why}")));
        }
        self.remote.ok_or_else(|| Error::invalid_usage(OP, "not connected"))
    }

    /// Whether a chunk may be written now (a credit and a send slot are free).
    pub fn can_send(&self) -> bool {
        self.failed.is_none() && self.remote.is_some() && !self.free_send.is_empty() && !self.credits.is_empty()
    }

    /// Write `data` (at most [`max_payload`](Self::max_payload) bytes) as the chunk of
    /// transfer `xfer` (`total` bytes in all) at `offset`; false when no credit or send slot
    /// is free now (poll, then try again).
    pub fn try_send(&mut self, nic: &mut dyn Nic, xfer: u32, offset: u64, total: u64, data: &[u8]) -> Result<bool> {
        let qp = self.next_qp % self.qps.len();
        let sent = self.send_on(nic, qp, xfer, offset, total, data)?;
        if sent {
            self.next_qp += 1;
        }
        Ok(sent)
    }

    /// As [`try_send`](Self::try_send), always on the first queue pair: chunks sent this way
    /// land in the order they were sent (an RC queue pair keeps its order; different queue
    /// pairs do not), which the control messages above rely on.
    pub fn try_send_ordered(&mut self, nic: &mut dyn Nic, xfer: u32, offset: u64, total: u64, data: &[u8]) -> Result<bool> {
        self.send_on(nic, 0, xfer, offset, total, data)
    }

    fn send_on(&mut self, nic: &mut dyn Nic, qp: usize, xfer: u32, offset: u64, total: u64, data: &[u8]) -> Result<bool> {
        let (key, remote_slot_bytes) = self.check()?;
        if data.len() > self.max_payload() {
            return Err(Error::invalid_arg(OP, format!("a {}-byte chunk exceeds the {}-byte slot payload", data.len(), self.max_payload())));
        }
        let (Some(&local), Some(&remote)) = (self.free_send.last(), self.credits.front()) else { return Ok(false) };
        let mut hdr = [0u8; HEADER];
        hdr[0..4].copy_from_slice(&xfer.to_le_bytes());
        hdr[4..8].copy_from_slice(&(data.len() as u32).to_le_bytes());
        hdr[8..16].copy_from_slice(&offset.to_le_bytes());
        hdr[16..24].copy_from_slice(&total.to_le_bytes());
        let at = local * self.slot_bytes;
        nic.fill(self.send, at, &hdr)?;
        nic.fill(self.send, at + HEADER, data)?;
        let qp = self.qps[qp];
        let imm = ((remote as u32) << 24) | (xfer & 0x00ff_ffff);
        let wr = WR_WRITE | local as u64;
        nic.post_write_imm(qp, wr, self.send, at, HEADER + data.len(), key, (remote * remote_slot_bytes) as u64, imm)?;
        self.free_send.pop();
        self.credits.pop_front();
        self.writes.insert(wr, (local, xfer, data.len()));
        Ok(true)
    }

    /// Whether `qp` is one of this channel's queue pairs.
    pub fn owns(&self, qp: QpId) -> bool {
        self.qps.contains(&qp)
    }

    /// Take one event of this channel's queue pairs: a chunk that landed here goes to
    /// `arrived`; a completed write of this side frees its send slot and goes to `sent`
    /// (transfer, payload bytes); a credit returns a slot. An error fails the channel.
    pub fn handle(&mut self, nic: &mut dyn Nic, ev: &Event, arrived: &mut Vec<Arrived>, sent: &mut Vec<(u32, usize)>) -> Result<()> {
        match *ev {
            Event::Failed { ref why, wr_id, .. } => {
                let what = match wr_id & WR_KIND {
                    WR_WRITE => "a data write",
                    WR_CREDIT => "a credit",
                    _ => "a receive",
                };
                self.failed.get_or_insert_with(|| format!("{what} failed: {why}"));
                Err(Error::internal(OP, format!("{what} failed: {why}")))
            }
            Event::Sent { wr_id, .. } if wr_id & WR_KIND == WR_WRITE => {
                let Some((slot, xfer, len)) = self.writes.remove(&wr_id) else {
                    return Err(Error::internal(OP, format!("completion of an unknown write {wr_id:#x}")));
                };
                self.free_send.push(slot);
                sent.push((xfer, len));
                Ok(())
            }
            Event::Sent { .. } => Ok(()),
            Event::WriteLanded { qp, wr_id, imm } => {
                self.repost(nic, qp, wr_id)?;
                let slot = (imm >> 24) as usize;
                if slot >= self.nslots {
                    return self.corrupt(format!("an immediate names slot {slot} of {}", self.nslots));
                }
                let mut hdr = [0u8; HEADER];
                nic.read(self.recv, slot * self.slot_bytes, &mut hdr)?;
                let xfer = u32::from_le_bytes(hdr[0..4].try_into().unwrap_or_default());
                let len = u32::from_le_bytes(hdr[4..8].try_into().unwrap_or_default()) as usize;
                let offset = u64::from_le_bytes(hdr[8..16].try_into().unwrap_or_default());
                let total = u64::from_le_bytes(hdr[16..24].try_into().unwrap_or_default());
                if xfer & 0x00ff_ffff != imm & 0x00ff_ffff || len > self.slot_bytes - HEADER {
                    return self.corrupt(format!("slot {slot}'s header (transfer {xfer}, {len} bytes) disagrees with immediate {imm:#x}"));
                }
                arrived.push(Arrived { slot, xfer, offset, total, len });
                Ok(())
            }
            Event::Received { qp, wr_id, len } => {
                if len != 4 {
                    return self.corrupt(format!("a {len}-byte control message"));
                }
                // Read the message before reposting its receive (the NIC may refill it).
                let idx = (wr_id & !WR_KIND) as usize;
                let mut b = [0u8; 4];
                nic.read(self.ctl, idx * CTL, &mut b)?;
                self.repost(nic, qp, wr_id)?;
                let slot = u32::from_le_bytes(b) as usize;
                let peer_slots = self.remote.map_or(0, |(k, b)| (k.len / b as u64) as usize);
                if slot >= peer_slots || self.credits.contains(&slot) {
                    return self.corrupt(format!("a credit for slot {slot}"));
                }
                self.credits.push_back(slot);
                Ok(())
            }
        }
    }

    fn corrupt(&mut self, what: String) -> Result<()> {
        self.failed.get_or_insert_with(|| what.clone());
        Err(Error::corrupt(OP, what))
    }

    fn repost(&mut self, nic: &mut dyn Nic, qp: QpId, wr_id: u64) -> Result<()> {
        let idx = (wr_id & !WR_KIND) as usize;
        nic.post_recv(qp, wr_id, self.ctl, idx * CTL, CTL)
    }

    /// Copy arrived chunk `a`'s payload into `out` (its length) and return the slot's
    /// credit to the peer.
    pub fn take(&mut self, nic: &mut dyn Nic, a: &Arrived, out: &mut [u8]) -> Result<()> {
        self.check()?;
        if out.len() != a.len || a.slot >= self.nslots {
            return Err(Error::invalid_arg(OP, format!("take {} bytes of a {}-byte chunk in slot {}", out.len(), a.len, a.slot)));
        }
        nic.read(self.recv, a.slot * self.slot_bytes + HEADER, out)?;
        // The credit message area of this slot: free, as the slot was written after the
        // peer received its previous credit.
        let at = (self.qps.len() * 2 * self.nslots + a.slot) * CTL;
        nic.fill(self.ctl, at, &(a.slot as u32).to_le_bytes())?;
        let qp = self.qps[a.slot % self.qps.len()];
        nic.post_send(qp, WR_CREDIT | a.slot as u64, self.ctl, at, 4)
    }
}

#[cfg(test)]
mod tests {
    use super::super::nic::fake::FakeNic;
    use super::*;

    /// Two connected channels on the fake fabric, their setups crossing as bytes.
    fn pair(qps: usize, nslots: usize, slot_bytes: usize) -> (FakeNic, Channel, FakeNic, Channel) {
        let (mut na, mut nb) = (FakeNic::new(), FakeNic::new());
        let (mut a, sa) = Channel::new(&mut na, qps, nslots, slot_bytes).unwrap();
        let (mut b, sb) = Channel::new(&mut nb, qps, nslots, slot_bytes).unwrap();
        a.connect(&mut na, &Setup::from_bytes(&sb.to_bytes()).unwrap()).unwrap();
        b.connect(&mut nb, &Setup::from_bytes(&sa.to_bytes()).unwrap()).unwrap();
        (na, a, nb, b)
    }

    /// Poll `nic` and hand every event to `ch`; the first error, if any.
    fn pump(nic: &mut FakeNic, ch: &mut Channel, arrived: &mut Vec<Arrived>, sent: &mut Vec<(u32, usize)>) -> Result<()> {
        let mut evs = Vec::new();
        nic.poll(&mut evs)?;
        let mut first = Ok(());
        for e in &evs {
            if let Err(x) = ch.handle(nic, e, arrived, sent) {
                first = first.and(Err(x));
            }
        }
        first
    }

    #[test]
    fn setup_round_trips_and_rejects_garbage() {
        let mut n = FakeNic::new();
        let (_, s) = Channel::new(&mut n, 3, 4, 1024).unwrap();
        assert_eq!(Setup::from_bytes(&s.to_bytes()).unwrap(), s);
        assert_eq!(s.endpoints.len(), 3);
        assert!(Setup::from_bytes(&s.to_bytes()[..30]).is_err());
        assert!(Channel::new(&mut n, 1, MAX_SLOTS + 1, 1024).is_err(), "more slots than a queue pair's depth holds");
        assert!(Channel::new(&mut n, 1, 4, HEADER).is_err(), "a slot with no room for payload");
    }

    #[test]
    fn a_transfer_in_chunks_over_several_queue_pairs_arrives_intact_within_its_credits() {
        let (mut na, mut a, mut nb, mut b) = pair(2, 3, 64 + HEADER);
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut got = vec![0u8; data.len()];
        let (mut arrived, mut sent_a, mut sent_b, mut none) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut off, mut landed, mut stalls, mut sent_bytes) = (0usize, 0usize, 0, 0);
        while landed < data.len() {
            // The sender writes until credits run out: never more than 3 chunks ahead.
            while off < data.len() {
                let n = (data.len() - off).min(a.max_payload());
                if !a.try_send(&mut na, 7, off as u64, data.len() as u64, &data[off..off + n]).unwrap() {
                    stalls += 1;
                    break;
                }
                off += n;
            }
            assert!(a.in_flight() <= 3);
            pump(&mut nb, &mut b, &mut arrived, &mut sent_b).unwrap();
            for c in arrived.drain(..) {
                assert_eq!((c.xfer, c.total), (7, 1000));
                b.take(&mut nb, &c, &mut got[c.offset as usize..c.offset as usize + c.len]).unwrap();
                landed += c.len;
            }
            pump(&mut na, &mut a, &mut none, &mut sent_a).unwrap();
            sent_bytes += sent_a.drain(..).map(|(x, n)| { assert_eq!(x, 7); n }).sum::<usize>();
        }
        assert!(got == data, "the bytes differ");
        assert_eq!(sent_bytes, data.len());
        assert!(stalls > 0, "16 chunks through 3 slots must wait for credits");
        assert!(none.is_empty() && sent_b.is_empty());
    }

    #[test]
    fn without_credits_returned_the_sender_stops() {
        let (mut na, mut a, mut nb, mut b) = pair(1, 2, HEADER + 16);
        let chunk = [1u8; 16];
        assert!(a.try_send(&mut na, 1, 0, 48, &chunk).unwrap());
        assert!(a.try_send(&mut na, 1, 16, 48, &chunk).unwrap());
        assert!(!a.try_send(&mut na, 1, 32, 48, &chunk).unwrap());
        let (mut arrived, mut sent) = (Vec::new(), Vec::new());
        pump(&mut nb, &mut b, &mut arrived, &mut sent).unwrap();
        pump(&mut na, &mut a, &mut Vec::new(), &mut sent).unwrap();
        // Writes completed, slots freed locally, but the peer has not drained: still no credit.
        assert_eq!(sent.len(), 2);
        assert!(!a.try_send(&mut na, 1, 32, 48, &chunk).unwrap());
        let mut out = [0u8; 16];
        b.take(&mut nb, &arrived[0], &mut out).unwrap();
        pump(&mut na, &mut a, &mut Vec::new(), &mut sent).unwrap();
        assert!(a.try_send(&mut na, 1, 32, 48, &chunk).unwrap());
        assert!(a.try_send(&mut na, 1, 0, 48, &[0u8; 17]).is_err(), "a chunk larger than the slot payload is refused");
    }

    #[test]
    fn an_error_completion_fails_both_sides() {
        let (mut na, mut a, mut nb, mut b) = pair(2, 2, 64);
        na.inject_error(0, "transport retry counter exceeded");
        assert!(a.try_send(&mut na, 3, 0, 48, &[5u8; 8]).unwrap());
        let e = pump(&mut na, &mut a, &mut Vec::new(), &mut Vec::new()).unwrap_err();
        assert!(e.to_string().contains("data write failed: transport retry counter exceeded"), "{e}");
        assert!(a.try_send(&mut na, 3, 8, 48, &[5u8; 8]).is_err());
        // The peer's receives on that connection are flushed: it fails too.
        assert!(pump(&mut nb, &mut b, &mut Vec::new(), &mut Vec::new()).is_err());
        assert!(b.failed().is_some());
    }
}
