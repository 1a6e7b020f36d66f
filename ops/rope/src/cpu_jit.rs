//! The CPU kernel: machine code Cranelift emits for one [`RopeSpec`].
//!
//! The spec fixes dtypes, layout, Hq, Hkv and D; B and S do not change the
//! code (so it is compiled and cached under the spec's generic key, shared by
//! every (B, S)). A launch's work items are token rows `r = b·S + s`; the
//! host validates the call and then gives each row a [`RowPlan`]: where its
//! cos/sin row starts in `freqs_cis` (or -1: a padded row) and where its K
//! heads start in `blocks`. The machine code does no page lookups and no
//! bounds checks.
//!
//! Per row:
//!
//! ```text
//! padded row:  output[r, :, :] = 0 (16 bytes at a time)
//! valid row:   table = cos/sin of the row, widened to f32, laid out for the
//!              layout's rotation (a stack buffer of 8·D bytes, built once per
//!              row and reused by all Hq + Hkv heads)
//!              for each Q head:  output[r, h, :] = rotate(q_proj[r, h, :])
//!              for each KV head: K[h, :] = rotate(K[h, :]) in place, in the cache dtype
//! ```
//!
//! An FP8 (`f8e4m3`) cache goes through an f32 stack buffer of D values per
//! K head (the rotation pairs elements of different g-blocks):
//!
//! ```text
//! x[d] = value(code[d]) · scale[d / g]      dequantize the whole head
//! x = rotate(x)                             in place, the f32 code path above
//! per g-block: scale = max|x| / 448         over the finite lanes (±∞ and NaN count as 0)
//!              code[d] = e4m3(x[d] / scale) (a finite x[d] · 0 when scale = 0)
//! ```
//!
//! bit for bit what `kvjit_core::fp8::quantize_block` stores for the same
//! rotated f32 values. The scales of the row's K heads start at
//! `k_offset / g` (`k_offset` is a multiple of D, which g divides).
//!
//! Everything is F32X4 (x64 Cranelift lowers 128-bit vectors only), four
//! pairs per vector:
//!
//! - **non-interleaved** (`rotate_half`): the table holds `cos[0..D/2]` then
//!   `sin[0..D/2]` (deinterleaved from `freqs_cis` with two `shufps`); a
//!   head's chunk `a = x[j..j+4]`, `b = x[j+D/2..j+D/2+4]` becomes
//!   `a·c − b·s`, `b·c + a·s`.
//! - **interleaved**: the table holds `cc = (c0, c0, c1, c1, …)` and
//!   `ss = (−s0, s0, −s1, s1, …)`; a chunk `x = (a0, b0, a1, b1)` becomes
//!   `x·cc + swap(x)·ss` with `swap(x) = (b0, a0, b1, a1)` (one `pshufd`).
//!
//! Each result is one `fmul` and one `fma` in f32, rounded once to the
//! output's (or cache's) dtype by the shared store helpers (ties to even,
//! bit for bit as `half`). A row is computed by one invocation with the same
//! code wherever it runs, so results do not depend on the thread count.
//!
//! Requirements (refused at specialize through `supports`): D a multiple of
//! 8 (whole vectors of pairs in both layouts) and at most
//! [`MAX_JIT_HEAD_SIZE`]; for an FP8 cache, a scale granularity g that is a
//! multiple of 4 (whole vectors per g-block).

use std::sync::Arc;

use std::mem::offset_of;

use kvjit_core::{DType, KernelKey, KernelSpec, Result};
use kvjit_jit::cranelift_codegen::ir::condcodes::IntCC;
use kvjit_jit::cranelift_codegen::ir::{InstBuilder, MemFlagsData, StackSlotData, StackSlotKind, Value, types};
use kvjit_jit::cranelift_frontend::FunctionBuilder;
use kvjit_jit::ir::addr::{self, Displacements};
use kvjit_jit::ir::{counted_loop, e4m3, if_else, load_f32x4, load_f32x4_raw, mem, shuffle, splat_f32, store_f32x4};
use kvjit_jit::{CaptureText, JitError, JitFunction, compile_kernel};
use kvjit_op::{JitSpec, Launch};

use crate::{CallShape, MAX_JIT_HEAD_SIZE, RopeSpec, RowPlan};

