//! What each rank tells the others about itself at communicator creation: one
//! [`RankRecord`], serialized with [`RankRecord::to_bytes`] for the bootstrap all-gather.
use crate::config::Config;
use crate::error::{Error, Result};

/// One rank's view of its process and GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankRecord {
    /// Host name; ranks with equal names share a host (and its GPUs, memory and NICs).
    pub hostname: String,
    pub pid: u32,
    /// GPUs this rank can see (0 on a host without GPUs: the host backend's one device).
    pub gpu_count: u32,
    /// The GPU this rank asks for: its `Config.device` (`HOCCL_DEVICE`). `None` lets the
    /// topology choose (host-local rank modulo `gpu_count`).
    pub gpu: Option<u32>,
    /// PCI bus id of the chosen GPU (`0000:18:00.0`), empty when not known yet. Two ranks of
    /// one host with the same non-empty id share a GPU even if their ordinals differ (as with
    /// different `CUDA_VISIBLE_DEVICES`); without ids, equal ordinals mean a shared GPU.
    pub pci_bus_id: String,
    /// This host's NIC-affine forwarding map as this process reads it from sysfs
    /// ([`choose_forwarding`](super::choose_forwarding)): for each GPU ordinal the process
    /// sees, the ordinal of the GPU whose staging buffer and NIC carry its inter-node
    /// traffic. Empty when not known (no GPU, no usable NIC, or not probed). Every process of
    /// a host reads the same sysfs, so the topology takes the lowest rank's.
    pub forwarding: Vec<u32>,
}

/// "HRR2" little-endian: hoccl rank record, format 2.
const MAGIC: u32 = 0x3252_5248;

impl RankRecord {
    /// This process's record: host name, pid, `config.device` as the requested GPU. The
    /// caller supplies what the device layer saw (`gpu_count`, and the PCI bus id of the
    /// requested GPU if it has one); the forwarding map starts empty
    /// ([`with_forwarding`](Self::with_forwarding)).
    pub fn for_this_process(config: &Config, gpu_count: u32, pci_bus_id: &str) -> RankRecord {
        RankRecord {
            hostname: local_hostname(),
            pid: std::process::id(),
            gpu_count,
            gpu: config.device.map(|d| u32::try_from(d).unwrap_or(u32::MAX)),
            pci_bus_id: pci_bus_id.to_string(),
            forwarding: Vec::new(),
        }
    }

    /// The same record carrying this host's forwarding map (GPU ordinal → forwarding GPU
    /// ordinal, one entry per GPU the process sees).
    pub fn with_forwarding(mut self, map: Vec<u32>) -> RankRecord {
        self.forwarding = map;
        self
    }

    /// Little-endian encoding: magic, hostname (u32 length + UTF-8), pid, gpu_count,
    /// gpu (u8 present flag + u32), pci_bus_id (u32 length + UTF-8), forwarding (u32 count
    /// + u32 each).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        const OP: &str = "RankRecord::to_bytes";
        let mut out = Vec::with_capacity(32 + self.hostname.len() + self.pci_bus_id.len());
        out.extend_from_slice(&MAGIC.to_le_bytes());
        put_str(OP, &mut out, &self.hostname)?;
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.gpu_count.to_le_bytes());
        out.push(u8::from(self.gpu.is_some()));
        out.extend_from_slice(&self.gpu.unwrap_or(0).to_le_bytes());
        put_str(OP, &mut out, &self.pci_bus_id)?;
        let n = u32::try_from(self.forwarding.len()).map_err(|_| Error::invalid_arg(OP, "forwarding map too long"))?;
        out.extend_from_slice(&n.to_le_bytes());
        self.forwarding.iter().for_each(|g| out.extend_from_slice(&g.to_le_bytes()));
        Ok(out)
    }

    /// Decode what [`to_bytes`](Self::to_bytes) wrote. Any other input (truncated, trailing
    /// bytes, bad magic, invalid UTF-8) is a `CorruptData` error.
    pub fn from_bytes(bytes: &[u8]) -> Result<RankRecord> {
        let mut r = Reader { bytes, at: 0 };
        if r.u32()? != MAGIC {
            return Err(Error::corrupt(Reader::OP, "not a hoccl rank record (bad magic)"));
        }
        let hostname = r.string()?;
        let pid = r.u32()?;
        let gpu_count = r.u32()?;
        let has_gpu = r.u8()?;
        let gpu = r.u32()?;
        let gpu = match has_gpu {
            0 => None,
            1 => Some(gpu),
            f => return Err(Error::corrupt(Reader::OP, format!("gpu flag {f}"))),
        };
        let pci_bus_id = r.string()?;
        let n = r.u32()? as usize;
        if n > (bytes.len() - r.at) / 4 {
            return Err(Error::corrupt(Reader::OP, format!("forwarding map of {n} entries in {} bytes", bytes.len() - r.at)));
        }
        let forwarding = (0..n).map(|_| r.u32()).collect::<Result<Vec<u32>>>()?;
        if r.at != bytes.len() {
            return Err(Error::corrupt(Reader::OP, format!("{} trailing bytes", bytes.len() - r.at)));
        }
        Ok(RankRecord { hostname, pid, gpu_count, gpu, pci_bus_id, forwarding })
    }
}

fn put_str(op: &'static str, out: &mut Vec<u8>, s: &str) -> Result<()> {
    let len = u32::try_from(s.len()).map_err(|_| Error::invalid_arg(op, "string longer than 4 GiB"))?;
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    const OP: &'static str = "RankRecord::from_bytes";

    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or_else(|| {
            Error::corrupt(Self::OP, format!("truncated: need {n} bytes at offset {}, have {}", self.at, self.bytes.len()))
        })?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn string(&mut self) -> Result<String> {
        let len = self.u32()? as usize;
        let b = self.take(len)?;
        String::from_utf8(b.to_vec()).map_err(|_| Error::corrupt(Self::OP, "string is not UTF-8"))
    }
}

/// The kernel's host name (`/proc/sys/kernel/hostname`), else `$HOSTNAME`, else
/// `"localhost"`: never fails, so a rank can always describe itself.
pub fn local_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "localhost".to_string())
}
