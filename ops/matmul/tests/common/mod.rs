//! What the tests share: the six forms of the op (`mo.matmul` and its
//! fused epilogues and siblings) as specs and kernels, random non-zero
//! inputs, runs of the JIT into NaN-poisoned outputs between canary guards
//! and of the reference into poisoned tensors, and the tolerance of the
//! JIT against the f64 reference, element by element.

#![allow(dead_code, reason = "each test file uses a part of the common module")]

use std::sync::Arc;

use kvjit_core::{Backend, CodeTier, DType, PreparedConstant, Tensor};
use kvjit_graph::OpRegistry;
use kvjit_jit::CaptureText;
use kvjit_jit::microkernel::avx2_available;
use kvjit_op::gemm::WeightOrientation;
use kvjit_op::rows::Rows;
use kvjit_op::{Compiled, Defined, OpKernel};
use kvjit_op_matmul::{
    Epilogue, EpilogueMatmulSpec, JitKernel, MatmulEpilogueOp, MatmulOp, MatmulSiluOp, MatmulSpec, ReferenceKernel,
    SwigluMatmulOp, SwigluMatmulSpec,
};
use kvjit_op_silu::reference::silu;
use kvjit_runtime::{DeviceContextPtr, Kernel};
use kvjit_testkit::calls::run_poisoned;
use kvjit_testkit::tolerance::{F32_TOL_PER_K, ulp};
use kvjit_testkit::values::signed_magnitudes;
use kvjit_testkit::{Guarded, nan_bytes};
use rand::Rng;

/// A registry of the four ops.
pub fn registry() -> OpRegistry {
    let mut registry = OpRegistry::new();
    registry.register(Arc::new(Defined(MatmulOp))).unwrap();
    registry.register(Arc::new(Defined(MatmulSiluOp))).unwrap();
    registry.register(Arc::new(Defined(MatmulEpilogueOp))).unwrap();
    registry.register(Arc::new(Defined(SwigluMatmulOp))).unwrap();
    registry
}

/// Canary bytes on each side of a JIT output.
pub const GUARD: usize = 64;

/// Every dtype the op takes.
pub const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// Both weight orientations.
pub const ORIENTATIONS: [WeightOrientation; 2] = [WeightOrientation::NK, WeightOrientation::KN];

/// Every epilogue: `mo.matmul`, `kvjit.matmul_silu`, the three of
/// `kvjit.matmul_epilogue` and `kvjit.swiglu_matmul`.
pub const EPILOGUES: [Epilogue; 6] =
    [Epilogue::None, Epilogue::Silu, Epilogue::Add, Epilogue::Mul, Epilogue::SiluMul, Epilogue::SwiGlu];

/// The CPU tiers this machine runs: the Cranelift tier always, the 256-bit
/// tier where the CPU has AVX2, FMA and F16C (said once on stderr where it
/// does not).
pub fn tiers() -> Vec<CodeTier> {
    if avx2_available() {
        vec![CodeTier::Cranelift, CodeTier::Avx2]
    } else {
        eprintln!("the avx2 tier is skipped: this CPU has no AVX2/FMA/F16C");
        vec![CodeTier::Cranelift]
    }
}

/// The spec of a GEMM `[rows, K] × weight → [rows, N]` with `epilogue`.
pub fn spec(
    epilogue: Epilogue,
    dtype: DType,
    tier: CodeTier,
    orientation: WeightOrientation,
    (k, n): (usize, usize),
    rows: Option<usize>,
) -> MatmulSpec {
    MatmulSpec {
        backend: Backend::Cpu(tier),
        dtype,
        weights: dtype,
        rows: Rows { width: k, rows },
        n,
        orientation,
        epilogue,
    }
}

pub fn ctx(threads: usize) -> DeviceContextPtr {
    DeviceContextPtr::cpu(threads).unwrap()
}

/// The JIT kernel of a spec, of the wrapper its epilogue's call takes
/// (`[a, b]`, `[a, b, other]` or `[a, gate, up]`), behind `Compiled`.
pub enum Jit {
    /// `mo.matmul`, `kvjit.matmul_silu`.
    Gemm(Compiled<JitKernel<MatmulSpec>>),
    /// `kvjit.matmul_epilogue`.
    Operand(Compiled<JitKernel<EpilogueMatmulSpec>>),
    /// `kvjit.swiglu_matmul`.
    Swiglu(Compiled<JitKernel<SwigluMatmulSpec>>),
}

