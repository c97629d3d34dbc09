//! The `Communicator`: created from MPI (or any `Bootstrap`), it takes every operation as
//! an [`OpDesc`] through [`Communicator::enqueue`] (`enqueue.rs`), which validates it and
//! turns it into byte ranges sent to and received from peers; `submit` enqueues the stream
//! handshake on the caller's stream and hands the op to its engine. Calls are
//! stream-ordered and asynchronous, as NCCL's.
use crate::bootstrap::Bootstrap;
use crate::config::{init_logging, Config};
use crate::device::batch::{Batch, OnStream};
use crate::device::{self, DevPtr, Device, StreamHandle};
use crate::engine::streams::{Admission, StreamManager};
use crate::engine::{Engine, EngineConfig, Fill, Op, Transfer};
use crate::error::{Error, Result};
use crate::transport::staged::{Staged, StagedWait};
use crate::types::DataType;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

mod capture;
mod collectives;
pub(crate) mod compressed;
mod enqueue;
mod guard;
mod internode;
mod op;
mod reduction;
mod setup;
mod shrink;

pub use crate::topology::{RankPlacement, Topology};
pub use crate::transport::relay::RelayCounts;
pub use op::{Collective, OpDesc};
pub use reduction::shard_start;

// The cost model's floor for compression is the compressed engine's.
const _: () = assert!(compressed::MIN_BYTES == crate::cost::MIN_COMPRESS_BYTES);

/// Calls gathered between `group_start` and `group_end`: the byte ranges of every
/// point-to-point call and copy-engine collective (one op at the end), and the reductions,
/// which run after it in call order (each is several steps on the stream, see
/// `reduction.rs`, so they cannot merge into one op).
#[derive(Default)]
struct Group {
    depth: usize,
    stream: Option<StreamHandle>,
    sends: Vec<Transfer>,
    recvs: Vec<Transfer>,
    /// The calls' data type, None once two calls differ (the group then moves raw).
    dtype: Option<DataType>,
    calls: usize,
    reductions: Vec<reduction::Reduction>,
}

struct State {
    next_seq: u64,
    /// Per peer: ops so far that involved this rank and that peer.
    pair_counts: Vec<u64>,
    streams: StreamManager,
    group: Group,
    /// The compressed engine's staging and status words.
    codec: compressed::CodecState,
    /// The reductions' scratch, once allocated (`reduction.rs`).
    scratch: Option<reduction::Scratch>,
    /// The staged inter-node path's plans and forwarding staging (`internode.rs`).
    internode: internode::Staged,
    /// Ops captured into graphs: template ids, flag pairs, released resources (`capture.rs`).
    capture: capture::CaptureState,
    /// The staged path (`transport::staged`), when on.
    staged: Option<Staged>,
    destroyed: bool,
}

pub struct Communicator {
    rank: usize,
    size: usize,
    dev: Arc<dyn Device>,
    engine: Engine,
    bootstrap: Box<dyn Bootstrap>,
    topo: Topology,
    config: Config,
    /// Streams of this process that may wait for collectives on this GPU at once
    /// (`Config::max_waiting_streams`, resolved for the backend).
    wait_limit: usize,
    /// Whether the debug line about reductions under `HOCCL_ENGINE=ce` was logged.
    ce_reduce_logged: AtomicBool,
    /// `shrink` calls so far, failed ones included: each call's message uses its own tag
    /// (`shrink.rs`), so a retry never reads an id left over from a failed attempt.
    shrinks: std::sync::atomic::AtomicU32,
    /// The engine setting resolved for this communicator (docs/design.md, "Choosing the
    /// engine"): the link to each rank, the cost model every rank uses (rank 0's), and which
    /// transfers cross compressed. `EngineChoice::Auto` goes no further than this.
    peer_links: Vec<crate::cost::LinkKind>,
    cost_model: crate::cost::CostModel,
    compress_from: crate::cost::CompressFrom,
    state: Mutex<State>,
}

impl Communicator {
    // ================================================================ creation ==========

    /// Create over `MPI_COMM_WORLD` (initializing MPI if nobody has). Collective.
    pub fn world(config: Config) -> Result<Communicator> {
        let b = crate::bootstrap::mpi::MpiBootstrap::world()?;
        Self::with_bootstrap(Box::new(b), None, config)
    }

