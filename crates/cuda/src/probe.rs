//! Whether CUDA can be used here, and why not.
//!
//! cudarc loads `libcuda` lazily and *panics* when it is missing (or lacks a
//! symbol cudarc needs), so the probe first asks cudarc whether the library
//! can be opened at all, then walks the driver step by step — init, driver
//! version, device count, context, compute capability — turning each failure
//! into a one-line reason. The result for device 0 is computed once per
//! process; its context is kept and reused by [`CudaDevice::new`](crate::CudaDevice::new)
//! (creating a primary context costs a noticeable fraction of a second).

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, DriverError, result, sys};

use crate::CudaError;

/// The oldest driver API version that loads kvjit's PTX: ISA 9.0 comes from
/// CUDA 13.0 (driver 580).
pub(crate) const MIN_DRIVER_VERSION: i32 = 13000;
/// The oldest GPU the kernels run on: they use `cp.async`, `ldmatrix` and
/// bf16 `mma.sync` (sm_80, Ampere).
pub(crate) const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

static DEVICE0: OnceLock<Result<Arc<CudaContext>, String>> = OnceLock::new();

/// `Ok` when CUDA device 0 can run kvjit's kernels; otherwise
/// [`CudaError::Unavailable`] with the reason (`libcuda.so not found (no
/// NVIDIA driver is installed)`, `no CUDA device`, a driver too old for the
/// PTX, a GPU older than sm_80, ...). Never panics; probes once per process.
pub fn availability() -> Result<(), CudaError> {
    device0().map(|_| ())
}

/// Device 0's context, created by the probe.
pub(crate) fn device0() -> Result<Arc<CudaContext>, CudaError> {
    DEVICE0.get_or_init(|| probe(0)).clone().map_err(CudaError::Unavailable)
}

/// Probe device `ordinal` and return a context on it, or why there is none.
pub(crate) fn probe(ordinal: usize) -> Result<Arc<CudaContext>, String> {
    // SAFETY: `is_culib_present` only tries to open the driver library under
    // its usual names (and closes it again); it calls no driver function, so
    // it is sound whether or not a driver is installed.
    if !unsafe { sys::is_culib_present() } {
        return Err("libcuda.so not found (no NVIDIA driver is installed)".into());
    }
    // The library opened, so cudarc's lazy loader will find it; it still
    // panics if a symbol it wants is missing (a driver older than cudarc's
    // CUDA 13.0 bindings). Report that as a reason, not a crash.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| probe_driver(ordinal))) {
        Ok(result) => result,
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(format!("the CUDA driver library cannot be used: {message}"))
        }
    }
}

fn status(call: &str, error: DriverError) -> String {
    if error.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE {
        "no CUDA device".into()
    } else {
        CudaError::driver(call, error).to_string()
    }
}

fn probe_driver(ordinal: usize) -> Result<Arc<CudaContext>, String> {
    result::init().map_err(|e| status("cuInit", e))?;
    let mut version = 0;
    // SAFETY: the driver library is loaded (checked by the caller) and
    // initialized; cuDriverGetVersion writes one int through a valid pointer.
    unsafe { sys::cuDriverGetVersion(&mut version) }.result().map_err(|e| status("cuDriverGetVersion", e))?;
    if version < MIN_DRIVER_VERSION {
        return Err(format!(
            "the NVIDIA driver supports CUDA {}.{}, but kvjit's PTX (ISA 9.0) needs CUDA 13.0 (driver 580 or newer)",
            version / 1000,
            version % 1000 / 10
        ));
    }
    let count = CudaContext::device_count().map_err(|e| status("cuDeviceGetCount", e))?;
    if count <= 0 {
        return Err("no CUDA device".into());
    }
    if ordinal >= count as usize {
        return Err(format!("CUDA device {ordinal} does not exist (this machine has {count})"));
    }
    let ctx =
        CudaContext::new(ordinal).map_err(|e| status(&format!("creating a context on CUDA device {ordinal}"), e))?;
    let (major, minor) = ctx.compute_capability().map_err(|e| status("cuDeviceGetAttribute", e))?;
    if (major, minor) < MIN_COMPUTE_CAPABILITY {
        let name = ctx.name().unwrap_or_else(|_| "unnamed".into());
        return Err(format!(
            "CUDA device {ordinal} ({name}) has compute capability {major}.{minor}; kvjit's CUDA kernels need {}.{} or newer",
            MIN_COMPUTE_CAPABILITY.0, MIN_COMPUTE_CAPABILITY.1
        ));
    }
    Ok(ctx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without a driver (CI, the dev containers) the probe must
    /// say so instead of panicking; with a GPU it must succeed.
    #[test]
    fn availability_is_a_reason_or_ok_never_a_panic() {
        match availability() {
            Ok(()) => eprintln!("CUDA available"),
            Err(CudaError::Unavailable(reason)) => {
                assert!(!reason.is_empty());
                // SAFETY: as in `probe`: only tries to open the library.
                if !unsafe { sys::is_culib_present() } {
                    assert_eq!(reason, "libcuda.so not found (no NVIDIA driver is installed)");
                }
            }
            Err(other) => panic!("availability must report Unavailable, got {other:?}"),
        }
        // Probing again gives the same answer (it is cached).
        assert_eq!(availability().is_ok(), availability().is_ok());
    }
}
