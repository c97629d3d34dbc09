//! Communicator handles, the calling thread's state (last error, open group) and the
//! creation paths (unique id, one process's clique, split, shrink).
//!
//! An `ncclComm_t` is not a pointer to anything: as hoccl's C ABI does, it is the id of an
//! entry in a process-wide registry, never reused, so a destroyed handle is an error value
//! (`ncclInvalidUsage`), never a use of freed memory. A call costs what a call of hoccl's C
//! ABI costs: one registry lookup and the handle's life-cycle check.
#![allow(non_camel_case_types)]
use crate::abi::{ncclConfig_t, ncclResult_t, read_config, result_of, CommOptions, NCCL_IN_PROGRESS, NCCL_REVOKE_DEFAULT, NCCL_SPLIT_NOCOLOR, NCCL_SUCCESS};
use hoccl::surface::{LastError, Registry, ThreadGroup};
use hoccl::{rank_arg, CommHandle, Communicator, Config, Error, OpDesc, Result, ThreadBootstrap, UniqueId};
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

/// What an `ncclComm_t` names.
pub struct Comm {
    /// The communicator's life cycle once it exists; unset while its creation waits for
    /// the creating thread's outermost `ncclGroupEnd` (see [`Deferred`]).
    made: OnceLock<Made>,
    /// `ncclCommSplit` calls so far: each split's messages over the parent's bootstrap use
    /// their own tag, so two splits never read each other's ids.
    splits: AtomicU32,
    options: CommOptions,
    /// `ncclCommRevoke` ran: the communicator is aborted underneath (its operations failed,
    /// their streams released) but the handle stays usable for split, shrink, destroy and
    /// abort; collectives and `ncclCommFinalize` are refused.
    revoked: AtomicBool,
    /// `ncclCommFinalize` was called: a later revoke is refused, as NCCL's.
    finalized: AtomicBool,
}

/// How a communicator's creation ended.
enum Made {
    Live(CommHandle),
    /// A creation deferred to `ncclGroupEnd` that failed, or whose group had another
    /// creation fail: every call but destroy and abort reports this error.
    Failed(Error),
}

impl Comm {
    fn new(made: Option<Made>, options: CommOptions) -> Comm {
        let cell = OnceLock::new();
        if let Some(m) = made {
            let _ = cell.set(m);
        }
        Comm { made: cell, splits: AtomicU32::new(0), options, revoked: AtomicBool::new(false), finalized: AtomicBool::new(false) }
    }

    /// The communicator's handle, or why there is none: its creation is still deferred to
    /// a group's end, or failed there.
    pub fn handle(&self, op: &'static str) -> Result<&CommHandle> {
        match self.made.get() {
            Some(Made::Live(h)) => Ok(h),
            Some(Made::Failed(e)) => Err(Error::invalid_usage(op, format!("this communicator's creation failed in ncclGroupEnd: {e}"))),
            None => Err(Error::invalid_usage(op, "this communicator is created by the ncclGroupEnd that closes the group of its creation call; only collectives may be enqueued on it before then")),
        }
    }
}

/// The opaque struct behind `ncclComm_t`; never instantiated.
#[repr(C)]
pub struct ncclComm {
    _opaque: [u8; 0],
}
pub type ncclComm_t = *mut ncclComm;

/// Ids start high and odd, apart from hoccl's C ABI's, so that a `hocclComm_t` passed here
/// by mistake is never live.
static REGISTRY: Registry<Comm> = Registry::new(0x4e43_0001);

pub fn register(c: Communicator, options: CommOptions) -> ncclComm_t {
    log_name(&c, &options);
    REGISTRY.insert(Comm::new(Some(Made::Live(CommHandle::new(c))), options)) as usize as ncclComm_t
}

fn log_name(c: &Communicator, options: &CommOptions) {
    if let Some(name) = &options.name {
        log::info!("rank {}/{}: communicator \"{name}\"", c.rank(), c.size());
    }
}

fn id(comm: ncclComm_t) -> u64 {
    comm as usize as u64
}

