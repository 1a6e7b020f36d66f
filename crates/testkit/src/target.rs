//! Where a check runs: the CPU JIT kernels, the CPU reference kernels, and
//! CUDA when this machine has a device.
//!
//! [`targets`] lists them; without a CUDA device it prints one line,
//! `skipped: no CUDA device (<reason>)`, and lists the CPU ones. With
//! `KVJIT_REQUIRE_CUDA=1` (scripts/gpu-check.sh) a missing device is a
//! panic instead, so no CUDA check can skip on a GPU machine unnoticed.

use std::fmt;

use kvjit_runtime::{BuildOptions, DeviceContextPtr, KernelImpl};

/// The environment variable that makes a missing CUDA device a failure.
pub const REQUIRE_CUDA: &str = "KVJIT_REQUIRE_CUDA";

/// Worker threads of the CPU contexts [`targets`] starts.
pub const CPU_THREADS: usize = 2;

/// A kernel implementation on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// The CPU's fast kernels (JIT-compiled machine code).
    CpuJit,
    /// The plain reference kernels, on the CPU.
    CpuReference,
    /// The CUDA kernels, on device 0.
    Cuda,
}

impl Target {
    /// All of them, in the order [`targets`] lists them.
    pub const ALL: [Target; 3] = [Target::CpuJit, Target::CpuReference, Target::Cuda];

    /// Its name in messages: `cpu jit`, `cpu reference`, `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            Target::CpuJit => "cpu jit",
            Target::CpuReference => "cpu reference",
            Target::Cuda => "cuda",
        }
    }

    /// The device it runs on.
    pub fn device(self) -> kvjit_core::Target {
        match self {
            Target::CpuJit | Target::CpuReference => kvjit_core::Target::Cpu,
            Target::Cuda => kvjit_core::Target::Cuda,
        }
    }

    /// Which implementation it builds.
    pub fn implementation(self) -> KernelImpl {
        match self {
            Target::CpuReference => KernelImpl::Reference,
            Target::CpuJit | Target::Cuda => KernelImpl::Fast,
        }
    }

    /// Build options for it (nothing kept, no shape specialization).
    pub fn build_options(self) -> BuildOptions {
        BuildOptions { implementation: self.implementation(), ..BuildOptions::default() }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A target with a context to run on.
#[derive(Clone)]
pub struct OnTarget {
    /// The target.
    pub target: Target,
    /// A context on its device (CPU contexts have [`CPU_THREADS`] workers).
    pub ctx: DeviceContextPtr,
}

impl OnTarget {
    /// The target's name.
    pub fn name(&self) -> &'static str {
        self.target.name()
    }
}

impl fmt::Debug for OnTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OnTarget").field("target", &self.target).finish_non_exhaustive()
    }
}

/// Whether `KVJIT_REQUIRE_CUDA=1` is set.
pub fn cuda_required() -> bool {
    std::env::var_os(REQUIRE_CUDA).is_some_and(|v| v == "1")
}

/// A context on CUDA device 0, or `None` after printing `skipped: no CUDA
/// device (<reason>)`.
///
/// # Panics
///
/// Without a device when `KVJIT_REQUIRE_CUDA=1`.
pub fn cuda_or_skip() -> Option<DeviceContextPtr> {
    match kvjit_runtime::cuda_availability().and_then(|()| DeviceContextPtr::cuda(0)) {
        Ok(ctx) => Some(ctx),
        Err(e) if cuda_required() => panic!("{REQUIRE_CUDA}=1 but {e}"),
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

/// CPU JIT and CPU reference (fresh contexts of [`CPU_THREADS`] workers
/// each), then CUDA when a device exists — otherwise one line `skipped: no
/// CUDA device (<reason>)` is printed.
///
/// # Panics
///
/// Without a CUDA device when `KVJIT_REQUIRE_CUDA=1`, or if a CPU context
/// cannot start.
pub fn targets() -> Vec<OnTarget> {
    let cpu = |target| OnTarget { target, ctx: DeviceContextPtr::cpu(CPU_THREADS).expect("a CPU context starts") };
    let mut list = vec![cpu(Target::CpuJit), cpu(Target::CpuReference)];
    if let Some(ctx) = cuda_or_skip() {
        list.push(OnTarget { target: Target::Cuda, ctx });
    }
    list
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_targets_are_always_listed_first() {
        let listed: Vec<Target> = targets().iter().map(|t| t.target).collect();
        assert_eq!(listed[..2], [Target::CpuJit, Target::CpuReference]);
        assert!(listed.len() == 2 || listed[2] == Target::Cuda);
        for t in targets() {
            assert_eq!(t.ctx.target(), t.target.device(), "{}", t.name());
        }
        assert_eq!(Target::CpuReference.build_options().implementation, KernelImpl::Reference);
    }
}