kvjit_op::kernel_args! {
    /// The kernel's arguments; the work items of a launch are token rows.
    struct LaunchArgs {
        /// `q_proj`, `[B·S, Hq, D]` in the dtype.
        q,
        /// The output, `[B·S, Hq, D]` in the dtype.
        out,
        /// `freqs_cis`, `[max_seq, D]` in the dtype.
        freqs,
        /// The cache's blocks.
        blocks,
        /// Per row, its [`RowPlan`].
        rows,
        /// An FP8 cache's f32 scales (null for other caches).
        scales,
    }
}

/// A field's `offset_of!` as a load displacement (a `#[repr(C)]` struct of
/// two words).
fn field_offset(offset: usize) -> i32 {
    i32::try_from(offset).expect("a field of a two-word struct")
}

/// Refuse specs the generated code does not handle: D not a multiple of 8
/// or above [`MAX_JIT_HEAD_SIZE`], a scale granularity that is not a
/// multiple of 4 dividing D for an FP8 cache, or a row too large for the
/// offsets it forms.
pub(crate) fn supported(spec: &RopeSpec) -> Result<(), JitError> {
    let unsupported = |reason: String| JitError::Unsupported { key: spec.key().to_string(), reason };
    let d = spec.head_size();
    if !d.is_multiple_of(8) || d > MAX_JIT_HEAD_SIZE {
        return Err(unsupported(format!(
            "the CPU kernel needs head_size to be a multiple of 8 and at most {MAX_JIT_HEAD_SIZE}, got {d}"
        )));
    }
    if let Some(g) = spec.cache.scale_granularity()
        && !(g.is_multiple_of(4) && d.is_multiple_of(g))
    {
        return Err(unsupported(format!(
            "the CPU kernel needs the f8e4m3 cache's scale_granularity to be a multiple of 4 dividing head_size \
             {d}, got {g}"
        )));
    }
    let row_bytes = spec.num_q_heads.checked_mul(d).and_then(|e| e.checked_mul(spec.dtype.size_bytes()));
    if row_bytes.and_then(|b| i64::try_from(b).ok()).is_none() {
        return Err(unsupported("a row of q_proj overflows the offsets the kernel computes".into()));
    }
    displacements(spec).map(drop)
}

/// The constant displacements of the kernel's loads and stores, within the
/// row's f32 table (8·D bytes, the largest), a head, or a chunk of 4 of them.
fn displacements(spec: &RopeSpec) -> Result<Displacements, JitError> {
    Displacements::up_to(&spec.key(), spec.head_size().checked_mul(8))
}

/// Compile the kernel for `spec` (or fetch it from the process-wide
/// registry, under the spec's generic key). Kept IR/disassembly bypass the
/// registry so the texts always exist.
pub fn compile(spec: &RopeSpec, capture: CaptureText) -> Result<Arc<JitFunction>, JitError> {
    let generic = spec.generic();
    let key = generic.key();
    kvjit_jit::compile_or_fetch(&key, capture, || emit_and_compile(&generic, &key, capture))
}

fn emit_and_compile(spec: &RopeSpec, key: &KernelKey, capture: CaptureText) -> Result<JitFunction, JitError> {
    supported(spec)?;
    let disp = displacements(spec)?;
    compile_kernel(key, capture, |b, params| {
        let bases = Bases {
            q: params.field(b, offset_of!(LaunchArgs, q)),
            out: params.field(b, offset_of!(LaunchArgs, out)),
            freqs: params.field(b, offset_of!(LaunchArgs, freqs)),
            blocks: params.field(b, offset_of!(LaunchArgs, blocks)),
            rows: params.field(b, offset_of!(LaunchArgs, rows)),
            scales: params.field(b, offset_of!(LaunchArgs, scales)),
        };
        Emitter { spec: *spec, disp }.emit(b, bases, params.begin, params.end);
    })
}

/// The call's buffer addresses, loaded once at entry.
#[derive(Clone, Copy)]
struct Bases {
    q: Value,
    out: Value,
    freqs: Value,
    blocks: Value,
    rows: Value,
    scales: Value,
}

/// The emitter for one kernel body.
struct Emitter {
    spec: RopeSpec,
    /// The bound of every constant displacement ([`displacements`]).
    disp: Displacements,
}

/// Chunks of 4 f32 lanes handled per loop iteration, for `count` chunks.
fn unroll_for(count: usize) -> usize {
    [4, 3, 2, 1].into_iter().find(|&u| count.is_multiple_of(u)).expect("1 divides everything")
}

