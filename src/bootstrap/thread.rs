//! Several ranks in one process: each thread holds a `ThreadBootstrap` made by
//! [`ThreadBootstrap::group`]. Used by unit tests to run the whole stack without MPI.
use super::Bootstrap;
use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

struct Shared {
    size: usize,
    state: Mutex<State>,
    cv: Condvar,
    timeout: Duration,
}

#[derive(Default)]
struct State {
    /// Round-based all-gather: round number -> records by rank.
    gathers: HashMap<u64, Vec<Option<Vec<u8>>>>,
    /// How many ranks have taken their copy of a completed round.
    taken: HashMap<u64, usize>,
    /// (from, to, tag) -> queued messages.
    mailboxes: HashMap<(usize, usize, u32), VecDeque<Vec<u8>>>,
}

pub struct ThreadBootstrap {
    rank: usize,
    shared: Arc<Shared>,
    round: Mutex<u64>,
}

impl ThreadBootstrap {
    /// One bootstrap per rank of a group of `size`; hand each to its own thread.
    pub fn group(size: usize) -> Vec<ThreadBootstrap> {
        Self::group_with_timeout(size, Duration::from_secs(60))
    }

    /// As [`group`](Self::group); any wait longer than `timeout` is a `Timeout` error
    /// (a rank that never arrives must not hang the test).
    pub fn group_with_timeout(size: usize, timeout: Duration) -> Vec<ThreadBootstrap> {
        let shared = Arc::new(Shared { size, state: Mutex::new(State::default()), cv: Condvar::new(), timeout });
        (0..size).map(|rank| ThreadBootstrap { rank, shared: shared.clone(), round: Mutex::new(0) }).collect()
    }

    fn wait_until<T>(&self, op: &'static str, mut f: impl FnMut(&mut State) -> Option<T>) -> Result<T> {
        let deadline = Instant::now() + self.shared.timeout;
        let mut st = self.shared.state.lock().map_err(|_| Error::internal(op, "bootstrap lock poisoned"))?;
        loop {
            if let Some(v) = f(&mut st) {
                self.shared.cv.notify_all();
                return Ok(v);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout { op, after: self.shared.timeout, what: "thread bootstrap".into() });
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .map_err(|_| Error::internal(op, "bootstrap lock poisoned"))?
                .0;
        }
    }
}

impl Bootstrap for ThreadBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        const OP: &str = "ThreadBootstrap::all_gather";
        let round = {
            let mut r = self.round.lock().map_err(|_| Error::internal(OP, "poisoned"))?;
            *r += 1;
            *r
        };
        let size = self.shared.size;
        let rank = self.rank;
        {
            let mut st = self.shared.state.lock().map_err(|_| Error::internal(OP, "poisoned"))?;
            let slots = st.gathers.entry(round).or_insert_with(|| vec![None; size]);
            slots[rank] = Some(mine.to_vec());
            self.shared.cv.notify_all();
        }
        self.wait_until(OP, |st| {
            let slots = st.gathers.get(&round)?;
            if slots.iter().any(|s| s.is_none()) {
                return None;
            }
            let out: Vec<Vec<u8>> = slots.iter().map(|s| s.clone().unwrap_or_default()).collect();
            let taken = st.taken.entry(round).or_insert(0);
            *taken += 1;
            if *taken == size {
                st.gathers.remove(&round);
                st.taken.remove(&round);
            }
            Some(out)
        })
    }

    fn barrier(&self) -> Result<()> {
        self.all_gather(&[]).map(|_| ())
    }

    fn timeout(&self) -> Option<Duration> {
        Some(self.shared.timeout)
    }

    fn send(&self, peer: usize, tag: u32, data: &[u8]) -> Result<()> {
        const OP: &str = "ThreadBootstrap::send";
        if peer >= self.shared.size {
            return Err(Error::invalid_arg(OP, format!("peer {peer} out of {}", self.shared.size)));
        }
        let mut st = self.shared.state.lock().map_err(|_| Error::internal(OP, "poisoned"))?;
        st.mailboxes.entry((self.rank, peer, tag)).or_default().push_back(data.to_vec());
        self.shared.cv.notify_all();
        Ok(())
    }

    fn recv(&self, peer: usize, tag: u32) -> Result<Vec<u8>> {
        const OP: &str = "ThreadBootstrap::recv";
        if peer >= self.shared.size {
            return Err(Error::invalid_arg(OP, format!("peer {peer} out of {}", self.shared.size)));
        }
        let key = (peer, self.rank, tag);
        self.wait_until(OP, |st| st.mailboxes.get_mut(&key).and_then(|q| q.pop_front()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_gather_barrier_and_p2p() {
        let group = ThreadBootstrap::group(4);
        let handles: Vec<_> = group
            .into_iter()
            .map(|b| {
                std::thread::spawn(move || {
                    let r = b.rank();
                    for round in 0..3u8 {
                        let got = b.all_gather(&vec![r as u8 + round; r + 1]).unwrap();
                        for (i, rec) in got.iter().enumerate() {
                            assert_eq!(rec, &vec![i as u8 + round; i + 1]);
                        }
                    }
                    b.barrier().unwrap();
                    let next = (r + 1) % 4;
                    let prev = (r + 3) % 4;
                    b.send(next, 7, &[r as u8]).unwrap();
                    assert_eq!(b.recv(prev, 7).unwrap(), vec![prev as u8]);
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    #[test]
    fn missing_rank_times_out() {
        let mut group = ThreadBootstrap::group_with_timeout(2, Duration::from_millis(100));
        let b0 = group.remove(0);
        let e = b0.all_gather(b"x").unwrap_err();
        assert_eq!(e.code(), crate::error::ErrorCode::Timeout);
    }
}
