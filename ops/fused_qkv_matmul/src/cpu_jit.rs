//! The CPU kernel: machine code Cranelift emits for one [`FusedQkvSpec`].
//!
//! Everything the spec fixes is a constant in the code: K, the Q/K/V column
//! ranges, the K→V stride of the cache, dtypes, and — for a fully specialized
//! key — the row count M. The weight is packed once (at graph build when it
//! is a constant) into panels of [`NR`] columns, k-major (`[K][NR]`), one
//! run of panels per Q, K and V segment, each zero-padded to a whole panel.
//!
//! Schedule, for each thread's range of panels:
//!
//! ```text
//! for each block of MC rows:                  (X block stays in cache across panels)
//!   for each panel p in the thread's range:   (a [K][NR] weight panel, read from DRAM once per block)
//!     for each group of MR rows:              (register tile: MR×NR f32 accumulators)
//!       acc = Σ_k x[r, k] · w[p][k][:]        (F32X4 fma, k-split accumulators when MR is small)
//!       epilogue: Q columns → output[r, col]; K/V columns → blocks[row_offset[r] + col]
//!                 (skipped for padded rows: row_offset = -1), rounded to the dtype
//! ```
//!
//! With M ≤ MC (decode) every weight panel is read from memory exactly once
//! for all rows, and the panels are split between the worker threads: the
//! kernel streams the weight once. Each output element is computed by one
//! call with the same code whatever the thread count, so results are
//! bit-identical for any number of threads.
//!
//! The micro-kernel (`Emitter::emit_tile`) is one swappable piece: a wider tier
//! replaces it without touching packing, scheduling or the epilogue.

use std::sync::Arc;

use half::slice::HalfFloatSliceExt;
use kvjit_core::{
    DType, Error, KernelKey, PagedKVCacheCollection, PreparedConstant, Result, Tensor, TensorData, bf16, f16,
};
use kvjit_jit::cranelift_codegen::ir::{InstBuilder, Value, condcodes::IntCC, types};
use kvjit_jit::cranelift_frontend::FunctionBuilder;
use kvjit_jit::ir::{counted_loop, load_f32x4_raw, load_splat_f32x4, mem, store_f32x4, store_lane};
use kvjit_jit::{CaptureText, CompileCause, JitError, JitFunction, SeenShapes, compile_kernel};
use kvjit_runtime::{CodeInfo, DeviceContextPtr, Kernel, OutputSpec};

use crate::call::cache_row_offsets;
use crate::kernel::{check_against_spec_with, checked_call_with, same_data};
use crate::{CallShape, FusedQkvError, FusedQkvSpec, OP_NAME, QkvArgs};

/// Columns per weight panel (two F32X4 vectors).
pub const NR: usize = 8;
/// Rows per register tile.
pub const MR: usize = 4;
/// Rows per block: the X block that stays in cache while panels stream by.
pub const MC: usize = 64;
/// k values per iteration of the micro-kernel loop (amortizes the loop's
/// overhead and the accumulator moves on its back edge).
pub const K_UNROLL: usize = 4;

/// Shapes a generic kernel specializes for, at most (the shared policy's
/// limit, [`kvjit_jit::MAX_SEEN_SHAPES`]).
pub use kvjit_jit::MAX_SEEN_SHAPES;
/// The compile log of the CPU JIT (every op's kernels: the registry is
/// shared), re-exported where this op's users look for it.
pub use kvjit_jit::compile_log;

/// Where a segment's columns go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Destination {
    Q,
    K,
    V,
}

/// A run of columns with one destination, and its panels.
#[derive(Clone, Copy, Debug)]
struct Segment {
    destination: Destination,
    first_column: usize,
    columns: usize,
    first_panel: usize,
}

impl Segment {
    fn panels(&self) -> usize {
        self.columns.div_ceil(NR)
    }
}

/// How the weight's columns are cut into panels.
#[derive(Clone, Copy, Debug)]
pub struct PanelLayout {
    segments: [Segment; 3],
    k: usize,
}