    /// Create from an MPI communicator (duplicated, so hoccl's traffic never mixes with
    /// the caller's). Collective over `comm`.
    pub fn from_mpi<C: mpi::traits::Communicator>(comm: &C, config: Config) -> Result<Communicator> {
        let b = crate::bootstrap::mpi::MpiBootstrap::from_communicator(comm)?;
        Self::with_bootstrap(Box::new(b), None, config)
    }

    /// Create from the Fortran handle of an MPI communicator (`MPI_Comm_c2f`), as C and C++
    /// callers pass it. Collective over that communicator.
    pub fn from_mpi_fortran(handle: i32, config: Config) -> Result<Communicator> {
        let b = crate::bootstrap::mpi::MpiBootstrap::from_fortran(handle)?;
        Self::with_bootstrap(Box::new(b), None, config)
    }

    /// On the process that will host the TCP rendezvous: a fresh [`UniqueId`] on the
    /// interface `config.socket_ifname` chooses (its root thread serves one communicator's
    /// creation). Hand the id to every rank, then each calls [`from_unique_id`](Self::from_unique_id).
    ///
    /// [`UniqueId`]: crate::bootstrap::tcp::UniqueId
    pub fn unique_id(config: &Config) -> Result<crate::bootstrap::tcp::UniqueId> {
        crate::bootstrap::tcp::UniqueId::with_ifname(config.socket_ifname.as_deref())
    }

    /// Create as `rank` of `nranks` over a TCP bootstrap joined through `id` (no MPI), with
    /// `config.timeout` bounding every bootstrap wait. The backend follows `config.backend`.
    /// Collective over the `nranks` ranks.
    pub fn from_unique_id(id: &crate::bootstrap::tcp::UniqueId, nranks: usize, rank: usize, config: Config) -> Result<Communicator> {
        Self::from_unique_id_on(id, nranks, rank, None, config)
    }

    /// As [`from_unique_id`](Self::from_unique_id) on a given device (tests pass a host one).
    pub fn from_unique_id_on(
        id: &crate::bootstrap::tcp::UniqueId,
        nranks: usize,
        rank: usize,
        device: Option<Arc<dyn Device>>,
        config: Config,
    ) -> Result<Communicator> {
        config.validate()?;
        let b = crate::bootstrap::tcp::TcpBootstrap::init(id, nranks, rank, config.timeout)?;
        Self::with_bootstrap(Box::new(b), device, config)
    }

