//! What every elementwise op (`mo.silu`, `mo.add`, `mo.mul`) checks the
//! same way: its compute dtype, the element count a kernel bakes in when
//! the shape is static, and a call's tensor against that count.

use kvjit_core::{DType, Error, KernelSpec, Result, Tensor};
use kvjit_graph::{GraphError, TensorType, ValueType, input_error, tensor_input};

/// `dtype` (the node parameter `param`) if it is f32, bf16 or f16.
pub fn compute_dtype(param: &str, dtype: DType) -> Result<DType, GraphError> {
    if dtype.is_compute_float() {
        return Ok(dtype);
    }
    Err(GraphError::Param { param: param.into(), problem: format!("must be f32, bf16 or f16, got {dtype}") })
}

/// Input `i` (named `arg`) as a tensor of `dtype`, of any shape, and its
/// static element count ([`static_elements`]).
pub fn input<'a>(
    inputs: &[&'a ValueType],
    i: usize,
    arg: &str,
    dtype: DType,
) -> Result<(&'a TensorType, Option<usize>), GraphError> {
    let ty = tensor_input(inputs, i);
    if ty.dtype != dtype {
        return Err(input_error(arg, format!("{dtype}[...] (any shape)"), ty));
    }
    Ok((ty, static_elements(arg, ty)?))
}

/// The element count of input `arg` of type `ty` when every dim is static
/// (`None` when one is symbolic: kernels take it from each call); refused
/// when it overflows a usize.
pub fn static_elements(arg: &str, ty: &TensorType) -> Result<Option<usize>, GraphError> {
    let Some(shape) = ty.static_shape() else { return Ok(None) };
    let elements = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    elements.map(Some).ok_or_else(|| input_error(arg, "a shape of at most usize::MAX elements".into(), ty))
}

/// Check a call's `tensor` against the element count `spec` baked in
/// (`None`: any): [`Error::NotBuiltFor`], naming the key, when it differs.
pub fn expect_elements(
    arg: &'static str,
    tensor: &Tensor,
    elements: Option<usize>,
    spec: &impl KernelSpec,
) -> Result<()> {
    match elements {
        Some(n) if tensor.numel() != n => Err(Error::NotBuiltFor {
            arg,
            expected: format!("{n} elements (baked into {})", spec.key()),
            got: tensor.shape().to_vec(),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use kvjit_core::{KernelKey, Target};
    use kvjit_graph::Dim;

    use super::*;

    #[derive(Clone, Debug)]
    struct Spec;

    impl KernelSpec for Spec {
        fn key_name(&self) -> KernelKey {
            KernelKey::new("test", Target::Cpu, DType::F32)
        }
    }

    #[test]
    fn dtypes_counts_and_calls() {
        assert_eq!(compute_dtype("dtype", DType::BF16).unwrap(), DType::BF16);
        let refused = compute_dtype("dtype", DType::U32).unwrap_err().to_string();
        assert!(refused.contains("must be f32, bf16 or f16, got u32"), "{refused}");
        let ty = |shape: Vec<Dim>| TensorType::new(DType::F32, shape);
        assert_eq!(static_elements("x", &ty(vec![Dim::Static(3), Dim::Static(5)])).unwrap(), Some(15));
        assert_eq!(static_elements("x", &ty(vec![])).unwrap(), Some(1));
        assert_eq!(static_elements("x", &ty(vec![Dim::from("batch"), Dim::Static(5)])).unwrap(), None);
        assert!(static_elements("x", &ty(vec![Dim::Static(usize::MAX), Dim::Static(2)])).is_err());
        let (symbolic, scalar) = (ValueType::Tensor(ty(vec![Dim::from("n")])), ValueType::Tensor(ty(vec![])));
        assert_eq!(input(&[&symbolic, &scalar], 1, "b", DType::F32).unwrap(), (&ty(vec![]), Some(1)));
        assert_eq!(input(&[&symbolic], 0, "a", DType::F32).unwrap(), (&ty(vec![Dim::from("n")]), None));
        let wrong = input(&[&symbolic], 0, "a", DType::BF16).unwrap_err().to_string();
        assert!(wrong.contains("bf16[...] (any shape)") && wrong.contains("f32[n]"), "{wrong}");
        let t = Tensor::zeros(DType::F32, &[3, 5]).unwrap();
        expect_elements("x", &t, Some(15), &Spec).unwrap();
        expect_elements("x", &t, None, &Spec).unwrap();
        let err = expect_elements("x", &t, Some(16), &Spec).unwrap_err().to_string();
        assert!(err.contains("16 elements (baked into test.cpu.f32)") && err.contains("[3, 5]"), "{err}");
    }
}
