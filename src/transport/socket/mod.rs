//! The socket transport: ranks of other nodes over TCP. Several connections per peer
//! (`HOCCL_QPS_PER_PEER`), non-blocking, driven from the proxy's turns; nothing here waits
//! once the connections are up.
//!
//! **Wire format.** Every frame is a 48-byte header ([`HDR`]), then, for data, its payload:
//! `kind | k | pair_seq | a | token | offset | payload length`, little-endian. Kinds:
//! `Ready` (a receive buffer: `a` its length, `token` its name at the receiver), `Failed`
//! (`a` the error code), `Data` (`payload` bytes at `offset` of the buffer `token`; `a` the
//! transfer's total length), `Done` (the receiver has every byte of `token`), `Bye` (the
//! sender's communicator closed). Control frames (all but `Data`) go on the peer's first
//! connection, in the order they were posted; a transfer's data is cut into chunks of
//! [`CHUNK`] bytes that go on whichever connection is free, so its chunks travel in
//! parallel and may arrive out of order (each names its offset).
//!
//! **Landing.** The receiver counts a transfer's bytes; when all have arrived it reports
//! `Landed` to its own engine (through `poll_signals`, as if the sender had signalled it:
//! the bytes on the other connections cannot be overtaken that way) and sends `Done` back;
//! the sender reports the flow done at `Done`. While a long transfer's chunks keep arriving
//! the receiver reports `Progress` to its engine at most every [`PROGRESS_EVERY`].
//!
//! **Memory.** The host backend's device memory is host memory: the bytes go from the
//! sender's buffer into the socket and from the socket into the receiver's buffer, with no
//! copy in between ([`raw`]). Nothing is allocated per chunk: frame headers live in the
//! connections, control frames in per-peer queues that keep their capacity.
//!
//! **Rate limit.** `HOCCL_NET_GBPS` caps this rank's payload bytes per second in each
//! direction with a token bucket ([`Bucket`]): a limit inside the transport, for measuring
//! with several virtual nodes on one host, not Linux traffic control.
//!
//! **Health.** A connection that closes or fails makes the peer gone: its flows fail (the
//! error names the rank) and `peer_health` says why, so the engine fails the ops that wait
//! on it. A peer that closed its communicator says `Bye` first.
mod raw;

use crate::device::{DevPtr, Device};
use crate::error::{Error, Result};
use crate::transport::{FlowId, Incoming, Region, RemoteBuffer, Signal, Tag, Transport, Wire};
use raw::Span;
use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The bytes of one data frame's payload at most.
pub const CHUNK: usize = 512 << 10;
/// A frame header's size.
pub const HDR: usize = 48;
/// How often at most a receive in progress tells its engine that bytes keep arriving.
pub const PROGRESS_EVERY: Duration = Duration::from_millis(10);
/// Bytes one connection moves per direction in one turn at most, so one busy connection
/// does not hold the proxy from the others.
const TURN_BYTES: usize = 4 << 20;
/// Identifies hoccl's frames and connection handshakes ("HCNT" + version 1).
const MAGIC: u32 = 0x4843_4e01;
const OP: &str = "socket transport";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Ready = 1,
    Failed = 2,
    Data = 3,
    Done = 4,
    Bye = 5,
}

/// A frame header, decoded.
#[derive(Clone, Copy, Debug)]
struct Header {
    kind: Kind,
    k: u32,
    pair_seq: u64,
    a: u64,
    token: u64,
    offset: u64,
    payload: u64,
}

impl Header {
    fn new(kind: Kind, pair_seq: u64, k: u32) -> Header {
        Header { kind, k, pair_seq, a: 0, token: 0, offset: 0, payload: 0 }
    }

