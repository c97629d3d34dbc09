//! Reads the embedded fatbin's table of contents without a GPU: which architectures it holds
//! (machine code `sm_XX` and PTX `compute_XX`) and the kernel names in its cubins. Used by
//! `hoccl-info` and tests; the driver never needs it.
//!
//! Layout (little-endian; the container nvcc writes with `-fatbin`): a 16-byte header
//! `{u32 magic 0xBA55ED50, u16 version, u16 header_size, u64 entries_size}`, then entries of
//! `{u16 kind (1 PTX, 2 ELF), u16 version, u32 header_size, u64 payload_size,
//! u32 compressed_size, u32 _, u16 minor, u16 major, u32 arch, ..., u64 flags @40}`, each
//! followed by its payload. Flags 0x2000 / 0x8000 mark a compressed payload (PTX usually is,
//! and nvcc compresses the cubins of a large fatbin too; names are not read from those). Kernel names come from the cubins' `.nv.info.<name>`
//! sections, which the compiler emits for every `__global__` function.
use std::collections::BTreeSet;

const MAGIC: u32 = 0xBA55_ED50;
const KIND_PTX: u16 = 1;
const KIND_ELF: u16 = 2;
const FLAG_COMPRESSED: u64 = 0x2000 | 0x8000;

/// One entry of the fatbin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// `sm_90` for machine code, `compute_90` for PTX.
    pub arch: String,
    pub compressed: bool,
    pub payload_bytes: usize,
}

/// The fatbin's table of contents.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Contents {
    pub entries: Vec<Entry>,
    /// Kernel names found in uncompressed entries, sorted, without duplicates.
    pub kernels: Vec<String>,
}

fn u16_at(b: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(off..off.checked_add(2)?)?.try_into().ok()?))
}
fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(off..off.checked_add(4)?)?.try_into().ok()?))
}
fn u64_at(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(off..off.checked_add(8)?)?.try_into().ok()?))
}

/// Parse `image`. `None` if it is not a fatbin (an empty image gives empty contents).
pub fn parse(image: &[u8]) -> Option<Contents> {
    if image.is_empty() {
        return Some(Contents::default());
    }
    if u32_at(image, 0)? != MAGIC {
        return None;
    }
    let header = u16_at(image, 6)? as usize;
    let end = header.checked_add(u64_at(image, 8)? as usize)?.min(image.len());
    let mut out = Contents::default();
    let mut names = BTreeSet::new();
    let mut off = header;
    while off.saturating_add(48) <= end {
        let kind = u16_at(image, off)?;
        let entry_header = u32_at(image, off + 4)? as usize;
        let size = u64_at(image, off + 8)? as usize;
        let arch = u32_at(image, off + 28)?;
        let flags = u64_at(image, off + 40)?;
        let start = off.checked_add(entry_header)?;
        let payload = image.get(start..start.checked_add(size)?.min(end))?;
        let compressed = flags & FLAG_COMPRESSED != 0;
        let prefix = if kind == KIND_PTX { "compute" } else { "sm" };
        out.entries.push(Entry { arch: format!("{prefix}_{arch}"), compressed, payload_bytes: size });
        if !compressed {
            match kind {
                KIND_ELF => elf_kernel_names(payload, &mut names),
                KIND_PTX => ptx_kernel_names(payload, &mut names),
                _ => {}
            }
        }
        if entry_header == 0 && size == 0 {
            break;
        }
        off = start.checked_add(size)?;
    }
    out.kernels = names.into_iter().collect();
    Some(out)
}

/// Names of `.nv.info.<kernel>` sections of an ELF64 cubin.
fn elf_kernel_names(elf: &[u8], names: &mut BTreeSet<String>) {
    let _ = (|| -> Option<()> {
        if elf.get(0..4)? != b"\x7fELF" || *elf.get(4)? != 2 {
            return None;
        }
        let shoff = u64_at(elf, 0x28)? as usize;
        let shentsize = u16_at(elf, 0x3a)? as usize;
        let shnum = u16_at(elf, 0x3c)? as usize;
        let shstrndx = u16_at(elf, 0x3e)? as usize;
        let section = |i: usize| shoff.checked_add(i.checked_mul(shentsize)?);
        let strtab_off = u64_at(elf, section(shstrndx)?.checked_add(0x18)?)? as usize;
        for i in 0..shnum {
            let name_off = u32_at(elf, section(i)?)? as usize;
            let start = strtab_off.checked_add(name_off)?;
            let tail = elf.get(start..)?;
            let len = tail.iter().position(|&c| c == 0)?;
            if let Some(k) = std::str::from_utf8(&tail[..len]).ok().and_then(|s| s.strip_prefix(".nv.info.")) {
                names.insert(k.to_string());
            }
        }
        Some(())
    })();
}

/// Names after `.entry` in PTX text.
fn ptx_kernel_names(ptx: &[u8], names: &mut BTreeSet<String>) {
    let text = String::from_utf8_lossy(ptx);
    for line in text.lines() {
        if let Some(rest) = line.trim_start().strip_prefix(".visible .entry ").or_else(|| line.trim_start().strip_prefix(".entry ")) {
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '$').collect();
            if !name.is_empty() {
                names.insert(name);
            }
        }
    }
}

/// The embedded fatbin's contents (`None` if it cannot be parsed).
pub fn embedded() -> Option<Contents> {
    parse(crate::device::kernels::fatbin())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_fatbin_lists_archs_and_the_pattern_kernel() {
        let c = embedded().expect("the embedded fatbin parses");
        if crate::device::kernels::fatbin().is_empty() {
            assert!(c.entries.is_empty());
            return;
        }
        assert!(c.entries.iter().any(|e| e.arch.starts_with("sm_")), "{c:?}");
        // nvcc compresses the cubins of a large fatbin; names come from uncompressed ones.
        if c.entries.iter().any(|e| e.arch.starts_with("sm_") && !e.compressed) {
            assert!(c.kernels.iter().any(|k| k == "hoccl_fill_pattern"), "{c:?}");
        } else {
            assert!(c.kernels.is_empty(), "{c:?}");
        }
    }

    #[test]
    fn garbage_is_rejected_without_panicking() {
        assert_eq!(parse(b"not a fatbin at all"), None);
        let mut b = MAGIC.to_le_bytes().to_vec();
        b.extend_from_slice(&[1, 0, 16, 0]);
        b.extend_from_slice(&u64::MAX.to_le_bytes());
        b.extend_from_slice(&[0xff; 64]);
        let _ = parse(&b);
        for cut in 0..b.len() {
            let _ = parse(&b[..cut]);
        }
    }

    #[test]
    fn corrupted_embedded_fatbin_never_panics() {
        let good = crate::device::kernels::fatbin().to_vec();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for round in 0..2000 {
            let mut b = good.clone();
            for _ in 0..1 + round % 8 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if !b.is_empty() {
                    let i = (x as usize) % b.len();
                    b[i] = (x >> 32) as u8;
                }
            }
            let _ = parse(&b);
        }
    }

    #[test]
    fn ptx_entries_are_found() {
        let mut names = BTreeSet::new();
        ptx_kernel_names(b".visible .entry hoccl_x(\n.param .u64 a\n)\n.entry y_2(", &mut names);
        assert_eq!(names.into_iter().collect::<Vec<_>>(), vec!["hoccl_x".to_string(), "y_2".to_string()]);
    }
}
