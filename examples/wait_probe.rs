//! How many streams may wait for a collective at once before hoccl's copies stop running,
//! whether waiting on an event instead of a host flag changes that, and how a kernel fares
//! when other threads enqueue such waits at the same moment (CUDA only, not self-checking).
//!
//! `cargo run --release --example wait_probe [flag|event] [WAITERS] [first|last]`
//! `cargo run --release --example wait_probe race [ROUNDS] [WAITERS] [OPEN]`
//!
//! `flag` / `event`: makes 3 copy queues (as a communicator does; `last`: after the
//! waiters), then WAITERS streams that wait, the way user streams wait for pending
//! collectives:
//! - `flag`: each stream waits on a host flag (`cuStreamWaitValue64`, what hoccl does);
//! - `event`: one gate stream waits on the host flag and records an event, and every
//!   other stream waits on that event (`cuStreamWaitEvent`).
//!
//! Then each copy queue gets a 4-byte copy and a fence, as the proxy issues a collective's
//! copies after the streams reached it, and a fresh stream gets a fill kernel and a flag
//! write (as a rank's stream runs its own work before its collective). After 300 ms it
//! prints how many copies have not run and whether the kernel has, releases the flag and
//! checks that everything ran. A driver call that itself waits for the flag would hang the
//! probe: a guard releases the flag after 3 s and says where.
//!
//! `race`: the thread-rank tests' failing pattern, ROUNDS times. Each round makes WAITERS +
//! 1 fresh streams; WAITERS threads enqueue a flag write and a wait on a host flag while,
//! released by the same barrier, the main thread enqueues a fill kernel and a flag write on
//! its stream (as a Broadcast's root fills its data). It counts the rounds whose kernel and
//! write had not run 1 s later, then releases the waits. OPEN:
//! - 1: each thread opens its own device object (as the tests' ranks do);
//! - 0: the threads share one;
//! - 2: no threads: the main thread enqueues the waits, then the kernel;
//! - 3: as 0, the threads' streams made by the main thread beforehand;
//! - 4: as 0, every enqueue call (the threads' and the main thread's) under one lock, so
//!   that none overlap (is it the overlap, or the threads?).
//!
//! hoccl's own enqueue gate (`HOCCL_SERIAL_ENQUEUE`, `src/device/cuda/enqueue_gate.rs`) applies to
//! these calls too: in `auto` it is closed in mode 1 (several devices on the GPU) and open
//! in the others; `HOCCL_SERIAL_ENQUEUE=0` measures the race itself in every mode.
use cudarc::driver::sys;
use hoccl::config::BackendChoice;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

static STEP: AtomicUsize = AtomicUsize::new(0);

fn cu(what: &str, r: sys::CUresult) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "wait_probe: {what} failed");
}

