//! Output: nccl-tests-style tables per operation (hoccl beside each NCCL variant with the
//! hoccl/NCCL ratio), a summary against the project's targets, and the JSON file.
use crate::ops::OpKind;
use std::fmt::Write as _;

/// One measured point of one implementation.
#[derive(Clone, Debug)]
pub struct Point {
    pub op: OpKind,
    pub imp: String,
    pub bytes: usize,
    pub count: usize,
    pub time_us: f64,
    pub first_us: f64,
    pub iters: usize,
    pub algbw: f64,
    pub busbw: f64,
    /// Wrong elements summed over ranks; None when checking was off.
    pub wrong: Option<u64>,
}

/// "2097152" → "2M" for labels.
pub fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => format!("{b}"),
    }
}

fn wrong_str(w: Option<u64>) -> String {
    w.map_or("N/A".into(), |w| w.to_string())
}

fn find<'a>(pts: &'a [Point], op: OpKind, imp: &str, bytes: usize) -> Option<&'a Point> {
    pts.iter().find(|p| p.op == op && p.imp == imp && p.bytes == bytes)
}

/// The table of one op: hoccl and (if present) default NCCL side by side, then the
/// CTA-limited NCCL variants' busbw and ratios.
pub fn op_table(op: OpKind, pts: &[Point], imps: &[String], header: &str) -> String {
    let mut s = String::new();
    let mine: Vec<&Point> = pts.iter().filter(|p| p.op == op && p.imp == "hoccl").collect();
    let nccl = imps.iter().find(|i| i.as_str() == "nccl");
    let _ = writeln!(s, "\n# {} — {header}", op.name());
    let mut h = format!("# {:>10} {:>11}  {:>10} {:>7} {:>7} {:>6}", "size", "count", "time(us)", "algbw", "busbw", "wrong");
    let mut h0 = format!("# {:>10} {:>11}  {:-^33}", "", "", " hoccl ");
    if nccl.is_some() {
        h += &format!("  {:>10} {:>7} {:>7} {:>6} {:>6}", "time(us)", "algbw", "busbw", "wrong", "ratio");
        h0 += &format!("  {:-^33} {:>6}", " nccl ", "h/n");
    }
    let _ = writeln!(s, "{h0}\n{h}");
    for p in &mine {
        let mut line = format!(
            "  {:>10} {:>11}  {:>10.1} {:>7.1} {:>7.1} {:>6}",
            p.bytes,
            p.count,
            p.time_us,
            p.algbw,
            p.busbw,
            wrong_str(p.wrong)
        );
        if let Some(q) = nccl.and_then(|i| find(pts, op, i, p.bytes)) {
            let _ = write!(line, "  {:>10.1} {:>7.1} {:>7.1} {:>6} {:>6.2}", q.time_us, q.algbw, q.busbw, wrong_str(q.wrong), p.busbw / q.busbw);
        }
        let _ = writeln!(s, "{line}");
    }
    let variants: Vec<&String> = imps.iter().filter(|i| i.starts_with("nccl-")).collect();
    if !variants.is_empty() {
        let mut h = format!("#   CTA-limited NCCL, busbw GB/s (ratio = hoccl/variant)\n# {:>10}", "size");
        for v in &variants {
            h += &format!("  {:>10} {:>6}", v, "ratio");
        }
        let _ = writeln!(s, "{h} {:>6}", "wrong");
        for p in &mine {
            let mut line = format!("  {:>10}", p.bytes);
            let mut wrong: Option<u64> = Some(0);
            for v in &variants {
                match find(pts, op, v, p.bytes) {
                    Some(q) => {
                        let _ = write!(line, "  {:>10.1} {:>6.2}", q.busbw, p.busbw / q.busbw);
                        wrong = wrong.zip(q.wrong).map(|(a, b)| a + b);
                    }
                    None => line += &format!("  {:>10} {:>6}", "-", "-"),
                }
            }
            let _ = writeln!(s, "{line} {:>6}", wrong_str(wrong));
        }
    }
    s
}

/// busbw of `imp` at the largest measured size <= `bytes` (sizes are rounded to blocks).
fn busbw_near(pts: &[Point], op: OpKind, imp: &str, bytes: usize) -> Option<(usize, f64)> {
    pts.iter().filter(|p| p.op == op && p.imp == imp && p.bytes <= bytes && p.bytes * 2 > bytes).map(|p| (p.bytes, p.busbw)).next()
}

