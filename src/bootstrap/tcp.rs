//! Bootstrap over plain TCP, without MPI: the NCCL `ncclGetUniqueId` / `ncclCommInitRank`
//! model.
//!
//! One process makes a [`UniqueId`] ([`UniqueId::new`]): it picks an interface
//! (`HOCCL_SOCKET_IFNAME`, else the first non-loopback interface that is up, else
//! loopback), listens on an ephemeral port and starts a root thread that serves one
//! rendezvous. The 128-byte id (root address, port and a random 128-bit secret) travels to
//! every rank by the caller's means. Each rank then calls [`TcpBootstrap::init`]: it listens
//! on its own ephemeral port, joins the root presenting the secret, `rank` and `nranks`, and
//! receives the table of all ranks' listening addresses once every rank has joined. Ranks
//! then connect pairwise (the higher rank connects to the lower), authenticating each link
//! with the secret. The root refuses, logs at warn level and answers with the reason: a wrong
//! secret, a rank out of range, a duplicate rank or an `nranks` that differs from the first
//! joiner's.
//!
//! Messages are frames `kind u8 | tag u32 | len u64 | bytes` (big endian). One reader
//! thread per peer files frames into a mailbox keyed by (kind, peer, tag), so `recv` may
//! take tags in any order. Every wait is bounded by the timeout given to `init`; a peer
//! that closes its link is a `Remote` error naming it.
use super::Bootstrap;
use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, SocketAddrV6, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const MAGIC: [u8; 4] = *b"HOCT";
const VERSION: u8 = 1;
/// Frames longer than this are refused as corrupt (bootstrap traffic is small; 1 MiB+
/// records are allowed, gigabytes are not).
const MAX_FRAME: u64 = 1 << 32;
/// Largest join request, greeting or root reply (the address table of 2^16 ranks fits).
const MAX_CONTROL: u64 = 4 << 20;
const KIND_USER: u8 = 0;
const KIND_GATHER: u8 = 1;
const REPLY_OK: u8 = 0;
const REPLY_REFUSED: u8 = 1;
/// The root gave up waiting for the other ranks.
const REPLY_TIMEOUT: u8 = 2;

/// The rendezvous handle: 128 bytes, copyable by value through any channel (MPI, a file,
/// an environment variable via [`UniqueId::to_hex`]). Layout: magic `HOCT` (0..4),
/// version (4), address family 4 or 6 (5), root port big endian (6..8), root address
/// (8..24; IPv4 in the first 4 bytes), secret (24..40), IPv6 scope id big endian (40..44),
/// zeros after. It holds the secret: log it only through `Display`, which omits it.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId {
    pub internal: [u8; 128],
}

const _: () = assert!(std::mem::size_of::<UniqueId>() == 128);

impl UniqueId {
    /// On the would-be root process: choose the interface from `HOCCL_SOCKET_IFNAME` (see
    /// [`UniqueId::with_ifname`]), listen and start the root thread.
    pub fn new() -> Result<UniqueId> {
        let cfg = crate::config::Config::from_env()?;
        Self::with_ifname(cfg.socket_ifname.as_deref())
    }

    /// As [`new`](Self::new) with an explicit interface spec (`HOCCL_SOCKET_IFNAME` syntax:
    /// comma list of name prefixes, `=` before a list for exact names, `^` to exclude;
    /// `None`: any interface except `lo` and `docker*`, loopback as the last resort).
    ///
    /// The root thread serves one rendezvous: it waits for the first join without limit,
    /// then for the rest within the first joiner's timeout, sends the table and exits.
    pub fn with_ifname(ifname: Option<&str>) -> Result<UniqueId> {
        const OP: &str = "UniqueId::new";
        let ip = pick_interface(ifname)?;
        let listener = TcpListener::bind(SocketAddr::new(ip.0, 0)).map_err(|e| io_err(OP, "bind", &e, "root listener"))?;
        let mut addr = listener.local_addr().map_err(|e| io_err(OP, "getsockname", &e, "root listener"))?;
        if let (SocketAddr::V6(a), Some(scope)) = (&mut addr, ip.1) {
            a.set_scope_id(scope);
        }
        let mut secret = [0u8; 16];
        fill_random(&mut secret)?;
        let id = UniqueId::encode(addr, &secret);
        std::thread::Builder::new()
            .name("hoccl-tcp-root".into())
            .spawn(move || root_serve(listener, secret))
            .map_err(|e| io_err(OP, "pthread_create", &e, "root thread"))?;
        log::debug!("hoccl: tcp bootstrap root listening at {addr}");
        Ok(id)
    }

