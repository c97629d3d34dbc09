//! MPI bootstrap on rsmpi (`mpi` 0.8.2 and its raw `mpi::ffi` bindings).
//!
//! [`MpiBootstrap`] owns a private duplicate of the communicator it is made from, so hoccl's
//! control traffic never matches a message of the application. Its error handler is set to
//! `MPI_ERRORS_RETURN`, and every MPI return code is checked and turned into
//! [`Error::Mpi`] (rsmpi's safe wrappers discard return codes, so this file calls the raw
//! functions). Nothing here panics.
//!
//! # Threads
//! All MPI calls of one bootstrap are serialized behind a `Mutex`. Blocking operations are
//! started non-blocking (`MPI_Iallgather`, `MPI_Ibarrier`, `MPI_Isend`, `MPI_Improbe`) and
//! polled with the lock released between polls, so a thread waiting in `recv` never stops
//! another thread from sending through the same bootstrap. What the MPI thread level allows:
//! - `MULTIPLE`: any thread, any time.
//! - `SERIALIZED`: any thread; the application must not call MPI concurrently with a hoccl
//!   bootstrap call (hoccl serializes its own calls, not the application's).
//! - `FUNNELED` or `SINGLE`: only MPI's main thread may call; every call from another thread
//!   returns [`Error::InvalidUsage`] instead of breaking MPI.
//!
//! Collectives (`all_gather`, `barrier`) follow MPI's rule: every rank calls them in the
//! same order, so call them from one thread at a time.
//!
//! # Who initializes and finalizes MPI
//! [`MpiBootstrap::world`] initializes MPI (requesting `MPI_THREAD_MULTIPLE`) only if nobody
//! has; then hoccl owns MPI and calls `MPI_Finalize` when the last `MpiBootstrap` alive is
//! dropped (every bootstrap made while hoccl owns MPI keeps it alive). MPI cannot be
//! initialized twice in one process, so a later `world()` fails with `InvalidUsage`; a program
//! that wants MPI to outlive hoccl initializes it itself (`mpi::initialize_with_threading`,
//! whose `Universe` finalizes when *it* drops) and uses [`MpiBootstrap::from_communicator`].
//! hoccl never finalizes an MPI it did not initialize, and `MPI_Init_thread` is called
//! directly rather than through rsmpi so that its return code is checked (rsmpi's returns a
//! `Universe` whose drop would finalize, and discards the code).
//!
//! If MPI was initialized by someone else at a level below `MULTIPLE`, `world()` and the
//! other constructors still work at that level with the rules above, and say so once per
//! process: a warning on rank 0 of the first communicator, an info record on the others.
use super::Bootstrap;
use crate::error::{Error, Result};
use mpi::ffi;
use std::mem::MaybeUninit;
use std::os::raw::{c_char, c_int};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

pub use mpi::Threading;

// ---------------------------------------------------------------- process-wide state -----

/// Who initialized MPI, guarded so that `world()` and the finalizing drop never interleave.
struct InitState {
    /// hoccl called `MPI_Init_thread` in this process.
    ours: bool,
    /// The owner token shared by every live bootstrap while hoccl owns MPI.
    owner: Weak<MpiOwner>,
}

static INIT: Mutex<InitState> = Mutex::new(InitState { ours: false, owner: Weak::new() });

fn init_state() -> MutexGuard<'static, InitState> {
    // The state stays consistent even if a holder panicked (it only flips two fields).
    INIT.lock().unwrap_or_else(|p| p.into_inner())
}

/// The owner token to hold while a bootstrap lives, if hoccl owns MPI. Fails if hoccl's
/// MPI has been (or is being) finalized: its last bootstrap went away.
fn current_owner(op: &'static str) -> Result<Option<Arc<MpiOwner>>> {
    let st = init_state();
    match st.owner.upgrade() {
        Some(o) => Ok(Some(o)),
        None if st.ours => Err(Error::invalid_usage(op, "hoccl finalized MPI when its last bootstrap was dropped")),
        None => Ok(None),
    }
}