/// `count` chunks of `step` units each (elements or bytes), `unroll_for(count)`
/// per iteration: calls `body(b, at, u)` for each `u < unroll`, where `at`
/// (a Value) is the iteration's first chunk times `step` and the caller adds
/// chunk `u`'s part as constant displacements.
fn chunk_loop(
    b: &mut FunctionBuilder,
    count: usize,
    step: i64,
    mut body: impl FnMut(&mut FunctionBuilder, Value, usize),
) {
    let unroll = unroll_for(count);
    let start = b.ins().iconst(types::I64, 0);
    let end = b.ins().iconst(types::I64, count as i64 * step);
    counted_loop(b, start, end, unroll as i64 * step, &[], |b, at, _| {
        for u in 0..unroll {
            body(b, at, u);
        }
        Vec::new()
    });
}

impl Emitter {
    fn d(&self) -> usize {
        self.spec.head_size()
    }

    /// Bytes of one output (and q_proj) row: Hq·D elements.
    fn row_bytes(&self) -> usize {
        self.spec.num_q_heads * self.d() * self.spec.dtype.size_bytes()
    }

    /// Values per scale of an FP8 cache (`None` for other caches).
    fn granularity(&self) -> Option<usize> {
        (self.spec.cache.dtype() == DType::F8E4M3)
            .then(|| self.spec.cache.scale_granularity().expect("checked by `supported`"))
    }

    /// The loop over this invocation's rows.
    fn emit(&self, b: &mut FunctionBuilder, bases: Bases, begin: Value, end: Value) {
        let table_slot =
            b.create_sized_stack_slot(StackSlotData::new(StackSlotKind::ExplicitSlot, (8 * self.d()) as u32, 4));
        // An FP8 cache's K head, dequantized to f32 (4·D bytes).
        let head_slot = self.granularity().map(|_| {
            b.create_sized_stack_slot(StackSlotData::new(StackSlotKind::ExplicitSlot, (4 * self.d()) as u32, 4))
        });
        counted_loop(b, begin, end, 1, &[], |b, r, _| {
            let plan_at = addr::element(b, bases.rows, r, size_of::<RowPlan>());
            let freqs_offset =
                b.ins().load(types::I64, mem(), plan_at, field_offset(offset_of!(RowPlan, freqs_offset)));
            let row_offset = addr::offset(b, r, self.row_bytes());
            let out_row = b.ins().iadd(bases.out, row_offset);

            let is_padded = b.ins().icmp_imm_s(IntCC::SignedLessThan, freqs_offset, 0);
            let zero_row = |b: &mut FunctionBuilder| self.emit_zero_row(b, out_row);
            if_else(b, is_padded, zero_row, |b| {
                let k_offset = b.ins().load(types::I64, mem(), plan_at, field_offset(offset_of!(RowPlan, k_offset)));
                let table = b.ins().stack_addr(kvjit_jit::pointer_type(), table_slot, 0);
                let freqs_row = addr::element(b, bases.freqs, freqs_offset, self.spec.dtype.size_bytes());
                self.emit_table(b, freqs_row, table);
                let q_row = b.ins().iadd(bases.q, row_offset);
                self.emit_heads(b, q_row, out_row, self.spec.num_q_heads, self.spec.dtype, table);
                let k_row = addr::element(b, bases.blocks, k_offset, self.spec.cache.dtype().size_bytes());
                match (self.granularity(), head_slot) {
                    (Some(g), Some(head_slot)) => {
                        // The row's first scale: `k_offset / g`, exact (k_offset
                        // is a multiple of D, which g divides).
                        let scale_index = b.ins().udiv_imm_u(k_offset, g as i64);
                        let scale_row = addr::element(b, bases.scales, scale_index, 4);
                        let head = b.ins().stack_addr(kvjit_jit::pointer_type(), head_slot, 0);
                        self.emit_e4m3_heads(b, k_row, scale_row, head, table);
                    }
                    _ => self.emit_heads(b, k_row, k_row, self.spec.cache.num_kv_heads, self.spec.cache.dtype(), table),
                }
            });
            Vec::new()
        });
    }

    /// Zero the `Hq·D` elements of a padded row (a multiple of 16 bytes).
    fn emit_zero_row(&self, b: &mut FunctionBuilder, out_row: Value) {
        let zero = splat_f32(b, 0.0);
        chunk_loop(b, self.row_bytes() / 16, 16, |b, at, u| {
            let p = b.ins().iadd(out_row, at);
            b.ins().store(mem(), zero, p, self.disp.of(16 * u));
        });
    }