impl Jit {
    /// Compile (or fetch) the kernel, packing `weights` as its graph
    /// constant(s) if given.
    pub fn new(spec: MatmulSpec, weights: Option<Vec<Arc<Tensor>>>) -> Self {
        let capture = CaptureText::default();
        let fail = |e: kvjit_jit::JitError| -> ! { panic!("{spec:?}: {e}") };
        match spec.epilogue {
            Epilogue::None | Epilogue::Silu => {
                Jit::Gemm(Compiled::new(JitKernel::new(spec, weights, capture).unwrap_or_else(|e| fail(e))))
            }
            Epilogue::SwiGlu => Jit::Swiglu(Compiled::new(
                JitKernel::new(SwigluMatmulSpec(spec), weights, capture).unwrap_or_else(|e| fail(e)),
            )),
            _ => Jit::Operand(Compiled::new(
                JitKernel::new(EpilogueMatmulSpec(spec), weights, capture).unwrap_or_else(|e| fail(e)),
            )),
        }
    }

    /// The kernel with its weight taken already packed.
    pub fn with_prepared(spec: MatmulSpec, prepared: &PreparedConstant) -> kvjit_core::Result<Self> {
        let capture = CaptureText::default();
        Ok(match spec.epilogue {
            Epilogue::None | Epilogue::Silu => {
                Jit::Gemm(Compiled::new(JitKernel::with_prepared(spec, prepared, capture)?))
            }
            Epilogue::SwiGlu => {
                Jit::Swiglu(Compiled::new(JitKernel::with_prepared(SwigluMatmulSpec(spec), prepared, capture)?))
            }
            _ => Jit::Operand(Compiled::new(JitKernel::with_prepared(EpilogueMatmulSpec(spec), prepared, capture)?)),
        })
    }

    /// The kernel behind the runtime's interface.
    pub fn kernel(&self) -> &dyn Kernel {
        match self {
            Jit::Gemm(k) => k,
            Jit::Operand(k) => k,
            Jit::Swiglu(k) => k,
        }
    }

    /// `JitKernel::run_into`.
    pub fn run_into(&self, tensors: &[&Tensor], output: &mut [u8], ctx: &DeviceContextPtr) -> kvjit_core::Result<()> {
        match self {
            Jit::Gemm(k) => k.kernel().run_into(tensors, output, ctx),
            Jit::Operand(k) => k.kernel().run_into(tensors, output, ctx),
            Jit::Swiglu(k) => k.kernel().run_into(tensors, output, ctx),
        }
    }

    /// `OpKernel::prepared_constants`.
    pub fn prepared_constants(&self) -> Vec<(usize, PreparedConstant)> {
        match self {
            Jit::Gemm(k) => k.kernel().prepared_constants(),
            Jit::Operand(k) => k.kernel().prepared_constants(),
            Jit::Swiglu(k) => k.kernel().prepared_constants(),
        }
    }

    /// The tier the code runs on.
    pub fn tier(&self) -> CodeTier {
        match self {
            Jit::Gemm(k) => k.kernel().tier(),
            Jit::Operand(k) => k.kernel().tier(),
            Jit::Swiglu(k) => k.kernel().tier(),
        }
    }
}

/// The reference kernel of `spec`'s form, for any row count.
pub fn reference(spec: MatmulSpec) -> Arc<dyn Kernel> {
    let spec = MatmulSpec { rows: Rows { rows: None, ..spec.rows }, ..spec };
    match spec.epilogue {
        Epilogue::None | Epilogue::Silu => Arc::new(Compiled::new(ReferenceKernel::new(spec))),
        Epilogue::SwiGlu => Arc::new(Compiled::new(kvjit_op::Reference::new(SwigluMatmulSpec(spec)))),
        _ => Arc::new(Compiled::new(kvjit_op::Reference::new(EpilogueMatmulSpec(spec)))),
    }
}

/// A call's tensors: `a`, the weight(s) and, for an epilogue with an
/// operand, `other`.
#[derive(Clone, Debug)]
pub struct Inputs {
    pub a: Tensor,
    pub weights: Vec<Tensor>,
    pub other: Option<Tensor>,
}

impl Inputs {
    /// In call order.
    pub fn tensors(&self) -> Vec<&Tensor> {
        let mut t = vec![&self.a];
        t.extend(&self.weights);
        t.extend(&self.other);
        t
    }

    /// The result's shape: `a`'s with N last.
    pub fn output_shape(&self, spec: &MatmulSpec) -> Vec<usize> {
        let mut shape = self.a.shape().to_vec();
        *shape.last_mut().unwrap() = spec.n;
        shape
    }
}