    /// Create over any bootstrap. `device` overrides the backend choice (tests pass a host
    /// device); otherwise `config.backend` decides and the GPU is `config.device` or the
    /// local rank modulo the GPU count. Collective over the bootstrap's ranks.
    pub fn with_bootstrap(bootstrap: Box<dyn Bootstrap>, device: Option<Arc<dyn Device>>, config: Config) -> Result<Communicator> {
        const OP: &str = "Communicator::new";
        config.validate()?;
        init_logging(config.log.as_deref());
        let (rank, size) = (bootstrap.rank(), bootstrap.size());
        let topo = setup::build_topology(bootstrap.as_ref(), &config)?;
        let me = topo.ranks()[rank].clone();
        let dev = match device {
            Some(d) => d,
            None => device::open(config.backend, me.gpu)?,
        };
        let sharers = topo.context_sharers(rank);
        if dev.backend() == device::Backend::Cuda && sharers.len() > 1 && sharers[0] == rank {
            log::warn!(
                "hoccl: ranks {sharers:?} drive {} from one process (one CUDA context): their enqueues take turns (HOCCL_SERIAL_ENQUEUE), and allocating or freeing while a collective is pending can stall them (docs/design.md, Current limits); prefer one rank per process",
                dev.pci_bus_id()
            );
        }
        let wait_limit = config.waiting_stream_limit(dev.backend());
        let comm_id = setup::agree_comm_id(bootstrap.as_ref())?;
        let (peer_links, cost_model, compress_from) = setup::resolve_engine(bootstrap.as_ref(), &topo, &config)?;
        let local: Vec<usize> = topo.local_peers(rank).to_vec();
        let (links, flag_maps) = setup::connect_mailboxes(bootstrap.as_ref(), &topo, comm_id, &local, config.staged_bytes > 0)?;
        let net = setup::listen_for_peers(bootstrap.as_ref(), &topo, &config, comm_id, dev.backend())?;
        let engine = Engine::start(
            dev.clone(),
            links,
            net,
            EngineConfig {
                chunk_bytes: config.chunk_bytes,
                copy_queues: config.copy_queues,
                timeout: config.timeout,
                trace_ops: config.trace_ops,
                gated: config.gated,
                relay_via: relay_via(&topo, rank, &config),
                // Served whatever this rank's own setting: a sender that relays must find
                // its forwarding peer carrying.
                relay_serves: (0..size).any(|r| r != rank && topo.same_node(r, rank) && topo.ranks()[r].forwarding_peer == rank),
                relay_refuse: config.relay_refuse,
            },
        )?;
        bootstrap.barrier().map_err(|e| e.with_op(OP))?;
        let staged = Staged::setup(&dev, bootstrap.as_ref(), &topo, flag_maps, &config)?;
        log::info!("rank {rank}/{size}: communicator {comm_id:016x} on {} ({})", dev.name(), dev.pci_bus_id());
        let comm = Communicator {
            rank,
            size,
            dev,
            engine,
            bootstrap,
            topo,
            config,
            wait_limit,
            ce_reduce_logged: AtomicBool::new(false),
            shrinks: std::sync::atomic::AtomicU32::new(0),
            peer_links,
            cost_model,
            compress_from,
            state: Mutex::new(State {
                next_seq: 1,
                pair_counts: vec![0; size],
                streams: StreamManager::default(),
                group: Group::default(),
                codec: compressed::CodecState::default(),
                scratch: None,
                internode: internode::Staged::default(),
                capture: capture::CaptureState::default(),
                staged,
                destroyed: false,
            }),
        };
        comm.reserve_forward_staging()?;
        Ok(comm)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn size(&self) -> usize {
        self.size
    }
    /// The device this rank drives (allocate buffers and streams through it).
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }
    pub fn config(&self) -> &Config {
        &self.config
    }
    /// The bootstrap the communicator was created over (out-of-band exchange, barriers).
    pub fn bootstrap(&self) -> &dyn Bootstrap {
        self.bootstrap.as_ref()
    }
    /// Where every rank runs (host, pid, node, local rank, GPU).
    pub fn ranks(&self) -> &[RankPlacement] {
        self.topo.ranks()
    }
    /// The communicator's topology (nodes, GPUs, peer access, forwarding peers).
    pub fn topology(&self) -> &Topology {
        &self.topo
    }

    // ================================================================ errors ============

    /// The first asynchronous error (a peer died, a timeout, mismatched calls), if any.
    /// Once set, every later call fails with it, as NCCL's `ncclCommGetAsyncError`.
    pub fn async_error(&self) -> Option<Error> {
        self.engine.shared.scan_codec_status();
        self.engine.shared.error()
    }

    /// Tear down from any state: pending operations fail now and their streams are
    /// released; later calls fail with `Aborted`. Never blocks on the GPU.
    pub fn abort(&self) {
        // First, so that a call blocked for a waiting-stream slot (holding the state lock)
        // sees it and returns.
        self.engine.shared.aborted.store(true, Ordering::Release);
        if let Ok(mut st) = self.state.lock() {
            st.destroyed = true;
        }
        self.engine.shutdown(false);
    }

    /// Operations submitted and not yet finished on this rank.
    pub fn pending(&self) -> u64 {
        self.engine.pending()
    }

