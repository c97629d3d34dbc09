//! The socket transport: ranks of other nodes over TCP. Several connections per peer
//! (`HOCCL_QPS_PER_PEER`), non-blocking, driven from the proxy's turns; nothing here waits
//! once the connections are up.
//!
//! **Wire format.** Every frame is a 48-byte header ([`HDR`]), then, for data, its payload
//! and an 8-byte trailer: `kind | k | pair_seq | a | token | offset | payload length`,
//! little-endian. The trailer says whether the payload is the data ([`INTACT`]) or filler
//! for a transfer cancelled while its frame was being written, whose receiver then drops
//! the transfer: a frame cannot be cut short without losing the stream's framing. Kinds:
//! `Ready` (a receive buffer: `a` its length, `token` its name at the receiver), `Failed`
//! (`a` the error code), `Data` (`payload` bytes at `offset` of the buffer `token`; `a` the
//! transfer's total length), `Done` (the receiver has every byte of `token`), `Bye` (the
//! sender's communicator closed). Control frames (all but `Data`) go on the peer's first
//! connection, in the order they were posted; a transfer's data is cut into chunks (at most
//! [`CHUNK`] bytes, and at most what the receiver published it takes in one piece: its
//! staging slot) that go on whichever connection is free, so its chunks travel in parallel
//! and may arrive out of order (each names its offset).
//!
//! **Landing.** The receiver counts a transfer's bytes; when all have arrived it reports
//! `Landed` to its own engine (through `poll_signals`, as if the sender had signalled it:
//! the bytes on the other connections cannot be overtaken that way) and sends `Done` back;
//! the sender reports the flow done at `Done`. While a long transfer's chunks keep arriving
//! the receiver reports `Progress` to its engine at most every [`PROGRESS_EVERY`].
//!
//! **Memory.** The host backend's device memory is host memory: the bytes go from the
//! sender's buffer into the socket and from the socket into the receiver's buffer, with no
//! copy in between ([`raw`]). On CUDA they pass through host staging ([`Staging`]: pinned
//! memory, `HOCCL_NET_STAGING` bytes allocated once per communicator, half for sending and
//! half for receiving, in slots of one chunk): the sender's copy queue fills a slot from
//! the user's buffer (device to host) and the chunk goes on the wire once the copy's fence
//! has completed; the receiver reads a payload into a free slot and its copy queue drains
//! the slot into the user's buffer (host to device); the bytes count as landed when that
//! copy's fence has completed. Every free slot is in use at once, so the copy of one chunk
//! overlaps the socket I/O of the others. Nothing is allocated per chunk: frame headers
//! live in the connections, control frames and staged chunks in queues that keep their
//! capacity.
//!
//! **Rate limit.** `HOCCL_NET_GBPS` caps this rank's payload bytes per second in each
//! direction with a token bucket ([`Bucket`]): a limit inside the transport, for measuring
//! with several virtual nodes on one host, not Linux traffic control.
//!
//! **Health.** A connection that closes or fails makes the peer gone: its flows fail (the
//! error names the rank) and `peer_health` says why, so the engine fails the ops that wait
//! on it. A peer that closed its communicator says `Bye` first.
mod raw;

use crate::device::{Allocation, DevPtr, Device};
use crate::transport::fair::Fair;
use crate::transport::host_staging::HostStaging;
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
/// A data frame's trailer: its payload is the data.
const INTACT: u64 = 0x1a7d_0000_0000_0001;
/// A data frame's trailer: its payload is filler (the transfer was cancelled).
const CANCELLED: u64 = 0x1a7d_0000_0000_0002;
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

/// The least a rate-limited transfer moves at once (unless less is left).
const QUANTUM: usize = 64 << 10;

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

    /// How many of `want` bytes may move now: 0 while the bucket holds less than
    /// [`QUANTUM`] (or `want`), so a caller that loops until it gets 0 stops instead of
    /// spinning on the trickle that refills while it runs.
    pub fn grant(&mut self, want: usize) -> usize {
        let Some(rate) = self.rate else { return want };
        let now = Instant::now();
        self.tokens = (self.tokens + now.duration_since(self.last).as_secs_f64() * rate).min(self.burst);
        self.last = now;
        let have = self.tokens.max(0.0) as usize;
        if have < want.min(QUANTUM) {
            return 0;
        }
        have.min(want)
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
    /// The staging slot the payload is in (returned to the free slots once it is sent).
    slot: Option<Span>,
    /// After a payload: [`INTACT`] or [`CANCELLED`], and its bytes sent.
    trailer: u64,
    trailer_sent: usize,
}

impl OutFrame {
    fn control(h: Header) -> OutFrame {
        OutFrame { hdr: h.encode(), hdr_sent: 0, src: None, at: 0, len: 0, sent: 0, seq: None, slot: None, trailer: INTACT, trailer_sent: 0 }
    }
}

/// Where a payload being read goes.
enum Sink {
    /// Its receive is gone (failed): read and dropped.
    Discard,
    /// Straight into the receive buffer (host backend).
    Direct(Span),
    /// Into a staging slot (taken when the first byte is read; a payload fits one), `filled`
    /// bytes of it so far; drained to `dst` (the payload's place in the receive buffer)
    /// once the trailer says the payload is intact.
    Staged { dst: DevPtr, slot: Option<Span>, filled: usize },
}

/// What a connection is reading.
enum InState {
    Header { buf: [u8; HDR], got: usize },
    /// A data frame's payload for receive `token`: `left` bytes to read, the next of them
    /// at offset `at` of the receive buffer.
    Payload { token: u64, sink: Sink, at: usize, left: usize, len: usize },
    /// A payload's trailer: `bytes` of receive `token` read into `sink`, `got` bytes of the
    /// trailer so far.
    Trailer { token: u64, sink: Sink, bytes: usize, buf: [u8; 8], got: usize },
}

struct Conn {
    sock: TcpStream,
    fd: RawFd,
    out: Option<OutFrame>,
    inp: InState,
    /// The peer closed this connection's sending side between frames. Only the first
    /// connection's end makes the peer gone: it carries the control frames, so the peer's
    /// last `Done` and its `Bye` are read before its end, whatever order the connections'
    /// ends arrive in.
    ended: bool,
}

impl Conn {
    fn new(sock: TcpStream) -> Conn {
        let fd = sock.as_raw_fd();
        Conn { sock, fd, out: None, inp: InState::Header { buf: [0; HDR], got: 0 }, ended: false }
    }
}

/// A send with chunks left to put on the wire (or, staged, to copy into staging).
struct OutFlow {
    id: FlowId,
    tag: Tag,
    token: u64,
    src: DevPtr,
    /// `src` as host memory (direct I/O; None when staged).
    span: Option<Span>,
    len: usize,
    /// Bytes handed on so far.
    next: usize,
}

/// A receive buffer exposed to a peer, by token.
struct Slot {
    /// The rank whose send lands here (the one its signals name).
    peer: usize,
    /// A receive this rank lands for another rank of its node (`relay`): its landing goes
    /// to [`Transport::take_relay_landings`], not to this rank's engine.
    relayed: bool,
    /// The op it belongs to (what an error about it names).
    seq: u64,
    ptr: DevPtr,
    len: usize,
    /// The buffer as host memory (direct I/O; None when staged).
    span: Option<Span>,
    /// The transfer it was announced for (set by `post_ready`).
    pair_seq: Option<u64>,
    /// The transfer's index and total length, from its first data frame.
    k: u32,
    total: Option<u64>,
    /// Bytes in place (read, and drained when staged).
    received: u64,
    told: Instant,
}

/// Everything about one peer of another node.
struct Peer {
    conns: Vec<Conn>,
    /// Control frames not yet begun, in order (they go on `conns[0]`).
    ctrl: VecDeque<Header>,
    flows: VecDeque<OutFlow>,
    /// Chunks in staging, ready for the wire, in order.
    staged: VecDeque<OutFrame>,
    /// Flows whose every chunk is on its way, waiting for the receiver's `Done`, by token.
    awaiting: HashMap<u64, FlowId>,
    /// The connection the next data chunk goes on first (round robin).
    next_conn: usize,
    /// Payload bytes of one data frame to this peer at most.
    chunk: usize,
    bye: bool,
    gone: Option<String>,
}

/// Host staging and the copy queue that fills and drains it (CUDA: device memory is not
/// host memory).
pub struct Staging {
    host: HostStaging,
    /// Receive slots from here.
    split: DevPtr,
    slot: usize,
    send_free: Vec<Span>,
    recv_free: Vec<Span>,
    /// Device-to-host copies in flight: (fence ticket, peer, the frame they fill).
    filling: VecDeque<(u64, usize, OutFrame)>,
    /// Host-to-device copies in flight: (fence ticket, peer, receive token, bytes, slot).
    draining: VecDeque<(u64, usize, u64, u64, Span)>,
    /// Ops cancelled while their chunks were being copied into staging.
    cancelled: Vec<u64>,
    /// The copy queue failed: copies it had may still write the staging.
    broken: bool,
}

