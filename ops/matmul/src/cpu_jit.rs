//! The matmul kernels' CPU code: the platform's GEMM driver
//! ([`kvjit_op::gemm::GemmEmitter`]) with the epilogue of the spec
//! ([`MatmulStore`]), the constant weight(s) packed once at build (or taken
//! prepared from an artifact), one work item per panel group.

use std::mem::offset_of;
use std::sync::Arc;

use kvjit_core::{CodeTier, DType, Error, KernelSpec, PagedKVCacheCollection, PreparedConstant, Result, Tensor};
use kvjit_jit::cranelift_codegen::ir::{InstBuilder, Value};
use kvjit_jit::cranelift_frontend::FunctionBuilder;
use kvjit_jit::ir::addr::{self, Displacements, Size};
use kvjit_jit::ir::math::silu_f32x4;
use kvjit_jit::{CaptureText, JitError, JitFunction, compile_kernel, compile_or_fetch};
use kvjit_op::gemm::{
    self, Epilogue as GemmEpilogue, GemmBases, GemmEmitter, PackedWeights, PanelAt, PanelLayout, Schedule, Scratch,
    SegmentBounds, load_columns, store_columns,
};
use kvjit_op::{BoxError, Call, Constants, CpuBuild, CpuKernel, OpKernel, check_signature};
use kvjit_runtime::{CodeInfo, ConstantInput, DeviceContextPtr};

use crate::spec::{Epilogue, MatmulCall, MatmulContract, MatmulSpec};
use crate::{MatmulError, MatmulOp};
use kvjit_op::Op;

kvjit_op::kernel_args! {
    /// The GEMM kernel's arguments; the work items of a launch are panel
    /// groups.
    pub(crate) struct MatmulArgs {
        /// Activations as f32 (see [`gemm::activations`]).
        x,
        /// The packed weight(s).
        w,
        /// The result, `[M, N]` of the dtype.
        out,
        /// The epilogue's operand `other`, `[M, N]` of the dtype (0: none).
        other,
        /// Rows M (read when the key leaves them to run time).
        m,
        /// The activations' tile step ([`GemmBases::x_step`]).
        x_step,
    }
}

/// The packed layout of `spec`'s weight(s) on `tier`: one segment of N
/// columns, one panel per weight in each group (two for SwiGLU).
pub fn layout(spec: &MatmulSpec, tier: CodeTier) -> PanelLayout {
    let panel_columns = Schedule::of(tier).panel_columns;
    PanelLayout::new("matmul", &[spec.n], spec.k(), panel_columns, spec.epilogue.weights(), spec.orientation)
}

/// Refuse specs whose offsets the generated code could not form: the
/// panels, the rows of `a` and of the result in i64 byte offsets, and the
/// constant displacements in i32.
fn addressable(spec: &MatmulSpec) -> Result<(), JitError> {
    let size = spec.dtype.size_bytes();
    // Panels of f32 at most (the Cranelift tier's dequantized blocks).
    let panel_size = spec.weights.size_bytes().max(4);
    let groups = spec.n.div_ceil(gemm::NR);
    let output_fits = spec.rows.rows.is_none_or(|m| {
        m.checked_mul(spec.n).and_then(|e| e.checked_mul(size)).is_some_and(|b| i64::try_from(b).is_ok())
    });
    if !(output_fits && gemm::addressable(spec.k(), panel_size, groups, spec.epilogue.weights(), spec.rows.rows)) {
        return Err(JitError::Unsupported {
            key: spec.key().to_string(),
            reason: "its sizes overflow the offsets the kernel computes".into(),
        });
    }
    gemm::displacements(&spec.key(), spec.k(), 0).map(drop)
}