    /// Block the calling thread until the communicator's pending operations are finished
    /// (like `cudaStreamSynchronize` over every stream it used, but without touching the
    /// streams). Returns the async error if one occurred.
    pub fn wait_idle(&self) -> Result<()> {
        let deadline = std::time::Instant::now() + self.config.timeout + std::time::Duration::from_secs(5);
        while self.pending() > 0 {
            if std::time::Instant::now() > deadline {
                return Err(Error::Timeout { op: "Communicator::wait_idle", after: self.config.timeout, what: format!("{} operations pending", self.pending()) });
            }
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
        self.async_error().map_or(Ok(()), Err)
    }

    /// Why no call may proceed now: aborted, or the (sticky, as NCCL's) asynchronous error.
    fn stopped(&self, op: &'static str) -> Option<Error> {
        if self.engine.shared.aborted.load(Ordering::Acquire) {
            return Some(Error::Aborted { op });
        }
        self.engine.shared.error()
    }

    fn lock(&self, op: &'static str) -> Result<MutexGuard<'_, State>> {
        let st = self.state.lock().map_err(|_| Error::internal(op, "communicator lock poisoned"))?;
        if st.destroyed {
            return Err(Error::Aborted { op });
        }
        if let Some(e) = self.stopped(op) {
            return Err(e);
        }
        Ok(st)
    }

    // ================================================================ groups ============

    /// Start a group: sends and receives until the matching `group_end` form one operation,
    /// so any pattern of pairs completes without deadlock.
    pub fn group_start(&self) -> Result<()> {
        self.lock("group_start")?.group.depth += 1;
        Ok(())
    }

    /// End a group; the outermost end launches the gathered sends and receives (and the
    /// byte ranges of other copy-engine collectives) as one operation, then the group's
    /// reductions in call order.
    pub fn group_end(&self) -> Result<()> {
        const OP: &str = "group_end";
        let mut st = self.lock(OP)?;
        if st.group.depth == 0 {
            return Err(Error::invalid_usage(OP, "group_end without group_start"));
        }
        st.group.depth -= 1;
        if st.group.depth > 0 {
            return Ok(());
        }
        let g = std::mem::take(&mut st.group);
        let Some(stream) = g.stream else { return Ok(()) };
        if !g.sends.is_empty() || !g.recvs.is_empty() || g.reductions.is_empty() {
            self.launch(&mut st, "group", stream, g.dtype, g.sends, g.recvs)?;
        }
        for red in &g.reductions {
            self.run_reduction(&mut st, red)?;
        }
        Ok(())
    }

    /// Run `f` inside `group_start`/`group_end`; the group is closed even if `f` fails.
    pub fn group<T>(&self, f: impl FnOnce(&Self) -> Result<T>) -> Result<T> {
        self.group_start()?;
        let r = f(self);
        let end = self.group_end();
        let v = r?;
        end.map(|_| v)
    }

    // ================================================================ launch ============

    /// Validate `[ptr, ptr+len)` as device memory inside one allocation (one lookup per
    /// user buffer per call; sub-ranges are cut from it with [`Region::part`]).
    fn region(&self, op: &'static str, what: &'static str, ptr: DevPtr, len: usize) -> Result<Region> {
        if len == 0 {
            return Ok(Region { op, what, ptr, len, alloc: None });
        }
        if ptr.is_null() {
            return Err(Error::invalid_arg(op, format!("{what} buffer is null")));
        }
        let a = self.dev.allocation(ptr).map_err(|e| Error::invalid_arg(op, format!("{what} buffer: {e}")))?;
        let end = ptr.0.checked_add(len as u64).ok_or_else(|| Error::invalid_arg(op, format!("{what} buffer range overflows")))?;
        if end > a.base.0 + a.len as u64 {
            return Err(Error::invalid_arg(
                op,
                format!("{what} buffer too short: {len} bytes at offset {} of an allocation of {} bytes", ptr.0 - a.base.0, a.len),
            ));
        }
        Ok(Region { op, what, ptr, len, alloc: Some(a) })
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer >= self.size {
            return Err(Error::invalid_arg(op, format!("peer rank {peer} out of range (size {})", self.size)));
        }
        Ok(())
    }

    /// Queue one op (or add it to the open group).
    fn submit(&self, name: &'static str, stream: StreamHandle, dtype: DataType, sends: Vec<Transfer>, recvs: Vec<Transfer>) -> Result<()> {
        let mut st = self.lock(name)?;
        if st.group.depth > 0 {
            if st.group.stream.is_some_and(|s| s != stream) {
                return Err(Error::invalid_usage(name, "all calls of one group must use the same stream"));
            }
            let g = &mut st.group;
            g.stream = Some(stream);
            g.dtype = if g.calls == 0 || g.dtype == Some(dtype) { Some(dtype) } else { None };
            g.calls += 1;
            g.sends.extend(sends);
            g.recvs.extend(recvs);
            return Ok(());
        }
        self.launch(&mut st, name, stream, Some(dtype), sends, recvs)
    }

    /// Run a validated reduction now, or add it to the open group.
    fn submit_reduction(&self, name: &'static str, red: reduction::Reduction) -> Result<()> {
        let mut st = self.lock(name)?;
        if st.group.depth > 0 {
            if st.group.stream.is_some_and(|s| s != red.stream) {
                return Err(Error::invalid_usage(name, "all calls of one group must use the same stream"));
            }
            st.group.stream = Some(red.stream);
            st.group.reductions.push(red);
            return Ok(());
        }
        self.run_reduction(&mut st, &red)
    }

    /// Enqueue one op (or a group's gathered transfers): the copies to self, the compressed
    /// engine's work when it applies (`dtype`: the calls' common type), the handshake, and
    /// the proxy's part.
    fn launch(&self, st: &mut State, name: &'static str, stream: StreamHandle, dtype: Option<DataType>, sends: Vec<Transfer>, recvs: Vec<Transfer>) -> Result<()> {
        // `auto` with every rank on this rank's GPU: coding, moving and decoding share one memory, so
        // overlapping them gains nothing and smaller codec launches cost (on one H200, two
        // processes under MPS, 256 MiB bf16: sendrecv 296 GB/s whole against 268 cut in 8,
        // AllGather 229 against 185). Every rank sees the same topology, so all cut alike.
        let count = match self.config.codec_segments {
            Some(n) => n,
            None if self.topo.gpu_sharers(self.rank).len() == self.size => 1,
            None => crate::config::CODEC_SEGMENTS,
        };
        st.codec.segment_next(compressed::Segmenting { count, min_bytes: self.config.codec_segment_bytes });
        let plan = self.launch_op(st, name, stream, dtype, sends, recvs, None);
        st.codec.segment_none();
        match plan? {
            Some(p) => p.finish(self.dev.as_ref(), stream).map_err(|e| e.with_op(name)),
            None => Ok(()),
        }
    }

    /// Enqueue one op whose transfers to peers wait for each other as `order` says (a
    /// staged plan as one op, `internode`), uncompressed. Its transfers to self, if any,
    /// come after all the others in `sends` and `recvs`.
    fn launch_ordered(&self, st: &mut State, name: &'static str, stream: StreamHandle, sends: Vec<Transfer>, recvs: Vec<Transfer>, order: Arc<crate::engine::Order>) -> Result<()> {
        self.launch_op(st, name, stream, None, sends, recvs, Some(order)).map(|_| ())
    }

    /// [`Self::launch`] without the compressed receives' decompression: the compressed
    /// engine's plan, when there is one, is returned for the caller to finish (or to hand
    /// its streams to a fused kernel, as the reductions do).
    /// `order`: waits between the transfers to peers (indices into `sends` and `recvs` once
    /// the transfers to self are taken out); such an op moves its data uncompressed and
    /// without the staged transport, every transfer through the proxy.
    #[allow(clippy::too_many_arguments)]
    fn launch_op(
        &self,
        st: &mut State,
        name: &'static str,
        stream: StreamHandle,
        dtype: Option<DataType>,
        mut sends: Vec<Transfer>,
        mut recvs: Vec<Transfer>,
        order: Option<Arc<crate::engine::Order>>,
    ) -> Result<Option<compressed::Plan>> {
        // No proxy closes a mapping between this op's stream work and its submission
        // (`transport::ipc::quiet`).
        let _enqueue = crate::transport::ipc::enqueue_guard();
        let local = take_local(name, self.rank, &mut sends, &mut recvs)?;
        if let Some(o) = &order {
            if !o.fits(sends.len(), recvs.len()) {
                return Err(Error::internal(name, "an op's order does not fit its transfers to peers"));
            }
        }
        if self.capturing(name, stream, !sends.is_empty() || !recvs.is_empty())? {
            if order.is_some() {
                return Err(Error::internal(name, "an ordered op cannot be captured"));
            }
            return self.launch_captured(st, name, stream, dtype, sends, recvs, &local).map(|_| None);
        }
        if sends.is_empty() && recvs.is_empty() {
            // Nothing crosses to a peer: the copies go on the caller's stream itself, which
            // orders them after the work before the call and before the work after it.
            local.iter().try_for_each(|&(dst, src, len)| self.dev.memcpy_async(stream, dst, src, len).map_err(|e| e.with_op(name)))?;
            return Ok(None);
        }
        let plan = match dtype.filter(|_| order.is_none()).and_then(|dt| Some((dt, self.compress_from.for_dtype(dt)?))) {
            Some((dt, from)) => {
                let dev = self.dev.as_ref();
                let plan = st.codec.prepare(dev, stream, dt, self.rank, from, &mut sends, &mut recvs).map_err(|e| e.with_op(name))?;
                if plan.is_some() {
                    let ring = st.codec.status_ring(dev)?;
                    if let Ok(mut g) = self.engine.shared.codec_status.lock() {
                        g.get_or_insert(ring);
                    }
                }
                plan
            }
            _ => None,
        };
        // Staged transfers: every device operation enqueued here, on the stream (receives)
        // and the staged queues (sends); the proxy only watches their flags.
        let taken = st.staged.as_ref().filter(|_| order.is_none()).map(|s| s.split(&mut sends, &mut recvs)).unwrap_or_default();
        let mut peers: Vec<usize> = sends.iter().chain(&recvs).chain(&taken.sends).chain(&taken.recvs).map(|x| x.peer).collect();
        peers.sort_unstable();
        peers.dedup();
        let stop = || self.stopped(name);
        let adm = Admission { max: self.wait_limit, timeout: self.config.timeout, stop: &stop };
        let mut waits: Vec<StagedWait> = Vec::new();
        let State { streams, staged, .. } = &mut *st;
        // An op the proxy moves nothing of completes without it: its stream waits on the
        // staged queues' own words, not on the proxy's finish.
        let direct = staged.as_ref().and_then(|s| s.direct_waits(&taken, sends.is_empty() && recvs.is_empty() && plan.is_none()));
        let hop = direct.is_none();
        // Between the start and the finish: a pipelined compressed op's coding (its copies
        // wait for it), the staged receives, then the compressed receives' decoding.
        let mut between = |b: &mut Batch<OnStream<'_>>| {
            if let Some(p) = &plan {
                p.enqueue_coding(b)?;
            }
            match staged.as_mut() {
                Some(s) if !taken.recvs.is_empty() => s.enqueue_recvs(b, &taken.recvs, hop, &mut waits)?,
                _ => {}
            }
            plan.as_ref().map_or(Ok(()), |p| p.enqueue_decoding(b))
        };
        let hs = streams.enqueue_with(self.dev.as_ref(), stream, name, &local, &mut between, direct.as_deref(), &adm).inspect_err(|_| {
            // The receives' last operations share a driver call with the handshake's finish:
            // after any failure the stream may hold part of them.
            if let Some(s) = staged.as_mut().filter(|_| !taken.recvs.is_empty()) {
                s.abandon(&taken.recvs);
            }
            if let Some(p) = &plan {
                p.abandon();
            }
        })?;
        if let Some(s) = staged.as_mut().filter(|_| !taken.sends.is_empty()) {
            if let Err(e) = s.enqueue_sends(hs.flags.dev_addr(hs.start_flag), hs.stream_seq, &taken.sends, hop, &mut waits) {
                // The handshake is on the stream but the op is not submitted: release it.
                if let Some(p) = &plan {
                    p.abandon();
                }
                hs.flags.raise(hs.finish_flag, hs.stream_seq);
                return Err(e.with_op(name));
            }
        }
        let pair_seqs = peers
            .into_iter()
            .map(|p| {
                st.pair_counts[p] += 1;
                (p, st.pair_counts[p])
            })
            .collect();
        let seq = st.next_seq;
        st.next_seq += 1;
        self.engine.submit(Op {
            seq,
            name,
            flags: hs.flags,
            start_flag: hs.start_flag,
            finish_flag: hs.finish_flag,
            stream_seq: hs.stream_seq,
            sends,
            recvs,
            pair_seqs,
            len_words: plan.as_ref().and_then(|p| p.len_words.clone()),
            staged: waits,
            order,
        })?;
        Ok(plan)
    }

    fn bytes(op: &'static str, count: usize, dtype: DataType) -> Result<usize> {
        dtype.bytes(op, count)
    }
}

/// This rank's forwarding peer when its point-to-point sends to other nodes go through it
/// (`transport::relay`): `HOCCL_FORWARDING` on, ranks on several nodes, and the topology's
/// forwarding peer another rank of this node.
fn relay_via(topo: &Topology, rank: usize, config: &Config) -> Option<usize> {
    let f = topo.ranks()[rank].forwarding_peer;
    (config.forwarding && topo.nodes().len() > 1 && f != rank && topo.same_node(f, rank)).then_some(f)
}

/// Remove this rank's transfers to itself from `sends` and `recvs` and pair them: the k-th
/// send to self lands in the k-th receive from self. Returns the copies still to make as
/// (dst, src, len), leaving out empty and in-place ones. A send to self without its receive
/// (or the reverse), or two of different lengths, is a usage error.
fn take_local(name: &'static str, me: usize, sends: &mut Vec<Transfer>, recvs: &mut Vec<Transfer>) -> Result<Vec<(DevPtr, DevPtr, usize)>> {
    let mine = |x: &&Transfer| x.peer == me;
    let mut copies = Vec::new();
    let mut ins = recvs.iter().filter(mine);
    for s in sends.iter().filter(mine) {
        let Some(r) = ins.next() else {
            return Err(Error::invalid_usage(name, "a send to self has no matching receive from self"));
        };
        if s.len != r.len {
            return Err(Error::invalid_usage(name, format!("send to self of {} bytes but receive from self of {}", s.len, r.len)));
        }
        if s.len > 0 && s.ptr != r.ptr {
            copies.push((r.ptr, s.ptr, s.len));
        }
    }
    if let Some(r) = ins.next() {
        return Err(Error::invalid_usage(name, format!("a receive from self ({} bytes) has no matching send to self", r.len)));
    }
    sends.retain(|x| x.peer != me);
    recvs.retain(|x| x.peer != me);
    Ok(copies)
}

/// A validated user buffer.
#[derive(Clone, Copy)]
struct Region {
    op: &'static str,
    what: &'static str,
    ptr: DevPtr,
    len: usize,
    alloc: Option<crate::device::Allocation>,
}

impl Region {
    /// The transfer of `len` bytes at `off` within this buffer, to or from `peer`.
    fn part(&self, off: usize, len: usize, peer: usize) -> Result<Transfer> {
        if len == 0 {
            return Ok(Transfer { peer, ptr: self.ptr.add(off), len: 0, alloc: None, fill: Fill::Exact, forward: false });
        }
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok(Transfer { peer, ptr: self.ptr.add(off), len, alloc: self.alloc, fill: Fill::Exact, forward: false }),
            _ => Err(Error::invalid_arg(self.op, format!("{} range {off}+{len} exceeds the {}-byte buffer", self.what, self.len))),
        }
    }
    fn whole(&self, peer: usize) -> Result<Transfer> {
        self.part(0, self.len, peer)
    }
    /// A validated sub-buffer (same allocation).
    fn sub(&self, off: usize, len: usize) -> Result<Region> {
        let x = self.part(off, len, 0)?;
        Ok(Region { op: self.op, what: self.what, ptr: x.ptr, len, alloc: x.alloc.or(self.alloc) })
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Pending ops finish first (bounded by the timeout), then the proxy stops.
        self.engine.shutdown(true);
        let clean = self.engine.pending() == 0 && self.engine.shared.error().is_none() && !self.engine.shared.aborted.load(Ordering::Acquire);
        if let Ok(mut st) = self.state.lock() {
            st.streams.release(self.dev.as_ref(), clean);
            st.codec.release(self.dev.as_ref(), clean);
            self.release_scratch(&mut st, self.config.timeout);
            self.release_forward_staging(&mut st, self.config.timeout);
            self.release_captured(&mut st);
            if let Some(s) = st.staged.take() {
                s.close(clean);
            }
        }
    }
}
