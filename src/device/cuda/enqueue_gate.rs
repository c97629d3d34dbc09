//! One enqueueing driver call at a time per CUDA context, when several hoccl devices share
//! it (`HOCCL_SERIAL_ENQUEUE`, default `auto`).
//!
//! On the H200 (driver 580), when one thread enqueues a kernel or a stream write while other
//! threads of the process enqueue `cuStreamWaitValue64` waits on their own streams of the
//! same context, the first thread's stream sometimes does not run until those waits are
//! released; with every enqueue under one lock, or from one thread, it always runs
//! (`examples/wait_probe.rs race` shows it; figures in `docs/results/`). Several ranks in
//! one process hit exactly that: a Broadcast root's fill waits for the other
//! ranks' collective, which waits for the fill.
//! So while two or more hoccl device objects are open on one GPU in this process (several
//! ranks, one per thread), every enqueueing call of the CUDA backend (stream writes and
//! waits, async copies, event records, kernel launches) holds its context's gate for the
//! call's duration, a few microseconds. With one device per GPU (one rank per process, the
//! production shape) the gate is open and costs an atomic load per call: there the proxy
//! thread's copies run beside the application thread's enqueues, and holding both to one
//! at a time would add microseconds to every collective's launch cost (`docs/results/`).
//!
//! A driver call that blocks (a stream whose command queue is full, a driver lock held by a
//! free) must not stop the others: a caller that has waited [`GATE_WAIT`] for the gate goes
//! ahead without it, and so does every caller after it until the slow call returns. That keeps
//! the gate from ever turning a delay into a deadlock; while it is bypassed, enqueues may
//! overlap again.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a caller waits for the gate before going ahead without it: hundreds of times
/// an enqueue's few microseconds, and short, because a holder blocked in the driver is
/// common under back-pressure: an enqueue on a stream whose command queue is full waits
/// in the driver until the stream's earlier collectives complete, which needs the other
/// ranks' enqueues, and every such stall costs the full wait (`tests/collectives.rs`
/// `back_to_back` with 4 thread ranks stalls like that many times per run).
pub(crate) const GATE_WAIT: Duration = Duration::from_millis(2);
/// How long a caller spins before it sleeps (an enqueue takes a few microseconds; a wake-up
/// from a futex costs tens).
const SPIN: Duration = Duration::from_micros(50);

/// `HOCCL_SERIAL_ENQUEUE`: `auto` (None): closed while two or more devices share the
/// context; `1`: always; `0`: never.
pub(crate) type Mode = Option<bool>;

/// The gate of one context.
pub(crate) struct EnqueueGate {
    mode: Mode,
    /// hoccl device objects open on this context (`CudaDevice::open` / drop).
    users: AtomicUsize,
    /// A call holds the gate.
    busy: AtomicBool,
    /// The holder has held it longer than `GATE_WAIT`: callers go ahead without it until
    /// the holder returns.
    bypassed: AtomicBool,
    /// Callers asleep on `freed` (the holder wakes one only when there are any).
    sleepers: Mutex<usize>,
    freed: Condvar,
    /// What the log line names (the GPU's ordinal).
    ordinal: usize,
}

/// Held across one enqueueing driver call; releases the gate on drop. Empty when the gate
/// is open or was bypassed.
#[must_use]
pub(crate) struct EnqueueGuard<'a> {
    gate: Option<&'a EnqueueGate>,
}

impl EnqueueGate {
    fn new(ordinal: usize, mode: Mode) -> EnqueueGate {
        EnqueueGate {
            mode,
            users: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            bypassed: AtomicBool::new(false),
            sleepers: Mutex::new(0),
            freed: Condvar::new(),
            ordinal,
        }
    }

    /// A device object opened on (`+1`) or left (`-1`) this context.
    pub(crate) fn user(&self, opened: bool) {
        if opened {
            self.users.fetch_add(1, SeqCst);
        } else {
            let _ = self.users.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1));
        }
    }

    /// Whether callers take the gate now.
    fn closed(&self) -> bool {
        self.mode.unwrap_or_else(|| self.users.load(SeqCst) >= 2)
    }

    fn try_take(&self) -> bool {
        self.busy.compare_exchange(false, true, SeqCst, SeqCst).is_ok()
    }

    /// Wait for the gate (at most `wait`) and hold it until the guard drops; `op` names the
    /// call in the log line (info, once per process) when the holder is bypassed.
    pub(crate) fn enter_within(&self, op: &'static str, wait: Duration) -> EnqueueGuard<'_> {
        if !self.closed() {
            return EnqueueGuard { gate: None };
        }
        let t0 = Instant::now();
        loop {
            if self.try_take() {
                return EnqueueGuard { gate: Some(self) };
            }
            if self.bypassed.load(SeqCst) {
                return EnqueueGuard { gate: None };
            }
            if t0.elapsed() >= SPIN.min(wait) {
                break;
            }
            for _ in 0..32 {
                std::hint::spin_loop();
            }
        }
        let deadline = t0 + wait;
        let mut sleepers = self.sleepers.lock().unwrap_or_else(|e| e.into_inner());
        *sleepers += 1;
        let got = loop {
            if self.try_take() {
                break true;
            }
            if self.bypassed.load(SeqCst) {
                break false;
            }
            let now = Instant::now();
            if now >= deadline {
                self.bypassed.store(true, SeqCst);
                static NOTED: AtomicBool = AtomicBool::new(false);
                if !NOTED.swap(true, SeqCst) {
                    log::info!(
                        "hoccl: {op} waited {wait:?} for GPU {}'s enqueue gate: the call holding it is blocked \
                         in the driver; enqueueing without the gate until it returns (HOCCL_SERIAL_ENQUEUE)",
                        self.ordinal
                    );
                }
                break false;
            }
            // The 1 ms cap only bounds the cost of a wake-up missed between a holder's
            // release and this caller's sleep.
            let nap = (deadline - now).min(Duration::from_millis(1));
            sleepers = match self.freed.wait_timeout(sleepers, nap) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        };
        *sleepers -= 1;
        EnqueueGuard { gate: got.then_some(self) }
    }

    pub(crate) fn enter(&self, op: &'static str) -> EnqueueGuard<'_> {
        self.enter_within(op, GATE_WAIT)
    }
}

impl EnqueueGuard<'_> {
    /// A guard that holds nothing (no gate).
    pub(crate) fn none() -> EnqueueGuard<'static> {
        EnqueueGuard { gate: None }
    }

    /// Whether this guard holds its gate (tests).
    #[cfg(test)]
    fn holds(&self) -> bool {
        self.gate.is_some()
    }
}

