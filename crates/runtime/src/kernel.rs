//! The kernel interface every target implements.

use std::sync::Arc;

use kvjit_core::{DType, KernelKey, PagedKVCacheCollection, PreparedConstant, Tensor};

use crate::{DeviceContextPtr, Result};

/// Dtype and shape of one kernel output for a given call.
pub type OutputSpec = (DType, Vec<usize>);

/// Which implementation of an op to build.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KernelImpl {
    /// The target's fast kernel (on the CPU: JIT-compiled machine code).
    #[default]
    Fast,
    /// The plain reference implementation (CPU only), for checking results.
    Reference,
}

/// How to build kernels.
#[derive(Clone, Copy, Debug, Default)]
pub struct BuildOptions {
    /// Which implementation.
    pub implementation: KernelImpl,
    /// Keep the generated IR text (`kvjit inspect --dump-clif`).
    pub keep_ir: bool,
    /// Keep the disassembled machine code (`kvjit inspect --disasm`).
    pub keep_disasm: bool,
    /// When a kernel's key leaves dims symbolic, compile a kernel specialized
    /// for each shape it sees at run time (up to a few per kernel) instead of
    /// always running the generic one.
    pub specialize_shapes: bool,
    /// Which CPU code tier JIT kernels run on (`Auto`: the widest the CPU
    /// runs). Ops without a 256-bit tier ignore it.
    pub cpu_tier: kvjit_core::CpuTier,
}

/// What a compiled kernel can say about its code.
#[derive(Clone, Debug, Default)]
pub struct CodeInfo {
    /// How long compiling took (zero for kernels that need no compile).
    pub compile_time: std::time::Duration,
    /// Machine-code bytes.
    pub code_size: usize,
    /// Generated IR, if kept.
    pub ir: Option<String>,
    /// Disassembly, if kept.
    pub disasm: Option<String>,
}

/// A compiled kernel for one [`KernelKey`].
///
/// `check` and `run` both validate every argument; `run` must not write a
/// byte of any output or cache when validation fails, whoever calls it.
pub trait Kernel: Send + Sync {
    /// The key this kernel was built for (its canonical name).
    fn key(&self) -> &KernelKey;

    /// Which implementation this is, in a word (`jit`, `reference`, …).
    fn implementation(&self) -> &'static str;

    /// What the kernel knows about its generated code (nothing, by default).
    fn code_info(&self) -> CodeInfo {
        CodeInfo::default()
    }

    /// Validate a call's inputs and caches and give the output shapes,
    /// writing nothing.
    fn check(&self, inputs: &[&Tensor], caches: &[&PagedKVCacheCollection]) -> kvjit_core::Result<Vec<OutputSpec>>;

    /// Whether this "kernel" computes nothing: its one output is its first
    /// tensor input seen with the shape [`check`](Self::check) gives (a
    /// reshape). The executor then hands consumers a view sharing the
    /// producer's storage — no copy, and [`run`](Self::run) is not called.
    fn is_view(&self) -> bool {
        false
    }

    /// Constant inputs this kernel keeps in its own layout, by input index
    /// (a JIT kernel's packed weight panels). A compiled artifact stores
    /// these instead of the plain data; the kernel accepts the prepared
    /// tensor itself as that input's argument. Default: none.
    fn prepared_constants(&self) -> Vec<(usize, PreparedConstant)> {
        Vec::new()
    }

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

/// A graph constant as a kernel builder gets it.
#[derive(Clone, Debug)]
pub enum ConstantInput {
    /// The constant's data, in the graph's layout.
    Plain(Arc<Tensor>),
    /// Data a kernel prepared earlier in its own layout (from a compiled
    /// artifact). A builder that cannot take this layout ignores it; the
    /// compile step then refuses the graph.
    Prepared(PreparedConstant),
}

impl ConstantInput {
    /// The plain data, if that is what this is.
    pub fn plain(&self) -> Option<&Arc<Tensor>> {
        match self {
            ConstantInput::Plain(data) => Some(data),
            ConstantInput::Prepared(_) => None,
        }
    }

    /// The prepared data, if that is what this is.
    pub fn prepared(&self) -> Option<&PreparedConstant> {
        match self {
            ConstantInput::Prepared(prepared) => Some(prepared),
            ConstantInput::Plain(_) => None,
        }
    }
}

/// Builds kernels for an op: one implementation per op, covering its targets.
pub trait KernelBuilder: Send + Sync {
    /// Build (or fetch) the kernel for `key`. `constants[i]` holds input `i`'s
    /// data when that input is a graph constant, so kernels can prepare it
    /// (e.g. pack weights) once, at build time — or take it already
    /// prepared ([`ConstantInput::Prepared`]).
    fn build(
        &self,
        key: &KernelKey,
        constants: &[Option<ConstantInput>],
        options: &BuildOptions,
    ) -> Result<Arc<dyn Kernel>>;
}
