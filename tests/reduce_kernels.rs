//! The CopyReduce kernels (`cuda/reduce.cu`, `CudaDevice::reduce_kernel_async`) against a
//! host reference written here from the contract in `src/reduce.rs`, bit for bit: every
//! dtype × op × m in {1, 2, 3, 4, 8} × counts (0, 1, odd, 16-byte boundary ± 1, large) ×
//! misaligned offsets. Ignored by default; run on a GPU machine with `--ignored`
//! (scripts/gpu/reduce.sh does). Without a usable GPU they FAIL.
//!
//! The kernels' results are compared with `hoccl::reduce::reduce_into`, the contract's
//! reference (NaN payloads included: its NaN rule is explicit). The helpers here are an
//! independent reading of the contract, checked against it on hand-picked values.
#[path = "common/rng.rs"]
mod rng;
use rng::Rng;
use hoccl::config::BackendChoice;
use hoccl::device::{cuda::CudaDevice, DevPtr, Device};
use hoccl::reduce::{RedOp, Scalar};
use hoccl::types::DataType;
use std::sync::Arc;

// ------------------------------------------------------------------ host reference -----

fn f16_to_f32(h: u16) -> f32 {
    let s = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let e = ((h >> 10) & 31) as i32;
    let m = (h & 0x3ff) as f32;
    match e {
        0 => s * m * 2f32.powi(-24),
        31 => {
            if h & 0x3ff == 0 {
                s * f32::INFINITY
            } else {
                f32::from_bits(((h as u32 & 0x8000) << 16) | 0x7fc0_0000)
            }
        }
        _ => s * (1.0 + m / 1024.0) * 2f32.powi(e - 15),
    }
}

/// Value of fp8 code `b` (e4m3 when `e4`, else e5m2), NaN/inf as f32.
fn f8_to_f32(b: u8, e4: bool) -> f32 {
    let s = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let (eb, mb, bias) = if e4 { (4, 3, 7) } else { (5, 2, 15) };
    let e = ((b as u32 >> mb) & ((1 << eb) - 1)) as i32;
    let m = (b as u32 & ((1 << mb) - 1)) as f32;
    if e4 && b & 0x7f == 0x7f {
        return f32::from_bits(((b as u32 & 0x80) << 24) | 0x7fc0_0000);
    }
    if !e4 && e == 31 {
        return if m == 0.0 { s * f32::INFINITY } else { f32::from_bits(((b as u32 & 0x80) << 24) | 0x7fc0_0000) };
    }
    let scale = (1u32 << mb) as f32;
    if e == 0 {
        s * (m / scale) * 2f32.powi(1 - bias)
    } else {
        s * (1.0 + m / scale) * 2f32.powi(e - bias)
    }
}

/// Nearest-even rounding of finite |x| to the codes 0..=max of a format by table: the
/// largest code whose value is <= x, or the next one when x is past their midpoint (on the
/// midpoint: the even code). Codes past `max` are the caller's (overflow or saturation).
fn nearest(x: f64, values: &[f64]) -> usize {
    let i = values.partition_point(|v| *v <= x) - 1;
    if i + 1 >= values.len() {
        return i;
    }
    let mid = (values[i] + values[i + 1]) / 2.0;
    if x > mid || (x == mid && i % 2 == 1) {
        i + 1
    } else {
        i
    }
}

struct Tables {
    f16: Vec<f64>,  // codes 0..=0x7c00 (the last: 65536, standing for overflow)
    e4m3: Vec<f64>, // codes 0..=0x7e
    e5m2: Vec<f64>, // codes 0..=0x7b
}

fn tables() -> &'static Tables {
    static T: std::sync::OnceLock<Tables> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let mut f16: Vec<f64> = (0..0x7c00u16).map(|c| f16_to_f32(c) as f64).collect();
        f16.push(65536.0);
        Tables {
            f16,
            e4m3: (0..=0x7eu8).map(|c| f8_to_f32(c, true) as f64).collect(),
            e5m2: (0..=0x7bu8).map(|c| f8_to_f32(c, false) as f64).collect(),
        }
    })
}

fn f32_to_f16(x: f32) -> u16 {
    let sign = ((x.to_bits() >> 16) & 0x8000) as u16;
    if x.is_nan() {
        return sign | 0x7e00;
    }
    let a = x.abs() as f64;
    if a >= 65520.0 {
        return sign | 0x7c00;
    }
    sign | nearest(a, &tables().f16) as u16
}

fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if x.is_nan() {
        return ((u >> 16) & 0x8000) as u16 | 0x7fc0;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

fn f32_to_f8(x: f32, e4: bool) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    if x.is_nan() {
        return sign | if e4 { 0x7f } else { 0x7e };
    }
    let t = if e4 { &tables().e4m3 } else { &tables().e5m2 };
    let a = (x.abs() as f64).min(*t.last().unwrap()); // saturating (inf too)
    sign | nearest(a, t) as u8
}

