//! `mo.add` and `mo.mul`: `a + b` and `a · b`, elementwise, on two tensors
//! `a` and `b` of one type (f32, bf16 or f16, any rank, the same dims —
//! symbolic ones by name); the output has their dtype and shape. Computed
//! in f32 and rounded once to the dtype, which is the correctly rounded
//! result in every dtype (f32 carries more than twice the bits of bf16 and
//! f16, plus two), so the JIT equals the reference bit for bit.
//!
//! The two ops share everything but their names: one spec
//! ([`BinarySpec`], whose [`BinaryOperation`] says which), one call
//! contract, one [`reference`](mod@reference) (f64, rounded once) and one
//! [`JitKernel`] (the platform's elementwise map around one `fadd` or
//! `fmul` per vector). No CUDA variant yet.

mod cpu_jit;
pub mod reference;

use kvjit_core::{Backend, DType, KernelKey, KernelSpec, KeyField, PagedKVCacheCollection, Result, Target, Tensor};
use kvjit_graph::{ArgSpec, GraphBuilder, GraphError, ValueId, ValueType};
use kvjit_op::{Call, CallContract, Op, Specialized, TensorArg, add_node, elementwise};
use kvjit_runtime::OutputSpec;

pub use cpu_jit::JitKernel;
pub use kvjit_op::elementwise::ELEMENTS_PER_ITEM;
pub use reference::ReferenceKernel;

kvjit_op::params! {
    /// The parameters of a `mo.add` or `mo.mul` node: none (the dtype is
    /// the operands').
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct BinaryParams {}
}

/// Which elementwise operation a kernel computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOperation {
    /// `a + b` (`mo.add`).
    Add,
    /// `a · b` (`mo.mul`).
    Mul,
}

impl BinaryOperation {
    /// The operation's name in kernel keys: `add`, `mul`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Add => "add",
            Self::Mul => "mul",
        }
    }

    /// The operation on two f64s (the reference's arithmetic).
    pub fn apply(self, a: f64, b: f64) -> f64 {
        match self {
            Self::Add => a + b,
            Self::Mul => a * b,
        }
    }
}

/// The `mo.add` op: inputs `a`, `b` (one type), output `a + b`. Register it
/// as `registry.register(kvjit_op::Defined(AddOp))`.
#[derive(Clone, Copy, Debug, Default)]
pub struct AddOp;

/// The `mo.mul` op: inputs `a`, `b` (one type), output `a · b`. Register it
/// as `registry.register(kvjit_op::Defined(MulOp))`.
#[derive(Clone, Copy, Debug, Default)]
pub struct MulOp;

/// Add a `mo.add` node `a + b` to `builder`; returns its output.
pub fn add(builder: &mut GraphBuilder<'_>, a: ValueId, b: ValueId) -> Result<ValueId, GraphError> {
    Ok(add_node::<AddOp, 2>(builder, &BinaryParams {}, [a, b])?[0])
}

/// Add a `mo.mul` node `a · b` to `builder`; returns its output.
pub fn mul(builder: &mut GraphBuilder<'_>, a: ValueId, b: ValueId) -> Result<ValueId, GraphError> {
    Ok(add_node::<MulOp, 2>(builder, &BinaryParams {}, [a, b])?[0])
}

/// The inputs of both ops.
const INPUTS: &[ArgSpec] = &[ArgSpec::tensor("a"), ArgSpec::tensor("b")];

/// Both ops' check of a node: `a` a float tensor of any shape, `b` of
/// exactly its type.
fn specialize(operation: BinaryOperation, inputs: &[&ValueType], backend: Backend) -> Specialized<BinarySpec> {
    let (a, dtype, elements) = elementwise::float_input(inputs, 0, "a")?;
    elementwise::same_type_input(inputs, 1, "b", a, "a")?;
    Ok(BinarySpec { target: backend.target(), operation, dtype, elements })
}

impl Op for AddOp {
    const NAME: &'static str = "mo.add";
    const INPUTS: &'static [ArgSpec] = INPUTS;
    type Params = BinaryParams;
    type Spec = BinarySpec;
    type Cpu = JitKernel;

    fn specialize(&self, _: &BinaryParams, inputs: &[&ValueType], backend: Backend) -> Specialized<BinarySpec> {
        specialize(BinaryOperation::Add, inputs, backend)
    }
}

impl Op for MulOp {
    const NAME: &'static str = "mo.mul";
    const INPUTS: &'static [ArgSpec] = INPUTS;
    type Params = BinaryParams;
    type Spec = BinarySpec;
    type Cpu = JitKernel;

    fn specialize(&self, _: &BinaryParams, inputs: &[&ValueType], backend: Backend) -> Specialized<BinarySpec> {
        specialize(BinaryOperation::Mul, inputs, backend)
    }
}

/// Everything a `mo.add` or `mo.mul` kernel bakes in: target, operation,
/// dtype, and the element count when every dim is static (`None`: taken
/// from each call). The shape itself is not baked in: any `a` and `b` of
/// one shape of that many elements are one flat run of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BinarySpec {
    /// Target.
    pub target: Target,
    /// What the kernel computes.
    pub operation: BinaryOperation,
    /// Dtype of `a`, `b` and the output.
    pub dtype: DType,
    /// Elements of `a` (and `b`), if static.
    pub elements: Option<usize>,
}

impl KernelSpec for BinarySpec {
    /// `add.cpu.bf16.n4096`, `mul.cpu.f32.nany`. No CPU tier: both tiers
    /// run the same Cranelift code.
    fn key_name(&self) -> KernelKey {
        KernelKey::new(self.operation.name(), self.target, self.dtype).with("n", KeyField::dim(self.elements))
    }
}

impl CallContract for BinarySpec {
    /// The shape of `a` (and of `b` and the output).
    type Checked = Vec<usize>;
    const TENSORS: &'static [TensorArg] = &[TensorArg::compute("a"), TensorArg::compute("b")];

    /// `a` holds the baked element count, if there is one, and `b` has
    /// `a`'s shape.
    fn check(&self, tensors: &[&Tensor], _caches: &[&PagedKVCacheCollection]) -> Result<Vec<usize>> {
        let [a, b] = [tensors[0], tensors[1]];
        elementwise::expect_elements("a", a, self.elements, self)?;
        elementwise::expect_same_shape("b", b, "a", a)?;
        Ok(a.shape().to_vec())
    }

    fn outputs(&self, shape: &Vec<usize>) -> Vec<OutputSpec> {
        vec![(self.dtype, shape.clone())]
    }

    /// The operation on every pair of elements in f64, rounded once.
    fn reference(&self, _: Vec<usize>, call: Call<'_, '_>) -> Result<()> {
        let [a, b] = call.tensors();
        let y = reference::apply(self.operation, &a.to_f32_vec()?, &b.to_f32_vec()?);
        kvjit_op::store_f64(&mut call.outputs[0], &y)
    }
}
