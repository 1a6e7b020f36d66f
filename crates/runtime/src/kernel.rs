//! The kernel interface every target implements.

use std::sync::Arc;

use kvjit_core::{DType, KernelKey, PagedKVCacheCollection, Tensor};

use crate::{DeviceContextPtr, Result};

/// Dtype and shape of one kernel output for a given call.
pub type OutputSpec = (DType, Vec<usize>);

/// A compiled kernel for one [`KernelKey`].
///
/// `check` and `run` both validate every argument; `run` must not write a
/// byte of any output or cache when validation fails, whoever calls it.
pub trait Kernel: Send + Sync {
    /// The key this kernel was built for (its canonical name).
    fn key(&self) -> &KernelKey;

    /// Validate a call's inputs and caches and give the output shapes,
    /// writing nothing.
    fn check(&self, inputs: &[&Tensor], caches: &[&PagedKVCacheCollection]) -> kvjit_core::Result<Vec<OutputSpec>>;

    /// Run the kernel: read `inputs`, write `outputs` (allocated to the shapes
    /// `check` gave) and the caches.
    fn run(
        &self,
        inputs: &[&Tensor],
        caches: &mut [&mut PagedKVCacheCollection],
        outputs: &mut [Tensor],
        ctx: &DeviceContextPtr,
    ) -> kvjit_core::Result<()>;
}

/// Builds kernels for an op: one implementation per op, covering its targets.
pub trait KernelBuilder: Send + Sync {
    /// Build (or fetch) the kernel for `key`. `constants[i]` holds input `i`'s
    /// data when that input is a graph constant, so kernels can prepare it
    /// (e.g. pack weights) once, at build time.
    fn build(&self, key: &KernelKey, constants: &[Option<Arc<Tensor>>]) -> Result<Arc<dyn Kernel>>;
}