/// Random values of `dtype`, magnitudes in [1/4, 1) with random signs:
/// never zero (an unwritten or dropped term stands out).
pub fn random(rng: &mut impl Rng, dtype: DType, shape: &[usize]) -> Tensor {
    signed_magnitudes(rng, dtype, shape, 0.25, 1.0)
}

/// Random inputs of `spec` with `a` of shape `[leading..., K]`.
pub fn inputs(rng: &mut impl Rng, spec: &MatmulSpec, leading: &[usize]) -> Inputs {
    let mut a_shape = leading.to_vec();
    a_shape.push(spec.k());
    let a = random(rng, spec.dtype, &a_shape);
    let weights = (0..spec.epilogue.weights()).map(|_| random(rng, spec.dtype, &spec.weight_shape())).collect();
    let mut out_shape = leading.to_vec();
    out_shape.push(spec.n);
    let other = spec.epilogue.has_operand().then(|| random(rng, spec.dtype, &out_shape));
    Inputs { a, weights, other }
}

/// The JIT's result, written into a NaN-poisoned buffer between canary
/// guards (checked) by `run_into` on `threads` threads.
pub fn run_jit(jit: &Jit, tensors: &[&Tensor], out_shape: &[usize], threads: usize) -> Tensor {
    let dtype = tensors[0].dtype();
    let numel = out_shape.iter().product();
    let mut out = Guarded::new(GUARD, &nan_bytes(dtype, numel), GUARD);
    jit.run_into(tensors, out.body_mut(), &ctx(threads)).unwrap_or_else(|e| panic!("the JIT refused: {e}"));
    out.assert_guards(&format!("{} {dtype} {out_shape:?}, {threads} threads", jit.kernel().key()));
    Tensor::from_le_bytes(dtype, out_shape, out.body()).unwrap()
}

/// The reference's result (through the platform's `Kernel`, output
/// poisoned first).
pub fn run_reference(spec: MatmulSpec, tensors: &[&Tensor], out_shape: &[usize]) -> Tensor {
    run_poisoned(&*reference(spec), tensors, spec.dtype, out_shape, 1)
}

/// Relative error of one f32 operation of an epilogue after the GEMM,
/// SiLU's included: 8 units of f32 roundoff (SiLU is within 3 ulps, 6
/// units, of the exact value; a product or sum after it rounds once more).
pub const EPILOGUE_ROUNDOFF: f64 = 8.0 / (1u64 << 24) as f64;

/// The largest slope of SiLU (at x ≈ 2.4: 1.0998): how far an error in C
/// moves silu(C).
pub const SILU_SLOPE: f64 = 1.1;

/// How far the JIT's element may be from the reference's: the f32
/// accumulation error of each GEMM (`F32_TOL_PER_K · K · Σ|a·w|`, the
/// textbook bound of a K-term sum with 4 units of roundoff per term)
/// carried through the epilogue's arithmetic (C's error times `|other|`, or
/// SiLU's slope; SwiGLU both sums' errors), plus [`EPILOGUE_ROUNDOFF`] of
/// the exact result, plus one spacing of the dtype at the larger of the
/// two values (both are rounded to it: the reference from the exact value,
/// the JIT from its f32 value).
pub fn bound(spec: &MatmulSpec, terms: &Terms, got: f64, want: f64) -> f64 {
    let per_k = F32_TOL_PER_K * spec.k() as f64;
    let (dc, du) = (per_k * terms.abs_sum, per_k * terms.abs_sum_up);
    let silu_error = SILU_SLOPE * dc + EPILOGUE_ROUNDOFF * silu(terms.c).abs();
    let carried = match spec.epilogue {
        Epilogue::None => dc,
        Epilogue::Silu => silu_error,
        Epilogue::Add => dc,
        Epilogue::Mul => dc * terms.operand.abs(),
        Epilogue::SiluMul => silu_error * terms.operand.abs(),
        Epilogue::SwiGlu => silu_error * (terms.operand.abs() + du) + silu(terms.c).abs() * du,
    };
    let exact = spec.epilogue.apply(terms.c, terms.operand);
    carried + EPILOGUE_ROUNDOFF * exact.abs() + ulp(spec.dtype, got.abs().max(want.abs()))
}