impl PanelLayout {
    /// The layout for a spec.
    pub fn new(spec: &FusedQkvSpec) -> Self {
        let kv = spec.kv_dim();
        let q = Segment { destination: Destination::Q, first_column: 0, columns: spec.q_dim, first_panel: 0 };
        let k = Segment { destination: Destination::K, first_column: spec.q_dim, columns: kv, first_panel: q.panels() };
        let v = Segment {
            destination: Destination::V,
            first_column: spec.q_dim + kv,
            columns: kv,
            first_panel: q.panels() + k.panels(),
        };
        Self { segments: [q, k, v], k: spec.k }
    }

    /// Panels in all.
    pub fn total_panels(&self) -> usize {
        self.segments.iter().map(Segment::panels).sum()
    }

    /// Names this layout and everything it depends on (the prepared
    /// constant's [`layout`](kvjit_core::PreparedConstant::layout)).
    pub fn id(&self, dtype: DType) -> String {
        let [q, k, v] = self.segments.map(|s| s.columns);
        format!("fused_qkv.panels.v1.nr{NR}.{dtype}.k{}.cols{q}+{k}+{v}", self.k)
    }

    /// Elements of the packed weight.
    pub fn packed_len(&self) -> usize {
        self.total_panels() * self.k * NR
    }

    /// Pack a `[N, K]` weight into panels (zero-padded), keeping its dtype.
    pub fn pack(&self, weight: &Tensor) -> Result<Tensor> {
        // Panel by panel, row kk of the panel gathers element kk of its NR
        // weight rows: the writes stream, the reads walk NR rows side by
        // side. The panels go to huge-page memory (few faults to make, few
        // TLB misses to stream).
        fn pack_typed<T: Copy + Default + bytemuck::Pod>(layout: &PanelLayout, w: &[T], out: &mut [u8]) {
            let k = layout.k;
            if k == 0 {
                return; // no elements: nothing to pack
            }
            let out: &mut [T] = bytemuck::cast_slice_mut(out);
            let mut panels = out.chunks_exact_mut(k * NR);
            for seg in &layout.segments {
                for p in 0..seg.panels() {
                    let columns = NR.min(seg.columns - p * NR);
                    let first = seg.first_column + p * NR;
                    let rows: Vec<&[T]> = (0..columns).map(|c| &w[(first + c) * k..][..k]).collect();
                    let panel = panels.next().expect("packed_len counts every panel");
                    for (kk, out_row) in panel.chunks_exact_mut(NR).enumerate() {
                        for (c, slot) in out_row.iter_mut().enumerate() {
                            *slot = rows.get(c).map_or(T::default(), |row| row[kk]);
                        }
                    }
                }
            }
        }
        let shape = [self.packed_len()];
        match weight.data() {
            TensorData::F32(w) => Tensor::anonymous(DType::F32, &shape, |out| pack_typed(self, w, out)),
            TensorData::BF16(w) => Tensor::anonymous(DType::BF16, &shape, |out| pack_typed(self, w, out)),
            TensorData::F16(w) => Tensor::anonymous(DType::F16, &shape, |out| pack_typed(self, w, out)),
            TensorData::U32(_) => Err(Error::NotFloat { what: "weight".into(), dtype: DType::U32 }),
        }
    }
}

/// Refuse specs whose offsets the generated code could not form: byte
/// offsets of the cache and of rows must fit in i64, and the constant
/// displacements inside a tile (up to MR rows of K f32) in i32.
pub(crate) fn addressable(spec: &FusedQkvSpec) -> Result<(), JitError> {
    let fits = || -> Option<()> {
        let kv_stride = spec.num_layers.checked_mul(spec.page_size)?.checked_mul(spec.kv_dim())?;
        let blocks_bytes = kv_stride.checked_mul(2)?.checked_mul(spec.cache_dtype.size_bytes())?;
        let tile_bytes = spec.k.checked_mul(4 * MR)?;
        let n = spec.q_dim.checked_add(spec.kv_dim().checked_mul(2)?)?;
        let panel_bytes = spec.k.checked_mul(NR * spec.dtype.size_bytes())?.checked_mul(n.div_ceil(NR) + 3)?;
        if let (Some(batch), Some(seq)) = (spec.batch, spec.seq) {
            let rows = i64::try_from(batch.checked_mul(seq)?).ok()?;
            rows.checked_add(MC as i64)?;
        }
        (i64::try_from(blocks_bytes).is_ok() && i32::try_from(tile_bytes).is_ok() && i64::try_from(panel_bytes).is_ok())
            .then_some(())
    };
    fits().ok_or_else(|| JitError::Unsupported {
        key: spec.kernel_key().to_string(),
        reason: "its sizes overflow the offsets the kernel computes".into(),
    })
}

