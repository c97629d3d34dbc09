//! What every C surface of handles shares (hoccl's C ABI, the NCCL-compatible library): a
//! registry of handles, the calling thread's last error, and NCCL's thread-global groups.
//!
//! A handle is not a pointer to anything: it is the id of a registry entry, never reused,
//! so a destroyed (or never created) handle is simply absent and using it is an error
//! value, not a use of freed memory.
use crate::error::{Error, Result};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// Process-wide handles of one surface.
pub struct Registry<T> {
    map: OnceLock<Mutex<HashMap<u64, Arc<T>>>>,
    next: AtomicU64,
}

impl<T> Registry<T> {
    /// Ids start at `first` and step by 2. Start high and odd, and apart from other
    /// surfaces' ids, so that small integers, aligned pointers and another surface's
    /// handles passed by mistake are never live.
    pub const fn new(first: u64) -> Registry<T> {
        Registry { map: OnceLock::new(), next: AtomicU64::new(first) }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Arc<T>>> {
        // Entries are inserted and removed in single operations: a poisoned map is still valid.
        self.map.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Register `v`; its handle.
    pub fn insert(&self, v: T) -> u64 {
        self.insert_arc(Arc::new(v))
    }

    /// Register a shared `v` (its creator keeps a reference); its handle.
    pub fn insert_arc(&self, v: Arc<T>) -> u64 {
        let id = self.next.fetch_add(2, Ordering::Relaxed);
        self.lock().insert(id, v);
        id
    }

    /// The entry of handle `id` (0 is C's NULL).
    pub fn get(&self, op: &'static str, id: u64) -> Result<Arc<T>> {
        if id == 0 {
            return Err(Error::invalid_arg(op, "communicator is NULL"));
        }
        let h = self.lock().get(&id).cloned();
        h.ok_or_else(|| Error::invalid_usage(op, format!("{id:#x} is not a live communicator (destroyed, or never created)")))
    }

    /// Take handle `id` out: from then on it is invalid for every thread.
    pub fn remove(&self, op: &'static str, id: u64) -> Result<Arc<T>> {
        let h = self.get(op, id)?;
        self.lock().remove(&id);
        Ok(h)
    }
}

/// Write `v` through a C out-pointer, or fail with `InvalidArgument` naming `what` if it is
/// NULL. For C entry points only: `out` comes from C, whose contract (a writable `T` or
/// NULL) the caller relays, so this is not an `unsafe fn` to every caller in Rust.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn put<T>(op: &'static str, what: &str, out: *mut T, v: T) -> Result<()> {
    if out.is_null() {
        return Err(Error::invalid_arg(op, format!("{what} is NULL")));
    }
    // SAFETY: checked non-NULL; the C contract is that it points to a writable, aligned `T`.
    unsafe { out.write(v) };
    Ok(())
}

/// The message of a thread's last failed call, for `…GetLastError()` (keep one in a
/// `thread_local!`).
#[derive(Default)]
pub struct LastError(RefCell<CString>);

impl LastError {
    pub fn set(&self, e: &Error) {
        *self.0.borrow_mut() = CString::new(e.to_string().replace('\0', " ")).unwrap_or_default();
    }

    /// The message ("" if none); valid until the next `set` on this thread.
    pub fn as_ptr(&self) -> *const c_char {
        self.0.borrow().as_ptr()
    }
}

/// A thread's open group, as NCCL's groups are thread-global: between the outermost start
/// and end, the first call on each handle opens that handle's group, and the outermost end
/// closes (launches) them all (keep one in a `thread_local!`).
pub struct ThreadGroup<T> {
    depth: usize,
    /// Handles whose group this thread opened, in first-use order.
    members: Vec<(u64, Arc<T>)>,
}

impl<T> Default for ThreadGroup<T> {
    fn default() -> Self {
        ThreadGroup { depth: 0, members: Vec::new() }
    }
}

impl<T> ThreadGroup<T> {
    pub fn start(&mut self) {
        self.depth += 1;
    }

