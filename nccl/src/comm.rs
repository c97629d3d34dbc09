#![allow(non_camel_case_types)]
//! Communicator handles, the calling thread's state (last error, open group) and the
//! creation paths (unique id, one process's clique, split).
//!
//! An `ncclComm_t` is not a pointer to anything: as hoccl's C ABI does, it is the id of an
//! entry in a process-wide registry, never reused, so a destroyed handle is an error value
//! (`ncclInvalidUsage`), never a use of freed memory. A call costs what a call of hoccl's C
//! ABI costs: one registry lookup and the handle's life-cycle check.
use crate::abi::{read_config, CommOptions, ncclConfig_t, NCCL_SPLIT_NOCOLOR};
use hoccl::{rank_arg, CommHandle, Communicator, Config, Error, Result, ThreadBootstrap, UniqueId};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::CString;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// What an `ncclComm_t` names.
pub struct Comm {
    pub handle: CommHandle,
    /// `ncclCommSplit` calls so far: each split's messages over the parent's bootstrap use
    /// their own tag, so two splits never read each other's ids.
    splits: AtomicU32,
    options: CommOptions,
}

/// The opaque struct behind `ncclComm_t`; never instantiated.
#[repr(C)]
pub struct ncclComm {
    _opaque: [u8; 0],
}
#[allow(non_camel_case_types)]
pub type ncclComm_t = *mut ncclComm;

type Registry = Mutex<HashMap<u64, Arc<Comm>>>;

fn registry() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    R.get_or_init(Default::default)
}

fn lock_registry() -> std::sync::MutexGuard<'static, HashMap<u64, Arc<Comm>>> {
    // Entries are inserted and removed in single operations: a poisoned map is still valid.
    registry().lock().unwrap_or_else(|p| p.into_inner())
}

/// Ids start high and odd, and differ from hoccl's C ABI's, so neither a small integer, an
/// aligned pointer nor a `hocclComm_t` passed by mistake is ever a live handle.
static NEXT_ID: AtomicU64 = AtomicU64::new(0x4e43_0001);

pub fn register(c: Communicator, options: CommOptions) -> ncclComm_t {
    if let Some(name) = &options.name {
        log::info!("rank {}/{}: communicator \"{name}\"", c.rank(), c.size());
    }
    let id = NEXT_ID.fetch_add(2, Ordering::Relaxed);
    lock_registry().insert(id, Arc::new(Comm { handle: CommHandle::new(c), splits: AtomicU32::new(0), options }));
    id as usize as ncclComm_t
}

pub fn lookup(op: &'static str, comm: ncclComm_t) -> Result<(u64, Arc<Comm>)> {
    if comm.is_null() {
        return Err(Error::invalid_arg(op, "communicator is NULL"));
    }
    let id = comm as usize as u64;
    let h = lock_registry().get(&id).cloned();
    h.map(|h| (id, h)).ok_or_else(|| Error::invalid_usage(op, format!("{id:#x} is not a live communicator (destroyed, or never created)")))
}

/// Take `comm` out of the registry: from then on the handle is invalid for every thread.
pub fn unregister(op: &'static str, comm: ncclComm_t) -> Result<Arc<Comm>> {
    let (id, c) = lookup(op, comm)?;
    lock_registry().remove(&id);
    Ok(c)
}

/// The live communicator behind `comm`, outside any group.
pub fn live(op: &'static str, comm: ncclComm_t) -> Result<Arc<Communicator>> {
    lookup(op, comm)?.1.handle.get(op)
}

// ---------------------------------------------------------------- thread state -----------

#[derive(Default)]
struct ThreadGroup {
    depth: usize,
    /// Communicators whose group this thread opened, in first-use order.
    members: Vec<(u64, Arc<Comm>)>,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    static GROUP: RefCell<ThreadGroup> = RefCell::new(ThreadGroup::default());
}

pub fn set_last_error(e: &Error) {
    let msg = CString::new(e.to_string().replace('\0', " ")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|l| *l.borrow_mut() = msg);
}

/// The calling thread's last failure ("" if none); valid until its next failing call.
pub fn last_error() -> *const std::ffi::c_char {
    LAST_ERROR.try_with(|l| l.borrow().as_ptr()).unwrap_or(c"".as_ptr())
}

/// The live communicator behind `comm`, joined to the thread's open group if there is one
/// (groups are thread-global, as NCCL's: the first call on a communicator inside
/// `ncclGroupStart` opens its group, the outermost `ncclGroupEnd` launches them all).
pub fn for_call(op: &'static str, comm: ncclComm_t) -> Result<Arc<Communicator>> {
    let (id, h) = lookup(op, comm)?;
    let c = h.handle.get(op)?;
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 && !g.members.iter().any(|(m, _)| *m == id) {
            c.group_start()?;
            g.members.push((id, h));
        }
        Ok::<_, Error>(())
    })?;
    Ok(c)
}