/// Exists while hoccl owns MPI and some bootstrap is alive; its drop finalizes MPI.
struct MpiOwner {
    _private: (),
}

impl Drop for MpiOwner {
    fn drop(&mut self) {
        let _state = init_state();
        match finalized("MpiOwner::drop") {
            Ok(false) => {}
            Ok(true) => return,
            Err(e) => {
                log::error!("hoccl: not finalizing MPI: {e}");
                return;
            }
        }
        if !is_thread_main().unwrap_or(true) {
            log::warn!("hoccl: finalizing MPI from a thread other than the one that initialized it");
        }
        // SAFETY: MPI is initialized and not finalized (checked under INIT), and every
        // communicator hoccl created was freed before the last owner reference went away.
        let rc = unsafe { ffi::MPI_Finalize() };
        if rc != ffi::MPI_SUCCESS as c_int {
            log::error!("hoccl: MPI_Finalize failed: {}", error_string(rc));
        }
    }
}

/// Say that MPI's thread level restricts the bootstrap, once per process (every bootstrap
/// made from then on has the same level): the level is the job's, so every rank would say
/// the same, and only rank 0 says it as a warning.
fn note_thread_level(threading: Threading, rank: usize) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let level = if rank == 0 { log::Level::Warn } else { log::Level::Info };
        log::log!(
            level,
            "hoccl: MPI thread level is {threading:?}, not Multiple: bootstrap calls are restricted (logged once, by rank 0)"
        );
    });
}

// ---------------------------------------------------------------- small checked calls ----

fn check(op: &'static str, call: &'static str, rc: c_int) -> Result<()> {
    if rc == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        log::error!("hoccl: {op}: {call} failed: {}", error_string(rc));
        Err(Error::Mpi { op, code: rc })
    }
}