    /// Widen the row's cos/sin (`[c0, s0, c1, s1, …]`, D elements) into the
    /// f32 table the rotation reads (see the module docs).
    fn emit_table(&self, b: &mut FunctionBuilder, freqs_row: Value, table: Value) {
        let dtype = self.spec.dtype;
        let size = dtype.size_bytes();
        let d = self.d();
        let at = |bytes: usize| self.disp.of(bytes);
        if self.spec.interleaved {
            // One chunk: 2 pairs (4 elements) → 4 lanes of cc and of ss.
            let sign = splat_sign_even_lanes(b);
            chunk_loop(b, d / 4, 4, |b, chunk, u| {
                let src = addr::element(b, freqs_row, chunk, size);
                let v = load_f32x4_raw(b, dtype, src, at(4 * u * size));
                let cc = shuffle::f32x4(b, v, v, [0, 0, 2, 2]);
                let ss = shuffle::f32x4(b, v, v, [1, 1, 3, 3]);
                let ss = b.ins().bxor(ss, sign);
                let dst = addr::element(b, table, chunk, 4);
                b.ins().store(mem(), cc, dst, at(16 * u));
                b.ins().store(mem(), ss, dst, at(16 * u + 4 * d));
            });
        } else {
            // One chunk: 4 pairs (8 elements) → 4 lanes of cos and of sin.
            chunk_loop(b, d / 8, 4, |b, chunk, u| {
                let src = addr::element(b, freqs_row, chunk, 2 * size);
                let v0 = load_f32x4_raw(b, dtype, src, at(8 * u * size));
                let v1 = load_f32x4_raw(b, dtype, src, at((8 * u + 4) * size));
                let cos = shuffle::f32x4(b, v0, v1, [0, 2, 4, 6]);
                let sin = shuffle::f32x4(b, v0, v1, [1, 3, 5, 7]);
                let dst = addr::element(b, table, chunk, 4);
                b.ins().store(mem(), cos, dst, at(16 * u));
                b.ins().store(mem(), sin, dst, at(16 * u + 2 * d));
            });
        }
    }

    /// Rotate `heads` consecutive heads of D `dtype` elements at `src` into
    /// `dst` (the same address for K, rotated in place).
    fn emit_heads(&self, b: &mut FunctionBuilder, src: Value, dst: Value, heads: usize, dtype: DType, table: Value) {
        let head_bytes = (self.d() * dtype.size_bytes()) as i64;
        let start = b.ins().iconst(types::I64, 0);
        let end = b.ins().iconst(types::I64, heads as i64 * head_bytes);
        counted_loop(b, start, end, head_bytes, &[], |b, h, _| {
            let src = b.ins().iadd(src, h);
            let dst = b.ins().iadd(dst, h);
            self.emit_rotate(b, src, dst, dtype, table);
            Vec::new()
        });
    }

    /// Rotate one head of D `dtype` elements at `src` into `dst` (the same
    /// address rotates in place: every chunk is read before it is written,
    /// and chunks do not overlap).
    fn emit_rotate(&self, b: &mut FunctionBuilder, src: Value, dst: Value, dtype: DType, table: Value) {
        let size = dtype.size_bytes();
        let d = self.d();
        let at = |bytes: usize| self.disp.of(bytes);
        if self.spec.interleaved {
            chunk_loop(b, d / 4, 4, |b, chunk, u| {
                let tab = addr::element(b, table, chunk, 4);
                let x_at = addr::offset(b, chunk, size);
                let (x_src, x_dst) = (b.ins().iadd(src, x_at), b.ins().iadd(dst, x_at));
                let disp = 4 * u * size;
                let x = load_f32x4_raw(b, dtype, x_src, at(disp));
                let cc = b.ins().load(types::F32X4, mem(), tab, at(16 * u));
                let ss = b.ins().load(types::F32X4, mem(), tab, at(16 * u + 4 * d));
                let swapped = shuffle::f32x4(b, x, x, [1, 0, 3, 2]);
                let xc = b.ins().fmul(x, cc);
                let rotated = b.ins().fma(swapped, ss, xc);
                store_f32x4(b, dtype, rotated, x_dst, at(disp));
            });
        } else {
            let half_bytes = d / 2 * size;
            chunk_loop(b, d / 8, 4, |b, chunk, u| {
                let tab = addr::element(b, table, chunk, 4);
                let x_at = addr::offset(b, chunk, size);
                let (x_src, x_dst) = (b.ins().iadd(src, x_at), b.ins().iadd(dst, x_at));
                let disp = 4 * u * size;
                let xa = load_f32x4_raw(b, dtype, x_src, at(disp));
                let xb = load_f32x4_raw(b, dtype, x_src, at(disp + half_bytes));
                let cos = b.ins().load(types::F32X4, mem(), tab, at(16 * u));
                let sin = b.ins().load(types::F32X4, mem(), tab, at(16 * u + 2 * d));
                // a' = a·c − b·s, b' = b·c + a·s: one product rounded, one fma.
                let bs = b.ins().fmul(xb, sin);
                let neg_bs = b.ins().fneg(bs);
                let ra = b.ins().fma(xa, cos, neg_bs);
                let bc = b.ins().fmul(xb, cos);
                let rb = b.ins().fma(xa, sin, bc);
                store_f32x4(b, dtype, ra, x_dst, at(disp));
                store_f32x4(b, dtype, rb, x_dst, at(disp + half_bytes));
            });
        }
    }

