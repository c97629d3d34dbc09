//! `hoccl-info`: the engine table of `HOCCL_ENGINE=auto` and `--calibrate`, as a user runs
//! them (the built binary).
use hoccl::cost::CostModel;
use std::process::{Command, Output};

fn info(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hoccl-info"));
    c.args(args).env_remove("HOCCL_COST_MODEL");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run hoccl-info")
}

fn stdout(o: &Output) -> String {
    assert!(o.status.success(), "hoccl-info failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout.clone()).unwrap()
}

/// (call, dtype, size, engine, raw µs, compressed µs) of each table row.
fn rows(text: &str) -> Vec<(String, String, String, String, f64, Option<f64>)> {
    let start = text.lines().position(|l| l.starts_with("Engine choice")).expect("engine table");
    text.lines()
        .skip(start + 3)
        .take_while(|l| !l.trim_start().starts_with("cost model"))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 6, "row {l:?}");
            (f[0].into(), f[1].into(), f[2].into(), f[3].into(), f[4].parse().unwrap(), f[5].parse().ok())
        })
        .collect()
}

#[test]
fn engine_table() {
    let text = stdout(&info(&[], &[]));
    let all = rows(&text);
    // 3 calls x 3 dtypes x 5 sizes, each engine the one predicted faster.
    assert_eq!(all.len(), 45, "{text}");
    for (call, dt, size, engine, raw, comp) in &all {
        let want = match (comp, call.as_str()) {
            (Some(c), _) if c < raw => "compressed",
            (_, "allreduce") => "sm",
            _ => "ce",
        };
        assert_eq!(engine, want, "{call} {dt} {size}");
        if dt == "i32" {
            assert_eq!(*comp, None, "{call} {dt} {size}: integers have no codec");
        }
    }
    assert!(text.contains("cost model (HOCCL_COST_MODEL): ce_fixed_us="));
    // Over a slow link large bf16 movement compresses; small never does.
    let nic = rows(&stdout(&info(&["--link", "nic", "--ranks", "4"], &[])));
    let pick = |call: &str, dt: &str, size: &str| nic.iter().find(|r| r.0 == call && r.1 == dt && r.2 == size).unwrap().3.clone();
    assert_eq!(pick("sendrecv", "bf16", "256M"), "compressed");
    assert_eq!(pick("allreduce", "bf16", "256M"), "compressed");
    assert_eq!(pick("sendrecv", "bf16", "4K"), "ce");
    assert_eq!(pick("allreduce", "i32", "256M"), "sm");
    // The model's overrides reach the table.
    let slow = rows(&stdout(&info(&["--link", "nvlink"], &[("HOCCL_COST_MODEL", "nvlink_gbps=5")])));
    assert_eq!(slow.iter().find(|r| r.0 == "sendrecv" && r.1 == "bf16" && r.2 == "1M").unwrap().3, "compressed");
}

#[test]
fn bad_arguments_exit_2() {
    for args in [&["--link", "warp"][..], &["--ranks", "1"], &["--ranks"], &["--sample", "x.bf16"], &["--frobnicate"]] {
        let o = info(args, &[]);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert!(String::from_utf8_lossy(&o.stderr).contains("usage:"), "{args:?}");
    }
    let o = info(&["--calibrate", "--sample", "Cargo.toml"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("extension must name the dtype"));
    // A bad model is reported, not ignored.
    let text = stdout(&info(&[], &[("HOCCL_COST_MODEL", "nvlink_gbps=0")]));
    assert!(text.contains("Engine choice (HOCCL_ENGINE=auto): ? (") && text.contains("nvlink_gbps"), "{text}");
}

/// With a GPU: a `HOCCL_COST_MODEL=` line that reads back as a valid model. Without one: the
/// line saying so, and the sample's ratio by the host codec.
#[test]
fn calibrate() {
    let sample = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/minilm-weight-l3-ffn-in.bf16");
    let text = stdout(&info(&["--calibrate", "--sample", sample], &[]));
    let line = text.lines().find_map(|l| l.strip_prefix("HOCCL_COST_MODEL=")).unwrap_or_else(|| panic!("no model line: {text}"));
    let m = CostModel::default().with_overrides(line).unwrap();
    // The real weights compress to about 0.68 (docs/codec.md).
    assert!((m.bf16.ratio - 0.68).abs() < 0.02, "{}", m.bf16.ratio);
    if text.contains("no GPU") {
        assert!(text.contains("host figures not meaningful"), "{text}");
        assert_eq!(line, format!("bf16_ratio={}", m.bf16.ratio));
    } else {
        assert!(m.same_gpu_gbps > 0.0 && m.reduce_gbps > 0.0 && m.bf16.compress_gbps > 0.0, "{line}");
    }
}