pub fn lookup(op: &'static str, comm: ncclComm_t) -> Result<Arc<Comm>> {
    REGISTRY.get(op, id(comm))
}

/// `ncclCommDestroy` / `ncclCommAbort` (`abort`): take `comm` out of the registry (from
/// then on the handle is invalid for every thread) and tear it down. A handle whose
/// deferred creation failed is released quietly; one whose creation is still deferred
/// stays (its group's end has yet to make it).
pub fn release(op: &'static str, comm: ncclComm_t, abort: bool) -> Result<()> {
    let h = lookup(op, comm)?;
    if h.made.get().is_none() {
        h.handle(op)?; // the error saying the creation is deferred
    }
    let h = REGISTRY.remove(op, id(comm))?;
    // A revoked communicator has nothing pending: destroying it is releasing it.
    let abort = abort || h.revoked.load(Ordering::Acquire);
    match h.made.get() {
        Some(Made::Live(c)) if abort => c.abort(op),
        Some(Made::Live(c)) => c.destroy(op),
        _ => Ok(()),
    }
}

/// The live communicator behind `comm`, outside any group.
pub fn live(op: &'static str, comm: ncclComm_t) -> Result<Arc<Communicator>> {
    lookup(op, comm)?.handle(op)?.get(op)
}

/// `ncclCommRevoke` (NCCL 2.28): stop `comm`'s operations without destroying it. Its pending
/// operations fail and their streams are released ([`Communicator::abort`]: their outputs
/// are undefined; peers waiting on this rank's side fail their side as after an abort);
/// from then on collectives on it are `ncclInvalidUsage`, `ncclCommFinalize` is
/// `ncclInvalidArgument`, `ncclCommGetAsyncError` reports `ncclSuccess` (it is quiescent),
/// and `ncclCommSplit`, `ncclCommShrink`, `ncclCommDestroy` and `ncclCommAbort` work (the
/// bootstrap stays up). Local, as NCCL's: no other rank is told. NULL is accepted (nothing
/// to do); a flag other than `NCCL_REVOKE_DEFAULT`, a second revoke, and a revoke after
/// `ncclCommFinalize` are `ncclInvalidArgument`. Complete when it returns, also for a
/// non-blocking communicator. Inside a group it takes effect at once: calls the group
/// gathered on `comm` then fail at `ncclGroupEnd`.
pub fn revoke(op: &'static str, comm: ncclComm_t, flags: i32) -> Result<()> {
    if comm.is_null() {
        return Ok(());
    }
    if flags != NCCL_REVOKE_DEFAULT {
        return Err(Error::invalid_arg(op, format!("revokeFlags {flags:#x} (want NCCL_REVOKE_DEFAULT)")));
    }
    let h = lookup(op, comm)?;
    let c = h.handle(op)?.get(op)?;
    if h.finalized.load(Ordering::Acquire) {
        return Err(Error::invalid_arg(op, "the communicator was finalized (ncclCommFinalize); destroy it instead"));
    }
    if h.revoked.swap(true, Ordering::AcqRel) {
        return Err(Error::invalid_arg(op, "the communicator was already revoked"));
    }
    let pending = c.pending();
    c.abort();
    log::info!("rank {}/{}: communicator revoked ({pending} operation(s) pending failed, their streams released)", c.rank(), c.size());
    Ok(())
}

/// The refusal of a collective on a revoked communicator.
fn revoked(op: &'static str) -> Error {
    Error::invalid_usage(op, "the communicator was revoked (ncclCommRevoke): only ncclCommSplit, ncclCommShrink, ncclCommDestroy and ncclCommAbort remain")
}

/// `ncclCommFinalize`'s communicator: refused after a revoke (as NCCL's); marks the handle
/// finalized.
pub fn finalize(op: &'static str, comm: ncclComm_t) -> Result<Arc<Communicator>> {
    let h = lookup(op, comm)?;
    let c = h.handle(op)?.get(op)?;
    if h.revoked.load(Ordering::Acquire) {
        return Err(Error::invalid_arg(op, "the communicator was revoked (ncclCommRevoke): destroy it instead"));
    }
    h.finalized.store(true, Ordering::Release);
    Ok(c)
}

