//! `mo.matmul`: `a` `[..., K]` times a constant weight `b` — `[N, K]` with
//! `transpose_b = true` (`a·bᵀ`, how checkpoints store a linear layer),
//! `[K, N]` otherwise (`a·b`) — giving `[..., N]` in `a`'s dtype (f32, bf16
//! or f16; `b` of the same dtype, or `[N, K]` in a weight block format —
//! Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and kvjit's q8_min — kept quantized and decoded as the kernel
//! reads it). Computed in f32, rounded once.
//!
//! Its kernel is the platform's GEMM driver ([`kvjit_op::gemm`]: the
//! weight packed once into panels at build, the tiers' schedules and
//! micro-kernels, one code path with the fused QKV op) with a plain-store
//! epilogue. The compiler fuses what reads a matmul's result into that
//! epilogue (`kvjit::compile`), as nodes of the internal ops here, which a
//! graph file may also spell:
//!
//! | op | inputs | computes |
//! |---|---|---|
//! | `kvjit.matmul_silu` | `a`, `b` | `silu(a·b)` |
//! | `kvjit.matmul_epilogue` | `a`, `b`, `other` | `a·b + other`, `(a·b)·other` or `silu(a·b)·other` (`epilogue`: `add`, `mul`, `silu_mul`) |
//! | `kvjit.swiglu_matmul` | `a`, `gate`, `up` | `silu(a·gate)·(a·up)`: one GEMM over both weights |
//!
//! Every fused form computes its whole epilogue in f32 on the GEMM's f32
//! result and rounds once (the unfused graph rounds the matmul's result to
//! the dtype first: the two agree bit for bit in f32 where the arithmetic
//! order is the same, within the dtype's rounding otherwise). No CUDA
//! variant yet.

mod cpu_jit;
mod spec;

use kvjit_core::{Backend, DType, Result};
use kvjit_graph::{ArgSpec, Dim, GraphBuilder, GraphError, TensorType, ValueId, ValueType, input_error, tensor_input};
use kvjit_op::gemm::WeightOrientation;
use kvjit_op::{Choice, Op, Specialized, add_node, rows};

pub use cpu_jit::{JitKernel, ReferenceKernel, layout};
pub use spec::{Epilogue, EpilogueMatmulSpec, MatmulCall, MatmulContract, MatmulSpec, SwigluMatmulSpec};

kvjit_op::params! {
    /// The parameters of a `mo.matmul` node (and of `kvjit.matmul_silu`
    /// and `kvjit.swiglu_matmul`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct MatmulParams {
        /// true: `b` is `[N, K]` and the result `a·bᵀ`; false: `b` is
        /// `[K, N]`, `a·b`.
        transpose_b: bool,
    }
}

kvjit_op::params! {
    /// The parameters of a `kvjit.matmul_epilogue` node.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct EpilogueParams {
        /// As `mo.matmul`'s.
        transpose_b: bool,
        /// What is done with `other`: `add`, `mul` or `silu_mul`.
        epilogue: BinaryEpilogue,
    }
}

/// The epilogues with an operand, as graph files spell them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryEpilogue {
    /// `a·b + other`.
    Add,
    /// `(a·b)·other`.
    Mul,
    /// `silu(a·b)·other`.
    SiluMul,
}

impl Choice for BinaryEpilogue {
    const NAMES: &'static [&'static str] = &["add", "mul", "silu_mul"];

    fn from_name(name: &str) -> Option<Self> {
        match name {
            "add" => Some(Self::Add),
            "mul" => Some(Self::Mul),
            "silu_mul" => Some(Self::SiluMul),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Add => "add",
            Self::Mul => "mul",
            Self::SiluMul => "silu_mul",
        }
    }
}

impl From<BinaryEpilogue> for Epilogue {
    fn from(e: BinaryEpilogue) -> Self {
        match e {
            BinaryEpilogue::Add => Epilogue::Add,
            BinaryEpilogue::Mul => Epilogue::Mul,
            BinaryEpilogue::SiluMul => Epilogue::SiluMul,
        }
    }
}

/// A matmul kernel's own refusal.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MatmulError {
    /// A prepared weight (from a compiled artifact) in another layout,
    /// dtype or size than the kernel packs.
    #[error("the prepared weight is {got}, but this kernel takes {expected}")]
    PreparedWeight {
        /// The layout id, dtype and length the kernel takes.
        expected: String,
        /// What the artifact held.
        got: String,
    },
}

