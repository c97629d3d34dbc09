//! The collectives the multi-op tests (faults, inter-node) run, in the order they run them.
#![allow(dead_code)] // each test binary that includes `common` uses some of these

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    SendRecv,
    AllGather,
    AllToAll,
    AllToAllV,
    Broadcast,
    Gather,
    Scatter,
    AllReduce,
    ReduceScatter,
    Reduce,
}

pub const OPS: [Op; 10] = [
    Op::SendRecv,
    Op::AllGather,
    Op::AllToAll,
    Op::AllToAllV,
    Op::Broadcast,
    Op::Gather,
    Op::Scatter,
    Op::AllReduce,
    Op::ReduceScatter,
    Op::Reduce,
];