/// One fold step (a: accumulator) and the Avg division, on raw little-endian elements.
fn step(dt: DataType, op: RedOp, a: u64, b: u64) -> u64 {
    macro_rules! int {
        ($t:ty) => {{
            let (x, y) = (a as $t, b as $t);
            (match op {
                RedOp::Sum | RedOp::Avg | RedOp::PreMulSum(_) => x.wrapping_add(y),
                RedOp::Prod => x.wrapping_mul(y),
                RedOp::Max => if y > x { y } else { x },
                RedOp::Min => if y < x { y } else { x },
            }) as u64
        }};
    }
    macro_rules! flt {
        ($x:expr, $y:expr) => {{
            let (x, y) = ($x, $y);
            match op {
                RedOp::Sum | RedOp::Avg | RedOp::PreMulSum(_) => Err(x + y),
                RedOp::Prod => Err(x * y),
                RedOp::Max => Ok(y > x || x.is_nan()),
                RedOp::Min => Ok(y < x || x.is_nan()),
            }
        }};
    }
    // Ok(take b) for min/max, Err(value to round) otherwise
    let small = |r: Result<bool, f32>, narrow: &dyn Fn(f32) -> u64| match r {
        Ok(take_b) => if take_b { b } else { a },
        Err(v) => narrow(v),
    };
    match dt {
        DataType::I8 => int!(i8) & 0xff,
        DataType::U8 => int!(u8),
        DataType::I32 => int!(i32) & 0xffff_ffff,
        DataType::U32 => int!(u32),
        DataType::I64 => int!(i64),
        DataType::U64 => int!(u64),
        DataType::F32 => match flt!(f32::from_bits(a as u32), f32::from_bits(b as u32)) {
            Ok(t) => if t { b } else { a },
            Err(v) => v.to_bits() as u64,
        },
        DataType::F64 => match flt!(f64::from_bits(a), f64::from_bits(b)) {
            Ok(t) => if t { b } else { a },
            Err(v) => v.to_bits(),
        },
        DataType::F16 => small(flt!(f16_to_f32(a as u16), f16_to_f32(b as u16)), &|v| f32_to_f16(v) as u64),
        DataType::BF16 => small(flt!(f32::from_bits((a as u32) << 16), f32::from_bits((b as u32) << 16)), &|v| {
            f32_to_bf16(v) as u64
        }),
        DataType::F8E4M3 => small(flt!(f8_to_f32(a as u8, true), f8_to_f32(b as u8, true)), &|v| f32_to_f8(v, true) as u64),
        DataType::F8E5M2 => {
            small(flt!(f8_to_f32(a as u8, false), f8_to_f32(b as u8, false)), &|v| f32_to_f8(v, false) as u64)
        }
    }
}

fn avg(dt: DataType, a: u64, n: usize) -> u64 {
    let nf = n as f32;
    match dt {
        DataType::I8 => ((a as i8) / n as i8) as u8 as u64,
        DataType::U8 => (a as u8 / n as u8) as u64,
        DataType::I32 => ((a as i32) / n as i32) as u32 as u64,
        DataType::U32 => (a as u32 / n as u32) as u64,
        DataType::I64 => ((a as i64) / n as i64) as u64,
        DataType::U64 => a / n as u64,
        DataType::F32 => (f32::from_bits(a as u32) / nf).to_bits() as u64,
        DataType::F64 => (f64::from_bits(a) / n as f64).to_bits(),
        DataType::F16 => f32_to_f16(f16_to_f32(a as u16) / nf) as u64,
        DataType::BF16 => f32_to_bf16(f32::from_bits((a as u32) << 16) / nf) as u64,
        DataType::F8E4M3 => f32_to_f8(f8_to_f32(a as u8, true) / nf, true) as u64,
        DataType::F8E5M2 => f32_to_f8(f8_to_f32(a as u8, false) / nf, false) as u64,
    }
}

fn get(bytes: &[u8], i: usize, s: usize) -> u64 {
    let mut w = [0u8; 8];
    w[..s].copy_from_slice(&bytes[i * s..(i + 1) * s]);
    u64::from_le_bytes(w)
}

/// The contract's fold of `inputs` (raw bytes of `count` elements each), left to right:
/// `reduce_into`.
pub fn reference(dt: DataType, op: RedOp, inputs: &[&[u8]], count: usize) -> Vec<u8> {
    let mut out = vec![0u8; count * dt.size()];
    let srcs: Vec<&[u8]> = inputs.iter().map(|x| &x[..count * dt.size()]).collect();
    hoccl::reduce::reduce_into(dt, op, &mut out, &srcs).expect("reduce_into");
    out
}