kvjit_op::op_error!(MatmulError, MatmulOp::NAME);

/// The `mo.matmul` op: inputs `a` and `b` (a graph constant), output
/// `a·b` (or `a·bᵀ`). Register it as `registry.register(kvjit_op::Defined(MatmulOp))`.
#[derive(Clone, Copy, Debug, Default)]
pub struct MatmulOp;

/// `kvjit.matmul_silu`: `silu(a·b)` (a `mo.matmul` whose one reader is a
/// `mo.silu`, fused).
#[derive(Clone, Copy, Debug, Default)]
pub struct MatmulSiluOp;

/// `kvjit.matmul_epilogue`: a `mo.matmul` with an elementwise reader that
/// takes one more operand (`mo.add` of a residual, `mo.mul`, or both a
/// `mo.silu` and the `mo.mul` after it), fused.
#[derive(Clone, Copy, Debug, Default)]
pub struct MatmulEpilogueOp;

/// `kvjit.swiglu_matmul`: `silu(a·gate)·(a·up)`, two sibling `mo.matmul`s
/// of one input and the SwiGLU that reads them, fused into one GEMM.
#[derive(Clone, Copy, Debug, Default)]
pub struct SwigluMatmulOp;

/// Add a `mo.matmul` node `a·b` (`a·bᵀ` with `transpose_b`) to `builder`;
/// `b` must be a graph constant. Returns its output.
pub fn matmul(
    builder: &mut GraphBuilder<'_>,
    a: ValueId,
    b: ValueId,
    params: MatmulParams,
) -> Result<ValueId, GraphError> {
    Ok(add_node::<MatmulOp, 2>(builder, &params, [a, b])?[0])
}

/// The GEMM of a node: `a` `[..., K]` (its rows), the weight(s) checked
/// against it, `N`.
fn gemm_spec(
    inputs: &[&ValueType],
    weights: &[(usize, &str)],
    transpose_b: bool,
    epilogue: Epilogue,
    backend: Backend,
) -> Specialized<MatmulSpec> {
    let (a, rows) = rows::input(inputs, 0, "a")?;
    let k = rows.width;
    let orientation = if transpose_b { WeightOrientation::NK } else { WeightOrientation::KN };
    let mut n = None;
    let weight_dtype = tensor_input(inputs, weights[0].0).dtype;
    for &(index, name) in weights {
        let b = tensor_input(inputs, index);
        let expected = match orientation {
            WeightOrientation::NK => format!(
                "{}[N, {k}] (K of a, transpose_b = true; or [N, {k}] in a weight block format: {})",
                a.dtype,
                DType::BLOCK_FORMATS.map(DType::name).join(", ")
            ),
            WeightOrientation::KN => format!("{}[{k}, N] (K of a, transpose_b = false)", a.dtype),
        };
        let shape = b.static_shape();
        let this_n = match (shape.as_deref(), orientation) {
            (Some(&[n, bk]), WeightOrientation::NK) if bk == k && n >= 1 => n,
            (Some(&[bk, n]), WeightOrientation::KN) if bk == k && n >= 1 => n,
            _ => return Err(input_error(name, expected, b)),
        };
        let block_weights = b.dtype.is_block_format() && orientation == WeightOrientation::NK;
        if (b.dtype != a.dtype && !block_weights) || b.dtype != weight_dtype {
            return Err(input_error(name, expected, b));
        }
        if block_weights && !k.is_multiple_of(b.dtype.block().0) {
            let block = b.dtype.block().0;
            return Err(input_error(name, format!("{expected}, K a multiple of the {block}-weight block"), b));
        }
        if let Some(n) = n.filter(|&n| n != this_n) {
            return Err(input_error(name, format!("{expected} with N = {n}, like the first weight's"), b));
        }
        n = Some(this_n);
    }
    let n = n.expect("every matmul has a weight");
    Ok(MatmulSpec { backend, dtype: a.dtype, weights: weight_dtype, rows, n, orientation, epilogue })
}

/// `[..., N]` in `a`'s dtype.
fn output_type(spec: &MatmulSpec, inputs: &[&ValueType]) -> Vec<TensorType> {
    let a = tensor_input(inputs, 0);
    let mut shape = a.shape.clone();
    *shape.last_mut().expect("a has rank ≥ 1") = Dim::Static(spec.n);
    vec![TensorType::new(spec.dtype, shape)]
}

