//! What every elementwise op (`mo.silu`, `mo.add`, `mo.mul`) does the
//! same way: its compute dtype (its first input's), its operands of one
//! type, the element count a kernel bakes in when the
//! shape is static, a call's tensor against that count, and the kernel
//! itself — a map over the elements in `F32X4` vectors ([`compile_map`],
//! [`launch_map`]) whose per-vector arithmetic is all an op writes.

use std::mem::offset_of;
use std::sync::Arc;

use kvjit_core::{DType, Error, KernelKey, KernelSpec, Result, Tensor};
use kvjit_graph::{GraphError, TensorType, ValueType, input_error, tensor_input};
use kvjit_jit::cranelift_codegen::ir::condcodes::IntCC;
use kvjit_jit::cranelift_codegen::ir::{InstBuilder, Value};
use kvjit_jit::cranelift_frontend::FunctionBuilder;
use kvjit_jit::ir::addr::{Size, element};
use kvjit_jit::ir::{self, counted_loop};
use kvjit_jit::{CaptureText, JitError, JitFunction, KernelArgs, KernelParams, compile_kernel, compile_or_fetch};

use crate::Launch;

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

/// Input `i` (named `arg`) as a tensor of f32, bf16 or f16 of any shape:
/// its type, its dtype (the op's compute dtype) and its static element
/// count ([`static_elements`]).
pub fn float_input<'a>(
    inputs: &[&'a ValueType],
    i: usize,
    arg: &str,
) -> Result<(&'a TensorType, DType, Option<usize>), GraphError> {
    let ty = tensor_input(inputs, i);
    if !ty.dtype.is_compute_float() {
        return Err(input_error(arg, "an f32, bf16 or f16 tensor (any shape)".into(), ty));
    }
    Ok((ty, ty.dtype, static_elements(arg, ty)?))
}

