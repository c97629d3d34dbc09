//! Says so when a proxy thread stops making progress with operations pending.
//!
//! The proxy never waits for the GPU itself, but its driver calls (copies, events) take a
//! lock of the CUDA context that other threads of the process may hold for a long time:
//! `cuMemFree` holds it while it waits for every stream, including the stream of a pending
//! collective that only this proxy can finish, so the group hangs for good. A proxy stuck
//! like that cannot time its operations out itself; without this watchdog the user would
//! see a silent hang.
//! One process-wide thread watches every engine's heartbeat (the proxy loop's iteration
//! count). Once a proxy has been stuck for the communicator's timeout with operations
//! pending, it sets the communicator's async error (a `Timeout` naming the likely cause;
//! those operations would time out anyway) and logs it, and it logs a note when the proxy
//! moves again. It makes no device call.
use super::Shared;
use crate::error::Error;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, Weak};
use std::time::{Duration, Instant};

/// What `StallCheck::observe` reports.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Stall {
    /// No heartbeat for `after` with operations pending (reported once per stall).
    Stuck { after: Duration },
    /// A stuck proxy beats again after `after`.
    Resumed { after: Duration },
}

/// One proxy's stall state: pure, fed with the heartbeat, the pending count and the time.
pub(super) struct StallCheck {
    limit: Duration,
    beat: u64,
    since: Instant,
    reported: bool,
}

impl StallCheck {
    pub(super) fn new(limit: Duration, beat: u64, now: Instant) -> Self {
        StallCheck { limit, beat, since: now, reported: false }
    }

    pub(super) fn observe(&mut self, beat: u64, pending: u64, now: Instant) -> Option<Stall> {
        if beat != self.beat {
            let was = std::mem::replace(&mut self.reported, false);
            let after = now.saturating_duration_since(self.since);
            self.beat = beat;
            self.since = now;
            return was.then_some(Stall::Resumed { after });
        }
        if pending == 0 {
            // Idle proxies beat too (every 20 ms); a still beat with nothing pending is not
            // a stall of any operation. Start counting afresh.
            self.since = now;
            return None;
        }
        let after = now.saturating_duration_since(self.since);
        if !self.reported && after >= self.limit {
            self.reported = true;
            return Some(Stall::Stuck { after });
        }
        None
    }
}

struct Watched {
    shared: Weak<Shared>,
    rank: usize,
    check: StallCheck,
}

static WATCHED: Mutex<Vec<Watched>> = Mutex::new(Vec::new());

/// How often the watchdog looks.
const TICK: Duration = Duration::from_millis(500);

/// Watch the proxy of `shared` (rank `rank`), reporting stalls of `limit` or more.
pub(super) fn watch(shared: &std::sync::Arc<Shared>, rank: usize, limit: Duration) {
    let check = StallCheck::new(limit, shared.heartbeat.load(Ordering::Relaxed), Instant::now());
    WATCHED.lock().unwrap_or_else(|e| e.into_inner()).push(Watched { shared: std::sync::Arc::downgrade(shared), rank, check });
    start_thread();
}

/// Start the watchdog thread unless it runs (a failed start is tried again at the next watch).
fn start_thread() {
    use std::sync::atomic::AtomicBool;
    static RUNNING: AtomicBool = AtomicBool::new(false);
    if RUNNING.swap(true, Ordering::AcqRel) {
        return;
    }
    let spawned = std::thread::Builder::new().name("hoccl-watchdog".into()).spawn(|| loop {
        std::thread::sleep(TICK);
        let now = Instant::now();
        let mut w = WATCHED.lock().unwrap_or_else(|e| e.into_inner());
        w.retain_mut(|x| {
            let Some(sh) = x.shared.upgrade() else { return false };
            let pending = sh.pending();
            match x.check.observe(sh.heartbeat.load(Ordering::Relaxed), pending, now) {
                Some(Stall::Stuck { after }) => {
                    let e = Error::Timeout {
                        op: "hoccl proxy",
                        after,
                        what: format!(
                            "rank {}: the proxy thread has made no progress with {pending} operation(s) pending: it is blocked, most likely in a CUDA driver call. \
                             The usual cause is another thread of this process waiting for the GPU inside the driver (a synchronous copy into pageable memory such as torch's .item()/.cpu(), or cudaFree/cuMemFree) while a collective is pending; \
                             that call waits for the collective's stream while holding the lock the proxy needs (see the README, \"Waiting inside the driver while a collective is pending\"). \
                             abort() releases the streams",
                            x.rank
                        ),
                    };
                    // The communicator's async error (a monitor thread can abort it); these
                    // operations time out anyway.
                    sh.report(e);
                }
                Some(Stall::Resumed { after }) => {
                    log::warn!("hoccl: rank {}: the proxy thread moves again after {:.1} s", x.rank, after.as_secs_f64())
                }
                None => {}
            }
            true
        });
    });
    if let Err(e) = spawned {
        RUNNING.store(false, Ordering::Release);
        log::warn!("hoccl: no watchdog thread ({e}); a stuck proxy will not be reported");
    }
}

#[cfg(test)]
mod tests {
    use super::{Stall, StallCheck};
    use std::time::{Duration, Instant};

    #[test]
    fn a_still_heartbeat_with_work_pending_is_reported_once_then_its_end() {
        let t0 = Instant::now();
        let s = |ms: u64| t0 + Duration::from_millis(ms);
        let mut c = StallCheck::new(Duration::from_secs(10), 7, t0);
        assert_eq!(c.observe(8, 1, s(500)), None, "beating");
        assert_eq!(c.observe(8, 1, s(5_000)), None, "still for 4.5 s: under the limit");
        assert_eq!(c.observe(8, 1, s(10_500)), Some(Stall::Stuck { after: Duration::from_secs(10) }));
        assert_eq!(c.observe(8, 1, s(20_000)), None, "reported once");
        assert_eq!(c.observe(9, 0, s(21_000)), Some(Stall::Resumed { after: Duration::from_millis(20_500) }));
        assert_eq!(c.observe(10, 1, s(21_500)), None, "beating again, nothing to say");
    }

    #[test]
    fn nothing_pending_is_never_a_stall() {
        let t0 = Instant::now();
        let mut c = StallCheck::new(Duration::from_secs(1), 0, t0);
        for k in 1..50 {
            assert_eq!(c.observe(0, 0, t0 + Duration::from_secs(k)), None);
        }
        // Work arrives: the limit counts from the last observation without work.
        assert_eq!(c.observe(0, 2, t0 + Duration::from_millis(49_500)), None);
        assert_eq!(c.observe(0, 2, t0 + Duration::from_millis(50_000)), Some(Stall::Stuck { after: Duration::from_secs(1) }));
    }
}