/// Compile (or fetch from the process-wide registry) the code of a CPU
/// `spec` on the tier it names.
fn compile(spec: &MatmulSpec, tier: CodeTier, capture: CaptureText) -> Result<Arc<JitFunction>, JitError> {
    let key = spec.key();
    compile_or_fetch(&key, capture, || {
        addressable(spec)?;
        let disp = gemm::displacements(&key, spec.k(), 0)?;
        let layout = layout(spec, tier);
        compile_kernel(&key, capture, |b, params| {
            let field = |b: &mut FunctionBuilder, offset: usize| params.field(b, offset);
            let bases = GemmBases {
                x: field(b, offset_of!(MatmulArgs, x)),
                w: field(b, offset_of!(MatmulArgs, w)),
                x_step: field(b, offset_of!(MatmulArgs, x_step)),
            };
            let store = MatmulStore {
                dtype: spec.dtype,
                n: spec.n,
                epilogue: spec.epilogue,
                disp,
                out: field(b, offset_of!(MatmulArgs, out)),
                other: spec.epilogue.has_operand().then(|| field(b, offset_of!(MatmulArgs, other))),
            };
            let m_arg = field(b, offset_of!(MatmulArgs, m));
            let weights = spec.epilogue.weights();
            let panels = layout.panel_dtype(spec.weights);
            let emitter = GemmEmitter {
                tier,
                dtype: panels,
                k: Size::Known(spec.k()),
                m: spec.rows.rows,
                weights,
                disp,
                bases,
                scratch: Scratch::new(b, tier, panels, weights),
                epilogue: &store,
            };
            emitter.emit(b, m_arg, params.begin, params.end, &SegmentBounds::of(&layout));
        })
    })
}

/// The matmul epilogue: a row of C (and of C' for SwiGLU), the epilogue's
/// arithmetic in f32, stored once to the result in its dtype.
struct MatmulStore {
    dtype: DType,
    n: usize,
    epilogue: Epilogue,
    disp: Displacements,
    out: Value,
    other: Option<Value>,
}

impl GemmEpilogue for MatmulStore {
    fn store_row(&self, b: &mut FunctionBuilder, r: Value, panel: &PanelAt, vectors: &[Value]) {
        let Size::Known(width) = panel.width else { unreachable!("a matmul bakes N in") };
        let size = self.dtype.size_bytes();
        let element = b.ins().imul_imm_s(r, self.n as i64);
        let element = b.ins().iadd(element, panel.column);
        let out = addr::element(b, self.out, element, size);
        let per_weight = vectors.len() / self.epilogue.weights();
        let (c, sibling) = vectors.split_at(per_weight);
        let operand = match self.other {
            Some(other) => {
                let base = addr::element(b, other, element, size);
                load_columns(b, self.disp, self.dtype, base, width, per_weight)
            }
            None => sibling.to_vec(),
        };
        let values: Vec<Value> = c
            .iter()
            .enumerate()
            .map(|(v, &c)| match self.epilogue {
                Epilogue::None => c,
                Epilogue::Silu => silu_f32x4(b, c),
                Epilogue::Add => b.ins().fadd(c, operand[v]),
                Epilogue::Mul => b.ins().fmul(c, operand[v]),
                Epilogue::SiluMul | Epilogue::SwiGlu => {
                    let s = silu_f32x4(b, c);
                    b.ins().fmul(s, operand[v])
                }
            })
            .collect();
        store_columns(b, self.disp, self.dtype, out, panel.width, &values);
    }
}

/// A matmul kernel of spec `S` (`mo.matmul` and its fused forms) as
/// Cranelift code on the spec's tier.
pub struct JitKernel<S> {
    spec: S,
    tier: CodeTier,
    layout: PanelLayout,
    code: Arc<JitFunction>,
    /// The graph's constant weight(s), packed at build (or prepared). Calls
    /// whose weights are those very tensors, or the packed one, use them;
    /// any other weights are packed per call.
    constant: Option<PackedWeights>,
}

