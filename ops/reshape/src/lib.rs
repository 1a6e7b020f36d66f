//! `mo.reshape` (MAX's name): the same elements under another shape.
//!
//! Parameter `shape`: the output dims, numbers or graph symbols, e.g.
//! `["batch", "seq", 32, 128]`. Input: one tensor; output: the same dtype and
//! elements in row-major order under `shape`. The element counts must be
//! equal for every binding of the symbols, which is checked when the node is
//! added: the output names the same symbols as the input (as a multiset) and
//! the product of its numbers equals the input's.
//!
//! No kernel runs: the op is a view ([`OpDef::is_view`](kvjit_graph::OpDef::is_view)). The executor hands
//! the consumer the producer's storage under the new shape, on every target.
//! A run-time output dim named by a symbol takes its size from the input
//! axis with that symbol, so the key records, per output dim, a size or the
//! input axis it copies (`reshape.cpu.f32.o0in0.o1in1.o2x32.o3x128`).

use kvjit_core::{Backend, DType, Error, KernelKey, KernelSpec, KeyField, PagedKVCacheCollection, Target, Tensor};
use kvjit_graph::{ArgSpec, Dim, GraphBuilder, GraphError, ParamValue, TensorType, ValueId, ValueType, tensor_input};
use kvjit_op::{
    BoxError, Built, Call, CallContract, Constants, CpuBuild, CpuKernel, Op, OpKernel, Specialized, TensorArg,
    add_node, built,
};
use kvjit_runtime::{DeviceContextPtr, OutputSpec};

/// The op's name in graphs (MAX's).
pub const OP_NAME: &str = "mo.reshape";
/// Short name in kernel keys.
pub const KERNEL_NAME: &str = "reshape";

kvjit_op::params! {
    /// The parameters of a reshape node.
    #[derive(Clone, Debug, PartialEq)]
    pub struct ReshapeParams {
        /// The output dims, numbers or graph symbols.
        shape: Vec<Dim>,
    }
}

/// The reshape op.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReshapeOp;

/// Where one output dim's size comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OutDim {
    /// A number.
    Size(usize),
    /// The size of this input axis (a symbol at build time).
    InputAxis(usize),
}

/// Map each output dim to a size or the input axis with the same symbol
/// (each input axis used once), checking the element counts agree for every
/// binding.
fn plan(input: &[Dim], output: &[Dim]) -> Result<Vec<OutDim>, String> {
    let mut used = vec![false; input.len()];
    let mut plan = Vec::with_capacity(output.len());
    for dim in output {
        plan.push(match dim {
            Dim::Static(size) => OutDim::Size(*size),
            Dim::Symbolic(symbol) => {
                let axis = (0..input.len())
                    .find(|&a| !used[a] && input[a] == *dim)
                    .ok_or_else(|| format!("output dim '{symbol}' is not a dim of the input (or is used twice)"))?;
                used[axis] = true;
                OutDim::InputAxis(axis)
            }
        });
    }
    if let Some(axis) = (0..input.len()).find(|&a| !used[a] && input[a].as_static().is_none()) {
        return Err(format!("input dim '{}' does not appear in the output", input[axis]));
    }
    let product = |dims: &mut dyn Iterator<Item = &Dim>| {
        dims.filter_map(Dim::as_static).try_fold(1usize, |acc, d| acc.checked_mul(d))
    };
    let (have, want) = (product(&mut input.iter()), product(&mut output.iter()));
    if have.is_none() || have != want {
        return Err(format!(
            "the input's fixed dims hold {} elements per symbol binding, the output's {}",
            have.map_or("too many".into(), |v| v.to_string()),
            want.map_or("too many".into(), |v| v.to_string())
        ));
    }
    Ok(plan)
}

/// What a reshape's view bakes in: the dtype and, per output dim, a size
/// or the input axis it copies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReshapeSpec {
    /// Target.
    pub target: Target,
    /// Element type (of input and output).
    pub dtype: DType,
    /// Per output dim, where its size comes from.
    plan: Vec<OutDim>,
}

