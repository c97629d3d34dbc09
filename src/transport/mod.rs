//! How bytes and control signals move between ranks: the [`Transport`] trait the engine's
//! proxy drives, and its implementations.
//!
//! The engine owns every operation's logic: matching sends to receives by pair sequence
//! number, the stream flags, timeouts, failure reports. A transport owns what depends on
//! how two ranks are connected: making a receive buffer writable by the peer, moving the
//! bytes of a flow (chunking and queueing them as it sees fit), telling the peer that its
//! buffer is ready or that data landed, and watching the peer's health. The engine never
//! asks which transport it holds; a transport never looks inside an operation. (NCCL draws
//! the same line with `struct ncclTransport`, setup/connect plus a proxy progress function
//! per transport; MSCCL++ with its connections' `write`, `updateAndSync` and `flush`.)
//!
//! The unit of work a transport takes is a whole flow, and it signals the landing itself:
//! how it cuts a flow into chunks, and whether the CPU or the device watches the chunks and
//! raises the flags, is its own affair.
//!
//! - [`same_host`]: ranks of one host. Copies straight into the peer's buffer on the
//!   device's copy-engine queues ([`chunk_scheduler`]), through mappings of the peer's
//!   allocations ([`ipc`]), with control signals on shared-memory rings ([`mailbox`]); a
//!   transfer whose receive allocation stale mappings keep from being imported goes
//!   through a host-memory ring instead ([`ipc_bounce`]).
//! - [`socket`]: ranks of other nodes over TCP, several connections per peer, from and
//!   into host memory (the user's buffers on the host backend, pinned staging filled and
//!   drained by the copy queues on CUDA).
//! - [`staged`]: small transfers between processes of this host whose every device
//!   operation the calling threads enqueue during their calls (receive rings and flags);
//!   not a [`Transport`]: the communicator drives it at the call, the proxy only reads its
//!   flags.
//! - [`verbs`]: ranks of other nodes over RDMA (rdma-core via bindgen, loaded at run
//!   time): one channel of several queue pairs per peer, writes with immediate into
//!   registered slots under credits; host backend only. Chosen instead of [`socket`] by
//!   `HOCCL_NET` ([`verbs::decide`]).
//! - [`host_staging`]: the pinned host staging and copy queue through which those two move
//!   device memory that is not host memory (CUDA).
//! - [`route`]: one transport over the same-host one and one of the two above, choosing
//!   by peer.
//! - [`relay`]: point-to-point sends to other nodes carried by the sender's forwarding
//!   peer (NCCL's PXN), run by [`route`] over the same-host and the socket transport.
pub mod chunk_scheduler;
pub mod fair;
pub mod host_staging;
pub mod ipc;
pub mod ipc_bounce;
pub mod mailbox;
pub mod same_host;
pub mod route;
pub mod relay;
pub mod socket;
pub mod staged;
pub mod verbs;

use crate::device::{Allocation, DevPtr};
use crate::error::{Error, Result};

/// How this rank reaches the ranks of other nodes, as communicator creation set it up
/// (`comm::setup::listen_for_peers`); the engine makes the transport from it.
pub enum Far {
    Socket(socket::NetLinks),
    Verbs(verbs::transport::VerbsLinks),
}

/// One flow: op `seq` (the communicator's call order), send index `idx` within the op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlowId {
    pub seq: u64,
    pub idx: usize,
}

/// Names one transfer between two ranks in the signals about it: the pair sequence number
/// of its op (the count of ops so far between the two ranks, equal on both sides) and its
/// index `k` among that op's transfers between the same two ranks in the same direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tag {
    pub pair_seq: u64,
    pub k: u32,
}

/// A receive buffer of this rank, as the engine hands it to [`Transport::expose`].
/// `alloc` is the allocation holding `ptr` (None iff `len` is 0); `seq` is the op it is for
/// (what a transport's error about it names).
#[derive(Clone, Copy, Debug)]
pub struct Region {
    pub seq: u64,
    pub ptr: DevPtr,
    pub len: usize,
    pub alloc: Option<Allocation>,
}

