//! Which streams share a hardware work queue with a blocked stream (CUDA only).
//!
//! `cargo run --release --example queue_probe [BEFORE AFTER USERS [CHURN]]`
//!
//! With CHURN, it first creates and destroys CHURN streams and CHURN copy queues in rounds
//! of 16 (as test binaries do with each communicator), so that the queues handed out
//! afterwards are ones the driver recycled.
//!
//! Creates BEFORE copy queues, then a stream B blocked in a wait on a host flag (as a user
//! stream is while a collective runs), then AFTER copy queues and USERS plain streams. Each
//! copy queue gets a 4-byte copy and a fence, each plain stream a 64-byte fill kernel and a
//! flag write. After 300 ms it prints, in creation order, which of them have not run: those share B's hardware queue
//! (the driver spreads streams over `CUDA_DEVICE_MAX_CONNECTIONS` queues). Then it releases
//! B and checks that everything ran. A driver call that itself waits for B would hang the
//! probe: a guard releases B after 3 s and says which call was stuck.
//!
//! H200, driver 580, 32 queues (docs/results/h200-1gpu/queues-twentysixth.txt; plain
//! streams without the fill then, no CHURN): nothing ran behind B with 3+3+3, 12+4+16
//! or (8 queues) 10+10+10; with 40 before,
//! creating the 38th copy queue after B (the 79th stream of the context) blocked in the
//! driver until B was released.
use hoccl::config::BackendChoice;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Progress of the enqueue phase (for the release guard): 1000*phase + index.
static STEP: AtomicUsize = AtomicUsize::new(0);

fn step(phase: usize, i: usize) {
    STEP.store(phase * 1000 + i, Ordering::Release);
}

fn main() -> hoccl::Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("counts")).collect();
    let (before, after, users) = (*args.first().unwrap_or(&40), *args.get(1).unwrap_or(&40), *args.get(2).unwrap_or(&40));
    let churn = *args.get(3).unwrap_or(&0);
    let dev = hoccl::device::open(BackendChoice::Cuda, 0)?;
    dev.bind_thread()?;
    for round in 0..churn.div_ceil(16) {
        let k = 16.min(churn - round * 16);
        let streams = (0..k).map(|_| dev.create_stream()).collect::<hoccl::Result<Vec<_>>>()?;
        let queues = (0..k).map(|_| dev.create_copy_queue()).collect::<hoccl::Result<Vec<_>>>()?;
        drop(queues);
        for s in streams {
            dev.destroy_stream(s)?;
        }
    }
    let buf = dev.alloc(1 << 12)?;
    let flags = Arc::new(dev.alloc_flags(1 + users)?);
    // A driver call that waits for B would hang the probe: after 3 s the guard reports
    // where the enqueue phase stands and releases B.
    let guard_flags = flags.clone();
    let t0 = Instant::now();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(3));
        let s = STEP.load(Ordering::Acquire);
        if s != usize::MAX {
            eprintln!("queue_probe: enqueue phase stuck after 3 s at phase {} item {} (1 queues before B, 2 queues after, 3 streams, 4 copies): releasing B", s / 1000, s % 1000);
            guard_flags.store(0, 1);
        }
    });
    let mut queues = Vec::new();
    for _ in 0..before {
        queues.push(dev.create_copy_queue()?);
    }
    let b = dev.create_stream()?;
    dev.wait_value_geq(b, flags.dev_addr(0), 1)?;
    for i in 0..after {
        step(2, i);
        queues.push(dev.create_copy_queue()?);
    }
    let mut plain = Vec::new();
    for j in 0..users {
        step(3, j);
        let s = dev.create_stream()?;
        dev.fill_pattern_async(s, buf.add(3072), 64, j as u64)?;
        dev.write_value(s, flags.dev_addr(1 + j), 1)?;
        plain.push(s);
    }
    let mut tickets = Vec::new();
    for (i, q) in queues.iter_mut().enumerate() {
        step(4, i);
        q.copy(buf.add(2048), buf, 4)?;
        tickets.push(q.fence()?);
    }
    STEP.store(usize::MAX, Ordering::Release);
    eprintln!("queue_probe: enqueued in {:?}", t0.elapsed());
    std::thread::sleep(Duration::from_millis(300));
    // Creation positions: queues 0..before, B = before, queues after it, then the streams.
    let mut stuck = Vec::new();
    for (i, q) in queues.iter_mut().enumerate() {
        if q.completed()? < tickets[i] {
            stuck.push(if i < before { i } else { i + 1 });
        }
    }
    for j in 0..users {
        if flags.load(1 + j) == 0 {
            stuck.push(before + 1 + after + j);
        }
    }
    println!(
        "queue_probe: CUDA_DEVICE_MAX_CONNECTIONS={:?}; {churn} streams and queues made and destroyed first; {before} copy queues, B at position {before}, {after} copy queues, {users} streams",
        std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").ok()
    );
    println!("queue_probe: behind B after 300 ms (creation positions): {stuck:?}");
    flags.store(0, 1);
    for (i, q) in queues.iter_mut().enumerate() {
        while q.completed()? < tickets[i] {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    for s in plain.into_iter().chain([b]) {
        dev.synchronize(s)?;
        dev.destroy_stream(s)?;
    }
    drop(queues);
    dev.free(buf)?;
    println!("queue_probe: all ran once B was released");
    Ok(())
}
