//! Fair service of a transport's peers: the NIC transports (sockets, verbs) visit their
//! peers in passes, and where a pass starts decides who gets a rate-limited rank's bytes.

/// Where a pass over the peers starts: after the last peer that moved bytes in the pass
/// before, and, before any pass, after this rank. A pass gives each peer in turn what the
/// rate limit, the connections (or credits) and the staging slots allow, so a fixed start would hand every turn's
/// tokens (or free slots) to the lowest-numbered peer with data, and every rank would send
/// to (and read from) the same rank first: that rank's link then carries several ranks'
/// traffic while the others idle, and a uniform exchange ends on the last rank's link
/// alone, up to twice the time the rates allow. Rotating the start shares each rank's
/// rate evenly between its peers with data, as the simulator's fair sharing assumes.
#[derive(Clone, Copy)]
pub struct Fair {
    start: usize,
}

impl Fair {
    pub fn new(rank: usize) -> Fair {
        Fair { start: rank + 1 }
    }

    /// The peers of one pass, in order, for `n` peers.
    pub fn order(self, n: usize) -> impl Iterator<Item = usize> {
        let s = if n == 0 { 0 } else { self.start % n };
        (0..n).map(move |k| (s + k) % n)
    }

    /// Peer `i` moved bytes in this pass: the next pass starts after it.
    pub fn moved(&mut self, i: usize) {
        self.start = i + 1;
    }
}
