//! The `hoccl-zip` command line: round trips through files, `stats`, errors, and a reader
//! that closes the pipe early.
use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn zip(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hoccl-zip")).args(args).output().unwrap()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hoccl-zip-test-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

/// bf16 values of a bell-shaped distribution (sums of uniforms, a small LCG), as bytes.
fn bf16_file(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut out = Vec::with_capacity(2 * n);
    for _ in 0..n {
        let x = ((0..4).map(|_| next()).sum::<f64>() - 2.0) * 0.03;
        out.extend_from_slice(&(((x as f32).to_bits() >> 16) as u16).to_le_bytes());
    }
    out
}

#[test]
fn compress_decompress_stats_round_trip() {
    let (raw, z, back) = (tmp("a.bf16"), tmp("a.bfx"), tmp("a.out"));
    let data = bf16_file(100_003, 7);
    std::fs::write(&raw, &data).unwrap();
    let p = |p: &PathBuf| p.to_str().unwrap().to_string();
    let o = zip(&["compress", "--dtype", "bf16", "--block", "4096", &p(&raw), &p(&z)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = zip(&["decompress", &p(&z), &p(&back)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(std::fs::read(&back).unwrap(), data, "round trip through files");
    let zlen = std::fs::metadata(&z).unwrap().len() as f64;
    assert!(zlen < 0.8 * data.len() as f64, "bell-shaped bf16 compresses: {zlen} of {}", data.len());

    let o = zip(&["stats", &p(&z)]);
    assert!(o.status.success());
    let text = String::from_utf8(o.stdout).unwrap();
    let want = format!("ratio {:.4}", zlen / data.len() as f64);
    assert!(text.contains("dtype bf16  values 100003  block 4096  blocks 25"), "{text}");
    assert!(text.contains(&want), "{want} in {text}");
    assert!(text.contains("widths: (k1 "), "{text}");
    // a header line, then one line per block
    let rows = text.lines().skip_while(|l| !l.trim_start().starts_with("block")).count();
    assert_eq!(rows, 1 + 25, "{text}");
    let o = zip(&["stats", "--summary", &p(&z)]);
    assert!(!String::from_utf8(o.stdout).unwrap().contains("n_esc1"));
}

#[test]
fn bad_usage_and_corrupt_input_are_errors() {
    let (raw, z) = (tmp("b.bf16"), tmp("b.bfx"));
    std::fs::write(&raw, bf16_file(5000, 3)).unwrap();
    let p = |p: &PathBuf| p.to_str().unwrap().to_string();
    for args in [
        vec!["compress", &p(&raw), &p(&z)] as Vec<&str>, // no dtype
        vec!["compress", "--dtype", "bf17", &p(&raw), &p(&z)],
        vec!["compress", "--dtype", "bf16", "--block", "33", &p(&raw), &p(&z)],
        vec!["frobnicate"],
        vec!["decompress", "/nonexistent/in", &p(&z)],
    ] {
        let o = zip(&args);
        assert!(!o.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.starts_with("hoccl-zip: ") && !err.contains("panicked"), "{args:?}: {err}");
    }
    // a stream cut short: a clear error, nothing written
    let o = zip(&["compress", "--dtype", "bf16", &p(&raw), &p(&z)]);
    assert!(o.status.success());
    let mut stream = std::fs::read(&z).unwrap();
    stream.truncate(stream.len() - 3);
    let cut = tmp("cut.bfx");
    std::fs::write(&cut, &stream).unwrap();
    let out = tmp("cut.out");
    let o = zip(&["decompress", &p(&cut), &p(&out)]);
    assert!(!o.status.success());
    assert!(!out.exists(), "no output from a corrupt stream");
    assert!(!String::from_utf8_lossy(&o.stderr).contains("panicked"));
}

#[test]
fn stats_into_a_closed_pipe_is_not_a_crash() {
    // 8192 blocks: about 500 KB of report, far more than a pipe buffers
    let (raw, z) = (tmp("c.bf16"), tmp("c.bfx"));
    std::fs::write(&raw, bf16_file(8192 * 32, 11)).unwrap();
    let p = |p: &PathBuf| p.to_str().unwrap().to_string();
    assert!(zip(&["compress", "--dtype", "bf16", "--block", "32", &p(&raw), &p(&z)]).status.success());
    let mut child = Command::new(env!("CARGO_BIN_EXE_hoccl-zip"))
        .args(["stats", &p(&z)])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut head = [0u8; 64];
    child.stdout.as_mut().unwrap().read_exact(&mut head).unwrap();
    drop(child.stdout.take()); // like `| head -c 64`
    let mut err = String::new();
    child.stderr.as_mut().unwrap().read_to_string(&mut err).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "exit {status:?}: {err}");
    assert!(err.is_empty(), "{err}");
}
