//! Device contexts: what a kernel call gets to run on.
//!
//! A [`DeviceContextPtr`] is a cheap, clonable handle (like MAX's
//! `DeviceContextPtr`) to a [`DeviceContext`]. On the CPU it carries the
//! worker pool kernels split their work over; on CUDA, the device and the
//! stream every copy and launch goes to (a [`kvjit_cuda::CudaDevice`], which
//! also holds the buffers kept resident on the device between calls).
//!
//! **Kernel state lives in the context.** A kernel that keeps something per
//! device — the CUDA kernels' loaded functions, uploaded constant weight and
//! scratch buffers — keeps it in the context it ran on
//! ([`DeviceContextPtr::with_kernel_state`]), keyed by the kernel's
//! [`KernelStateOwner`]. The state is freed when the last handle to the
//! context is dropped, or earlier when the kernel is dropped, so neither a
//! long-lived executable run with fresh contexts nor a long-lived context
//! running many short-lived executables accumulates device memory.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};

use kvjit_core::Target;
use kvjit_cuda::CudaDevice;

use crate::workers::WorkerPool;
use crate::{Result, RuntimeError};

/// The CPU context: a worker pool of a fixed number of threads.
#[derive(Debug)]
pub struct CpuContext {
    workers: WorkerPool,
    /// A rayon pool of as many threads, built on first use.
    rayon: OnceLock<rayon::ThreadPool>,
    threads: usize,
}

impl CpuContext {
    /// The worker pool kernels run their parallel work on.
    pub fn workers(&self) -> &WorkerPool {
        &self.workers
    }

    /// A rayon pool of [`CpuContext::threads`] threads, for code that speaks
    /// rayon (library peers in benchmarks); built on the first call.
    /// Kernels run on [`CpuContext::workers`], whose idle workers this
    /// parks first ([`WorkerPool::park_idle`]): a worker spinning for the
    /// next kernel would share a core with rayon's threads (a peer timed
    /// right after a kernel ran slower for it).
    pub fn rayon_pool(&self) -> Result<&rayon::ThreadPool> {
        self.workers.park_idle();
        if let Some(pool) = self.rayon.get() {
            return Ok(pool);
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(self.threads)
            .thread_name(|i| format!("kvjit-rayon-{i}"))
            .build()
            .map_err(|e| RuntimeError::ThreadPool(e.to_string()))?;
        // Another thread may have won the race; either pool will do.
        let _ = self.rayon.set(pool);
        Ok(self.rayon.get().expect("set above"))
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }
}

/// The CUDA context: one GPU and its stream.
#[derive(Debug)]
pub struct CudaContext {
    device: Arc<CudaDevice>,
}

impl CudaContext {
    /// The device, its stream, loaded modules and resident buffers.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }
}

/// A device a kernel runs on, with what it needs to run there.
#[derive(Debug)]
#[non_exhaustive]
pub enum DeviceContext {
    /// The host CPU and its worker pool.
    Cpu(CpuContext),
    /// A CUDA GPU and its stream.
    Cuda(CudaContext),
}

/// One kernel's state in one context, behind its own lock so kernels on one
/// context do not wait for each other.
type StateCell = Arc<Mutex<Box<dyn Any + Send>>>;

/// A context and the state kernels keep in it.
#[derive(Debug)]
struct ContextInner {
    context: DeviceContext,
    kernel_states: KernelStates,
}

/// Per-kernel state kept in a context, by [`KernelStateOwner`] id.
#[derive(Default)]
struct KernelStates(Mutex<HashMap<u64, StateCell>>);

impl std::fmt::Debug for KernelStates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let count = self.0.lock().unwrap_or_else(PoisonError::into_inner).len();
        write!(f, "KernelStates({count} kernels)")
    }
}

/// The identity under which a kernel keeps state in contexts
/// ([`DeviceContextPtr::with_kernel_state`]). Dropping it (with the kernel
/// that owns it) frees that state in every context still alive.
pub struct KernelStateOwner {
    id: u64,
    /// The contexts holding state of this owner.
    contexts: Mutex<Vec<Weak<ContextInner>>>,
}

impl KernelStateOwner {
    /// A new owner, distinct from every other one in the process.
    pub fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Self { id: NEXT.fetch_add(1, Ordering::Relaxed), contexts: Mutex::new(Vec::new()) }
    }
}

