//! libnccl.so.2 as the dynamic loader sees it: soname `libnccl.so.2`, exactly the entry
//! points `nccl/symbols.txt` lists (each as `ncclX` and `pncclX`, as NCCL's own map exports
//! them) and no other symbol, no MPI dependency; the header and `docs/nccl.md` name the
//! same list. The library is built here (cargo, same profile and target directory as this
//! test), so the check always inspects the current sources.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `name status [note]` lines of nccl/symbols.txt.
fn listed() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(root().join("nccl/symbols.txt")).expect("nccl/symbols.txt");
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let mut w = l.split_whitespace();
            let name = w.next().unwrap().to_string();
            let status = w.next().unwrap_or_else(|| panic!("no status for {name}")).to_string();
            assert!(["implemented", "accepted", "refused"].contains(&status.as_str()), "{name}: status {status}");
            (name, status)
        })
        .collect()
}

fn expected_exports() -> BTreeSet<String> {
    listed().into_iter().flat_map(|(n, _)| [format!("p{n}"), n]).collect()
}

/// Build the library with this test's profile and return its path.
fn build_library() -> PathBuf {
    // target/<profile>/deps/nccl_exports-<hash>: the profile directory is two levels up.
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>").to_path_buf();
    let target_dir = profile_dir.parent().expect("target dir").to_path_buf();
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root()).args(["build", "-p", "hoccl-nccl", "--target-dir"]).arg(&target_dir);
    if release {
        cmd.arg("--release");
    }
    let out = cmd.output().expect("run cargo");
    assert!(out.status.success(), "cargo build -p hoccl-nccl failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let lib = profile_dir.join("libnccl.so");
    assert!(lib.exists(), "{} not built", lib.display());
    lib
}

fn tool(cmd: &str, args: &[&str], lib: &Path) -> String {
    let out = Command::new(cmd).args(args).arg(lib).output().unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8")
}

#[test]
fn the_library_exports_exactly_nccls_entry_points() {
    let lib = build_library();
    let dynamic = tool("readelf", &["-d", "-W"], &lib);
    assert!(dynamic.contains("Library soname: [libnccl.so.2]"), "soname:\n{dynamic}");
    // Programs load it where MPI is not installed (PyTorch, vLLM).
    assert!(!dynamic.contains("libmpi"), "libnccl.so.2 must not need MPI:\n{dynamic}");
    let defined: BTreeSet<String> = tool("nm", &["-D", "--defined-only"], &lib)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // "<address> <type> <name>"; versioned names would carry "@".
            (f.len() == 3).then(|| f[2].to_string())
        })
        .collect();
    let want = expected_exports();
    let extra: Vec<_> = defined.difference(&want).collect();
    let missing: Vec<_> = want.difference(&defined).collect();
    assert!(extra.is_empty() && missing.is_empty(), "exports differ from nccl/symbols.txt: extra {extra:?}, missing {missing:?}");
    // Every export is a function (NCCL exports no data).
    let types = tool("nm", &["-D", "--defined-only"], &lib);
    for l in types.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        assert_eq!(f.get(1), Some(&"T"), "not a function: {l}");
    }
}

#[test]
fn the_header_declares_every_entry_point() {
    let h = std::fs::read_to_string(root().join("include/hoccl-nccl/nccl.h")).expect("nccl.h");
    for name in expected_exports() {
        assert!(h.contains(&format!(" {name}(")) || h.contains(&format!("*{name}(")), "nccl.h does not declare {name}");
    }
}

/// The table in docs/nccl.md (rows "| `ncclX` | status | ... |") says what symbols.txt says.
#[test]
fn the_docs_table_matches_the_list() {
    let doc = std::fs::read_to_string(root().join("docs/nccl.md")).expect("docs/nccl.md");
    let rows: Vec<(String, String)> = doc
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let name = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            name.starts_with("nccl").then(|| (name.to_string(), cells.get(2).map_or(String::new(), |s| s.to_string())))
        })
        .collect();
    assert_eq!(rows, listed(), "docs/nccl.md's table differs from nccl/symbols.txt (same order, same status)");
}