/// This file's reading of the contract, element by element (the spot checks below).
/// PreMulSum: each input times the scalar (a Prod step, the input first), then summed.
fn fold(dt: DataType, op: RedOp, inputs: &[u64]) -> u64 {
    let scaled: Vec<u64> = match op {
        RedOp::PreMulSum(Scalar::Value(s)) => inputs.iter().map(|&x| step(dt, RedOp::Prod, x, s)).collect(),
        _ => inputs.to_vec(),
    };
    let inputs = &scaled;
    let mut acc = inputs[0];
    for &x in &inputs[1..] {
        acc = step(dt, op, acc, x);
    }
    if op == RedOp::Avg {
        acc = avg(dt, acc, inputs.len());
    }
    acc
}

// ------------------------------------------------------------------ data ---------------

/// Random elements: raw bit patterns (specials, subnormals, NaNs) mixed with values of
/// moderate size, so sums and products are not all inf or NaN.
fn data(rng: &mut Rng, dt: DataType, count: usize) -> Vec<u8> {
    let s = dt.size();
    let mut v = rng.bytes(count * s);
    for i in 0..count {
        if rng.below(4) == 0 {
            continue; // raw bits
        }
        let x = rng.normal() * 4.0;
        let bits: u64 = match dt {
            DataType::F32 => (x as f32).to_bits() as u64,
            DataType::F64 => x.to_bits(),
            DataType::F16 => f32_to_f16(x as f32) as u64,
            DataType::BF16 => f32_to_bf16(x as f32) as u64,
            DataType::F8E4M3 => f32_to_f8(x as f32, true) as u64,
            DataType::F8E5M2 => f32_to_f8(x as f32, false) as u64,
            _ => (x * 8.0) as i64 as u64,
        };
        v[i * s..(i + 1) * s].copy_from_slice(&bits.to_le_bytes()[..s]);
    }
    v
}

// ------------------------------------------------------------------ GPU ----------------

fn gpu() -> Arc<dyn Device> {
    let dev = hoccl::device::open(BackendChoice::Cuda, 0).unwrap_or_else(|e| panic!("needs a GPU, none usable: {e}"));
    assert!(dev.as_cuda().is_some(), "BackendChoice::Cuda opened a device without CUDA");
    dev
}

fn cuda(dev: &Arc<dyn Device>) -> &CudaDevice {
    dev.as_cuda().unwrap()
}

/// One case: m inputs of `count` elements at element offsets `offs` (input k at offs[k],
/// dst at offs[m]) from 256-byte aligned allocations; `in_place`: dst is input 0.
#[allow(clippy::too_many_arguments)]
fn run_case(dev: &Arc<dyn Device>, s: hoccl::device::StreamHandle, rng: &mut Rng, dt: DataType, op: RedOp, m: usize, count: usize, offs: &[usize], in_place: bool) {
    run_case_as(dev, s, rng, dt, op, op, m, count, offs, in_place)
}

