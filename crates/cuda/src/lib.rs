//! kvjit's CUDA plumbing, shared by every op's CUDA kernels: whether CUDA can
//! be used here ([`availability`]), a device with its stream
//! ([`CudaDevice`]), precompiled PTX modules ([`PtxImage`],
//! [`CudaDevice::function`]), device buffers and host↔device copies
//! ([`DeviceBuffer`]), kernel launches ([`CudaDevice::launch`]), and the
//! device-side KV cache every op's kernels read and write (blocks, and an
//! FP8 cache's scales: [`DeviceKvCache`]), kept across calls and re-uploaded
//! when the host wrote it ([`CudaDevice::with_kv_cache`]).
//!
//! Start with [`availability`] (never panics, even without a driver), then
//! [`CudaDevice::new`].
//!
//! The crate builds and its tests pass with no CUDA installed: cudarc loads
//! `libcuda` at run time (`dynamic-loading`), and nothing here is compiled
//! from CUDA sources — ops ship PTX generated ahead of time with the pinned
//! CUDA 13.0 toolchain (`scripts/gen-ptx.sh`). Every driver call's status is
//! checked and turned into a [`CudaError`] naming the call.

mod device;
mod error;
mod kv_cache;
mod probe;

pub use device::{CudaDevice, DeviceBuffer, Function, KernelArg, LaunchShape, PtxImage, live_device_bytes};
pub use error::{CudaError, Result};
pub use kv_cache::DeviceKvCache;
pub use probe::availability;

/// cudarc, for code that needs more than this crate wraps (the GPU check's
/// cuBLAS baseline).
pub use cudarc;
