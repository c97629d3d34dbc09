//! Codec throughput on one GPU: compress and decompress (input bytes per second) from
//! 32 KiB to 1 GiB, the compression ratio, and the device-to-device copy bandwidth measured
//! in the same run as the ceiling (one read and one write of every byte, as the codec).
//!
//! ```text
//! codec_bench [--json] [--json-out FILE] [--dtype bf16|f16|f32] [--tiers 1|2] [--block B] [--max-size 1G]
//!             [--min-size 32K] [--fixture FILE] [--backend cuda|host]
//! ```
//! Method: every size rotates through enough buffers that one pass touches >= 256 MiB (far
//! beyond L2), so each repetition reads HBM; a measurement enqueues R repetitions between
//! two stream synchronizations (host timer), and the median of 5 measurements is reported.
//! Input: bf16/f16/f32 values drawn from N(0, 0.02) (like trained weights), or the
//! `--fixture` file tiled; never zeros. Every size is round-tripped and checked first.
use hoccl::compress::{self, Dtype, Params};
use hoccl::config::BackendChoice;
use hoccl::device::{DevPtr, Device, StreamHandle};
use std::time::Instant;

const FOOTPRINT: usize = 256 << 20;

struct Opts {
    json: bool,
    /// `--json-out FILE`: the JSON rows to FILE as well as the table to stdout (one sweep).
    json_out: Option<String>,
    dtype: Dtype,
    params: Params,
    min: usize,
    max: usize,
    fixture: Option<String>,
    backend: BackendChoice,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().map(|v| v * mul).map_err(|e| format!("size {s}: {e}"))
}

fn opts() -> Result<Opts, String> {
    let mut o = Opts {
        json: false,
        json_out: None,
        dtype: Dtype::Bf16,
        params: Params::default(),
        min: 32 << 10,
        max: 1 << 30,
        fixture: None,
        backend: BackendChoice::Cuda,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--json" => o.json = true,
            "--json-out" => o.json_out = Some(val()?),
            "--dtype" => o.dtype = Dtype::parse(&val()?).ok_or("unknown dtype")?,
            "--tiers" => o.params.tiers = val()?.parse().map_err(|e| format!("--tiers: {e}"))?,
            "--block" => o.params.block = val()?.parse().map_err(|e| format!("--block: {e}"))?,
            "--max-size" => o.max = parse_size(&val()?)?,
            "--min-size" => o.min = parse_size(&val()?)?,
            "--fixture" => o.fixture = Some(val()?),
            "--backend" => {
                o.backend = match val()?.as_str() {
                    "cuda" => BackendChoice::Cuda,
                    "host" => BackendChoice::Host,
                    b => return Err(format!("unknown backend {b}")),
                }
            }
            _ => return Err(format!("unknown argument {a}; see the doc comment of examples/codec_bench.rs")),
        }
    }
    Ok(o)
}

/// `len` bytes of input: the fixture tiled, or N(0, 0.02) values of the dtype.
fn pattern(o: &Opts, len: usize) -> Result<Vec<u8>, String> {
    let unit: Vec<u8> = match &o.fixture {
        Some(f) => std::fs::read(f).map_err(|e| format!("{f}: {e}"))?,
        None => {
            let mut s = 0x1234_5678_9abc_def0u64;
            let mut next = move || {
                s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = s;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
            };
            let n = (16usize << 20).min(len.max(4)) / o.dtype.size();
            let mut v = Vec::with_capacity(n * o.dtype.size());
            for _ in 0..n {
                let x = ((-2.0 * (next() + 1e-300).ln()).sqrt() * (2.0 * std::f64::consts::PI * next()).cos() * 0.02)
                    as f32;
                match o.dtype {
                    Dtype::Bf16 => v.extend_from_slice(&((x.to_bits() + 0x8000) >> 16).to_le_bytes()[..2]),
                    Dtype::F16 => v.extend_from_slice(&half(x).to_le_bytes()),
                    Dtype::F32 => v.extend_from_slice(&x.to_le_bytes()),
                }
            }
            v
        }
    };
    if unit.is_empty() || unit.len() % o.dtype.size() != 0 {
        return Err("fixture is empty or not a whole number of values".into());
    }
    Ok(unit.iter().copied().cycle().take(len).collect())
}

/// fp32 → fp16 (truncating; bench data only needs the right distribution).
fn half(x: f32) -> u16 {
    let u = x.to_bits();
    let e = ((u >> 23) & 0xff) as i32 - 112;
    let sign = ((u >> 16) & 0x8000) as u16;
    if e <= 0 {
        sign
    } else if e >= 31 {
        sign | 0x7bff
    } else {
        sign | ((e as u16) << 10) | ((u >> 13) & 0x3ff) as u16
    }
}

struct Slots {
    base: DevPtr,
    stride: usize,
}

fn alloc(dev: &dyn Device, k: usize, stride: usize) -> Result<Slots, String> {
    let stride = (stride + 255) & !255;
    Ok(Slots { base: dev.alloc(k * stride).map_err(|e| e.to_string())?, stride })
}

impl Slots {
    fn at(&self, i: usize) -> DevPtr {
        self.base.add(i * self.stride)
    }
}

/// Median seconds per repetition of `op(i)` over 5 measurements of `reps` repetitions.
fn time(
    dev: &dyn Device,
    s: StreamHandle,
    reps: usize,
    k: usize,
    mut op: impl FnMut(usize) -> Result<(), String>,
) -> Result<f64, String> {
    let mut t = Vec::new();
    op(0)?; // warm-up (module load, first-touch)
    for _ in 0..5 {
        dev.synchronize(s).map_err(|e| e.to_string())?;
        let t0 = Instant::now();
        for r in 0..reps {
            op(r % k)?;
        }
        dev.synchronize(s).map_err(|e| e.to_string())?;
        t.push(t0.elapsed().as_secs_f64() / reps as f64);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[2])
}