    fn encode(addr: SocketAddr, secret: &[u8; 16]) -> UniqueId {
        let mut b = [0u8; 128];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[6..8].copy_from_slice(&addr.port().to_be_bytes());
        match addr {
            SocketAddr::V4(a) => {
                b[5] = 4;
                b[8..12].copy_from_slice(&a.ip().octets());
            }
            SocketAddr::V6(a) => {
                b[5] = 6;
                b[8..24].copy_from_slice(&a.ip().octets());
                b[40..44].copy_from_slice(&a.scope_id().to_be_bytes());
            }
        }
        b[24..40].copy_from_slice(secret);
        UniqueId { internal: b }
    }

    /// The root's address, checking magic, version and family.
    pub fn root_addr(&self) -> Result<SocketAddr> {
        const OP: &str = "UniqueId::root_addr";
        let b = &self.internal;
        if b[0..4] != MAGIC {
            return Err(Error::invalid_arg(OP, "not a hoccl unique id (bad magic)"));
        }
        if b[4] != VERSION {
            return Err(Error::invalid_arg(OP, format!("unique id version {} (this build speaks {VERSION})", b[4])));
        }
        let port = u16::from_be_bytes([b[6], b[7]]);
        match b[5] {
            4 => Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::new(b[8], b[9], b[10], b[11])), port)),
            6 => {
                let mut o = [0u8; 16];
                o.copy_from_slice(&b[8..24]);
                let scope = u32::from_be_bytes([b[40], b[41], b[42], b[43]]);
                Ok(SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(o), port, 0, scope)))
            }
            f => Err(Error::invalid_arg(OP, format!("unique id address family {f}"))),
        }
    }

    fn secret(&self) -> [u8; 16] {
        let mut s = [0u8; 16];
        s.copy_from_slice(&self.internal[24..40]);
        s
    }

    /// The whole id (secret included) as 256 hex digits, for passing to other processes.
    pub fn to_hex(&self) -> String {
        self.internal.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Inverse of [`to_hex`](Self::to_hex); checks the id is well formed.
    pub fn from_hex(s: &str) -> Result<UniqueId> {
        const OP: &str = "UniqueId::from_hex";
        let s = s.trim();
        if s.len() != 256 || !s.is_ascii() {
            return Err(Error::invalid_arg(OP, format!("want 256 hex digits, got {} characters", s.len())));
        }
        let mut b = [0u8; 128];
        for (i, out) in b.iter_mut().enumerate() {
            *out = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| Error::invalid_arg(OP, "not hex"))?;
        }
        let id = UniqueId { internal: b };
        id.root_addr()?;
        Ok(id)
    }
}

/// For logs: the root address, never the secret.
impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.root_addr() {
            Ok(a) => write!(f, "hoccl-tcp-v{VERSION}@{a}"),
            Err(_) => write!(f, "hoccl-tcp(invalid)"),
        }
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UniqueId({self})")
    }
}

/// A socket error that means the process at the other end is gone.
fn peer_gone(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe)
}

fn io_err(op: &'static str, call: &'static str, e: &std::io::Error, what: impl fmt::Display) -> Error {
    Error::System { op, call, errno: e.raw_os_error().unwrap_or(0), what: format!("{what}: {e}") }
}

pub(crate) fn fill_random(buf: &mut [u8]) -> Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: the pointer and length describe the unfilled tail of `buf`, which we own
        // mutably for the duration of the call.
        let n = unsafe { libc::getrandom(buf[done..].as_mut_ptr().cast(), buf.len() - done, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == ErrorKind::Interrupted {
                continue;
            }
            return Err(io_err("UniqueId::new", "getrandom", &e, "secret"));
        }
        done += n as usize;
    }
    Ok(())
}

// ================================================================ interfaces ==========

struct Iface {
    name: String,
    ip: IpAddr,
    scope: Option<u32>,
    up: bool,
    loopback: bool,
}

fn interfaces() -> Result<Vec<Iface>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `head`; freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io_err("UniqueId::new", "getifaddrs", &std::io::Error::last_os_error(), "interfaces"));
    }
    let mut out = Vec::new();
    let mut p = head;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        // SAFETY: ifa_addr is non-null and points to a sockaddr of the family it names.
        let family = unsafe { (*ifa.ifa_addr).sa_family } as i32;
        let (ip, scope) = match family {
            libc::AF_INET => {
                // SAFETY: the family is AF_INET, so the sockaddr is a sockaddr_in.
                let sa = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                (IpAddr::V4(Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr))), None)
            }
            libc::AF_INET6 => {
                // SAFETY: the family is AF_INET6, so the sockaddr is a sockaddr_in6.
                let sa = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                (IpAddr::V6(Ipv6Addr::from(sa.sin6_addr.s6_addr)), Some(sa.sin6_scope_id))
            }
            _ => continue,
        };
        let flags = ifa.ifa_flags;
        out.push(Iface {
            name,
            ip,
            scope,
            up: flags & libc::IFF_UP as u32 != 0,
            loopback: flags & libc::IFF_LOOPBACK as u32 != 0,
        });
    }
    // SAFETY: `head` came from a successful getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// Whether interface `name` passes a `HOCCL_SOCKET_IFNAME`-style spec (NCCL_SOCKET_IFNAME