    /// Rotate the Hkv K heads of an FP8 row in place: per head (D codes at
    /// `codes`, D/g scales at `scales`), dequantize into the f32 buffer
    /// `head`, rotate it in place, and requantize each g-block with a fresh
    /// scale (see the module docs).
    fn emit_e4m3_heads(&self, b: &mut FunctionBuilder, codes: Value, scales: Value, head: Value, table: Value) {
        let d = self.d();
        let g = self.granularity().expect("an FP8 cache");
        let start = b.ins().iconst(types::I64, 0);
        let end = b.ins().iconst(types::I64, (self.spec.cache.num_kv_heads * d) as i64);
        // `h`: the head's first code (D bytes per head); its scales advance
        // by D/g f32 per head, carried.
        counted_loop(b, start, end, d as i64, &[scales], |b, h, carried| {
            let codes = b.ins().iadd(codes, h);
            let scales = carried[0];
            self.emit_e4m3_blocks(b, codes, scales, head, |b, codes, scale, head| {
                let scale = b.ins().load(types::F32, mem(), scale, 0);
                let scale = b.ins().splat(types::F32X4, scale);
                chunk_loop(b, g / 4, 4, |b, at, u| {
                    let src = b.ins().iadd(codes, at);
                    let x = load_f32x4(b, DType::F8E4M3, src, self.disp.of(4 * u));
                    let x = b.ins().fmul(x, scale);
                    let dst = addr::element(b, head, at, 4);
                    b.ins().store(mem(), x, dst, self.disp.of(16 * u));
                });
            });
            self.emit_rotate(b, head, head, DType::F32, table);
            self.emit_e4m3_blocks(b, codes, scales, head, |b, codes, scale_at, head| {
                emit_quantize_block(b, g, head, codes, scale_at);
            });
            vec![b.ins().iadd_imm_s(scales, (d / g * 4) as i64)]
        });
    }

    /// A loop over the D/g blocks of one FP8 head: calls `body(b, codes,
    /// scale, values)` with the addresses of block k's first code, its
    /// scale and its first f32 in `head`.
    fn emit_e4m3_blocks(
        &self,
        b: &mut FunctionBuilder,
        codes: Value,
        scales: Value,
        head: Value,
        body: impl FnOnce(&mut FunctionBuilder, Value, Value, Value),
    ) {
        let g = self.granularity().expect("an FP8 cache");
        let start = b.ins().iconst(types::I64, 0);
        let end = b.ins().iconst(types::I64, (self.d() / g) as i64);
        counted_loop(b, start, end, 1, &[], |b, k, _| {
            let block_codes = addr::element(b, codes, k, g);
            let scale_at = addr::element(b, scales, k, 4);
            let values = addr::element(b, head, k, 4 * g);
            body(b, block_codes, scale_at, values);
            Vec::new()
        });
    }
}

/// Quantize the `g` f32 values at `values` into E4M3 codes at `codes` and
/// one f32 scale at `scale_at`, bit for bit as
/// `kvjit_core::fp8::quantize_block` (the shared
/// [`e4m3::quantize_block`]).
fn emit_quantize_block(b: &mut FunctionBuilder, g: usize, values: Value, codes: Value, scale_at: Value) {
    let count = b.ins().iconst(types::I64, g as i64);
    e4m3::quantize_block(b, values, count, codes, scale_at);
}