/// What a receiver tells its sender about the buffer a transfer lands in: made by the
/// receiver's [`Transport::expose`], carried by a `Ready` signal, consumed by the sender's
/// [`Transport::start_write`]. The engine reads only `len`; `wire` is the transport's own
/// plain-data description (for the same-host transport: the allocation's export handle,
/// identity and base, and the buffer's offset in it).
#[derive(Clone, Copy, Debug)]
pub struct RemoteBuffer {
    /// Bytes the receiver expects.
    pub len: u64,
    pub wire: Wire,
}

/// The transport-defined part of a [`RemoteBuffer`]: fixed size, plain data, so it fits a
/// control record as it is.
#[derive(Clone, Copy, Debug)]
pub struct Wire {
    pub alloc_id: u64,
    pub alloc_len: u64,
    /// The allocation's base in the receiver's address space.
    pub base: u64,
    /// The buffer's offset inside the allocation.
    pub offset: u64,
    /// The receiver's process.
    pub pid: u32,
    /// An export handle (or a remote key) for the allocation; zero when none is needed.
    pub handle: [u8; 64],
    /// Announced for a gated transfer ([`Transport::announce`]): the sender must take it
    /// with [`Transport::gated_write`], never with `start_write`.
    pub gated: bool,
    /// The announcement of a staged transfer ([`staged`]): [`STAGED_RECV`] or [`STAGED_SEND`]
    /// (0: none). It carries only the length, which the peer's proxy checks against its own
    /// staged transfer with the same `k` in the other direction.
    pub staged: u8,
}

impl Wire {
    /// Nothing described yet, sent by process `pid`.
    pub fn empty(pid: u32) -> Wire {
        Wire { alloc_id: 0, alloc_len: 0, base: 0, offset: 0, pid, handle: [0; 64], gated: false, staged: 0 }
    }
}

/// [`Wire::staged`] of a staged receive's announcement (to the sender).
pub const STAGED_RECV: u8 = 1;
/// [`Wire::staged`] of a staged send's announcement (to the receiver).
pub const STAGED_SEND: u8 = 2;

/// One transfer of a gated batch ([`Transport::gated_write`]): flow `id` moves `len` bytes
/// from `src` to the receiver's buffer `remote`.
#[derive(Clone, Copy, Debug)]
pub struct GatedWrite {
    pub id: FlowId,
    pub src: DevPtr,
    pub remote: RemoteBuffer,
    pub len: usize,
}

/// A control signal from a peer, as [`Transport::poll_signals`] delivers it.
#[derive(Clone, Copy, Debug)]
pub enum Signal {
    /// The peer's receive `k` of the op is ready: the data of this rank's send `k` to it
    /// goes to `remote`.
    Ready { k: u32, remote: RemoteBuffer },
    /// All `len` bytes of the peer's send `k` of the op to this rank have landed.
    Landed { k: u32, len: u64 },
    /// The op failed on the peer's side (`code`: its `ErrorCode`).
    Failed { code: u32 },
    /// Bytes of the peer's send `k` of the op to this rank keep landing (a long transfer
    /// in progress): the op is not stalled.
    Progress { k: u32 },
}

/// A signal and who sent it about which op.
#[derive(Clone, Copy, Debug)]
pub struct Incoming {
    pub from: usize,
    pub pair_seq: u64,
    pub signal: Signal,
}

/// A way of reaching a class of peers (the ranks of this node, the ranks of other nodes
/// over TCP or RDMA). The engine's proxy thread owns it and is the only caller, on that thread; no
/// method waits for the device or for a peer: a transport that cannot go on now keeps the
/// work and continues on a later call.
///
/// Per transfer, the calls go: the receiver's engine [`expose`](Transport::expose)s the
/// buffer and [`post_ready`](Transport::post_ready)s it to the sender; the sender's engine
/// gets `Ready` from [`poll_signals`](Transport::poll_signals) and calls
/// [`start_write`](Transport::start_write); the sender's transport moves the bytes, and when
/// they have all landed reports the flow from [`progress`](Transport::progress) and signals
/// `Landed` to the receiver itself, so a transport whose landing is observed off the CPU
/// (a device-side flag write, an RDMA write with immediate) needs no proxy turn in between.
/// A transport whose receiver sees the bytes arrive (the socket one) may instead report
/// `Landed` from the receiver's own `poll_signals`, as if the sender had signalled it, and
/// tell the sender, whose `progress` then reports the flow.
/// Signals to one peer arrive in the order they were posted.
///
/// **Gated transfers.** A transport may move some transfers without a proxy turn on the
/// critical path ([`gated`](Transport::gated) says which; both ranks answer alike). The
/// receiver's engine [`announce`](Transport::announce)s such a buffer when the op is
/// submitted and reports [`reached`](Transport::reached) when its stream reaches the op; the
/// sender's engine hands the op's gated transfers to that peer in one
/// [`gated_write`](Transport::gated_write) as soon as it has them all, started or not (the
/// transport orders the bytes after both streams reached the op). Completion is reported as
/// for other transfers: the flows from the sender's `progress`, `Landed` from the receiver's
/// `poll_signals`.
pub trait Transport: Send {
    /// Make this rank's receive buffer `region` writable by `peer`; returns what the peer's
    /// `start_write` needs. May register or export the allocation (cached).
    fn expose(&mut self, peer: usize, region: Region) -> Result<RemoteBuffer>;

