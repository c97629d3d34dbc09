//! `hoccl-zip`: the hoccl codec on files of raw little-endian values.
//!
//! ```text
//! hoccl-zip compress --dtype bf16|f16|f32 [--block B] [--tiers 1|2] IN OUT
//! hoccl-zip decompress IN OUT
//! hoccl-zip stats [--summary] IN
//! ```
//! `stats` validates the stream, decodes it, and prints the ratio, how often each
//! `(k1, k2)` was chosen, the exponent-entropy bound, and (without `--summary`) one line per
//! block with its widths and escape counts.
use hoccl::compress::{self, cpu, format::Dtype, BlockInfo, Params, StreamHeader};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::process::ExitCode;

const USAGE: &str = "usage:
  hoccl-zip compress --dtype bf16|f16|f32 [--block B] [--tiers 1|2] IN OUT
  hoccl-zip decompress IN OUT
  hoccl-zip stats [--summary] IN";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hoccl-zip: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[String]) -> Result<(), String> {
    let (cmd, rest) = args.split_first().ok_or(USAGE)?;
    let mut flags = BTreeMap::new();
    let mut files = Vec::new();
    let mut it = rest.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--dtype" | "--block" | "--tiers" => {
                let v = it.next().ok_or_else(|| format!("{a} needs a value"))?;
                flags.insert(a.as_str(), v.clone());
            }
            "--summary" => {
                flags.insert("--summary", String::new());
            }
            "-h" | "--help" => return Err(USAGE.into()),
            f if f.starts_with("--") => return Err(format!("unknown option {f}\n{USAGE}")),
            f => files.push(f.to_string()),
        }
    }
    let read = |p: &str| std::fs::read(p).map_err(|e| format!("{p}: {e}"));
    let write = |p: &str, d: &[u8]| std::fs::write(p, d).map_err(|e| format!("{p}: {e}"));
    match (cmd.as_str(), files.as_slice()) {
        ("compress", [i, o]) => {
            let dtype = flags.get("--dtype").ok_or("compress needs --dtype")?;
            let dtype = Dtype::parse(dtype).ok_or_else(|| format!("unknown dtype {dtype}"))?;
            let num =
                |k: &str, d: u32| flags.get(k).map_or(Ok(d), |v| v.parse::<u32>().map_err(|e| format!("{k} {v}: {e}")));
            let tiers = num("--tiers", 2)?;
            let params = Params { block: num("--block", 0)?, tiers: tiers.min(255) as u8 };
            let out = compress::compress(dtype, &read(i)?, &params).map_err(|e| e.to_string())?;
            write(o, &out)
        }
        ("decompress", [i, o]) => write(o, &compress::decompress(&read(i)?).map_err(|e| e.to_string())?),
        ("stats", [i]) => print(&stats(&read(i)?, flags.contains_key("--summary"))?),
        _ => Err(USAGE.into()),
    }
}

/// Text to standard output. A reader that stops early (`hoccl-zip stats IN | head`) is not
/// an error: the rest is dropped, as other command-line tools do.
fn print(text: &str) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(format!("standard output: {e}")),
        _ => Ok(()),
    }
}

/// The report of `stats` (writing to a String cannot fail, hence the ignored results).
fn stats(stream: &[u8], summary: bool) -> Result<String, String> {
    let (h, blocks) = compress::inspect(stream).map_err(|e| e.to_string())?;
    let values = compress::decompress(stream).map_err(|e| e.to_string())?;
    let raw_bytes = values.len();
    let mut o = String::new();
    let _ = writeln!(o, "dtype {}  values {}  block {}  blocks {}", h.dtype.name(), h.n, h.block, h.nblocks);
    let _ = writeln!(
        o,
        "bytes {} -> {}  ratio {:.4}",
        raw_bytes,
        stream.len(),
        if raw_bytes == 0 { 1.0 } else { stream.len() as f64 / raw_bytes as f64 }
    );
    let mut kinds: BTreeMap<(u32, u32), usize> = BTreeMap::new();
    for b in &blocks {
        *kinds.entry((b.header.k1, b.header.k2)).or_default() += 1;
    }
    let kinds: Vec<String> = kinds
        .iter()
        .map(|(&(k1, k2), c)| if k1 == 0 { format!("raw x{c}") } else { format!("(k1 {k1}, k2 {k2}) x{c}") })
        .collect();
    let _ = writeln!(o, "widths: {}", kinds.join(", "));
    let (block_bound, tensor_bound) = entropy_bounds(&h, &values);
    let _ = writeln!(o, "exponent-entropy bound: per-block tables {block_bound:.4}, one per-tensor table {tensor_bound:.4}");
    if !summary {
        let _ = writeln!(
            o,
            "{:>8} {:>8} {:>8} {:>7} {:>3} {:>3} {:>7} {:>7}",
            "block", "values", "bytes", "ratio", "k1", "k2", "n_esc1", "n_raw"
        );
        for (j, b) in blocks.iter().enumerate() {
            print_block(&mut o, j, h.dtype, b);
        }
    }
    Ok(o)
}

fn print_block(o: &mut String, j: usize, dt: Dtype, b: &BlockInfo) {
    let ratio = b.bytes as f64 / (b.values * dt.size()) as f64;
    let x = &b.header;
    let _ = writeln!(
        o,
        "{j:>8} {:>8} {:>8} {ratio:>7.4} {:>3} {:>3} {:>7} {:>7}",
        b.values, b.bytes, x.k1, x.k2, x.n_esc1, x.n_raw
    );
}

/// Ratios an ideal entropy coder of the exponents would reach (the rest stored raw), with
/// one table per block and with one table for the whole input.
fn entropy_bounds(h: &StreamHeader, values: &[u8]) -> (f64, f64) {
    let dt = h.dtype;
    let n = values.len() / dt.size();
    if n == 0 {
        return (1.0, 1.0);
    }
    let rest_bits = (8 * dt.size() as u32 - dt.exp_bits()) as f64;
    let exps: Vec<u32> = (0..n)
        .map(|i| {
            let mut w = [0u8; 4];
            w[..dt.size()].copy_from_slice(&values[i * dt.size()..(i + 1) * dt.size()]);
            cpu::exponent(dt, u32::from_le_bytes(w))
        })
        .collect();
    let entropy = |e: &[u32]| {
        let mut c = vec![0usize; dt.symbols()];
        for &x in e {
            c[x as usize] += 1;
        }
        let t = e.len() as f64;
        c.iter().filter(|&&k| k > 0).map(|&k| -(k as f64 / t) * (k as f64 / t).log2()).sum::<f64>()
    };
    let bits = (8 * dt.size()) as f64 * n as f64;
    let per_block: f64 = exps.chunks(h.block as usize).map(|b| b.len() as f64 * (rest_bits + entropy(b))).sum();
    (per_block / bits, n as f64 * (rest_bits + entropy(&exps)) / bits)
}
