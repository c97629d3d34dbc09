//! RDMA verbs (rdma-core's libibverbs) in three FFI levels, as cudarc does for CUDA:
//! [`sys`] (bindgen types, dlsym'd function table), [`result`] (one function per call,
//! `Result`s naming the call), [`safe`] (owning types holding `Arc`s to their parents).
//!
//! libibverbs is loaded at run time with `dlopen("libibverbs.so.1")`, so hosts without
//! rdma-core build and run; code above this module has no `unsafe`.
//!
//! [`nic`] puts what an RDMA transport needs (queue pairs, registered buffers, writes with
//! immediate, small sends, completions) behind one trait, implemented over these bindings
//! and by an in-memory test fabric; [`channel`] is one peer's data path over it (slots,
//! immediates, credits); [`transport`] is the [`crate::transport::Transport`] over one
//! channel per rank of another node (control messages, landing, failure; host staging on
//! CUDA through [`pinned`]). [`decide`] chooses between it and the socket transport; communicator creation
//! (`comm::setup`) makes the agreement collective, opens the NIC ([`open_nic`]) and
//! exchanges every channel's [`channel::Setup`] over the bootstrap. The bindings cover
//! more of libibverbs than the transport uses, so unused items are allowed here.
#![allow(dead_code, unused_imports)]
pub mod channel;
pub mod nic;
mod pinned;
pub mod result;
pub mod safe;
pub mod sys;
pub mod transport;

pub use safe::{
    Access, Completion, CompletionQueue, Context, DeviceAttr, Endpoint, MemoryRegion, PathConfig, PortAttr,
    ProtectionDomain, QpCaps, QueuePair, Sge,
};

use crate::error::Result;

/// One port of an RDMA device.
#[derive(Clone, Debug, PartialEq)]
pub struct RdmaPortInfo {
    /// 1-based.
    pub port: u8,
    /// "ACTIVE", "DOWN", ...
    pub state: String,
    /// "InfiniBand" or "Ethernet".
    pub link_layer: String,
    pub lid: u16,
    pub active_mtu: u32,
    pub rate_gbps: f64,
    /// GID index 0, as 16 bytes (all zero if it could not be read).
    pub gid0: [u8; 16],
}

/// One RDMA device as the probe sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct RdmaDeviceInfo {
    pub name: String,
    pub node_guid: u64,
    pub fw_ver: String,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub max_qp: i32,
    pub max_mr_size: u64,
    pub ports: Vec<RdmaPortInfo>,
    /// Why the device could not be opened or queried (the fields above are then default).
    pub error: Option<String>,
}

/// The RDMA devices of this host.
///
/// Decision: a host without libibverbs is a normal configuration (no NIC transport), so an
/// absent or unloadable library gives `Ok(vec![])` and an info-level log line, never an
/// error; so does a kernel without the uverbs interface. `Err` only when the library loads
/// and listing the devices fails. A device that cannot be opened or queried is listed with
/// its `error` set, so one bad device does not hide the others.
pub fn probe() -> Result<Vec<RdmaDeviceInfo>> {
    if let Err(why) = sys::library() {
        log::info!("hoccl: no RDMA: {why}");
        return Ok(Vec::new());
    }
    Ok(safe::device_names()?.into_iter().map(|name| describe(&name)).collect())
}

fn describe(name: &str) -> RdmaDeviceInfo {
    let mut info = RdmaDeviceInfo {
        name: name.to_string(),
        node_guid: 0,
        fw_ver: String::new(),
        vendor_id: 0,
        vendor_part_id: 0,
        max_qp: 0,
        max_mr_size: 0,
        ports: Vec::new(),
        error: None,
    };
    let r = (|| -> Result<()> {
        let ctx = Context::open(name)?;
        let a = ctx.query_device()?;
        info.node_guid = a.node_guid;
        info.fw_ver = a.fw_ver;
        info.vendor_id = a.vendor_id;
        info.vendor_part_id = a.vendor_part_id;
        info.max_qp = a.max_qp;
        info.max_mr_size = a.max_mr_size;
        for port in 1..=a.phys_port_cnt {
            let p = ctx.query_port(port)?;
            info.ports.push(RdmaPortInfo {
                port,
                state: p.state_name().to_string(),
                link_layer: p.link_layer_name().to_string(),
                lid: p.lid,
                active_mtu: p.active_mtu,
                rate_gbps: p.rate_gbps,
                gid0: ctx.query_gid(port, 0).unwrap_or([0; 16]),
            });
        }
        Ok(())
    })();
    if let Err(e) = r {
        info.error = Some(e.to_string());
    }
    info
}