    /// Tell `peer` that the buffer of transfer `tag` is ready (sent at once, or queued behind
    /// earlier signals to a full ring; sent in order).
    fn post_ready(&mut self, peer: usize, tag: Tag, remote: RemoteBuffer);

    /// Tell `peer` that op `pair_seq` (between the two) failed here (as `post_ready`).
    fn signal_failure(&mut self, peer: usize, pair_seq: u64, code: u32);

    /// Append every signal that has arrived from peers to `out`; whether there were any.
    fn poll_signals(&mut self, out: &mut Vec<Incoming>) -> bool;

    /// Start moving `len` bytes from `src` to `peer`'s buffer `remote` (len matches
    /// `remote.len`; 0 is allowed). When every byte has landed, `progress` reports `id`
    /// and the transport signals `Landed` for `tag` to `peer`.
    fn start_write(&mut self, id: FlowId, peer: usize, tag: Tag, src: DevPtr, remote: &RemoteBuffer, len: usize) -> Result<()>;

    /// As [`start_write`](Transport::start_write), for a send that may cross through this
    /// rank's forwarding peer ([`relay`]): a point-to-point send to a rank of another node.
    /// Transports that do not relay start it as any write.
    fn start_forwarded(&mut self, id: FlowId, peer: usize, tag: Tag, src: DevPtr, remote: &RemoteBuffer, len: usize) -> Result<()> {
        self.start_write(id, peer, tag, src, remote, len)
    }

    /// As [`start_write`](Transport::start_write) from memory this rank mapped from
    /// another (a relayed send's source, [`relay`]), which the device's allocation
    /// registry does not know: `src_alloc` is the mapping's extent here.
    #[allow(clippy::too_many_arguments)]
    fn start_write_mapped(&mut self, id: FlowId, peer: usize, tag: Tag, src: DevPtr, src_alloc: Allocation, remote: &RemoteBuffer, len: usize) -> Result<()> {
        let _ = (id, tag, src, src_alloc, remote, len);
        Err(Error::internal("Transport::start_write_mapped", format!("this transport carries no relayed send to rank {peer}")))
    }

    /// As [`expose`](Transport::expose), for a point-to-point receive from a rank of another
    /// node that this rank's forwarding peer may land ([`relay`]). Transports that do not
    /// relay expose it as any receive.
    fn expose_forwarded(&mut self, peer: usize, region: Region) -> Result<RemoteBuffer> {
        self.expose(peer, region)
    }

    /// A forwarding peer ([`relay`]): make `region` (memory mapped from another rank of
    /// this node, `region.alloc` the mapping's extent) the receive of transfer `tag` from
    /// `peer`; returns its token. Its landing and progress go to
    /// [`take_relay_landings`](Transport::take_relay_landings), not to this rank's engine.
    fn expose_relayed(&mut self, peer: usize, tag: Tag, region: Region) -> Result<u64> {
        let _ = (tag, region);
        Err(Error::internal("Transport::expose_relayed", format!("this transport lands no relayed receive from rank {peer}")))
    }

    /// The relayed receives landed or progressing since the last call, by token
    /// ([`expose_relayed`](Transport::expose_relayed)).
    fn take_relay_landings(&mut self, out: &mut Vec<(u64, Signal)>) {
        let _ = out;
    }

