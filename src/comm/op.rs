//! The operation descriptor every public surface fills (the Rust methods, the C++ API
//! through the cxx bridge, the C ABI) and hands to [`Communicator::enqueue`], which
//! validates it in one place (as NCCL's `ncclInfo` and `ncclEnqueueCheck`).
//!
//! Adding an operation is one variant here, its byte ranges in `enqueue.rs`, and one line
//! per surface. A reduction takes its operator in its variant (`AllReduce { op: RedOp }`,
//! `Reduce { op: RedOp, root }`), so ops without one carry nothing extra.
//!
//! [`Communicator::enqueue`]: super::Communicator::enqueue
use crate::device::{DevPtr, StreamHandle};
use crate::reduce::RedOp;
use crate::types::DataType;

/// Which operation, with the arguments only it has. Ranks (`peer`, `root`) are checked
/// against the communicator's size by `enqueue`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective<'a> {
    /// `count` elements of `send` to `peer` (match with its `Recv`; use a group for pairs).
    Send { peer: usize },
    /// `count` elements from `peer` into `recv`.
    Recv { peer: usize },
    /// Every rank's `count` elements of `send`, concatenated by rank into every rank's
    /// `recv` (`size * count` elements). In place when `send == recv + rank * count`.
    AllGather,
    /// Block j of `send` (`count` elements) goes to rank j, which stores it as block `rank`
    /// of its `recv`. The buffers must not overlap.
    AllToAll,
    /// AllToAll with per-peer counts and displacements in elements (MPI's layout), one
    /// entry per rank: `send_counts[j]` elements at `send + send_displs[j]` go to rank j,
    /// which receives them at `recv + recv_displs[rank]`. Counts must agree pairwise (a
    /// mismatch is reported as an error by both ranks). `count` is unused.
    AllToAllV { send_counts: &'a [usize], send_displs: &'a [usize], recv_counts: &'a [usize], recv_displs: &'a [usize] },
    /// `root`'s `count` elements from its `send` into every rank's `recv` (`send` is only
    /// read on the root; in place when the root's `send == recv`).
    Broadcast { root: usize },
    /// Every rank's `count` elements into block `rank` of the root's `recv` (`size * count`
    /// elements, only used on the root; in place when the root's `send` is its block).
    Gather { root: usize },
    /// Block j of the root's `send` (`size * count` elements) into rank j's `recv` (in
    /// place when the root's `recv` is its block).
    Scatter { root: usize },
    /// Every rank's `count` elements of `send`, reduced element-wise with `op` in rank order
    /// (`reduce::reduce_into`), into every rank's `recv`. In place when `send == recv`.
    AllReduce { op: RedOp },
    /// `send` holds `size * count` elements; block j of every rank's `send`, reduced in rank
    /// order, into rank j's `recv` (`count` elements). In place when
    /// `recv == send + rank * count`.
    ReduceScatter { op: RedOp },
    /// Every rank's `count` elements of `send`, reduced in rank order, into the root's
    /// `recv` (only used on the root; in place when the root's `send == recv`).
    Reduce { op: RedOp, root: usize },
}

impl Collective<'_> {
    /// The name errors and logs use.
    pub fn name(&self) -> &'static str {
        match self {
            Collective::Send { .. } => "send",
            Collective::Recv { .. } => "recv",
            Collective::AllGather => "all_gather",
            Collective::AllToAll => "all_to_all",
            Collective::AllToAllV { .. } => "all_to_allv",
            Collective::Broadcast { .. } => "broadcast",
            Collective::Gather { .. } => "gather",
            Collective::Scatter { .. } => "scatter",
            Collective::AllReduce { .. } => "all_reduce",
            Collective::ReduceScatter { .. } => "reduce_scatter",
            Collective::Reduce { .. } => "reduce",
        }
    }
}

/// One stream-ordered, asynchronous operation: buffers are device pointers (any
/// alignment), `count` is in elements of `dtype`. A buffer the operation does not use
/// (`recv` of a `Send`, `send` of a `Recv`) is ignored whatever its value.
#[derive(Clone, Copy, Debug)]
pub struct OpDesc<'a> {
    pub coll: Collective<'a>,
    pub send: DevPtr,
    pub recv: DevPtr,
    pub count: usize,
    pub dtype: DataType,
    pub stream: StreamHandle,
}
