//! Collectives as the user asks for them, and the skewed size matrices used to test AlltoAllv.
use super::rng::Rng;
use crate::error::{Error, Result};

const OP: &str = "plan::Collective";

/// A collective over all GPUs of a [`Cluster`](super::Cluster). Byte counts follow
/// nccl-tests: `bytes` is the per-GPU buffer size (AlltoAll: each GPU's send buffer, split
/// evenly over all GPUs including itself; AllGather: each GPU's receive buffer, so each
/// contributes `bytes / G`). Remainders below G bytes are dropped.
#[derive(Clone, Debug, PartialEq)]
pub enum Collective {
    AllGather { bytes: u64 },
    AlltoAll { bytes: u64 },
    /// `sizes[src * G + dst]`: bytes from `src` to `dst` (the diagonal stays local).
    AlltoAllv { sizes: Vec<u64> },
    /// A batch of point-to-point transfers `(src, dst, bytes)`, fused like a group call.
    SendRecv { pairs: Vec<(usize, usize, u64)> },
    Broadcast { root: usize, bytes: u64 },
}

impl Collective {
    pub fn name(&self) -> &'static str {
        match self {
            Collective::AllGather { .. } => "allgather",
            Collective::AlltoAll { .. } => "alltoall",
            Collective::AlltoAllv { .. } => "alltoallv",
            Collective::SendRecv { .. } => "sendrecv",
            Collective::Broadcast { .. } => "broadcast",
        }
    }

    /// True when every flow from one source carries the same payload (AllGather,
    /// Broadcast): one NIC transfer per destination node is then fanned out on arrival.
    pub fn shared_payload(&self) -> bool {
        matches!(self, Collective::AllGather { .. } | Collective::Broadcast { .. })
    }

    /// Checks the collective against a cluster of `g` GPUs.
    pub fn validate(&self, g: usize) -> Result<()> {
        match self {
            Collective::AlltoAllv { sizes } if sizes.len() != g * g => {
                Err(Error::invalid_arg(OP, format!("alltoallv needs a {g}x{g} size matrix, got {} entries", sizes.len())))
            }
            Collective::SendRecv { pairs } => match pairs.iter().find(|p| p.0 >= g || p.1 >= g) {
                Some(p) => Err(Error::invalid_arg(OP, format!("send/recv pair {p:?} names a rank >= {g}"))),
                None => Ok(()),
            },
            Collective::Broadcast { root, .. } if *root >= g => {
                Err(Error::invalid_arg(OP, format!("broadcast root {root} >= {g}")))
            }
            _ => Ok(()),
        }
    }

    /// Calls `f(src, dst, bytes)` for every logical flow (the non-empty off-diagonal entries
    /// of the paper's matrix C), in (src, dst) order for the matrix collectives.
    pub fn for_each_flow(&self, g: usize, mut f: impl FnMut(usize, usize, u64)) {
        match self {
            Collective::AllGather { bytes } => {
                let per = bytes / g as u64;
                if per > 0 {
                    for u in 0..g {
                        (0..g).filter(|&v| v != u).for_each(|v| f(u, v, per));
                    }
                }
            }
            Collective::AlltoAll { bytes } => {
                let per = bytes / g as u64;
                if per > 0 {
                    for u in 0..g {
                        (0..g).filter(|&v| v != u).for_each(|v| f(u, v, per));
                    }
                }
            }
            Collective::AlltoAllv { sizes } => {
                for u in 0..g {
                    for v in 0..g {
                        let b = sizes[u * g + v];
                        if u != v && b > 0 {
                            f(u, v, b);
                        }
                    }
                }
            }
            Collective::SendRecv { pairs } => {
                pairs.iter().filter(|p| p.0 != p.1 && p.2 > 0).for_each(|p| f(p.0, p.1, p.2));
            }
            Collective::Broadcast { root, bytes } => {
                if *bytes > 0 {
                    (0..g).filter(|v| v != root).for_each(|v| f(*root, v, *bytes));
                }
            }
        }
    }

    /// Bytes of the logical flow u → v (0 on the diagonal). Send/recv batches are summed.
    pub fn pair_bytes(&self, g: usize, u: usize, v: usize) -> u64 {
        if u == v {
            return 0;
        }
        match self {
            Collective::AllGather { bytes } | Collective::AlltoAll { bytes } => bytes / g as u64,
            Collective::AlltoAllv { sizes } => sizes[u * g + v],
            Collective::Broadcast { root, bytes } => if u == *root { *bytes } else { 0 },
            Collective::SendRecv { pairs } => pairs.iter().filter(|p| p.0 == u && p.1 == v).map(|p| p.2).sum(),
        }
    }

    /// The dense matrix C (row-major G×G), for small clusters and tests.
    pub fn matrix(&self, g: usize) -> Vec<u64> {
        let mut c = vec![0u64; g * g];
        self.for_each_flow(g, |u, v, b| c[u * g + v] += b);
        c
    }
}

/// A Zipf-skewed AlltoAllv size matrix: every GPU sends `bytes_per_gpu` in total; sender `u`
/// ranks the other GPUs by a seeded random permutation and sends to the GPU of rank `r`
/// (1-based) a share proportional to `r^-s` (MoE-like token routing with per-sender
/// preferences). Deterministic in `seed`.
pub fn zipf_sizes(g: usize, bytes_per_gpu: u64, s: f64, seed: u64) -> Vec<u64> {
    let mut rng = Rng::new(seed);
    let mut sizes = vec![0u64; g * g];
    if g < 2 {
        return sizes;
    }
    let weights: Vec<f64> = (1..g).map(|r| (r as f64).powf(-s)).collect();
    let total: f64 = weights.iter().sum();
    let mut others: Vec<usize> = Vec::with_capacity(g - 1);
    for u in 0..g {
        others.clear();
        others.extend((0..g).filter(|&v| v != u));
        rng.shuffle(&mut others);
        for (r, &v) in others.iter().enumerate() {
            sizes[u * g + v] = (bytes_per_gpu as f64 * weights[r] / total).floor() as u64;
        }
    }
    sizes
}