/// The kernel's argument words ([`kvjit_jit::KernelParams::arg`]), in
/// order; the work items of a launch are weight panels.
mod arg {
    /// Activations as f32 rows, `[M, K]`.
    pub const X: usize = 0;
    /// The packed weight.
    pub const W: usize = 1;
    /// The Q output, `[M, q_dim]`.
    pub const OUT: usize = 2;
    /// The cache's blocks.
    pub const BLOCKS: usize = 3;
    /// Per row, the element offset of its K in `blocks` (-1: padded row).
    pub const ROW_OFFSETS: usize = 4;
    /// Rows M (read when the key leaves B or S symbolic).
    pub const M: usize = 5;
    /// Words in all.
    pub const COUNT: usize = 6;
}

/// Compile the kernel for `spec` (or fetch it from the process-wide
/// registry). Kept IR/disassembly bypass the registry so the texts always
/// exist.
pub fn compile(spec: &FusedQkvSpec, capture: CaptureText) -> Result<Arc<JitFunction>, JitError> {
    let key = spec.kernel_key();
    let build = || emit_and_compile(spec, &key, capture);
    if capture.clif || capture.disasm {
        return build().map(Arc::new);
    }
    kvjit_jit::kernels().get_or_compile(&key, CompileCause::GraphBuild, build)
}

fn emit_and_compile(spec: &FusedQkvSpec, key: &KernelKey, capture: CaptureText) -> Result<JitFunction, JitError> {
    addressable(spec)?;
    compile_kernel(key, capture, |b, params| {
        let bases = Bases {
            x: params.arg(b, arg::X),
            w: params.arg(b, arg::W),
            out: params.arg(b, arg::OUT),
            blocks: params.arg(b, arg::BLOCKS),
            row_offsets: params.arg(b, arg::ROW_OFFSETS),
        };
        let m_arg = params.arg(b, arg::M);
        Emitter::new(spec, bases).emit(b, m_arg, params.begin, params.end);
    })
}

/// The emitter's state for one kernel body — everything the loop nest and
/// the tiles share — so each level of the schedule takes the builder, this
/// context and only what its own loop adds (rustc_codegen_cranelift's
/// `FunctionCx` is the model).
struct Emitter {
    spec: FusedQkvSpec,
    layout: PanelLayout,
    /// Rows, when the key fixes them.
    m: Option<usize>,
    /// The call's buffers.
    bases: Bases,
}

/// The call's buffer addresses, loaded once at entry.
#[derive(Clone, Copy)]
struct Bases {
    x: Value,
    w: Value,
    out: Value,
    blocks: Value,
    row_offsets: Value,
}

/// The panel loop's state, which every tile of the panel shares.
#[derive(Clone, Copy)]
struct Panel {
    /// Address of the packed panel.
    w: Value,
    /// Its first column within its segment.
    column: Value,
    /// Where its columns go.
    destination: Destination,
    /// Columns it holds (NR, or fewer in a segment's last panel).
    width: usize,
}

impl Emitter {
    fn new(spec: &FusedQkvSpec, bases: Bases) -> Self {
        let m = spec.batch.zip(spec.seq).map(|(b, s)| b * s);
        Self { spec: *spec, layout: PanelLayout::new(spec), m, bases }
    }

