//! `mo.reshape` (MAX's name): the same elements under another shape.
//!
//! Parameter `shape`: the output dims, numbers or graph symbols, e.g.
//! `["batch", "seq", 32, 128]`. Input: one tensor; output: the same dtype and
//! elements in row-major order under `shape`. The element counts must be
//! equal for every binding of the symbols, which is checked when the node is
//! added: the output names the same symbols as the input (as a multiset) and
//! the product of its numbers equals the input's.
//!
//! No kernel runs: the op is a view ([`OpDef::is_view`]). The executor hands
//! the consumer the producer's storage under the new shape, on every target.
//! A run-time output dim named by a symbol takes its size from the input
//! axis with that symbol, so the key records, per output dim, a size or the
//! input axis it copies (`reshape.cpu.f32.o0in0.o1in1.o2x32.o3x128`).

use std::sync::Arc;

use kvjit_core::{Error, KernelKey, KeyField, PagedKVCacheCollection, Target, Tensor};
use kvjit_graph::{
    ArgSpec, Dim, GraphBuilder, GraphError, OpDef, ParamKind, ParamSpec, ParamValue, Params, TensorType, ValueId,
    ValueType, param_dims,
};
use kvjit_runtime::{BuildOptions, ConstantInput, DeviceContextPtr, Kernel, KernelBuilder, OutputSpec, RuntimeError};

/// The op's name in graphs (MAX's).
pub const OP_NAME: &str = "mo.reshape";
/// Short name in kernel keys.
pub const KERNEL_NAME: &str = "reshape";

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

fn input_type<'a>(inputs: &[&'a ValueType]) -> &'a TensorType {
    inputs[0].as_tensor().expect("argument kinds are checked before infer")
}

impl OpDef for ReshapeOp {
    fn name(&self) -> &'static str {
        OP_NAME
    }

    fn params(&self) -> &'static [ParamSpec] {
        const PARAMS: &[ParamSpec] = &[ParamSpec::required("shape", ParamKind::Dims)];
        PARAMS
    }

    fn inputs(&self) -> &'static [ArgSpec] {
        const INPUTS: &[ArgSpec] = &[ArgSpec::tensor("input")];
        INPUTS
    }

    fn outputs(&self) -> &'static [&'static str] {
        &["output"]
    }

    fn infer(&self, params: &Params, inputs: &[&ValueType]) -> Result<Vec<TensorType>, GraphError> {
        let input = input_type(inputs);
        let shape = param_dims(params, "shape")?;
        plan(&input.shape, shape).map_err(|why| GraphError::InputType {
            arg: "input".into(),
            expected: format!("a tensor with as many elements as {}", ParamValue::Dims(shape.to_vec())),
            got: format!("{input} ({why})"),
        })?;
        Ok(vec![TensorType::new(input.dtype, shape.to_vec())])
    }

    fn kernel_key(&self, params: &Params, inputs: &[&ValueType], target: Target) -> Result<KernelKey, GraphError> {
        let input = input_type(inputs);
        let shape = param_dims(params, "shape")?;
        let plan = plan(&input.shape, shape).map_err(GraphError::Unsupported)?;
        let key =
            plan.iter().enumerate().fold(KernelKey::new(KERNEL_NAME, target, input.dtype), |key, (i, d)| match *d {
                OutDim::Size(size) => key.with(&format!("o{i}x"), KeyField::Static(size as u64)),
                OutDim::InputAxis(axis) => key.with(&format!("o{i}in"), KeyField::Static(axis as u64)),
            });
        Ok(key)
    }

    fn is_view(&self) -> bool {
        true
    }
}

/// Add a reshape node: `input` seen as `shape` (numbers or symbols).
pub fn reshape(b: &mut GraphBuilder<'_>, input: ValueId, shape: &[Dim]) -> Result<ValueId, GraphError> {
    let params = Params::from([("shape".to_string(), ParamValue::Dims(shape.to_vec()))]);
    Ok(b.node(OP_NAME, params, &[input])?[0])
}

/// The view "kernel": checks the input and gives the output shape; the
/// executor makes the view (see [`Kernel::is_view`]).
struct ViewKernel {
    key: KernelKey,
    plan: Vec<OutDim>,
}