impl KernelSpec for ReshapeSpec {
    /// E.g. `reshape.cpu.f32.o0in0.o1in1.o2x32.o3x128`.
    fn key_name(&self) -> KernelKey {
        let key = KernelKey::new(KERNEL_NAME, self.target, self.dtype);
        self.plan.iter().enumerate().fold(key, |key, (i, d)| match *d {
            OutDim::Size(size) => key.with(&format!("o{i}x"), KeyField::Static(size as u64)),
            OutDim::InputAxis(axis) => key.with(&format!("o{i}in"), KeyField::Static(axis as u64)),
        })
    }
}

impl Op for ReshapeOp {
    const NAME: &'static str = OP_NAME;
    const INPUTS: &'static [ArgSpec] = &[ArgSpec::tensor("input")];
    type Params = ReshapeParams;
    type Spec = ReshapeSpec;
    type Cpu = ViewKernel;

    fn specialize(&self, params: &ReshapeParams, inputs: &[&ValueType], backend: Backend) -> Specialized<ReshapeSpec> {
        let input = tensor_input(inputs, 0);
        let plan = plan(&input.shape, &params.shape).map_err(|why| GraphError::InputType {
            arg: "input".into(),
            expected: format!("a tensor with as many elements as {}", ParamValue::Dims(params.shape.clone())),
            got: format!("{input} ({why})"),
        })?;
        Ok(ReshapeSpec { target: backend.target(), dtype: input.dtype, plan })
    }

    fn infer(&self, spec: &ReshapeSpec, inputs: &[&ValueType]) -> Vec<TensorType> {
        let input = tensor_input(inputs, 0);
        let shape: Vec<Dim> = spec
            .plan
            .iter()
            .map(|d| match *d {
                OutDim::Size(size) => Dim::Static(size),
                OutDim::InputAxis(axis) => input.shape[axis].clone(),
            })
            .collect();
        vec![TensorType::new(spec.dtype, shape)]
    }

    /// Views serve every target.
    fn supports_cuda(&self, _: &ReshapeSpec) -> Result<(), String> {
        Ok(())
    }

    fn build_reference(&self, spec: &ReshapeSpec) -> Built {
        built(ViewKernel(spec.clone()))
    }

    fn build_cuda(&self, spec: &ReshapeSpec, _: &Constants) -> Built {
        self.build_reference(spec)
    }

    fn is_view(&self) -> bool {
        true
    }
}

/// Add a reshape node: `input` seen as `shape` (numbers or symbols).
pub fn reshape(b: &mut GraphBuilder<'_>, input: ValueId, shape: &[Dim]) -> Result<ValueId, GraphError> {
    Ok(add_node::<ReshapeOp, 1>(b, &ReshapeParams { shape: shape.to_vec() }, [input])?[0])
}

impl CallContract for ReshapeSpec {
    type Checked = Vec<usize>;
    const TENSORS: &'static [TensorArg] = &[TensorArg::compute("input")];

    /// The output shape: the input's rank and element count must be the
    /// ones the plan was built for.
    fn check(&self, tensors: &[&Tensor], _: &[&PagedKVCacheCollection]) -> kvjit_core::Result<Vec<usize>> {
        let input = tensors[0];
        let shape: Vec<usize> = self
            .plan
            .iter()
            .map(|d| match *d {
                OutDim::Size(size) => Some(size),
                OutDim::InputAxis(axis) => input.shape().get(axis).copied(),
            })
            .collect::<Option<_>>()
            .ok_or_else(|| Error::ShapeMismatch {
                arg: "input".into(),
                expected: format!("the rank {} built into {}", self.plan.len(), self.key()),
                got: input.shape().to_vec(),
            })?;
        if shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) != Some(input.numel()) {
            return Err(Error::ShapeMismatch {
                arg: "input".into(),
                expected: format!("as many elements as {shape:?}"),
                got: input.shape().to_vec(),
            });
        }
        Ok(shape)
    }

    fn outputs(&self, shape: &Vec<usize>) -> Vec<OutputSpec> {
        vec![(self.dtype, shape.clone())]
    }

    /// The output becomes the input seen with the checked shape.
    fn reference(&self, shape: Vec<usize>, call: Call<'_, '_>) -> kvjit_core::Result<()> {
        call.outputs[0] = call.tensors[0].reshaped(&shape)?;
        Ok(())
    }
}