    /// The schedule: blocks of MC rows, then this invocation's panels of
    /// each segment, then row groups of MR.
    fn emit(&self, b: &mut FunctionBuilder, m_arg: Value, panel_begin: Value, panel_end: Value) {
        let m = match self.m {
            Some(m) => b.ins().iconst(types::I64, m as i64),
            None => m_arg,
        };
        let zero = b.ins().iconst(types::I64, 0);
        counted_loop(b, zero, m, MC as i64, &[], |b, block_start, _| {
            let block_end = b.ins().iadd_imm_s(block_start, MC as i64);
            let block_end = b.ins().smin(block_end, m);
            for seg in self.layout.segments {
                let full = seg.columns / NR;
                let tail = seg.columns % NR;
                for (first, count, width) in
                    [(seg.first_panel, full, NR), (seg.first_panel + full, usize::from(tail > 0), tail)]
                {
                    if count == 0 {
                        continue;
                    }
                    let lo = b.ins().iconst(types::I64, first as i64);
                    let lo = b.ins().smax(lo, panel_begin);
                    let hi = b.ins().iconst(types::I64, (first + count) as i64);
                    let hi = b.ins().smin(hi, panel_end);
                    counted_loop(b, lo, hi, 1, &[], |b, index, _| {
                        let panel_bytes = (self.layout.k * NR * self.spec.dtype.size_bytes()) as i64;
                        let offset = b.ins().imul_imm_s(index, panel_bytes);
                        let rel = b.ins().iadd_imm_s(index, -(seg.first_panel as i64));
                        let panel = Panel {
                            w: b.ins().iadd(self.bases.w, offset),
                            column: b.ins().imul_imm_s(rel, NR as i64),
                            destination: seg.destination,
                            width,
                        };
                        self.emit_row_groups(b, block_start, block_end, panel);
                        Vec::new()
                    });
                }
            }
            Vec::new()
        });
    }

    /// Tiles of MR rows over `[start, end)`, then one smaller tile for the rest.
    fn emit_row_groups(&self, b: &mut FunctionBuilder, start: Value, end: Value, panel: Panel) {
        let rows = b.ins().isub(end, start);
        let whole = b.ins().band_imm_s(rows, !(MR as i64 - 1));
        let full_end = b.ins().iadd(start, whole);
        counted_loop(b, start, full_end, MR as i64, &[], |b, row, _| {
            self.emit_tile(b, MR, row, panel);
            Vec::new()
        });
        let rest = b.ins().isub(end, full_end);
        let remainders: Vec<usize> = match self.m {
            Some(m) => Some(m % MR).filter(|&r| r > 0).into_iter().collect(),
            None => (1..MR).collect(),
        };
        let done = b.create_block();
        for mr in remainders {
            let this = b.create_block();
            let next = b.create_block();
            let is_this = b.ins().icmp_imm_s(IntCC::Equal, rest, mr as i64);
            b.ins().brif(is_this, this, &[], next, &[]);
            b.switch_to_block(this);
            self.emit_tile(b, mr, full_end, panel);
            b.ins().jump(done, &[]);
            b.switch_to_block(next);
        }
        b.ins().jump(done, &[]);
        b.switch_to_block(done);
    }

