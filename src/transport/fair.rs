//! Fair service of a transport's peers: the NIC transports (sockets, verbs) visit their
//! peers in passes, and where a pass starts decides who gets a rate-limited rank's bytes.

/// Where a pass over the peers starts: after the last peer that moved bytes in the pass
/// before, and, before any pass, after this rank. A pass gives each peer in turn what the
/// rate limit, the connections (or credits) and the staging slots allow, so a fixed start
/// would hand every turn's tokens (or free slots) to the lowest-numbered peer with data,
/// and every rank would send to (and read from) the same rank first: that rank's link then
/// carries several ranks' traffic while the others idle, and a uniform exchange ends on
/// the last rank's link alone, up to twice the time the rates allow. Rotating the start
/// shares each rank's rate evenly between its peers with data, as the simulator's fair
/// sharing assumes.
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

/// Test support for both NIC transports: rank 0 of `t` (three ranks on the host device
/// `dev`, each on a node of its own, rate-limited to 50 MB/s) writes `len` bytes to each of
/// ranks 1 and 2 at once; both transfers must land at about the same time. Served in a
/// fixed order, the first would land at half the time and the second at the end.
#[cfg(test)]
pub(crate) fn assert_shares_rate<T: super::Transport>(dev: &std::sync::Arc<dyn crate::device::Device>, t: &mut [T], len: usize) {
    use super::{FlowId, Region, Signal, Tag};
    use std::time::{Duration, Instant};
    let src = dev.alloc(len).unwrap();
    dev.copy_from_host(src, &vec![0x5a; len]).unwrap();
    let dst: Vec<_> = (0..2).map(|_| dev.alloc(len).unwrap()).collect();
    let tag = Tag { pair_seq: 1, k: 0 };
    for r in 1..3 {
        let region = Region { seq: 1, ptr: dst[r - 1], len, alloc: Some(dev.allocation(dst[r - 1]).unwrap()) };
        let remote = t[r].expose(0, region).unwrap();
        t[r].post_ready(0, tag, remote);
    }
    let (mut remotes, mut landed) = (Vec::new(), [None, None]);
    let t0 = Instant::now();
    while landed.iter().any(Option::is_none) {
        for (r, tr) in t.iter_mut().enumerate() {
            let mut sig = Vec::new();
            tr.poll_signals(&mut sig);
            tr.progress(&mut Vec::new(), &mut Vec::new()).unwrap();
            for m in sig {
                match m.signal {
                    Signal::Ready { remote, .. } if r == 0 => remotes.push((m.from, remote)),
                    Signal::Landed { .. } if r > 0 => landed[r - 1] = Some(t0.elapsed()),
                    _ => {}
                }
            }
        }
        if remotes.len() == 2 {
            for (i, (to, remote)) in remotes.drain(..).enumerate() {
                t[0].start_write(FlowId { seq: 1, idx: i }, to, tag, src, &remote, len).unwrap();
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "no progress: {}", t[0].describe());
    }
    let [a, b] = landed.map(|l| l.unwrap().as_secs_f64());
    // Sharing, the two land within a few grants of each other.
    assert!((a - b).abs() < 0.25 * a.max(b), "landed at {a:.3} s and {b:.3} s: the rate was not shared");
    dev.free(src).unwrap();
    for d in dst {
        dev.free(d).unwrap();
    }
}