/// MPI's text for an error code (for logs; errors carry the code).
fn error_string(rc: c_int) -> String {
    // Open MPI aborts the process on MPI_Error_string outside [init, finalize].
    let (mut init, mut fin): (c_int, c_int) = (0, 0);
    // SAFETY: MPI_Initialized and MPI_Finalized may be called at any time.
    let live = unsafe { ffi::MPI_Initialized(&mut init) == 0 && ffi::MPI_Finalized(&mut fin) == 0 };
    if !live || init == 0 || fin != 0 {
        return format!("MPI error {rc}");
    }
    let mut buf = [0 as c_char; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: buf holds MPI_MAX_ERROR_STRING chars as the standard requires; callable at any time.
    let ok = unsafe { ffi::MPI_Error_string(rc, buf.as_mut_ptr(), &mut len) };
    if ok != ffi::MPI_SUCCESS as c_int || len <= 0 {
        return format!("MPI error {rc}");
    }
    let bytes: Vec<u8> = buf[..(len as usize).min(buf.len())].iter().map(|&c| c as u8).collect();
    format!("{} ({rc})", String::from_utf8_lossy(&bytes))
}

fn initialized(op: &'static str) -> Result<bool> {
    let mut flag: c_int = 0;
    // SAFETY: MPI_Initialized may be called at any time, from any thread.
    check(op, "MPI_Initialized", unsafe { ffi::MPI_Initialized(&mut flag) })?;
    Ok(flag != 0)
}

fn finalized(op: &'static str) -> Result<bool> {
    let mut flag: c_int = 0;
    // SAFETY: MPI_Finalized may be called at any time, from any thread.
    check(op, "MPI_Finalized", unsafe { ffi::MPI_Finalized(&mut flag) })?;
    Ok(flag != 0)
}

fn is_thread_main() -> Result<bool> {
    let mut flag: c_int = 0;
    // SAFETY: callable from any thread once MPI is initialized (callers check that first).
    check("MpiBootstrap", "MPI_Is_thread_main", unsafe { ffi::MPI_Is_thread_main(&mut flag) })?;
    Ok(flag != 0)
}

fn threading_from_raw(level: c_int) -> Threading {
    // SAFETY: the RSMPI_THREAD_* values are constants initialized by the mpi-sys shim.
    let (single, funneled, serialized) =
        unsafe { (ffi::RSMPI_THREAD_SINGLE, ffi::RSMPI_THREAD_FUNNELED, ffi::RSMPI_THREAD_SERIALIZED) };
    // The standard orders SINGLE < FUNNELED < SERIALIZED < MULTIPLE; unknown values round down.
    if level <= single {
        Threading::Single
    } else if level <= funneled {
        Threading::Funneled
    } else if level <= serialized {
        Threading::Serialized
    } else {
        Threading::Multiple
    }
}

fn query_thread(op: &'static str) -> Result<Threading> {
    let mut level: c_int = 0;
    // SAFETY: MPI is initialized (callers check); MPI_Query_thread may be called from any thread.
    check(op, "MPI_Query_thread", unsafe { ffi::MPI_Query_thread(&mut level) })?;
    Ok(threading_from_raw(level))
}

fn require_live_mpi(op: &'static str) -> Result<()> {
    if !initialized(op)? {
        return Err(Error::invalid_usage(op, "MPI is not initialized (call MPI_Init_thread first)"));
    }
    if finalized(op)? {
        return Err(Error::invalid_usage(op, "MPI has already been finalized"));
    }
    Ok(())
}

fn c_len(op: &'static str, what: &str, n: usize) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| Error::invalid_arg(op, format!("{what} of {n} bytes exceeds MPI's int count")))
}

// ---------------------------------------------------------------- the bootstrap ---------

/// The duplicated communicator and whether an abandoned operation made it unusable.
struct Inner {
    comm: ffi::MPI_Comm,
    /// Set when an operation timed out with an MPI request still in flight (its buffers
    /// were leaked on purpose so MPI never writes into freed memory).
    broken: Option<String>,
}

// SAFETY: `MPI_Comm` is a handle (a pointer to an object owned by the MPI library) that MPI
// lets any thread use, subject to the thread level. `Inner` is only reached through the
// `Mutex` in `MpiBootstrap`, so at most one thread uses the handle at a time, and
// `MpiBootstrap::lock` refuses calls from non-main threads when the level is below
// SERIALIZED. That makes `MpiBootstrap` (and the `Mutex<Inner>` in it) Send + Sync soundly.
unsafe impl Send for Inner {}

/// [`Bootstrap`] over MPI. See the module documentation for thread and lifetime rules.
pub struct MpiBootstrap {
    inner: Mutex<Inner>,
    rank: usize,
    size: usize,
    /// Largest tag MPI accepts on this communicator (`MPI_TAG_UB`, at least 32767).
    tag_ub: u32,
    threading: Threading,
    timeout: Option<Duration>,
    /// Keeps MPI initialized while this bootstrap lives, when hoccl owns MPI. Declared last:
    /// fields drop after `Drop::drop` has freed the communicator.
    _owner: Option<Arc<MpiOwner>>,
}

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<MpiBootstrap>();
};