impl<S: MatmulContract> JitKernel<S> {
    /// Compile (or fetch) the code of a CPU `spec` on the tier it names,
    /// packing `weights` (the graph's constants, one per sibling) now.
    pub fn new(spec: S, weights: Option<Vec<Arc<Tensor>>>, capture: CaptureText) -> Result<Self, JitError> {
        let gemm_spec = spec.gemm();
        let tier = gemm::code_tier(gemm_spec.tier(), &gemm_spec.key())?;
        addressable(gemm_spec)?;
        let layout = layout(gemm_spec, tier);
        let code = compile(gemm_spec, tier, capture)?;
        // Weights a call could not pass (another dtype or shape, or strided:
        // the call's check refuses them) are not packed, and the kernel packs
        // whatever a call passes instead.
        let packable = |w: &Arc<Tensor>| {
            w.dtype() == gemm_spec.weights && w.shape() == gemm_spec.weight_shape() && w.is_contiguous()
        };
        let constant = weights
            .filter(|ws| ws.iter().all(packable))
            .map(|ws| PackedWeights::pack(&layout, ws).expect("contiguous float weights of the layout's shape pack"));
        Ok(Self { spec, tier, layout, code, constant })
    }

    /// Like [`new`](Self::new), with the weight already packed (a prepared
    /// constant from a compiled artifact) — one weight only. A weight in
    /// another layout, dtype or size is refused.
    pub fn with_prepared(spec: S, prepared: &PreparedConstant, capture: CaptureText) -> Result<Self> {
        let gemm_spec = *spec.gemm();
        let mut kernel = Self::new(spec, None, capture).map_err(|e| Error::op(MatmulOp::NAME, e))?;
        let panels = kernel.layout.panel_dtype(gemm_spec.weights);
        let constant = PackedWeights::prepared(&kernel.layout, panels, prepared)
            .map_err(|(expected, got)| MatmulError::PreparedWeight { expected, got })?;
        kernel.constant = Some(constant);
        Ok(kernel)
    }

    /// The tier the code runs on.
    pub fn tier(&self) -> CodeTier {
        self.tier
    }

    /// The weights of a call, as tensors.
    fn weights<'t>(&self, tensors: &[&'t Tensor]) -> Vec<&'t Tensor> {
        tensors[1..=self.spec.gemm().epilogue.weights()].to_vec()
    }

    /// Run with the result written into `output`, bytes the caller owns (a
    /// test's guarded buffer, a benchmark's reused one), checked like
    /// `Kernel::run`: arity, dtypes and contiguity, the call contract, and
    /// `output`'s length against the result's bytes — nothing is written
    /// unless every check passes.
    pub fn run_into(&self, tensors: &[&Tensor], output: &mut [u8], ctx: &DeviceContextPtr) -> Result<()> {
        let dtype = self.spec.gemm().dtype;
        check_signature::<S>(dtype, tensors, &[], None)?;
        let checked = OpKernel::check(self, tensors, &[])?;
        let expected = checked.output.iter().product::<usize>() * dtype.size_bytes();
        if output.len() != expected {
            return Err(Error::ByteCount { dtype, shape: checked.output, expected, got: output.len() });
        }
        self.launch(&checked, tensors, output, ctx)
    }

    /// Run a call [`OpKernel::check`] accepted on exactly these `tensors`,
    /// into `output` (exactly the result's bytes).
    fn launch(
        &self,
        checked: &MatmulCall,
        tensors: &[&Tensor],
        output: &mut [u8],
        ctx: &DeviceContextPtr,
    ) -> Result<()> {
        let spec = self.spec.gemm();
        let rows = checked.rows;
        if rows == 0 {
            return Ok(());
        }
        let panels = self.layout.panel_dtype(spec.weights);
        let (x, x_step) = gemm::activations(tensors[0], rows, spec.k(), self.tier, panels);
        let weights = self.weights(tensors);
        let packed_now;
        let packed = match self.constant.as_ref().and_then(|c| c.panels_for(&weights)) {
            Some(panels) => panels,
            None => {
                packed_now = self.layout.pack(&weights)?;
                &packed_now
            }
        };
        let other = match spec.epilogue.has_operand() {
            true => tensors[2].as_bytes().as_ptr() as u64,
            false => 0,
        };
        let args = MatmulArgs {
            x: x.as_ptr() as u64,
            w: packed.as_bytes().as_ptr() as u64,
            out: output.as_mut_ptr() as u64,
            other,
            m: rows as u64,
            x_step: x_step as u64,
        };
        // SAFETY: `self.code` was compiled by `compile` for this spec (its
        // dtype, weight format, K, N, row count if baked, epilogue and tier), reading
        // `MatmulArgs` at its fields' offsets. The check (`check_call`,
        // after the platform's dtype and contiguity checks) established `a`
        // contiguous `[rows, K]` of the dtype (and the baked row count), the
        // weights of the spec's shape and format (packed here into `self.layout`, or
        // the kernel's own panels of that layout), `other` (if the epilogue
        // reads it) of the result's shape `[rows, N]`, and the caller
        // established `output` holds exactly `rows·N` elements (`Kernel::run`
        // checked the output tensor against `outputs`, `run_into` the
        // buffer's length). For any panel-group range the code reads `x`
        // (`rows·K` f32, or ⌈rows/x_step⌉·x_step·K packed by
        // `activations`; one row quantized in K/32 blocks for block panels'
        // integer GEMV, from the same row count the code branches on), panels
        // inside the packed weight, and reads `other`
        // / writes the output only at `r·N + column` for `r < rows`,
        // `column < N`; different groups write different columns. Every
        // buffer outlives the launch.
        unsafe { kvjit_jit::launch(&self.code, &args, self.layout.total_panels(), ctx) };
        Ok(())
    }
}