/// syntax): `^` first excludes, `=` (after any `^`) matches whole names, else prefixes.
pub fn ifname_matches(spec: &str, name: &str) -> bool {
    let (exclude, rest) = match spec.strip_prefix('^') {
        Some(r) => (true, r),
        None => (false, spec),
    };
    let (exact, list) = match rest.strip_prefix('=') {
        Some(r) => (true, r),
        None => (false, rest),
    };
    let hit = list
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .any(|p| if exact { name == p } else { name.starts_with(p) });
    hit != exclude
}

/// The address (and IPv6 scope) to listen on: the first up interface passing `spec`
/// (IPv4 before IPv6, link-local IPv6 skipped); without a spec the first non-loopback,
/// non-docker one, else loopback.
pub(crate) fn pick_interface(spec: Option<&str>) -> Result<(IpAddr, Option<u32>)> {
    let all = interfaces()?;
    let usable = |i: &&Iface| i.up && !matches!(i.ip, IpAddr::V6(a) if (a.segments()[0] & 0xffc0) == 0xfe80);
    let pick = |pred: &dyn Fn(&Iface) -> bool| -> Option<(IpAddr, Option<u32>)> {
        let c: Vec<&Iface> = all.iter().filter(usable).filter(|i| pred(i)).collect();
        c.iter().find(|i| i.ip.is_ipv4()).or_else(|| c.first()).map(|i| (i.ip, i.scope.filter(|_| i.ip.is_ipv6())))
    };
    if let Some(spec) = spec.filter(|s| !s.trim().is_empty()) {
        return pick(&|i| ifname_matches(spec, &i.name)).ok_or_else(|| {
            Error::invalid_arg("UniqueId::new", format!("HOCCL_SOCKET_IFNAME={spec}: no interface that is up matches"))
        });
    }
    pick(&|i| !i.loopback && !i.name.starts_with("docker"))
        .or_else(|| pick(&|i| i.loopback))
        .ok_or_else(|| Error::NoDevice { op: "UniqueId::new", what: "no network interface is up".into() })
}

// ================================================================ framing ==========

fn write_frame(s: &mut impl Write, kind: u8, tag: u32, data: &[u8]) -> std::io::Result<()> {
    let mut h = [0u8; 13];
    h[0] = kind;
    h[1..5].copy_from_slice(&tag.to_be_bytes());
    h[5..13].copy_from_slice(&(data.len() as u64).to_be_bytes());
    s.write_all(&h)?;
    s.write_all(data)?;
    s.flush()
}

fn read_frame(s: &mut impl Read) -> std::io::Result<(u8, u32, Vec<u8>)> {
    read_frame_max(s, MAX_FRAME)
}

/// As `read_frame`, refusing frames over `max` bytes before allocating for them (`MAX_CONTROL`
/// for anything read from a side not yet authenticated).
fn read_frame_max(s: &mut impl Read, max: u64) -> std::io::Result<(u8, u32, Vec<u8>)> {
    let mut h = [0u8; 13];
    s.read_exact(&mut h)?;
    let tag = u32::from_be_bytes([h[1], h[2], h[3], h[4]]);
    let mut l = [0u8; 8];
    l.copy_from_slice(&h[5..13]);
    let len = u64::from_be_bytes(l);
    if len > max {
        return Err(std::io::Error::new(ErrorKind::InvalidData, format!("frame of {len} bytes")));
    }
    // Memory grows with the bytes that arrive, not with the length a peer claims: a header
    // announcing gigabytes and then closing costs nothing.
    let mut data = Vec::with_capacity(len.min(1 << 20) as usize);
    (&mut *s).take(len).read_to_end(&mut data)?;
    if data.len() as u64 != len {
        return Err(std::io::Error::new(ErrorKind::UnexpectedEof, format!("frame cut short: {} of {len} bytes", data.len())));
    }
    Ok((h[0], tag, data))
}

/// A string field: u32 length then bytes.
fn put_str(v: &mut Vec<u8>, s: &str) {
    v.extend_from_slice(&(s.len() as u32).to_be_bytes());
    v.extend_from_slice(s.as_bytes());
}

fn get_str(b: &[u8], at: &mut usize) -> Option<String> {
    let n = u32::from_be_bytes(b.get(*at..*at + 4)?.try_into().ok()?) as usize;
    let s = std::str::from_utf8(b.get(*at + 4..*at + 4 + n)?).ok()?.to_owned();
    *at += 4 + n;
    Some(s)
}