impl Staging {
    /// `bytes` of host staging on `dev` (at least four slots), with one copy queue; made
    /// on the proxy thread.
    pub fn new(dev: Arc<dyn Device>, bytes: usize) -> Result<Staging> {
        let host = HostStaging::new(dev, bytes, slot_bytes(bytes))?;
        let (n, slot) = (host.n, host.slot);
        let span = |i: usize| Span::staging(host.slot_ptr(i), slot);
        Ok(Staging {
            split: host.slot_ptr(n),
            slot,
            send_free: (0..n).map(span).collect(),
            recv_free: (n..2 * n).map(span).collect(),
            filling: VecDeque::with_capacity(n),
            draining: VecDeque::with_capacity(n),
            cancelled: Vec::new(),
            broken: false,
            host,
        })
    }

    fn busy(&self) -> bool {
        !self.filling.is_empty() || !self.draining.is_empty()
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // Copies may still land in it: then it stays allocated rather than freed under them.
        self.host.release("socket transport", self.filling.len() + self.draining.len(), self.broken);
    }
}

/// What a rank of another node published: where it listens, the secret its connections
/// must present, and the largest data frame payload it takes.
#[derive(Clone, Copy, Debug)]
pub struct Remote {
    pub addr: SocketAddr,
    pub secret: [u8; 16],
    pub max_chunk: usize,
}

/// The largest data payload a rank takes in one piece: its staging slot when it stages
/// (`staging` bytes, from `HOCCL_NET_STAGING`), else [`CHUNK`].
pub fn max_chunk(staging: Option<usize>) -> usize {
    staging.map_or(CHUNK, slot_bytes)
}

/// The slot size of `bytes` of staging: four slots at least, each at most a chunk.
fn slot_bytes(bytes: usize) -> usize {
    (bytes / 4).clamp(4096, CHUNK)
}

/// What `connect` needs: this rank, the communicator, the listening socket and what every
/// rank published (its address and secret; None for the ranks of this node).
pub struct NetLinks {
    pub rank: usize,
    pub comm_id: u64,
    pub listener: TcpListener,
    pub peers: Vec<Option<Remote>>,
    /// This rank's own secret (what its peers must present).
    pub secret: [u8; 16],
    /// Connections per peer.
    pub qps: usize,
    /// `Config::net_gbps`.
    pub gbps: f64,
    /// Bytes of host staging (`Config::net_staging_bytes`), or None to read and write the
    /// user buffers directly (the host backend, whose device memory is host memory).
    pub staging: Option<usize>,
    /// Bounds the connection setup.
    pub timeout: Duration,
    /// By rank: its forwarding peer, whose connections may carry that rank's
    /// point-to-point sends to this one (`relay`); empty: none.
    pub forwarder_of: Vec<usize>,
}

pub struct Socket {
    dev: Arc<dyn Device>,
    rank: usize,
    peers: Vec<Option<Peer>>,
    /// Receive buffers exposed to the peers, by token (unique over every peer).
    slots: HashMap<u64, Slot>,
    forwarder_of: Vec<usize>,
    stage: Option<Staging>,
    next_token: u64,
    send_bucket: Bucket,
    recv_bucket: Bucket,
    /// Zeros to send in place of a cancelled flow's payload; a sink for discarded payloads.
    pad: Box<[u8]>,
    /// Results gathered while reading, handed out by `poll_signals` and `progress`.
    incoming: Vec<Incoming>,
    /// Landings and progress of relayed receives, by token (`take_relay_landings`).
    relay_landings: Vec<(u64, Signal)>,
    done: Vec<FlowId>,
    advanced: Vec<u64>,
    failed: VecDeque<(u64, Error)>,
    /// Staging slots whose frames went out, to return to the free list.
    freed: Vec<Span>,
    /// Peers found gone while reading or writing, with why.
    lost: Vec<(usize, String)>,
    /// The peer each pass over the peers starts at when writing, reading and filling send
    /// slots ([`Fair`]).
    out_first: Fair,
    in_first: Fair,
    fill_first: Fair,
    /// The connections `pump_in` polls, and (peer, connection) of each; kept to reuse
    /// their capacity.
    poll_fds: Vec<libc::pollfd>,
    poll_at: Vec<(usize, usize)>,
}

