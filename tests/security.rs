//! Security (issue 41, item 6): what other processes of the host can see of hoccl's shared
//! memory, and the unique-id bootstrap's rendezvous. Messages from peers are checked next to
//! their parsers, by unit tests that inject corrupt ones: mailbox records and ring counters
//! (`transport::mailbox`, `transport::same_host`), socket frames (`transport::socket`) and
//! bootstrap frames (`bootstrap::tcp`).
mod common;
use common::*;

use hoccl::bootstrap::tcp::TcpBootstrap;
use hoccl::{Communicator, DataType, RedOp};
use std::os::unix::fs::PermissionsExt;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The tests count `/dev/shm` names of this process: one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn shm_names(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// The host backend's allocations (the shared-memory objects that stand for device memory,
/// which peers map by name) are owner-only, named `/hoccl.<pid>.<random 64-bit key>.<id>`
/// with a fresh key per allocation, and gone once freed.
#[test]
fn shm_allocations_are_owner_only_with_random_names() {
    let _g = serial();
    let dev = open_device(Backend::Host, 0);
    let pid = std::process::id().to_string();
    let mut keys = std::collections::HashSet::new();
    for _ in 0..16 {
        let p = dev.alloc(4096).unwrap();
        let h = dev.export(&dev.allocation(p).unwrap()).unwrap();
        let end = h.0[..48].iter().position(|b| *b == 0).expect("NUL-terminated name");
        let name = std::str::from_utf8(&h.0[..end]).unwrap().to_string();
        let parts: Vec<&str> = name.trim_start_matches('/').split('.').collect();
        assert!(parts.len() == 4 && parts[0] == "hoccl" && parts[1] == pid, "{name}");
        assert!(parts[2].len() == 16 && parts[2].chars().all(|c| c.is_ascii_hexdigit()), "{name}: no 64-bit random part");
        assert!(keys.insert(parts[2].to_string()), "{name}: a random part repeated");
        let path = format!("/dev/shm{name}");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{name}: mode {:o}", mode & 0o777);
        dev.free(p).unwrap();
        assert!(!std::path::Path::new(&path).exists(), "{name} outlived its allocation");
    }
}

/// A communicator's mailboxes lose their names as soon as every rank has mapped them: once
/// it is formed no mailbox of this process is left in `/dev/shm` (nothing for another
/// process to open, nothing left behind if this one dies), and the mapped ones work.
#[test]
fn mailboxes_are_unlinked_once_every_rank_mapped_them() {
    let _g = serial();
    let prefix = format!("hoccl.{}.ctl.", std::process::id());
    run_ranks(Backend::Host, 3, test_config(), move |c| {
        c.bootstrap().barrier().unwrap();
        let left = shm_names(&prefix);
        assert!(left.is_empty(), "rank {}: mailboxes still named after creation: {left:?}", c.rank());
        let dev = c.device().clone();
        let s = new_stream(&dev);
        let (a, b) = (Buf::new(&dev, 64, 0, 1), Buf::new(&dev, 64, 0, 2));
        dev.copy_from_host(a.ptr, &[1u8; 64]).unwrap();
        c.all_reduce(a.ptr, b.ptr, 64, DataType::U8, RedOp::Sum, s).unwrap();
        sync(&dev, s);
        assert!(b.read_all()[..64].iter().all(|v| *v == 3), "rank {}: wrong sum", c.rank());
    });
}

/// The unique-id root serves one rendezvous: once the communicator is formed it no longer
/// listens, so nobody joins late, with or without the secret (a joiner without it is refused
/// during the rendezvous: tests/tcp_bootstrap.rs, `root_refuses_bad_joins`).
#[test]
fn unique_id_root_stops_listening_once_formed() {
    let _g = serial();
    logs::capture();
    let id = Communicator::unique_id(&test_config()).unwrap();
    let root = id.root_addr().unwrap();
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            std::thread::spawn(move || Communicator::from_unique_id_on(&id, 2, r, Some(open_device(Backend::Host, r)), test_config()).expect("communicator"))
        })
        .collect();
    let comms: Vec<Communicator> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
    let t = Instant::now();
    loop {
        match std::net::TcpStream::connect(root) {
            Err(e) => {
                assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
                break;
            }
            Ok(_) => assert!(t.elapsed() < Duration::from_secs(2), "the root still accepts connections after the rendezvous"),
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // A late joiner holding the id (and so the secret) gets an error at once, not a hang.
    let t = Instant::now();
    let e = TcpBootstrap::init(&id, 2, 1, Duration::from_secs(5)).err().expect("a late join fails");
    assert!(t.elapsed() < Duration::from_secs(1), "late join took {:?}: {e}", t.elapsed());
    assert!(e.to_string().contains("root"), "{e}");
    drop(comms);
}