    /// The micro-kernel: an `mr`×NR tile of C = X·Wᵀ in registers, then its
    /// epilogue. Small tiles split k over several accumulator sets so the
    /// FMA latency chain does not limit them.
    fn emit_tile(&self, b: &mut FunctionBuilder, mr: usize, row: Value, panel: Panel) {
        let k = self.layout.k;
        let w_dtype = self.spec.dtype;
        let w_size = w_dtype.size_bytes() as i32;
        let sets = match mr {
            1 => 4,
            2 => 2,
            _ => 1,
        };
        let zero = b.ins().f32const(0.0);
        let zero = b.ins().splat(types::F32X4, zero);
        let x_row_bytes = (k * 4) as i64;
        let row_offset = b.ins().imul_imm_s(row, x_row_bytes);
        let x_rows = b.ins().iadd(self.bases.x, row_offset);
        // Accumulator index: (set, row, half).
        let acc_index = |set: usize, i: usize, h: usize| (set * mr + i) * 2 + h;
        // `count` consecutive k values from `kk`; k value u uses accumulator
        // set u % sets. Each FMA gets its own broadcast load of x: a splat
        // with one use folds into `vbroadcastss mem`, while a shared one costs
        // a register copy per FMA (x64 FMAs overwrite a multiplicand).
        let step = |b: &mut FunctionBuilder, kk: Value, count: usize, accs: &mut [Value]| {
            let x_off = b.ins().ishl_imm_u(kk, 2);
            let x_at = b.ins().iadd(x_rows, x_off);
            let w_off = b.ins().imul_imm_s(kk, (NR as i32 * w_size) as i64);
            let w_at = b.ins().iadd(panel.w, w_off);
            for u in 0..count {
                let halves = [
                    load_f32x4_raw(b, w_dtype, w_at, (u * NR) as i32 * w_size),
                    load_f32x4_raw(b, w_dtype, w_at, (u * NR + 4) as i32 * w_size),
                ];
                for i in 0..mr {
                    for (h, &w) in halves.iter().enumerate() {
                        let xb = load_splat_f32x4(b, DType::F32, x_at, ((i * k + u) * 4) as i32);
                        let acc = &mut accs[acc_index(u % sets, i, h)];
                        *acc = b.ins().fma(xb, w, *acc);
                    }
                }
            }
        };
        let main = k - k % K_UNROLL;
        let start = b.ins().iconst(types::I64, 0);
        let end = b.ins().iconst(types::I64, main as i64);
        let mut accs = counted_loop(b, start, end, K_UNROLL as i64, &vec![zero; sets * mr * 2], |b, kk, carried| {
            let mut accs = carried.to_vec();
            step(b, kk, K_UNROLL, &mut accs);
            accs
        });
        if main < k {
            let kk = b.ins().iconst(types::I64, main as i64);
            step(b, kk, k - main, &mut accs);
        }
        for set in 1..sets {
            for i in 0..mr {
                for h in 0..2 {
                    accs[acc_index(0, i, h)] = b.ins().fadd(accs[acc_index(0, i, h)], accs[acc_index(set, i, h)]);
                }
            }
        }
        for i in 0..mr {
            let halves = [accs[acc_index(0, i, 0)], accs[acc_index(0, i, 1)]];
            self.emit_store_row(b, row, i, panel, halves);
        }
    }

    /// Store row `row + i` of a tile where its panel's columns go.
    fn emit_store_row(&self, b: &mut FunctionBuilder, row: Value, i: usize, panel: Panel, halves: [Value; 2]) {
        let r = b.ins().iadd_imm_s(row, i as i64);
        let (dtype, base, after) = match panel.destination {
            Destination::Q => {
                let element = b.ins().imul_imm_s(r, self.spec.q_dim as i64);
                let element = b.ins().iadd(element, panel.column);
                let bytes = b.ins().imul_imm_s(element, self.spec.dtype.size_bytes() as i64);
                (self.spec.dtype, b.ins().iadd(self.bases.out, bytes), None)
            }
            Destination::K | Destination::V => {
                let slot_at = b.ins().ishl_imm_u(r, 3);
                let slot_at = b.ins().iadd(self.bases.row_offsets, slot_at);
                let slot = b.ins().load(types::I64, mem(), slot_at, 0);
                let store = b.create_block();
                let after = b.create_block();
                let writes = b.ins().icmp_imm_s(IntCC::SignedGreaterThanOrEqual, slot, 0);
                b.ins().brif(writes, store, &[], after, &[]);
                b.switch_to_block(store);
                let stride = if panel.destination == Destination::V { self.kv_stride() } else { 0 };
                let element = b.ins().iadd_imm_s(slot, stride as i64);
                let element = b.ins().iadd(element, panel.column);
                let bytes = b.ins().imul_imm_s(element, self.spec.cache_dtype.size_bytes() as i64);
                (self.spec.cache_dtype, b.ins().iadd(self.bases.blocks, bytes), Some(after))
            }
        };
        let size = dtype.size_bytes() as i32;
        for (h, &value) in halves.iter().enumerate() {
            let lanes = panel.width.saturating_sub(4 * h).min(4);
            if lanes == 4 {
                store_f32x4(b, dtype, value, base, 4 * h as i32 * size);
            } else {
                for lane in 0..lanes {
                    store_lane(b, dtype, value, lane as u8, base, (4 * h + lane) as i32 * size);
                }
            }
        }
        if let Some(after) = after {
            b.ins().jump(after, &[]);
            b.switch_to_block(after);
        }
    }