impl MpiBootstrap {
    /// A bootstrap over (a duplicate of) `MPI_COMM_WORLD`, initializing MPI with
    /// `MPI_THREAD_MULTIPLE` requested if nobody has. See the module docs for finalization.
    pub fn world() -> Result<MpiBootstrap> {
        const OP: &str = "MpiBootstrap::world";
        let owner = {
            let mut st = init_state();
            if let Some(o) = st.owner.upgrade() {
                Some(o)
            } else if st.ours {
                return Err(Error::invalid_usage(
                    OP,
                    "hoccl initialized MPI and finalized it when its last bootstrap was dropped; MPI cannot be \
                     initialized twice (keep a bootstrap alive, or initialize MPI yourself)",
                ));
            } else if finalized(OP)? {
                return Err(Error::invalid_usage(OP, "MPI has already been finalized"));
            } else if initialized(OP)? {
                None
            } else {
                let mut provided: c_int = 0;
                // SAFETY: MPI is neither initialized nor finalized (checked above under INIT,
                // which also keeps two hoccl threads from initializing at once); null
                // argc/argv are allowed by the standard.
                let rc = unsafe {
                    ffi::MPI_Init_thread(
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        ffi::RSMPI_THREAD_MULTIPLE,
                        &mut provided,
                    )
                };
                check(OP, "MPI_Init_thread", rc)?;
                st.ours = true;
                let o = Arc::new(MpiOwner { _private: () });
                st.owner = Arc::downgrade(&o);
                log::debug!("hoccl: initialized MPI, thread level {:?}", threading_from_raw(provided));
                Some(o)
            }
        };
        // SAFETY: reading the constant world handle of an initialized MPI.
        let world = unsafe { ffi::RSMPI_COMM_WORLD };
        Self::dup_of(OP, world, owner)
    }

    /// A bootstrap over a duplicate of `comm` (an intra-communicator), so hoccl's messages
    /// never mix with the application's traffic on `comm`.
    pub fn from_communicator(comm: &impl mpi::traits::Communicator) -> Result<MpiBootstrap> {
        const OP: &str = "MpiBootstrap::from_communicator";
        require_live_mpi(OP)?;
        let owner = current_owner(OP)?;
        Self::dup_of(OP, comm.as_raw(), owner)
    }

    /// A bootstrap over a duplicate of the communicator whose Fortran handle is `handle`:
    /// what C or C++ gets from `MPI_Comm_c2f(comm)`. MPI must be initialized.
    pub fn from_fortran(handle: i32) -> Result<MpiBootstrap> {
        const OP: &str = "MpiBootstrap::from_fortran";
        require_live_mpi(OP)?;
        // SAFETY: MPI is initialized; MPI_Comm_f2c never raises an error, it maps an unknown
        // handle to an invalid C handle (Open MPI: a null pointer).
        let comm = unsafe { ffi::MPI_Comm_f2c(handle) };
        // SAFETY: reading a constant handle.
        if comm == unsafe { ffi::RSMPI_COMM_NULL } || is_zero_handle(comm) {
            return Err(Error::invalid_arg(OP, format!("Fortran handle {handle} is not a communicator")));
        }
        let owner = current_owner(OP)?;
        Self::dup_of(OP, comm, owner)
    }

    /// Operations that wait longer than `timeout` fail with [`Error::Timeout`] (default:
    /// wait forever, as MPI does). A `recv` that times out leaves the bootstrap usable; a
    /// collective or send that times out leaves it unusable (its request is abandoned).
    pub fn with_timeout(mut self, timeout: Duration) -> MpiBootstrap {
        self.timeout = Some(timeout);
        self
    }

    /// The MPI thread level in force.
    pub fn threading(&self) -> Threading {
        self.threading
    }

    /// Whether hoccl initialized MPI (and so will finalize it after the last bootstrap).
    pub fn owns_mpi(&self) -> bool {
        self._owner.is_some()
    }

    /// Largest tag `send`/`recv` accept.
    pub fn max_tag(&self) -> u32 {
        self.tag_ub
    }