/// Hello to the root: secret(16) | rank u32 | nranks u32 | timeout_ms u64 | listen addr.
fn hello(secret: &[u8; 16], rank: usize, nranks: usize, timeout: Duration, listen: SocketAddr) -> Vec<u8> {
    let mut v = secret.to_vec();
    v.extend_from_slice(&(rank as u32).to_be_bytes());
    v.extend_from_slice(&(nranks as u32).to_be_bytes());
    v.extend_from_slice(&(timeout.as_millis().min(u64::MAX as u128) as u64).to_be_bytes());
    put_str(&mut v, &listen.to_string());
    v
}

struct Hello {
    secret: [u8; 16],
    rank: usize,
    nranks: usize,
    timeout: Duration,
    listen: SocketAddr,
}

fn parse_hello(b: &[u8]) -> Option<Hello> {
    let secret: [u8; 16] = b.get(0..16)?.try_into().ok()?;
    let rank = u32::from_be_bytes(b.get(16..20)?.try_into().ok()?) as usize;
    let nranks = u32::from_be_bytes(b.get(20..24)?.try_into().ok()?) as usize;
    let ms = u64::from_be_bytes(b.get(24..32)?.try_into().ok()?);
    let mut at = 32;
    let listen = get_str(b, &mut at)?.parse().ok()?;
    Some(Hello { secret, rank, nranks, timeout: Duration::from_millis(ms), listen })
}

