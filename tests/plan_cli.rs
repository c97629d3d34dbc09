//! The `hoccl-plan` binary: stable JSON fields, clear errors with exit status 2.
use std::process::Command;

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hoccl-plan")).args(args).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn simulate_json_has_the_stable_fields() {
    let (code, out, err) = run(&["simulate", "--nodes", "2", "--gpus-per-node", "4", "--collective", "alltoall", "--bytes", "64MiB", "--json"]);
    assert_eq!(code, 0, "{err}");
    let j = hoccl::plan::json::Json::parse(out.trim()).unwrap();
    for k in ["completion_s", "lower_bound_s", "naive_s", "stages", "plan_ms", "baseline_s", "fluid"] {
        assert!(j.get(k).is_some(), "missing {k} in {out}");
    }
    assert!(j.get("completion_s").unwrap().as_f64().unwrap() >= j.get("lower_bound_s").unwrap().as_f64().unwrap());
}

#[test]
fn skewed_alltoallv_and_fluid_model() {
    let (code, out, err) = run(&["simulate", "--nodes", "2", "--gpus-per-node", "2", "--bytes", "16MiB", "--skew", "zipf:1.2", "--seed", "7", "--incast", "0", "--json"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"collective\":\"alltoallv\""), "{out}");
    assert!(!out.contains("\"fluid\""), "incast 0 is already the fluid model: {out}");
}

#[test]
fn show_prints_stage_matrices_and_draws_png() {
    let png = std::env::temp_dir().join(format!("hoccl-plan-test-{}.png", std::process::id()));
    let p = png.to_str().unwrap();
    let (code, out, err) = run(&["show", "--nodes", "2", "--gpus-per-node", "2", "--collective", "allgather", "--png", p]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("stage 0"), "{out}");
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[1..4], b"PNG");
    let _ = std::fs::remove_file(&png);
}

#[test]
fn bad_input_exits_2_with_a_message() {
    for args in [
        vec!["simulate", "--nodes", "zero"],
        vec!["simulate", "--bytes", "12XB"],
        vec!["simulate", "--collective", "allreduce"],
        vec!["simulate", "--skew", "pareto:1"],
        vec!["simulate", "--incast", "2"],
        vec!["simulate", "--forwarding", "0,9"],
        vec!["simulate", "--frobnicate", "1"],
        vec!["explode"],
        vec![],
    ] {
        let (code, _, err) = run(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains("hoccl-plan") && !err.contains("panicked"), "{args:?}: {err}");
    }
}