    fn dup_of(op: &'static str, comm: ffi::MPI_Comm, owner: Option<Arc<MpiOwner>>) -> Result<MpiBootstrap> {
        let threading = query_thread(op)?;
        if threading < Threading::Serialized && !is_thread_main()? {
            return Err(Error::invalid_usage(op, format!("MPI thread level {threading:?}: call from MPI's main thread")));
        }
        // SAFETY: reading a constant handle.
        if comm == unsafe { ffi::RSMPI_COMM_NULL } {
            return Err(Error::invalid_arg(op, "MPI_COMM_NULL"));
        }
        let mut inter: c_int = 0;
        // SAFETY: `comm` is a live communicator handle (from rsmpi, MPI_Comm_f2c or the world).
        check(op, "MPI_Comm_test_inter", unsafe { ffi::MPI_Comm_test_inter(comm, &mut inter) })?;
        if inter != 0 {
            return Err(Error::invalid_arg(op, "an inter-communicator cannot bootstrap hoccl"));
        }
        // SAFETY: reading a constant handle.
        let mut dup = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: `comm` is live; `dup` receives the new handle.
        check(op, "MPI_Comm_dup", unsafe { ffi::MPI_Comm_dup(comm, &mut dup) })?;
        let boot = MpiBootstrap {
            inner: Mutex::new(Inner { comm: dup, broken: None }),
            rank: 0,
            size: 0,
            tag_ub: 32767,
            threading,
            timeout: None,
            _owner: owner,
        };
        // From here on `boot`'s drop frees `dup` on any error.
        boot.finish_setup(op)
    }

    fn finish_setup(mut self, op: &'static str) -> Result<MpiBootstrap> {
        let comm = match self.inner.get_mut() {
            Ok(i) => i.comm,
            Err(_) => return Err(Error::internal(op, "MPI bootstrap lock poisoned")),
        };
        // SAFETY: `comm` is our live duplicate; MPI_ERRORS_RETURN is a constant handle.
        check(op, "MPI_Comm_set_errhandler", unsafe { ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN) })?;
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: `comm` is live; outputs are plain ints.
        check(op, "MPI_Comm_rank", unsafe { ffi::MPI_Comm_rank(comm, &mut rank) })?;
        // SAFETY: as above.
        check(op, "MPI_Comm_size", unsafe { ffi::MPI_Comm_size(comm, &mut size) })?;
        self.rank = usize::try_from(rank).map_err(|_| Error::internal(op, format!("MPI rank {rank}")))?;
        self.size = usize::try_from(size).map_err(|_| Error::internal(op, format!("MPI size {size}")))?;
        if self.threading < Threading::Multiple {
            note_thread_level(self.threading, self.rank);
        }
        let mut value: *mut c_int = std::ptr::null_mut();
        let mut flag: c_int = 0;
        // SAFETY: for MPI_TAG_UB the attribute value is a pointer to an int owned by MPI,
        // written into `value`.
        let rc = unsafe {
            ffi::MPI_Comm_get_attr(comm, ffi::MPI_TAG_UB as c_int, (&mut value as *mut *mut c_int).cast(), &mut flag)
        };
        check(op, "MPI_Comm_get_attr(MPI_TAG_UB)", rc)?;
        if flag != 0 && !value.is_null() {
            // SAFETY: MPI returned a valid pointer to the attribute's int (checked non-null).
            let ub = unsafe { *value };
            self.tag_ub = u32::try_from(ub).unwrap_or(32767).max(32767);
        }
        Ok(self)
    }

    /// Lock the communicator for one MPI call, refusing calls MPI would not allow now.
    fn lock(&self, op: &'static str) -> Result<MutexGuard<'_, Inner>> {
        if self.threading < Threading::Serialized && !is_thread_main()? {
            return Err(Error::invalid_usage(op, format!("MPI thread level {:?}: call from MPI's main thread", self.threading)));
        }
        let g = self.inner.lock().map_err(|_| Error::internal(op, "MPI bootstrap lock poisoned"))?;
        if let Some(why) = &g.broken {
            return Err(Error::invalid_usage(op, format!("bootstrap unusable after an earlier failure: {why}")));
        }
        if finalized(op)? {
            return Err(Error::invalid_usage(op, "MPI has been finalized"));
        }
        Ok(g)
    }

    fn deadline(&self) -> Option<Instant> {
        self.timeout.map(|t| Instant::now() + t)
    }

    /// Poll `req` to completion, taking the lock only for each `MPI_Test`. On failure the
    /// request may still be in flight: the caller must leak the buffers it references
    /// (see [`abandon`](Self::abandon)).
    fn wait(&self, op: &'static str, req: &mut ffi::MPI_Request, deadline: Option<Instant>) -> Result<()> {
        let mut backoff = Backoff::default();
        loop {
            {
                let _locked = self.lock(op)?;
                let mut done: c_int = 0;
                // SAFETY: `req` is a live request on our communicator; the status is ignored.
                check(op, "MPI_Test", unsafe { ffi::MPI_Test(req, &mut done, ffi::RSMPI_STATUS_IGNORE) })?;
                if done != 0 {
                    return Ok(());
                }
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::Timeout {
                    op,
                    after: self.timeout.unwrap_or_default(),
                    what: "MPI bootstrap: a peer did not take part".into(),
                });
            }
            backoff.pause();
        }
    }

    /// Give up on an in-flight request: leak `keep` (MPI may still read or write it) and
    /// mark the bootstrap unusable.
    fn abandon<T>(&self, e: &Error, keep: T) {
        std::mem::forget(keep);
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.broken = Some(e.to_string());
    }

    fn check_peer(&self, op: &'static str, peer: usize, tag: u32) -> Result<(c_int, c_int)> {
        if peer >= self.size {
            return Err(Error::invalid_arg(op, format!("peer {peer} out of {} ranks", self.size)));
        }
        if tag > self.tag_ub {
            return Err(Error::invalid_arg(op, format!("tag {tag} above MPI_TAG_UB {}", self.tag_ub)));
        }
        // Both fit: peer < size (a c_int) and tag <= tag_ub (from a c_int).
        Ok((peer as c_int, tag as c_int))
    }
}

