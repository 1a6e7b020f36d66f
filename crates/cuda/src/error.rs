//! The CUDA error enum: every failed driver call becomes one of these, named
//! after the call that failed.

use cudarc::driver::DriverError;

/// Result alias for this crate.
pub type Result<T, E = CudaError> = std::result::Result<T, E>;

/// What can go wrong using CUDA.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// CUDA cannot be used on this machine (no driver, no device, a driver
    /// too old for kvjit's PTX, ...). The text is the reason, e.g.
    /// `libcuda.so not found (no NVIDIA driver is installed)`.
    #[error("{0}")]
    Unavailable(String),
    /// A driver call returned an error status.
    #[error("{call} failed: {name}: {description}")]
    Driver {
        /// The driver call (or the operation, when cudarc makes several).
        call: String,
        /// The status's name, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
        name: String,
        /// The driver's description of the status.
        description: String,
        /// The raw `CUresult` value.
        code: u32,
    },
    /// A buffer too small for what was asked of it (a caller bug caught
    /// before the driver is called).
    #[error("{what}: needs {needed} bytes, the buffer has {available}")]
    BufferTooSmall {
        /// The operation.
        what: String,
        /// Bytes needed.
        needed: usize,
        /// Bytes the buffer has.
        available: usize,
    },
    /// No PTX image of a module can run on the device.
    #[error("module '{module}' has PTX for {have}, none of which runs on compute capability {major}.{minor}")]
    NoPtxForDevice {
        /// The module.
        module: String,
        /// The PTX targets it ships, e.g. `compute_80, compute_90`.
        have: String,
        /// Device compute capability, major.
        major: i32,
        /// Device compute capability, minor.
        minor: i32,
    },
}

impl CudaError {
    /// The error of a failed driver call.
    pub fn driver(call: impl Into<String>, error: DriverError) -> Self {
        let name = error
            .error_name()
            .map_or_else(|_| format!("CUresult {}", error.0 as u32), |n| n.to_string_lossy().into_owned());
        let description =
            error.error_string().map_or_else(|_| "no description".to_string(), |d| d.to_string_lossy().into_owned());
        CudaError::Driver { call: call.into(), name, description, code: error.0 as u32 }
    }

    /// Whether this is a driver error with the given status name.
    pub fn is_status(&self, status: &str) -> bool {
        matches!(self, CudaError::Driver { name, .. } if name == status)
    }
}