impl Drop for EnqueueGuard<'_> {
    fn drop(&mut self) {
        if let Some(g) = self.gate {
            g.bypassed.store(false, SeqCst);
            g.busy.store(false, SeqCst);
            let sleepers = g.sleepers.lock().unwrap_or_else(|e| e.into_inner());
            if *sleepers > 0 {
                g.freed.notify_one();
            }
        }
    }
}

/// The gate of GPU `ordinal`'s primary context, shared by every device object of the
/// process on that GPU; None when `HOCCL_SERIAL_ENQUEUE=0`. The first call's mode stays.
pub(crate) fn for_ordinal(ordinal: usize, mode: Mode) -> Option<Arc<EnqueueGate>> {
    static GATES: OnceLock<Mutex<HashMap<usize, Arc<EnqueueGate>>>> = OnceLock::new();
    if mode == Some(false) {
        return None;
    }
    let mut m = GATES.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    Some(m.entry(ordinal).or_insert_with(|| Arc::new(EnqueueGate::new(ordinal, mode))).clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_holder_at_a_time() {
        let gate = Arc::new(EnqueueGate::new(0, Some(true)));
        let inside = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..4)
            .map(|i| {
                let (gate, inside, most) = (gate.clone(), inside.clone(), most.clone());
                std::thread::spawn(move || {
                    for k in 0..200 {
                        let g = gate.enter_within("test", Duration::from_secs(10));
                        assert!(g.holds());
                        let n = inside.fetch_add(1, SeqCst) + 1;
                        most.fetch_max(n, SeqCst);
                        // Holds short and long (past the spin, so callers also sleep).
                        std::thread::sleep(Duration::from_micros(if (i + k) % 7 == 0 { 200 } else { 5 }));
                        inside.fetch_sub(1, SeqCst);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(most.load(SeqCst), 1, "two callers held the gate at once");
    }

    #[test]
    fn a_blocked_holder_is_bypassed_then_the_gate_works_again() {
        let gate = EnqueueGate::new(3, Some(true));
        let held = gate.enter_within("test", Duration::from_millis(5));
        assert!(held.holds());
        let t = Instant::now();
        let late = gate.enter_within("test", Duration::from_millis(30));
        assert!(!late.holds(), "a caller after the wait must go ahead without the gate");
        assert!(t.elapsed() >= Duration::from_millis(30));
        // While the holder is still inside, later callers do not wait at all.
        let t = Instant::now();
        assert!(!gate.enter_within("test", Duration::from_secs(5)).holds());
        assert!(t.elapsed() < Duration::from_secs(1));
        drop(late);
        drop(held);
        let again = gate.enter_within("test", Duration::from_millis(5));
        assert!(again.holds(), "the gate is held normally once the slow call returned");
        drop(again);
        assert!(gate.enter_within("test", Duration::from_millis(5)).holds());
    }

    #[test]
    fn auto_closes_with_two_devices() {
        let gate = EnqueueGate::new(1, None);
        assert!(!gate.enter("test").holds(), "no device: open");
        gate.user(true);
        assert!(!gate.enter("test").holds(), "one device: open");
        gate.user(true);
        assert!(gate.enter("test").holds(), "two devices: one call at a time");
        gate.user(false);
        assert!(!gate.enter("test").holds());
        let never = EnqueueGate::new(1, Some(false));
        never.user(true);
        never.user(true);
        assert!(!never.enter("test").holds());
    }

    #[test]
    fn shared_per_ordinal_and_none_when_off() {
        let a = for_ordinal(7, None).unwrap();
        let b = for_ordinal(7, None).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &for_ordinal(8, None).unwrap()));
        assert!(for_ordinal(7, Some(false)).is_none());
        assert!(!EnqueueGuard::none().holds());
    }
}
