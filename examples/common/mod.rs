//! Pieces shared by the MPI example programs (not an example itself).
use hoccl::comm::Communicator;
use hoccl::Config;

/// `12`, `64K`, `1M`, `2G` -> bytes.
pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (n, m) = match s.chars().last()? {
        'K' | 'k' => (&s[..s.len() - 1], 1 << 10),
        'M' | 'm' => (&s[..s.len() - 1], 1 << 20),
        'G' | 'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    n.parse::<usize>().ok().map(|n| n * m)
}

/// The value after `--key` on the command line.
pub fn arg(key: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == key).and_then(|i| args.get(i + 1)).cloned()
}

/// The communicator over MPI's world with the `HOCCL_*` settings; on failure, says so as
/// `tool` and exits (2 for bad settings, 1 otherwise).
pub fn world_or_exit(tool: &str) -> Communicator {
    let cfg = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{tool}: {e}");
            std::process::exit(2);
        }
    };
    match Communicator::world(cfg) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{tool}: creating the communicator failed: {e}");
            std::process::exit(1);
        }
    }
}