/// The NIC the verbs layer would open on this rank, as one line for logs and errors, or
/// why there is none: `fake` takes the in-memory test fabric; otherwise [`pick`].
pub fn usable(hca: Option<&str>, gid_index: u8, fake: bool) -> std::result::Result<String, String> {
    if fake {
        return Ok("the in-memory test fabric (HOCCL_VERBS_FAKE=1)".into());
    }
    let (d, p) = pick(hca)?;
    Ok(match p.link_layer.as_str() {
        "Ethernet" => format!("{} port {} (RoCE, GID index {gid_index})", d.name, p.port),
        _ => format!("{} port {} (InfiniBand, LID {})", d.name, p.port, p.lid),
    })
}

/// The inter-node transport a rank wants: what [`decide`] returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    /// The verbs transport (else sockets).
    pub verbs: bool,
    /// `HOCCL_NET` names the transport: the communicator fails rather than take the other.
    pub forced: bool,
    /// Which and why, as one line ("verbs: ...", "socket (...)").
    pub line: String,
}

/// Which transport carries this rank's inter-node traffic under `cfg`, or why `cfg` cannot
/// be met: `HOCCL_NET=ib` takes verbs when a device is usable (or the test fabric is asked
/// for), `auto` takes verbs when usable and sockets otherwise, `socket` takes sockets. The
/// ranks of a communicator then agree (`comm::setup`): verbs only if every rank wants it.
pub fn decide(cfg: &crate::config::Config) -> std::result::Result<Choice, String> {
    use crate::config::NetChoice;
    let nic = match cfg.net {
        NetChoice::Socket => Err(String::new()),
        _ => usable(cfg.ib_hca.as_deref(), cfg.ib_gid_index, cfg.verbs_fake),
    };
    let pick = |verbs: bool, forced: bool, line: String| Ok(Choice { verbs, forced, line });
    match (cfg.net, nic) {
        (NetChoice::Ib, Err(why)) => Err(format!("HOCCL_NET=ib: no usable RDMA device: {why}; use HOCCL_NET=socket or auto")),
        (NetChoice::Ib, Ok(dev)) => pick(true, true, format!("verbs (HOCCL_NET=ib; {dev})")),
        (NetChoice::Socket, _) => pick(false, true, "socket (HOCCL_NET=socket)".into()),
        (NetChoice::Auto, Ok(dev)) => pick(true, false, format!("verbs (HOCCL_NET=auto; {dev})")),
        (NetChoice::Auto, Err(why)) => pick(false, false, format!("socket (HOCCL_NET=auto; no verbs NIC: {why})")),
    }
}

/// [`decide`]'s line for `cfg` (`hoccl-info`).
pub fn choose(cfg: &crate::config::Config) -> std::result::Result<String, String> {
    decide(cfg).map(|c| c.line)
}

/// The NIC the verbs transport opens under `cfg`, with room for `max_qps` queue pairs, and
/// its description: the test fabric (`HOCCL_VERBS_FAKE=1`) or [`pick`]'s device.
pub fn open_nic(cfg: &crate::config::Config, max_qps: usize) -> Result<(Box<dyn nic::Nic>, String)> {
    if cfg.verbs_fake {
        let mut nic = nic::fake::FakeNic::new();
        nic.fail_at(cfg.verbs_fake_fail_at, "injected: transport retry counter exceeded");
        return Ok((Box::new(nic), "the in-memory test fabric".into()));
    }
    let (d, p) = pick(cfg.ib_hca.as_deref()).map_err(|why| crate::error::Error::invalid_usage("verbs::open_nic", why))?;
    let line = usable(Some(&d.name), cfg.ib_gid_index, false).unwrap_or_else(|_| d.name.clone());
    Ok((Box::new(nic::VerbsNic::open(&d.name, p.port, cfg.ib_gid_index, max_qps)?), line))
}

/// Slots of one channel (count, bytes each, header included) when `staging` bytes of
/// registered memory serve `peers` ranks of other nodes: per peer and direction a quarter
/// of its share, in slots of at most [`SLOT_PAYLOAD`] payload bytes (at least 4 KiB), 4 to
/// [`channel::MAX_SLOTS`] of them.
pub fn slots_for(staging: usize, peers: usize) -> (usize, usize) {
    let per_dir = staging / 2 / peers.max(1);
    let payload = (per_dir / 4).clamp(4096, SLOT_PAYLOAD);
    let n = (per_dir / payload).clamp(4, channel::MAX_SLOTS);
    (n, payload + channel::HEADER)
}

/// The largest payload of one verbs chunk.
pub const SLOT_PAYLOAD: usize = 256 << 10;