impl<S: MatmulContract> CpuKernel for JitKernel<S> {
    fn supported(spec: &S) -> Result<(), JitError> {
        addressable(spec.gemm())
    }

    fn build(spec: &S, constants: &Constants, build: &CpuBuild) -> Result<Self, BoxError> {
        let weights = spec.gemm().epilogue.weights();
        let inputs: Vec<Option<&ConstantInput>> =
            (1..=weights).map(|i| constants.get(i).and_then(Option::as_ref)).collect();
        Ok(match inputs.as_slice() {
            [Some(ConstantInput::Prepared(prepared))] => Self::with_prepared(*spec, prepared, build.capture)?,
            _ => {
                let plain: Option<Vec<Arc<Tensor>>> =
                    inputs.iter().map(|c| c.and_then(ConstantInput::plain).cloned()).collect();
                Self::new(*spec, plain, build.capture)?
            }
        })
    }
}

impl<S: MatmulContract> OpKernel for JitKernel<S> {
    type Spec = S;
    const IMPLEMENTATION: &'static str = "jit";

    fn spec(&self) -> &S {
        &self.spec
    }

    /// The spec's check; a call may pass the kernel's packed weight itself.
    fn check(&self, tensors: &[&Tensor], _caches: &[&PagedKVCacheCollection]) -> Result<MatmulCall> {
        let packed = self.constant.as_ref().map(|c| &**c.packed());
        self.spec.gemm().check_call(tensors, packed)
    }

    fn run(&self, checked: MatmulCall, call: Call<'_, '_>, ctx: &DeviceContextPtr) -> Result<()> {
        self.launch(&checked, call.tensors, call.outputs[0].as_bytes_mut(), ctx)
    }

    fn code_info(&self) -> CodeInfo {
        self.code.code_info()
    }

    /// The packed weight, when the spec has one weight (SwiGLU's two
    /// siblings share one packed tensor that no single constant is, so an
    /// artifact stores them plain).
    fn prepared_constants(&self) -> Vec<(usize, PreparedConstant)> {
        match (&self.constant, self.spec.gemm().epilogue.weights()) {
            (Some(constant), 1) => {
                vec![(
                    1,
                    PreparedConstant {
                        layout: self.layout.id(self.layout.panel_dtype(self.spec.gemm().weights)),
                        data: constant.packed().clone(),
                    },
                )]
            }
            _ => Vec::new(),
        }
    }
}

/// The reference kernel of a matmul spec.
pub type ReferenceKernel<S = MatmulSpec> = kvjit_op::Reference<S>;