/// The view "kernel": checks the input and gives the output shape; the
/// executor makes the view (see [`Kernel::is_view`](kvjit_runtime::Kernel::is_view)).
pub struct ViewKernel(ReshapeSpec);

/// Every target's kernel is the view.
impl CpuKernel for ViewKernel {
    fn build(spec: &ReshapeSpec, _: &Constants, _: &CpuBuild) -> Result<Self, BoxError> {
        Ok(Self(spec.clone()))
    }
}

impl OpKernel for ViewKernel {
    type Spec = ReshapeSpec;
    const IMPLEMENTATION: &'static str = "view";
    const IS_VIEW: bool = true;

    fn spec(&self) -> &ReshapeSpec {
        &self.0
    }

    /// Not called by the executor (it makes the view); for direct callers,
    /// the reference's view.
    fn run(&self, shape: Vec<usize>, call: Call<'_, '_>, _: &DeviceContextPtr) -> kvjit_core::Result<()> {
        self.0.reference(shape, call)
    }
}

#[cfg(test)]
mod tests {
    use kvjit_core::{DType, KernelSpec};
    use kvjit_runtime::{BuildOptions, KernelBuilder};

    use kvjit_op::Defined;

    use super::*;

    fn dims(text: &[&str]) -> Vec<Dim> {
        text.iter().map(|t| t.parse::<usize>().map_or_else(|_| Dim::from(*t), Dim::Static)).collect()
    }

    #[test]
    fn a_plan_maps_symbols_to_input_axes_and_checks_counts() {
        let plan = plan(&dims(&["batch", "seq", "4096"]), &dims(&["batch", "seq", "32", "128"])).unwrap();
        assert_eq!(plan, [OutDim::InputAxis(0), OutDim::InputAxis(1), OutDim::Size(32), OutDim::Size(128)]);
        let swapped = super::plan(&dims(&["b", "s", "6"]), &dims(&["s", "2", "b", "3"])).unwrap();
        assert_eq!(swapped[0], OutDim::InputAxis(1));
        assert_eq!(swapped[2], OutDim::InputAxis(0));
        for (input, output, why) in [
            (&["b", "4096"][..], &["b", "32", "127"][..], "4096"),
            (&["b", "8"], &["c", "8"], "'c' is not a dim of the input"),
            (&["b", "s", "8"], &["b", "8"], "input dim 's' does not appear"),
            (&["b", "8"], &["b", "b", "8"], "used twice"),
        ] {
            let err = super::plan(&dims(input), &dims(output)).unwrap_err();
            assert!(err.contains(why), "{input:?} -> {output:?}: {err}");
        }
    }

    #[test]
    fn the_view_kernel_shares_storage_and_refuses_a_wrong_count() {
        let plan = vec![OutDim::InputAxis(0), OutDim::Size(2), OutDim::Size(3)];
        let spec = ReshapeSpec { target: Target::Cpu, dtype: DType::F32, plan };
        assert_eq!(spec.key().to_string(), "reshape.cpu.f32.o0in0.o1x2.o2x3");
        let kernel = Defined(ReshapeOp).build(&spec.key(), &[], &BuildOptions::default()).unwrap();
        assert!(kernel.is_view());
        let input = Tensor::from_vec(&[4, 6], (0..24).map(|v| v as f32).collect()).unwrap();
        assert_eq!(kernel.check(&[&input], &[]).unwrap(), vec![(DType::F32, vec![4, 2, 3])]);
        let mut out = [Tensor::zeros(DType::F32, &[4, 2, 3]).unwrap()];
        kernel.run(&[&input], &mut [], &mut out, &DeviceContextPtr::cpu(1).unwrap()).unwrap();
        assert_eq!(out[0].shape(), [4, 2, 3]);
        assert!(out[0].shares_storage_with(&input), "a view, not a copy");
        let wrong = Tensor::zeros(DType::F32, &[4, 5]).unwrap();
        assert!(kernel.check(&[&wrong], &[]).is_err());
    }
}