/// `run_case` with the operator of the reference given apart (a scalar in device memory is
/// checked against its value).
#[allow(clippy::too_many_arguments)]
fn run_case_as(dev: &Arc<dyn Device>, s: hoccl::device::StreamHandle, rng: &mut Rng, dt: DataType, op: RedOp, ref_op: RedOp, m: usize, count: usize, offs: &[usize], in_place: bool) {
    let es = dt.size();
    let inputs: Vec<Vec<u8>> = (0..m).map(|_| data(rng, dt, count)).collect();
    let len = count * es + 64;
    let bases: Vec<DevPtr> = (0..=m).map(|_| dev.alloc(len).unwrap()).collect();
    let ptrs: Vec<DevPtr> = bases.iter().zip(offs).map(|(b, o)| b.add(o * es)).collect();
    for k in 0..m {
        dev.copy_from_host(ptrs[k], &inputs[k]).unwrap();
    }
    let dst = if in_place { ptrs[0] } else { ptrs[m] };
    cuda(dev).reduce_kernel_async(s, dst, &ptrs[..m], count, dt, op).unwrap();
    dev.synchronize(s).unwrap();
    let mut got = vec![0u8; count * es];
    dev.copy_to_host(&mut got, dst).unwrap();
    let refs: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
    let want = reference(dt, ref_op, &refs, count);
    if got != want {
        let i = (0..count).find(|&i| got[i * es..(i + 1) * es] != want[i * es..(i + 1) * es]).unwrap();
        let ins: Vec<String> = inputs.iter().map(|x| format!("{:#x}", get(x, i, es))).collect();
        panic!(
            "{} {} m={m} count={count} offs={offs:?} in_place={in_place}: element {i}: got {:#x}, want {:#x} (inputs {})",
            dt.name(),
            op.name(),
            get(&got, i, es),
            get(&want, i, es),
            ins.join(" ")
        );
    }
    for b in bases {
        dev.free(b).unwrap();
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn every_dtype_op_and_count_bit_exact() {
    let dev = gpu();
    let s = dev.create_stream().unwrap();
    let mut rng = Rng(0x5eed_0001);
    let mut cases = 0;
    for dt in DataType::ALL {
        let per16 = 16 / dt.size();
        let counts = [0, 1, 7, per16 - 1, per16, per16 + 1, 3 * per16 + 1, 1000, 64 * 1024 + 3];
        for op in RedOp::ALL {
            for m in [1usize, 2, 3, 4, 8] {
                for (ci, &count) in counts.iter().enumerate() {
                    // aligned, all equally misaligned (vector path with a head), and mixed
                    let mis = 1 + rng.below(per16.max(2) as u64 - 1) as usize % per16.max(1);
                    let offs: Vec<usize> = match ci % 3 {
                        0 => vec![0; m + 1],
                        1 => vec![mis % per16; m + 1],
                        _ => (0..=m).map(|_| rng.below(per16 as u64) as usize).collect(),
                    };
                    run_case(&dev, s, &mut rng, dt, op, m, count, &offs, ci == 4);
                    cases += 1;
                }
            }
        }
    }
    eprintln!("{cases} cases bit exact");
}

/// PreMulSum kernels: every dtype, the scalar by value and in device memory (read by the
/// kernel), vector and scalar paths, in place and out of place.
#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn premulsum_every_dtype_bit_exact() {
    let dev = gpu();
    let s = dev.create_stream().unwrap();
    let mut rng = Rng(0x5eed_0003);
    let sp = dev.alloc(8).unwrap();
    for dt in DataType::ALL {
        let per16 = 16 / dt.size();
        for (ci, count) in [1, per16 + 1, 1000, 64 * 1024 + 3].into_iter().enumerate() {
            for m in [1usize, 2, 3, 8] {
                let bits = get(&data(&mut rng, dt, 1), 0, dt.size());
                for on_device in [false, true] {
                    let op = if on_device {
                        dev.copy_from_host(sp, &bits.to_le_bytes()[..dt.size()]).unwrap();
                        RedOp::PreMulSum(Scalar::Device(sp.0))
                    } else {
                        RedOp::PreMulSum(Scalar::Value(bits))
                    };
                    let offs: Vec<usize> = if ci % 2 == 0 { vec![0; m + 1] } else { (0..=m).map(|_| rng.below(per16 as u64) as usize).collect() };
                    run_case_as(&dev, s, &mut rng, dt, op, RedOp::PreMulSum(Scalar::Value(bits)), m, count, &offs, ci == 2);
                }
            }
        }
    }
    dev.free(sp).unwrap();
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn large_and_misaligned_bf16_f32() {
    let dev = gpu();
    let s = dev.create_stream().unwrap();
    let mut rng = Rng(0x5eed_0002);
    for dt in [DataType::BF16, DataType::F32, DataType::F8E4M3, DataType::I64] {
        for op in [RedOp::Sum, RedOp::Avg, RedOp::Max] {
            let count = (3 << 20) / dt.size() + 5;
            run_case(&dev, s, &mut rng, dt, op, 4, count, &[1, 1, 1, 1, 1], false);
            run_case(&dev, s, &mut rng, dt, op, 3, count, &[0, 1, 0, 1], false);
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn every_16bit_pattern_pairwise() {
    // All 2^16 patterns of a 16-bit type against a shuffled copy: specials meet specials.
    let dev = gpu();
    let s = dev.create_stream().unwrap();
    for dt in [DataType::F16, DataType::BF16] {
        let a: Vec<u8> = (0..=u16::MAX).flat_map(|v| v.to_le_bytes()).collect();
        let b: Vec<u8> = (0..=u16::MAX).map(|v| v.wrapping_mul(40503).rotate_left(5)).flat_map(|v| v.to_le_bytes()).collect();
        let count = 1 << 16;
        let pa = dev.alloc(2 * count).unwrap();
        let pb = dev.alloc(2 * count).unwrap();
        let pd = dev.alloc(2 * count).unwrap();
        dev.copy_from_host(pa, &a).unwrap();
        dev.copy_from_host(pb, &b).unwrap();
        for op in RedOp::ALL {
            cuda(&dev).reduce_kernel_async(s, pd, &[pa, pb], count, dt, op).unwrap();
            dev.synchronize(s).unwrap();
            let mut got = vec![0u8; 2 * count];
            dev.copy_to_host(&mut got, pd).unwrap();
            let want = reference(dt, op, &[&a, &b], count);
            if let Some(i) = (0..count).find(|&i| got[2 * i..2 * i + 2] != want[2 * i..2 * i + 2]) {
                panic!("{} {}: {:#x} op {:#x}: got {:#x}, want {:#x}", dt.name(), op.name(), get(&a, i, 2), get(&b, i, 2), get(&got, i, 2), get(&want, i, 2));
            }
        }
        for p in [pa, pb, pd] {
            dev.free(p).unwrap();
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn argument_errors() {
    let dev = gpu();
    let s = dev.create_stream().unwrap();
    let p = dev.alloc(1024).unwrap();
    let c = cuda(&dev);
    assert!(c.reduce_kernel_async(s, p, &[], 4, DataType::F32, RedOp::Sum).is_err(), "no sources");
    assert!(c.reduce_kernel_async(s, p, &[p; 9], 4, DataType::F32, RedOp::Sum).is_err(), "9 sources");
    assert!(c.reduce_kernel_async(s, p, &[p], usize::MAX / 2, DataType::F32, RedOp::Sum).is_err(), "count overflow");
    assert!(c.reduce_kernel_async(s, p.add(1), &[p], 4, DataType::F32, RedOp::Sum).is_err(), "misaligned");
    let before = hoccl::device::kernels::launch_count();
    c.reduce_kernel_async(s, p, &[p], 0, DataType::F32, RedOp::Sum).unwrap();
    assert_eq!(hoccl::device::kernels::launch_count(), before, "count 0 launches nothing");
    c.reduce_kernel_async(s, p, &[p, p], 4, DataType::F32, RedOp::Sum).unwrap();
    assert_eq!(hoccl::device::kernels::launch_count(), before + 1, "one launch counted");
    dev.synchronize(s).unwrap();
    dev.free(p).unwrap();
}

/// The reference itself on hand-checked values (runs without a GPU).
#[test]
fn reference_spot_checks() {
    assert_eq!(f32_to_bf16(1.0), 0x3f80);
    assert_eq!(f32_to_f16(65504.0), 0x7bff);
    assert_eq!(f32_to_f16(65519.0), 0x7bff);
    assert_eq!(f32_to_f16(65520.0), 0x7c00);
    assert_eq!(f32_to_f16(5.960_464_5e-8), 0x0001);
    assert_eq!(f32_to_f16(2.980_232_2e-8), 0x0000, "half the smallest subnormal ties to even 0");
    assert_eq!(f32_to_f8(448.0, true), 0x7e);
    assert_eq!(f32_to_f8(1e9, true), 0x7e);
    assert_eq!(f32_to_f8(f32::NEG_INFINITY, false), 0xfb);
    assert_eq!(f32_to_f8(f32::NAN, false), 0x7e);
    assert_eq!(f32_to_f8(-f32::NAN, true), 0xff);
    assert_eq!(f8_to_f32(0x01, true), 2f32.powi(-9));
    assert_eq!(f8_to_f32(0x7e, true), 448.0);
    assert_eq!(f8_to_f32(0x7b, false), 57344.0);
    // bf16 1 + 2^-8 (exactly between 1 and 1 + 2^-7) rounds to even 1
    assert_eq!(step(DataType::BF16, RedOp::Sum, 0x3f80, 0x3b80), 0x3f80);
    assert_eq!(step(DataType::I8, RedOp::Sum, 0x7f, 1), 0x80);
    assert_eq!(avg(DataType::I8, 0xf9, 2), 0xfd, "-7 / 2 = -3");
    assert_eq!(step(DataType::F32, RedOp::Max, f32::NAN.to_bits() as u64, 1.0f32.to_bits() as u64), 1.0f32.to_bits() as u64);
    assert_eq!(step(DataType::F32, RedOp::Max, 1.0f32.to_bits() as u64, f32::NAN.to_bits() as u64), 1.0f32.to_bits() as u64);
    // The two readings agree on values without generated NaNs.
    let mut rng = Rng(7);
    for dt in [DataType::BF16, DataType::F16, DataType::F32, DataType::F64, DataType::I32, DataType::U8, DataType::F8E4M3] {
        let scalar = get(&data(&mut rng, dt, 1), 0, dt.size());
        for op in RedOp::ALL.into_iter().chain([RedOp::PreMulSum(Scalar::Value(scalar))]) {
            let x: Vec<Vec<u8>> = (0..3).map(|_| data(&mut rng, dt, 64)).collect();
            let refd = reference(dt, op, &x.iter().map(|v| v.as_slice()).collect::<Vec<_>>(), 64);
            for i in 0..64 {
                let vals: Vec<u64> = x.iter().map(|v| get(v, i, dt.size())).collect();
                let mine = fold(dt, op, &vals);
                let theirs = get(&refd, i, dt.size());
                if mine != theirs {
                    // Where a NaN is generated the readings may differ in its sign only.
                    let nan = |w: u64| match dt {
                        DataType::F32 => f32::from_bits(w as u32).is_nan(),
                        DataType::F64 => f64::from_bits(w).is_nan(),
                        DataType::BF16 => w & 0x7fff > 0x7f80,
                        DataType::F16 => w & 0x7fff > 0x7c00,
                        DataType::F8E4M3 => w & 0x7f == 0x7f,
                        _ => false,
                    };
                    assert!(nan(mine) && nan(theirs), "{dt:?} {op:?} element {i}: {mine:#x} vs reduce_into {theirs:#x}");
                }
            }
        }
    }
}

// ------------------------------------------------------------------ fused kernels ------

mod fused {
    use super::*;
    use hoccl::compress::{self, fused, Dtype, Params};

    /// The fixtures of tests/data with extension `ext` (HOCCL_TEST_DATA when run away from
    /// the checkout).
    fn fixtures(ext: &str) -> Vec<(String, Vec<u8>)> {
        let dir = std::env::var_os("HOCCL_TEST_DATA")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data"));
        let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e} (set HOCCL_TEST_DATA)", dir.display()))
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == ext))
            .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
            .collect();
        v.sort();
        assert!(!v.is_empty(), "{ext} fixtures missing in {}", dir.display());
        v
    }
    fn bf16_fixtures() -> Vec<(String, Vec<u8>)> {
        let v = fixtures("bf16");
        assert!(v.len() >= 5, "bf16 fixtures missing");
        v
    }

    struct Case<'a> {
        dev: &'a Arc<dyn Device>,
        s: hoccl::device::StreamHandle,
        dt: Dtype,
    }

    impl Case<'_> {
        /// Compress `data` on the GPU; returns (device stream, its capacity).
        fn compress(&self, data: &[u8], p: &Params) -> (DevPtr, usize) {
            let d = &**self.dev;
            let n = data.len() / self.dt.size();
            let cap = compress::max_compressed_len(self.dt, n, p).unwrap();
            let input = d.alloc(data.len().max(2)).unwrap();
            let out = d.alloc(cap).unwrap();
            let words = d.alloc(16).unwrap();
            d.copy_from_host(input, data).unwrap();
            compress::compress_async(d, self.s, self.dt, input, n, out, cap, words, p).unwrap();
            d.synchronize(self.s).unwrap();
            d.free(input).unwrap();
            d.free(words).unwrap();
            (out, cap)
        }

        /// The fused kernel over `streams` with `local` at `pos`, dst/local at element offset
        /// `shift`, the accumulator in `acc`; returns (dst bytes, status word).
        #[allow(clippy::too_many_arguments)]
        fn fused(&self, streams: &[(DevPtr, usize)], local: &[u8], pos: usize, op: RedOp, shift: usize, in_place: bool, acc: fused::Accumulator) -> (Vec<u8>, u32) {
            let d = &**self.dev;
            let es = self.dt.size();
            let n = local.len() / es;
            let lp = d.alloc(local.len() + 64).unwrap();
            let dp = d.alloc(local.len() + 64).unwrap();
            let st = d.alloc(16).unwrap();
            d.copy_from_host(lp.add(es * shift), local).unwrap();
            let dst = if in_place { lp.add(es * shift) } else { dp.add(es * shift) };
            fused::decompress_reduce_with_async(d, self.s, self.dt, streams, lp.add(es * shift), pos, dst, n, op, st, acc).unwrap();
            d.synchronize(self.s).unwrap();
            let mut got = vec![0u8; local.len()];
            d.copy_to_host(&mut got, dst).unwrap();
            let mut w = [0u8; 4];
            d.copy_to_host(&mut w, st).unwrap();
            for p in [lp, dp, st] {
                d.free(p).unwrap();
            }
            (got, u32::from_le_bytes(w))
        }

        /// fused == reference(inputs in fold order) for every op and local position, with
        /// either accumulator (the dst one in place only where it allows it).
        fn check(&self, name: &str, inputs: &[Vec<u8>], p: &Params, shift: usize) {
            let m = inputs.len() - 1;
            let streams: Vec<(DevPtr, usize)> = inputs[..m].iter().map(|x| self.compress(x, p)).collect();
            let local = &inputs[m];
            let dt = match self.dt {
                Dtype::Bf16 => DataType::BF16,
                Dtype::F16 => DataType::F16,
                Dtype::F32 => DataType::F32,
            };
            let es = self.dt.size();
            for op in RedOp::ALL {
                for pos in 0..=m {
                    let mut order: Vec<&[u8]> = inputs[..m].iter().map(|v| v.as_slice()).collect();
                    order.insert(pos, local);
                    let want = reference(dt, op, &order, local.len() / es);
                    for acc in [fused::Accumulator::Shared, fused::Accumulator::Dst] {
                        let in_place = (pos == m || pos == 0) && op == RedOp::Sum && (acc == fused::Accumulator::Shared || pos == 0);
                        let (got, status) = self.fused(&streams, local, pos, op, shift, in_place, acc);
                        assert_eq!(status, 0, "{name}: {} pos {pos} {acc:?}: status {:#x} ({:?})", op.name(), status, compress::status_result(status));
                        if got != want {
                            let i = (0..got.len() / es).find(|&i| got[es * i..es * (i + 1)] != want[es * i..es * (i + 1)]).unwrap();
                            panic!(
                                "{name}: {} m={m} {} local at {pos} shift {shift} {acc:?}: value {i} of {}: got {:#x}, want {:#x}",
                                dt.name(),
                                op.name(),
                                local.len() / es,
                                get(&got, i, es),
                                get(&want, i, es)
                            );
                        }
                    }
                }
            }
            for (p, _) in streams {
                self.dev.free(p).unwrap();
            }
        }
    }

    fn normal_bf16(rng: &mut Rng, n: usize, sigma: f64, specials: bool) -> Vec<u8> {
        (0..n)
            .flat_map(|_| {
                let v = if specials && rng.below(64) == 0 { rng.next() as u16 } else { f32_to_bf16((rng.normal() * sigma) as f32) };
                v.to_le_bytes()
            })
            .collect()
    }

    #[test]
    #[ignore = "needs a GPU: run with --ignored"]
    fn fused_reduce_of_real_fixtures_bit_exact() {
        let dev = gpu();
        let c = Case { dev: &dev, s: dev.create_stream().unwrap(), dt: Dtype::Bf16 };
        let fx = bf16_fixtures();
        let len = fx.iter().map(|(_, d)| d.len()).min().unwrap() & !1;
        for m in [1usize, 3, 4] {
            let inputs: Vec<Vec<u8>> = (0..=m).map(|k| fx[k % fx.len()].1[..len].to_vec()).collect();
            let names: Vec<&str> = (0..=m).map(|k| fx[k % fx.len()].0.as_str()).collect();
            c.check(&format!("fixtures {names:?}"), &inputs, &Params::default(), 0);
        }
        // one tier, and every fixture against its neighbours at full length (tiled)
        let inputs: Vec<Vec<u8>> = fx.iter().take(4).map(|(_, d)| d.iter().cycle().take(len).copied().collect()).collect();
        c.check("fixtures, one tier", &inputs, &Params { block: 0, tiers: 1 }, 0);
    }

    #[test]
    #[ignore = "needs a GPU: run with --ignored"]
    fn fused_reduce_random_sizes_alignments_and_raw_blocks() {
        let dev = gpu();
        let c = Case { dev: &dev, s: dev.create_stream().unwrap(), dt: Dtype::Bf16 };
        let mut rng = Rng(0x5eed_0003);
        for &n in &[1usize, 31, 1000, 16383, 16384, 16385, 3 * 16384 + 7, 40 * 16384 + 5] {
            for &shift in &[0usize, 1, 2] {
                let m = 1 + rng.below(4) as usize;
                let inputs: Vec<Vec<u8>> = (0..=m)
                    .map(|k| match k % 3 {
                        0 => normal_bf16(&mut rng, n, 0.02, true),
                        1 => normal_bf16(&mut rng, n, 3.0, false),
                        _ => rng.bytes(2 * n), // incompressible: raw blocks
                    })
                    .collect();
                c.check(&format!("random n={n}"), &inputs, &Params::default(), shift);
            }
        }
        // eight compressed inputs at once
        let inputs: Vec<Vec<u8>> = (0..9).map(|_| normal_bf16(&mut rng, 5 * 16384 + 3, 1.0, true)).collect();
        c.check("random m=8", &inputs, &Params::default(), 0);
    }

    /// f16 and f32 (HFX1, FFX1): the real fixtures of each type, then random values of a
    /// normal spread with specials, random bytes (raw blocks), sizes around the block and
    /// element offsets, every operator and local position.
    #[test]
    #[ignore = "needs a GPU: run with --ignored"]
    fn fused_reduce_f16_f32_bit_exact() {
        let dev = gpu();
        let mut rng = Rng(0x5eed_0005);
        for (dt, ext) in [(Dtype::F16, "f16"), (Dtype::F32, "f32")] {
            let c = Case { dev: &dev, s: dev.create_stream().unwrap(), dt };
            let es = dt.size();
            let b = (32 << 10) / es; // the default block
            let fx = fixtures(ext);
            let len = fx[0].1.len() / es * es;
            // the fixture against rotations of itself: four different inputs of real data
            let inputs: Vec<Vec<u8>> = (0..4).map(|k| fx[0].1[..len].iter().cycle().skip(k * 4099 * es).take(len).copied().collect()).collect();
            c.check(&format!("{ext} fixture {}", fx[0].0), &inputs, &Params::default(), 0);
            for &n in &[1usize, 31, 1000, b - 1, b, b + 1, 5 * b + 7] {
                for &shift in &[0usize, 1] {
                    let m = 1 + rng.below(4) as usize;
                    let inputs: Vec<Vec<u8>> = (0..=m)
                        .map(|k| match k % 3 {
                            2 => rng.bytes(es * n),
                            _ => (0..n)
                                .flat_map(|_| {
                                    let x = (rng.normal() * if k == 0 { 0.02 } else { 3.0 }) as f32;
                                    let special = rng.below(64) == 0;
                                    match dt {
                                        Dtype::F32 => (if special { rng.next() as u32 } else { x.to_bits() }).to_le_bytes().to_vec(),
                                        _ => (if special { rng.next() as u16 } else { f32_to_f16(x) }).to_le_bytes().to_vec(),
                                    }
                                })
                                .collect(),
                        })
                        .collect();
                    c.check(&format!("{ext} random n={n}"), &inputs, &Params::default(), shift);
                }
            }
        }
    }

    #[test]
    #[ignore = "needs a GPU: run with --ignored"]
    fn fused_reduce_reports_corrupt_inputs() {
        let dev = gpu();
        let c = Case { dev: &dev, s: dev.create_stream().unwrap(), dt: Dtype::Bf16 };
        let d = &*dev;
        let mut rng = Rng(0x5eed_0004);
        let n = 10 * 16384 + 3;
        let good = normal_bf16(&mut rng, n, 0.02, false);
        let local = normal_bf16(&mut rng, n, 0.02, false);
        let host = compress::compress(Dtype::Bf16, &good, &Params::default()).unwrap();
        let nblocks = u32::from_le_bytes(host[20..24].try_into().unwrap()) as usize;
        let first_block = 24 + 4 * nblocks;
        let block3 = first_block + (0..3).map(|j| u32::from_le_bytes(host[24 + 4 * j..28 + 4 * j].try_into().unwrap()) as usize).sum::<usize>();
        // (what, byte offset, xor): the magic, a block size, block 3's header, its planes
        let cases: [(&str, usize, u8); 5] = [
            ("magic", 0, 0x01),
            ("value count", 8, 0x01),
            ("size of block 2", 24 + 8, 0x04),
            ("header of block 3", block3, 0xc0),
            ("n_esc1 of block 3", block3 + 6, 0x01),
        ];
        for (what, at, x) in cases {
            let mut bad = host.clone();
            bad[at] ^= x;
            let p = d.alloc(bad.len()).unwrap();
            let q = d.alloc(host.len()).unwrap();
            d.copy_from_host(p, &bad).unwrap();
            d.copy_from_host(q, &host).unwrap();
            for streams in [vec![(p, bad.len())], vec![(q, host.len()), (p, bad.len())]] {
                for acc in [fused::Accumulator::Shared, fused::Accumulator::Dst] {
                    let (_, status) = c.fused(&streams, &local, 0, RedOp::Sum, 0, false, acc);
                    assert_ne!(status, 0, "corrupt {what} ({acc:?}): not reported");
                    eprintln!("corrupt {what} ({acc:?}): {:?}", compress::status_result(status).unwrap_err());
                }
            }
            d.free(p).unwrap();
            d.free(q).unwrap();
        }
        // a stream of another block size than the first
        let other = compress::compress(Dtype::Bf16, &good, &Params { block: 8192, tiers: 2 }).unwrap();
        let p = d.alloc(host.len()).unwrap();
        let q = d.alloc(other.len()).unwrap();
        d.copy_from_host(p, &host).unwrap();
        d.copy_from_host(q, &other).unwrap();
        let (_, status) = c.fused(&[(p, host.len()), (q, other.len())], &local, 1, RedOp::Sum, 0, false, fused::Accumulator::Shared);
        assert_ne!(status, 0, "mixed block sizes not reported");
        d.free(p).unwrap();
        d.free(q).unwrap();
    }

    #[test]
    #[ignore = "needs a GPU: run with --ignored"]
    fn fused_reduce_argument_errors() {
        let dev = gpu();
        let s = dev.create_stream().unwrap();
        let p = dev.alloc(4096).unwrap();
        let r = |inputs: &[(DevPtr, usize)], pos: usize, dt: Dtype| {
            fused::decompress_reduce_async(&*dev, s, dt, inputs, p, pos, p, 16, RedOp::Sum, p.add(1024))
        };
        assert!(r(&[], 0, Dtype::Bf16).is_err(), "no inputs");
        assert!(r(&[(p, 64); 9], 0, Dtype::Bf16).is_err(), "9 inputs");
        assert!(r(&[(p, 64)], 2, Dtype::Bf16).is_err(), "local position past the end");
        let dacc = |pos: usize| fused::decompress_reduce_with_async(&*dev, s, Dtype::Bf16, &[(p, 64)], p, pos, p, 16, RedOp::Sum, p.add(1024), fused::Accumulator::Dst);
        assert!(dacc(1).is_err(), "dst accumulator in place with the local input not first");
        assert!(fused::decompress_reduce_async(&*dev, s, Dtype::F32, &[(p, 64)], p.add(2), 0, p, 16, RedOp::Sum, p.add(1024)).is_err(), "f32 local not 4-byte aligned");
        assert!(fused::decompress_reduce_async(&*dev, s, Dtype::F16, &[(p, 64)], p, 0, p.add(1), 16, RedOp::Sum, p.add(1024)).is_err(), "f16 dst not 2-byte aligned");
        dev.synchronize(s).unwrap();
        dev.free(p).unwrap();
    }
}