    /// Forget relayed receive `token` (its op failed): its data is read and dropped.
    fn forget_receive(&mut self, token: u64) {
        let _ = token;
    }

    /// Whether the proxy must look for work often while it has none of its own: it carries
    /// other ranks' sends ([`relay`]), which arrive without an op of its own to wake it.
    fn wake_often(&self) -> bool {
        false
    }

    /// Move data on (reap what completed, start what may start), signal landings, send
    /// queued signals, append the flows now complete to `done` and the ops whose data
    /// moved (a chunk landed) to `advanced` (an op may appear more than once); whether
    /// anything moved. An error names the op (its `FlowId::seq`) whose data movement failed.
    fn progress(&mut self, done: &mut Vec<FlowId>, advanced: &mut Vec<u64>) -> std::result::Result<bool, (u64, Error)>;

    /// Stop moving data for op `seq` (it failed). Data already on its way may still land;
    /// its flows are never reported done, and the transport keeps whatever that data needs
    /// (mappings, staging) until it has drained. No `Landed` is signalled for a transfer
    /// cut short; one whose every byte had left intact before the cancel may still be
    /// reported landed by a transport whose receiver observes the landing (the socket one).
    fn cancel(&mut self, seq: u64);

    /// Why `peer` can no longer take part (its process exited, its communicator closed),
    /// or None while it can.
    fn peer_health(&self, peer: usize) -> Option<String>;

    /// Whether data may still be moving into or out of memory (the proxy may not exit and
    /// mappings may not close while it is).
    fn data_in_flight(&self) -> bool;

    /// Whether signals wait to be sent (a peer's ring was full).
    fn signals_queued(&self) -> bool;

    /// One line for failure reports: data in flight and signals queued.
    fn describe(&self) -> String;

    /// Close mappings and tell the peers this rank is gone (the proxy's exit; called once,
    /// after `data_in_flight` turned false or the exit was forced).
    fn close(&mut self);

    /// The proxy has no op pending, no graph template, no data in flight and no failed op:
    /// no device work of this communicator waits for it, so the transport may make driver
    /// calls that wait for the device (closing retired mappings, `ipc`). Called once per
    /// idle park.
    fn idle(&mut self) {}

    /// Whether a transfer of `len` bytes with `peer` is gated. Both ranks of a pair answer
    /// alike for the same `len` (a length mismatch is caught at the sender, as always).
    fn gated(&mut self, peer: usize, len: usize) -> bool {
        let _ = (peer, len);
        false
    }

    /// Receiver, at the op's submission: announce the buffer `remote` (from `expose`) of
    /// gated transfer `tag` from `peer`; the transport reports `Landed` for it.
    fn announce(&mut self, peer: usize, tag: Tag, remote: RemoteBuffer) -> Result<()> {
        let _ = (tag, remote);
        Err(Error::internal("Transport::announce", format!("no gated transfers with rank {peer} here")))
    }

    /// Receiver: the stream reached op `pair_seq` (with `peer`), which has gated receives
    /// from it: their bytes may land from now on.
    fn reached(&mut self, peer: usize, pair_seq: u64) {
        let _ = (peer, pair_seq);
    }

    /// Sender: whether `peer`'s gated queue takes another batch now. Batches wait on the
    /// device for flags only the proxies raise, so a queue holding too many of them fills
    /// its command buffer, and the driver then blocks the call that enqueues the next one
    /// (the proxy, which would raise those flags). The proxy holds a batch back until the
    /// queue has room.
    fn gated_room(&mut self, peer: usize) -> bool {
        let _ = peer;
        true
    }

    /// Sender: queue every gated transfer of op `pair_seq` to `peer`, to run once this
    /// rank's stream wrote `start_value` to the flag at `start_flag` (device address) and the
    /// receiver reached the op. May be called before the stream reached the op; calls for
    /// one peer come in pair order. Each flow is reported done by `progress`.
    fn gated_write(&mut self, peer: usize, pair_seq: u64, start_flag: DevPtr, start_value: u64, writes: &[GatedWrite]) -> Result<()> {
        let _ = (pair_seq, start_flag, start_value, writes);
        Err(Error::internal("Transport::gated_write", format!("no gated transfers with rank {peer} here")))
    }
}