/// `ncclCommGetAsyncError`'s code: the live communicator's asynchronous error,
/// `ncclInProgress` while its creation waits for its group's end, the failure once that
/// failed (whose message becomes this thread's last error).
pub fn async_error(op: &'static str, comm: ncclComm_t) -> Result<ncclResult_t> {
    let h = lookup(op, comm)?;
    let e = match h.made.get() {
        None => return Ok(NCCL_IN_PROGRESS),
        // The creation's own code, with the message that says where it failed.
        Some(Made::Failed(why)) => h.handle(op).err().map(|e| (why.code(), e)),
        // Revoked: quiescent, as NCCL reports once its revocation completed.
        Some(Made::Live(c)) if h.revoked.load(Ordering::Acquire) => c.get(op).map(|_| None)?,
        Some(Made::Live(c)) => c.get(op)?.async_error().map(|e| (e.code(), e)),
    };
    if let Some((_, e)) = &e {
        set_last_error(e);
    }
    Ok(e.map_or(NCCL_SUCCESS, |(code, _)| result_of(code)))
}

// ---------------------------------------------------------------- thread state -----------

thread_local! {
    static LAST_ERROR: LastError = LastError::default();
    static GROUP: RefCell<ThreadGroup<Comm>> = RefCell::default();
    /// Creations recorded inside this thread's open group, in call order.
    static DEFERRED: RefCell<Vec<Deferred>> = RefCell::default();
}

/// A creation call made inside a group: NCCL defers it to the outermost `ncclGroupEnd`,
/// so that one thread can create several ranks of one communicator (each creation waits
/// for the others' rendezvous, so they must run together).
struct Deferred {
    op: &'static str,
    /// The handle already returned to the caller and its entry; `None` for a split with
    /// `NCCL_SPLIT_NOCOLOR`, which takes part in the exchange and gets no communicator.
    comm: Option<(u64, Arc<Comm>)>,
    create: Box<dyn FnOnce() -> Result<Option<Communicator>> + Send>,
    /// Operations enqueued on the handle before the group's end, in call order.
    ops: Vec<OpDesc<'static>>,
}

pub fn set_last_error(e: &Error) {
    let _ = LAST_ERROR.try_with(|l| l.set(e));
}

/// The calling thread's last failure ("" if none); valid until its next failing call.
pub fn last_error() -> *const std::ffi::c_char {
    LAST_ERROR.try_with(|l| l.as_ptr()).unwrap_or(c"".as_ptr())
}

/// Enqueue `desc` on `comm` through hoccl's funnel, joined to the thread's open group if
/// there is one (groups are thread-global, as NCCL's: the first call on a communicator
/// inside `ncclGroupStart` opens its group, the outermost `ncclGroupEnd` launches them
/// all). On a handle whose creation this thread's group deferred, the operation is kept and
/// enqueued when the group's end has created the communicator, as NCCL allows.
pub fn enqueue(op: &'static str, comm: ncclComm_t, desc: impl FnOnce() -> Result<OpDesc<'static>>) -> Result<()> {
    let h = lookup(op, comm)?;
    if h.revoked.load(Ordering::Acquire) {
        return Err(revoked(op));
    }
    let d = desc()?;
    if h.made.get().is_none() {
        let mine = DEFERRED.with(|p| {
            let mut p = p.borrow_mut();
            let entry = p.iter_mut().find(|x| x.comm.as_ref().is_some_and(|(i, _)| *i == id(comm)));
            entry.map(|x| x.ops.push(d)).is_some()
        });
        if mine {
            return Ok(());
        }
        // Deferred by another thread's group (an error saying so), or made just now.
    }
    let c = h.handle(op)?.get(op)?;
    GROUP.with(|g| g.borrow_mut().join(id(comm), &h, || c.group_start()))?;
    c.enqueue(&d)
}

pub fn group_start() {
    GROUP.with(|g| g.borrow_mut().start());
}