/// The first device of [`probe`] (named `hca`, when given) with an active port, and that
/// port; or why there is none.
pub fn pick(hca: Option<&str>) -> std::result::Result<(RdmaDeviceInfo, RdmaPortInfo), String> {
    let devs = probe().map_err(|e| e.to_string())?;
    if devs.is_empty() {
        return Err("no RDMA device (libibverbs found none)".into());
    }
    let mut why = Vec::new();
    for d in devs.iter().filter(|d| hca.is_none_or(|h| h == d.name)) {
        if let Some(e) = &d.error {
            why.push(format!("{}: {e}", d.name));
            continue;
        }
        match d.ports.iter().find(|p| p.state == "ACTIVE") {
            Some(p) => return Ok((d.clone(), p.clone())),
            None => why.push(format!("{}: no active port", d.name)),
        }
    }
    if why.is_empty() {
        let names: Vec<&str> = devs.iter().map(|d| d.name.as_str()).collect();
        return Err(format!("no RDMA device named {} (HOCCL_IB_HCA; found {})", hca.unwrap_or(""), names.join(", ")));
    }
    Err(why.join("; "))
}

/// A GID as the usual colon-separated hex (8 groups of 4 digits).
pub fn gid_string(gid: &[u8; 16]) -> String {
    gid.chunks(2).map(|c| format!("{:02x}{:02x}", c[0], c[1])).collect::<Vec<_>>().join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_never_fails_for_a_missing_library_or_no_devices() {
        let devs = probe().expect("probe");
        // Build and GPU machines have libibverbs and no RDMA device; elsewhere, devices must
        // at least have names.
        for d in &devs {
            assert!(!d.name.is_empty());
        }
    }

    #[test]
    fn library_loads_where_installed() {
        if std::path::Path::new("/usr/lib/x86_64-linux-gnu/libibverbs.so.1").exists() {
            assert!(sys::library().is_ok(), "{:?}", sys::library().err());
        }
    }

    #[test]
    fn usable_names_the_fake_and_explains_a_missing_device() {
        assert!(usable(None, 3, true).unwrap().contains("HOCCL_VERBS_FAKE"));
        if probe().unwrap().is_empty() {
            assert!(usable(None, 3, false).unwrap_err().contains("no RDMA device"));
        }
        // A filter that matches nothing says so, whatever the host has.
        if let Err(e) = usable(Some("no-such-hca"), 3, false) {
            assert!(e.contains("no RDMA device"), "{e}");
        }
    }

    #[test]
    fn gid_formats() {
        let mut g = [0u8; 16];
        g[0] = 0xfe;
        g[1] = 0x80;
        g[15] = 1;
        assert_eq!(gid_string(&g), "fe80:0000:0000:0000:0000:0000:0000:0001");
    }

    #[test]
    fn decide_takes_verbs_when_usable_and_says_why_not() {
        use crate::config::{Config, NetChoice};
        let cfg = |net, fake| Config { net, verbs_fake: fake, ib_hca: Some("no-such-hca".into()), ..Config::default() };
        // The fake fabric is usable: ib and auto take verbs on host memory.
        let c = decide(&cfg(NetChoice::Ib, true)).unwrap();
        assert!(c.verbs && c.forced && c.line.starts_with("verbs (HOCCL_NET=ib") && c.line.contains("HOCCL_VERBS_FAKE"), "{c:?}");
        let c = decide(&cfg(NetChoice::Auto, true)).unwrap();
        assert!(c.verbs && !c.forced && c.line.starts_with("verbs (HOCCL_NET=auto"), "{c:?}");
        assert_eq!(choose(&cfg(NetChoice::Auto, true)), Ok(c.line));
        // socket always takes sockets.
        let c = decide(&cfg(NetChoice::Socket, true)).unwrap();
        assert!(!c.verbs && c.forced && c.line == "socket (HOCCL_NET=socket)", "{c:?}");
        // No device: ib is refused with the reason, auto falls back to sockets.
        let e = decide(&cfg(NetChoice::Ib, false)).unwrap_err();
        assert!(e.starts_with("HOCCL_NET=ib: no usable RDMA device") && (e.contains("no-such-hca") || e.contains("no RDMA device")), "{e}");
        let c = decide(&cfg(NetChoice::Auto, false)).unwrap();
        assert!(!c.verbs && c.line.starts_with("socket (HOCCL_NET=auto; no verbs NIC"), "{c:?}");
    }

    #[test]
    fn slots_fit_the_staging_and_the_queue_depth() {
        assert_eq!(slots_for(16 << 20, 1), (32, SLOT_PAYLOAD + channel::HEADER));
        assert_eq!(slots_for(16 << 20, 7), (4, SLOT_PAYLOAD + channel::HEADER));
        assert_eq!(slots_for(64 << 10, 64), (4, 4096 + channel::HEADER));
        assert_eq!(slots_for(1 << 40, 1).0, channel::MAX_SLOTS);
    }
}