impl Bootstrap for MpiBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        const OP: &str = "MpiBootstrap::all_gather";
        let deadline = self.deadline();
        let n = self.size;
        // Owned copies: if a wait fails these are leaked, never freed under MPI's feet. Both
        // buffers get a real allocation even when empty: two empty Vecs share one dangling
        // address, and MPI rejects a send buffer equal to the receive buffer (MPI_ERR_ARG).
        let mut send: Vec<u8> = Vec::with_capacity(mine.len().max(1));
        send.extend_from_slice(mine);
        let my_len: Box<c_int> = Box::new(c_len(OP, "record", mine.len())?);
        let mut lens: Vec<c_int> = vec![0; n];

        // Phase 1: every rank's record length.
        let mut req = null_request();
        {
            let g = self.lock(OP)?;
            // SAFETY: `my_len` holds 1 int and `lens` n ints; both stay alive until the request
            // completes or are leaked by `abandon`. The communicator is live under the lock.
            let rc = unsafe {
                ffi::MPI_Iallgather(
                    (&*my_len as *const c_int).cast(),
                    1,
                    ffi::RSMPI_INT32_T,
                    lens.as_mut_ptr().cast(),
                    1,
                    ffi::RSMPI_INT32_T,
                    g.comm,
                    &mut req,
                )
            };
            check(OP, "MPI_Iallgather", rc)?;
        }
        if let Err(e) = self.wait(OP, &mut req, deadline) {
            self.abandon(&e, (my_len, lens, send));
            return Err(e);
        }

        // Every rank computes the same displacements, so every rank fails alike on overflow.
        let mut displs: Vec<c_int> = Vec::with_capacity(n);
        let mut total: usize = 0;
        for (r, &l) in lens.iter().enumerate() {
            let l = usize::try_from(l).map_err(|_| Error::Remote { op: OP, peer: r, what: format!("record length {l}") })?;
            displs.push(c_len(OP, "all-gathered records", total)?);
            total += l;
        }
        c_len(OP, "all-gathered records", total)?;

        // Phase 2: the records themselves.
        let mut recv: Vec<u8> = Vec::with_capacity(total.max(1));
        recv.resize(total, 0);
        let mut req = null_request();
        {
            let g = self.lock(OP)?;
            // SAFETY: `send` holds my_len bytes, `recv` total bytes laid out by `lens`/`displs`
            // (n entries each); all stay alive until completion or are leaked by `abandon`.
            let rc = unsafe {
                ffi::MPI_Iallgatherv(
                    send.as_ptr().cast(),
                    *my_len,
                    ffi::RSMPI_UINT8_T,
                    recv.as_mut_ptr().cast(),
                    lens.as_ptr(),
                    displs.as_ptr(),
                    ffi::RSMPI_UINT8_T,
                    g.comm,
                    &mut req,
                )
            };
            check(OP, "MPI_Iallgatherv", rc)?;
        }
        if let Err(e) = self.wait(OP, &mut req, deadline) {
            self.abandon(&e, (my_len, lens, displs, send, recv));
            return Err(e);
        }
        let mut out = Vec::with_capacity(n);
        for (&d, &l) in displs.iter().zip(&lens) {
            out.push(recv[d as usize..d as usize + l as usize].to_vec());
        }
        Ok(out)
    }

    fn barrier(&self) -> Result<()> {
        const OP: &str = "MpiBootstrap::barrier";
        let deadline = self.deadline();
        let mut req = null_request();
        {
            let g = self.lock(OP)?;
            // SAFETY: live communicator under the lock; `req` receives the request.
            check(OP, "MPI_Ibarrier", unsafe { ffi::MPI_Ibarrier(g.comm, &mut req) })?;
        }
        if let Err(e) = self.wait(OP, &mut req, deadline) {
            self.abandon(&e, ());
            return Err(e);
        }
        Ok(())
    }

    fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    fn send(&self, peer: usize, tag: u32, data: &[u8]) -> Result<()> {
        const OP: &str = "MpiBootstrap::send";
        let (dest, tag) = self.check_peer(OP, peer, tag)?;
        let count = c_len(OP, "message", data.len())?;
        let deadline = self.deadline();
        let buf: Vec<u8> = data.to_vec();
        let mut req = null_request();
        {
            let g = self.lock(OP)?;
            // SAFETY: `buf` holds `count` bytes and outlives the request (or is leaked).
            let rc = unsafe { ffi::MPI_Isend(buf.as_ptr().cast(), count, ffi::RSMPI_UINT8_T, dest, tag, g.comm, &mut req) };
            check(OP, "MPI_Isend", rc)?;
        }
        if let Err(e) = self.wait(OP, &mut req, deadline) {
            self.abandon(&e, buf);
            return Err(e);
        }
        Ok(())
    }

    fn recv(&self, peer: usize, tag: u32) -> Result<Vec<u8>> {
        const OP: &str = "MpiBootstrap::recv";
        let (source, tag) = self.check_peer(OP, peer, tag)?;
        let deadline = self.deadline();
        let mut backoff = Backoff::default();
        loop {
            {
                let g = self.lock(OP)?;
                let mut found: c_int = 0;
                // SAFETY: reading a constant handle.
                let mut msg = unsafe { ffi::RSMPI_MESSAGE_NULL };
                let mut status = MaybeUninit::<ffi::MPI_Status>::zeroed();
                // SAFETY: live communicator under the lock; outputs are valid for writes.
                let rc = unsafe { ffi::MPI_Improbe(source, tag, g.comm, &mut found, &mut msg, status.as_mut_ptr()) };
                check(OP, "MPI_Improbe", rc)?;
                if found != 0 {
                    // SAFETY: MPI_Improbe filled the status when it found a message.
                    let status = unsafe { status.assume_init() };
                    let mut count: c_int = 0;
                    // SAFETY: `status` describes the matched message.
                    check(OP, "MPI_Get_count", unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count) })?;
                    let len = usize::try_from(count)
                        .map_err(|_| Error::Remote { op: OP, peer, what: format!("message of {count} bytes") })?;
                    let mut buf = vec![0u8; len];
                    // SAFETY: `msg` is the message matched above (only this call can receive
                    // it); `buf` holds exactly its `count` bytes. Mrecv completes because the
                    // message is already matched.
                    let rc = unsafe {
                        ffi::MPI_Mrecv(buf.as_mut_ptr().cast(), count, ffi::RSMPI_UINT8_T, &mut msg, ffi::RSMPI_STATUS_IGNORE)
                    };
                    check(OP, "MPI_Mrecv", rc)?;
                    return Ok(buf);
                }
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::Timeout {
                    op: OP,
                    after: self.timeout.unwrap_or_default(),
                    what: format!("no message from rank {peer} with tag {tag}"),
                });
            }
            backoff.pause();
        }
    }
}