fn main() -> hoccl::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().is_some_and(|a| a == "race") {
        let num = |i: usize, d: usize| args.get(i).map_or(d, |s| s.parse().expect("a number"));
        return race(num(1, 100), num(2, 3), num(3, 1));
    }
    let event_mode = match args.first().map(String::as_str).unwrap_or("flag") {
        "flag" => false,
        "event" => true,
        m => panic!("wait_probe: mode {m}: flag or event"),
    };
    let waiters: usize = args.get(1).map_or(64, |s| s.parse().expect("WAITERS"));
    let queues_last = args.get(2).is_some_and(|s| s == "last");
    let dev = hoccl::device::open(BackendChoice::Cuda, 0)?;
    dev.bind_thread()?;
    let buf = dev.alloc(1 << 12)?;
    let flags = Arc::new(dev.alloc_flags(2)?);
    let guard_flags = flags.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(3));
        let s = STEP.load(Ordering::Acquire);
        if s != usize::MAX {
            eprintln!("wait_probe: enqueue stuck after 3 s at step {s} (1000 + waiter, 2000 + queue copy, 3000 kernel): releasing the flag");
            guard_flags.store(0, 1);
        }
    });
    let t0 = Instant::now();
    let mut queues = Vec::new();
    if !queues_last {
        for _ in 0..3 {
            queues.push(dev.create_copy_queue()?);
        }
    }
    let gate = dev.create_stream()?;
    let mut event: sys::CUevent = std::ptr::null_mut();
    if event_mode {
        dev.wait_value_geq(gate, flags.dev_addr(0), 1)?;
        // SAFETY: valid out-pointer; bind_thread made the device's context current.
        cu("cuEventCreate", unsafe { sys::cuEventCreate(&mut event, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) });
        // SAFETY: the event and the stream belong to the current context.
        cu("cuEventRecord", unsafe { sys::cuEventRecord(event, gate.0 as sys::CUstream) });
    }
    let mut streams = Vec::new();
    for j in 0..waiters {
        STEP.store(1000 + j, Ordering::Release);
        let s = dev.create_stream()?;
        if event_mode {
            // SAFETY: the event was recorded above; both belong to the current context.
            cu("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(s.0 as sys::CUstream, event, 0) });
        } else {
            dev.wait_value_geq(s, flags.dev_addr(0), 1)?;
        }
        streams.push(s);
    }
    if queues_last {
        for _ in 0..3 {
            queues.push(dev.create_copy_queue()?);
        }
    }
    let mut tickets = Vec::new();
    for (i, q) in queues.iter_mut().enumerate() {
        STEP.store(2000 + i, Ordering::Release);
        q.copy(buf.add(2048), buf, 4)?;
        tickets.push(q.fence()?);
    }
    STEP.store(3000, Ordering::Release);
    let k = dev.create_stream()?;
    dev.fill_pattern_async(k, buf.add(1024), 64, 7)?;
    dev.write_value(k, flags.dev_addr(1), 1)?;
    STEP.store(usize::MAX, Ordering::Release);
    let enq = t0.elapsed();
    std::thread::sleep(Duration::from_millis(300));
    let mut stuck = 0;
    for (i, q) in queues.iter_mut().enumerate() {
        if q.completed()? < tickets[i] {
            stuck += 1;
        }
    }
    let kernel_ran = flags.load(1) == 1;
    println!(
        "wait_probe: {} mode, {waiters} waiting streams, copy queues made {}, CUDA_DEVICE_MAX_CONNECTIONS={:?}: enqueued in {enq:?}; copies not run after 300 ms: {stuck} of {}; kernel on a fresh stream {}",
        if event_mode { "event" } else { "flag" },
        if queues_last { "last" } else { "first" },
        std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").ok(),
        queues.len(),
        if kernel_ran { "ran" } else { "NOT run" }
    );
    flags.store(0, 1);
    let t1 = Instant::now();
    for (i, q) in queues.iter_mut().enumerate() {
        while q.completed()? < tickets[i] {
            if t1.elapsed() > Duration::from_secs(5) {
                println!("wait_probe: copies still not run 5 s after the release");
                std::process::exit(3);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    for s in streams.into_iter().chain([gate, k]) {
        dev.synchronize(s)?;
        dev.destroy_stream(s)?;
    }
    if event_mode {
        // SAFETY: the event's streams are synchronized; it is not used again.
        cu("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(event) });
    }
    drop(queues);
    dev.free(buf)?;
    println!("wait_probe: all ran once the flag was released");
    Ok(())
}

/// See the `race` mode above.
fn race(rounds: usize, waiters: usize, open: usize) -> hoccl::Result<()> {
    let (open_each, serial, premade, locked) = (open == 1, open == 2, open == 3, open == 4);
    let enqueue = Arc::new(Mutex::new(()));
    let dev = hoccl::device::open(BackendChoice::Cuda, 0)?;
    dev.bind_thread()?;
    let buf = dev.alloc(1 << 16)?;
    let flags = Arc::new(dev.alloc_flags(2 * rounds + 2)?);
    // The kernel fills a flag word of its own (host memory), so a stuck round tells whether
    // the kernel did not run or only the stream-memory write after it.
    let kflags = Arc::new(dev.alloc_flags(rounds)?);
    let mut stuck = Vec::new();
    let mut kernel_ran_in_stuck = 0;
    let t0 = Instant::now();
    for r in 0..rounds {
        let (release, done) = (2 * r, 2 * r + 1);
        let barrier = Arc::new(Barrier::new(if serial { 1 } else { waiters + 1 }));
        let mut made = Vec::new();
        if serial {
            for w in 0..waiters {
                let s = dev.create_stream()?;
                dev.write_value(s, flags.dev_addr(2 * rounds + (w & 1)), r as u64)?;
                dev.wait_value_geq(s, flags.dev_addr(release), 1)?;
                made.push((dev.clone(), s));
            }
        }
        let pre: Vec<Option<hoccl::device::StreamHandle>> =
            (0..waiters).map(|_| if premade { dev.create_stream().map(Some) } else { Ok(None) }).collect::<hoccl::Result<_>>()?;
        let threads: Vec<_> = (0..if serial { 0 } else { waiters })
            .map(|w| {
                let (dev, flags, barrier, pre, enqueue) = (dev.clone(), flags.clone(), barrier.clone(), pre[w], enqueue.clone());
                std::thread::spawn(move || -> hoccl::Result<(Arc<dyn hoccl::device::Device>, hoccl::device::StreamHandle)> {
                    let d = if open_each { hoccl::device::open(BackendChoice::Cuda, 0)? } else { dev };
                    d.bind_thread()?;
                    let s = match pre {
                        Some(s) => s,
                        None => d.create_stream()?,
                    };
                    barrier.wait();
                    let _g = locked.then(|| enqueue.lock().unwrap_or_else(|e| e.into_inner()));
                    d.write_value(s, flags.dev_addr(2 * rounds + (w & 1)), r as u64)?;
                    d.wait_value_geq(s, flags.dev_addr(release), 1)?;
                    Ok((d, s))
                })
            })
            .collect();
        let k = dev.create_stream()?;
        barrier.wait();
        {
            let _g = locked.then(|| enqueue.lock().unwrap_or_else(|e| e.into_inner()));
            dev.fill_pattern_async(k, buf, 1 << 16, r as u64)?;
            dev.fill_pattern_async(k, kflags.dev_addr(r), 8, 1 + r as u64)?;
            dev.write_value(k, flags.dev_addr(done), 1)?;
        }
        let t = Instant::now();
        while flags.load(done) == 0 && t.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(Duration::from_micros(100));
        }
        if flags.load(done) == 0 {
            stuck.push(r);
            kernel_ran_in_stuck += usize::from(kflags.load(r) != 0);
        }
        flags.store(release, 1);
        made.push((dev.clone(), k));
        for t in threads {
            made.push(t.join().expect("waiter thread")?);
        }
        for (d, s) in made {
            d.synchronize(s)?;
            d.destroy_stream(s)?;
        }
    }
    println!(
        "wait_probe race: {rounds} rounds, {waiters} waiting threads ({}), {:?}: the fill kernels and their flag write had not run 1 s after enqueue in {} rounds {:?} (in {kernel_ran_in_stuck} of them the kernels had run)",
        if serial { "no threads: waits enqueued first" } else if locked { "one device, enqueues under one lock" } else if premade { "one device, streams made first" } else if open_each { "a device each" } else { "one device" },
        t0.elapsed(),
        stuck.len(),
        &stuck[..stuck.len().min(20)]
    );
    dev.free(buf)?;
    Ok(())
}
