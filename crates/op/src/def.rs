//! [`Op`]: what an op declares about itself, and [`Defined`], the one
//! adapter that makes every such op a graph [`OpDef`] and a runtime
//! [`KernelBuilder`].
//!
//! The typed spec is the currency: [`Op::specialize`] makes it from the
//! node's typed parameters and input types, the key carries it
//! ([`KernelKey::of`]), and the builder takes it back
//! ([`KernelKey::spec`]) — no key is parsed back from its name.

use std::sync::Arc;

use kvjit_core::{Backend, CodeTier, KernelKey, KernelSpec, Target};
use kvjit_graph::{ArgSpec, GraphError, OpDef, ParamSpec, Params, RecipeKind, TensorType, ValueType};
use kvjit_jit::CaptureText;
use kvjit_runtime::{BuildOptions, ConstantInput, Kernel, KernelBuilder, KernelImpl, RuntimeError};

use crate::OpParams;

/// An op, declared once: its names, parameters, signature, spec, shape
/// rules and the kernels it builds per target. Wrap it in [`Defined`] to
/// register it.
pub trait Op: Send + Sync + 'static {
    /// Canonical name, as graph files write it.
    const NAME: &'static str;
    /// Other names the op answers to.
    const ALIASES: &'static [&'static str] = &[];
    /// Input signature, in order.
    const INPUTS: &'static [ArgSpec];
    /// Output names, in order.
    const OUTPUTS: &'static [&'static str] = &["output"];
    /// The node parameters ([`params!`](crate::params)).
    type Params: OpParams;
    /// Everything a kernel of the op bakes in, and how its calls are
    /// checked and run by the reference.
    type Spec: crate::CallContract;
    /// The op's fast CPU kernel (its JIT kernel, or a view), which the
    /// default [`supports_cpu`](Self::supports_cpu) and
    /// [`build_cpu`](Self::build_cpu) ask.
    type Cpu: CpuKernel<Spec = Self::Spec>;

    /// Check a node's parameters and input types (their kinds already
    /// checked against [`INPUTS`](Self::INPUTS)) and make the spec of its
    /// kernel on `backend`.
    fn specialize(&self, params: &Self::Params, inputs: &[&ValueType], backend: Backend) -> Specialized<Self::Spec>;

    /// The output types of a node with this (valid) spec. Default: one
    /// output of the first input's shape in the spec's compute dtype.
    fn infer(&self, spec: &Self::Spec, inputs: &[&ValueType]) -> Vec<TensorType> {
        vec![TensorType::new(spec.key_name().dtype(), kvjit_graph::tensor_input(inputs, 0).shape.clone())]
    }

    /// Whether the CPU kernels serve `spec` (`Err(reason)`: sizes past
    /// what the generated code handles). Default: what the fast CPU kernel
    /// says ([`CpuKernel::supported`]).
    fn supports_cpu(&self, spec: &Self::Spec) -> Result<(), String> {
        Self::Cpu::supported(spec).map_err(|e| e.to_string())
    }

    /// Whether a CUDA kernel serves `spec`. Default: none does.
    fn supports_cuda(&self, spec: &Self::Spec) -> Result<(), String> {
        let _ = spec;
        Err(format!("no CUDA variant for op {} yet", Self::NAME))
    }

    /// The reference kernel (CPU), for checking results. Default: the
    /// spec's [`reference`](crate::CallContract::reference) as a kernel.
    fn build_reference(&self, spec: &Self::Spec) -> Built {
        built(crate::Reference(spec.clone()))
    }

    /// The fast CPU kernel (JIT-compiled); `constants[i]` holds input `i`'s
    /// data when it is a graph constant. Default: [`CpuKernel::build`].
    fn build_cpu(&self, spec: &Self::Spec, constants: &Constants, build: &CpuBuild) -> Built {
        built(
            Self::Cpu::build(spec, constants, build)
                .map_err(|e| RuntimeError::Compile { key: spec.key().to_string(), source: e })?,
        )
    }

    /// The CUDA kernel. Default: refused like [`supports_cuda`](Self::supports_cuda).
    fn build_cuda(&self, spec: &Self::Spec, constants: &Constants) -> Built {
        let _ = constants;
        let reason = self.supports_cuda(spec).err().unwrap_or_else(|| format!("no CUDA variant for op {}", Self::NAME));
        Err(RuntimeError::NoImplementation { key: spec.key().to_string(), reason })
    }

    /// Inputs whose constant data the fast CPU kernel keeps a packed copy of.
    fn packed_constant_inputs(&self) -> &'static [usize] {
        &[]
    }

    /// The constant recipes the op brings.
    fn recipes(&self) -> &'static [RecipeKind] {
        &[]
    }

    /// Whether the op is a view (no kernel runs).
    fn is_view(&self) -> bool {
        false
    }
}

/// An op's fast CPU kernel as its [`Op`] builds it: what it serves, and
/// how it is made from a spec (and the graph's constants).
pub trait CpuKernel: crate::OpKernel + Sized {
    /// Whether the kernel serves `spec`: sizes past what its code handles
    /// are refused at specialize with this reason. Default: every spec.
    fn supported(spec: &Self::Spec) -> Result<(), kvjit_jit::JitError> {
        let _ = spec;
        Ok(())
    }

    /// Compile (or fetch from the process-wide registry) the kernel for
    /// `spec`; `constants[i]` holds input `i`'s data when it is a graph
    /// constant.
    fn build(spec: &Self::Spec, constants: &Constants, build: &CpuBuild) -> Result<Self, BoxError>;
}

