//! Out-of-band exchange between ranks: rank/size, all-gather of byte records, barriers and
//! tagged point-to-point messages. Used at communicator creation and for rare control
//! traffic, never on the data path.
//!
//! Implementations: [`mpi::MpiBootstrap`] (rsmpi; from `MPI_COMM_WORLD` or any communicator
//! handed in from C++), [`tcp::TcpBootstrap`] (plain TCP from a [`tcp::UniqueId`], no MPI)
//! and [`thread::ThreadBootstrap`] (several ranks in one process, for unit tests).
use crate::error::Result;

pub mod mpi;
pub mod tcp;
pub mod thread;

pub trait Bootstrap: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Every rank contributes one record (lengths may differ); all receive all, by rank.
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;
    fn barrier(&self) -> Result<()>;
    /// Tagged point-to-point; `recv` blocks until the matching message arrives.
    fn send(&self, peer: usize, tag: u32, data: &[u8]) -> Result<()>;
    fn recv(&self, peer: usize, tag: u32) -> Result<Vec<u8>>;
    /// The longest any wait of this bootstrap blocks before `Timeout`; `None` when waits
    /// are unbounded. `Communicator::shrink` needs a bound (a survivor waits for the
    /// leader's message point to point).
    fn timeout(&self) -> Option<std::time::Duration> {
        None
    }
}