impl Default for KernelStateOwner {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for KernelStateOwner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KernelStateOwner({})", self.id)
    }
}

impl Drop for KernelStateOwner {
    fn drop(&mut self) {
        let contexts = std::mem::take(self.contexts.get_mut().unwrap_or_else(PoisonError::into_inner));
        for context in contexts.iter().filter_map(Weak::upgrade) {
            let removed = context.kernel_states.0.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.id);
            drop(removed); // freed outside the table's lock
        }
    }
}

/// A shared handle to a [`DeviceContext`], passed to every kernel call.
#[derive(Clone, Debug)]
pub struct DeviceContextPtr(Arc<ContextInner>);

impl DeviceContextPtr {
    /// A CPU context with `threads` workers (0 means one per available core;
    /// more than [`MAX_WORKER_THREADS`](crate::MAX_WORKER_THREADS) is refused).
    pub fn cpu(threads: usize) -> Result<Self> {
        let threads = match threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()).min(crate::MAX_WORKER_THREADS),
            threads => threads,
        };
        let workers = WorkerPool::new(threads, "kvjit-cpu").map_err(|e| RuntimeError::ThreadPool(e.to_string()))?;
        Ok(Self::wrap(DeviceContext::Cpu(CpuContext { workers, rayon: OnceLock::new(), threads })))
    }

    /// A context on CUDA device `ordinal` with a new stream, or
    /// [`RuntimeError::TargetUnavailable`] saying why CUDA cannot be used
    /// (no driver, no device, ...). Never panics.
    pub fn cuda(ordinal: usize) -> Result<Self> {
        let device = CudaDevice::new(ordinal).map_err(unavailable)?;
        Ok(Self::wrap(DeviceContext::Cuda(CudaContext { device })))
    }

    fn wrap(context: DeviceContext) -> Self {
        Self(Arc::new(ContextInner { context, kernel_states: KernelStates::default() }))
    }

    /// A context for `target` (CUDA: device 0), or a typed error saying why
    /// it is unavailable.
    pub fn for_target(target: Target, cpu_threads: usize) -> Result<Self> {
        match target {
            Target::Cpu => Self::cpu(cpu_threads),
            Target::Cuda => Self::cuda(0),
        }
    }

    /// The target this context runs kernels on.
    pub fn target(&self) -> Target {
        match &self.0.context {
            DeviceContext::Cpu(_) => Target::Cpu,
            DeviceContext::Cuda(_) => Target::Cuda,
        }
    }

    /// The CPU context, if this is one.
    pub fn cpu_context(&self) -> Option<&CpuContext> {
        match &self.0.context {
            DeviceContext::Cpu(cpu) => Some(cpu),
            DeviceContext::Cuda(_) => None,
        }
    }

    /// The CUDA context, if this is one.
    pub fn cuda_context(&self) -> Option<&CudaContext> {
        match &self.0.context {
            DeviceContext::Cuda(cuda) => Some(cuda),
            DeviceContext::Cpu(_) => None,
        }
    }

    /// The context itself.
    pub fn context(&self) -> &DeviceContext {
        &self.0.context
    }

    /// Run `f` on the state `owner` keeps in this context, creating it with
    /// `init` on the owner's first call here (a failed `init` stores
    /// nothing). Calls for one owner on one context are serialized; other
    /// owners are not blocked. The state lives until this context's last
    /// handle or the owner is dropped, whichever comes first.
    ///
    /// An owner must always ask for the same `T`; asking for another type is
    /// a bug in the kernel and panics.
    pub fn with_kernel_state<T: Send + 'static, R, E>(
        &self,
        owner: &KernelStateOwner,
        init: impl FnOnce() -> std::result::Result<T, E>,
        f: impl FnOnce(&mut T) -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        let cell = {
            let mut states = self.0.kernel_states.0.lock().unwrap_or_else(PoisonError::into_inner);
            match states.get(&owner.id) {
                Some(cell) => cell.clone(),
                None => {
                    let cell: StateCell = Arc::new(Mutex::new(Box::new(init()?)));
                    states.insert(owner.id, cell.clone());
                    let mut contexts = owner.contexts.lock().unwrap_or_else(PoisonError::into_inner);
                    contexts.retain(|c| c.strong_count() > 0);
                    contexts.push(Arc::downgrade(&self.0));
                    cell
                }
            }
        };
        let mut state = cell.lock().unwrap_or_else(PoisonError::into_inner);
        let state = state.downcast_mut::<T>().expect("a kernel state owner always keeps one type of state");
        f(state)
    }

    /// How many kernels keep state in this context.
    pub fn kernel_states(&self) -> usize {
        self.0.kernel_states.0.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

fn unavailable(error: kvjit_cuda::CudaError) -> RuntimeError {
    RuntimeError::TargetUnavailable { target: Target::Cuda, reason: error.to_string() }
}

/// Whether the CUDA target can be used on this machine: `Ok`, or
/// [`RuntimeError::TargetUnavailable`] with the probe's reason
/// (`libcuda.so not found (no NVIDIA driver is installed)`, `no CUDA
/// device`, ...). Probes once per process (see [`kvjit_cuda::availability`]).
pub fn cuda_availability() -> Result<()> {
    kvjit_cuda::availability().map_err(unavailable)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// Counts live instances, to see exactly when kernel state is dropped.
    struct Tracked(Arc<AtomicUsize>);

    impl Tracked {
        fn new(live: &Arc<AtomicUsize>) -> Self {
            live.fetch_add(1, Ordering::SeqCst);
            Self(live.clone())
        }
    }

    impl Drop for Tracked {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn touch(ctx: &DeviceContextPtr, owner: &KernelStateOwner, live: &Arc<AtomicUsize>) -> usize {
        ctx.with_kernel_state(
            owner,
            || Ok::<_, ()>((Tracked::new(live), 0usize)),
            |(_, calls)| {
                *calls += 1;
                Ok(*calls)
            },
        )
        .unwrap()
    }

    #[test]
    fn kernel_state_is_created_once_per_context_and_freed_with_the_context() {
        let live = Arc::new(AtomicUsize::new(0));
        let owner = KernelStateOwner::new();
        for round in 0..50 {
            let ctx = DeviceContextPtr::cpu(1).unwrap();
            let clone = ctx.clone();
            assert_eq!(touch(&ctx, &owner, &live), 1, "round {round}: a fresh context starts fresh state");
            assert_eq!(touch(&clone, &owner, &live), 2, "round {round}: clones share the context's state");
            assert_eq!(live.load(Ordering::SeqCst), 1);
            drop(ctx);
            assert_eq!(live.load(Ordering::SeqCst), 1, "a handle is still alive");
            drop(clone);
            assert_eq!(live.load(Ordering::SeqCst), 0, "round {round}: the context's state outlived it");
        }
        assert!(owner.contexts.lock().unwrap().len() <= 1, "dead contexts are not remembered");
    }

    #[test]
    fn kernel_state_is_freed_with_its_owner_and_other_owners_keep_theirs() {
        let live = Arc::new(AtomicUsize::new(0));
        let ctx = DeviceContextPtr::cpu(1).unwrap();
        let other_ctx = DeviceContextPtr::cpu(1).unwrap();
        let (first, second) = (KernelStateOwner::new(), KernelStateOwner::new());
        touch(&ctx, &first, &live);
        touch(&other_ctx, &first, &live);
        touch(&ctx, &second, &live);
        assert_eq!((live.load(Ordering::SeqCst), ctx.kernel_states()), (3, 2));
        drop(first);
        assert_eq!(live.load(Ordering::SeqCst), 1, "the dropped owner's state stays in some context");
        assert_eq!((ctx.kernel_states(), other_ctx.kernel_states()), (1, 0));
        assert_eq!(touch(&ctx, &second, &live), 2, "the other owner's state is untouched");
    }

    #[test]
    fn a_failed_init_stores_nothing() {
        let ctx = DeviceContextPtr::cpu(1).unwrap();
        let owner = KernelStateOwner::new();
        let failed: std::result::Result<(), &str> =
            ctx.with_kernel_state(&owner, || Err("no device"), |_: &mut u8| Ok(()));
        assert_eq!(failed, Err("no device"));
        assert_eq!(ctx.kernel_states(), 0);
        let value = ctx.with_kernel_state(&owner, || Ok::<u8, ()>(7), |v| Ok(*v)).unwrap();
        assert_eq!(value, 7);
    }
}