    fn encode(&self) -> [u8; HDR] {
        let mut b = [0u8; HDR];
        b[0..4].copy_from_slice(&(MAGIC ^ (self.kind as u32) << 24).to_le_bytes());
        b[4..8].copy_from_slice(&self.k.to_le_bytes());
        for (i, v) in [self.pair_seq, self.a, self.token, self.offset, self.payload].into_iter().enumerate() {
            b[8 + 8 * i..16 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    fn decode(b: &[u8; HDR]) -> Option<Header> {
        let w = u32::from_le_bytes(b[0..4].try_into().ok()?);
        if w & 0x00ff_ffff != MAGIC & 0x00ff_ffff {
            return None;
        }
        let kind = match ((w ^ MAGIC) >> 24) as u8 {
            1 => Kind::Ready,
            2 => Kind::Failed,
            3 => Kind::Data,
            4 => Kind::Done,
            5 => Kind::Bye,
            _ => return None,
        };
        let q = |i: usize| u64::from_le_bytes(b[8 + 8 * i..16 + 8 * i].try_into().expect("8 bytes"));
        let k = u32::from_le_bytes(b[4..8].try_into().ok()?);
        Some(Header { kind, k, pair_seq: q(0), a: q(1), token: q(2), offset: q(3), payload: q(4) })
    }
}

/// A token bucket: `rate` bytes per second, bursts up to `burst` bytes. `None` rate: no limit.
pub struct Bucket {
    rate: Option<f64>,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    /// `gbps` GB/s (10^9 bytes per second); 0: unlimited. Bursts of 2 ms of traffic (at
    /// least one chunk), so the proxy's sleeps between turns do not lose rate.
    pub fn new(gbps: f64) -> Bucket {
        let rate = (gbps > 0.0).then_some(gbps * 1e9);
        let burst = rate.map_or(0.0, |r| (r * 2e-3).max(CHUNK as f64));
        Bucket { rate, burst, tokens: burst, last: Instant::now() }
    }

    /// How many of `want` bytes may move now (0 when the bucket is empty).
    pub fn grant(&mut self, want: usize) -> usize {
        let Some(rate) = self.rate else { return want };
        let now = Instant::now();
        self.tokens = (self.tokens + now.duration_since(self.last).as_secs_f64() * rate).min(self.burst);
        self.last = now;
        (self.tokens.max(0.0) as usize).min(want)
    }

    /// `n` bytes moved.
    pub fn spend(&mut self, n: usize) {
        if self.rate.is_some() {
            self.tokens -= n as f64;
        }
    }
}

/// The frame a connection is writing.
struct OutFrame {
    hdr: [u8; HDR],
    hdr_sent: usize,
    /// The payload's source (None: zeros, for a cancelled flow's frame already begun).
    src: Option<Span>,
    /// Offset of the payload in `src`, its length, bytes of it sent.
    at: usize,
    len: usize,
    sent: usize,
    /// The op the payload belongs to (data frames).
    seq: Option<u64>,
}

/// What a connection is reading.
enum InState {
    Header { buf: [u8; HDR], got: usize },
    /// A data frame's payload for receive `token` (None: discarded, its receive is gone):
    /// `left` bytes to read into the buffer at `at`.
    Payload { token: u64, dst: Option<Span>, at: usize, left: usize },
}

struct Conn {
    sock: TcpStream,
    fd: RawFd,
    out: Option<OutFrame>,
    inp: InState,
}

impl Conn {
    fn new(sock: TcpStream) -> Conn {
        let fd = sock.as_raw_fd();
        Conn { sock, fd, out: None, inp: InState::Header { buf: [0; HDR], got: 0 } }
    }
}

/// A send with chunks left to put on the wire.
struct OutFlow {
    id: FlowId,
    tag: Tag,
    token: u64,
    src: Span,
    len: usize,
    /// Bytes handed to connections so far.
    next: usize,
}

/// A receive buffer exposed to the peer, by token.
struct Slot {
    dst: Span,
    /// The transfer it was announced for (set by `post_ready`).
    pair_seq: Option<u64>,
    /// The transfer's index and total length, from its first data frame.
    k: u32,
    total: Option<u64>,
    received: u64,
    told: Instant,
}

/// Everything about one peer of another node.
struct Peer {
    conns: Vec<Conn>,
    /// Control frames not yet begun, in order (they go on `conns[0]`).
    ctrl: VecDeque<Header>,
    flows: VecDeque<OutFlow>,
    /// Flows whose every chunk is on the wire, waiting for the receiver's `Done`, by token.
    awaiting: HashMap<u64, FlowId>,
    slots: HashMap<u64, Slot>,
    /// The connection the next data chunk goes on first (round robin).
    next_conn: usize,
    bye: bool,
    gone: Option<String>,
}

/// What `connect` needs: this rank, the communicator, the listening socket and what every
/// rank published (its address and secret; None for the ranks of this node).
pub struct NetLinks {
    pub rank: usize,
    pub comm_id: u64,
    pub listener: TcpListener,
    pub peers: Vec<Option<(SocketAddr, [u8; 16])>>,
    /// This rank's own secret (what its peers must present).
    pub secret: [u8; 16],
    /// Connections per peer.
    pub qps: usize,
    /// `Config::net_gbps`.
    pub gbps: f64,
    /// Bounds the connection setup.
    pub timeout: Duration,
}

pub struct Socket {
    dev: Arc<dyn Device>,
    rank: usize,
    peers: Vec<Option<Peer>>,
    next_token: u64,
    send_bucket: Bucket,
    recv_bucket: Bucket,
    /// Zeros to send in place of a cancelled flow's payload; a sink for discarded payloads.
    pad: Box<[u8]>,
    /// Results gathered while reading, handed out by `poll_signals` and `progress`.
    incoming: Vec<Incoming>,
    done: Vec<FlowId>,
    advanced: Vec<u64>,
    failed: VecDeque<(u64, Error)>,
}

impl Socket {
    /// Open `qps` connections to every peer of another node, authenticated both ways, within
    /// `links.timeout`; the lower rank of each pair connects. The device must be the host
    /// backend (its memory is what the sockets read and write).
    pub fn connect(dev: Arc<dyn Device>, links: NetLinks) -> Result<Socket> {
        if dev.backend() != crate::device::Backend::Host {
            return Err(Error::invalid_usage(
                OP,
                "ranks of another node are reached through host memory; the CUDA backend's staging for the socket transport is not built, so only the host backend runs across nodes",
            ));
        }
        let conns = establish(&links)?;
        let peers = conns.into_iter().map(|c| c.map(|conns| Peer {
            conns: conns.into_iter().map(Conn::new).collect(),
            ctrl: VecDeque::with_capacity(64),
            flows: VecDeque::new(),
            awaiting: HashMap::new(),
            slots: HashMap::new(),
            next_conn: 0,
            bye: false,
            gone: None,
        }));
        Ok(Socket {
            dev,
            rank: links.rank,
            peers: peers.collect(),
            next_token: 1,
            send_bucket: Bucket::new(links.gbps),
            recv_bucket: Bucket::new(links.gbps),
            pad: vec![0u8; 64 << 10].into_boxed_slice(),
            incoming: Vec::new(),
            done: Vec::new(),
            advanced: Vec::new(),
            failed: VecDeque::new(),
        })
    }

    /// Whether this transport reaches `peer`.
    pub fn reaches(&self, peer: usize) -> bool {
        self.peers.get(peer).is_some_and(Option::is_some)
    }

    fn peer(&mut self, peer: usize) -> Result<&mut Peer> {
        let rank = self.rank;
        self.peers.get_mut(peer).and_then(Option::as_mut).ok_or_else(|| Error::internal(OP, format!("rank {rank} has no connection to rank {peer}")))
    }

    /// Queue a control frame to `peer` (dropped, with a debug line, when it is gone).
    fn post(&mut self, peer: usize, h: Header) {
        match self.peers.get_mut(peer).and_then(Option::as_mut) {
            Some(p) if p.gone.is_none() => p.ctrl.push_back(h),
            Some(p) => log::debug!("rank {}: {:?} to rank {peer} dropped: {}", self.rank, h.kind, p.gone.as_deref().unwrap_or("")),
            None => log::error!("rank {}: no connection to rank {peer}", self.rank),
        }
    }

    /// Peer `i` can no longer be reached: fail its flows, forget its receives.
    fn mark_gone(&mut self, i: usize, why: String) {
        let Some(p) = self.peers.get_mut(i).and_then(Option::as_mut) else { return };
        if p.gone.is_some() {
            return;
        }
        log::debug!("rank {}: rank {i} is gone: {why}", self.rank);
        let seqs: Vec<u64> = p.flows.drain(..).map(|f| f.id.seq).chain(p.awaiting.drain().map(|(_, id)| id.seq)).collect();
        for seq in seqs {
            self.failed.push_back((seq, Error::Remote { op: OP, peer: i, what: why.clone() }));
        }
        p.slots.clear();
        p.ctrl.clear();
        for c in &mut p.conns {
            c.out = None;
            let _ = c.sock.shutdown(std::net::Shutdown::Both);
        }
        p.gone = Some(why);
    }

    /// Write on every connection of every peer; whether a byte moved.
    fn pump_out(&mut self) -> bool {
        let mut any = false;
        for i in 0..self.peers.len() {
            let Some(p) = self.peers[i].as_mut() else { continue };
            if p.gone.is_some() {
                continue;
            }
            let n = p.conns.len();
            let first = p.next_conn;
            for j in 0..n {
                let c = (first + j) % n;
                match write_conn(p, c, &mut self.send_bucket, &self.pad, &mut self.advanced) {
                    Ok(moved) => any |= moved,
                    Err(e) => {
                        self.mark_gone(i, format!("connection {c} failed: {e}"));
                        break;
                    }
                }
            }
            if let Some(p) = self.peers[i].as_mut() {
                p.next_conn = (first + 1) % n.max(1);
            }
        }
        any
    }

    /// Read on every connection of every peer; whether a byte moved.
    fn pump_in(&mut self) -> bool {
        let mut any = false;
        for i in 0..self.peers.len() {
            let n = self.peers[i].as_ref().map_or(0, |p| p.conns.len());
            for c in 0..n {
                let Some(p) = self.peers[i].as_mut().filter(|p| p.gone.is_none()) else { break };
                let mut r = Reader { from: i, peer: p, bucket: &mut self.recv_bucket, pad: &mut self.pad, incoming: &mut self.incoming, done: &mut self.done, advanced: &mut self.advanced };
                match r.read_conn(c) {
                    Ok(moved) => any |= moved,
                    Err(why) => self.mark_gone(i, why),
                }
            }
        }
        any
    }
}

impl Transport for Socket {
    fn expose(&mut self, peer: usize, region: Region) -> Result<RemoteBuffer> {
        let dst = Span::in_allocation(OP, region.ptr, region.len, region.alloc)?;
        let token = self.next_token;
        self.next_token += 1;
        let p = self.peer(peer)?;
        if let Some(why) = &p.gone {
            return Err(Error::Remote { op: OP, peer, what: why.clone() });
        }
        p.slots.insert(token, Slot { dst, pair_seq: None, k: 0, total: None, received: 0, told: Instant::now() });
        let wire = Wire { alloc_id: token, ..Wire::empty(std::process::id()) };
        Ok(RemoteBuffer { len: region.len as u64, wire })
    }

    fn post_ready(&mut self, peer: usize, tag: Tag, remote: RemoteBuffer) {
        if let Some(slot) = self.peers.get_mut(peer).and_then(Option::as_mut).and_then(|p| p.slots.get_mut(&remote.wire.alloc_id)) {
            slot.pair_seq = Some(tag.pair_seq);
        }
        let mut h = Header::new(Kind::Ready, tag.pair_seq, tag.k);
        (h.a, h.token) = (remote.len, remote.wire.alloc_id);
        self.post(peer, h);
    }

    fn signal_failure(&mut self, peer: usize, pair_seq: u64, code: u32) {
        // The op's receives from `peer` are over: data still coming for them is dropped.
        if let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) {
            p.slots.retain(|_, s| s.pair_seq != Some(pair_seq));
        }
        let mut h = Header::new(Kind::Failed, pair_seq, 0);
        h.a = code as u64;
        self.post(peer, h);
    }

    fn poll_signals(&mut self, out: &mut Vec<Incoming>) -> bool {
        self.pump_in();
        let any = !self.incoming.is_empty();
        out.append(&mut self.incoming);
        any
    }

    fn start_write(&mut self, id: FlowId, peer: usize, tag: Tag, src: DevPtr, remote: &RemoteBuffer, len: usize) -> Result<()> {
        let alloc = if len == 0 { None } else { Some(self.dev.allocation(src)?) };
        let src = Span::in_allocation(OP, src, len, alloc)?;
        let p = self.peer(peer)?;
        if let Some(why) = &p.gone {
            return Err(Error::Remote { op: OP, peer, what: why.clone() });
        }
        p.flows.push_back(OutFlow { id, tag, token: remote.wire.alloc_id, src, len, next: 0 });
        Ok(())
    }

    fn progress(&mut self, done: &mut Vec<FlowId>, advanced: &mut Vec<u64>) -> std::result::Result<bool, (u64, Error)> {
        let mut moved = self.pump_out();
        moved |= self.pump_in();
        // Landings just read owe their senders a `Done`.
        moved |= self.pump_out();
        done.append(&mut self.done);
        advanced.append(&mut self.advanced);
        match self.failed.pop_front() {
            Some(e) => Err(e),
            None => Ok(moved),
        }
    }

    fn cancel(&mut self, seq: u64) {
        for p in self.peers.iter_mut().flatten() {
            p.flows.retain(|f| f.id.seq != seq);
            p.awaiting.retain(|_, id| id.seq != seq);
            // A frame begun must be finished for the stream to stay framed; the rest of its
            // payload is zeros, not the op's memory (which may be freed once it failed).
            for c in &mut p.conns {
                if let Some(f) = c.out.as_mut().filter(|f| f.seq == Some(seq)) {
                    f.src = None;
                }
            }
        }
    }

    fn peer_health(&self, peer: usize) -> Option<String> {
        self.peers.get(peer)?.as_ref()?.gone.clone()
    }

    fn data_in_flight(&self) -> bool {
        self.peers.iter().flatten().filter(|p| p.gone.is_none()).any(|p| {
            !p.flows.is_empty() || !p.awaiting.is_empty() || p.conns.iter().any(|c| c.out.as_ref().is_some_and(|f| f.seq.is_some()) || matches!(c.inp, InState::Payload { .. }))
        })
    }

    fn signals_queued(&self) -> bool {
        self.peers.iter().flatten().filter(|p| p.gone.is_none()).any(|p| !p.ctrl.is_empty() || p.conns.first().is_some_and(|c| c.out.as_ref().is_some_and(|f| f.seq.is_none())))
    }

    fn describe(&self) -> String {
        let live = self.peers.iter().flatten().filter(|p| p.gone.is_none());
        let (mut flows, mut awaiting, mut slots, mut ctrl) = (0, 0, 0, 0);
        for p in live {
            (flows, awaiting, slots, ctrl) = (flows + p.flows.len(), awaiting + p.awaiting.len(), slots + p.slots.len(), ctrl + p.ctrl.len());
        }
        let gone: Vec<usize> = (0..self.peers.len()).filter(|i| self.peer_health(*i).is_some()).collect();
        format!("sockets: {flows} sends with chunks to go, {awaiting} waiting for their receivers' Done, {slots} receives open, {ctrl} signals queued out, ranks gone {gone:?}")
    }

    fn close(&mut self) {
        for i in 0..self.peers.len() {
            if self.peers[i].as_ref().is_some_and(|p| p.gone.is_none()) {
                self.post(i, Header::new(Kind::Bye, 0, 0));
            }
        }
        // The last signals (a Done, failures at an abort, the Bye) go out within a bound.
        let t0 = Instant::now();
        while self.signals_queued() && t0.elapsed() < CLOSE_FLUSH {
            if !self.pump_out() {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        // Half-close, then read until the peer closes too (or the bound): closing with
        // unread bytes would reset the connection and could destroy what the peer has not
        // read yet.
        let conns = self.peers.iter().flatten().filter(|p| p.gone.is_none()).flat_map(|p| p.conns.iter());
        let mut open: Vec<&Conn> = conns.filter(|c| c.sock.shutdown(std::net::Shutdown::Write).is_ok()).collect();
        let t0 = Instant::now();
        while !open.is_empty() && t0.elapsed() < CLOSE_FLUSH {
            open.retain(|c| loop {
                match (&c.sock).read(&mut self.pad) {
                    Ok(0) => break false,
                    Ok(_) => continue,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break true,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(_) => break false,
                }
            });
            if !open.is_empty() {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        for p in self.peers.iter_mut().flatten() {
            p.gone.get_or_insert_with(|| "this rank closed its communicator".into());
        }
    }
}

/// How long `close` tries to send the last signals, and then waits for the peers to close.
const CLOSE_FLUSH: Duration = Duration::from_millis(200);

/// Fill connection `c` of `p` with frames and write what the socket takes; whether a byte
/// moved. An error: the connection failed.
fn write_conn(p: &mut Peer, c: usize, bucket: &mut Bucket, pad: &[u8], advanced: &mut Vec<u64>) -> std::io::Result<bool> {
    let mut moved = 0usize;
    loop {
        if p.conns[c].out.is_none() {
            let frame = if c == 0 && !p.ctrl.is_empty() {
                p.ctrl.pop_front().map(|h| OutFrame { hdr: h.encode(), hdr_sent: 0, src: None, at: 0, len: 0, sent: 0, seq: None })
            } else {
                next_chunk(p)
            };
            match frame {
                Some(f) => p.conns[c].out = Some(f),
                None => return Ok(moved > 0),
            }
        }
        let conn = &mut p.conns[c];
        let f = conn.out.as_mut().expect("set above");
        if f.hdr_sent < HDR {
            match (&conn.sock).write(&f.hdr[f.hdr_sent..]) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => {
                    f.hdr_sent += n;
                    moved += n;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(moved > 0),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            continue;
        }
        if f.sent < f.len {
            if moved >= TURN_BYTES {
                return Ok(true);
            }
            let want = bucket.grant(f.len - f.sent);
            if want == 0 {
                return Ok(moved > 0);
            }
            let r = match f.src {
                Some(src) => raw::send(conn.fd, src, f.at + f.sent, want),
                None => (&conn.sock).write(&pad[..want.min(pad.len())]),
            };
            match r {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => {
                    bucket.spend(n);
                    f.sent += n;
                    moved += n;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(moved > 0),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            continue;
        }
        if let Some(seq) = f.seq {
            if advanced.last() != Some(&seq) {
                advanced.push(seq);
            }
        }
        conn.out = None;
    }
}

/// The next data frame of `p`'s flows (the first flow's next chunk); a flow whose last
/// chunk goes out moves to `awaiting`.
fn next_chunk(p: &mut Peer) -> Option<OutFrame> {
    let f = p.flows.front_mut()?;
    let n = (f.len - f.next).min(CHUNK);
    let mut h = Header::new(Kind::Data, f.tag.pair_seq, f.tag.k);
    (h.a, h.token, h.offset, h.payload) = (f.len as u64, f.token, f.next as u64, n as u64);
    let frame = OutFrame { hdr: h.encode(), hdr_sent: 0, src: Some(f.src), at: f.next, len: n, sent: 0, seq: Some(f.id.seq) };
    f.next += n;
    if f.next == f.len {
        let f = p.flows.pop_front().expect("front exists");
        p.awaiting.insert(f.token, f.id);
    }
    Some(frame)
}

/// Reads the connections of one peer.
struct Reader<'a> {
    from: usize,
    peer: &'a mut Peer,
    bucket: &'a mut Bucket,
    pad: &'a mut [u8],
    incoming: &'a mut Vec<Incoming>,
    done: &'a mut Vec<FlowId>,
    advanced: &'a mut Vec<u64>,
}

impl Reader<'_> {
    /// Read what connection `c` has; whether a byte moved. An error: why the peer is gone.
    fn read_conn(&mut self, c: usize) -> std::result::Result<bool, String> {
        let mut moved = 0usize;
        let closed = |bye: bool| if bye { "its communicator was destroyed or aborted".to_string() } else { format!("connection {c} closed (its process exited or the network failed)") };
        loop {
            if moved >= TURN_BYTES {
                return Ok(true);
            }
            let conn = &mut self.peer.conns[c];
            match &mut conn.inp {
                InState::Header { buf, got } => {
                    match (&conn.sock).read(&mut buf[*got..]) {
                        Ok(0) => return Err(closed(self.peer.bye)),
                        Ok(n) => {
                            *got += n;
                            moved += n;
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(moved > 0),
                        Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                        Err(e) => return Err(format!("connection {c} failed: {e}")),
                    }
                    if *got < HDR {
                        continue;
                    }
                    let h = Header::decode(buf).ok_or_else(|| format!("connection {c} carried a malformed frame header"))?;
                    conn.inp = InState::Header { buf: [0; HDR], got: 0 };
                    self.frame(c, h)?;
                }
                InState::Payload { token, dst, at, left } => {
                    let want = self.bucket.grant(*left);
                    if want == 0 {
                        return Ok(moved > 0);
                    }
                    let r = match dst {
                        Some(d) => raw::recv(conn.fd, *d, *at, want),
                        None => {
                            let n = want.min(self.pad.len());
                            (&conn.sock).read(&mut self.pad[..n])
                        }
                    };
                    let n = match r {
                        Ok(0) => return Err(closed(self.peer.bye)),
                        Ok(n) => n,
                        Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(moved > 0),
                        Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                        Err(e) => return Err(format!("connection {c} failed: {e}")),
                    };
                    self.bucket.spend(n);
                    moved += n;
                    *at += n;
                    *left -= n;
                    let (token, finished) = (*token, *left == 0);
                    if finished {
                        conn.inp = InState::Header { buf: [0; HDR], got: 0 };
                    }
                    self.received(token, n as u64);
                }
            }
        }
    }

    /// A whole header arrived on connection `c`.
    fn frame(&mut self, c: usize, h: Header) -> std::result::Result<(), String> {
        let from = self.from;
        let signal = match h.kind {
            Kind::Ready => Signal::Ready { k: h.k, remote: RemoteBuffer { len: h.a, wire: Wire { alloc_id: h.token, ..Wire::empty(0) } } },
            Kind::Failed => Signal::Failed { code: h.a as u32 },
            Kind::Bye => {
                self.peer.bye = true;
                return Ok(());
            }
            Kind::Done => {
                if let Some(id) = self.peer.awaiting.remove(&h.token) {
                    self.done.push(id);
                    self.advanced.push(id.seq);
                }
                return Ok(());
            }
            Kind::Data => {
                let Some(slot) = self.peer.slots.get_mut(&h.token) else {
                    // Its receive failed and was forgotten: read the payload and drop it.
                    self.peer.conns[c].inp = InState::Payload { token: h.token, dst: None, at: 0, left: h.payload as usize };
                    return Ok(());
                };
                let len = slot.dst.len() as u64;
                let end = h.offset.checked_add(h.payload);
                if h.a > len || end.is_none_or(|e| e > h.a) || h.payload > CHUNK as u64 || slot.total.is_some_and(|t| t != h.a) {
                    return Err(format!("sent {} bytes at {} of a {}-byte transfer into a {len}-byte buffer (corrupt frame)", h.payload, h.offset, h.a));
                }
                (slot.total, slot.k, slot.pair_seq) = (Some(h.a), h.k, Some(h.pair_seq));
                if h.payload > 0 {
                    self.peer.conns[c].inp = InState::Payload { token: h.token, dst: Some(slot.dst), at: h.offset as usize, left: h.payload as usize };
                }
                // An empty transfer is complete at its header.
                self.received(h.token, 0);
                return Ok(());
            }
        };
        self.incoming.push(Incoming { from, pair_seq: h.pair_seq, signal });
        Ok(())
    }

    /// `n` bytes of receive `token` arrived; when it has all its bytes, report `Landed` to
    /// this rank's engine and send `Done` to the sender.
    fn received(&mut self, token: u64, n: u64) {
        let from = self.from;
        let Some(slot) = self.peer.slots.get_mut(&token) else { return };
        slot.received += n;
        let Some(total) = slot.total else { return };
        let (pair_seq, k) = (slot.pair_seq.unwrap_or(0), slot.k);
        if slot.received < total {
            if n > 0 && slot.told.elapsed() >= PROGRESS_EVERY {
                slot.told = Instant::now();
                self.incoming.push(Incoming { from, pair_seq, signal: Signal::Progress { k } });
            }
            return;
        }
        self.peer.slots.remove(&token);
        self.incoming.push(Incoming { from, pair_seq, signal: Signal::Landed { k, len: total } });
        let mut d = Header::new(Kind::Done, pair_seq, k);
        (d.a, d.token) = (total, token);
        self.peer.ctrl.push_back(d);
    }
}

// ================================================================ connection setup ======

/// The handshake record, both ways: magic, connection index, communicator, the sender's
/// rank and the secret the receiver published (proving the sender joined the bootstrap).
fn hello(comm_id: u64, rank: usize, c: usize, secret: &[u8; 16]) -> [u8; HDR] {
    let mut b = [0u8; HDR];
    b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    b[4..8].copy_from_slice(&(c as u32).to_le_bytes());
    b[8..16].copy_from_slice(&comm_id.to_le_bytes());
    b[16..24].copy_from_slice(&(rank as u64).to_le_bytes());
    b[24..40].copy_from_slice(secret);
    b
}

/// (connection index, communicator, rank, secret) of a handshake record.
fn parse_hello(b: &[u8; HDR]) -> Option<(usize, u64, usize, [u8; 16])> {
    (u32::from_le_bytes(b[0..4].try_into().ok()?) == MAGIC).then_some(())?;
    let c = u32::from_le_bytes(b[4..8].try_into().ok()?) as usize;
    let comm = u64::from_le_bytes(b[8..16].try_into().ok()?);
    let rank = u64::from_le_bytes(b[16..24].try_into().ok()?) as usize;
    Some((c, comm, rank, b[24..40].try_into().ok()?))
}

/// Time left before `deadline`, or the setup's timeout error.
fn left(deadline: Instant, l: &NetLinks, what: impl FnOnce() -> String) -> Result<Duration> {
    let now = Instant::now();
    if now >= deadline {
        return Err(Error::Timeout { op: "Communicator::new", after: l.timeout, what: format!("socket transport of rank {}: {}", l.rank, what()) });
    }
    Ok(deadline - now)
}

/// Open the connections: to each higher peer of another node `qps` connections (this rank
/// connects), from each lower one `qps` (this rank accepts), each confirmed by the other
/// side's handshake. Connecting first never waits for a peer (the listener's backlog holds
/// the connection), so no order of ranks deadlocks.
fn establish(l: &NetLinks) -> Result<Vec<Option<Vec<TcpStream>>>> {
    const NEW: &str = "Communicator::new";
    let (me, qps) = (l.rank, l.qps);
    let deadline = Instant::now() + l.timeout;
    let mut conns: Vec<Option<Vec<Option<TcpStream>>>> = l.peers.iter().map(|p| p.map(|_| (0..qps).map(|_| None).collect())).collect();
    let io = |peer: usize, what: String| Error::Remote { op: NEW, peer, what };
    for (q, p) in l.peers.iter().enumerate().skip(me + 1) {
        let Some((addr, secret)) = p else { continue };
        for c in 0..qps {
            let t = left(deadline, l, || format!("connecting to rank {q} at {addr}"))?;
            let mut s = TcpStream::connect_timeout(addr, t).map_err(|e| io(q, format!("socket transport: connect to {addr}: {e}")))?;
            s.set_write_timeout(Some(t)).map_err(|e| Error::io(NEW, "setsockopt", e))?;
            s.write_all(&hello(l.comm_id, me, c, secret)).map_err(|e| io(q, format!("socket transport: handshake to {addr}: {e}")))?;
            conns[q].as_mut().expect("remote peer")[c] = Some(s);
        }
    }
    let expected = l.peers.iter().take(me).flatten().count() * qps;
    l.listener.set_nonblocking(true).map_err(|e| Error::io(NEW, "fcntl", e))?;
    let mut accepted = 0;
    while accepted < expected {
        let missing = || {
            let m: Vec<usize> = (0..me).filter(|q| conns[*q].as_ref().is_some_and(|v| v.iter().any(Option::is_none))).collect();
            format!("ranks {m:?} did not connect")
        };
        let t = left(deadline, l, missing)?;
        let (mut s, from) = match l.listener.accept() {
            Ok(x) => x,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Err(e) => return Err(Error::io(NEW, "accept", e)),
        };
        let _ = s.set_nonblocking(false);
        let _ = s.set_read_timeout(Some(t));
        let _ = s.set_write_timeout(Some(t));
        let mut b = [0u8; HDR];
        let who = s.read_exact(&mut b).ok().and_then(|_| parse_hello(&b));
        let ok = who.filter(|(c, comm, r, secret)| {
            *comm == l.comm_id && *r < me && *c < qps && crate::bootstrap::tcp::same_secret(secret, &l.secret) && conns[*r].as_ref().is_some_and(|v| v[*c].is_none())
        });
        let Some((c, _, r, _)) = ok else {
            log::warn!("rank {me}: socket transport: refused a connection from {from} (not a rank of this communicator, or a duplicate)");
            continue;
        };
        let (_, their) = l.peers[r].expect("checked remote");
        s.write_all(&hello(l.comm_id, me, c, &their)).map_err(|e| io(r, format!("socket transport: handshake reply: {e}")))?;
        conns[r].as_mut().expect("checked remote")[c] = Some(s);
        accepted += 1;
    }
    for (q, p) in l.peers.iter().enumerate().skip(me + 1) {
        let Some((addr, _)) = p else { continue };
        for c in 0..qps {
            let t = left(deadline, l, || format!("waiting for rank {q}'s handshake"))?;
            let s = conns[q].as_mut().and_then(|v| v[c].as_mut()).expect("connected above");
            s.set_read_timeout(Some(t)).map_err(|e| Error::io(NEW, "setsockopt", e))?;
            let mut b = [0u8; HDR];
            s.read_exact(&mut b).map_err(|e| io(q, format!("socket transport: no handshake reply from {addr}: {e}")))?;
            match parse_hello(&b) {
                Some((cc, comm, r, secret)) if cc == c && comm == l.comm_id && r == q && crate::bootstrap::tcp::same_secret(&secret, &l.secret) => {}
                _ => return Err(io(q, format!("socket transport: {addr} answered with a bad handshake (another communicator's rank?)"))),
            }
        }
    }
    let mut out = Vec::with_capacity(conns.len());
    for v in conns {
        out.push(match v {
            None => None,
            Some(v) => Some(
                v.into_iter()
                    .map(|s| {
                        let s = s.expect("every connection made");
                        s.set_nonblocking(true).and_then(|_| s.set_nodelay(true)).map_err(|e| Error::io(NEW, "setsockopt", e))?;
                        Ok(s)
                    })
                    .collect::<Result<Vec<_>>>()?,
            ),
        });
    }
    Ok(out)
}

/// Listen for this rank's peers of other nodes: on loopback when every rank shares this
/// host, otherwise on the interface `ifname` picks (as the TCP bootstrap does); with a
/// fresh secret.
pub fn listen(all_on_this_host: bool, ifname: Option<&str>) -> Result<(TcpListener, [u8; 16])> {
    const NEW: &str = "Communicator::new";
    let ip = if all_on_this_host {
        std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)
    } else {
        let (ip, _) = crate::bootstrap::tcp::pick_interface(ifname).map_err(|e| e.with_op(NEW))?;
        if ip.is_loopback() {
            return Err(Error::invalid_arg(NEW, "ranks span several hosts but the socket transport found only a loopback interface (set HOCCL_SOCKET_IFNAME)"));
        }
        ip
    };
    let listener = TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| Error::io(NEW, "bind", e))?;
    let mut secret = [0u8; 16];
    crate::bootstrap::tcp::fill_random(&mut secret)?;
    Ok((listener, secret))
}
