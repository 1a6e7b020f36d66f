//! Device contexts: what a kernel call gets to run on.
//!
//! A [`DeviceContextPtr`] is a cheap, clonable handle (like MAX's
//! `DeviceContextPtr`) to a [`DeviceContext`]. On the CPU it carries the
//! worker pool kernels split their work over; on CUDA, the device and the
//! stream every copy and launch goes to (a [`kvjit_cuda::CudaDevice`], which
//! also holds the buffers kept resident on the device between calls).

use std::sync::Arc;

use kvjit_core::Target;
use kvjit_cuda::CudaDevice;

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

    /// A context on CUDA device `ordinal` with a new stream, or
    /// [`RuntimeError::TargetUnavailable`] saying why CUDA cannot be used
    /// (no driver, no device, ...). Never panics.
    pub fn cuda(ordinal: usize) -> Result<Self> {
        let device = CudaDevice::new(ordinal).map_err(unavailable)?;
        Ok(Self(Arc::new(DeviceContext::Cuda(CudaContext { device }))))
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
        match &*self.0 {
            DeviceContext::Cpu(_) => Target::Cpu,
            DeviceContext::Cuda(_) => Target::Cuda,
        }
    }

    /// The CPU context, if this is one.
    pub fn cpu_context(&self) -> Option<&CpuContext> {
        match &*self.0 {
            DeviceContext::Cpu(cpu) => Some(cpu),
            DeviceContext::Cuda(_) => None,
        }
    }

    /// The CUDA context, if this is one.
    pub fn cuda_context(&self) -> Option<&CudaContext> {
        match &*self.0 {
            DeviceContext::Cuda(cuda) => Some(cuda),
            DeviceContext::Cpu(_) => None,
        }
    }

    /// The context itself.
    pub fn context(&self) -> &DeviceContext {
        &self.0
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