    /// Elements from a token's K to its V in the blocks tensor:
    /// `L · page_size · Hkv · D`.
    fn kv_stride(&self) -> usize {
        self.spec.num_layers * self.spec.page_size * self.spec.kv_dim()
    }
}

/// The fused op as JIT-compiled machine code for one kernel key.
///
/// Tensor inputs, in order: `hidden_state`, `weight`, `layer_idx`,
/// `valid_lengths`; one cache; one output.
pub struct JitKernel {
    spec: FusedQkvSpec,
    key: KernelKey,
    /// Kernels specialized for shapes seen at run time, by (B, S), when the
    /// key leaves them symbolic and the policy asks for it.
    seen_shapes: Option<SeenShapes>,
    layout: PanelLayout,
    code: Arc<JitFunction>,
    /// The graph's constant weight and its packed copy, made at build (or
    /// taken prepared from an artifact). Used only when a call's weight is
    /// that very tensor or the packed one itself ([`same_data`]); any other
    /// weight is packed for its call.
    constant_weight: Option<PackedConstant>,
}

/// A constant weight (absent when it came prepared) and its panels.
struct PackedConstant {
    plain: Option<Arc<Tensor>>,
    packed: Arc<Tensor>,
}

impl PackedConstant {
    /// The panels to use for a call's `weight`, if it is this constant.
    fn panels_for(&self, weight: &Tensor) -> Option<&Tensor> {
        let is_plain = self.plain.as_deref().is_some_and(|plain| same_data(plain, weight));
        (is_plain || same_data(&self.packed, weight)).then_some(&*self.packed)
    }
}

impl JitKernel {
    /// Compile (or fetch) the kernel for `spec`; pack `weight` now when it
    /// is a graph constant. Calls whose weight is that same tensor (the same
    /// allocation) use the packed copy; calls with any other weight pack
    /// theirs per call.
    pub fn new(spec: FusedQkvSpec, weight: Option<Arc<Tensor>>, capture: CaptureText) -> Result<Self, JitError> {
        Self::with_policy(spec, weight, capture, false)
    }

    /// Like [`new`](Self::new); with `specialize_shapes`, a kernel whose key
    /// leaves B or S symbolic also compiles (and caches, process-wide) a
    /// kernel for each (B, S) it runs with, up to [`MAX_SEEN_SHAPES`] per
    /// kernel, and runs that one instead of the generic code.
    pub fn with_policy(
        spec: FusedQkvSpec,
        weight: Option<Arc<Tensor>>,
        capture: CaptureText,
        specialize_shapes: bool,
    ) -> Result<Self, JitError> {
        let layout = PanelLayout::new(&spec);
        let constant_weight = match weight {
            Some(w) if w.dtype() == spec.dtype && w.shape() == [spec.n(), spec.k] && w.is_contiguous() => {
                Some(PackedConstant {
                    packed: Arc::new(layout.pack(&w).expect("a float weight packs")),
                    plain: Some(w),
                })
            }
            _ => None,
        };
        Self::with_constant(spec, constant_weight, capture, specialize_shapes)
    }

