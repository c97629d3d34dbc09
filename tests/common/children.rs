//! Ranks as child processes: this test binary run again with one test selected (`--exact
//! NAME`) and the child's instructions in its environment. The parent collects every
//! child's stdout lines as they come (the children report events there) and its stderr,
//! may SIGKILL one child once it reports reaching a point, and waits for the others.
use std::io::{BufRead, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A child's one line to the parent on stdout: `<tag> <rank> <event> <unix ms> <detail>`.
pub fn say(tag: &str, rank: usize, ev: &str, detail: &str) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{tag} {rank} {ev} {} {detail}", unix_ms());
    let _ = o.flush();
}

/// The report `say(tag, ..)` put in line `l` (the test harness may print before it on the
/// same line): event, unix ms, detail.
pub fn event(tag: &str, l: &str) -> Option<(String, u64, String)> {
    let f: Vec<&str> = l[l.find(&format!("{tag} "))?..].splitn(5, ' ').collect();
    Some((f.get(2)?.to_string(), f.get(3)?.parse().ok()?, f.get(4).unwrap_or(&"").to_string()))
}

/// What the parent saw of the children.
pub struct Run {
    /// Every stdout line, with its child's rank, in arrival order.
    pub lines: Vec<(usize, String)>,
    pub stderr: Vec<String>,
    /// Exit status per child (None: still running at the limit, then killed).
    pub status: Vec<Option<ExitStatus>>,
    /// When the victim was killed (unix ms), if it was.
    pub kill_ms: Option<u64>,
}

impl Run {
    /// Everything the children wrote, for a failure message.
    pub fn dump(&self) -> String {
        let mut s = String::new();
        for (r, l) in &self.lines {
            s += &format!("[{r}] {l}\n");
        }
        for (r, e) in self.stderr.iter().enumerate() {
            s += &format!("--- rank {r} stderr (last 3000 bytes):\n{}\n", &e[e.len().saturating_sub(3000)..]);
        }
        s
    }
}

/// Run test `test` of this binary as `n` children, child `r` with the environment `env(r)`.
/// `victim` = (rank, delay): that child is SIGKILLed `delay` after the first of its lines
/// that `at_point` accepts. Returns once every other child exited, or at `limit` (the rest
/// are killed then).
pub fn run(test: &str, n: usize, env: impl Fn(usize) -> Vec<(String, String)>, victim: Option<(usize, Duration)>, at_point: impl Fn(&str) -> bool, limit: Duration) -> Run {
    let exe = std::env::current_exe().expect("test binary");
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let mut errs = Vec::new();
    let mut kids: Vec<Option<Child>> = (0..n)
        .map(|r| {
            let mut k = Command::new(&exe)
                .args(["--exact", test, "--nocapture", "--test-threads=1"])
                .envs(env(r))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn child rank");
            let out = k.stdout.take().unwrap();
            let tx = tx.clone();
            std::thread::spawn(move || {
                for l in std::io::BufReader::new(out).lines().map_while(|l| l.ok()) {
                    let _ = tx.send((r, l));
                }
            });
            let mut err = k.stderr.take().unwrap();
            errs.push(std::thread::spawn(move || {
                let mut s = String::new();
                let _ = std::io::Read::read_to_string(&mut err, &mut s);
                s
            }));
            Some(k)
        })
        .collect();
    drop(tx);
    let start = Instant::now();
    let mut lines: Vec<(usize, String)> = Vec::new();
    let mut kill_ms = None;
    let mut status = vec![None; n];
    let is_victim = |r: usize| victim.is_some_and(|(v, _)| v == r);
    while (0..n).any(|r| !is_victim(r) && status[r].is_none()) && start.elapsed() < limit {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(10)) {
            lines.push(l);
        }
        if let Some((v, delay)) = victim.filter(|_| kill_ms.is_none()) {
            if lines.iter().any(|(r, l)| *r == v && at_point(l)) {
                std::thread::sleep(delay);
                let mut k = kids[v].take().unwrap();
                k.kill().expect("SIGKILL the victim");
                kill_ms = Some(unix_ms());
                status[v] = Some(k.wait().expect("reap the victim"));
            }
        }
        for r in 0..n {
            if status[r].is_none() {
                if let Some(k) = kids[r].as_mut() {
                    status[r] = k.try_wait().expect("try_wait");
                }
            }
        }
    }
    for k in kids.iter_mut().flatten() {
        let _ = k.kill();
        let _ = k.wait();
    }
    lines.extend(rx.try_iter());
    let stderr = errs.into_iter().map(|h| h.join().unwrap_or_default()).collect();
    Run { lines, stderr, status, kill_ms }
}