/// Input `i` (named `arg`) as a tensor of exactly the type `like` of
/// input `like_arg`: the same dtype and the same dims (a symbolic dim by
/// its name) — an elementwise op's other operand.
pub fn same_type_input(
    inputs: &[&ValueType],
    i: usize,
    arg: &str,
    like: &TensorType,
    like_arg: &str,
) -> Result<(), GraphError> {
    let ty = tensor_input(inputs, i);
    if ty != like {
        return Err(input_error(arg, format!("{like} (the type of {like_arg})"), ty));
    }
    Ok(())
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

/// Check a call's `tensor` (named `arg`) against `first`, the operand
/// named `first_arg`: the same shape ([`Error::ShapeMismatch`] naming
/// `arg` otherwise). Dtypes are the signature's to check.
pub fn expect_same_shape(arg: &str, tensor: &Tensor, first_arg: &str, first: &Tensor) -> Result<()> {
    if tensor.shape() == first.shape() {
        return Ok(());
    }
    Err(kvjit_core::shape_mismatch(arg, format!("{:?} (the shape of {first_arg})", first.shape()), tensor))
}

/// Elements per work item of an elementwise kernel (the last item takes
/// what is left): items do not depend on the thread count, so neither
/// does any result.
pub const ELEMENTS_PER_ITEM: usize = 2048;

/// The argument struct of an elementwise kernel over `N` inputs, read by
/// its code at `offset_of!`.
#[repr(C)]
struct MapArgs<const N: usize> {
    /// Addresses of the inputs.
    inputs: [u64; N],
    /// Address of the output.
    output: u64,
    /// Elements of every input and of the output.
    elements: u64,
}

// SAFETY: `#[repr(C)]` with only u64 fields (an array of them, then two).
unsafe impl<const N: usize> KernelArgs for MapArgs<N> {}

/// Compile (or fetch from the process-wide registry) the elementwise
/// kernel of `key`: output element `i` is `lanes` of the inputs' elements
/// `i`, all of `dtype` — widened to f32, computed by `lanes` on `F32X4`
/// vectors, rounded once to `dtype` on the store. The element count is
/// baked in (`Some`) or read from each call.
///
/// Each work item is a run of [`ELEMENTS_PER_ITEM`] elements (the last
/// one's may be shorter): `F32X4` vectors, then the 0–3 left over one at a
/// time (splat to four lanes; lane 0 is stored). bf16 lanes are loaded
/// without quieting signalling NaNs (`kvjit_jit::ir::load_f32x4_raw`):
/// `lanes` must only feed them to float arithmetic.
pub fn compile_map<const N: usize>(
    key: &KernelKey,
    capture: CaptureText,
    dtype: DType,
    elements: Option<usize>,
    lanes: impl Fn(&mut FunctionBuilder, [Value; N]) -> Value,
) -> std::result::Result<Arc<JitFunction>, JitError> {
    compile_or_fetch(key, capture, || compile_kernel(key, capture, |b, p| emit_map(b, p, dtype, elements, lanes)))
}

/// The body of a [`compile_map`] kernel: work items `[begin, end)`.
fn emit_map<const N: usize>(
    b: &mut FunctionBuilder,
    p: KernelParams,
    dtype: DType,
    elements: Option<usize>,
    lanes: impl Fn(&mut FunctionBuilder, [Value; N]) -> Value,
) {
    let inputs: [Value; N] = std::array::from_fn(|i| p.field(b, offset_of!(MapArgs<N>, inputs) + 8 * i));
    let output = p.field(b, offset_of!(MapArgs<N>, output));
    let n = match elements {
        Some(n) => Size::Known(n),
        None => Size::Runtime(p.field(b, offset_of!(MapArgs<N>, elements))),
    }
    .value(b);
    let bytes = dtype.size_bytes();
    let per_item = ELEMENTS_PER_ITEM as i64;
    counted_loop(b, p.begin, p.end, 1, &[], |b, item, _| {
        // This item's elements: [start, stop), stop = min(start + per_item, n).
        let start = b.ins().imul_imm_s(item, per_item);
        let full = b.ins().iadd_imm_s(start, per_item);
        let past = b.ins().icmp(IntCC::SignedGreaterThan, full, n);
        let stop = b.ins().select(past, n, full);
        let len = b.ins().isub(stop, start);
        let vector_len = b.ins().band_imm_s(len, -4);
        let vector_stop = b.ins().iadd(start, vector_len);
        counted_loop(b, start, vector_stop, 4, &[], |b, i, _| {
            let x = inputs.map(|input| {
                let at = element(b, input, i, bytes);
                ir::load_f32x4_raw(b, dtype, at, 0)
            });
            let y = lanes(b, x);
            let at = element(b, output, i, bytes);
            ir::store_f32x4(b, dtype, y, at, 0);
            Vec::new()
        });
        counted_loop(b, vector_stop, stop, 1, &[], |b, i, _| {
            let x = inputs.map(|input| {
                let at = element(b, input, i, bytes);
                ir::load_splat_f32x4_raw(b, dtype, at, 0)
            });
            let y = lanes(b, x);
            let at = element(b, output, i, bytes);
            ir::store_lane(b, dtype, y, 0, at, 0);
            Vec::new()
        });
        Vec::new()
    });
}

/// Run a [`compile_map`] kernel of `N` inputs on a call (its tensors, in
/// order, are the inputs), its work items over the call's workers.
///
/// # Panics
///
/// When the call has other than `N` tensors, or an input's or the
/// output's byte length differs from the first input's.
///
/// # Safety
///
/// `call.code` must come from [`compile_map`] with `N` inputs, for the
/// dtype of the call's tensors and, if it baked one, their element count;
/// every input must be contiguous of that dtype (the lengths are asserted
/// here; the dtype, contiguity and baked count are the caller's checks to
/// name).
pub unsafe fn launch_map<const N: usize>(call: Launch<'_, '_>) {
    let (code, inputs, output, ctx) = (call.code, call.tensors::<N>(), call.output, call.ctx);
    let first = inputs.first().expect("an elementwise kernel has at least one input");
    let (elements, bytes) = (first.numel(), first.as_bytes().len());
    assert!(
        inputs.iter().all(|t| t.numel() == elements && t.as_bytes().len() == bytes) && output.len() == bytes,
        "elementwise operands of different sizes reached {}",
        code.name()
    );
    let args = MapArgs {
        inputs: inputs.map(|t| t.as_bytes().as_ptr() as u64),
        output: output.as_mut_ptr() as u64,
        elements: elements as u64,
    };
    // SAFETY: the caller guarantees `code` is a `compile_map` kernel of `N`
    // inputs of these tensors' dtype and (if baked) element count; every
    // buffer holds `elements` elements of it (asserted above); the code
    // touches element `i` of each only for `i < elements`, and item `t`
    // covers elements `t·ELEMENTS_PER_ITEM..` up to the next item's:
    // disjoint writes.
    unsafe { kvjit_jit::launch(code, &args, elements.div_ceil(ELEMENTS_PER_ITEM), ctx) };
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

    #[test]
    fn float_operands_of_one_type() {
        let ty = |dtype, shape: Vec<Dim>| ValueType::Tensor(TensorType::new(dtype, shape));
        let a = ty(DType::BF16, vec![Dim::from("batch"), Dim::Static(5)]);
        let (a_type, dtype, elements) = float_input(&[&a], 0, "a").unwrap();
        assert_eq!((a_type, dtype, elements), (a.as_tensor().unwrap(), DType::BF16, None));
        let ids = ty(DType::U32, vec![Dim::Static(4)]);
        let err = float_input(&[&a, &ids], 1, "ids").unwrap_err().to_string();
        assert!(err.contains("ids") && err.contains("f32, bf16 or f16") && err.contains("u32[4]"), "{err}");

        same_type_input(&[&a, &a], 1, "b", a_type, "a").unwrap();
        for other in [
            ty(DType::F32, vec![Dim::from("batch"), Dim::Static(5)]),
            ty(DType::BF16, vec![Dim::from("seq"), Dim::Static(5)]),
            ty(DType::BF16, vec![Dim::from("batch"), Dim::Static(6)]),
            ty(DType::BF16, vec![Dim::from("batch"), Dim::Static(5), Dim::Static(1)]),
        ] {
            let err = same_type_input(&[&a, &other], 1, "b", a_type, "a").unwrap_err().to_string();
            assert!(err.contains("bf16[batch, 5] (the type of a)") && err.contains(&format!("{other}")), "{err}");
        }

        let (t, u) = (Tensor::zeros(DType::F32, &[3, 5]).unwrap(), Tensor::zeros(DType::F32, &[5, 3]).unwrap());
        expect_same_shape("b", &t, "a", &t).unwrap();
        let err = expect_same_shape("b", &u, "a", &t).unwrap_err();
        assert!(matches!(&err, Error::ShapeMismatch { arg, got, .. } if arg == "b" && got == &[5, 3]), "{err}");
        assert!(err.to_string().contains("[3, 5] (the shape of a)"), "{err}");
    }
}