    /// Like [`with_policy`](Self::with_policy), with the weight already
    /// packed (a prepared constant from a compiled artifact): no packing at
    /// build. Calls pass that packed tensor itself as the weight. A weight
    /// in another layout, dtype or size is refused.
    pub fn with_prepared_weight(
        spec: FusedQkvSpec,
        prepared: &PreparedConstant,
        capture: CaptureText,
        specialize_shapes: bool,
    ) -> Result<Self> {
        let layout = PanelLayout::new(&spec);
        let expected = layout.id(spec.dtype);
        let data = &prepared.data;
        if prepared.layout != expected
            || data.dtype() != spec.dtype
            || data.shape() != [layout.packed_len()]
            || !data.is_contiguous()
        {
            return Err(FusedQkvError::PreparedWeight {
                expected: format!("{expected} ({}[{}])", spec.dtype, layout.packed_len()),
                got: format!("{} ({}{:?})", prepared.layout, data.dtype(), data.shape()),
            }
            .into());
        }
        let constant = PackedConstant { plain: None, packed: data.clone() };
        Self::with_constant(spec, Some(constant), capture, specialize_shapes).map_err(|e| Error::op(OP_NAME, e))
    }

    fn with_constant(
        spec: FusedQkvSpec,
        constant_weight: Option<PackedConstant>,
        capture: CaptureText,
        specialize_shapes: bool,
    ) -> Result<Self, JitError> {
        let code = compile(&spec, capture)?;
        let layout = PanelLayout::new(&spec);
        let generic = spec.batch.is_none() || spec.seq.is_none();
        Ok(Self {
            key: spec.kernel_key(),
            seen_shapes: (specialize_shapes && generic).then(SeenShapes::new),
            spec,
            layout,
            code,
            constant_weight,
        })
    }

    /// The code to run for a call of this shape: a kernel specialized for it
    /// when the policy allows, else this kernel's own.
    fn code_for(&self, shape: &CallShape) -> Arc<JitFunction> {
        let Some(seen) = &self.seen_shapes else { return self.code.clone() };
        let spec = FusedQkvSpec { batch: Some(shape.batch), seq: Some(shape.seq), ..self.spec };
        let key = spec.kernel_key();
        seen.code_for(&[("B", shape.batch), ("S", shape.seq)], (&self.code, &self.key), &key, || {
            emit_and_compile(&spec, &key, CaptureText::default())
        })
    }
}

fn hidden_as_f32(hidden: &Tensor) -> std::borrow::Cow<'_, [f32]> {
    let convert = |len: usize, f: &dyn Fn(&mut [f32])| {
        let mut out = vec![0f32; len];
        f(&mut out);
        std::borrow::Cow::Owned(out)
    };
    match hidden.data() {
        TensorData::F32(x) => std::borrow::Cow::Borrowed(x),
        TensorData::BF16(x) => convert(x.len(), &|out| <[bf16]>::convert_to_f32_slice(x, out)),
        TensorData::F16(x) => convert(x.len(), &|out| <[f16]>::convert_to_f32_slice(x, out)),
        TensorData::U32(_) => unreachable!("check_call accepts float hidden states only"),
    }
}

impl Kernel for JitKernel {
    fn key(&self) -> &KernelKey {
        &self.key
    }

    fn implementation(&self) -> &'static str {
        "jit"
    }

    fn code_info(&self) -> CodeInfo {
        CodeInfo {
            compile_time: self.code.compile_time(),
            code_size: self.code.code_size(),
            ir: self.code.clif().map(str::to_string),
            disasm: self.code.disasm().map(str::to_string),
        }
    }

    fn check(&self, inputs: &[&Tensor], caches: &[&PagedKVCacheCollection]) -> Result<Vec<OutputSpec>> {
        let shape = check_against_spec_with(&self.spec, inputs, caches, self.packed_weight())?;
        Ok(vec![(self.spec.dtype, shape.output_shape())])
    }

    fn prepared_constants(&self) -> Vec<(usize, PreparedConstant)> {
        let Some(constant) = &self.constant_weight else { return Vec::new() };
        vec![(1, PreparedConstant { layout: self.layout.id(self.spec.dtype), data: constant.packed.clone() })]
    }

    fn run(
        &self,
        inputs: &[&Tensor],
        caches: &mut [&mut PagedKVCacheCollection],
        outputs: &mut [Tensor],
        ctx: &DeviceContextPtr,
    ) -> Result<()> {
        let call = checked_call_with(&self.spec, inputs, caches, outputs, self.packed_weight())?;
        let args = QkvArgs {
            hidden_state: call.hidden,
            weight: call.weight,
            kv_collection: call.cache,
            layer_idx: call.layer_idx,
            valid_lengths: call.valid_lengths,
        };
        self.launch(&call.shape, args, call.output.as_bytes_mut(), ctx)
    }
}