/// Any error, boxed (what a [`CpuKernel`] may fail with).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How to build a fast CPU kernel: what to keep of its code, and whether to
/// specialize generic kernels for the shapes they see.
#[derive(Clone, Copy, Debug)]
pub struct CpuBuild {
    /// IR / disassembly to keep.
    pub capture: CaptureText,
    /// Compile a kernel per seen shape for dims left symbolic.
    pub specialize_shapes: bool,
}

/// An [`Op`] as the graph and the runtime see it: implements [`OpDef`] and
/// [`KernelBuilder`] once for every op. The registry line of an op is
/// `registry.register(Defined(MyOp))`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Defined<O>(pub O);

impl<O: Op> Defined<O> {
    fn spec(&self, params: &Params, inputs: &[&ValueType], backend: Backend) -> Result<O::Spec, GraphError> {
        self.0.specialize(&O::Params::read(params)?, inputs, backend)
    }
}

/// The spec a key holds, or the error saying whose key it is not.
pub fn spec_of<'k, S: KernelSpec>(key: &'k KernelKey, op: &str) -> Result<&'k S, String> {
    key.spec::<S>().ok_or_else(|| format!("{key} is not a key op {op} made"))
}

impl<O: Op> OpDef for Defined<O> {
    fn name(&self) -> &'static str {
        O::NAME
    }

    fn aliases(&self) -> &'static [&'static str] {
        O::ALIASES
    }

    fn params(&self) -> &'static [ParamSpec] {
        O::Params::SPECS
    }

    fn inputs(&self) -> &'static [ArgSpec] {
        O::INPUTS
    }

    fn outputs(&self) -> &'static [&'static str] {
        O::OUTPUTS
    }

    /// Types do not depend on the backend: inferred from the spec for the
    /// plain CPU tier.
    fn infer(&self, params: &Params, inputs: &[&ValueType]) -> Result<Vec<TensorType>, GraphError> {
        let spec = self.spec(params, inputs, Backend::Cpu(CodeTier::Cranelift))?;
        Ok(self.0.infer(&spec, inputs))
    }

    fn kernel_key(&self, params: &Params, inputs: &[&ValueType], backend: Backend) -> Result<KernelKey, GraphError> {
        Ok(self.spec(params, inputs, backend)?.key())
    }

    fn supports(&self, key: &KernelKey) -> Result<(), String> {
        let spec = spec_of::<O::Spec>(key, O::NAME)?;
        match key.target() {
            Target::Cpu => self.0.supports_cpu(spec),
            Target::Cuda => self.0.supports_cuda(spec),
        }
    }

    fn packed_constant_inputs(&self) -> &'static [usize] {
        self.0.packed_constant_inputs()
    }

    fn is_view(&self) -> bool {
        self.0.is_view()
    }

    fn recipes(&self) -> &'static [RecipeKind] {
        self.0.recipes()
    }
}

impl<O: Op> KernelBuilder for Defined<O> {
    fn build(
        &self,
        key: &KernelKey,
        constants: &[Option<ConstantInput>],
        options: &BuildOptions,
    ) -> kvjit_runtime::Result<Arc<dyn Kernel>> {
        let spec = spec_of::<O::Spec>(key, O::NAME).map_err(RuntimeError::Plan)?;
        match (key.target(), options.implementation) {
            (Target::Cpu, KernelImpl::Reference) => self.0.build_reference(spec),
            (Target::Cpu, KernelImpl::Fast) => {
                let capture = CaptureText { clif: options.keep_ir, disasm: options.keep_disasm };
                self.0.build_cpu(spec, constants, &CpuBuild { capture, specialize_shapes: options.specialize_shapes })
            }
            (Target::Cuda, KernelImpl::Reference) => Err(RuntimeError::NoImplementation {
                key: key.to_string(),
                reason: "the reference implementation runs on the CPU only (use the CPU target to check results)"
                    .into(),
            }),
            (Target::Cuda, KernelImpl::Fast) => self.0.build_cuda(spec, constants),
        }
    }
}

/// What specializing a node gives: its kernel's spec, or why the node is
/// refused.
pub type Specialized<S> = Result<S, GraphError>;

/// What building a kernel gives: the kernel, ready for the runtime.
pub type Built = Result<Arc<dyn Kernel>, RuntimeError>;

/// The graph constants a kernel builder gets: `constants[i]` holds input
/// `i`'s data when it is a graph constant.
pub type Constants = [Option<ConstantInput>];

/// `kernel` behind the runtime's interface ([`Compiled`](crate::Compiled)).
pub fn built<K: crate::OpKernel>(kernel: K) -> Built {
    Ok(Arc::new(crate::Compiled::new(kernel)))
}

/// Add a node of op `O` to `b` with typed parameters: the typed form of
/// `b.node(O::NAME, params.to_params(), inputs)`, which every op's builder
/// function (`fused_qk_rope`, `mha`, …) is.
pub fn add_node<O: Op, const N: usize>(
    b: &mut kvjit_graph::GraphBuilder<'_>,
    params: &O::Params,
    inputs: [kvjit_graph::ValueId; N],
) -> Result<Vec<kvjit_graph::ValueId>, GraphError> {
    b.node(O::NAME, params.to_params(), &inputs)
}

/// [`RuntimeError::Compile`] for a kernel of `spec` whose code could not be
/// generated.
pub fn compile_error(spec: &impl KernelSpec, error: impl std::error::Error + Send + Sync + 'static) -> RuntimeError {
    RuntimeError::Compile { key: spec.key().to_string(), source: Box::new(error) }
}
