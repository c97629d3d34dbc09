//! `hoccl-info --calibrate`: measure GPU 0 and print the `HOCCL_COST_MODEL` line for it.
//! What one GPU can show: the device-to-device copy (the `same_gpu` link), the codec's
//! throughput and fixed cost per launch for each dtype, and the reduce kernel at its default
//! CTA count; with `--sample FILE`, the compression ratio of that file's values. The other
//! keys keep the model's values (the line says which, and what measures them).
use hoccl::compress::{self, Dtype, Params};
use hoccl::cost::{CodecCost, CostModel};
use hoccl::device::{self, cuda, DevPtr, Device, StreamHandle};
use hoccl::{BackendChoice, DataType, RedOp};
use std::sync::Arc;
use std::time::Instant;

/// The figures' buffers: 256 MiB, as the measurements in docs/results.
const SIZE: usize = 256 << 20;
/// The size of the fixed-cost launches (the codec's smallest row in docs/results).
const SMALL: usize = 32 << 10;

/// Exit status: 0 measured (or no GPU, said so), 1 a measurement failed, 2 bad input.
pub fn run(model: Result<CostModel, String>, sample: Option<&str>) -> i32 {
    let base = match model {
        Ok(m) => m,
        Err(e) => {
            eprintln!("hoccl-info --calibrate: {e}");
            return 2;
        }
    };
    let ratio = match sample.map(sample_ratio).transpose() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("hoccl-info --calibrate: {e}");
            return 2;
        }
    };
    let why = match cuda::probe() {
        Ok(p) if p.count > 0 => None,
        Ok(p) => Some(format!("driver {} reports 0 devices", p.driver_version)),
        Err(e) => Some(e.to_string()),
    };
    if let Some(why) = why {
        println!("hoccl-info --calibrate: no GPU ({why}): host figures not meaningful; nothing measured, HOCCL_COST_MODEL keeps its values");
        // The ratio is a property of the data, not of the GPU: the host codec measures it.
        if let Some((dtype, r)) = ratio {
            println!("# {}_ratio: the --sample file's, by the host codec", dtype_name(dtype));
            println!("HOCCL_COST_MODEL={}_ratio={r}", dtype_name(dtype));
        }
        return 0;
    }
    match measure(base, ratio) {
        Ok((m, notes)) => {
            for n in notes {
                println!("# {n}");
            }
            println!("HOCCL_COST_MODEL={}", m.to_spec());
            0
        }
        Err(e) => {
            eprintln!("hoccl-info --calibrate: {e}");
            1
        }
    }
}

fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::Bf16 => "bf16",
        Dtype::F16 => "f16",
        Dtype::F32 => "f32",
    }
}

/// The compression ratio of a file of raw little-endian values (dtype from its extension),
/// by the host codec (the same format as the GPU's).
fn sample_ratio(path: &str) -> Result<(Dtype, f64), String> {
    let dtype = match path.rsplit('.').next() {
        Some("bf16") => Dtype::Bf16,
        Some("f16") => Dtype::F16,
        Some("f32") => Dtype::F32,
        _ => return Err(format!("--sample {path}: the extension must name the dtype (.bf16, .f16 or .f32)")),
    };
    let data = std::fs::read(path).map_err(|e| format!("--sample {path}: {e}"))?;
    if data.is_empty() || data.len() % dtype.size() != 0 {
        return Err(format!("--sample {path}: {} bytes is not a whole, nonzero number of values", data.len()));
    }
    let packed = compress::compress(dtype, &data, &Params::default()).map_err(|e| format!("--sample {path}: {e}"))?;
    Ok((dtype, packed.len() as f64 / data.len() as f64))
}

/// Values drawn from N(0, 0.02) (like trained weights), `len` bytes of `dtype`.
fn synthetic(dtype: Dtype, len: usize) -> Vec<u8> {
    let mut rng = hoccl::plan::rng::Rng::new(2026);
    let unit = (4usize << 20).min(len);
    let mut v = Vec::with_capacity(unit);
    while v.len() < unit {
        // Box-Muller; 1 - unit() is in (0, 1], so its logarithm is finite.
        let (u1, u2) = (1.0 - rng.unit(), rng.unit());
        let x = ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos() * 0.02) as f32;
        match dtype {
            Dtype::Bf16 => v.extend_from_slice(&(((x.to_bits() + 0x8000) >> 16) as u16).to_le_bytes()),
            Dtype::F16 => v.extend_from_slice(&hoccl::reduce::f32_to_f16(x).to_le_bytes()),
            Dtype::F32 => v.extend_from_slice(&x.to_le_bytes()),
        }
    }
    v.iter().copied().cycle().take(len).collect()
}

/// Median seconds per call of `op` over 5 runs of `reps` calls back to back on `s`.
fn time(dev: &dyn Device, s: StreamHandle, reps: usize, mut op: impl FnMut() -> hoccl::Result<()>) -> hoccl::Result<f64> {
    op()?; // warm-up
    let mut t = Vec::with_capacity(5);
    for _ in 0..5 {
        dev.synchronize(s)?;
        let t0 = Instant::now();
        for _ in 0..reps {
            op()?;
        }
        dev.synchronize(s)?;
        t.push(t0.elapsed().as_secs_f64() / reps as f64);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[2])
}

struct Buffers {
    dev: Arc<dyn Device>,
    ptrs: Vec<DevPtr>,
}

impl Buffers {
    fn alloc(&mut self, len: usize) -> hoccl::Result<DevPtr> {
        let p = self.dev.alloc(len)?;
        self.ptrs.push(p);
        Ok(p)
    }
}

impl Drop for Buffers {
    fn drop(&mut self) {
        for &p in &self.ptrs {
            let _ = self.dev.free(p);
        }
    }
}

