//! The test binaries' logger. Negative tests provoke errors on purpose (ranks that disagree,
//! a peer that never calls, a stuck proxy) and the library logs them, as it must; a passing
//! run must not show them. `capture()` installs this logger before the library's own
//! (`hoccl::config::init_logging` leaves an installed logger in place):
//! - every record at warning level or above is kept in memory, so that a test can assert
//!   that the expected error was logged (`expect_logged`, `lines`);
//! - it is also written with `eprintln!`, which the test harness captures per test (threads
//!   that a test spawns, the library's proxies included, inherit its capture): a record
//!   shows only when its test fails, or with `--nocapture`;
//! - with `HOCCL_LOG` set, the records its filter passes go straight to stderr instead,
//!   formatted as outside the tests, whether the test passes or not.
use log::{Level, LevelFilter, Log, Metadata, Record};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

/// A kept record.
#[derive(Clone, Debug)]
pub struct Logged {
    pub level: Level,
    pub message: String,
}

/// Records kept, in order; bounded so that a runaway logger cannot exhaust memory.
static RECORDS: Mutex<Vec<Logged>> = Mutex::new(Vec::new());
const KEEP: usize = 100_000;

struct Capture {
    /// The `HOCCL_LOG` logger, when that variable is set.
    explicit: Option<env_logger::Logger>,
}

impl Log for Capture {
    fn enabled(&self, m: &Metadata) -> bool {
        m.level() <= Level::Warn || self.explicit.as_ref().is_some_and(|l| l.enabled(m))
    }
    fn log(&self, r: &Record) {
        match &self.explicit {
            Some(l) => l.log(r),
            None if r.level() <= Level::Warn => eprintln!("[{:<5} {}] {}", r.level(), r.target(), r.args()),
            None => {}
        }
        if r.level() <= Level::Warn {
            let mut v = RECORDS.lock().unwrap_or_else(|p| p.into_inner());
            if v.len() < KEEP {
                v.push(Logged { level: r.level(), message: r.args().to_string() });
            }
        }
    }
    fn flush(&self) {
        if let Some(l) = &self.explicit {
            l.flush();
        }
    }
}

/// Install the capturing logger (once per test binary; later calls do nothing). Call it
/// before the first communicator is made: the common helpers do.
pub fn capture() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let explicit = std::env::var("HOCCL_LOG")
            .ok()
            .map(|f| env_logger::Builder::new().parse_filters(&f).format_timestamp_micros().build());
        let max = explicit.as_ref().map_or(LevelFilter::Warn, |l| l.filter().max(LevelFilter::Warn));
        if log::set_boxed_logger(Box::new(Capture { explicit })).is_ok() {
            log::set_max_level(max);
        }
    });
}

/// The kept records as `LEVEL message` lines.
pub fn lines() -> Vec<String> {
    let v = RECORDS.lock().unwrap_or_else(|p| p.into_inner());
    v.iter().map(|l| format!("{} {}", l.level, l.message)).collect()
}

/// The kept lines that contain `what`.
pub fn lines_with(what: &str) -> Vec<String> {
    lines().into_iter().filter(|l| l.contains(what)).collect()
}

/// Forget the kept records (for a test binary whose parts run in sequence).
pub fn clear() {
    RECORDS.lock().unwrap_or_else(|p| p.into_inner()).clear();
}

/// Assert that a record at `level` containing `what` was kept, waiting up to 2 s for it
/// (the library may log from its own threads after the call that observed the failure).
/// Tests of one binary run in parallel and share the records: choose `what` specific to
/// the test.
pub fn expect_logged(level: Level, what: &str) {
    let t = Instant::now();
    loop {
        let found = RECORDS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|l| l.level == level && l.message.contains(what));
        if found {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(2), "no {level} record containing {what:?} was logged: {:#?}", lines());
        std::thread::sleep(Duration::from_millis(20));
    }
}
