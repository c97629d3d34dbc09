//! The codec's shared test bodies on the CPU reference, plus what only the host API has:
//! ratio targets on real data, argument errors, the format's size bounds.
mod codec_common;
use codec_common::*;
use hoccl::compress::{self, format, Dtype, Params};

#[test]
fn cpu_all_16bit_patterns() {
    all_16bit_patterns(&Cpu);
}

#[test]
fn cpu_f32_specials() {
    f32_specials(&Cpu);
}

#[test]
fn cpu_sizes() {
    sizes(&Cpu);
}

#[test]
fn cpu_block_sizes() {
    block_sizes(&Cpu);
}

#[test]
fn cpu_incompressible() {
    incompressible(&Cpu);
}

#[test]
fn cpu_distributions() {
    distributions(&Cpu);
}

#[test]
fn cpu_decodes_cpu_streams() {
    decodes_cpu_streams(&Cpu);
}

/// The targets: real trained bf16 weights compress to <= 0.72 with one tier and <= 0.70
/// with two; every fixture compresses in both modes.
#[test]
fn cpu_real_data_ratios() {
    let rows = real_data(&Cpu);
    for (file, class, r1, r2) in &rows {
        eprintln!("{file:34} {class:12} one tier {r1:.4}  two tiers {r2:.4}");
        assert!(r2 <= r1, "{file}: two tiers ({r2}) worse than one ({r1})");
        assert!(*r1 < 1.0, "{file}: did not compress");
        if class == "weights" && file.ends_with(".bf16") {
            assert!(*r1 <= 0.72, "{file}: one tier {r1} > 0.72");
            assert!(*r2 <= 0.70, "{file}: two tiers {r2} > 0.70");
        }
    }
    assert!(rows.iter().any(|r| r.1 == "gradients") && rows.iter().any(|r| r.1 == "activations"));
}

/// Codes past a group's end (planes1's last group, planes2's past n_esc1) are ignored.
#[test]
fn cpu_ignores_padding_codes() {
    let bad = padding_codes_ignored(&Cpu);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn bf16_default_stream_layout() {
    // The stream header spelled out (format.rs): magic, version, n, B, nblocks, sizes.
    let data = normal_values(Dtype::Bf16, 16384 + 5, 0.02, 1);
    let s = compress::compress(Dtype::Bf16, &data, &Params::default()).unwrap();
    assert_eq!(&s[0..4], b"BFX1");
    assert_eq!(u32::from_le_bytes(s[4..8].try_into().unwrap()), 1);
    assert_eq!(u64::from_le_bytes(s[8..16].try_into().unwrap()), 16389);
    assert_eq!(u32::from_le_bytes(s[16..20].try_into().unwrap()), 16384);
    assert_eq!(u32::from_le_bytes(s[20..24].try_into().unwrap()), 2);
    let b0 = u32::from_le_bytes(s[24..28].try_into().unwrap()) as usize;
    let b1 = u32::from_le_bytes(s[28..32].try_into().unwrap()) as usize;
    assert_eq!(32 + b0 + b1, s.len());
    let (h, blocks) = compress::inspect(&s).unwrap();
    assert_eq!((h.nblocks, blocks[1].values), (2, 5));
    assert!(blocks[0].header.k1 >= 1, "normal data must be coded, not raw");
}

#[test]
fn max_compressed_len_bounds_every_stream() {
    let mut r = Rng(1234);
    for _ in 0..40 {
        let dt = Dtype::ALL[r.below(3) as usize];
        let n = r.below(50_000) as usize;
        let p = Params { block: 32 * (1 + r.below(600) as u32), tiers: 1 + r.below(2) as u8 };
        let data = if r.below(2) == 0 { r.bytes(n * dt.size()) } else { normal_values(dt, n, 1.0, r.next()) };
        let s = compress::compress(dt, &data, &p).unwrap();
        let bound = format::max_stream_len("t", dt, n as u64, p.block).unwrap();
        assert!(s.len() <= bound && bound <= compress::max_compressed_len(dt, n, &p).unwrap());
    }
}

#[test]
fn bad_arguments_are_errors() {
    let d = [0u8; 6];
    assert!(compress::compress(Dtype::F32, &d, &Params::default()).is_err(), "6 bytes of f32");
    assert!(compress::compress(Dtype::Bf16, &d, &Params { block: 33, tiers: 2 }).is_err());
    assert!(compress::compress(Dtype::Bf16, &d, &Params { block: 1 << 25, tiers: 2 }).is_err());
    assert!(compress::compress(Dtype::Bf16, &d, &Params { block: 0, tiers: 3 }).is_err());
    let mut small = [0u8; 10];
    assert!(compress::compress_into(Dtype::Bf16, &d, &mut small, &Params::default()).is_err());
    for bad in [&b""[..], b"BFX1", b"XXXX\x01\0\0\0\0\0\0\0\0\0\0\0\0\x40\0\0\0\0\0\0"] {
        assert!(compress::decompress(bad).is_err());
    }
    let s = compress::compress(Dtype::Bf16, &normal_values(Dtype::Bf16, 100, 1.0, 1), &Params::default()).unwrap();
    let mut out = vec![0u8; 198];
    assert!(compress::decompress_into(&s, &mut out).is_err(), "output of the wrong size");
}

#[test]
fn one_tier_never_uses_a_second() {
    let data = normal_values(Dtype::Bf16, 100_000, 0.02, 9);
    let s = compress::compress(Dtype::Bf16, &data, &Params { block: 0, tiers: 1 }).unwrap();
    let (_, blocks) = compress::inspect(&s).unwrap();
    assert!(blocks.iter().all(|b| b.header.k2 == 0 && b.header.k1 > 0));
}