    /// Groups open on this thread (0 outside any).
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// A call on handle `id`: inside a group, the first one opens the handle's group
    /// (`open`) and makes it a member.
    pub fn join(&mut self, id: u64, h: &Arc<T>, open: impl FnOnce() -> Result<()>) -> Result<()> {
        if self.depth > 0 && !self.members.iter().any(|(m, _)| *m == id) {
            open()?;
            self.members.push((id, h.clone()));
        }
        Ok(())
    }

    /// Close one level (`InvalidUsage` naming `start` when none is open); at the outermost
    /// end, close every member's group with `close`. Every member is closed even if one
    /// fails; the first failure is returned.
    pub fn end(cell: &RefCell<Self>, op: &'static str, start: &str, mut close: impl FnMut(&T) -> Result<()>) -> Result<()> {
        let members = {
            let mut g = cell.borrow_mut();
            if g.depth == 0 {
                return Err(Error::invalid_usage(op, format!("{op} without {start}")));
            }
            g.depth -= 1;
            if g.depth == 0 {
                std::mem::take(&mut g.members)
            } else {
                Vec::new()
            }
        };
        let mut first = Ok(());
        for (_, h) in members {
            let r = close(&h);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    #[test]
    fn handles_are_never_reused_and_dead_ones_are_errors() {
        let r: Registry<u32> = Registry::new(0x1001);
        let a = r.insert(7);
        let b = r.insert(8);
        assert_ne!(a, b);
        assert_eq!(*r.get("g", a).unwrap(), 7);
        assert_eq!(*r.remove("rm", a).unwrap(), 7);
        assert_eq!(r.get("g", a).unwrap_err().code(), ErrorCode::InvalidUsage);
        assert_eq!(r.remove("rm", a).unwrap_err().code(), ErrorCode::InvalidUsage);
        assert_eq!(r.get("g", 0).unwrap_err().code(), ErrorCode::InvalidArgument);
        assert_ne!(r.insert(9), a);
    }

    #[test]
    fn groups_nest_and_the_outermost_end_closes_every_member_once() {
        let g = RefCell::new(ThreadGroup::<u32>::default());
        let (x, y) = (Arc::new(1), Arc::new(2));
        let mut opened = 0;
        g.borrow_mut().join(1, &x, || panic!("no group is open")).unwrap();
        g.borrow_mut().start();
        g.borrow_mut().start();
        for (id, h) in [(1, &x), (2, &y), (1, &x)] {
            g.borrow_mut()
                .join(id, h, || {
                    opened += 1;
                    Ok(())
                })
                .unwrap();
        }
        assert_eq!(opened, 2);
        let mut closed = Vec::new();
        ThreadGroup::end(&g, "end", "start", |h| {
            closed.push(*h);
            Ok(())
        })
        .unwrap();
        assert!(closed.is_empty(), "an inner end closes nothing");
        let r = ThreadGroup::end(&g, "end", "start", |h| {
            closed.push(*h);
            Err(Error::internal("close", format!("{h}")))
        });
        assert_eq!(closed, [1, 2], "every member closed, in first-use order");
        assert!(r.unwrap_err().to_string().contains("close: internal error: 1"));
        let e = ThreadGroup::end(&g, "end", "startFn", |_| Ok(())).unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidUsage);
        assert!(e.to_string().contains("startFn"), "{e}");
    }

    #[test]
    fn last_error_keeps_the_message() {
        let l = LastError::default();
        // SAFETY: as_ptr returns a NUL-terminated string that lives until the next set.
        assert_eq!(unsafe { std::ffi::CStr::from_ptr(l.as_ptr()) }.to_bytes(), b"");
        l.set(&Error::invalid_arg("op", "bad\0value"));
        // SAFETY: as above.
        assert_eq!(unsafe { std::ffi::CStr::from_ptr(l.as_ptr()) }.to_str().unwrap(), "op: invalid argument: bad value");
    }
}