impl KernelBuilder for ReshapeOp {
    fn build(
        &self,
        key: &KernelKey,
        _constants: &[Option<ConstantInput>],
        _options: &BuildOptions,
    ) -> kvjit_runtime::Result<Arc<dyn Kernel>> {
        let plan = key
            .fields()
            .iter()
            .map(|(label, field)| match (label.ends_with("in"), field) {
                (true, KeyField::Static(axis)) => Some(OutDim::InputAxis(*axis as usize)),
                (false, KeyField::Static(size)) => Some(OutDim::Size(*size as usize)),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
            .filter(|_| key.op() == KERNEL_NAME)
            .ok_or_else(|| RuntimeError::Plan(format!("{key} is not a key of {OP_NAME}")))?;
        Ok(Arc::new(ViewKernel { key: key.clone(), plan }))
    }
}

impl Kernel for ViewKernel {
    fn key(&self) -> &KernelKey {
        &self.key
    }

    fn implementation(&self) -> &'static str {
        "view"
    }

    fn is_view(&self) -> bool {
        true
    }

    fn check(&self, inputs: &[&Tensor], _caches: &[&PagedKVCacheCollection]) -> kvjit_core::Result<Vec<OutputSpec>> {
        let [input] = inputs else {
            return Err(Error::ShapeMismatch {
                arg: "arguments".into(),
                expected: "1 tensor (input)".into(),
                got: vec![inputs.len()],
            });
        };
        if input.dtype() != self.key.dtype() {
            return Err(Error::DTypeMismatch { arg: "input".into(), expected: self.key.dtype(), got: input.dtype() });
        }
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
                expected: format!("the rank {} built into {}", self.plan.len(), self.key),
                got: input.shape().to_vec(),
            })?;
        if shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) != Some(input.numel()) {
            return Err(Error::ShapeMismatch {
                arg: "input".into(),
                expected: format!("as many elements as {shape:?}"),
                got: input.shape().to_vec(),
            });
        }
        if !input.is_contiguous() {
            return Err(Error::NotContiguous { arg: "input".into() });
        }
        Ok(vec![(input.dtype(), shape)])
    }

    /// Not called by the executor (it makes the view); for direct callers,
    /// a copy into the output allocated to the checked shape.
    fn run(
        &self,
        inputs: &[&Tensor],
        caches: &mut [&mut PagedKVCacheCollection],
        outputs: &mut [Tensor],
        _ctx: &DeviceContextPtr,
    ) -> kvjit_core::Result<()> {
        let caches: Vec<&PagedKVCacheCollection> = caches.iter().map(|c| &**c).collect();
        let [(_, shape)] = self.check(inputs, &caches)?.try_into().expect("one output");
        let [output] = outputs else {
            return Err(Error::ShapeMismatch { arg: "outputs".into(), expected: "1".into(), got: vec![outputs.len()] });
        };
        *output = inputs[0].reshaped(&shape)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use kvjit_core::DType;

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
        let key = KernelKey::new(KERNEL_NAME, Target::Cpu, DType::F32)
            .with("o0in", KeyField::Static(0))
            .with("o1x", KeyField::Static(2))
            .with("o2x", KeyField::Static(3));
        let kernel = ReshapeOp.build(&key, &[], &BuildOptions::default()).unwrap();
        let input = Tensor::from_vec(&[4, 6], (0..24).map(|v| v as f32).collect()).unwrap();
        assert_eq!(kernel.check(&[&input], &[]).unwrap(), vec![(DType::F32, vec![4, 2, 3])]);
        let mut out = [Tensor::zeros(DType::F32, &[0]).unwrap()];
        kernel.run(&[&input], &mut [], &mut out, &DeviceContextPtr::cpu(1).unwrap()).unwrap();
        assert_eq!(out[0].shape(), [4, 2, 3]);
        assert!(out[0].shares_storage_with(&input), "a view, not a copy");
        let wrong = Tensor::zeros(DType::F32, &[4, 5]).unwrap();
        assert!(kernel.check(&[&wrong], &[]).is_err());
    }
}