/// Close the thread's group. The outermost end runs the group's deferred creations together
/// (a thread each, every one bounded by hoccl's timeout), launches the gathered calls of
/// every communicator used since the outermost start (each one even if another fails), and
/// enqueues, as one group per new communicator, the operations kept for it. If a creation
/// fails, every communicator of the group's creations is released and each of their handles
/// reports the failure. The first failure is returned.
pub fn group_end(op: &'static str) -> Result<()> {
    let outermost = GROUP.with(|g| g.borrow().depth() == 1);
    // The creations run before the group's calls on existing communicators launch, so that
    // new ranks that are threads of this process reserve their scratch while nothing of
    // this thread is pending (see `prepare_thread_rank`).
    let deferred = if outermost { DEFERRED.with(|p| std::mem::take(&mut *p.borrow_mut())) } else { Vec::new() };
    let (created, kept) = create_deferred(op, deferred);
    let launched = GROUP.with(|g| ThreadGroup::end(g, op, "ncclGroupStart", |h| h.handle(op)?.get(op).and_then(|c| c.group_end())));
    let mut first = launched.and(created);
    for (cop, h, ops) in kept {
        let r = launch_kept(cop, &h, &ops);
        if first.is_ok() {
            first = r;
        }
    }
    first
}

/// The operations kept for one communicator a group's end created.
type Kept = (&'static str, Arc<Comm>, Vec<OpDesc<'static>>);

/// Run a group's deferred creations; the communicators made and the operations kept for them.
fn create_deferred(op: &'static str, deferred: Vec<Deferred>) -> (Result<()>, Vec<Kept>) {
    if deferred.is_empty() {
        return (Ok(()), Vec::new());
    }
    log::debug!("{op}: {} deferred creation(s)", deferred.len());
    let (rest, jobs): (Vec<_>, Vec<_>) = deferred.into_iter().map(|d| ((d.op, d.comm, d.ops), d.create)).unzip();
    let made = concurrently(op, jobs);
    if let Some(e) = made.iter().find_map(|r| r.as_ref().err()).cloned() {
        for ((_, comm, _), r) in rest.into_iter().zip(made) {
            let why = match r {
                Err(mine) => mine,
                Ok(_) => Error::invalid_usage(op, format!("another creation of its group failed: {e}")),
            };
            if let Some((_, h)) = comm {
                let _ = h.made.set(Made::Failed(why));
            }
        } // the communicators that were made are dropped here
        return (Err(e), Vec::new());
    }
    let several = made.iter().filter(|r| matches!(r, Ok(Some(_)))).count() > 1;
    let mut kept = Vec::new();
    for ((cop, comm, ops), r) in rest.into_iter().zip(made) {
        let (Some((_, h)), Ok(Some(c))) = (comm, r) else { continue };
        log_name(&c, &h.options);
        if several {
            prepare_thread_rank(cop, &c);
        }
        let _ = h.made.set(Made::Live(CommHandle::new(c)));
        if !ops.is_empty() {
            kept.push((cop, h, ops));
        }
    }
    (Ok(()), kept)
}

/// Ranks that are threads of this process (several created by one `ncclGroupEnd`, or by
/// `ncclCommInitAll`) allocate their reduction scratch now, before any of them can have a
/// collective pending: allocating while another rank's collective is pending can wait for
/// that rank's stream, which one thread driving all ranks would never release. A failure
/// only defers the allocation to the first reduction, as for any communicator.
fn prepare_thread_rank(op: &'static str, c: &Communicator) {
    if let Err(e) = c.reserve_reduce_scratch() {
        log::warn!("{op}: rank {}: reserving the reduction scratch at creation: {e}", c.rank());
    }
}

/// The operations kept for a communicator created at a group's end, as one group.
fn launch_kept(op: &'static str, h: &Comm, ops: &[OpDesc<'static>]) -> Result<()> {
    let c = h.handle(op)?.get(op)?;
    c.group_start()?;
    let mut first = Ok(());
    for d in ops {
        if let Err(e) = c.enqueue(d) {
            if first.is_ok() {
                first = Err(e);
            }
        }
    }
    first.and(c.group_end())
}

