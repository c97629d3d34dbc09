//! Proof of zero SM: every copy-engine collective, run with data loaded by plain copies
//! (no fill kernel), launches no kernel. (hoccl's kernel module is loaded when a context's
//! first device opens, which runs no kernel.) Its own test binary, so no other test's
//! kernels share the process-wide counter.
mod common;
use common::*;
use hoccl::device::{kernels, pattern_byte};
use hoccl::DataType;

fn every_collective_without_kernels(b: Backend) {
    assert_eq!(kernels::launch_count(), 0, "nothing may have launched before this test");
    run_ranks(b, 4, test_config(), |c| {
        let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
        let s = dev.create_stream().unwrap();
        let len = 3 * 65536 + 5; // several chunks, odd
        let send = Buf::new(&dev, len * n, 0, 11);
        let recv = Buf::new(&dev, len * n, 0, 12);
        let data: Vec<u8> = (0..(len * n) as u64).map(|i| pattern_byte(seed_of(7, r, 0), i)).collect();
        dev.copy_from_host(send.ptr, &data).unwrap();
        allocated(c);
        for _ in 0..3 {
            c.all_gather(send.ptr, recv.ptr, len, DataType::U8, s).unwrap();
            c.all_to_all(send.ptr, recv.ptr, len, DataType::U8, s).unwrap();
            let counts = vec![len; n];
            let displs: Vec<usize> = (0..n).map(|j| j * len).collect();
            c.all_to_allv(send.ptr, &counts, &displs, recv.ptr, &counts, &displs, DataType::U8, s).unwrap();
            c.broadcast(send.ptr, recv.ptr, len, DataType::U8, 1 % n, s).unwrap();
            c.gather(send.ptr, recv.ptr, len, DataType::U8, 0, s).unwrap();
            c.scatter(send.ptr, recv.ptr, len, DataType::U8, n - 1, s).unwrap();
            c.group(|c| {
                c.send(send.ptr, len, DataType::U8, (r + 1) % n, s)?;
                c.recv(recv.ptr, len, DataType::U8, (r + n - 1) % n, s)
            })
            .unwrap();
        }
        dev.synchronize(s).unwrap();
        // The last op delivered rank r-1's first block: the collectives really moved data.
        let got = recv.read_all();
        assert_eq!(wrong(&got, 0, len, seed_of(7, (r + n - 1) % n, 0)), 0);
    });
    assert_eq!(kernels::launch_count(), 0, "a collective launched a kernel");
}

backend_tests!(every_collective_without_kernels);