/// `(0x8000_0000, 0, 0x8000_0000, 0)` as F32X4: XOR flips the sign of the
/// even lanes (the `−s` of each pair).
fn splat_sign_even_lanes(b: &mut FunctionBuilder) -> Value {
    let bytes: Vec<u8> = [0x8000_0000u32, 0, 0x8000_0000, 0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let c = b.func.dfg.constants.insert(bytes.into());
    let v = b.ins().vconst(types::I32X4, c);
    b.ins().bitcast(types::F32X4, MemFlagsData::new(), v)
}

/// The op as JIT-compiled machine code for one spec ([`kvjit_op::Jit`]:
/// wrap it in [`kvjit_op::Compiled`] to run it as a `Kernel`, or call
/// `run_into`).
///
/// Tensor inputs, in order: `q_proj`, `freqs_cis`, `layer_idx`,
/// `valid_lengths`; one cache; one output.
pub type JitKernel = kvjit_op::Jit<RopeSpec>;

/// Head sizes the generated code handles (a multiple of 8, at most
/// [`MAX_JIT_HEAD_SIZE`]), for an FP8 cache scale granularities that are
/// multiples of 4, and offsets it can form.
impl JitSpec for RopeSpec {
    fn supported(&self) -> Result<(), JitError> {
        supported(self)
    }

    fn compile(&self, capture: CaptureText) -> Result<Arc<JitFunction>, JitError> {
        compile(self, capture)
    }

    /// Run a call the spec checked: `output` holds `B·S·Hq·D` elements.
    fn launch(&self, shape: &CallShape, mut call: Launch<'_, '_>) -> Result<()> {
        let [q_proj, freqs_cis, _, _] = call.tensors();
        if shape.rows.is_empty() || shape.num_q_heads * shape.head_size == 0 {
            return Ok(());
        }
        let mut launch = LaunchArgs {
            q: q_proj.as_bytes().as_ptr() as u64,
            out: call.output.as_mut_ptr() as u64,
            freqs: freqs_cis.as_bytes().as_ptr() as u64,
            blocks: 0,
            rows: shape.rows.as_ptr() as u64,
            scales: 0,
        };
        // Only a call with valid tokens borrows the blocks (and an FP8
        // cache's scales) mutably (which bumps the cache's blocks
        // generation, and copies shared storage).
        if shape.cache_tokens > 0 {
            let (blocks, scales) = call.cache().blocks_and_scales_mut();
            launch.blocks = blocks.as_mut_ptr() as u64;
            launch.scales = scales.map_or(0, |s| s.as_mut_ptr() as u64);
        }
        // SAFETY: `code` was compiled by `emit_and_compile` for this
        // spec without B and S (which the code does not depend on),
        // reading `LaunchArgs` at the `offset_of!` of its fields. The spec's
        // check (`RopeSpec::check`, after `Compiled` or `Jit::run_into` checked
        // dtypes and contiguity) validated every argument against the spec
        // and each other: q_proj `[B, S, Hq, D]` with this spec's Hq and D
        // (so row r reads/writes `Hq·D` elements at `r·Hq·D` inside
        // `q_proj` and `output`, whose byte length was checked against the
        // call); `freqs_cis [max_seq, D]` with every valid token's position
        // `< max_seq` (so `freqs_offset + D ≤ max_seq·D`); the cache layout
        // equal to the spec's, `layer_idx < L`, every valid token's page
        // inside the lookup table and the cache, and no two tokens sharing a
        // (page, slot) (`write_rows`: so `k_offset + Hkv·D` lies inside
        // `blocks` and rows write disjoint K slots). For an FP8 cache,
        // `expect_built_for` matched the cache's dtype and scale granularity
        // to the spec's g, and the cache holds scales
        // `[P, 2, L, page_size, Hkv, D/g]` f32 (its constructors and
        // `set_scales` check that shape), so the row's scales
        // `k_offset/g .. k_offset/g + Hkv·D/g` are those of the same
        // validated (page, layer, slot), inside `scales` and disjoint across
        // rows. `shape.rows` holds one plan per row made from exactly these
        // validated values; padded rows (`freqs_offset < 0`) only zero their
        // own output row and never touch `blocks` or `scales` (null only
        // when no row is valid; `scales` also for caches without scales,
        // which the code then never reads). Rows of different ranges write
        // disjoint memory. `shape`, the tensors and the borrowed output and
        // cache outlive the launch.
        unsafe { kvjit_jit::launch(call.code, &launch, shape.rows.len(), call.ctx) };
        Ok(())
    }
}