/// Run `jobs` on a thread each; their results in order (a panic is an internal error).
fn concurrently<T: Send + 'static>(op: &'static str, jobs: Vec<Box<dyn FnOnce() -> Result<T> + Send>>) -> Vec<Result<T>> {
    let threads: Vec<Result<std::thread::JoinHandle<Result<T>>>> = jobs
        .into_iter()
        .map(|j| std::thread::Builder::new().name("hoccl-nccl-init".into()).spawn(j).map_err(|e| Error::io(op, "pthread_create", e)))
        .collect();
    threads
        .into_iter()
        .map(|t| t?.join().unwrap_or_else(|_| Err(Error::internal(op, "a creation thread panicked"))))
        .collect()
}

/// Inside a group, record a creation and return its handle (filled by the group's end);
/// outside one, run it now. `comm` is false for a split with `NCCL_SPLIT_NOCOLOR`, which
/// gets NULL either way.
fn create_or_defer(op: &'static str, options: CommOptions, comm: bool, create: impl FnOnce() -> Result<Option<Communicator>> + Send + 'static) -> Result<ncclComm_t> {
    if GROUP.with(|g| g.borrow().depth()) == 0 {
        return Ok(match create().map_err(|e| e.with_op(op))? {
            Some(c) => register(c, options),
            None => std::ptr::null_mut(),
        });
    }
    let entry = comm.then(|| {
        let h = Arc::new(Comm::new(None, options));
        (REGISTRY.insert_arc(h.clone()), h)
    });
    let handle = entry.as_ref().map_or(std::ptr::null_mut(), |(i, _)| *i as usize as ncclComm_t);
    let create = Box::new(move || create().map_err(|e| e.with_op(op)));
    DEFERRED.with(|p| p.borrow_mut().push(Deferred { op, comm: entry, create, ops: Vec::new() }));
    Ok(handle)
}

// ---------------------------------------------------------------- creation ---------------

/// Same-host transfers up to this many bytes take the staged path unless `HOCCL_STAGED_BYTES`
/// says otherwise. NCCL's users wait inside the CUDA driver on other threads while a
/// collective is pending (PyTorch's DDP does, at construction), which stops the proxy's
/// driver calls; the staged path makes none (docs/design.md, "Application threads that wait
/// inside the driver"). 1 MiB covers DDP's metadata exchange.
pub const STAGED_BYTES: usize = 1 << 20;

/// The configuration of a new communicator: the `HOCCL_*` environment (so `HOCCL_ENGINE`
/// and the rest apply) over this library's defaults ([`STAGED_BYTES`], at most what the
/// staged ring holds), on the calling
/// thread's current GPU unless `HOCCL_DEVICE` names one.
pub fn config(op: &'static str) -> Result<Config> {
    crate::logging();
    let mut cfg = Config::from_env().map_err(|e| e.with_op(op))?;
    if std::env::var_os("HOCCL_STAGED_BYTES").is_none() {
        cfg.staged_bytes = STAGED_BYTES.min(cfg.staged_bytes_max());
    }
    if cfg.device.is_none() {
        cfg.device = current_device(op, &cfg)?;
    }
    Ok(cfg)
}

/// `cudaGetDevice` semantics through the driver: the GPU of the context current on this
/// thread, 0 when none is. `None` on the host backend, and under `HOCCL_BACKEND=auto` when
/// there is no CUDA driver (hoccl then runs on the host backend).
fn current_device(op: &'static str, cfg: &Config) -> Result<Option<usize>> {
    use hoccl::BackendChoice;
    match cfg.backend {
        BackendChoice::Host => Ok(None),
        BackendChoice::Cuda => Ok(Some(hoccl::device::cuda::current_ordinal().map_err(|e| e.with_op(op))?.unwrap_or(0))),
        BackendChoice::Auto => Ok(hoccl::device::cuda::current_ordinal().ok().map(|o| o.unwrap_or(0))),
    }
}