impl Op for MatmulOp {
    const NAME: &'static str = "mo.matmul";
    const INPUTS: &'static [ArgSpec] = &[ArgSpec::tensor("a"), ArgSpec::constant("b")];
    type Params = MatmulParams;
    type Spec = MatmulSpec;
    type Cpu = JitKernel<MatmulSpec>;

    fn specialize(&self, params: &MatmulParams, inputs: &[&ValueType], backend: Backend) -> Specialized<MatmulSpec> {
        gemm_spec(inputs, &[(1, "b")], params.transpose_b, Epilogue::None, backend)
    }

    fn infer(&self, spec: &MatmulSpec, inputs: &[&ValueType]) -> Vec<TensorType> {
        output_type(spec, inputs)
    }

    fn packed_constant_inputs(&self) -> &'static [usize] {
        &[1]
    }
}

impl Op for MatmulSiluOp {
    const NAME: &'static str = "kvjit.matmul_silu";
    const INPUTS: &'static [ArgSpec] = &[ArgSpec::tensor("a"), ArgSpec::constant("b")];
    type Params = MatmulParams;
    type Spec = MatmulSpec;
    type Cpu = JitKernel<MatmulSpec>;

    fn specialize(&self, params: &MatmulParams, inputs: &[&ValueType], backend: Backend) -> Specialized<MatmulSpec> {
        gemm_spec(inputs, &[(1, "b")], params.transpose_b, Epilogue::Silu, backend)
    }

    fn infer(&self, spec: &MatmulSpec, inputs: &[&ValueType]) -> Vec<TensorType> {
        output_type(spec, inputs)
    }

    fn packed_constant_inputs(&self) -> &'static [usize] {
        &[1]
    }
}

impl Op for MatmulEpilogueOp {
    const NAME: &'static str = "kvjit.matmul_epilogue";
    const INPUTS: &'static [ArgSpec] = &[ArgSpec::tensor("a"), ArgSpec::constant("b"), ArgSpec::tensor("other")];
    type Params = EpilogueParams;
    type Spec = EpilogueMatmulSpec;
    type Cpu = JitKernel<EpilogueMatmulSpec>;

    fn specialize(
        &self,
        params: &EpilogueParams,
        inputs: &[&ValueType],
        backend: Backend,
    ) -> Specialized<EpilogueMatmulSpec> {
        let spec = gemm_spec(inputs, &[(1, "b")], params.transpose_b, params.epilogue.into(), backend)?;
        let other = tensor_input(inputs, 2);
        let expected = &output_type(&spec, inputs)[0];
        if other.dtype != expected.dtype || other.shape != expected.shape {
            return Err(input_error("other", format!("{expected} (the matmul's result)"), other));
        }
        Ok(EpilogueMatmulSpec(spec))
    }

    fn infer(&self, spec: &EpilogueMatmulSpec, inputs: &[&ValueType]) -> Vec<TensorType> {
        output_type(&spec.0, inputs)
    }

    fn packed_constant_inputs(&self) -> &'static [usize] {
        &[1]
    }
}

impl Op for SwigluMatmulOp {
    const NAME: &'static str = "kvjit.swiglu_matmul";
    const INPUTS: &'static [ArgSpec] = &[ArgSpec::tensor("a"), ArgSpec::constant("gate"), ArgSpec::constant("up")];
    type Params = MatmulParams;
    type Spec = SwigluMatmulSpec;
    type Cpu = JitKernel<SwigluMatmulSpec>;

    fn specialize(
        &self,
        params: &MatmulParams,
        inputs: &[&ValueType],
        backend: Backend,
    ) -> Specialized<SwigluMatmulSpec> {
        let weights = [(1, "gate"), (2, "up")];
        Ok(SwigluMatmulSpec(gemm_spec(inputs, &weights, params.transpose_b, Epilogue::SwiGlu, backend)?))
    }

    fn infer(&self, spec: &SwigluMatmulSpec, inputs: &[&ValueType]) -> Vec<TensorType> {
        output_type(&spec.0, inputs)
    }

    fn packed_constant_inputs(&self) -> &'static [usize] {
        &[1, 2]
    }
}
