//! `mo.silu`: `y = x · sigmoid(x) = x / (1 + e^−x)`, elementwise, on a
//! tensor `x` of any rank (f32, bf16 or f16; dims may be symbolic); the
//! output has `x`'s dtype and shape. At the ends it takes its limits:
//! `silu(−∞) = −0`, `silu(+∞) = +∞`; NaN stays NaN. The JIT, in f32, is
//! within 1 ulp of the reference for x ≥ 0 and 3 for x < 0 (f32); bf16 and
//! f16 within one step (0 of the 65536 bf16 inputs differ, 3 f16 ones).
//!
//! The op platform's worked example (the README's "Adding an op"): this file
//! declares the parameters, the op ([`SiluOp`]) and its spec with the call
//! contract both kernels share ([`SiluSpec`]); [`reference`](mod@reference)
//! computes in f64 and rounds once; [`JitKernel`] runs Cranelift code
//! (the platform's elementwise map around `emit.rs`'s vector arithmetic)
//! over the worker pool. No CUDA variant yet.

mod cpu_jit;
mod emit;
pub mod reference;

use kvjit_core::{Backend, DType, KernelKey, KernelSpec, KeyField, PagedKVCacheCollection, Result, Target, Tensor};
use kvjit_graph::{ArgSpec, GraphBuilder, GraphError, ValueId, ValueType};
use kvjit_op::{Call, CallContract, Op, Specialized, TensorArg, add_node, elementwise};
use kvjit_runtime::OutputSpec;

pub use cpu_jit::JitKernel;
pub use kvjit_op::elementwise::ELEMENTS_PER_ITEM;
pub use reference::ReferenceKernel;

kvjit_op::params! {
    /// The parameters of a `mo.silu` node: none (the dtype is `x`'s).
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct SiluParams {}
}

/// The `mo.silu` op: input `x` (any shape), output `output` (its dtype and
/// shape). Register it as `registry.register(kvjit_op::Defined(SiluOp))`.
#[derive(Clone, Copy, Debug, Default)]
pub struct SiluOp;

/// Add a `mo.silu` node to `b`; returns its output.
pub fn silu(b: &mut GraphBuilder<'_>, x: ValueId) -> Result<ValueId, GraphError> {
    Ok(add_node::<SiluOp, 1>(b, &SiluParams {}, [x])?[0])
}

impl Op for SiluOp {
    const NAME: &'static str = "mo.silu";
    const INPUTS: &'static [ArgSpec] = &[ArgSpec::tensor("x")];
    type Params = SiluParams;
    type Spec = SiluSpec;
    type Cpu = JitKernel;

    fn specialize(&self, _: &SiluParams, inputs: &[&ValueType], backend: Backend) -> Specialized<SiluSpec> {
        let (_, dtype, elements) = elementwise::float_input(inputs, 0, "x")?;
        Ok(SiluSpec { target: backend.target(), dtype, elements })
    }
}

/// Everything a `mo.silu` kernel bakes in: target, dtype, and the element
/// count when every dim of `x` is static (`None`: taken from each call).
/// The shape itself is not baked in: any `x` of that many elements is one
/// flat run of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SiluSpec {
    /// Target.
    pub target: Target,
    /// Dtype of `x` and the output.
    pub dtype: DType,
    /// Elements of `x`, if static.
    pub elements: Option<usize>,
}

impl KernelSpec for SiluSpec {
    /// `silu.cpu.bf16.n4096`, `silu.cpu.f32.nany`. No CPU tier: both tiers
    /// run the same Cranelift code.
    fn key_name(&self) -> KernelKey {
        KernelKey::new("silu", self.target, self.dtype).with("n", KeyField::dim(self.elements))
    }
}

impl CallContract for SiluSpec {
    /// The shape of `x` (and of the output).
    type Checked = Vec<usize>;
    const TENSORS: &'static [TensorArg] = &[TensorArg::compute("x")];

    /// `x` holds the baked element count, if there is one.
    fn check(&self, tensors: &[&Tensor], _caches: &[&PagedKVCacheCollection]) -> Result<Vec<usize>> {
        elementwise::expect_elements("x", tensors[0], self.elements, self)?;
        Ok(tensors[0].shape().to_vec())
    }

    fn outputs(&self, shape: &Vec<usize>) -> Vec<OutputSpec> {
        vec![(self.dtype, shape.clone())]
    }

    /// [`reference::silu`] of every element in f64, rounded once.
    fn reference(&self, _: Vec<usize>, call: Call<'_, '_>) -> Result<()> {
        let [x] = call.tensors();
        let y: Vec<f64> = x.to_f32_vec()?.into_iter().map(|v| reference::silu(f64::from(v))).collect();
        kvjit_op::store_f64(&mut call.outputs[0], &y)
    }
}