impl Socket {
    /// Open `qps` connections to every peer of another node, authenticated both ways, within
    /// `links.timeout`; the lower rank of each pair connects. Direct I/O needs the host
    /// backend; any other device needs `links.staging`.
    pub fn connect(dev: Arc<dyn Device>, links: NetLinks) -> Result<Socket> {
        let stage = match links.staging {
            Some(bytes) => Some(Staging::new(dev.clone(), bytes)?),
            None if dev.backend() == crate::device::Backend::Host => None,
            None => return Err(Error::invalid_usage(OP, "device memory that is not host memory needs host staging")),
        };
        let chunk = stage.as_ref().map_or(CHUNK, |s| s.slot);
        let conns = establish(&links)?;
        let peers = conns.into_iter().zip(&links.peers).map(|(c, remote)| {
            c.map(|conns| Peer {
                chunk: remote.map_or(chunk, |r| r.max_chunk.min(chunk)),
                conns: conns.into_iter().map(Conn::new).collect(),
                ctrl: VecDeque::with_capacity(64),
                flows: VecDeque::new(),
                staged: VecDeque::new(),
                awaiting: HashMap::new(),
                next_conn: 0,
                bye: false,
                gone: None,
            })
        });
        let peers: Vec<Option<Peer>> = peers.collect();
        log::info!(
            "rank {}: socket transport: {} connection(s) to each of {} rank(s) of other nodes, {}, rate {}",
            links.rank,
            links.qps,
            peers.iter().flatten().count(),
            stage.as_ref().map_or("direct I/O".to_string(), |s| format!("{} staging slots of {} KiB", s.send_free.len() + s.recv_free.len(), s.slot >> 10)),
            if links.gbps > 0.0 { format!("{} GB/s", links.gbps) } else { "unlimited".into() }
        );
        Ok(Socket {
            dev,
            rank: links.rank,
            peers,
            slots: HashMap::new(),
            forwarder_of: links.forwarder_of,
            stage,
            next_token: 1,
            send_bucket: Bucket::new(links.gbps),
            recv_bucket: Bucket::new(links.gbps),
            pad: vec![0u8; 64 << 10].into_boxed_slice(),
            incoming: Vec::new(),
            relay_landings: Vec::new(),
            done: Vec::new(),
            advanced: Vec::new(),
            failed: VecDeque::new(),
            freed: Vec::new(),
            lost: Vec::new(),
            out_first: Fair::new(links.rank),
            in_first: Fair::new(links.rank),
            fill_first: Fair::new(links.rank),
            poll_fds: Vec::new(),
            poll_at: Vec::new(),
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

    /// Queue the write of `len` bytes at `src` (in `alloc`, which direct I/O needs) to
    /// `peer`'s receive `remote`.
    #[allow(clippy::too_many_arguments)]
    fn write_from(&mut self, id: FlowId, peer: usize, tag: Tag, src: DevPtr, alloc: Option<Allocation>, remote: &RemoteBuffer, len: usize) -> Result<()> {
        let span = match self.stage {
            None => Some(Span::in_allocation(OP, src, len, alloc)?),
            Some(_) => None,
        };
        // The receiver's forwarding peer lands the bytes (`relay`): they go to it.
        let peer = match remote.wire.base {
            0 => peer,
            // Only the receiver's own forwarding peer may land its bytes.
            via => usize::try_from(via - 1)
                .ok()
                .filter(|v| self.reaches(*v) && self.forwarder_of.get(peer) == Some(v))
                .ok_or_else(|| Error::Remote { op: OP, peer, what: format!("named rank {} to land its receive, which is not its forwarding peer (corrupt Ready)", via - 1) })?,
        };
        let p = self.peer(peer)?;
        if let Some(why) = &p.gone {
            return Err(Error::Remote { op: OP, peer, what: why.clone() });
        }
        p.flows.push_back(OutFlow { id, tag, token: remote.wire.alloc_id, src, span, len, next: 0 });
        Ok(())
    }

    /// Open receive `region` from `peer` under a new token: this rank's own (`relayed`
    /// None), or, for a rank of this node it lands it for, transfer `relayed`.
    fn open_receive(&mut self, peer: usize, region: Region, relayed: Option<Tag>) -> Result<u64> {
        let span = match self.stage {
            None => Some(Span::in_allocation(OP, region.ptr, region.len, region.alloc)?),
            // The copy queue's driver checks device memory.
            Some(_) => None,
        };
        let p = self.peer(peer)?;
        if let Some(why) = &p.gone {
            return Err(Error::Remote { op: OP, peer, what: why.clone() });
        }
        let token = self.next_token;
        self.next_token += 1;
        let (pair_seq, k) = relayed.map_or((None, 0), |t| (Some(t.pair_seq), t.k));
        let slot = Slot { peer, relayed: relayed.is_some(), seq: region.seq, ptr: region.ptr, len: region.len, span, pair_seq, k, total: None, received: 0, told: Instant::now() };
        self.slots.insert(token, slot);
        Ok(token)
    }

    /// Payloads being read for the receives `dropped` (of `peer`, already forgotten) are
    /// read and dropped instead: their buffers may be freed. They may come on the peer's
    /// connections or its forwarding peer's.
    fn discard_payloads(&mut self, peer: usize, dropped: &[u64]) {
        let writers = [Some(peer), self.forwarder_of.get(peer).copied()];
        for w in writers.into_iter().flatten() {
            let Some(p) = self.peers.get_mut(w).and_then(Option::as_mut) else { continue };
            for c in &mut p.conns {
                if let InState::Payload { token, sink, .. } | InState::Trailer { token, sink, .. } = &mut c.inp {
                    if dropped.contains(token) {
                        if let Sink::Staged { slot: Some(s), .. } = std::mem::replace(sink, Sink::Discard) {
                            self.freed.push(s);
                        }
                    }
                }
            }
        }
        self.settle();
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
        let mut seqs: Vec<u64> = p.flows.drain(..).map(|f| f.id.seq).chain(p.awaiting.drain().map(|(_, id)| id.seq)).collect();
        for f in p.staged.drain(..) {
            seqs.extend(f.seq);
            self.freed.extend(f.slot);
        }
        seqs.sort_unstable();
        seqs.dedup();
        for seq in seqs {
            self.failed.push_back((seq, Error::Remote { op: OP, peer: i, what: why.clone() }));
        }
        self.slots.retain(|_, s| s.peer != i);
        p.ctrl.clear();
        for c in &mut p.conns {
            if let Some(f) = c.out.take() {
                self.freed.extend(f.slot);
            }
            if let InState::Payload { sink: Sink::Staged { slot: Some(s), .. }, .. } | InState::Trailer { sink: Sink::Staged { slot: Some(s), .. }, .. } = c.inp {
                self.freed.push(s);
            }
            c.inp = InState::Header { buf: [0; HDR], got: 0 };
            let _ = c.sock.shutdown(std::net::Shutdown::Both);
        }
        p.gone = Some(why);
    }

    /// Handle the peers found gone and the staging slots freed since the last call.
    fn settle(&mut self) {
        for (i, why) in std::mem::take(&mut self.lost) {
            self.mark_gone(i, why);
        }
        match self.stage.as_mut() {
            Some(st) => {
                for s in self.freed.drain(..) {
                    if s.ptr().0 < st.split.0 {
                        st.send_free.push(s);
                    } else {
                        st.recv_free.push(s);
                    }
                }
            }
            None => self.freed.clear(),
        }
    }

    /// Staged: copy the next chunks of the peers' flows into free send slots, and reap the
    /// copies that completed (filled slots go to their peer's wire queue; drained receive
    /// slots count their bytes as landed). Whether anything moved.
    fn stage_work(&mut self) -> bool {
        let Some(st) = self.stage.as_mut() else { return false };
        let mut moved = false;
        // Fill: one chunk per peer per pass, while slots last.
        let mut progress = true;
        while progress && !st.send_free.is_empty() {
            progress = false;
            for i in self.fill_first.order(self.peers.len()) {
                let Some(p) = self.peers[i].as_mut().filter(|p| p.gone.is_none()) else { continue };
                let Some(f) = p.flows.front_mut() else { continue };
                let n = (f.len - f.next).min(p.chunk);
                let mut h = Header::new(Kind::Data, f.tag.pair_seq, f.tag.k);
                (h.a, h.token, h.offset, h.payload) = (f.len as u64, f.token, f.next as u64, n as u64);
                let seq = f.id.seq;
                if n == 0 {
                    p.staged.push_back(OutFrame { seq: Some(seq), ..OutFrame::control(h) });
                } else {
                    let Some(slot) = st.send_free.pop() else { break };
                    let r = st.host.queue.copy(slot.ptr(), f.src.add(f.next), n).and_then(|_| st.host.queue.fence());
                    match r {
                        Ok(ticket) => {
                            let frame = OutFrame { src: Some(slot), len: n, seq: Some(seq), slot: Some(slot), ..OutFrame::control(h) };
                            st.filling.push_back((ticket, i, frame));
                        }
                        Err(e) => {
                            st.send_free.push(slot);
                            p.flows.pop_front();
                            self.failed.push_back((seq, e));
                            continue;
                        }
                    }
                }
                f.next += n;
                if f.next == f.len {
                    let f = p.flows.pop_front().expect("front exists");
                    p.awaiting.insert(f.token, f.id);
                }
                self.fill_first.moved(i);
                moved = true;
                progress = true;
                if st.send_free.is_empty() {
                    break;
                }
            }
        }
        if !st.busy() {
            return moved;
        }
        let done = match st.host.queue.completed() {
            Ok(t) => t,
            Err(e) => {
                // The queue is broken: every op with a copy on it fails, and those copies'
                // slots are not used again (the device may still write them).
                st.broken = true;
                let filling = std::mem::take(&mut st.filling).into_iter().filter_map(|(_, _, f)| f.seq);
                let slots = &mut self.slots;
                let draining = std::mem::take(&mut st.draining).into_iter().filter_map(|(_, _, tok, _, _)| slots.remove(&tok).map(|s| s.seq));
                let mut seqs: Vec<u64> = filling.chain(draining).collect();
                seqs.sort_unstable();
                seqs.dedup();
                for seq in seqs {
                    self.failed.push_back((seq, e.clone()));
                }
                return true;
            }
        };
        while st.filling.front().is_some_and(|(t, _, _)| *t <= done) {
            let (_, i, f) = st.filling.pop_front().expect("front exists");
            moved = true;
            let dropped = f.seq.is_some_and(|s| st.cancelled.contains(&s));
            match self.peers[i].as_mut().filter(|p| p.gone.is_none()) {
                Some(p) if !dropped => p.staged.push_back(f),
                _ => st.send_free.extend(f.slot),
            }
        }
        if st.filling.is_empty() {
            st.cancelled.clear();
        }
        while st.draining.front().is_some_and(|(t, ..)| *t <= done) {
            let (_, i, token, n, slot) = st.draining.pop_front().expect("front exists");
            moved = true;
            st.recv_free.push(slot);
            if let Some(p) = self.peers[i].as_mut().filter(|p| p.gone.is_none()) {
                landed(&mut self.slots, p, token, n, &mut self.incoming, &mut self.relay_landings);
            }
        }
        moved
    }

    /// Write on every connection of every peer; whether a byte moved.
    fn pump_out(&mut self) -> bool {
        let mut any = false;
        let staged = self.stage.is_some();
        let mut last = None;
        for i in self.out_first.order(self.peers.len()) {
            let Some(p) = self.peers[i].as_mut().filter(|p| p.gone.is_none()) else { continue };
            let n = p.conns.len();
            let first = p.next_conn;
            p.next_conn = (first + 1) % n.max(1);
            for j in 0..n {
                let c = (first + j) % n;
                let mut w = Writer { peer: p, staged, bucket: &mut self.send_bucket, pad: &self.pad, advanced: &mut self.advanced, freed: &mut self.freed };
                match w.write_conn(c) {
                    Ok(moved) => {
                        any |= moved;
                        last = if moved { Some(i) } else { last };
                    }
                    Err(e) => {
                        self.lost.push((i, format!("connection {c} failed: {e}")));
                        break;
                    }
                }
            }
        }
        if let Some(i) = last {
            self.out_first.moved(i);
        }
        self.settle();
        any
    }

    /// Read every connection that has bytes, an end or an error to read; whether a byte
    /// moved.
    fn pump_in(&mut self) -> bool {
        let mut any = false;
        let mut last = None;
        // One poll tells which connections have bytes, an end or an error to read: a read
        // on each would mostly find nothing, and those calls are most of an idle turn's
        // cost with many peers.
        self.poll_fds.clear();
        self.poll_at.clear();
        for i in self.in_first.order(self.peers.len()) {
            let Some(p) = self.peers[i].as_ref().filter(|p| p.gone.is_none()) else { continue };
            for (c, conn) in p.conns.iter().enumerate().filter(|(_, conn)| !conn.ended) {
                self.poll_fds.push(raw::poll_in(conn.fd));
                self.poll_at.push((i, c));
            }
        }
        // Should the poll fail (an interrupt), every connection is read, as without it.
        let every = raw::readable(&mut self.poll_fds).is_err();
        let mut failed = None;
        for k in 0..self.poll_at.len() {
            let (i, c) = self.poll_at[k];
            if (!every && self.poll_fds[k].revents == 0) || failed == Some(i) {
                continue;
            }
            let Some(p) = self.peers[i].as_mut().filter(|p| p.gone.is_none()) else { continue };
            let mut r = Reader {
                from: i,
                peer: p,
                slots: &mut self.slots,
                forwarder_of: &self.forwarder_of,
                stage: self.stage.as_mut(),
                bucket: &mut self.recv_bucket,
                pad: &mut self.pad,
                incoming: &mut self.incoming,
                relay_landings: &mut self.relay_landings,
                done: &mut self.done,
                advanced: &mut self.advanced,
                failed: &mut self.failed,
            };
            match r.read_conn(c) {
                Ok(moved) => {
                    any |= moved;
                    last = if moved { Some(i) } else { last };
                }
                Err(why) => {
                    self.lost.push((i, why));
                    failed = Some(i);
                }
            }
        }
        if let Some(i) = last {
            self.in_first.moved(i);
        }
        self.settle();
        any
    }
}

/// `n` more bytes of receive `token` are in place, carried by `writer` (the peer whose
/// send it is, or that peer's forwarding peer); when it has all its bytes, report `Landed`
/// to this rank's engine (from the peer whose send it is) and queue `Done` to the writer.
fn landed(slots: &mut HashMap<u64, Slot>, writer: &mut Peer, token: u64, n: u64, incoming: &mut Vec<Incoming>, relayed: &mut Vec<(u64, Signal)>) {
    let Some(slot) = slots.get_mut(&token) else { return };
    slot.received += n;
    let Some(total) = slot.total else { return };
    let (from, pair_seq, k, relay) = (slot.peer, slot.pair_seq.unwrap_or(0), slot.k, slot.relayed);
    let mut tell = |signal: Signal| {
        if relay {
            relayed.push((token, signal));
        } else {
            incoming.push(Incoming { from, pair_seq, signal });
        }
    };
    if slot.received < total {
        if n > 0 && slot.told.elapsed() >= PROGRESS_EVERY {
            slot.told = Instant::now();
            tell(Signal::Progress { k });
        }
        return;
    }
    slots.remove(&token);
    tell(Signal::Landed { k, len: total });
    let mut d = Header::new(Kind::Done, pair_seq, k);
    (d.a, d.token) = (total, token);
    writer.ctrl.push_back(d);
}

impl Transport for Socket {
    fn expose(&mut self, peer: usize, region: Region) -> Result<RemoteBuffer> {
        let token = self.open_receive(peer, region, None)?;
        let wire = Wire { alloc_id: token, ..Wire::empty(std::process::id()) };
        Ok(RemoteBuffer { len: region.len as u64, wire })
    }

    fn post_ready(&mut self, peer: usize, tag: Tag, remote: RemoteBuffer) {
        // A buffer another rank lands (`wire.base` = 1 + that rank) has its token there.
        if let Some(slot) = self.slots.get_mut(&remote.wire.alloc_id).filter(|s| s.peer == peer && remote.wire.base == 0) {
            slot.pair_seq = Some(tag.pair_seq);
        }
        let mut h = Header::new(Kind::Ready, tag.pair_seq, tag.k);
        (h.a, h.token, h.offset) = (remote.len, remote.wire.alloc_id, remote.wire.base);
        self.post(peer, h);
    }

    fn signal_failure(&mut self, peer: usize, pair_seq: u64, code: u32) {
        // The op's receives from `peer` are over: data still coming for them is dropped,
        // the payloads being read included (their buffers may be freed once the op failed).
        let mut dropped = Vec::new();
        self.slots.retain(|t, s| {
            let keep = s.relayed || s.peer != peer || s.pair_seq != Some(pair_seq);
            if !keep {
                dropped.push(*t);
            }
            keep
        });
        self.discard_payloads(peer, &dropped);
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
        let alloc = match self.stage {
            None if len > 0 => Some(self.dev.allocation(src)?),
            _ => None,
        };
        self.write_from(id, peer, tag, src, alloc, remote, len)
    }

    fn start_write_mapped(&mut self, id: FlowId, peer: usize, tag: Tag, src: DevPtr, src_alloc: Allocation, remote: &RemoteBuffer, len: usize) -> Result<()> {
        self.write_from(id, peer, tag, src, Some(src_alloc), remote, len)
    }

    fn expose_relayed(&mut self, peer: usize, tag: Tag, region: Region) -> Result<u64> {
        self.open_receive(peer, region, Some(tag))
    }

    fn take_relay_landings(&mut self, out: &mut Vec<(u64, Signal)>) {
        out.append(&mut self.relay_landings);
    }

    fn forget_receive(&mut self, token: u64) {
        if let Some(s) = self.slots.remove(&token) {
            self.discard_payloads(s.peer, &[token]);
        }
    }

    fn progress(&mut self, done: &mut Vec<FlowId>, advanced: &mut Vec<u64>) -> std::result::Result<bool, (u64, Error)> {
        let mut moved = self.stage_work();
        moved |= self.pump_out();
        moved |= self.pump_in();
        moved |= self.stage_work();
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
        let mut freed = Vec::new();
        for p in self.peers.iter_mut().flatten() {
            p.flows.retain(|f| f.id.seq != seq);
            p.awaiting.retain(|_, id| id.seq != seq);
            p.staged.retain(|f| {
                let keep = f.seq != Some(seq);
                if !keep {
                    freed.extend(f.slot);
                }
                keep
            });
            // A frame begun must be finished for the stream to stay framed; the rest of its
            // payload is zeros, not the op's memory (which may be freed once it failed).
            for c in &mut p.conns {
                if let Some(f) = c.out.as_mut().filter(|f| f.seq == Some(seq)) {
                    f.src = None;
                }
            }
        }
        if let Some(st) = self.stage.as_mut() {
            if st.filling.iter().any(|(_, _, f)| f.seq == Some(seq)) {
                st.cancelled.push(seq);
            }
        }
        self.freed.extend(freed);
        self.settle();
    }

    fn peer_health(&self, peer: usize) -> Option<String> {
        self.peers.get(peer)?.as_ref()?.gone.clone()
    }

    fn data_in_flight(&self) -> bool {
        self.stage.as_ref().is_some_and(Staging::busy)
            || self.peers.iter().flatten().filter(|p| p.gone.is_none()).any(|p| {
                !p.flows.is_empty()
                    || !p.staged.is_empty()
                    || !p.awaiting.is_empty()
                    || p.conns.iter().any(|c| c.out.as_ref().is_some_and(|f| f.seq.is_some()) || matches!(c.inp, InState::Payload { .. } | InState::Trailer { .. }))
            })
    }

    fn signals_queued(&self) -> bool {
        self.peers.iter().flatten().filter(|p| p.gone.is_none()).any(|p| !p.ctrl.is_empty() || p.conns.first().is_some_and(|c| c.out.as_ref().is_some_and(|f| f.seq.is_none())))
    }

    fn describe(&self) -> String {
        let live = self.peers.iter().flatten().filter(|p| p.gone.is_none());
        let (mut flows, mut awaiting, mut ctrl, slots) = (0, 0, 0, self.slots.len());
        for p in live {
            (flows, awaiting, ctrl) = (flows + p.flows.len() + p.staged.len(), awaiting + p.awaiting.len(), ctrl + p.ctrl.len());
        }
        let staging = self.stage.as_ref().map_or(String::new(), |s| format!(", staging: {} copies in, {} out", s.filling.len(), s.draining.len()));
        let gone: Vec<usize> = (0..self.peers.len()).filter(|i| self.peer_health(*i).is_some()).collect();
        format!("sockets: {flows} sends with chunks to go, {awaiting} waiting for their receivers' Done, {slots} receives open, {ctrl} signals queued out{staging}, ranks gone {gone:?}")
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
        // Copies still in flight (a forced exit) keep the staging allocated (`Staging::drop`).
        let mut t = Instant::now();
        while self.stage.as_ref().is_some_and(Staging::busy) && t0.elapsed() < CLOSE_FLUSH {
            self.stage_work();
            if t.elapsed() > Duration::from_millis(1) {
                std::thread::sleep(Duration::from_micros(100));
                t = Instant::now();
            }
        }
        self.stage = None;
    }
}

/// How long `close` tries to send the last signals, and then waits for the peers to close.
const CLOSE_FLUSH: Duration = Duration::from_millis(200);

/// One non-blocking socket call's outcome: the bytes it moved (0 when interrupted: call
/// again), None when it would block; a call that moved nothing failed with `zero` (a read:
/// the peer closed; a write: it took nothing).
fn io_step(r: std::io::Result<usize>, zero: ErrorKind) -> std::io::Result<Option<usize>> {
    match r {
        Ok(0) => Err(zero.into()),
        Ok(n) => Ok(Some(n)),
        Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(None),
        Err(e) if e.kind() == ErrorKind::Interrupted => Ok(Some(0)),
        Err(e) => Err(e),
    }
}

/// Writes the connections of one peer.
struct Writer<'a> {
    peer: &'a mut Peer,
    /// Whether data frames come from staging (else straight from the flows).
    staged: bool,
    bucket: &'a mut Bucket,
    pad: &'a [u8],
    advanced: &'a mut Vec<u64>,
    freed: &'a mut Vec<Span>,
}

impl Writer<'_> {
    /// Fill connection `c` with frames and write what the socket takes; whether a byte
    /// moved. An error: the connection failed.
    fn write_conn(&mut self, c: usize) -> std::io::Result<bool> {
        let mut moved = 0usize;
        let p = &mut *self.peer;
        loop {
            if p.conns[c].out.is_none() {
                let frame = if c == 0 && !p.ctrl.is_empty() {
                    p.ctrl.pop_front().map(OutFrame::control)
                } else if c == 0 && p.conns.len() > 1 {
                    // The first connection carries the control frames alone when there are
                    // others: behind a data frame, a `Done` would wait for that frame's
                    // payload, written at this rank's rate shared by every peer.
                    None
                } else if self.staged {
                    p.staged.pop_front()
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
                let Some(n) = io_step((&conn.sock).write(&f.hdr[f.hdr_sent..]), ErrorKind::WriteZero)? else { return Ok(moved > 0) };
                f.hdr_sent += n;
                moved += n;
                continue;
            }
            if f.sent < f.len {
                if moved >= TURN_BYTES {
                    return Ok(true);
                }
                let want = self.bucket.grant(f.len - f.sent);
                if want == 0 {
                    return Ok(moved > 0);
                }
                let r = match f.src {
                    Some(src) => raw::send(conn.fd, src, f.at + f.sent, want),
                    None => (&conn.sock).write(&self.pad[..want.min(self.pad.len())]),
                };
                let Some(n) = io_step(r, ErrorKind::WriteZero)? else { return Ok(moved > 0) };
                self.bucket.spend(n);
                f.sent += n;
                moved += n;
                continue;
            }
            if f.len > 0 && f.trailer_sent < 8 {
                let t = if f.src.is_some() { f.trailer } else { CANCELLED }.to_le_bytes();
                let Some(n) = io_step((&conn.sock).write(&t[f.trailer_sent..]), ErrorKind::WriteZero)? else { return Ok(moved > 0) };
                f.trailer_sent += n;
                moved += n;
                continue;
            }
            if let Some(seq) = f.seq {
                if self.advanced.last() != Some(&seq) {
                    self.advanced.push(seq);
                }
            }
            self.freed.extend(f.slot);
            conn.out = None;
        }
    }
}

/// The next data frame of `p`'s flows straight from their memory (the first flow's next
/// chunk); a flow whose last chunk goes out moves to `awaiting`.
fn next_chunk(p: &mut Peer) -> Option<OutFrame> {
    let f = p.flows.front_mut()?;
    let n = (f.len - f.next).min(p.chunk);
    let mut h = Header::new(Kind::Data, f.tag.pair_seq, f.tag.k);
    (h.a, h.token, h.offset, h.payload) = (f.len as u64, f.token, f.next as u64, n as u64);
    let frame = OutFrame { src: f.span, at: f.next, len: n, seq: Some(f.id.seq), ..OutFrame::control(h) };
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
    slots: &'a mut HashMap<u64, Slot>,
    /// `Socket::forwarder_of`: a slot's data may come from its peer's forwarding peer.
    forwarder_of: &'a [usize],
    stage: Option<&'a mut Staging>,
    bucket: &'a mut Bucket,
    pad: &'a mut [u8],
    incoming: &'a mut Vec<Incoming>,
    relay_landings: &'a mut Vec<(u64, Signal)>,
    done: &'a mut Vec<FlowId>,
    advanced: &'a mut Vec<u64>,
    failed: &'a mut VecDeque<(u64, Error)>,
}

impl Reader<'_> {
    /// Read what connection `c` has; whether a byte moved. An error: why the peer is gone.
    fn read_conn(&mut self, c: usize) -> std::result::Result<bool, String> {
        let mut moved = 0usize;
        // Why the peer is gone, from a failed read (end of stream: it closed).
        let gone = |bye: bool, e: std::io::Error| match e.kind() {
            ErrorKind::UnexpectedEof if bye => "its communicator was destroyed or aborted".to_string(),
            ErrorKind::UnexpectedEof => format!("connection {c} closed (its process exited or the network failed)"),
            _ => format!("connection {c} failed: {e}"),
        };
        loop {
            if moved >= TURN_BYTES {
                return Ok(true);
            }
            let bye = self.peer.bye;
            let conn = &mut self.peer.conns[c];
            if conn.ended {
                return Ok(moved > 0);
            }
            match &mut conn.inp {
                InState::Header { buf, got } => {
                    let r = io_step((&conn.sock).read(&mut buf[*got..]), ErrorKind::UnexpectedEof);
                    if c > 0 && *got == 0 && r.as_ref().is_err_and(|e| e.kind() == ErrorKind::UnexpectedEof) {
                        conn.ended = true;
                        return Ok(true);
                    }
                    let Some(n) = r.map_err(|e| gone(bye, e))? else { return Ok(moved > 0) };
                    *got += n;
                    moved += n;
                    if *got < HDR {
                        continue;
                    }
                    let h = Header::decode(buf).ok_or_else(|| format!("connection {c} carried a malformed frame header"))?;
                    conn.inp = InState::Header { buf: [0; HDR], got: 0 };
                    self.frame(c, h)?;
                }
                InState::Payload { token, sink, at, left, len } => {
                    // Staged: a free slot first (none: wait for a drain to complete).
                    if let Sink::Staged { slot: slot @ None, filled, .. } = sink {
                        let Some(s) = self.stage.as_mut().and_then(|st| st.recv_free.pop()) else { return Ok(moved > 0) };
                        (*slot, *filled) = (Some(s), 0);
                    }
                    let room = match sink {
                        Sink::Staged { slot: Some(s), filled, .. } => s.len() - *filled,
                        _ => usize::MAX,
                    };
                    let want = self.bucket.grant((*left).min(room));
                    if want == 0 {
                        return Ok(moved > 0);
                    }
                    let r = match sink {
                        Sink::Direct(d) => raw::recv(conn.fd, *d, *at, want),
                        Sink::Staged { slot: Some(s), filled, .. } => raw::recv(conn.fd, *s, *filled, want),
                        _ => {
                            let n = want.min(self.pad.len());
                            (&conn.sock).read(&mut self.pad[..n])
                        }
                    };
                    let Some(n) = io_step(r, ErrorKind::UnexpectedEof).map_err(|e| gone(bye, e))? else { return Ok(moved > 0) };
                    self.bucket.spend(n);
                    moved += n;
                    *at += n;
                    *left -= n;
                    if let Sink::Staged { filled, .. } = sink {
                        *filled += n;
                    }
                    if *left == 0 {
                        let (token, bytes) = (*token, *len);
                        let sink = std::mem::replace(sink, Sink::Discard);
                        conn.inp = InState::Trailer { token, sink, bytes, buf: [0; 8], got: 0 };
                    }
                }
                InState::Trailer { token, sink, bytes, buf, got } => {
                    let Some(n) = io_step((&conn.sock).read(&mut buf[*got..]), ErrorKind::UnexpectedEof).map_err(|e| gone(bye, e))? else { return Ok(moved > 0) };
                    *got += n;
                    moved += n;
                    if *got < 8 {
                        continue;
                    }
                    let status = u64::from_le_bytes(*buf);
                    let (token, bytes) = (*token, *bytes);
                    let sink = std::mem::replace(sink, Sink::Discard);
                    conn.inp = InState::Header { buf: [0; HDR], got: 0 };
                    match (status, sink) {
                        (INTACT, Sink::Direct(_)) => landed(self.slots, self.peer, token, bytes as u64, self.incoming, self.relay_landings),
                        (INTACT, Sink::Staged { dst, slot: Some(s), filled }) => self.drain(token, dst, s, filled),
                        (INTACT | CANCELLED, Sink::Discard) => {}
                        (CANCELLED, sink) => {
                            // The sender cancelled the transfer: it never lands here.
                            self.slots.remove(&token);
                            if let (Sink::Staged { slot: Some(s), .. }, Some(st)) = (sink, self.stage.as_mut()) {
                                st.recv_free.push(s);
                            }
                        }
                        _ => return Err(format!("connection {c} carried a malformed frame trailer")),
                    }
                }
            }
        }
    }

    /// Copy a receive slot holding an intact payload into the buffer at `to` (staged); its
    /// bytes count once the copy's fence has completed (`Socket::stage_work`).
    fn drain(&mut self, token: u64, to: DevPtr, s: Span, bytes: usize) {
        let st = self.stage.as_mut().expect("staged receive");
        match st.host.queue.copy(to, s.ptr(), bytes).and_then(|_| st.host.queue.fence()) {
            Ok(ticket) => st.draining.push_back((ticket, self.from, token, bytes as u64, s)),
            Err(e) => {
                st.recv_free.push(s);
                if let Some(slot) = self.slots.remove(&token) {
                    self.failed.push_back((slot.seq, e));
                }
            }
        }
    }

    /// A whole header arrived on connection `c`.
    fn frame(&mut self, c: usize, h: Header) -> std::result::Result<(), String> {
        let from = self.from;
        let signal = match h.kind {
            // `offset`: 1 + the rank that lands the bytes for the receiver (`relay`), or 0.
            Kind::Ready => Signal::Ready { k: h.k, remote: RemoteBuffer { len: h.a, wire: Wire { alloc_id: h.token, base: h.offset, ..Wire::empty(0) } } },
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
                let Some(slot) = self.slots.get_mut(&h.token) else {
                    // Its receive failed and was forgotten: read the payload and drop it.
                    self.peer.conns[c].inp = InState::Payload { token: h.token, sink: Sink::Discard, at: 0, left: h.payload as usize, len: h.payload as usize };
                    return Ok(());
                };
                if slot.peer != from && self.forwarder_of.get(slot.peer) != Some(&from) {
                    return Err(format!("sent data for rank {}'s transfer, which it neither sends nor forwards (corrupt frame)", slot.peer));
                }
                let len = slot.len as u64;
                let end = h.offset.checked_add(h.payload);
                let max = self.stage.as_ref().map_or(CHUNK, |st| st.slot) as u64;
                if h.a > len || end.is_none_or(|e| e > h.a) || h.payload > max || slot.total.is_some_and(|t| t != h.a) {
                    return Err(format!("sent {} bytes at {} of a {}-byte transfer into a {len}-byte buffer (corrupt frame)", h.payload, h.offset, h.a));
                }
                (slot.total, slot.k, slot.pair_seq) = (Some(h.a), h.k, Some(h.pair_seq));
                if h.payload > 0 {
                    let sink = match slot.span {
                        Some(span) => Sink::Direct(span),
                        None => Sink::Staged { dst: slot.ptr.add(h.offset as usize), slot: None, filled: 0 },
                    };
                    self.peer.conns[c].inp = InState::Payload { token: h.token, sink, at: h.offset as usize, left: h.payload as usize, len: h.payload as usize };
                }
                // An empty transfer is complete at its header.
                landed(self.slots, self.peer, h.token, 0, self.incoming, self.relay_landings);
                return Ok(());
            }
        };
        self.incoming.push(Incoming { from, pair_seq: h.pair_seq, signal });
        Ok(())
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
        let Some(Remote { addr, secret, .. }) = p else { continue };
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
        let their = l.peers[r].expect("checked remote").secret;
        s.write_all(&hello(l.comm_id, me, c, &their)).map_err(|e| io(r, format!("socket transport: handshake reply: {e}")))?;
        conns[r].as_mut().expect("checked remote")[c] = Some(s);
        accepted += 1;
    }
    for (q, p) in l.peers.iter().enumerate().skip(me + 1) {
        let Some(Remote { addr, .. }) = p else { continue };
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::host::HostDevice;
    use crate::device::pattern_byte;

    /// Ranks 0 and 1 of communicator `comm`, connected over loopback, each staging through
    /// `staging[r]` bytes (None: direct I/O).
    fn pair(comm: u64, qps: usize, staging: [Option<usize>; 2], gbps: f64) -> (Arc<dyn Device>, Socket, Socket) {
        let (dev, mut v) = ranks(comm, qps, &staging, gbps, &[]);
        let t1 = v.pop().unwrap();
        (dev, v.pop().unwrap(), t1)
    }

    /// Ranks 0..staging.len() of communicator `comm`, each on a node of its own, connected
    /// over loopback, rank r staging through `staging[r]` bytes (None: direct I/O), with
    /// forwarding peers `fwd` (empty: none).
    fn ranks(comm: u64, qps: usize, staging: &[Option<usize>], gbps: f64, fwd: &[usize]) -> (Arc<dyn Device>, Vec<Socket>) {
        let n = staging.len();
        let dev: Arc<dyn Device> = Arc::new(HostDevice::new().unwrap());
        let ls: Vec<(TcpListener, [u8; 16])> = (0..n).map(|_| listen(true, None).unwrap()).collect();
        let addrs: Vec<Remote> = ls.iter().enumerate().map(|(r, (l, s))| Remote { addr: l.local_addr().unwrap(), secret: *s, max_chunk: max_chunk(staging[r]) }).collect();
        let mut hs = Vec::new();
        for (r, (listener, secret)) in ls.into_iter().enumerate() {
            let peers = (0..n).map(|q| (q != r).then_some(addrs[q])).collect();
            let links = NetLinks { rank: r, comm_id: comm, listener, peers, secret, qps, gbps, staging: staging[r], timeout: Duration::from_secs(10), forwarder_of: fwd.to_vec() };
            let dev = dev.clone();
            hs.push(std::thread::spawn(move || Socket::connect(dev, links).unwrap()));
        }
        (dev, hs.into_iter().map(|h| h.join().unwrap()).collect())
    }

    /// Turn both transports until `until` holds (or fail after a while); the flows each
    /// reported and the signals each received.
    fn drive(t: &mut [&mut Socket; 2], until: impl Fn(&[&mut Socket; 2], &[Vec<FlowId>; 2], &[Vec<Incoming>; 2]) -> bool) -> ([Vec<FlowId>; 2], [Vec<Incoming>; 2]) {
        let (mut done, mut sig) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
        let t0 = Instant::now();
        while !until(t, &done, &sig) {
            for i in 0..2 {
                let mut adv = Vec::new();
                t[i].poll_signals(&mut sig[i]);
                t[i].progress(&mut done[i], &mut adv).unwrap();
                // With several connections, no data frame ever holds up the control frames.
                let data_on_first = t[i].peers.iter().flatten().any(|p| p.conns.len() > 1 && p.conns[0].out.as_ref().is_some_and(|f| f.seq.is_some()));
                assert!(!data_on_first, "rank {i}: a data frame on the first connection");
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "no progress: {} | {}", t[0].describe(), t[1].describe());
        }
        (done, sig)
    }

    /// A transfer of `len` bytes from rank 0 to rank 1 lands exactly, with `Landed` at the
    /// receiver and the flow done at the sender; an empty one too; a cancelled one is never
    /// reported; a closed peer is gone.
    fn write_lands(staging: [Option<usize>; 2], qps: usize, len: usize, comm: u64) {
        let (dev, mut t0, mut t1) = pair(comm, qps, staging, 0.0);
        let (src, dst) = (dev.alloc(len + 64).unwrap(), dev.alloc(len + 64).unwrap());
        let data: Vec<u8> = (0..len as u64).map(|i| pattern_byte(5, i)).collect();
        dev.copy_from_host(src.add(3), &data).unwrap();
        dev.copy_from_host(dst, &vec![0xee; len + 64]).unwrap();
        let region = Region { seq: 4, ptr: dst.add(7), len, alloc: Some(dev.allocation(dst).unwrap()) };
        let remote = t1.expose(0, region).unwrap();
        let tag = Tag { pair_seq: 1, k: 0 };
        t1.post_ready(0, tag, remote);
        let (_, sig) = drive(&mut [&mut t0, &mut t1], |_, _, s| !s[0].is_empty());
        let [Incoming { from: 1, pair_seq: 1, signal: Signal::Ready { k: 0, remote } }] = sig[0][..] else { panic!("{:?}", sig[0]) };
        assert_eq!(remote.len, len as u64);
        let id = FlowId { seq: 4, idx: 0 };
        t0.start_write(id, 1, tag, src.add(3), &remote, len).unwrap();
        let landed = |s: &[Incoming]| s.iter().any(|m| matches!(m.signal, Signal::Landed { .. }));
        let (done, sig) = drive(&mut [&mut t0, &mut t1], |_, d, s| !d[0].is_empty() && landed(&s[1]));
        assert_eq!(done[0], vec![id]);
        let l: Vec<_> = sig[1].iter().filter(|m| !matches!(m.signal, Signal::Progress { .. })).collect();
        assert!(matches!(l[..], [Incoming { from: 0, pair_seq: 1, signal: Signal::Landed { k: 0, len: n } }] if *n == len as u64), "{l:?}");
        let mut back = vec![0u8; len + 64];
        dev.copy_to_host(&mut back, dst).unwrap();
        assert!(back[7..7 + len] == data[..], "the bytes landed wrong");
        assert!(back[..7].iter().chain(&back[7 + len..]).all(|b| *b == 0xee), "bytes outside the buffer changed");

        // Empty.
        let r0 = t1.expose(0, Region { seq: 5, ptr: DevPtr(0), len: 0, alloc: None }).unwrap();
        t1.post_ready(0, Tag { pair_seq: 2, k: 0 }, r0);
        let (_, sig) = drive(&mut [&mut t0, &mut t1], |_, _, s| !s[0].is_empty());
        let Signal::Ready { remote, .. } = sig[0][0].signal else { panic!() };
        t0.start_write(FlowId { seq: 5, idx: 0 }, 1, Tag { pair_seq: 2, k: 0 }, DevPtr(0), &remote, 0).unwrap();
        let (done, sig) = drive(&mut [&mut t0, &mut t1], |_, d, s| !d[0].is_empty() && landed(&s[1]));
        assert_eq!(done[0], vec![FlowId { seq: 5, idx: 0 }]);
        assert!(matches!(sig[1][..], [Incoming { pair_seq: 2, signal: Signal::Landed { k: 0, len: 0 }, .. }]), "{:?}", sig[1]);

        // Cancelled before it moved: never reported, never lands.
        cancel_never_lands(&dev, &mut t0, &mut t1, region, src.add(3), len, false);

        assert_eq!(t0.peer_health(1), None);
        t1.close();
        drive(&mut [&mut t0, &mut t1], |t, _, _| t[0].peer_health(1).is_some());
        assert!(t0.peer_health(1).unwrap().contains("destroyed or aborted"), "{:?}", t0.peer_health(1));
        t0.close();
        dev.free(src).unwrap();
        dev.free(dst).unwrap();
    }

    /// Op 6 (pair seq 3) writes `len` bytes from `src` to `region` and is cancelled, before
    /// any byte moved or (`mid_frame`) once its first frame is partly written: no `Landed`
    /// at the receiver, no flow done at the sender; both sides drain.
    fn cancel_never_lands(dev: &Arc<dyn Device>, t0: &mut Socket, t1: &mut Socket, region: Region, src: DevPtr, len: usize, mid_frame: bool) {
        let _ = dev;
        let r2 = t1.expose(0, Region { seq: 6, ..region }).unwrap();
        t1.post_ready(0, Tag { pair_seq: 3, k: 0 }, r2);
        let (_, sig) = drive(&mut [t0, t1], |_, _, s| !s[0].is_empty());
        let Signal::Ready { remote, .. } = sig[0][0].signal else { panic!() };
        t0.start_write(FlowId { seq: 6, idx: 0 }, 1, Tag { pair_seq: 3, k: 0 }, src, &remote, len).unwrap();
        if mid_frame {
            // Rate-limited: the first turns send the bucket's burst, then a frame stalls
            // part-way.
            let t = Instant::now();
            while t.elapsed() < Duration::from_millis(30) {
                t0.progress(&mut Vec::new(), &mut Vec::new()).unwrap();
            }
            assert!(t0.peers[1].as_ref().unwrap().conns.iter().any(|c| c.out.as_ref().is_some_and(|f| f.hdr_sent == HDR && f.sent < f.len)), "no frame part-way: {} {:?}", t0.describe(), t0.peers[1].as_ref().unwrap().conns.iter().map(|c| c.out.as_ref().map(|f| (f.sent, f.len, f.hdr_sent, f.trailer_sent))).collect::<Vec<_>>());
        }
        t0.cancel(6);
        t0.signal_failure(1, 3, 7);
        let landed = |s: &[Incoming]| s.iter().any(|m| matches!(m.signal, Signal::Landed { .. }));
        let (done, sig) = drive(&mut [t0, t1], |_, _, s| s[1].iter().any(|m| matches!(m.signal, Signal::Failed { code: 7 })));
        assert!(done[0].is_empty() && !landed(&sig[1]), "{done:?} {:?}", sig[1]);
        t1.signal_failure(0, 3, 7);
        let (done, sig) = drive(&mut [t0, t1], |t, _, _| !t[0].data_in_flight() && !t[1].data_in_flight());
        assert!(done[0].is_empty() && !landed(&sig[1]), "{done:?} {:?}", sig[1]);
    }

    /// A frame cancelled part-way is finished with filler and its trailer says so: the
    /// receiver drops the transfer (direct and staged receivers).
    #[test]
    fn cancel_mid_frame_never_lands() {
        for (staging, comm) in [([None, None], 0x50c0_0005), ([Some(1 << 20), Some(1 << 20)], 0x50c0_0006)] {
            let (dev, mut t0, mut t1) = pair(comm, 1, staging, 0.02);
            let len = 4 * CHUNK;
            let (src, dst) = (dev.alloc(len).unwrap(), dev.alloc(len).unwrap());
            let region = Region { seq: 6, ptr: dst, len, alloc: Some(dev.allocation(dst).unwrap()) };
            cancel_never_lands(&dev, &mut t0, &mut t1, region, src, len, true);
            t0.close();
            t1.close();
            dev.free(src).unwrap();
            dev.free(dst).unwrap();
        }
    }

    /// Rate-limited, a frame stays on its connection for several turns: the data of a
    /// transfer over two connections keeps off the first (`drive` checks every turn), and
    /// its `Done` is not held up.
    #[test]
    fn control_connection_carries_no_data() {
        for staging in [None, Some(1 << 20)] {
            let (dev, mut t0, mut t1) = pair(0x50c0_0009, 2, [staging; 2], 0.1);
            let len = 3 * max_chunk(staging) + 777;
            let (src, dst) = (dev.alloc(len).unwrap(), dev.alloc(len).unwrap());
            let remote = t1.expose(0, Region { seq: 1, ptr: dst, len, alloc: Some(dev.allocation(dst).unwrap()) }).unwrap();
            let tag = Tag { pair_seq: 1, k: 0 };
            t1.post_ready(0, tag, remote);
            let (_, sig) = drive(&mut [&mut t0, &mut t1], |_, _, s| !s[0].is_empty());
            let Signal::Ready { remote, .. } = sig[0][0].signal else { panic!("{:?}", sig[0]) };
            t0.start_write(FlowId { seq: 1, idx: 0 }, 1, tag, src, &remote, len).unwrap();
            let busy = std::cell::Cell::new(false);
            drive(&mut [&mut t0, &mut t1], |t, d, _| {
                busy.set(busy.get() || t[0].peers[1].as_ref().is_some_and(|p| p.conns[1].out.is_some()));
                !d[0].is_empty()
            });
            assert!(busy.get(), "the data frames never stayed on their connection between turns: the check saw nothing");
            t0.close();
            t1.close();
            dev.free(src).unwrap();
            dev.free(dst).unwrap();
        }
    }

    #[test]
    fn direct_write_lands() {
        write_lands([None, None], 2, 3 * CHUNK + 12345, 0x50c0_0001);
    }

    #[test]
    fn staged_write_lands() {
        // 64 KiB of staging: slots of 16 KiB, so the transfer cycles through every slot.
        write_lands([Some(64 << 10), Some(64 << 10)], 3, 300_001, 0x50c0_0002);
    }

    #[test]
    fn direct_sender_staged_receiver() {
        // The sender's 512 KiB chunks are drained through the receiver's 16 KiB slots.
        write_lands([None, Some(64 << 10)], 1, 2 * CHUNK + 99, 0x50c0_0003);
        write_lands([Some(1 << 20), None], 2, 2 * CHUNK + 99, 0x50c0_0004);
    }

    #[test]
    fn header_round_trip_and_garbage() {
        let mut h = Header::new(Kind::Data, 77, 3);
        (h.a, h.token, h.offset, h.payload) = (1 << 40, 9, 123, 456);
        let d = Header::decode(&h.encode()).unwrap();
        assert_eq!((d.kind, d.k, d.pair_seq, d.a, d.token, d.offset, d.payload), (Kind::Data, 3, 77, 1 << 40, 9, 123, 456));
        assert!(Header::decode(&[0u8; HDR]).is_none());
        let mut b = h.encode();
        b[3] ^= 0x40;
        assert!(Header::decode(&b).is_none(), "an unknown kind is refused");
    }

    /// A rate-limited rank sending as much to each of two peers at once shares its rate
    /// between them (`Fair`).
    fn shares_rate(staging: Option<usize>, comm: u64) {
        let (dev, mut t) = ranks(comm, 2, &[staging, staging, staging], 0.05, &[]);
        crate::transport::fair::assert_shares_rate(&dev, &mut t, 2 << 20);
        for tr in &mut t {
            tr.close();
        }
    }

    #[test]
    fn direct_sender_shares_rate() {
        shares_rate(None, 0x50c0_0005);
    }

    #[test]
    fn staged_sender_shares_rate() {
        shares_rate(Some(1 << 20), 0x50c0_0006);
    }

    #[test]
    fn bucket_limits_the_rate() {
        let mut b = Bucket::new(0.1); // 100 MB/s: 2 ms of burst = 200 KB, at least one chunk
        let t0 = Instant::now();
        let mut moved = 0usize;
        while moved < 4 << 20 {
            let n = b.grant(64 << 10);
            b.spend(n);
            moved += n;
        }
        let el = t0.elapsed().as_secs_f64();
        let floor = ((4 << 20) - CHUNK) as f64 / 1e8;
        assert!(el >= floor * 0.95, "4 MiB at 100 MB/s in {el} s (< {floor})");
        let mut free = Bucket::new(0.0);
        assert_eq!(free.grant(1 << 30), 1 << 30);
    }

    /// Rank 1's transport, connected to a rank 0 written out by hand (the handshake done
    /// here): the raw connection lets a test send any bytes as rank 0.
    fn with_raw_rank0(comm: u64) -> (Arc<dyn Device>, Socket, TcpStream) {
        let (listener, secret) = listen(true, None).unwrap();
        let addr = listener.local_addr().unwrap();
        let peers = vec![Some(Remote { addr: SocketAddr::from(([127, 0, 0, 1], 1)), secret: [7; 16], max_chunk: CHUNK }), None];
        let links = NetLinks { rank: 1, comm_id: comm, listener, peers, secret, qps: 1, gbps: 0.0, staging: None, timeout: Duration::from_secs(10), forwarder_of: Vec::new() };
        let dev: Arc<dyn Device> = Arc::new(HostDevice::new().unwrap());
        let d = dev.clone();
        let t = std::thread::spawn(move || Socket::connect(d, links).unwrap());
        let mut raw = TcpStream::connect(addr).unwrap();
        raw.write_all(&hello(comm, 0, 0, &secret)).unwrap();
        let mut b = [0u8; HDR];
        raw.read_exact(&mut b).unwrap();
        assert_eq!(parse_hello(&b), Some((0, comm, 1, [7; 16])));
        (dev, t.join().unwrap(), raw)
    }

    /// A rank's forwarding peer may carry its sends (`relay`): rank 2 writes rank 1's
    /// transfer into rank 0's buffer, which lands there as rank 1's (its `Landed` from rank
    /// 1, the `Done` to rank 2), through direct I/O and through staging; a rank that is
    /// neither the sender nor its forwarding peer is refused (gone), the buffer untouched;
    /// a `Ready` naming a rank other than the receiver's forwarding peer to land the bytes
    /// is refused at the write.
    #[test]
    fn forwarded_writes_land_and_others_are_refused() {
        for (i, staging) in [[None, None, None], [Some(64 << 10), None, Some(64 << 10)]].into_iter().enumerate() {
            let len = 300_001usize;
            let (dev, mut t) = ranks(0x50c0_0200 + i as u64, 2, &staging, 0.0, &[0, 2, 2]);
            let turn = |t: &mut [Socket], sig: &mut [Vec<Incoming>], done: &mut [Vec<FlowId>]| {
                for r in 0..t.len() {
                    t[r].poll_signals(&mut sig[r]);
                    let _ = t[r].progress(&mut done[r], &mut Vec::new());
                }
            };
            let (src, dst) = (dev.alloc(len).unwrap(), dev.alloc(len).unwrap());
            let data: Vec<u8> = (0..len as u64).map(|x| pattern_byte(9, x)).collect();
            dev.copy_from_host(src, &data).unwrap();
            let remote = t[0].expose(1, Region { seq: 1, ptr: dst, len, alloc: Some(dev.allocation(dst).unwrap()) }).unwrap();
            t[0].post_ready(1, Tag { pair_seq: 5, k: 0 }, remote);
            let id = FlowId { seq: crate::transport::relay::RELAY_SEQ, idx: 0 };
            t[2].start_write_mapped(id, 0, Tag { pair_seq: 5, k: 0 }, src, dev.allocation(src).unwrap(), &remote, len).unwrap();
            let (mut sig, mut done): (Vec<Vec<Incoming>>, Vec<Vec<FlowId>>) = (vec![Vec::new(); 3], vec![Vec::new(); 3]);
            let t0 = Instant::now();
            while !(done[2].contains(&id) && sig[0].iter().any(|m| matches!(m.signal, Signal::Landed { .. }))) {
                turn(&mut t, &mut sig, &mut done);
                assert!(t0.elapsed() < Duration::from_secs(20), "case {i}: no landing: {}", t[0].describe());
            }
            let landed: Vec<&Incoming> = sig[0].iter().filter(|m| matches!(m.signal, Signal::Landed { .. })).collect();
            assert!(landed.len() == 1 && landed[0].from == 1 && landed[0].pair_seq == 5, "case {i}: {landed:?}");
            let mut back = vec![0u8; len];
            dev.copy_to_host(&mut back, dst).unwrap();
            assert!(back == data, "case {i}: the forwarded bytes");
            // A Ready may name only the receiver's forwarding peer as the rank that lands
            // its bytes (rank 0 forwards through itself).
            let via2 = RemoteBuffer { len: 16, wire: Wire { alloc_id: 1, base: 3, ..Wire::empty(0) } };
            let e = t[1].start_write(FlowId { seq: 8, idx: 0 }, 0, Tag { pair_seq: 7, k: 0 }, src, &via2, 16).unwrap_err();
            assert!(e.to_string().contains("not its forwarding peer"), "{e}");
            // Rank 1 writing rank 2's transfer (rank 2 forwards through itself) is refused.
            let spare = dev.alloc(4096).unwrap();
            let remote = t[0].expose(2, Region { seq: 2, ptr: spare, len: 4096, alloc: Some(dev.allocation(spare).unwrap()) }).unwrap();
            t[0].post_ready(2, Tag { pair_seq: 6, k: 0 }, remote);
            t[1].start_write(FlowId { seq: 9, idx: 0 }, 0, Tag { pair_seq: 6, k: 0 }, src, &remote, 4096).unwrap();
            while t[0].peer_health(1).is_none() {
                turn(&mut t, &mut sig, &mut done);
                assert!(t0.elapsed() < Duration::from_secs(20), "case {i}: rank 1's frame was taken");
            }
            assert!(t[0].peer_health(1).unwrap().contains("neither sends nor forwards"), "{:?}", t[0].peer_health(1));
            let mut back = vec![1u8; 4096];
            dev.copy_to_host(&mut back, spare).unwrap();
            assert!(back.iter().all(|b| *b == 0), "case {i}: the refused write changed the buffer");
            t.iter_mut().for_each(|x| x.close());
            for p in [src, dst, spare] {
                dev.free(p).unwrap();
            }
        }
    }

    /// Frames from a peer are checked before use: a header that is not hoccl's, a data
    /// frame that would write past its receive buffer (or claims a larger transfer than the
    /// buffer) and a trailer that is neither "intact" nor "cancelled" each make the peer
    /// gone with the reason, never a write outside the buffer or a landed transfer.
    #[test]
    fn corrupt_frames_are_refused() {
        let len = 4096usize;
        let data = |offset: u64, a: u64, payload: u64, token: u64| {
            let mut h = Header::new(Kind::Data, 1, 0);
            (h.a, h.token, h.offset, h.payload) = (a, token, offset, payload);
            h.encode().to_vec()
        };
        type Frames = (&'static str, Box<dyn Fn(u64) -> Vec<u8>>);
        let cases: [Frames; 5] = [
            ("malformed frame header", Box::new(|_| vec![0xab; HDR])),
            ("corrupt frame", Box::new(move |t| data(len as u64 - 8, len as u64, 100, t))),
            ("corrupt frame", Box::new(move |t| data(u64::MAX - 4, len as u64, 16, t))),
            ("corrupt frame", Box::new(move |t| data(0, 2 * len as u64, 16, t))),
            ("malformed frame trailer", Box::new(move |t| [data(0, len as u64, 16, t), vec![0x5a; 16], 0xdead_u64.to_le_bytes().to_vec()].concat())),
        ];
        for (i, (why, bytes)) in cases.into_iter().enumerate() {
            let (dev, mut t1, mut raw) = with_raw_rank0(0x50c0_0100 + i as u64);
            let dst = dev.alloc(len).unwrap();
            let region = Region { seq: 1, ptr: dst, len, alloc: Some(dev.allocation(dst).unwrap()) };
            let remote = t1.expose(0, region).unwrap();
            t1.post_ready(0, Tag { pair_seq: 1, k: 0 }, remote);
            raw.write_all(&bytes(remote.wire.alloc_id)).unwrap();
            let (mut sig, mut done, mut adv) = (Vec::new(), Vec::new(), Vec::new());
            let t0 = Instant::now();
            while t1.peer_health(0).is_none() {
                t1.poll_signals(&mut sig);
                let _ = t1.progress(&mut done, &mut adv);
                assert!(t0.elapsed() < Duration::from_secs(10), "{why}: the peer is still healthy: {}", t1.describe());
            }
            let health = t1.peer_health(0).unwrap();
            assert!(health.contains(why), "case {i}: {health:?}");
            assert!(!sig.iter().any(|m| matches!(m.signal, Signal::Landed { .. })), "case {i}: a corrupt transfer landed");
            let mut back = vec![0u8; len];
            dev.copy_to_host(&mut back, dst).unwrap();
            if i < 4 {
                assert!(back.iter().all(|b| *b == 0), "case {i}: the buffer changed");
            }
            t1.close();
            dev.free(dst).unwrap();
        }
    }

    /// A connection that does not present this rank's secret is refused and the setup
    /// goes on; one that never comes makes the setup time out naming the rank.
    #[test]
    fn handshake_is_authenticated_and_bounded() {
        let (listener, secret) = listen(true, None).unwrap();
        let addr = listener.local_addr().unwrap();
        let intruder = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&hello(42, 0, 0, &[9; 16])).unwrap();
            let mut b = [0u8; 1];
            // Refused: closed without a reply.
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            matches!(s.read(&mut b), Ok(0) | Err(_))
        });
        let peers = vec![Some(Remote { addr: SocketAddr::from(([127, 0, 0, 1], 1)), secret: [0; 16], max_chunk: CHUNK }), None];
        let links = NetLinks { rank: 1, comm_id: 42, listener, peers, secret, qps: 1, gbps: 0.0, staging: None, timeout: Duration::from_millis(500), forwarder_of: Vec::new() };
        let dev: Arc<dyn Device> = Arc::new(HostDevice::new().unwrap());
        let e = Socket::connect(dev, links).err().expect("times out");
        assert!(intruder.join().unwrap(), "the intruder got a reply");
        assert!(matches!(e, Error::Timeout { .. }) && e.to_string().contains("ranks [0] did not connect"), "{e}");
    }
}
