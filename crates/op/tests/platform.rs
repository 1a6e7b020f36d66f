//! The platform's shared plumbing, tested once on a toy op (`toy.double`:
//! y = 2·x over a 1-D tensor): what `Compiled` checks before a kernel runs,
//! what `Defined` makes of an `Op`, and what `params!` generates.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvjit_core::{
    Backend, CodeTier, DType, Error, KernelKey, KernelSpec, KeyField, PagedKVCacheCollection, Result, Target, Tensor,
};
use kvjit_graph::{
    ArgSpec, Dim, GraphBuilder, OpDef, OpRegistry, ParamKind, ParamValue, TensorType, ValueType, specialize,
    tensor_input,
};
use kvjit_op::checks::expect_baked;
use kvjit_op::{
    BoxError, Call, CallContract, Choice, Compiled, Constants, CpuBuild, CpuKernel, Defined, Op, OpKernel, OpParams,
    Specialized, TensorArg,
};
use kvjit_runtime::{BuildOptions, DeviceContextPtr, Kernel, KernelBuilder, KernelImpl, OutputSpec};

/// How the toy rounds (a `Choice` parameter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rounding {
    Nearest,
    Down,
}

impl Choice for Rounding {
    const NAMES: &'static [&'static str] = &["nearest", "down"];

    fn from_name(name: &str) -> Option<Self> {
        match name {
            "nearest" => Some(Rounding::Nearest),
            "down" => Some(Rounding::Down),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

kvjit_op::params! {
    /// The toy's parameters.
    #[derive(Clone, Copy, Debug, PartialEq)]
    struct ToyParams {
        /// Element type.
        dtype: DType,
        /// A choice.
        rounding: Rounding,
        /// An optional number.
        factor: Option<f32>,
        /// An optional size.
        limit: Option<usize>,
    }
}

#[derive(Clone, Debug, PartialEq)]
struct ToySpec {
    target: Target,
    dtype: DType,
    n: Option<usize>,
}

impl KernelSpec for ToySpec {
    fn key_name(&self) -> KernelKey {
        KernelKey::new("toy_double", self.target, self.dtype).with("n", KeyField::dim(self.n))
    }
}

impl CallContract for ToySpec {
    type Checked = usize;
    const TENSORS: &'static [TensorArg] = &[TensorArg::compute("x"), TensorArg::u32("count")];

    fn check(&self, tensors: &[&Tensor], _: &[&PagedKVCacheCollection]) -> Result<usize> {
        expect_baked("x", tensors[0], &[("N", self.n)], self)?;
        Ok(tensors[0].numel())
    }

    fn outputs(&self, n: &usize) -> Vec<OutputSpec> {
        vec![(self.dtype, vec![*n])]
    }

    fn reference(&self, n: usize, call: Call<'_, '_>) -> Result<()> {
        let [x, _count] = call.tensors();
        let doubled: Vec<f32> = x.to_f32_vec()?.iter().map(|v| 2.0 * v).collect();
        call.outputs[0] = Tensor::from_f32(self.dtype, &[n], &doubled)?;
        Ok(())
    }
}

impl CpuKernel for Doubler {
    fn build(spec: &ToySpec, _: &Constants, _: &CpuBuild) -> Result<Self, BoxError> {
        Ok(Doubler { spec: spec.clone(), runs: Arc::default() })
    }
}

/// Counts its runs, so a test sees that a refused call never ran.
struct Doubler {
    spec: ToySpec,
    runs: Arc<AtomicUsize>,
}

impl OpKernel for Doubler {
    type Spec = ToySpec;
    const IMPLEMENTATION: &'static str = "toy";

    fn spec(&self) -> &ToySpec {
        &self.spec
    }

    fn run(&self, n: usize, call: Call<'_, '_>, _: &DeviceContextPtr) -> Result<()> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        self.spec.reference(n, call)
    }
}

struct ToyOp;

impl Op for ToyOp {
    const NAME: &'static str = "toy.double";
    const INPUTS: &'static [ArgSpec] = &[ArgSpec::tensor("x"), ArgSpec::tensor("count")];
    type Params = ToyParams;
    type Spec = ToySpec;
    type Cpu = Doubler;

    fn specialize(&self, params: &ToyParams, inputs: &[&ValueType], backend: Backend) -> Specialized<ToySpec> {
        let x = tensor_input(inputs, 0);
        match x.shape.as_slice() {
            [n] if x.dtype == params.dtype => {
                Ok(ToySpec { target: backend.target(), dtype: x.dtype, n: n.as_static() })
            }
            _ => Err(kvjit_graph::input_error("x", format!("{}[N]", params.dtype), x)),
        }
    }

    fn infer(&self, spec: &ToySpec, inputs: &[&ValueType]) -> Vec<TensorType> {
        vec![TensorType::new(spec.dtype, tensor_input(inputs, 0).shape.clone())]
    }

    /// Sizes of 1000 and more are refused (a limit of the "generated code").
    fn supports_cpu(&self, spec: &ToySpec) -> Result<(), String> {
        match spec.n {
            Some(n) if n >= 1000 => Err(format!("n = {n} is past the toy's 999")),
            _ => Ok(()),
        }
    }
}

fn toy(n: Option<usize>) -> (Compiled<Doubler>, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let spec = ToySpec { target: Target::Cpu, dtype: DType::F32, n };
    (Compiled::new(Doubler { spec, runs: runs.clone() }), runs)
}

fn x(n: usize) -> Tensor {
    Tensor::from_f32(DType::F32, &[n], &(0..n).map(|i| i as f32 + 0.5).collect::<Vec<_>>()).unwrap()
}

fn count() -> Tensor {
    Tensor::scalar_u32(1)
}

fn ctx() -> DeviceContextPtr {
    DeviceContextPtr::cpu(1).unwrap()
}

/// A poisoned output of `n` elements, and its bytes.
fn poisoned(n: usize) -> (Tensor, Vec<u8>) {
    let output = Tensor::from_f32(DType::F32, &[n], &vec![f32::NAN; n]).unwrap();
    let bytes = output.as_bytes().to_vec();
    (output, bytes)
}

#[test]
fn a_valid_call_runs_once_and_writes_its_output() {
    let (kernel, runs) = toy(Some(4));
    assert_eq!(kernel.key().to_string(), "toy_double.cpu.f32.n4");
    assert_eq!(kernel.implementation(), "toy");
    assert_eq!(kernel.check(&[&x(4), &count()], &[]).unwrap(), vec![(DType::F32, vec![4])]);
    let (output, _) = poisoned(4);
    let mut outputs = [output];
    kernel.run(&[&x(4), &count()], &mut [], &mut outputs, &ctx()).unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(outputs[0].to_f32_vec().unwrap(), [1.0, 3.0, 5.0, 7.0]);
}

/// What a refused call's error must match.
type ErrorTest = fn(&Error) -> bool;

#[test]
fn refused_calls_name_what_is_wrong_and_never_run() {
    let (kernel, runs) = toy(Some(4));
    let strided = {
        let t = Tensor::from_f32(DType::F32, &[2, 4], &[1.0; 8]).unwrap();
        t.permuted(&[1, 0]).unwrap()
    };
    let bf16 = Tensor::from_f32(DType::BF16, &[4], &[1.0; 4]).unwrap();
    let (good_x, good_count) = (x(4), count());
    let cases: Vec<(&str, Vec<&Tensor>, usize, ErrorTest)> = vec![
        (
            "one tensor short",
            vec![&good_x],
            1,
            |e| matches!(e, Error::KernelArguments { got, .. } if got == &[1, 0, 1]),
        ),
        ("no output", vec![&good_x, &good_count], 0, |e| matches!(e, Error::KernelArguments { .. })),
        (
            "x of another dtype",
            vec![&bf16, &good_count],
            1,
            |e| matches!(e, Error::DTypeMismatch { arg, .. } if arg == "x"),
        ),
        (
            "count of another dtype",
            vec![&good_x, &good_x],
            1,
            |e| matches!(e, Error::DTypeMismatch { arg, expected: DType::U32, .. } if arg == "count"),
        ),
        ("a strided x", vec![&strided, &good_count], 1, |e| matches!(e, Error::NotContiguous { .. })),
    ];
    for (what, tensors, outputs, expected) in cases {
        let (output, bytes) = poisoned(4);
        let mut outputs: Vec<Tensor> = std::iter::repeat_n(output, outputs).collect();
        let err = kernel.run(&tensors, &mut [], &mut outputs, &ctx()).unwrap_err();
        assert!(expected(&err), "{what}: {err}");
        assert!(outputs.iter().all(|o| o.as_bytes() == bytes), "{what}: an output was written");
        if matches!(err, Error::KernelArguments { .. }) {
            assert!(err.to_string().contains("2 tensors (x, count), 0 KV caches and 1 outputs"), "{what}: {err}");
        }
    }
    let err = kernel.check(&[&x(5), &count()], &[]).unwrap_err();
    assert!(matches!(err, Error::NotBuiltFor { arg: "x", .. }), "{err}");
    assert!(err.to_string().contains("baked into toy_double.cpu.f32.n4"), "{err}");
    assert_eq!(runs.load(Ordering::SeqCst), 0, "a refused call ran");
}

#[test]
fn outputs_of_another_shape_or_dtype_are_refused_before_the_run() {
    let (kernel, runs) = toy(None);
    for (output, arg_error) in [
        (Tensor::from_f32(DType::F32, &[3], &[0.0; 3]).unwrap(), "output"),
        (Tensor::from_f32(DType::BF16, &[4], &[0.0; 4]).unwrap(), "output"),
    ] {
        let bytes = output.as_bytes().to_vec();
        let mut outputs = [output];
        let err = kernel.run(&[&x(4), &count()], &mut [], &mut outputs, &ctx()).unwrap_err();
        assert!(err.to_string().contains(arg_error), "{err}");
        assert_eq!(outputs[0].as_bytes(), bytes);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[test]
fn params_are_declared_once() {
    let names: Vec<&str> = ToyParams::SPECS.iter().map(|p| p.name).collect();
    assert_eq!(names, ["dtype", "rounding", "factor", "limit"]);
    assert_eq!(ToyParams::SPECS.iter().map(|p| p.required).collect::<Vec<_>>(), [true, true, false, false]);
    assert_eq!(ToyParams::SPECS[1].kind, ParamKind::Choice(&["nearest", "down"]));
    assert_eq!(ToyParams::SPECS[3].kind, ParamKind::SIZE);
    let full = ToyParams { dtype: DType::BF16, rounding: Rounding::Down, factor: Some(0.5), limit: Some(3) };
    let written = full.to_params();
    assert_eq!(written["rounding"], ParamValue::Str("down".into()));
    assert_eq!(ToyParams::read(&written).unwrap(), full);
    let bare = ToyParams { factor: None, limit: None, ..full };
    assert_eq!(bare.to_params().len(), 2, "absent optional parameters write no entry");
    assert_eq!(ToyParams::read(&bare.to_params()).unwrap(), bare);
    let mut bad = written.clone();
    bad.insert("rounding".into(), ParamValue::Str("up".into()));
    assert!(ToyParams::read(&bad).unwrap_err().to_string().contains("one of nearest, down"));
    bad.remove("dtype");
    assert!(ToyParams::read(&bad).unwrap_err().to_string().contains("dtype"));
    let mut huge = written;
    huge.insert("factor".into(), ParamValue::Float(1e300));
    assert!(ToyParams::read(&huge).is_err(), "an f32 parameter refuses what f32 cannot hold");
}

#[test]
fn a_defined_op_specializes_to_a_key_holding_its_spec_and_builds_from_it() {
    let mut registry = OpRegistry::new();
    registry.register(Arc::new(Defined(ToyOp))).unwrap();
    let mut b = GraphBuilder::new("toy", &registry);
    let input = b.input("x", DType::F32, &[Dim::from("n")]).unwrap();
    let count = b.input("count", DType::U32, &[]).unwrap();
    let params = ToyParams { dtype: DType::F32, rounding: Rounding::Nearest, factor: None, limit: None };
    let out = kvjit_op::add_node::<ToyOp, 2>(&mut b, &params, [input, count]).unwrap()[0];
    b.output("y", out).unwrap();
    let graph = b.finish().unwrap();

    let bindings = BTreeMap::from([("n".to_string(), 6)]);
    let cpu = specialize(&graph, &registry, Backend::Cpu(CodeTier::Cranelift), &bindings).unwrap();
    let key = &cpu.kernel_keys()[0];
    assert_eq!(key.to_string(), "toy_double.cpu.f32.n6");
    assert_eq!(key.spec::<ToySpec>(), Some(&ToySpec { target: Target::Cpu, dtype: DType::F32, n: Some(6) }));
    for implementation in [KernelImpl::Fast, KernelImpl::Reference] {
        let options = BuildOptions { implementation, ..BuildOptions::default() };
        let kernel = Defined(ToyOp).build(key, &[None, None], &options).unwrap();
        assert_eq!(kernel.key(), key);
        let expected = if implementation == KernelImpl::Fast { "toy" } else { "reference" };
        assert_eq!(kernel.implementation(), expected, "the default reference is the spec's reference");
        let mut outputs = [Tensor::zeros(DType::F32, &[6]).unwrap()];
        kernel.run(&[&x(6), &Tensor::scalar_u32(1)], &mut [], &mut outputs, &ctx()).unwrap();
        assert_eq!(outputs[0].to_f32_vec().unwrap(), [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]);
    }

    // A size the CPU kernel does not serve: refused at specialize.
    let err =
        specialize(&graph, &registry, Backend::Cpu(CodeTier::Cranelift), &BTreeMap::from([("n".to_string(), 1000)]))
            .unwrap_err()
            .to_string();
    assert!(err.contains("n = 1000 is past the toy's 999"), "{err}");

    // A target the op does not serve: refused at specialize, and by the builder.
    let err = specialize(&graph, &registry, Backend::Cuda, &bindings).unwrap_err().to_string();
    assert!(err.contains("no CUDA variant for op toy.double yet"), "{err}");
    let cuda_key = ToySpec { target: Target::Cuda, dtype: DType::F32, n: Some(6) }.key();
    let err = Defined(ToyOp).build(&cuda_key, &[], &BuildOptions::default()).err().unwrap().to_string();
    assert!(err.contains("no CUDA variant for op toy.double yet"), "{err}");

    // A key another op made is refused, not misread.
    let foreign = KernelKey::new("toy_double", Target::Cpu, DType::F32).with("n", KeyField::Static(6));
    assert_eq!(foreign, *key, "the same name");
    assert!(Defined(ToyOp).supports(&foreign).unwrap_err().contains("not a key op toy.double made"));
    assert!(Defined(ToyOp).build(&foreign, &[], &BuildOptions::default()).is_err());
}
