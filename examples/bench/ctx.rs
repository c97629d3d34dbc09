//! What every section of the benchmark shares: options, the control bootstrap (barriers
//! and all-gathers of results, separate from the communicator's own), the communicator,
//! its device and the one stream every timed op runs on.
use crate::opts::Opts;
use hoccl::bootstrap::mpi::MpiBootstrap;
use hoccl::bootstrap::Bootstrap;
use hoccl::comm::Communicator;
use hoccl::device::{Backend, DevPtr, Device, StreamHandle};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub type Res<T> = Result<T, String>;

pub struct Ctx {
    pub opts: Opts,
    pub ctl: MpiBootstrap,
    pub comm: Communicator,
    pub dev: Arc<dyn Device>,
    pub stream: StreamHandle,
    pub rank: usize,
    pub n: usize,
    pub cuda: bool,
    /// Distinct GPUs among the ranks (0 on the host backend).
    pub gpus: usize,
    /// Ranks that share a GPU with another rank (NCCL refuses that).
    pub shared_gpu_ranks: usize,
    pub device_name: String,
    /// Threads each rank may use to verify (cores split among the ranks of this host).
    pub verify_threads: usize,
    /// Fill kernels this process launched (CUDA only): every other hoccl launch would be a
    /// collective's, which must never happen.
    fill_launches: AtomicU64,
}

impl Ctx {
    pub fn new(opts: Opts, ctl: MpiBootstrap, comm: Communicator) -> Res<Ctx> {
        let dev = comm.device().clone();
        let stream = dev.create_stream().map_err(|e| format!("create stream: {e}"))?;
        let (rank, n) = (comm.rank(), comm.size());
        let cuda = dev.backend() == Backend::Cuda;
        let info = comm.ranks();
        let mut keys: Vec<(usize, usize)> = info.iter().map(|i| (i.host, i.gpu)).collect();
        let shared_gpu_ranks = keys.iter().filter(|k| keys.iter().filter(|o| o == k).count() > 1).count();
        keys.sort();
        keys.dedup();
        let gpus = if cuda { keys.len() } else { 0 };
        let me = &info[rank];
        let local = info.iter().filter(|i| i.host == me.host).count().max(1);
        let cores = std::thread::available_parallelism().map(|c| c.get()).unwrap_or(1);
        let verify_threads = (cores / local).clamp(1, 8);
        let device_name = dev.name();
        Ok(Ctx { opts, ctl, comm, dev, stream, rank, n, cuda, gpus, shared_gpu_ranks, device_name, verify_threads, fill_launches: AtomicU64::new(0) })
    }

    pub fn barrier(&self) -> Res<()> {
        self.ctl.barrier().map_err(|e| format!("barrier: {e}"))
    }

    /// Every rank's `bytes`, by rank.
    pub fn gather(&self, bytes: &[u8]) -> Res<Vec<Vec<u8>>> {
        self.ctl.all_gather(bytes).map_err(|e| format!("all_gather: {e}"))
    }

    pub fn gather_f64(&self, v: f64) -> Res<Vec<f64>> {
        self.gather(&v.to_le_bytes())?
            .iter()
            .map(|r| r.as_slice().try_into().map(f64::from_le_bytes).map_err(|_| "bad f64 record".to_string()))
            .collect()
    }

    pub fn max_f64(&self, v: f64) -> Res<f64> {
        Ok(self.gather_f64(v)?.into_iter().fold(f64::MIN, f64::max))
    }

    pub fn sum_u64(&self, v: u64) -> Res<u64> {
        Ok(self.gather_f64(v as f64)?.into_iter().map(|x| x as u64).sum())
    }

    /// Whether `ok` holds on every rank.
    pub fn all(&self, ok: bool) -> Res<bool> {
        Ok(self.gather(&[ok as u8])?.iter().all(|r| r.first() == Some(&1)))
    }

    /// Rank `root`'s string (others pass anything).
    pub fn bcast_str(&self, root: usize, s: &str) -> Res<String> {
        let all = self.gather(if self.rank == root { s.as_bytes() } else { &[] })?;
        Ok(String::from_utf8_lossy(&all[root]).into_owned())
    }

    /// The verification pattern generator (a kernel on CUDA; counted so that the launch
    /// accounting at the end can tell fills from collectives).
    pub fn fill(&self, s: StreamHandle, p: DevPtr, len: usize, seed: u64) -> Res<()> {
        if len == 0 {
            return Ok(());
        }
        self.dev.fill_pattern_async(s, p, len, seed).map_err(|e| format!("fill: {e}"))?;
        if self.cuda {
            self.fill_launches.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    pub fn fill_launches(&self) -> u64 {
        self.fill_launches.load(Ordering::Relaxed)
    }

    /// Wait for the bench stream, then surface any asynchronous hoccl error.
    pub fn sync(&self) -> Res<()> {
        self.sync_stream(self.stream)
    }

    pub fn sync_stream(&self, s: StreamHandle) -> Res<()> {
        self.dev.synchronize(s).map_err(|e| format!("synchronize: {e}"))?;
        match self.comm.async_error() {
            Some(e) => Err(format!("hoccl asynchronous error: {e}")),
            None => Ok(()),
        }
    }

    pub fn is_root(&self) -> bool {
        self.rank == 0
    }
}