/// `ncclCommInitRank(Config)`: `rank` of `nranks` over the TCP bootstrap of `id`, on the
/// GPU current at the call (also when the creation is deferred to a group's end).
pub fn init_rank(op: &'static str, id: &UniqueId, nranks: i32, rank: i32, cfg: *const ncclConfig_t) -> Result<ncclComm_t> {
    let options = read_config(op, cfg)?;
    let n = rank_arg(op, "nranks", nranks)?;
    let r = rank_arg(op, "rank", rank)?;
    if n == 0 || r >= n {
        return Err(Error::invalid_arg(op, format!("rank {rank} of {nranks} ranks")));
    }
    let (id, cfg) = (*id, config(op)?);
    create_or_defer(op, options, true, move || Communicator::from_unique_id(&id, n, r, cfg).map(Some))
}

/// `ncclCommInitAll`: `ndev` ranks in this process, one thread each over a thread
/// bootstrap, rank i on `devs[i]` (ignored on the host backend). All or nothing: if one rank fails,
/// the others are destroyed and the first failure is returned.
pub fn init_all(op: &'static str, devs: &[usize]) -> Result<Vec<ncclComm_t>> {
    let base = config(op)?;
    let jobs = ThreadBootstrap::group_with_timeout(devs.len(), base.timeout)
        .into_iter()
        .zip(devs)
        .map(|(b, &dev)| {
            let mut cfg = base.clone();
            // Without a GPU (the host backend) there is no device to choose.
            if base.device.is_some() {
                cfg.device = Some(dev);
            }
            Box::new(move || Communicator::with_bootstrap(Box::new(b), None, cfg)) as Box<dyn FnOnce() -> Result<Communicator> + Send>
        })
        .collect();
    let made = concurrently(op, jobs);
    if let Some(e) = made.iter().find_map(|r| r.as_ref().err()).cloned() {
        return Err(e.with_op(op)); // the communicators that were made are dropped here
    }
    let made: Vec<Communicator> = made.into_iter().flatten().collect();
    if made.len() > 1 {
        made.iter().for_each(|c| prepare_thread_rank(op, c));
    }
    Ok(made.into_iter().map(|c| register(c, CommOptions::default())).collect())
}

/// Tag base of `ncclCommSplit`'s messages over the parent's bootstrap (plus the split's
/// number on the parent).
const SPLIT_TAG: u32 = 0x4e43_5300;

/// `ncclCommSplit`, collective over the parent: every rank contributes (color, key); the
/// ranks of one color, ordered by key and then parent rank, form a new communicator over a
/// fresh TCP bootstrap whose id the lowest of them creates and sends to the rest over the
/// parent's bootstrap. `NCCL_SPLIT_NOCOLOR` takes part in the exchange and gets NULL. A
/// negative color other than NOCOLOR, on any rank, fails the split on every rank.
///
/// Inside a group the exchange and the creation run at the group's end (the parent must
/// exist by then: a parent created in the same group is refused); the handle of
/// `NCCL_SPLIT_NOCOLOR` is NULL at once, since the caller's own color decides it.
pub fn split(op: &'static str, parent: ncclComm_t, color: i32, key: i32, cfg: *const ncclConfig_t) -> Result<ncclComm_t> {
    let h = lookup(op, parent)?;
    let c = h.handle(op)?.get(op)?;
    let options = if cfg.is_null() { h.options.clone() } else { read_config(op, cfg)? };
    let tag = SPLIT_TAG.wrapping_add(h.splits.fetch_add(1, Ordering::Relaxed));
    create_or_defer(op, options, color != NCCL_SPLIT_NOCOLOR, move || split_run(op, &c, color, key, tag))
}