fn measure(base: CostModel, ratio: Option<(Dtype, f64)>) -> Result<(CostModel, Vec<String>), String> {
    let e = |e: hoccl::Error| e.to_string();
    let dev = device::open(BackendChoice::Cuda, 0).map_err(e)?;
    let s = dev.create_stream().map_err(e)?;
    let r = measure_on(&dev, s, base, ratio).map_err(e);
    let _ = dev.destroy_stream(s);
    r.map(|(m, mut notes)| {
        notes.insert(0, format!("GPU 0: {} ({})", dev.name(), dev.pci_bus_id()));
        (m, notes)
    })
}

fn measure_on(arc: &Arc<dyn Device>, s: StreamHandle, base: CostModel, ratio: Option<(Dtype, f64)>) -> hoccl::Result<(CostModel, Vec<String>)> {
    let dev = arc.as_ref();
    let mut m = base;
    let mut notes = Vec::new();
    let params = Params::default();
    let mut bufs = Buffers { dev: arc.clone(), ptrs: Vec::new() };
    let cap = compress::max_compressed_len(Dtype::F32, SIZE / 4, &params)?
        .max(compress::max_compressed_len(Dtype::Bf16, SIZE / 2, &params)?)
        .max(compress::max_compressed_len(Dtype::F16, SIZE / 2, &params)?);
    let (input, output, packed, words) = (bufs.alloc(SIZE)?, bufs.alloc(SIZE)?, bufs.alloc(cap)?, bufs.alloc(64)?);
    let gbps = |t: f64, bytes: usize| bytes as f64 / t / 1e9;

    let t = time(dev, s, 10, || dev.memcpy_async(s, output, input, SIZE))?;
    m.same_gpu_gbps = gbps(t, SIZE);
    notes.push(format!("same_gpu_gbps: device-to-device copy of {} MiB", SIZE >> 20));

    for (dtype, name) in [(Dtype::Bf16, "bf16"), (Dtype::F16, "f16"), (Dtype::F32, "f32")] {
        dev.copy_from_host(input, &synthetic(dtype, SIZE))?;
        let n = SIZE / dtype.size();
        let comp = || compress::compress_async(dev, s, dtype, input, n, packed, cap, words, &params);
        let tc = time(dev, s, 5, comp)?;
        let td = time(dev, s, 5, || compress::decompress_async(dev, s, dtype, packed, cap, output, n, words.add(8)))?;
        // The round trip must hold before its figures count.
        dev.synchronize(s)?;
        let mut w = [0u8; 16];
        dev.copy_to_host(&mut w, words)?;
        compress::status_result(u32::from_le_bytes([w[8], w[9], w[10], w[11]]))?;
        let (mut a, mut b) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
        dev.copy_to_host(&mut a, input)?;
        dev.copy_to_host(&mut b, output)?;
        if a != b {
            return Err(hoccl::Error::internal("hoccl-info --calibrate", format!("{name}: the codec's round trip differs")));
        }
        let c = match dtype {
            Dtype::Bf16 => &mut m.bf16,
            Dtype::F16 => &mut m.f16,
            Dtype::F32 => &mut m.f32,
        };
        *c = CodecCost { compress_gbps: gbps(tc, SIZE), decompress_gbps: gbps(td, SIZE), ..*c };
        match ratio {
            Some((d, r)) if d == dtype => {
                c.ratio = r;
                notes.push(format!("{name}: codec on {} MiB of N(0, 0.02) values; ratio of the --sample file", SIZE >> 20));
            }
            _ => notes.push(format!("{name}: codec on {} MiB of N(0, 0.02) values; ratio kept (pass --sample FILE.{name} to measure it on real data)", SIZE >> 20)),
        }
    }

    dev.copy_from_host(input, &synthetic(Dtype::Bf16, SMALL))?;
    let n = SMALL / 2;
    m.compress_fixed_us = 1e6 * time(dev, s, 200, || compress::compress_async(dev, s, Dtype::Bf16, input, n, packed, cap, words, &params))?;
    m.decompress_fixed_us = 1e6 * time(dev, s, 200, || compress::decompress_async(dev, s, Dtype::Bf16, packed, cap, output, n, words.add(8)))?;
    notes.push(format!("compress_fixed_us, decompress_fixed_us: one bf16 launch of {} KiB, back to back", SMALL >> 10));

    // The reduce kernel: 4 bf16 inputs of SIZE/4 bytes each (the four quarters of `input`).
    dev.copy_from_host(input, &synthetic(Dtype::Bf16, SIZE))?;
    let q = SIZE / 4;
    let srcs: Vec<DevPtr> = (0..4).map(|i| input.add(i * q)).collect();
    let t = time(dev, s, 10, || dev.reduce_async(s, output, &srcs, q / 2, DataType::BF16, RedOp::Sum))?;
    m.reduce_gbps = gbps(t, SIZE);
    let small: Vec<DevPtr> = (0..4).map(|i| input.add(i * SMALL)).collect();
    m.reduce_fixed_us = 1e6 * time(dev, s, 200, || dev.reduce_async(s, output, &small, SMALL / 2, DataType::BF16, RedOp::Sum))?;
    notes.push(format!("reduce_gbps: CopyReduce of 4 bf16 inputs of {} MiB (bytes read), default CTAs; reduce_fixed_us: of 4 x {} KiB", q >> 20, SMALL >> 10));
    notes.push("kept (not measured on one GPU): ce_fixed_us (bench --latency), nvlink_gbps (bench --ops sendrecv on two GPUs), pcie_gbps, nic_gbps, reduce_gbps_per_cta (reduce_bench)".into());
    m.validate()?;
    Ok((m, notes))
}