impl Drop for MpiBootstrap {
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(|p| p.into_inner());
        // SAFETY: reading a constant handle.
        if inner.comm == unsafe { ffi::RSMPI_COMM_NULL } {
            return;
        }
        match finalized("MpiBootstrap::drop") {
            Ok(false) => {}
            // After MPI_Finalize nothing may be freed (the application finalized first).
            Ok(true) | Err(_) => return,
        }
        if self.threading < Threading::Serialized && !is_thread_main().unwrap_or(false) {
            log::warn!("hoccl: leaking an MPI communicator dropped off MPI's main thread at level {:?}", self.threading);
            return;
        }
        // SAFETY: `comm` is our own duplicate, still live; any request abandoned on it keeps
        // its (leaked) buffers, and MPI_Comm_free lets pending operations complete.
        let rc = unsafe { ffi::MPI_Comm_free(&mut inner.comm) };
        if rc != ffi::MPI_SUCCESS as c_int {
            log::warn!("hoccl: MPI_Comm_free failed: {}", error_string(rc));
        }
        // `_owner` drops next and finalizes MPI if this was hoccl's last bootstrap.
    }
}

/// Whether a handle is all-zero bits (Open MPI's "invalid handle" from `MPI_Comm_f2c`).
fn is_zero_handle(comm: ffi::MPI_Comm) -> bool {
    // SAFETY: `MPI_Comm` is a plain handle (a pointer in Open MPI, an int in MPICH) for which
    // all-zero bits is a valid value to compare against.
    comm == unsafe { std::mem::zeroed::<ffi::MPI_Comm>() }
}