/// Constant-time comparison of secrets.
pub(crate) fn same_secret(a: &[u8; 16], b: &[u8; 16]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

// ================================================================ root ==========

fn refuse(mut s: TcpStream, from: SocketAddr, why: String) {
    log::warn!("hoccl: tcp bootstrap root: refused a join from {from}: {why}");
    let mut v = vec![REPLY_REFUSED];
    v.extend_from_slice(why.as_bytes());
    let _ = write_frame(&mut s, 0, 0, &v);
    let _ = s.shutdown(Shutdown::Both);
}

/// Serve one rendezvous on `listener`: collect valid hellos until every rank joined, send
/// each the table of listening addresses, exit. Gives up (closing every joiner) when the
/// rest do not join within the first joiner's timeout.
fn root_serve(listener: TcpListener, secret: [u8; 16]) {
    if let Err(e) = listener.set_nonblocking(true) {
        log::warn!("hoccl: tcp bootstrap root: set_nonblocking: {e}");
        return;
    }
    let mut joined: Vec<Option<(TcpStream, SocketAddr)>> = Vec::new();
    let mut nranks = 0usize;
    let mut deadline: Option<Instant> = None;
    let (tx, rx) = std::sync::mpsc::channel::<(TcpStream, SocketAddr, std::result::Result<Hello, String>)>();
    loop {
        if nranks > 0 && joined.iter().all(Option::is_some) {
            break;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            let have: Vec<usize> = (0..nranks).filter(|&r| joined[r].is_some()).collect();
            let why = format!("only ranks {have:?} of {nranks} joined the root within the first joiner's timeout");
            log::warn!("hoccl: tcp bootstrap root: {why}; giving up");
            let mut v = vec![REPLY_TIMEOUT];
            v.extend_from_slice(why.as_bytes());
            for (s, _) in joined.iter_mut().flatten() {
                let _ = write_frame(s, 0, 0, &v);
            }
            return;
        }
        match listener.accept() {
            Ok((s, from)) => {
                // Each join request is read on its own thread, so a slow or silent client
                // delays nobody else.
                let tx = tx.clone();
                let spawned = std::thread::Builder::new().name("hoccl-tcp-join".into()).spawn(move || {
                    let _ = s.set_nonblocking(false);
                    let _ = s.set_nodelay(true);
                    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                    let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
                    let mut r = &s;
                    let h = match read_frame_max(&mut r, MAX_CONTROL) {
                        Ok((_, _, b)) => parse_hello(&b).ok_or_else(|| "malformed join request".to_string()),
                        Err(e) => Err(format!("no join request ({e})")),
                    };
                    let _ = tx.send((s, from, h));
                });
                if let Err(e) = spawned {
                    log::warn!("hoccl: tcp bootstrap root: cannot read the join from {from}: {e}");
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {}
            Err(e) => log::warn!("hoccl: tcp bootstrap root: accept: {e}"),
        }
        let (s, from, h) = match rx.recv_timeout(Duration::from_millis(5)) {
            Ok(x) => x,
            Err(_) => continue,
        };
        let h = match h {
            Ok(h) => h,
            Err(why) => {
                refuse(s, from, why);
                continue;
            }
        };
        if !same_secret(&h.secret, &secret) {
            refuse(s, from, "wrong secret (the unique id does not match this root)".into());
            continue;
        }
        if nranks == 0 {
            if h.nranks == 0 {
                refuse(s, from, "nranks 0".into());
                continue;
            }
            nranks = h.nranks;
            joined = (0..nranks).map(|_| None).collect();
            deadline = Some(Instant::now() + h.timeout);
        }
        if h.nranks != nranks {
            refuse(s, from, format!("rank {} says nranks {} but the first rank to join said {nranks}", h.rank, h.nranks));
            continue;
        }
        if h.rank >= nranks {
            refuse(s, from, format!("rank {} out of range for nranks {nranks}", h.rank));
            continue;
        }
        if joined[h.rank].is_some() {
            refuse(s, from, format!("duplicate rank {}", h.rank));
            continue;
        }
        log::debug!("hoccl: tcp bootstrap root: rank {}/{nranks} joined from {from}", h.rank);
        joined[h.rank] = Some((s, h.listen));
    }
    let mut table = vec![REPLY_OK];
    table.extend_from_slice(&(nranks as u32).to_be_bytes());
    for (_, a) in joined.iter().flatten() {
        put_str(&mut table, &a.to_string());
    }
    for (r, (s, _)) in joined.iter_mut().flatten().enumerate() {
        if let Err(e) = write_frame(s, 0, 0, &table) {
            log::warn!("hoccl: tcp bootstrap root: sending the table to rank {r}: {e}");
        }
    }
}

// ================================================================ ranks ==========

#[derive(Default)]
struct Mail {
    boxes: HashMap<(u8, usize, u32), VecDeque<Vec<u8>>>,
    /// Why the link from a peer ended (set by its reader thread).
    closed: HashMap<usize, String>,
}

struct Shared {
    mail: Mutex<Mail>,
    cv: Condvar,
    closing: AtomicBool,
}

/// One rank's endpoint of a TCP bootstrap (see the module docs).
pub struct TcpBootstrap {
    rank: usize,
    size: usize,
    timeout: Duration,
    /// Write halves, by peer (`None` at our own rank).
    links: Vec<Option<Mutex<TcpStream>>>,
    shared: Arc<Shared>,
    round: Mutex<u32>,
}

fn timed_out(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

fn remaining(op: &'static str, deadline: Instant, after: Duration, what: &str) -> Result<Duration> {
    let now = Instant::now();
    if now >= deadline {
        return Err(Error::Timeout { op, after, what: what.into() });
    }
    Ok((deadline - now).max(Duration::from_millis(1)))
}

impl TcpBootstrap {
    /// Join the rendezvous of `id` as `rank` of `nranks`. Collective over all ranks: returns
    /// once this rank is connected to every other. Any wait past `timeout` is a `Timeout`
    /// error; a refusal by the root is `InvalidArgument` carrying the root's reason.
    pub fn init(id: &UniqueId, nranks: usize, rank: usize, timeout: Duration) -> Result<TcpBootstrap> {
        const OP: &str = "TcpBootstrap::init";
        if nranks == 0 || rank >= nranks {
            return Err(Error::invalid_arg(OP, format!("rank {rank} of nranks {nranks}")));
        }
        if timeout.is_zero() {
            return Err(Error::invalid_arg(OP, "timeout must be > 0"));
        }
        let root = id.root_addr().map_err(|e| e.with_op(OP))?;
        let secret = id.secret();
        let deadline = Instant::now() + timeout;
        let tmo = |what: &str| remaining(OP, deadline, timeout, what);

        let mut rs = TcpStream::connect_timeout(&root, tmo("connecting to the root")?).map_err(|e| {
            if timed_out(&e) {
                Error::Timeout { op: OP, after: timeout, what: format!("connecting to the root at {root}") }
            } else {
                io_err(OP, "connect", &e, format!("root at {root}"))
            }
        })?;
        let _ = rs.set_nodelay(true);
        // Listen where the route to the root leaves this host: the interface peers reach.
        let local_ip = rs.local_addr().map_err(|e| io_err(OP, "getsockname", &e, "root link"))?.ip();
        let listener = TcpListener::bind(SocketAddr::new(local_ip, 0)).map_err(|e| io_err(OP, "bind", &e, "rank listener"))?;
        let mut listen = listener.local_addr().map_err(|e| io_err(OP, "getsockname", &e, "rank listener"))?;
        if let (SocketAddr::V6(l), SocketAddr::V6(r)) = (&mut listen, root) {
            l.set_scope_id(r.scope_id());
        }
        let root_io = |e: std::io::Error, what: &str| {
            if timed_out(&e) {
                Error::Timeout { op: OP, after: timeout, what: format!("{what} (root at {root})") }
            } else if matches!(e.kind(), ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) {
                // The root is no rank, so this is no `Remote` error (which names a rank).
                Error::System { op: OP, call: "recv", errno: 0, what: format!("the root at {root} closed the link while {what}") }
            } else {
                io_err(OP, "recv", &e, format!("{what} (root at {root})"))
            }
        };
        rs.set_write_timeout(Some(tmo("joining")?)).ok();
        write_frame(&mut rs, 0, 0, &hello(&secret, rank, nranks, timeout, listen)).map_err(|e| root_io(e, "joining"))?;
        rs.set_read_timeout(Some(tmo("waiting for the other ranks to join")?)).ok();
        let (_, _, reply) = read_frame_max(&mut rs, MAX_CONTROL).map_err(|e| root_io(e, "waiting for the other ranks to join"))?;
        drop(rs);
        match reply.first() {
            Some(&REPLY_OK) => {}
            Some(&REPLY_REFUSED) => {
                let why = String::from_utf8_lossy(&reply[1..]).into_owned();
                return Err(Error::invalid_arg(OP, format!("the root refused rank {rank}: {why}")));
            }
            Some(&REPLY_TIMEOUT) => {
                let why = String::from_utf8_lossy(&reply[1..]).into_owned();
                return Err(Error::Timeout { op: OP, after: timeout, what: why });
            }
            _ => return Err(Error::internal(OP, "malformed reply from the root")),
        }
        let table = parse_table(&reply, nranks).ok_or_else(|| Error::internal(OP, "malformed address table from the root"))?;

        // Higher ranks connect to lower ones; the connector sends secret | its rank.
        let mut streams: Vec<Option<TcpStream>> = (0..nranks).map(|_| None).collect();
        for (peer, addr) in table.iter().enumerate().take(rank) {
            // The peer joined the root, so its listener was open: a refused or reset link
            // means its process is gone, a failure of that peer (Remote), not of this host.
            let mut s = TcpStream::connect_timeout(addr, tmo("connecting to a peer")?).map_err(|e| {
                if timed_out(&e) {
                    Error::Timeout { op: OP, after: timeout, what: format!("connecting to rank {peer} at {addr}") }
                } else if peer_gone(&e) {
                    Error::Remote { op: OP, peer, what: format!("rank {peer} at {addr} refused its link ({e}): it exited") }
                } else {
                    io_err(OP, "connect", &e, format!("rank {peer} at {addr}"))
                }
            })?;
            let mut v = secret.to_vec();
            v.extend_from_slice(&(rank as u32).to_be_bytes());
            s.set_write_timeout(Some(tmo("greeting a peer")?)).ok();
            write_frame(&mut s, 0, 0, &v).map_err(|e| {
                if peer_gone(&e) {
                    Error::Remote { op: OP, peer, what: format!("rank {peer} closed its link while greeted ({e}): it exited") }
                } else {
                    io_err(OP, "send", &e, format!("greeting rank {peer}"))
                }
            })?;
            streams[peer] = Some(s);
        }
        listener.set_nonblocking(true).map_err(|e| io_err(OP, "fcntl", &e, "rank listener"))?;
        let mut missing = nranks - 1 - rank;
        while missing > 0 {
            let left = tmo(&format!("{missing} higher rank(s) did not connect"))?;
            let (mut s, from) = match listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
                Err(e) => return Err(io_err(OP, "accept", &e, "rank listener")),
            };
            let _ = s.set_nonblocking(false);
            let _ = s.set_read_timeout(Some(left));
            let greet = read_frame_max(&mut s, MAX_CONTROL).ok().and_then(|(_, _, b)| {
                let sec: [u8; 16] = b.get(0..16)?.try_into().ok()?;
                let p = u32::from_be_bytes(b.get(16..20)?.try_into().ok()?) as usize;
                Some((sec, p))
            });
            match greet {
                Some((sec, p)) if same_secret(&sec, &secret) && p > rank && p < nranks && streams[p].is_none() => {
                    streams[p] = Some(s);
                    missing -= 1;
                }
                _ => log::warn!("hoccl: tcp bootstrap rank {rank}: refused a peer link from {from} (bad greeting)"),
            }
        }

        let shared = Arc::new(Shared { mail: Mutex::new(Mail::default()), cv: Condvar::new(), closing: AtomicBool::new(false) });
        let mut links = Vec::with_capacity(nranks);
        for (peer, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                links.push(None);
                continue;
            };
            let _ = s.set_nodelay(true);
            s.set_read_timeout(None).ok();
            s.set_write_timeout(Some(timeout)).ok();
            let reader = s.try_clone().map_err(|e| io_err(OP, "dup", &e, format!("link to rank {peer}")))?;
            let sh = shared.clone();
            std::thread::Builder::new()
                .name(format!("hoccl-tcp-r{rank}p{peer}"))
                .spawn(move || reader_loop(reader, peer, sh))
                .map_err(|e| io_err(OP, "pthread_create", &e, "reader thread"))?;
            links.push(Some(Mutex::new(s)));
        }
        Ok(TcpBootstrap { rank, size: nranks, timeout, links, shared, round: Mutex::new(0) })
    }

    fn post(&self, kind: u8, peer: usize, tag: u32, data: &[u8], op: &'static str) -> Result<()> {
        if peer >= self.size {
            return Err(Error::invalid_arg(op, format!("peer {peer} out of {}", self.size)));
        }
        let Some(link) = &self.links[peer] else {
            let mut m = self.shared.mail.lock().map_err(|_| Error::internal(op, "poisoned"))?;
            m.boxes.entry((kind, peer, tag)).or_default().push_back(data.to_vec());
            self.shared.cv.notify_all();
            return Ok(());
        };
        let mut s = link.lock().map_err(|_| Error::internal(op, "poisoned"))?;
        write_frame(&mut *s, kind, tag, data).map_err(|e| {
            if timed_out(&e) {
                Error::Timeout { op, after: self.timeout, what: format!("sending {} bytes to rank {peer}", data.len()) }
            } else {
                Error::Remote { op, peer, what: format!("link to rank {peer} failed while sending: {e}") }
            }
        })
    }

    fn take(&self, kind: u8, peer: usize, tag: u32, op: &'static str) -> Result<Vec<u8>> {
        if peer >= self.size {
            return Err(Error::invalid_arg(op, format!("peer {peer} out of {}", self.size)));
        }
        let deadline = Instant::now() + self.timeout;
        let mut m = self.shared.mail.lock().map_err(|_| Error::internal(op, "poisoned"))?;
        loop {
            if let Some(v) = m.boxes.get_mut(&(kind, peer, tag)).and_then(VecDeque::pop_front) {
                return Ok(v);
            }
            if let Some(why) = m.closed.get(&peer) {
                return Err(Error::Remote { op, peer, what: format!("rank {peer} closed its link ({why}) before sending tag {tag}") });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout { op, after: self.timeout, what: format!("no message from rank {peer} with tag {tag}") });
            }
            m = self.shared.cv.wait_timeout(m, deadline - now).map_err(|_| Error::internal(op, "poisoned"))?.0;
        }
    }
}

fn parse_table(b: &[u8], nranks: usize) -> Option<Vec<SocketAddr>> {
    let n = u32::from_be_bytes(b.get(1..5)?.try_into().ok()?) as usize;
    if n != nranks {
        return None;
    }
    let mut at = 5;
    (0..n).map(|_| get_str(b, &mut at)?.parse().ok()).collect()
}

fn reader_loop(mut s: TcpStream, peer: usize, sh: Arc<Shared>) {
    let why = loop {
        match read_frame(&mut s) {
            // A kind no rank sends: the link carries something else than hoccl's frames
            // (corrupt or hostile), so nothing more from it is trusted.
            Ok((kind, _, _)) if kind != KIND_USER && kind != KIND_GATHER => break format!("malformed frame (kind {kind})"),
            Ok((kind, tag, data)) => {
                let Ok(mut m) = sh.mail.lock() else { return };
                m.boxes.entry((kind, peer, tag)).or_default().push_back(data);
                sh.cv.notify_all();
            }
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => break "connection closed".to_string(),
            Err(e) => break e.to_string(),
        }
    };
    if !sh.closing.load(Ordering::Relaxed) {
        log::debug!("hoccl: tcp bootstrap: link from rank {peer} ended: {why}");
    }
    if let Ok(mut m) = sh.mail.lock() {
        m.closed.insert(peer, why);
        sh.cv.notify_all();
    }
}

impl Drop for TcpBootstrap {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Relaxed);
        for s in self.links.iter().flatten() {
            if let Ok(s) = s.lock() {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }
}

impl Bootstrap for TcpBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        const OP: &str = "TcpBootstrap::all_gather";
        let round = {
            let mut r = self.round.lock().map_err(|_| Error::internal(OP, "poisoned"))?;
            *r = r.wrapping_add(1);
            *r
        };
        for p in (0..self.size).filter(|&p| p != self.rank) {
            self.post(KIND_GATHER, p, round, mine, OP)?;
        }
        (0..self.size).map(|p| if p == self.rank { Ok(mine.to_vec()) } else { self.take(KIND_GATHER, p, round, OP) }).collect()
    }

    fn barrier(&self) -> Result<()> {
        self.all_gather(&[]).map(|_| ()).map_err(|e| e.with_op("TcpBootstrap::barrier"))
    }

    fn send(&self, peer: usize, tag: u32, data: &[u8]) -> Result<()> {
        self.post(KIND_USER, peer, tag, data, "TcpBootstrap::send")
    }

    fn recv(&self, peer: usize, tag: u32) -> Result<Vec<u8>> {
        self.take(KIND_USER, peer, tag, "TcpBootstrap::recv")
    }

    fn timeout(&self) -> Option<Duration> {
        Some(self.timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ifname_spec() {
        assert!(ifname_matches("eth", "eth0"));
        assert!(ifname_matches("ib,eth", "eth1"));
        assert!(!ifname_matches("=eth", "eth0"));
        assert!(ifname_matches("=eth0", "eth0"));
        assert!(!ifname_matches("^lo,docker", "lo"));
        assert!(ifname_matches("^lo,docker", "enp3s0"));
        assert!(!ifname_matches("^=eth0", "eth0"));
    }

    /// A rank written out by hand: joins the root of `id` as rank 1 of 2 and greets rank 0
    /// (secret and rank), as `init` does; returns its link to rank 0.
    fn hand_made_rank1(id: &UniqueId) -> TcpStream {
        let mut rs = TcpStream::connect(id.root_addr().unwrap()).unwrap();
        let own = TcpListener::bind("127.0.0.1:0").unwrap();
        write_frame(&mut rs, 0, 0, &hello(&id.secret(), 1, 2, Duration::from_secs(10), own.local_addr().unwrap())).unwrap();
        let (_, _, reply) = read_frame(&mut rs).unwrap();
        assert_eq!(reply.first(), Some(&REPLY_OK));
        let table = parse_table(&reply, 2).unwrap();
        let mut s = TcpStream::connect(table[0]).unwrap();
        let mut greet = id.secret().to_vec();
        greet.extend_from_slice(&1u32.to_be_bytes());
        write_frame(&mut s, 0, 0, &greet).unwrap();
        s
    }

    /// Frames a peer sends after the rendezvous are checked before use: an unknown kind, a
    /// length past the limit and a frame cut short each end the link with a `Remote` error
    /// that says why, and a frame claiming more bytes than it carries allocates only what
    /// arrived. The root stops listening once every rank joined.
    #[test]
    fn corrupt_frames_from_a_peer_are_errors() {
        type Corrupt = (&'static str, Box<dyn Fn(&mut TcpStream)>);
        let corrupt: [Corrupt; 3] = [
            ("malformed frame (kind 9)", Box::new(|s| write_frame(s, 9, 0, b"x").unwrap())),
            ("frame of", Box::new(|s| s.write_all(&[[KIND_USER, 0, 0, 0, 7].as_slice(), &(MAX_FRAME + 1).to_be_bytes()].concat()).unwrap())),
            ("closed its link", Box::new(|s| s.write_all(&[[KIND_USER, 0, 0, 0, 7].as_slice(), &(3u64 << 30).to_be_bytes(), b"abc"].concat()).unwrap())),
        ];
        for (why, send) in corrupt {
            let id = UniqueId::with_ifname(Some("=lo")).unwrap();
            let root = id.root_addr().unwrap();
            let r0 = std::thread::spawn(move || TcpBootstrap::init(&id, 2, 0, Duration::from_secs(10)));
            let mut s = hand_made_rank1(&id);
            let b0 = r0.join().unwrap().expect("rank 0 forms with the hand-made rank 1");
            // The root served its one rendezvous: nobody can join any more.
            let t = Instant::now();
            while TcpStream::connect(root).is_ok() {
                assert!(t.elapsed() < Duration::from_secs(5), "the root still listens after the rendezvous");
                std::thread::sleep(Duration::from_millis(10));
            }
            send(&mut s);
            if why == "closed its link" {
                // Cut short: the reader waits for the bytes until the link ends.
                s.shutdown(Shutdown::Both).unwrap();
            }
            let t = Instant::now();
            let e = b0.recv(1, 7).expect_err("a corrupt frame is no message");
            assert_eq!(e.code(), crate::error::ErrorCode::Remote, "{why}: {e}");
            assert!(e.to_string().contains("rank 1") && e.to_string().contains(why), "{why}: {e}");
            assert!(t.elapsed() < Duration::from_secs(2), "{why}: took {:?}", t.elapsed());
        }
    }

    #[test]
    fn id_roundtrip_hides_secret() {
        let a: SocketAddr = "10.1.2.3:4567".parse().unwrap();
        let id = UniqueId::encode(a, &[0xab; 16]);
        assert_eq!(id.root_addr().unwrap(), a);
        assert_eq!(UniqueId::from_hex(&id.to_hex()).unwrap(), id);
        let shown = format!("{id} {id:?}");
        assert!(shown.contains("10.1.2.3:4567") && !shown.contains("abab"), "{shown}");
        let v6: SocketAddr = "[fd00::1]:80".parse().unwrap();
        assert_eq!(UniqueId::encode(v6, &[1; 16]).root_addr().unwrap(), v6);
        assert!(UniqueId { internal: [0; 128] }.root_addr().is_err());
    }
}
