//! CopyReduce throughput on one GPU (`CudaDevice::reduce_kernel_async`), in bytes read per
//! second, against the device-to-device copy measured in the same run (bytes read per
//! second: one read and one write of every byte), at the default CTA count and a sweep.
//!
//! ```text
//! reduce_bench [--size 256M] [--inputs 4] [--dtype bf16] [--json-out FILE]
//! ```
//! Method: `--inputs` sources of `--size` bytes each (far beyond L2) and one destination;
//! a measurement enqueues R repetitions between two stream synchronizations (host timer),
//! and the median of 5 measurements is reported. The first launch of every configuration is
//! checked against a host fold of a sample of elements (bf16 sum). Then the fused
//! decompress + reduce kernels of every codec dtype against the standalone codec and the two
//! passes they replace (`fused::bench`).
use hoccl::config::BackendChoice;
use hoccl::device::cuda::{reduce_ctas, CudaDevice, DEFAULT_REDUCE_CTAS};
use hoccl::device::{DevPtr, Device, StreamHandle};
use hoccl::reduce::RedOp;
use hoccl::types::DataType;
use std::time::Instant;

struct Opts {
    size: usize,
    inputs: usize,
    dtype: DataType,
    json_out: Option<String>,
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
    let mut o = Opts { size: 256 << 20, inputs: 4, dtype: DataType::BF16, json_out: None };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--size" => o.size = parse_size(&val()?)?,
            "--inputs" => o.inputs = val()?.parse().map_err(|e| format!("--inputs: {e}"))?,
            "--dtype" => {
                let v = val()?;
                o.dtype = *DataType::ALL.iter().find(|d| d.name() == v).ok_or(format!("--dtype {v}: unknown"))?
            }
            "--json-out" => o.json_out = Some(val()?),
            _ => return Err(format!("unknown argument {a}")),
        }
    }
    Ok(o)
}

/// Median seconds per repetition of `f` (R repetitions per measurement, 5 measurements).
fn time(dev: &dyn Device, s: StreamHandle, reps: usize, mut f: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
    f()?;
    dev.synchronize(s).map_err(|e| e.to_string())?;
    let mut t = Vec::new();
    for _ in 0..5 {
        let t0 = Instant::now();
        for _ in 0..reps {
            f()?;
        }
        dev.synchronize(s).map_err(|e| e.to_string())?;
        t.push(t0.elapsed().as_secs_f64() / reps as f64);
    }
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Ok(t[2])
}

