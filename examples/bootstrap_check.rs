//! hoccl-example: self-checking
//! hoccl-example-run: --user-init
//!
//! Multi-rank check of the MPI bootstrap. Run with
//! `mpirun -np 4 target/debug/examples/bootstrap_check [--user-init]` (see
//! scripts/mpi-env.sh for the Open MPI settings that containers and root need). Prints
//! `bootstrap_check: OK` on rank 0 when every rank passed, otherwise reports each failure and
//! exits 1.
//!
//! Without arguments hoccl initializes MPI (`MpiBootstrap::world`). With `--user-init` the
//! application initializes MPI itself at `MPI_THREAD_FUNNELED` through rsmpi: bootstraps
//! then work on the main thread only, refuse other threads, and never finalize MPI.
//!
//! Checks: variable-length all-gathers (empty and 1 MiB records included), barriers, tagged
//! ring messages received out of tag order, a large (rendezvous-sized) message, a receive on
//! one thread while another thread sends, isolation between two bootstraps (and from the
//! application's own communicator), `from_communicator`/`from_fortran`, bad arguments, and a
//! receive timeout that leaves the bootstrap usable.
use hoccl::bootstrap::mpi::{MpiBootstrap, Threading};
use hoccl::bootstrap::Bootstrap;
use hoccl::ErrorCode;
use mpi::traits::Communicator as _;
use std::time::Duration;

/// Collects failures instead of stopping at the first.
struct Check {
    rank: usize,
    failures: Vec<String>,
}

impl Check {
    fn ok(&mut self, cond: bool, what: impl FnOnce() -> String) {
        if !cond {
            let w = what();
            eprintln!("bootstrap_check: rank {}: FAILED: {w}", self.rank);
            self.failures.push(w);
        }
    }
    fn result<T>(&mut self, what: &str, r: hoccl::Result<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.ok(false, || format!("{what}: {e}"));
                None
            }
        }
    }
    fn err_code<T>(&mut self, what: &str, r: hoccl::Result<T>, want: ErrorCode) {
        match r {
            Ok(_) => self.ok(false, || format!("{what}: succeeded, expected {want:?}")),
            Err(e) => self.ok(e.code() == want, || format!("{what}: got {e}, expected {want:?}")),
        }
    }
}

/// Record of `rank` in gather round `round`: its length and bytes are a function of both.
fn record(rank: usize, round: usize) -> Vec<u8> {
    let len = match (round, rank) {
        (3, 1) => 1 << 20,
        (4, _) => 0, // every record empty
        _ => (rank * 131 + round * 57) % 300,
    };
    (0..len).map(|i| (i * 7 + rank * 13 + round * 29) as u8).collect()
}

fn payload(from: usize, tag: u32, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(31).wrapping_add(from as u32 * 7 + tag) as u8).collect()
}

fn check_gathers(c: &mut Check, b: &MpiBootstrap) {
    for round in 0..5 {
        let Some(all) = c.result("all_gather", b.all_gather(&record(b.rank(), round))) else { return };
        c.ok(all.len() == b.size(), || format!("round {round}: {} records", all.len()));
        for (r, got) in all.iter().enumerate() {
            c.ok(*got == record(r, round), || format!("round {round}: record of rank {r} differs"));
        }
    }
    c.result("barrier", b.barrier());
}