impl JitKernel {
    /// The packed constant weight, which calls may pass as the weight.
    fn packed_weight(&self) -> Option<&Tensor> {
        self.constant_weight.as_ref().map(|c| &*c.packed)
    }

    /// Run with the Q output written into raw bytes (exactly `B·S·q_dim`
    /// elements of the dtype), so callers — tests with guard regions around
    /// the output, benchmarks reusing a buffer — choose where it lives.
    /// Validates everything first, like [`Kernel::run`].
    pub fn run_into(&self, args: QkvArgs<'_>, output: &mut [u8], ctx: &DeviceContextPtr) -> Result<()> {
        let inputs = [args.hidden_state, args.weight, args.layer_idx, args.valid_lengths];
        let shape = check_against_spec_with(&self.spec, &inputs, &[&*args.kv_collection], self.packed_weight())?;
        let expected = shape.batch * shape.seq * shape.q_dim * self.spec.dtype.size_bytes();
        if output.len() != expected {
            return Err(Error::ByteCount {
                dtype: self.spec.dtype,
                shape: shape.output_shape(),
                expected,
                got: output.len(),
            });
        }
        self.launch(&shape, args, output, ctx)
    }

    /// Run a validated call: `shape` came from `check_against_spec` on
    /// exactly these arguments and `output` holds `B·S·q_dim` elements.
    fn launch(&self, shape: &CallShape, args: QkvArgs<'_>, output: &mut [u8], ctx: &DeviceContextPtr) -> Result<()> {
        let shape = *shape;
        let QkvArgs { hidden_state, weight, kv_collection: cache, valid_lengths, .. } = args;
        let row_offsets = cache_row_offsets(&shape, cache, valid_lengths)?;
        let x = hidden_as_f32(hidden_state);
        let packed_now;
        let packed = match self.constant_weight.as_ref().and_then(|c| c.panels_for(weight)) {
            Some(panels) => panels,
            None => {
                packed_now = self.layout.pack(weight)?;
                &packed_now
            }
        };
        let mut args = [0u64; arg::COUNT];
        args[arg::X] = x.as_ptr() as u64;
        args[arg::W] = packed.as_bytes().as_ptr() as u64;
        args[arg::OUT] = output.as_mut_ptr() as u64;
        args[arg::BLOCKS] = cache.blocks_bytes_mut().as_mut_ptr() as u64;
        args[arg::ROW_OFFSETS] = row_offsets.as_ptr() as u64;
        args[arg::M] = (shape.batch * shape.seq) as u64;
        if shape.batch * shape.seq == 0 {
            return Ok(());
        }
        let code = self.code_for(&shape);
        // SAFETY: `code` was compiled by `emit_and_compile` for this kernel's
        // spec (or the same spec with this call's B and S baked in), reading
        // the argument words in `arg`'s layout. `check_against_spec`
        // validated every argument against the spec (dtypes, contiguity, K,
        // q_dim, cache layout, B·S rows, valid lengths ≤ S, every valid
        // token's page and slot inside the cache and no two tokens sharing
        // one), so for any panel range every load stays inside `x` (M·K f32)
        // and the packed weight (built for this layout), every Q store inside
        // `output` (M·q_dim, checked by the caller), and every K/V store at
        // `row_offsets[r] + col (+ kv_stride)` inside `blocks`, distinct per
        // row; different panel ranges write different columns. `x`,
        // `packed`, `row_offsets` and the borrowed output and cache outlive
        // the launch.
        unsafe { kvjit_jit::launch(&code, &args, self.layout.total_panels(), ctx) };
        Ok(())
    }
}