/// Per-op peaks and the bandwidth targets (which are stated for 4 GPUs).
pub fn summary(pts: &[Point], ops: &[OpKind], imps: &[String], nranks: usize, gpus: usize) -> String {
    let mut s = String::from("\n# Summary: busbw GB/s (peak over sizes, at size); ratio = hoccl/NCCL default\n");
    let _ = writeln!(s, "# {:<10} {:>18} {:>18} {:>7} {:>12}", "op", "hoccl peak", "nccl peak", "ratio", "wrong(all)");
    for &op in ops {
        let peak = |imp: &str| {
            pts.iter()
                .filter(|p| p.op == op && p.imp == imp)
                .max_by(|a, b| a.busbw.total_cmp(&b.busbw))
                .map(|p| (p.busbw, p.bytes))
        };
        let fmt = |v: Option<(f64, usize)>| v.map_or("-".into(), |(b, at)| format!("{b:.1} @{}", human(at)));
        let (h, n) = (peak("hoccl"), peak("nccl"));
        let ratio = h.zip(n).map_or("-".into(), |(a, b)| format!("{:.2}", a.0 / b.0));
        let wrong: Option<u64> = pts.iter().filter(|p| p.op == op).map(|p| p.wrong).sum();
        let _ = writeln!(s, "  {:<10} {:>18} {:>18} {:>7} {:>12}", op.name(), fmt(h), fmt(n), ratio, wrong_str(wrong));
    }
    let applies = nranks == 4 && gpus == 4;
    let _ = writeln!(
        s,
        "# Targets (stated for 4 GPUs, one rank each; this run: {nranks} ranks on {gpus} GPU(s){})",
        if applies { "" } else { " — informational only" }
    );
    let targets = [
        (OpKind::SendRecv, 1usize << 30, 390.0),
        (OpKind::SendRecv, 2 << 20, 120.0),
        (OpKind::AllGather, 512 << 20, 380.0),
        (OpKind::AlltoAll, 512 << 20, 360.0),
    ];
    for (op, at, want) in targets {
        let Some((b, got)) = busbw_near(pts, op, "hoccl", at) else { continue };
        let verdict = if !applies { "n/a" } else if got >= want { "PASS" } else { "FAIL" };
        let vs = busbw_near(pts, op, "nccl", at).map_or(String::new(), |(_, n)| format!(", NCCL {n:.1}"));
        let _ = writeln!(s, "  {:<10} @{:<5} busbw >= {want:>5.0}: hoccl {got:>7.1}{vs}  {verdict}", op.name(), human(b));
    }
    let _ = imps;
    s
}

// ---------------------------------------------------------------- JSON --------------

pub use hoccl::plan::json::Json;

/// The constructors the bench's call sites use, on the library's JSON value.
pub trait JsonExt {
    fn str(s: impl Into<String>) -> Json;
    fn num(v: impl Into<f64>) -> Json;
    fn opt_num(v: Option<u64>) -> Json;
}

impl JsonExt for Json {
    fn str(s: impl Into<String>) -> Json {
        Json::Str(s.into())
    }
    fn num(v: impl Into<f64>) -> Json {
        Json::Num(v.into())
    }
    fn opt_num(v: Option<u64>) -> Json {
        v.map_or(Json::Null, |v| Json::Int(v as i128))
    }
}

/// A point as JSON, with the run's context repeated so that every point stands alone.
pub fn point_json(p: &Point, nranks: usize, gpus: usize, device: &str, dtype: &str) -> Json {
    Json::obj(vec![
        ("op", Json::str(p.op.name())),
        ("impl", Json::str(p.imp.clone())),
        ("bytes", Json::num(p.bytes as f64)),
        ("count", Json::num(p.count as f64)),
        ("dtype", Json::str(dtype)),
        ("time_us", Json::num(p.time_us)),
        ("first_op_us", Json::num(p.first_us)),
        ("iters", Json::num(p.iters as f64)),
        ("algbw", Json::num(p.algbw)),
        ("busbw", Json::num(p.busbw)),
        ("wrong", Json::opt_num(p.wrong)),
        ("nranks", Json::num(nranks as f64)),
        ("gpus", Json::num(gpus as f64)),
        ("device", Json::str(device)),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn json_escapes() {
        let mut s = String::new();
        Json::obj(vec![("a", Json::str("x\"y\n")), ("b", Json::Arr(vec![Json::num(1.5), Json::Null]))]).write(&mut s);
        assert_eq!(s, "{\"a\":\"x\\\"y\\n\",\"b\":[1.5,null]}");
    }
}