fn bf16(x: f32) -> u16 {
    let u = x.to_bits();
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

fn main() {
    if let Err(e) = run() {
        eprintln!("reduce_bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let o = opts()?;
    let dev = hoccl::device::open(BackendChoice::Cuda, 0).map_err(|e| e.to_string())?;
    let cuda: &CudaDevice = dev.as_cuda().ok_or("not a CUDA device")?;
    let s = dev.create_stream().map_err(|e| e.to_string())?;
    let e = |e: hoccl::Error| e.to_string();
    let count = o.size / o.dtype.size();
    let srcs: Vec<DevPtr> = (0..o.inputs).map(|_| dev.alloc(o.size)).collect::<Result<_, _>>().map_err(e)?;
    let dst = dev.alloc(o.size).map_err(e)?;
    // Data: bf16 values of N(0, 1)-like spread from the device pattern (sign, exponent 120-134).
    for (k, p) in srcs.iter().enumerate() {
        dev.fill_pattern_async(s, *p, o.size, 77 + k as u64).map_err(e)?;
    }
    dev.synchronize(s).map_err(e)?;
    if o.dtype == DataType::BF16 {
        // Sane values: 1 + i/…, so sums stay finite (the pattern's raw bits hold NaNs).
        let host: Vec<u8> = (0..count).flat_map(|i| bf16(1.0 + (i % 1000) as f32 / 1000.0).to_le_bytes()).collect();
        for p in &srcs {
            dev.copy_from_host(*p, &host).map_err(e)?;
        }
    }
    let sm = cuda.sm_count();
    let gbs = |bytes: usize, t: f64| bytes as f64 / t / 1e9;
    let reps = (4usize << 30).div_ceil(o.size * (o.inputs + 1)).max(2);
    let t_copy = time(&*dev, s, reps, || dev.memcpy_async(s, dst, srcs[0], o.size).map_err(|x| x.to_string()))?;
    let copy_read = gbs(o.size, t_copy);
    println!("CopyReduce, {} inputs of {} MiB {} (sum), one H200-class GPU with {sm} SMs", o.inputs, o.size >> 20, o.dtype.name());
    println!("device-to-device copy: {copy_read:.1} GB/s read ({:.1} GB/s read+write)", 2.0 * copy_read);
    println!("{:>6} {:>10} {:>14} {:>10}", "CTAs", "time ms", "read GB/s", "vs copy");
    let mut rows = Vec::new();
    let default = reduce_ctas();
    let mut sweep = vec![8, 16, 32, 66, 132, 264];
    if !sweep.contains(&default) {
        sweep.push(default);
    }
    for &ctas in &sweep {
        cuda.reduce_kernel_ctas_async(s, dst, &srcs, count, o.dtype, RedOp::Sum, ctas).map_err(e)?;
        dev.synchronize(s).map_err(e)?;
        if o.dtype == DataType::BF16 {
            let mut got = vec![0u8; 2 * 4096];
            dev.copy_to_host(&mut got, dst).map_err(e)?;
            for i in 0..4096 {
                let x = f32::from_bits((bf16(1.0 + (i % 1000) as f32 / 1000.0) as u32) << 16);
                let mut acc = bf16(x);
                for _ in 1..o.inputs {
                    acc = bf16(f32::from_bits((acc as u32) << 16) + x);
                }
                let g = u16::from_le_bytes([got[2 * i], got[2 * i + 1]]);
                if g != acc {
                    return Err(format!("{ctas} CTAs: element {i}: got {g:#x}, want {acc:#x}"));
                }
            }
        }
        let t = time(&*dev, s, reps, || {
            cuda.reduce_kernel_ctas_async(s, dst, &srcs, count, o.dtype, RedOp::Sum, ctas).map_err(|x| x.to_string())
        })?;
        let read = gbs(o.size * o.inputs, t);
        let mark = if ctas == default { " (default)" } else { "" };
        println!("{ctas:>6} {:>10.3} {read:>14.1} {:>9.1}%{mark}", t * 1e3, 100.0 * read / copy_read);
        rows.push(format!(
            "{{\"kind\": \"copy_reduce\", \"dtype\": \"{}\", \"op\": \"sum\", \"inputs\": {}, \"bytes_per_input\": {}, \"ctas\": {ctas}, \"default\": {}, \"seconds\": {t:.6e}, \"read_gbps\": {read:.2}, \"copy_read_gbps\": {copy_read:.2}, \"vs_copy\": {:.4}}}",
            o.dtype.name(),
            o.inputs,
            o.size,
            ctas == default,
            read / copy_read
        ));
    }
    println!("default CTAs: {default} (DEFAULT_REDUCE_CTAS = {DEFAULT_REDUCE_CTAS}, HOCCL_REDUCE_CTAS overrides)");
    rows.extend(fused::bench(&*dev, s, &o)?);
    if let Some(path) = &o.json_out {
        let body = format!("{{\"sm_count\": {sm}, \"copy_read_gbps\": {copy_read:.2}, \"rows\": [\n  {}\n]}}\n", rows.join(",\n  "));
        std::fs::write(path, body).map_err(|x| format!("{path}: {x}"))?;
    }
    for p in srcs.iter().chain(std::iter::once(&dst)) {
        dev.free(*p).map_err(e)?;
    }
    Ok(())
}

mod fused {
    use super::*;
    use hoccl::compress::{self, Dtype, Params};

    fn data_type(dt: Dtype) -> DataType {
        match dt {
            Dtype::Bf16 => DataType::BF16,
            Dtype::F16 => DataType::F16,
            Dtype::F32 => DataType::F32,
        }
    }

    /// `n` values of `dt` spread uniformly in ±0.025 (trained-weight-like exponents),
    /// different per `seed`.
    fn weights(dt: Dtype, n: usize, seed: u64) -> Vec<u8> {
        let mut x = 0x1234_5678u64 + seed;
        let mut v = Vec::with_capacity(n * dt.size());
        for _ in 0..n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (((x >> 11) as f64) / (1u64 << 53) as f64 - 0.5) * 0.05;
            match dt {
                Dtype::Bf16 => v.extend_from_slice(&bf16(u as f32).to_le_bytes()),
                Dtype::F16 => v.extend_from_slice(&hoccl::reduce::f32_to_f16(u as f32).to_le_bytes()),
                Dtype::F32 => v.extend_from_slice(&(u as f32).to_le_bytes()),
            }
        }
        v
    }

    /// The fused rows of every codec dtype: bf16 in full (4 and 3 compressed inputs, the two
    /// passes, the AllReduce step's sequence with compression), f16 and f32 with 4 inputs.
    pub fn bench(dev: &dyn Device, s: StreamHandle, o: &Opts) -> Result<Vec<String>, String> {
        let mut rows = Vec::new();
        for dt in Dtype::ALL {
            rows.extend(bench_dtype(dev, s, o, dt)?);
        }
        Ok(rows)
    }

    /// The standalone codec on 4 inputs of `dt` of `o.size` bytes (the baseline of the fused
    /// kernels): compress each, then decompress each, in decompressed bytes per second; then
    /// the fused rows against it.
    fn bench_dtype(dev: &dyn Device, s: StreamHandle, o: &Opts, dt: Dtype) -> Result<Vec<String>, String> {
        let e = |e: hoccl::Error| e.to_string();
        let n = o.size / dt.size();
        let p = Params::default();
        let cap = compress::max_compressed_len(dt, n, &p).map_err(e)?;
        let inputs: Vec<DevPtr> = (0..4).map(|_| dev.alloc(o.size)).collect::<Result<_, _>>().map_err(e)?;
        let packed: Vec<DevPtr> = (0..5).map(|_| dev.alloc(cap)).collect::<Result<_, _>>().map_err(e)?;
        let out = dev.alloc(o.size).map_err(e)?;
        let words = dev.alloc(64).map_err(e)?;
        // 16 MiB of values per input, tiled, different per input
        for (k, ptr) in inputs.iter().enumerate() {
            let unit = weights(dt, (16 << 20) / dt.size(), k as u64);
            let host: Vec<u8> = unit.iter().copied().cycle().take(o.size).collect();
            dev.copy_from_host(*ptr, &host).map_err(e)?;
        }
        let reps = 2;
        let t_c = time(dev, s, reps, || {
            for k in 0..4 {
                compress::compress_async(dev, s, dt, inputs[k], n, packed[k], cap, words.add(8 * k), &p).map_err(|x| x.to_string())?;
            }
            Ok(())
        })?;
        let t_d = time(dev, s, reps, || {
            for k in 0..4 {
                compress::decompress_async(dev, s, dt, packed[k], cap, out, n, words.add(32 + 4 * k)).map_err(|x| x.to_string())?;
            }
            Ok(())
        })?;
        let gb = |t: f64| (4 * o.size) as f64 / t / 1e9;
        let name = dt.name();
        println!("standalone codec, 4 {name} inputs of {} MiB: compress {:.1} GB/s, decompress {:.1} GB/s (uncompressed bytes)", o.size >> 20, gb(t_c), gb(t_d));
        let mut rows = vec![
            format!("{{\"kind\": \"compress\", \"dtype\": \"{name}\", \"inputs\": 4, \"bytes_per_input\": {}, \"seconds\": {t_c:.6e}, \"gbps\": {:.2}}}", o.size, gb(t_c)),
            format!("{{\"kind\": \"decompress\", \"dtype\": \"{name}\", \"inputs\": 4, \"bytes_per_input\": {}, \"seconds\": {t_d:.6e}, \"gbps\": {:.2}}}", o.size, gb(t_d)),
        ];
        let r = fused_rows(dev, s, o, dt, &packed, cap, inputs[0], out, words, gb(t_c), gb(t_d));
        for ptr in inputs.iter().chain(&packed).chain([&out, &words]) {
            dev.free(*ptr).map_err(e)?;
        }
        rows.extend(r?);
        Ok(rows)
    }

    /// The AllReduce step in one kernel (`decompress_reduce_compress_async`): the fold of the
    /// compressed `inputs` and `local` (last) into `out`, coded into a stream; checked first
    /// (the stream byte for byte the standalone compressor's of `out`), then timed, in
    /// decompressed bytes of the compressed inputs per second, beside the standalone
    /// compressor of the same run.
    #[allow(clippy::too_many_arguments)]
    fn drc_row(
        dev: &dyn Device,
        s: StreamHandle,
        o: &Opts,
        dt: Dtype,
        inputs: &[(DevPtr, usize)],
        local: DevPtr,
        out: DevPtr,
        status: DevPtr,
        cap: usize,
        compress_gbps: f64,
    ) -> Result<String, String> {
        use compress::fused;
        let (n, m, name) = (o.size / dt.size(), inputs.len(), dt.name());
        let e = |e: hoccl::Error| e.to_string();
        let p = Params::default();
        let ws_len = fused::drc_workspace_len(dt, m, n, &p).map_err(e)?;
        let bufs: Vec<DevPtr> = [ws_len, cap, cap, 16].iter().map(|&l| dev.alloc(l)).collect::<Result<_, _>>().map_err(e)?;
        let (ws, stream, reference, lens) = (bufs[0], bufs[1], bufs[2], bufs[3]);
        let result = (|| -> Result<String, String> {
            let drc_out = fused::DrcOut { out: stream, cap, out_len: lens, total: n, params: p };
            let run = || -> Result<(), String> {
                fused::drc_begin_async(dev, s, dt, &drc_out).map_err(e)?;
                fused::decompress_reduce_compress_async(dev, s, dt, inputs, local, m, out, n, RedOp::Sum, status, &drc_out, 0, (ws, ws_len)).map_err(e)
            };
            run()?;
            compress::compress_async(dev, s, dt, out, n, reference, cap, lens.add(8), &p).map_err(e)?;
            dev.synchronize(s).map_err(e)?;
            let mut w = [0u8; 16];
            dev.copy_to_host(&mut w, lens).map_err(e)?;
            let word = |i: usize| u64::from_le_bytes(w[i..i + 8].try_into().unwrap()) as usize;
            let mut st = [0u8; 4];
            dev.copy_to_host(&mut st, status).map_err(e)?;
            compress::status_result(u32::from_le_bytes(st)).map_err(|x| format!("drc kernel ({name}): {x}"))?;
            let (len, ref_len) = (word(0), word(8));
            let (mut a, mut b) = (vec![0u8; len.min(cap)], vec![0u8; ref_len.min(cap)]);
            dev.copy_to_host(&mut a, stream).map_err(e)?;
            dev.copy_to_host(&mut b, reference).map_err(e)?;
            if a != b {
                return Err(format!("drc kernel ({m} {name} inputs): its stream ({len} bytes) differs from the compressor's ({ref_len} bytes)"));
            }
            let t = time(dev, s, 2, run)?;
            let gbps = (m * o.size) as f64 / t / 1e9;
            println!(
                "  decompress + reduce + compress in one kernel, {m} compressed {name} inputs + 1 local: {gbps:.1} GB/s of decompressed inputs ({:.1}% of standalone compress; stream {len} bytes, the compressor's)",
                100.0 * gbps / compress_gbps
            );
            Ok(format!(
                "{{\"kind\": \"fused_decompress_reduce_compress\", \"dtype\": \"{name}\", \"op\": \"sum\", \"compressed_inputs\": {m}, \"local_inputs\": 1, \"bytes_per_input\": {}, \"seconds\": {t:.6e}, \"gbps\": {gbps:.2}, \"compress_gbps\": {compress_gbps:.2}, \"vs_compress\": {:.4}, \"stream_bytes\": {len}}}",
                o.size,
                gbps / compress_gbps
            ))
        })();
        for b in bufs {
            dev.free(b).map_err(e)?;
        }
        result
    }

    /// The fused decompress+reduce kernel over 4 (bf16: then 3) of the compressed inputs and
    /// a raw local one (local last in the order), in decompressed bytes of the compressed
    /// inputs per second, beside the standalone decompressor's figure (4 streams, same data),
    /// and the two passes it replaces (each stream decompressed into a buffer of its own,
    /// then the CopyReduce kernel over them and the local input, default CTAs), in the same
    /// unit. bf16 also: the AllReduce step in one kernel (decompress + reduce + compress,
    /// `drc_row`), and in two (the fused kernel, then the standalone compressor over its
    /// output, which reads it back), in the same unit, beside the standalone compressor.
    #[allow(clippy::too_many_arguments)]
    fn fused_rows(
        dev: &dyn Device,
        s: StreamHandle,
        o: &Opts,
        dt: Dtype,
        packed: &[DevPtr],
        cap: usize,
        local: DevPtr,
        out: DevPtr,
        words: DevPtr,
        compress_gbps: f64,
        decompress_gbps: f64,
    ) -> Result<Vec<String>, String> {
        let n = o.size / dt.size();
        let name = dt.name();
        let status = words.add(48);
        let mut rows = Vec::new();
        let e = |e: hoccl::Error| e.to_string();
        let ms: &[usize] = if dt == Dtype::Bf16 { &[4, 3] } else { &[4] };
        let scratch: Vec<DevPtr> = (0..ms[0]).map(|_| dev.alloc(o.size)).collect::<Result<_, _>>().map_err(e)?;
        let result = (|| -> Result<(), String> {
            for &m in ms {
                let inputs: Vec<(DevPtr, usize)> = packed[..m].iter().map(|p| (*p, cap)).collect();
                let run = || {
                    compress::fused::decompress_reduce_async(dev, s, dt, &inputs, local, m, out, n, RedOp::Sum, status)
                        .map_err(|x| x.to_string())
                };
                run()?;
                dev.synchronize(s).map_err(|x| x.to_string())?;
                let mut w = [0u8; 4];
                dev.copy_to_host(&mut w, status).map_err(|x| x.to_string())?;
                compress::status_result(u32::from_le_bytes(w)).map_err(|x| format!("fused kernel ({name}): {x}"))?;
                let t = time(dev, s, 2, run)?;
                let gbps = (m * o.size) as f64 / t / 1e9;
                println!(
                    "fused decompress+reduce, {m} compressed {name} inputs + 1 local, {} MiB output: {gbps:.1} GB/s of decompressed inputs ({:.1}% of standalone decompress)",
                    o.size >> 20,
                    100.0 * gbps / decompress_gbps
                );
                rows.push(format!(
                    "{{\"kind\": \"fused_decompress_reduce\", \"accumulator\": \"shared\", \"dtype\": \"{name}\", \"op\": \"sum\", \"compressed_inputs\": {m}, \"local_inputs\": 1, \"bytes_per_input\": {}, \"seconds\": {t:.6e}, \"gbps\": {gbps:.2}, \"decompress_gbps\": {decompress_gbps:.2}, \"vs_decompress\": {:.4}}}",
                    o.size,
                    gbps / decompress_gbps
                ));
                // The accumulator in dst (L2) instead of shared memory, checked equal first.
                let sample = (1 << 16).min(o.size);
                let mut shared_out = vec![0u8; sample];
                dev.copy_to_host(&mut shared_out, out).map_err(|x| x.to_string())?;
                let run_d = || {
                    compress::fused::decompress_reduce_with_async(dev, s, dt, &inputs, local, m, out, n, RedOp::Sum, status, compress::fused::Accumulator::Dst)
                        .map_err(|x| x.to_string())
                };
                run_d()?;
                dev.synchronize(s).map_err(|x| x.to_string())?;
                let mut dacc_out = vec![0u8; sample];
                dev.copy_to_host(&mut dacc_out, out).map_err(|x| x.to_string())?;
                if dacc_out != shared_out {
                    return Err(format!("{m} {name} inputs: the two accumulators differ"));
                }
                let td = time(dev, s, 2, run_d)?;
                let gbpsd = (m * o.size) as f64 / td / 1e9;
                println!("  accumulator in dst: {gbpsd:.1} GB/s ({:.1}% of standalone decompress)", 100.0 * gbpsd / decompress_gbps);
                rows.push(format!(
                    "{{\"kind\": \"fused_decompress_reduce\", \"accumulator\": \"dst\", \"dtype\": \"{name}\", \"op\": \"sum\", \"compressed_inputs\": {m}, \"local_inputs\": 1, \"bytes_per_input\": {}, \"seconds\": {td:.6e}, \"gbps\": {gbpsd:.2}, \"decompress_gbps\": {decompress_gbps:.2}, \"vs_decompress\": {:.4}}}",
                    o.size,
                    gbpsd / decompress_gbps
                ));
                // The two passes, checked equal to the fused result first.
                let mut srcs: Vec<DevPtr> = scratch[..m].to_vec();
                srcs.push(local);
                let two = || -> Result<(), String> {
                    for k in 0..m {
                        compress::decompress_async(dev, s, dt, packed[k], cap, scratch[k], n, words.add(32 + 4 * k)).map_err(|x| x.to_string())?;
                    }
                    dev.reduce_async(s, scratch[0], &srcs, n, data_type(dt), RedOp::Sum).map_err(|x| x.to_string())
                };
                let fused_out = shared_out;
                two()?;
                dev.synchronize(s).map_err(|x| x.to_string())?;
                let mut two_out = vec![0u8; sample];
                dev.copy_to_host(&mut two_out, scratch[0]).map_err(|x| x.to_string())?;
                if fused_out != two_out {
                    return Err(format!("{m} {name} inputs: the fused kernel and the two passes differ"));
                }
                let t2 = time(dev, s, 2, two)?;
                let gbps2 = (m * o.size) as f64 / t2 / 1e9;
                println!("  two passes (decompress each, then CopyReduce): {gbps2:.1} GB/s; fused / two passes {:.2}x", gbps / gbps2);
                rows.push(format!(
                    "{{\"kind\": \"two_pass_decompress_reduce\", \"dtype\": \"{name}\", \"op\": \"sum\", \"compressed_inputs\": {m}, \"local_inputs\": 1, \"bytes_per_input\": {}, \"seconds\": {t2:.6e}, \"gbps\": {gbps2:.2}, \"fused_gbps\": {gbps:.2}}}",
                    o.size
                ));
                if dt == Dtype::Bf16 {
                    rows.push(drc_row(dev, s, o, dt, &inputs, local, out, status, cap, compress_gbps)?);
                }
                if dt == Dtype::Bf16 && m == 3 {
                    // The AllReduce step of 4 ranks without the fused compression: fused
                    // decompress + reduce, then compress the shard.
                    let step = || -> Result<(), String> {
                        run()?;
                        compress::compress_async(dev, s, dt, out, n, packed[4], cap, words.add(56), &Params::default()).map_err(|x| x.to_string())
                    };
                    let t3 = time(dev, s, 2, step)?;
                    let gbps3 = (m * o.size) as f64 / t3 / 1e9;
                    println!(
                        "  then compress the {} MiB result (the AllReduce step as it runs, two kernels): {gbps3:.1} GB/s of decompressed inputs ({:.1}% of standalone compress)",
                        o.size >> 20,
                        100.0 * gbps3 / compress_gbps
                    );
                    rows.push(format!(
                        "{{\"kind\": \"fused_decompress_reduce_then_compress\", \"dtype\": \"{name}\", \"op\": \"sum\", \"compressed_inputs\": {m}, \"local_inputs\": 1, \"bytes_per_input\": {}, \"seconds\": {t3:.6e}, \"gbps\": {gbps3:.2}, \"compress_gbps\": {compress_gbps:.2}, \"vs_compress\": {:.4}}}",
                        o.size,
                        gbps3 / compress_gbps
                    ));
                }
            }
            Ok(())
        })();
        for p in scratch {
            dev.free(p).map_err(|x| x.to_string())?;
        }
        result.map(|_| rows)
    }
}