/// The exchange and creation of one rank's split (`None` for NOCOLOR).
fn split_run(op: &'static str, c: &Communicator, color: i32, key: i32, tag: u32) -> Result<Option<Communicator>> {
    let b = c.bootstrap();
    let mine: Vec<u8> = color.to_le_bytes().into_iter().chain(key.to_le_bytes()).collect();
    let all = b.all_gather(&mine).map_err(|e| e.with_op(op))?;
    let entries: Vec<(i32, i32)> = all
        .iter()
        .map(|r| match r.as_slice() {
            [a, b, c, d, e, f, g, h] => Ok((i32::from_le_bytes([*a, *b, *c, *d]), i32::from_le_bytes([*e, *f, *g, *h]))),
            _ => Err(Error::internal(op, format!("split record of {} bytes", r.len()))),
        })
        .collect::<Result<_>>()?;
    let members = split_members(op, &entries, c.rank())?;
    let Some(members) = members else { return Ok(None) };
    let me = c.rank();
    let new_rank = members.iter().position(|&p| p == me).expect("split_members includes the caller");
    let leader = members[0];
    let mut cfg = c.config().clone();
    cfg.device = Some(c.device().ordinal());
    let id = if me == leader {
        let id = Communicator::unique_id(&cfg).map_err(|e| e.with_op(op))?;
        for &p in &members[1..] {
            b.send(p, tag, &id.internal).map_err(|e| e.with_op(op))?;
        }
        id
    } else {
        let bytes = b.recv(leader, tag).map_err(|e| e.with_op(op))?;
        let internal: [u8; 128] = bytes.try_into().map_err(|v: Vec<u8>| Error::internal(op, format!("split id of {} bytes", v.len())))?;
        UniqueId { internal }
    };
    Communicator::from_unique_id(&id, members.len(), new_rank, cfg).map(Some).map_err(|e| e.with_op(op))
}

/// `ncclCommShrink`, called by every rank not in `exclude` (the excluded ranks do not take
/// part; they may be dead): [`Communicator::shrink`] over the parent's bootstrap, with the
/// parent's hoccl settings and, for a NULL `cfg`, its options. With `NCCL_SHRINK_ABORT`
/// (`abort`) the parent's operations are aborted first (its handle stays valid for
/// `ncclCommDestroy` / `ncclCommAbort`, every other call on it fails with `ncclInvalidUsage`
/// as after any abort); without it the parent is untouched.
///
/// Inside a group the abort and the shrink run at the group's end, concurrently with the
/// group's other creations, so one thread may shrink several ranks of this process.
pub fn shrink(op: &'static str, parent: ncclComm_t, exclude: Vec<usize>, abort: bool, cfg: *const ncclConfig_t) -> Result<ncclComm_t> {
    let h = lookup(op, parent)?;
    let c = h.handle(op)?.get(op)?;
    let options = if cfg.is_null() { h.options.clone() } else { read_config(op, cfg)? };
    create_or_defer(op, options, true, move || {
        if abort {
            c.abort();
        }
        c.shrink(&exclude, c.config().clone()).map(Some)
    })
}

/// The parent ranks of the caller's color in their new rank order (key, then parent
/// rank), or `None` for NOCOLOR; an invalid color anywhere is an error for every rank.
pub fn split_members(op: &'static str, entries: &[(i32, i32)], me: usize) -> Result<Option<Vec<usize>>> {
    if let Some((r, (c, _))) = entries.iter().enumerate().find(|(_, (c, _))| *c < 0 && *c != NCCL_SPLIT_NOCOLOR) {
        return Err(Error::invalid_arg(op, format!("rank {r} passed color {c} (want >= 0, or NCCL_SPLIT_NOCOLOR)")));
    }
    let color = entries[me].0;
    if color == NCCL_SPLIT_NOCOLOR {
        return Ok(None);
    }
    let mut m: Vec<usize> = (0..entries.len()).filter(|&p| entries[p].0 == color).collect();
    m.sort_by_key(|&p| (entries[p].1, p));
    Ok(Some(m))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hoccl::ErrorCode;

    #[test]
    fn split_groups_by_color_and_orders_by_key() {
        let e = [(0, 5), (1, 0), (0, 1), (NCCL_SPLIT_NOCOLOR, 0), (1, 0), (0, 1)];
        assert_eq!(split_members("s", &e, 0).unwrap(), Some(vec![2, 5, 0]));
        assert_eq!(split_members("s", &e, 4).unwrap(), Some(vec![1, 4]));
        assert_eq!(split_members("s", &e, 3).unwrap(), None);
        let bad = [(0, 0), (-2, 0)];
        for me in 0..2 {
            assert_eq!(split_members("s", &bad, me).unwrap_err().code(), ErrorCode::InvalidArgument);
        }
    }
}
