//! The kvjit runtime: device contexts, the kernel interface, executables and
//! the executor that runs them.
//!
//! This crate knows nothing of graphs: the compile step (in the `kvjit`
//! facade) lowers a specialized graph to an [`Executable`] — an ordered list
//! of [`Kernel`] calls over numbered slots — and [`Executor::run`] runs it
//! with named inputs and KV caches, handing every kernel a
//! [`DeviceContextPtr`]. Start with [`Executor::new`].

mod context;
mod error;
mod executable;
mod executor;
mod kernel;
mod machine;
mod workers;

pub use context::{CpuContext, CudaContext, DeviceContext, DeviceContextPtr, KernelStateOwner, cuda_availability};
pub use error::{Result, RuntimeError};
pub use executable::{CacheSpec, Executable, InputSpec, ShapeDim, Slot, Step};
pub use executor::{Executor, RELEASE_DEAD_ABOVE, RELEASE_MIN_BYTES, RunOutput, StepTiming};
pub use kernel::{BuildOptions, CodeInfo, ConstantInput, Kernel, KernelBuilder, KernelImpl, OutputSpec};
pub use machine::physical_memory;
pub use workers::{MAX_WORKER_THREADS, SPIN, WorkerPool, parse_threads};
