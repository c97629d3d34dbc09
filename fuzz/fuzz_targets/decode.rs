//! Any bytes: the decoder returns an error or exactly n values, and never panics. Inputs
//! starting with a dtype byte are first turned into a valid stream of the rest, then one
//! byte of it is overwritten, so the fuzzer also reaches deep into valid block bodies.
#![no_main]
use hoccl::compress::{self, Dtype, Params};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let check = |s: &[u8]| {
        if let Ok(v) = compress::decompress(s) {
            let h = compress::cpu::peek(s).unwrap();
            assert_eq!(v.len() as u64, h.n * h.dtype.size() as u64);
        }
        let _ = compress::inspect(s);
    };
    check(data);
    if data.len() > 4 && data[0] < 3 {
        let dt = Dtype::ALL[data[0] as usize];
        let body = &data[4..];
        let body = &body[..body.len() / dt.size() * dt.size()];
        let p = Params { block: 32 * (1 + data[1] as u32 % 64), tiers: 1 + data[2] % 2 };
        if let Ok(mut s) = compress::compress(dt, body, &p) {
            assert!(compress::decompress(&s).unwrap() == body);
            let at = (data[3] as usize * 7919) % s.len();
            s[at] ^= data[3] | 1;
            check(&s);
        }
    }
});