fn null_request() -> ffi::MPI_Request {
    // SAFETY: reading a constant handle.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// Polling pace: spin briefly, then yield, then sleep, so a long wait costs little CPU
/// (several ranks often share one core in tests) and a short one little latency.
#[derive(Default)]
struct Backoff {
    polls: u32,
}

impl Backoff {
    fn pause(&mut self) {
        self.polls = self.polls.saturating_add(1);
        if self.polls < 16 {
            std::hint::spin_loop();
        } else if self.polls < 256 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(if self.polls < 2048 { 20 } else { 200 }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // These run without mpirun and never initialize MPI (one process can only do it once;
    // the multi-rank checks live in examples/bootstrap_check.rs).

    #[test]
    fn fortran_handle_before_init_is_an_error() {
        let e = MpiBootstrap::from_fortran(0).err().map(|e| e.code());
        assert_eq!(e, Some(crate::error::ErrorCode::InvalidUsage));
    }

    #[test]
    fn thread_levels_map_in_order() {
        // SAFETY: reading constants of the mpi-sys shim.
        let raw = unsafe {
            [ffi::RSMPI_THREAD_SINGLE, ffi::RSMPI_THREAD_FUNNELED, ffi::RSMPI_THREAD_SERIALIZED, ffi::RSMPI_THREAD_MULTIPLE]
        };
        let levels: Vec<Threading> = raw.iter().map(|&l| threading_from_raw(l)).collect();
        assert_eq!(levels, [Threading::Single, Threading::Funneled, Threading::Serialized, Threading::Multiple]);
    }

    #[test]
    fn error_strings_never_abort_before_init() {
        assert_eq!(error_string(ffi::MPI_ERR_ARG as c_int), "MPI error 13");
    }
}