pub fn group_start() {
    GROUP.with(|g| g.borrow_mut().depth += 1);
}

/// Close the thread's group; the outermost end launches the gathered calls of every
/// communicator used since the outermost start. Every member is closed even if one fails;
/// the first failure is returned.
pub fn group_end(op: &'static str) -> Result<()> {
    let members = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(Error::invalid_usage(op, "ncclGroupEnd without ncclGroupStart"));
        }
        g.depth -= 1;
        Ok(if g.depth == 0 { std::mem::take(&mut g.members) } else { Vec::new() })
    })?;
    let mut first = Ok(());
    for (_, h) in members {
        let r = h.handle.get(op).and_then(|c| c.group_end());
        if first.is_ok() {
            first = r;
        }
    }
    first
}

// ---------------------------------------------------------------- creation ---------------

/// The configuration of a new communicator: the `HOCCL_*` environment (so `HOCCL_ENGINE`
/// and the rest apply), on the calling thread's current GPU unless `HOCCL_DEVICE` names one.
pub fn config(op: &'static str) -> Result<Config> {
    crate::logging();
    let mut cfg = Config::from_env().map_err(|e| e.with_op(op))?;
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

/// `ncclCommInitRank(Config)`: `rank` of `nranks` over the TCP bootstrap of `id`.
pub fn init_rank(op: &'static str, id: &UniqueId, nranks: i32, rank: i32, cfg: *const ncclConfig_t) -> Result<ncclComm_t> {
    let options = read_config(op, cfg)?;
    let n = rank_arg(op, "nranks", nranks)?;
    let r = rank_arg(op, "rank", rank)?;
    if n == 0 || r >= n {
        return Err(Error::invalid_arg(op, format!("rank {rank} of {nranks} ranks")));
    }
    let c = Communicator::from_unique_id(id, n, r, config(op)?).map_err(|e| e.with_op(op))?;
    Ok(register(c, options))
}

/// `ncclCommInitAll`: `ndev` ranks in this process, one thread each over a thread
/// bootstrap, rank i on `devlist[i]` (GPU i when NULL). All or nothing: if one rank fails,
/// the others are destroyed and the first failure is returned.
pub fn init_all(op: &'static str, devs: &[usize]) -> Result<Vec<ncclComm_t>> {
    let base = config(op)?;
    let ranks: Vec<_> = ThreadBootstrap::group_with_timeout(devs.len(), base.timeout)
        .into_iter()
        .zip(devs)
        .map(|(b, &dev)| {
            let mut cfg = base.clone();
            cfg.device = Some(dev);
            std::thread::Builder::new()
                .name("hoccl-nccl-init".into())
                .spawn(move || Communicator::with_bootstrap(Box::new(b), None, cfg))
                .map_err(|e| Error::io(op, "pthread_create", e))
        })
        .collect::<Result<_>>()?;
    let made: Vec<Result<Communicator>> = ranks
        .into_iter()
        .map(|t| t.join().unwrap_or_else(|_| Err(Error::internal(op, "a rank's creation thread panicked"))))
        .collect();
    if let Some(e) = made.iter().find_map(|r| r.as_ref().err()).cloned() {
        return Err(e.with_op(op)); // the communicators that were made are dropped here
    }
    Ok(made.into_iter().flatten().map(|c| register(c, CommOptions::default())).collect())
}

/// Tag base of `ncclCommSplit`'s messages over the parent's bootstrap (plus the split's
/// number on the parent).
const SPLIT_TAG: u32 = 0x4e43_5300;

/// `ncclCommSplit`, collective over the parent: every rank contributes (color, key); the
/// ranks of one color, ordered by key and then parent rank, form a new communicator over a
/// fresh TCP bootstrap whose id the lowest of them creates and sends to the rest over the
/// parent's bootstrap. `NCCL_SPLIT_NOCOLOR` takes part in the exchange and gets NULL. A
/// negative color other than NOCOLOR, on any rank, fails the split on every rank.
pub fn split(op: &'static str, parent: ncclComm_t, color: i32, key: i32, cfg: *const ncclConfig_t) -> Result<ncclComm_t> {
    let (_, h) = lookup(op, parent)?;
    let c = h.handle.get(op)?;
    let options = if cfg.is_null() { h.options.clone() } else { read_config(op, cfg)? };
    let n = h.splits.fetch_add(1, Ordering::Relaxed);
    let tag = SPLIT_TAG.wrapping_add(n);
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
    let Some(members) = members else { return Ok(std::ptr::null_mut()) };
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
    let new = Communicator::from_unique_id(&id, members.len(), new_rank, cfg).map_err(|e| e.with_op(op))?;
    Ok(register(new, options))
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
