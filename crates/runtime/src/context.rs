//! Device contexts: what a kernel call gets to run on.
//!
//! A [`DeviceContextPtr`] is a cheap, clonable handle (like MAX's
//! `DeviceContextPtr`) to a [`DeviceContext`]. On the CPU it carries the
//! worker pool kernels split their work over; the CUDA context (device,
//! stream) joins it when the CUDA backend is built.

use std::sync::Arc;

use kvjit_core::Target;

use crate::{Result, RuntimeError};

/// The CPU context: a worker pool of a fixed number of threads.
#[derive(Debug)]
pub struct CpuContext {
    pool: rayon::ThreadPool,
    threads: usize,
}

impl CpuContext {
    /// The worker pool kernels run their parallel work on.
    pub fn pool(&self) -> &rayon::ThreadPool {
        &self.pool
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }
}

/// A device a kernel runs on, with what it needs to run there.
#[derive(Debug)]
#[non_exhaustive]
pub enum DeviceContext {
    /// The host CPU and its worker pool.
    Cpu(CpuContext),
}

/// A shared handle to a [`DeviceContext`], passed to every kernel call.
#[derive(Clone, Debug)]
pub struct DeviceContextPtr(Arc<DeviceContext>);

impl DeviceContextPtr {
    /// A CPU context with `threads` workers (0 means one per available core).
    pub fn cpu(threads: usize) -> Result<Self> {
        let threads = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("kvjit-cpu-{i}"))
            .build()
            .map_err(|e| RuntimeError::ThreadPool(e.to_string()))?;
        Ok(Self(Arc::new(DeviceContext::Cpu(CpuContext { pool, threads }))))
    }

    /// A context for `target`, or a typed error saying why it is unavailable.
    pub fn for_target(target: Target, cpu_threads: usize) -> Result<Self> {
        match target {
            Target::Cpu => Self::cpu(cpu_threads),
            Target::Cuda => Err(cuda_availability().unwrap_err()),
        }
    }

    /// The target this context runs kernels on.
    pub fn target(&self) -> Target {
        match &*self.0 {
            DeviceContext::Cpu(_) => Target::Cpu,
        }
    }

    /// The CPU context, if this is one.
    pub fn cpu_context(&self) -> Option<&CpuContext> {
        match &*self.0 {
            DeviceContext::Cpu(cpu) => Some(cpu),
        }
    }

    /// The context itself.
    pub fn context(&self) -> &DeviceContext {
        &self.0
    }
}

/// Whether the CUDA target can be used in this build on this machine.
pub fn cuda_availability() -> Result<()> {
    Err(RuntimeError::TargetUnavailable {
        target: Target::Cuda,
        reason: "this build of kvjit has no CUDA backend".into(),
    })
}