struct Row {
    bytes: usize,
    compress: f64,
    decompress: f64,
    ratio: f64,
    copy: f64,
}

fn bench_size(dev: &dyn Device, s: StreamHandle, o: &Opts, size: usize, data: &[u8]) -> Result<Row, String> {
    let dt = o.dtype;
    let n = size / dt.size();
    let e = |e: hoccl::Error| e.to_string();
    let cap = compress::max_compressed_len(dt, n, &o.params).map_err(e)?;
    let k = FOOTPRINT.div_ceil(size).clamp(1, 8192);
    let (input, packed, output, words) =
        (alloc(dev, k, size)?, alloc(dev, k, cap)?, alloc(dev, k, size)?, alloc(dev, k, 16)?);
    for i in 0..k {
        dev.copy_from_host(input.at(i), &data[..size]).map_err(e)?;
    }
    // Round trip once, checked.
    compress::compress_async(dev, s, dt, input.at(0), n, packed.at(0), cap, words.at(0), &o.params).map_err(e)?;
    compress::decompress_async(dev, s, dt, packed.at(0), cap, output.at(0), n, words.at(0).add(8)).map_err(e)?;
    dev.synchronize(s).map_err(e)?;
    let mut w = [0u8; 16];
    dev.copy_to_host(&mut w, words.at(0)).map_err(e)?;
    compress::status_result(u32::from_le_bytes(w[8..12].try_into().unwrap())).map_err(e)?;
    let stream_len = u64::from_le_bytes(w[..8].try_into().unwrap()) as usize;
    let mut back = vec![0u8; size];
    dev.copy_to_host(&mut back, output.at(0)).map_err(e)?;
    if back[..] != data[..size] {
        return Err(format!("{size} bytes: round trip differs"));
    }
    let reps = ((4usize << 30) / size).clamp(10, 4000);
    let tc = time(dev, s, reps, k, |i| {
        compress::compress_async(dev, s, dt, input.at(i), n, packed.at(i), cap, words.at(i), &o.params).map_err(e)
    })?;
    for i in 0..k {
        // every slot the decoder reads must hold a stream (the timed loop may not reach all)
        compress::compress_async(dev, s, dt, input.at(i), n, packed.at(i), cap, words.at(i), &o.params).map_err(e)?;
    }
    let td = time(dev, s, reps, k, |i| {
        compress::decompress_async(dev, s, dt, packed.at(i), cap, output.at(i), n, words.at(i).add(8)).map_err(e)
    })?;
    let last = (reps - 1) % k;
    dev.copy_to_host(&mut w, words.at(last)).map_err(e)?;
    compress::status_result(u32::from_le_bytes(w[8..12].try_into().unwrap())).map_err(e)?;
    let tm = time(dev, s, reps, k, |i| dev.memcpy_async(s, output.at(i), input.at(i), size).map_err(e))?;
    for sl in [input, packed, output, words] {
        dev.free(sl.base).map_err(e)?;
    }
    let gbs = |t: f64| size as f64 / t / 1e9;
    Ok(Row {
        bytes: size,
        compress: gbs(tc),
        decompress: gbs(td),
        ratio: stream_len as f64 / size as f64,
        copy: gbs(tm),
    })
}

fn main() {
    if let Err(e) = run() {
        eprintln!("codec_bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let o = opts()?;
    let dev = hoccl::device::open(o.backend, 0).map_err(|e| format!("no device: {e}"))?;
    let s = dev.create_stream().map_err(|e| e.to_string())?;
    let data = pattern(&o, o.max)?;
    let mut rows = Vec::new();
    if !o.json {
        println!("# {} {} tiers {} block {}", dev.name(), o.dtype.name(), o.params.tiers, o.params.block_for(o.dtype));
        println!(
            "{:>10} {:>12} {:>12} {:>7} {:>12} {:>7} {:>7}",
            "bytes", "comp GB/s", "decomp GB/s", "ratio", "D2D GB/s", "comp%", "decomp%"
        );
    }
    let mut size = o.min;
    while size <= o.max {
        let r = bench_size(&*dev, s, &o, size, &data)?;
        if !o.json {
            println!(
                "{:>10} {:>12.1} {:>12.1} {:>7.4} {:>12.1} {:>6.0}% {:>6.0}%",
                r.bytes,
                r.compress,
                r.decompress,
                r.ratio,
                r.copy,
                100.0 * r.compress / r.copy,
                100.0 * r.decompress / r.copy
            );
        }
        rows.push(r);
        size *= 2;
    }
    if o.json || o.json_out.is_some() {
        let items: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"bytes\":{},\"dtype\":\"{}\",\"tiers\":{},\"compress_gbps\":{:.2},\"decompress_gbps\":{:.2},\"ratio\":{:.5},\"copy_gbps\":{:.2}}}",
                    r.bytes,
                    o.dtype.name(),
                    o.params.tiers,
                    r.compress,
                    r.decompress,
                    r.ratio,
                    r.copy
                )
            })
            .collect();
        let json = format!("[{}]", items.join(",\n "));
        if o.json {
            println!("{json}");
        }
        if let Some(path) = &o.json_out {
            std::fs::write(path, json + "\n").map_err(|e| format!("{path}: {e}"))?;
        }
    }
    Ok(())
}