/// One element's GEMM, exactly (f64): C, `Σ|a·w|`, and the epilogue's
/// operand (`other`, or C' = a·up with its own `Σ|a·up|` for SwiGLU).
#[derive(Clone, Copy, Debug)]
pub struct Terms {
    pub c: f64,
    pub abs_sum: f64,
    pub operand: f64,
    pub abs_sum_up: f64,
}

/// Every element's [`Terms`], row-major `[M, N]`, from the call's inputs
/// (as their dtype holds them).
pub fn terms(spec: &MatmulSpec, inputs: &Inputs) -> Vec<Terms> {
    let (k, n) = (spec.k(), spec.n);
    let f64s = |t: &Tensor| -> Vec<f64> { t.to_f32_vec().unwrap().into_iter().map(f64::from).collect() };
    let a = f64s(&inputs.a);
    let weights: Vec<Vec<f64>> = inputs.weights.iter().map(f64s).collect();
    let other = inputs.other.as_ref().map(f64s);
    let at = |w: &[f64], col: usize, kk: usize| match spec.orientation {
        WeightOrientation::NK => w[col * k + kk],
        WeightOrientation::KN => w[kk * n + col],
    };
    let dot = |row: &[f64], w: &[f64], col: usize| -> (f64, f64) {
        row.iter().enumerate().fold((0.0, 0.0), |(s, abs), (kk, &x)| {
            let p = x * at(w, col, kk);
            (s + p, abs + p.abs())
        })
    };
    let rows = a.len() / k;
    let mut out = Vec::with_capacity(rows * n);
    for r in 0..rows {
        let row = &a[r * k..][..k];
        for col in 0..n {
            let (c, abs_sum) = dot(row, &weights[0], col);
            let (operand, abs_sum_up) = match (&other, weights.get(1)) {
                (Some(other), _) => (other[r * n + col], 0.0),
                (None, Some(up)) => dot(row, up, col),
                (None, None) => (0.0, 0.0),
            };
            out.push(Terms { c, abs_sum, operand, abs_sum_up });
        }
    }
    out
}

/// Whether every element of the JIT's `got` is within [`bound`] of the
/// reference's `want` (no NaN: the poison was overwritten): the worst error
/// relative to its bound, or the first element past it.
pub fn check_close(spec: &MatmulSpec, inputs: &Inputs, got: &Tensor, want: &Tensor) -> Result<f64, String> {
    assert_eq!((got.dtype(), got.shape()), (want.dtype(), want.shape()));
    let terms = terms(spec, inputs);
    let (g, w) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
    assert_eq!(g.len(), terms.len());
    let mut worst = 0f64;
    for (i, ((&g, &w), t)) in g.iter().zip(&w).zip(&terms).enumerate() {
        let (g, w) = (f64::from(g), f64::from(w));
        let (row, column) = (i / spec.n, i % spec.n);
        if !w.is_finite() {
            return Err(format!("the reference gave {w} at [{row}, {column}]"));
        }
        let bound = bound(spec, t, g, w);
        let error = (g - w).abs();
        if error.is_nan() || error > bound {
            return Err(format!("[{row}, {column}] = {g}, reference {w}: error {error:e} > allowed {bound:e} ({t:?})"));
        }
        worst = worst.max(error / bound);
    }
    Ok(worst)
}

/// Assert [`check_close`], naming `what`; returns the worst error relative
/// to its bound.
pub fn assert_close(spec: &MatmulSpec, inputs: &Inputs, got: &Tensor, want: &Tensor, what: &str) -> f64 {
    check_close(spec, inputs, got, want).unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// Assert two results are the same bytes.
pub fn assert_same_bytes(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!((got.dtype(), got.shape()), (want.dtype(), want.shape()), "{what}");
    if got.as_bytes() != want.as_bytes() {
        let (g, w) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
        let differ = g.iter().zip(&w).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        let first = g.iter().zip(&w).position(|(a, b)| a.to_bits() != b.to_bits()).unwrap();
        panic!("{what}: {differ} elements differ, first [{first}]: {} vs {}", g[first], w[first]);
    }
}

/// The spec's kernel key, for messages.
pub fn name(spec: &MatmulSpec) -> String {
    use kvjit_core::KernelSpec;
    spec.key().to_string()
}

/// The GEMM spec a kernel was made for.
pub fn spec_of(jit: &Jit) -> MatmulSpec {
    match jit {
        Jit::Gemm(k) => *OpKernel::spec(k.kernel()),
        Jit::Operand(k) => OpKernel::spec(k.kernel()).0,
        Jit::Swiglu(k) => OpKernel::spec(k.kernel()).0,
    }
}