fn check_ring(c: &mut Check, b: &MpiBootstrap) {
    let (r, n) = (b.rank(), b.size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    // Sends complete without a matching receive for small messages (eager), so send first.
    c.result("send tag 1", b.send(next, 1, &payload(r, 1, 10)));
    c.result("send tag 2", b.send(next, 2, &payload(r, 2, 0)));
    // Received in the other order: matching is by tag, not arrival.
    let got2 = c.result("recv tag 2", b.recv(prev, 2));
    let got1 = c.result("recv tag 1", b.recv(prev, 1));
    c.ok(got2 == Some(payload(prev, 2, 0)), || "ring tag 2 payload".into());
    c.ok(got1 == Some(payload(prev, 1, 10)), || "ring tag 1 payload".into());

    // A message far above the eager limit: send and receive must progress together, which
    // needs the polling send (a blocking send holding the lock would deadlock the receiver
    // thread of the same rank).
    let big = 3 << 20;
    if b.threading() >= Threading::Serialized {
        let bb: &MpiBootstrap = b;
        std::thread::scope(|s| {
            let h = s.spawn(move || bb.recv(prev, 3));
            c.result("send big", b.send(next, 3, &payload(r, 3, big)));
            match h.join() {
                Ok(got) => {
                    let got = c.result("recv big", got);
                    c.ok(got == Some(payload(prev, 3, big)), || "big ring payload".into());
                }
                Err(_) => c.ok(false, || "receiver thread panicked".into()),
            }
        });
    } else {
        eprintln!("bootstrap_check: MPI thread level {:?}: threaded checks skipped", b.threading());
    }
    c.result("barrier", b.barrier());
}

/// Two bootstraps (and the application's world) carry the same tag without mixing.
fn check_isolation(c: &mut Check, a: &MpiBootstrap, b: &MpiBootstrap) {
    let (r, n) = (a.rank(), a.size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    c.result("send on a", a.send(next, 5, b"from-a"));
    c.result("send on b", b.send(next, 5, b"from-b"));
    let world = mpi::topology::SimpleCommunicator::world();
    use mpi::point_to_point::{Destination as _, Source as _};
    world.process_at_rank(next as i32).send_with_tag(&[0xABu8; 3][..], 5);
    let gb = c.result("recv on b", b.recv(prev, 5));
    let ga = c.result("recv on a", a.recv(prev, 5));
    let (gw, _) = world.process_at_rank(prev as i32).receive_vec_with_tag::<u8>(5);
    c.ok(gb.as_deref() == Some(&b"from-b"[..]), || format!("bootstrap b got {gb:?}"));
    c.ok(ga.as_deref() == Some(&b"from-a"[..]), || format!("bootstrap a got {ga:?}"));
    c.ok(gw == vec![0xAB; 3], || format!("application world got {gw:?}"));
}

fn check_errors(c: &mut Check, b: &MpiBootstrap) {
    c.err_code("send to rank size", b.send(b.size(), 0, b"x"), ErrorCode::InvalidArgument);
    c.err_code("recv from rank size", b.recv(b.size() + 3, 0), ErrorCode::InvalidArgument);
    if b.max_tag() < u32::MAX {
        c.err_code("tag above MPI_TAG_UB", b.send(0, b.max_tag() + 1, b"x"), ErrorCode::InvalidArgument);
    }
    for h in [-1, 2, 1 << 30] {
        // Fortran handle 2 is MPI_COMM_NULL in Open MPI; the others name nothing.
        c.err_code(&format!("from_fortran({h})"), MpiBootstrap::from_fortran(h), ErrorCode::InvalidArgument);
    }
    // A receive nobody answers times out and leaves the bootstrap usable.
    if let Some(t) = c.result("world (timeout)", MpiBootstrap::world()) {
        let t = t.with_timeout(Duration::from_millis(200));
        c.err_code("recv nobody sends", t.recv(0, 999), ErrorCode::Timeout);
        c.result("barrier after timeout", t.barrier());
    }
}

fn run(c: &mut Check) -> Option<()> {
    let b = c.result("MpiBootstrap::world", MpiBootstrap::world())?;
    c.rank = b.rank();
    if let Some(n) = std::env::var("OMPI_COMM_WORLD_SIZE").ok().and_then(|v| v.parse::<usize>().ok()) {
        c.ok(b.size() == n, || format!("size {} but mpirun started {n}", b.size()));
    }
    if b.rank() == 0 {
        println!("bootstrap_check: {} ranks, MPI thread level {:?}, hoccl owns MPI: {}", b.size(), b.threading(), b.owns_mpi());
    }
    check_gathers(c, &b);
    check_ring(c, &b);

    // The same world reached two other ways: through rsmpi and through a Fortran handle.
    let world = mpi::topology::SimpleCommunicator::world();
    let from_rsmpi = c.result("from_communicator", MpiBootstrap::from_communicator(&world))?;
    use mpi::traits::AsRaw as _;
    // SAFETY: MPI is initialized (the bootstraps above exist) and `world` is a live handle.
    let fhandle = unsafe { mpi::ffi::MPI_Comm_c2f(world.as_raw()) };
    let from_f = c.result("from_fortran", MpiBootstrap::from_fortran(fhandle))?;
    for other in [&from_rsmpi, &from_f] {
        c.ok(other.rank() == b.rank() && other.size() == b.size(), || "rank/size differ across constructors".into());
    }
    check_isolation(c, &from_rsmpi, &from_f);
    check_gathers(c, &from_f);
    check_errors(c, &b);

    verdict(c, &b)
    // Bootstraps drop here; the last one finalizes MPI if hoccl initialized it.
}

/// Every rank learns every rank's failure count, so all exit with the same verdict.
fn verdict(c: &mut Check, b: &MpiBootstrap) -> Option<()> {
    let mine = (c.failures.len() as u32).to_le_bytes();
    let all = c.result("final all_gather", b.all_gather(&mine))?;
    let bad: Vec<usize> = all
        .iter()
        .enumerate()
        .filter(|(_, v)| v.as_slice() != 0u32.to_le_bytes().as_slice())
        .map(|(r, _)| r)
        .collect();
    if bad.is_empty() {
        if b.rank() == 0 {
            println!("bootstrap_check: OK");
        }
        Some(())
    } else {
        if b.rank() == 0 {
            eprintln!("bootstrap_check: FAILED on ranks {bad:?}");
        }
        None
    }
}

/// MPI initialized by the application at FUNNELED; hoccl must adapt and must not finalize.
fn run_user_init(c: &mut Check) -> Option<()> {
    let Some((universe, level)) = mpi::initialize_with_threading(Threading::Funneled) else {
        c.ok(false, || "MPI was already initialized".into());
        return None;
    };
    let world = universe.world();
    c.rank = world.rank() as usize;
    if c.rank == 0 && level < Threading::Multiple {
        eprintln!("bootstrap_check: MPI initialized at {level:?} on purpose: hoccl's warning that the level is not Multiple is expected");
    }
    let b = c.result("from_communicator", MpiBootstrap::from_communicator(&world))?;
    c.ok(!b.owns_mpi(), || "hoccl claims to own an MPI the application initialized".into());
    c.ok(b.threading() == level, || format!("threading {:?} but MPI provided {level:?}", b.threading()));
    if b.rank() == 0 {
        println!("bootstrap_check: --user-init, {} ranks, MPI thread level {level:?}", b.size());
    }
    check_gathers(c, &b);
    if level < Threading::Serialized {
        let bb = &b;
        let from_thread = std::thread::scope(|s| s.spawn(move || bb.barrier()).join());
        match from_thread {
            Ok(r) => c.err_code("barrier from a non-main thread", r, ErrorCode::InvalidUsage),
            Err(_) => c.ok(false, || "thread panicked".into()),
        }
    }
    {
        let w = c.result("world() after the application's init", MpiBootstrap::world())?;
        c.ok(!w.owns_mpi(), || "world() claims to own the application's MPI".into());
        check_gathers(c, &w);
    }
    c.ok(!mpi::is_finalized(), || "dropping a bootstrap finalized the application's MPI".into());
    let v = verdict(c, &b);
    drop(b);
    c.ok(!mpi::is_finalized(), || "dropping the last bootstrap finalized the application's MPI".into());
    drop(universe); // the application's Universe finalizes MPI
    v
}

fn main() {
    hoccl::config::init_logging(None);
    let mut c = Check { rank: 0, failures: Vec::new() };
    let user_init = std::env::args().any(|a| a == "--user-init");
    let verdict = if user_init { run_user_init(&mut c) } else { run(&mut c) };
    let passed = verdict.is_some() && c.failures.is_empty();
    // MPI is finalized by now (all bootstraps dropped), so exiting skips nothing.
    if !passed {
        std::process::exit(1);
    }
}
