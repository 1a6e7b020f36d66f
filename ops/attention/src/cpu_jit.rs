//! The CPU kernel: machine code Cranelift emits for one [`MhaSpec`].
//!
//! Baked in: D, Hq, Hkv, the page layout (K→V stride), dtypes, mask, window
//! and nothing else; B, S and the context lengths are read at run time.
//!
//! **Work items** are `(b, kv_head, query block, key chunk)`: a block of
//! `QB` query positions times the `G = Hq/Hkv` query heads that share the KV
//! head (`R = QB·G` rows), against one chunk of `CH` key positions. Decode
//! (S = 1) is split-KV flash decoding: the chunks of one `(b, kv_head)` run
//! in parallel and each leaves a partial `(max, sum, acc[D])` per row; the
//! host merges the chunks of each row (`out = Σ e^{m_c−M}·acc_c / Σ
//! e^{m_c−M}·l_c`, f32) and rounds once to the dtype. Prefill uses the same
//! code with QB = 8 and, when there are enough items, one chunk.
//!
//! Inside an item, keys go in blocks of [`KB`]; per block and row:
//!
//! ```text
//! scores[j] = q_row · K[p0+j]        (4 keys at a time: F32X4 FMAs along D, 2 accumulator
//!                                     sets, then a 4×4 transpose-add; lanes outside the row's
//!                                     key range → -inf)
//! m' = max(m, max_j scores)          (guarded: a row with no key yet uses 0, so -inf − -inf never occurs)
//! p[j] = exp(scores[j] − m'), α = exp(m − m')      (vector polynomial exp, crate::exp)
//! l = α·l + Σ p ;  acc = α·acc + Σ_j p[j]·V[p0+j]  (only the row's valid keys; 8 F32X4
//!                                                    accumulators per pass over D)
//! ```
//!
//! K and V are read in place through a per-position table of row offsets
//! (`kv_row_offsets`), built on the host from one checked
//! [`locate`](kvjit_core::PagedKVCacheCollection::locate) per page; q is
//! pre-scaled by `scale` and widened to f32 on the host (B·S·Hq·D values).

use std::sync::Arc;

use half::{bf16, f16};
use kvjit_core::{DType, Error, KernelKey, PagedKVCacheCollection, Result, Tensor};
use kvjit_jit::cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use kvjit_jit::cranelift_codegen::ir::{self, InstBuilder, MemFlagsData, Value, types};
use kvjit_jit::cranelift_frontend::FunctionBuilder;
use kvjit_jit::ir::{counted_loop, load_f32x4_raw, mem, splat_f32};
use kvjit_jit::{CaptureText, CompileCause, JitError, JitFunction, compile_kernel};
use kvjit_runtime::{CodeInfo, DeviceContextPtr, Kernel, OutputSpec};

use crate::call::{AttentionConfig, CallShape, key_row_offsets};
use crate::exp::emit_exp_f32x4;
use crate::kernel::{check_against_spec, checked_call};
use crate::{Mask, MhaSpec};

/// Keys per block (scores and probabilities of one block live in the item's
/// scratch).
pub const KB: usize = 16;
/// Key positions per chunk in split-KV (decode) launches.
pub const DECODE_CHUNK: usize = 256;
/// Query positions per work item in prefill.
pub const PREFILL_QUERY_BLOCK: usize = 8;
/// F32X4 accumulators per pass over D in the P·V update.
const PV_VECTORS: usize = 8;

/// The kernel's argument words, in order.
mod arg {
    /// q, pre-scaled, as f32 `[B, S, Hq, D]`.
    pub const Q: usize = 0;
    /// The cache's blocks.
    pub const BLOCKS: usize = 1;
    /// i64 `[B, T]`: element offset of the K row (head 0) of each position.
    pub const KEY_OFFSETS: usize = 2;
    /// i64 `[B, 2]`: cache length and valid length of each sequence.
    pub const LENGTHS: usize = 3;
    /// f32 partials: per item `[2·KB scratch | R rows × (m, l, acc[D])]`.
    pub const PARTIALS: usize = 4;
    /// S.
    pub const SEQ: usize = 5;
    /// T, the stride of the offsets table (≥ C·CH + KB).
    pub const STRIDE: usize = 6;
    /// Query blocks per (b, kv head).
    pub const QUERY_BLOCKS: usize = 7;
    /// Query positions per block, QB.
    pub const QUERY_BLOCK: usize = 8;
    /// Key chunks per (b, kv head, query block), C.
    pub const CHUNKS: usize = 9;
    /// Key positions per chunk, CH (a multiple of KB).
    pub const CHUNK: usize = 10;
    /// f32 values per item in the partials.
    pub const ITEM_FLOATS: usize = 11;
    /// Words in all.
    pub const COUNT: usize = 12;
}

/// Refuse specs the kernel cannot serve: D must be a multiple of 4 (whole
/// F32X4 vectors), and the fixed offsets must fit the code's displacements.
pub(crate) fn supported(spec: &MhaSpec) -> Result<(), JitError> {
    let reason = if !spec.head_size.is_multiple_of(4) {
        Some(format!("the CPU kernel needs head_size % 4 == 0 (whole F32X4 vectors), got {}", spec.head_size))
    } else {
        let fits = || -> Option<()> {
            let kv_stride = spec.num_layers.checked_mul(spec.page_size)?.checked_mul(spec.num_kv_heads)?;
            let kv_stride = kv_stride.checked_mul(spec.head_size)?;
            let bytes = kv_stride.checked_mul(2 * spec.cache_dtype.size_bytes())?;
            let row = spec.head_size.checked_mul(4 * (spec.num_heads + 2))?;
            (i64::try_from(bytes).is_ok() && i32::try_from(row).is_ok()).then_some(())
        };
        fits().is_none().then(|| "its sizes overflow the offsets the kernel computes".to_string())
    };
    match reason {
        Some(reason) => Err(JitError::Unsupported { key: spec.kernel_key().to_string(), reason }),
        None => Ok(()),
    }
}

/// Compile the kernel for `spec` (or fetch it from the process-wide
/// registry). Kept IR/disassembly bypass the registry.
pub fn compile(spec: &MhaSpec, capture: CaptureText) -> Result<Arc<JitFunction>, JitError> {
    let key = spec.kernel_key();
    let build = || emit_and_compile(spec, &key, capture);
    if capture.clif || capture.disasm {
        return build().map(Arc::new);
    }
    kvjit_jit::kernels().get_or_compile(&key, CompileCause::GraphBuild, build)
}

fn emit_and_compile(spec: &MhaSpec, key: &KernelKey, capture: CaptureText) -> Result<JitFunction, JitError> {
    supported(spec)?;
    compile_kernel(key, capture, |b, params| {
        let words: Vec<Value> = (0..arg::COUNT).map(|i| params.arg(b, i)).collect();
        let e = Emitter { spec: *spec, words };
        counted_loop(b, params.begin, params.end, 1, &[], |b, item, _| {
            e.emit_item(b, item);
            Vec::new()
        });
    })
}

struct Emitter {
    spec: MhaSpec,
    words: Vec<Value>,
}

/// What one row's pass over a key block needs.
struct RowBlock {
    /// Address of the row's partial (m, l, acc).
    row: Value,
    /// Address of the row's f32 query.
    q: Value,
    /// Address of the sequence's key offsets at position p0.
    offsets: Value,
    /// Scratch: KB scores then KB probabilities.
    scratch: Value,
    /// Valid keys of the block for this row, `[ja, je)` relative to p0.
    ja: Value,
    je: Value,
    /// Byte offset of the KV head within a K row.
    head_bytes: Value,
}

fn iconst(b: &mut FunctionBuilder, v: i64) -> Value {
    b.ins().iconst(types::I64, v)
}

/// `if cond { then } else { otherwise }` returning one value of type `ty`.
fn if_else(
    b: &mut FunctionBuilder,
    cond: Value,
    ty: ir::Type,
    then: impl FnOnce(&mut FunctionBuilder) -> Value,
    otherwise: impl FnOnce(&mut FunctionBuilder) -> Value,
) -> Value {
    let (t, f, join) = (b.create_block(), b.create_block(), b.create_block());
    b.append_block_param(join, ty);
    b.ins().brif(cond, t, &[], f, &[]);
    b.switch_to_block(t);
    let v = then(b);
    b.ins().jump(join, &[ir::BlockArg::Value(v)]);
    b.switch_to_block(f);
    let v = otherwise(b);
    b.ins().jump(join, &[ir::BlockArg::Value(v)]);
    b.switch_to_block(join);
    b.block_params(join)[0]
}

/// `if cond { then }`.
fn when(b: &mut FunctionBuilder, cond: Value, then: impl FnOnce(&mut FunctionBuilder)) {
    let (t, join) = (b.create_block(), b.create_block());
    b.ins().brif(cond, t, &[], join, &[]);
    b.switch_to_block(t);
    then(b);
    b.ins().jump(join, &[]);
    b.switch_to_block(join);
}

/// Lanes of `a` (0..4) and `c` (4..8) picked by `lanes`, as an `F32X4`.
fn shuffle32(b: &mut FunctionBuilder, a: Value, c: Value, lanes: [u8; 4]) -> Value {
    let little = MemFlagsData::new().with_endianness(ir::Endianness::Little);
    let a = b.ins().bitcast(types::I8X16, little, a);
    let c = b.ins().bitcast(types::I8X16, little, c);
    let bytes: Vec<u8> = lanes.iter().flat_map(|&l| (0..4).map(move |i| 4 * l + i)).collect();
    let mask = b.func.dfg.immediates.push(bytes.into());
    let s = b.ins().shuffle(a, c, mask);
    b.ins().bitcast(types::F32X4, little, s)
}

/// `[Σ a0, Σ a1, Σ a2, Σ a3]` (4×4 transpose-add).
fn transpose_sum(b: &mut FunctionBuilder, a: [Value; 4]) -> Value {
    let pair = |b: &mut FunctionBuilder, x: Value, y: Value| {
        let lo = shuffle32(b, x, y, [0, 4, 1, 5]);
        let hi = shuffle32(b, x, y, [2, 6, 3, 7]);
        b.ins().fadd(lo, hi)
    };
    let x = pair(b, a[0], a[1]);
    let y = pair(b, a[2], a[3]);
    let lo = shuffle32(b, x, y, [0, 1, 4, 5]);
    let hi = shuffle32(b, x, y, [2, 3, 6, 7]);
    b.ins().fadd(lo, hi)
}

/// Horizontal reduction of an `F32X4` with `op` (fadd or fmax), as a scalar.
fn reduce(b: &mut FunctionBuilder, v: Value, max: bool) -> Value {
    let op = |b: &mut FunctionBuilder, x: Value, y: Value| if max { b.ins().fmax(x, y) } else { b.ins().fadd(x, y) };
    let hi = shuffle32(b, v, v, [2, 3, 2, 3]);
    let v = op(b, v, hi);
    let odd = shuffle32(b, v, v, [1, 1, 1, 1]);
    let v = op(b, v, odd);
    b.ins().extractlane(v, 0)
}

impl Emitter {
    fn word(&self, i: usize) -> Value {
        self.words[i]
    }

    fn g(&self) -> i64 {
        self.spec.group() as i64
    }

    fn d(&self) -> i64 {
        self.spec.head_size as i64
    }

    /// Bytes of one row's partial: m, l, acc[D].
    fn row_bytes(&self) -> i64 {
        (self.d() + 2) * 4
    }

    /// Elements from a K row to its V row: L·page_size·Hkv·D.
    fn kv_stride(&self) -> i64 {
        (self.spec.num_layers * self.spec.page_size * self.spec.num_kv_heads * self.spec.head_size) as i64
    }

    fn emit_item(&self, b: &mut FunctionBuilder, item: Value) {
        let chunks = self.word(arg::CHUNKS);
        let c = b.ins().urem(item, chunks);
        let rest = b.ins().udiv(item, chunks);
        let nqb = self.word(arg::QUERY_BLOCKS);
        let qb = b.ins().urem(rest, nqb);
        let rest = b.ins().udiv(rest, nqb);
        let hkv_count = iconst(b, self.spec.num_kv_heads as i64);
        let hkv = b.ins().urem(rest, hkv_count);
        let batch = b.ins().udiv(rest, hkv_count);

        let item_bytes = b.ins().imul(item, self.word(arg::ITEM_FLOATS));
        let item_bytes = b.ins().ishl_imm_u(item_bytes, 2);
        let scratch = b.ins().iadd(self.word(arg::PARTIALS), item_bytes);
        let rows_base = b.ins().iadd_imm_s(scratch, (2 * KB * 4) as i64);

        let query_block = self.word(arg::QUERY_BLOCK);
        let rows = b.ins().imul_imm_s(query_block, self.g());
        // Every row starts empty: m = -inf, l = 0, acc = 0.
        let zero = iconst(b, 0);
        counted_loop(b, zero, rows, 1, &[], |b, r, _| {
            let at = b.ins().imul_imm_s(r, self.row_bytes());
            let at = b.ins().iadd(rows_base, at);
            let ninf = b.ins().f32const(f32::NEG_INFINITY);
            let z = b.ins().f32const(0.0);
            b.ins().store(mem(), ninf, at, 0);
            b.ins().store(mem(), z, at, 4);
            let zv = splat_f32(b, 0.0);
            for i in 0..self.spec.head_size / 4 {
                b.ins().store(mem(), zv, at, 8 + 16 * i as i32);
            }
            Vec::new()
        });

        // The sequence's lengths and this block's valid queries.
        let lengths_at = b.ins().ishl_imm_u(batch, 4);
        let lengths_at = b.ins().iadd(self.word(arg::LENGTHS), lengths_at);
        let cl = b.ins().load(types::I64, mem(), lengths_at, 0);
        let valid = b.ins().load(types::I64, mem(), lengths_at, 8);
        let s0 = b.ins().imul(qb, query_block);
        let s_end = b.ins().iadd(s0, query_block);
        let s_end = b.ins().smin(s_end, valid);
        let any = b.ins().icmp(IntCC::SignedLessThan, s0, s_end);
        when(b, any, |b| {
            let s_last = b.ins().iadd_imm_s(s_end, -1);
            let (item_lo, _) = self.row_range(b, cl, valid, s0);
            let (_, item_hi) = self.row_range(b, cl, valid, s_last);
            let chunk = self.word(arg::CHUNK);
            let c_lo = b.ins().imul(c, chunk);
            let c_hi = b.ins().iadd(c_lo, chunk);
            let lo = b.ins().smax(item_lo, c_lo);
            let hi = b.ins().smin(item_hi, c_hi);
            let valid_rows = b.ins().isub(s_end, s0);
            let valid_rows = b.ins().imul_imm_s(valid_rows, self.g());
            let stride = self.word(arg::STRIDE);
            let seq_offsets = b.ins().imul(batch, stride);
            let head_bytes = b.ins().imul_imm_s(hkv, self.d() * self.spec.cache_dtype.size_bytes() as i64);
            counted_loop(b, lo, hi, KB as i64, &[], |b, p0, _| {
                let p0_end = b.ins().iadd_imm_s(p0, KB as i64);
                let block_hi = b.ins().smin(p0_end, c_hi);
                let offsets = b.ins().iadd(seq_offsets, p0);
                let offsets = b.ins().ishl_imm_u(offsets, 3);
                let offsets = b.ins().iadd(self.word(arg::KEY_OFFSETS), offsets);
                let zero = iconst(b, 0);
                counted_loop(b, zero, valid_rows, 1, &[], |b, r, _| {
                    let (ds, g) = self.div_group(b, r);
                    let s = b.ins().iadd(s0, ds);
                    let (row_lo, row_hi) = self.row_range(b, cl, valid, s);
                    let a = b.ins().smax(row_lo, p0);
                    let e = b.ins().smin(row_hi, block_hi);
                    let some = b.ins().icmp(IntCC::SignedLessThan, a, e);
                    when(b, some, |b| {
                        // Row r of the item: (s0 + r / G, head hkv·G + r % G).
                        let row = b.ins().imul_imm_s(r, self.row_bytes());
                        let row = b.ins().iadd(rows_base, row);
                        let seq = self.word(arg::SEQ);
                        let q_row = b.ins().imul(batch, seq);
                        let q_row = b.ins().iadd(q_row, s);
                        let q_row = b.ins().imul_imm_s(q_row, self.spec.num_heads as i64);
                        let head = b.ins().imul_imm_s(hkv, self.g());
                        let head = b.ins().iadd(head, g);
                        let q_row = b.ins().iadd(q_row, head);
                        let q_row = b.ins().imul_imm_s(q_row, self.d() * 4);
                        let q = b.ins().iadd(self.word(arg::Q), q_row);
                        let ja = b.ins().isub(a, p0);
                        let je = b.ins().isub(e, p0);
                        self.emit_row_block(b, &RowBlock { row, q, offsets, scratch, ja, je, head_bytes });
                    });
                    Vec::new()
                });
                Vec::new()
            });
        });
    }

    /// `(r / G, r % G)`.
    fn div_group(&self, b: &mut FunctionBuilder, r: Value) -> (Value, Value) {
        let g = self.spec.group();
        if g.is_power_of_two() {
            let shift = g.trailing_zeros() as i64;
            let q = b.ins().ushr_imm_u(r, shift);
            let m = b.ins().band_imm_s(r, g as i64 - 1);
            (q, m)
        } else {
            let gv = iconst(b, g as i64);
            (b.ins().udiv(r, gv), b.ins().urem(r, gv))
        }
    }

    /// The key positions `[lo, hi)` query `s` reads.
    fn row_range(&self, b: &mut FunctionBuilder, cl: Value, valid: Value, s: Value) -> (Value, Value) {
        let own = b.ins().iadd(cl, s);
        let own_end = b.ins().iadd_imm_s(own, 1);
        let hi = match self.spec.mask {
            Mask::Causal => own_end,
            Mask::Null => b.ins().iadd(cl, valid),
        };
        let lo = match self.spec.window {
            Some(w) => {
                let lo = b.ins().iadd_imm_s(own_end, -(w as i64));
                let zero = iconst(b, 0);
                b.ins().smax(lo, zero)
            }
            None => iconst(b, 0),
        };
        (lo, hi)
    }

    /// One row against one key block: scores, online softmax, P·V.
    fn emit_row_block(&self, b: &mut FunctionBuilder, rb: &RowBlock) {
        let cdt = self.spec.cache_dtype;
        let csize = cdt.size_bytes() as i64;
        let dv = self.spec.head_size / 4;
        let ja32 = b.ins().ireduce(types::I32, rb.ja);
        let ja_v = b.ins().splat(types::I32X4, ja32);
        let je32 = b.ins().ireduce(types::I32, rb.je);
        let je_v = b.ins().splat(types::I32X4, je32);
        let ninf = splat_f32(b, f32::NEG_INFINITY);
        let mut block_max = ninf;
        for grp in 0..KB / 4 {
            let first = iconst(b, 4 * grp as i64);
            let last = iconst(b, 4 * grp as i64 + 4);
            let starts_before_end = b.ins().icmp(IntCC::SignedLessThan, first, rb.je);
            let ends_after_start = b.ins().icmp(IntCC::SignedGreaterThan, last, rb.ja);
            let needed = b.ins().band(starts_before_end, ends_after_start);
            let scores = if_else(
                b,
                needed,
                types::F32X4,
                |b| {
                    let keys: Vec<Value> = (0..4)
                        .map(|j| {
                            let off = b.ins().load(types::I64, mem(), rb.offsets, (8 * (4 * grp + j)) as i32);
                            let off = b.ins().imul_imm_s(off, csize);
                            let at = b.ins().iadd(self.word(arg::BLOCKS), off);
                            b.ins().iadd(at, rb.head_bytes)
                        })
                        .collect();
                    let zero = splat_f32(b, 0.0);
                    let sets = if dv >= 2 { 2 } else { 1 };
                    let mut acc = vec![[zero; 4]; sets];
                    for i in 0..dv {
                        let qv = b.ins().load(types::F32X4, mem(), rb.q, 16 * i as i32);
                        for (j, &key) in keys.iter().enumerate() {
                            let kv = load_f32x4_raw(b, cdt, key, (4 * i as i64 * csize) as i32);
                            acc[i % sets][j] = b.ins().fma(qv, kv, acc[i % sets][j]);
                        }
                    }
                    let mut sums = acc[0];
                    if sets == 2 {
                        for j in 0..4 {
                            sums[j] = b.ins().fadd(acc[0][j], acc[1][j]);
                        }
                    }
                    let s = transpose_sum(b, sums);
                    // Lanes outside [ja, je) → -inf.
                    let lane =
                        b.func.dfg.constants.insert(
                            (0..4u32).flat_map(|j| (4 * grp as u32 + j).to_le_bytes()).collect::<Vec<u8>>().into(),
                        );
                    let lane = b.ins().vconst(types::I32X4, lane);
                    let ge = b.ins().icmp(IntCC::SignedGreaterThanOrEqual, lane, ja_v);
                    let lt = b.ins().icmp(IntCC::SignedLessThan, lane, je_v);
                    let inside = b.ins().band(ge, lt);
                    let inside = b.ins().bitcast(types::F32X4, MemFlagsData::new(), inside);
                    let ninf = splat_f32(b, f32::NEG_INFINITY);
                    b.ins().bitselect(inside, s, ninf)
                },
                |b| splat_f32(b, f32::NEG_INFINITY),
            );
            b.ins().store(mem(), scores, rb.scratch, 16 * grp as i32);
            block_max = b.ins().fmax(block_max, scores);
        }
        let block_max = reduce(b, block_max, true);

        // Online softmax, guarded against a row with no key yet.
        let m_old = b.ins().load(types::F32, mem(), rb.row, 0);
        let l_old = b.ins().load(types::F32, mem(), rb.row, 4);
        let m_new = b.ins().fmax(m_old, block_max);
        let ninf_s = b.ins().f32const(f32::NEG_INFINITY);
        let empty = b.ins().fcmp(FloatCC::Equal, m_new, ninf_s);
        let zero_s = b.ins().f32const(0.0);
        let m_use = b.ins().select(empty, zero_s, m_new);
        let m_use_v = b.ins().splat(types::F32X4, m_use);
        let m_old_v = b.ins().splat(types::F32X4, m_old);
        let alpha_arg = b.ins().fsub(m_old_v, m_use_v);
        let alpha_v = emit_exp_f32x4(b, alpha_arg);
        let mut psum = splat_f32(b, 0.0);
        for grp in 0..KB / 4 {
            let s = b.ins().load(types::F32X4, mem(), rb.scratch, 16 * grp as i32);
            let x = b.ins().fsub(s, m_use_v);
            let p = emit_exp_f32x4(b, x);
            b.ins().store(mem(), p, rb.scratch, (4 * KB + 16 * grp) as i32);
            psum = b.ins().fadd(psum, p);
        }
        let psum = reduce(b, psum, false);
        let alpha = b.ins().extractlane(alpha_v, 0);
        let l_new = b.ins().fma(l_old, alpha, psum);
        b.ins().store(mem(), m_new, rb.row, 0);
        b.ins().store(mem(), l_new, rb.row, 4);

        // acc = α·acc + Σ_j p_j·V_j over the row's valid keys.
        let v_bytes = self.kv_stride() * csize;
        let mut first = 0;
        while first < dv {
            let count = PV_VECTORS.min(dv - first);
            let accs: Vec<Value> = (0..count)
                .map(|i| {
                    let a = b.ins().load(types::F32X4, mem(), rb.row, (8 + 16 * (first + i)) as i32);
                    b.ins().fmul(a, alpha_v)
                })
                .collect();
            let accs = counted_loop(b, rb.ja, rb.je, 1, &accs, |b, j, accs| {
                let p_at = b.ins().ishl_imm_u(j, 2);
                let p_at = b.ins().iadd(rb.scratch, p_at);
                let off_at = b.ins().ishl_imm_u(j, 3);
                let off_at = b.ins().iadd(rb.offsets, off_at);
                let off = b.ins().load(types::I64, mem(), off_at, 0);
                let off = b.ins().imul_imm_s(off, csize);
                let at = b.ins().iadd(self.word(arg::BLOCKS), off);
                let at = b.ins().iadd(at, rb.head_bytes);
                let p = b.ins().load(types::F32, mem(), p_at, (4 * KB) as i32);
                let p = b.ins().splat(types::F32X4, p);
                (0..count)
                    .map(|i| {
                        let disp = v_bytes + (4 * (first + i)) as i64 * csize;
                        let v = load_f32x4_raw(b, cdt, at, disp as i32);
                        b.ins().fma(p, v, accs[i])
                    })
                    .collect()
            });
            for (i, &a) in accs.iter().enumerate() {
                b.ins().store(mem(), a, rb.row, (8 + 16 * (first + i)) as i32);
            }
            first += count;
        }
    }
}

/// The launch plan of one call: how queries and keys are cut into items.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    query_block: usize,
    query_blocks: usize,
    chunk: usize,
    chunks: usize,
    stride: usize,
    rows: usize,
    item_floats: usize,
    items: usize,
}

impl Plan {
    fn new(spec: &MhaSpec, shape: &CallShape, threads: usize) -> Self {
        let group = shape.group();
        let max_hi = shape.key_ranges.iter().map(|r| r.1).max().unwrap_or(0).max(1);
        let query_block = shape.seq.clamp(1, PREFILL_QUERY_BLOCK);
        let query_blocks = shape.seq.div_ceil(query_block).max(1);
        let outer = shape.batch * shape.num_kv_heads * query_blocks;
        // One chunk per row when there is enough parallel work already
        // (prefill), else split the keys (decode).
        let chunk = if shape.seq > 1 && outer >= 4 * threads { max_hi.div_ceil(KB) * KB } else { DECODE_CHUNK };
        let chunks = max_hi.div_ceil(chunk);
        let rows = query_block * group;
        let item_floats = 2 * KB + rows * (spec.head_size + 2);
        Plan {
            query_block,
            query_blocks,
            chunk,
            chunks,
            stride: chunks * chunk + KB,
            rows,
            item_floats,
            items: outer * chunks,
        }
    }
}

/// The op as JIT-compiled machine code for one kernel key.
///
/// Tensor inputs, in order: `q`, `layer_idx`, `valid_lengths`; one cache;
/// one output.
pub struct JitKernel {
    spec: MhaSpec,
    key: KernelKey,
    code: Arc<JitFunction>,
}

impl JitKernel {
    /// Compile (or fetch) the kernel for `spec`.
    pub fn new(spec: MhaSpec, capture: CaptureText) -> Result<Self, JitError> {
        let code = compile(&spec, capture)?;
        Ok(Self { key: spec.kernel_key(), spec, code })
    }

    /// Run with the output written into raw bytes (exactly `B·S·Hq·D`
    /// elements of the dtype), so callers choose where it lives (tests with
    /// guard regions). Validates everything first, like [`Kernel::run`].
    pub fn run_into(
        &self,
        inputs: &[&Tensor],
        cache: &PagedKVCacheCollection,
        output: &mut [u8],
        ctx: &DeviceContextPtr,
    ) -> Result<()> {
        let shape = check_against_spec(&self.spec, inputs, &[cache])?;
        let expected = shape.output_shape().iter().product::<usize>() * self.spec.dtype.size_bytes();
        if output.len() != expected {
            return Err(Error::ByteCount {
                dtype: self.spec.dtype,
                shape: shape.output_shape(),
                expected,
                got: output.len(),
            });
        }
        self.launch(&shape, inputs[0], inputs[2], cache, output, ctx)
    }

    /// Run a validated call: `shape` came from `check_against_spec` on these
    /// arguments and `output` holds `B·S·Hq·D` elements of the dtype.
    fn launch(
        &self,
        shape: &CallShape,
        q: &Tensor,
        valid_lengths: &Tensor,
        cache: &PagedKVCacheCollection,
        output: &mut [u8],
        ctx: &DeviceContextPtr,
    ) -> Result<()> {
        let threads = ctx.cpu_context().map_or(1, |c| c.threads());
        let plan = Plan::new(&self.spec, shape, threads);
        let valid = valid_lengths.as_slice::<u32>()?;
        let mut out = vec![0f32; shape.output_shape().iter().product()];
        if valid.iter().any(|&v| v > 0) {
            let offsets = key_row_offsets(shape, cache, plan.stride)?;
            let scale = self.spec.scale;
            let q: Vec<f32> = q.to_f32_vec()?.into_iter().map(|x| x * scale).collect();
            let lengths: Vec<i64> =
                (0..shape.batch).flat_map(|b| [i64::from(cache.cache_lengths()[b]), i64::from(valid[b])]).collect();
            let mut partials = vec![0f32; plan.items * plan.item_floats];
            let mut args = [0u64; arg::COUNT];
            args[arg::Q] = q.as_ptr() as u64;
            args[arg::BLOCKS] = cache.blocks().as_bytes().as_ptr() as u64;
            args[arg::KEY_OFFSETS] = offsets.as_ptr() as u64;
            args[arg::LENGTHS] = lengths.as_ptr() as u64;
            args[arg::PARTIALS] = partials.as_mut_ptr() as u64;
            args[arg::SEQ] = shape.seq as u64;
            args[arg::STRIDE] = plan.stride as u64;
            args[arg::QUERY_BLOCKS] = plan.query_blocks as u64;
            args[arg::QUERY_BLOCK] = plan.query_block as u64;
            args[arg::CHUNKS] = plan.chunks as u64;
            args[arg::CHUNK] = plan.chunk as u64;
            args[arg::ITEM_FLOATS] = plan.item_floats as u64;
            // SAFETY: `code` was compiled by `emit_and_compile` for this
            // kernel's spec, reading the argument words in `arg`'s layout.
            // `check_against_spec` validated the call against the spec (q is
            // contiguous [B, S, Hq, D] with the spec's Hq and D, the cache has
            // the spec's layout and B sequences, layer < L, valid_lengths[b] ≤
            // S, cl + v fits u32, and every page holding a key position in
            // `key_ranges[b]` is inside the lookup table and the cache). So:
            // q reads stay in `q` (B·S·Hq·D f32, rows s < v ≤ S); every K/V
            // read is at `offsets[b·T + p]` (p < C·CH + KB = T: the item loops
            // stay below c_hi ≤ C·CH, blocks read at most KB past p0) plus
            // head·D + d (+ the K→V stride), where each offset is either a
            // checked row `[page, 0, layer, slot]` of the blocks or 0, both
            // leaving a whole K and V row inside `blocks`; `lengths` has 2·B
            // words; each item writes only its own `item_floats` values of
            // `partials` (items·item_floats long), so ranges write disjoint
            // memory. The cache is only read. All buffers outlive the launch.
            unsafe { kvjit_jit::launch(&self.code, &args, plan.items, ctx) };
            merge(shape, &plan, valid, &partials, &mut out);
        }
        store_output(self.spec.dtype, &out, output);
        Ok(())
    }
}

/// Combine the chunks' partials of every valid row into `out` (f32,
/// `[B, S, Hq, D]`); padded rows stay zero.
fn merge(shape: &CallShape, plan: &Plan, valid: &[u32], partials: &[f32], out: &mut [f32]) {
    let (d, hq, group) = (shape.head_size, shape.num_heads, shape.group());
    let row_floats = d + 2;
    let mut acc = vec![0f32; d];
    for b in 0..shape.batch {
        for s in 0..valid[b] as usize {
            let (qb, ds) = (s / plan.query_block, s % plan.query_block);
            for h in 0..hq {
                let (hkv, g) = (h / group, h % group);
                let first_item = ((b * shape.num_kv_heads + hkv) * plan.query_blocks + qb) * plan.chunks;
                let row = |c: usize| {
                    let at = (first_item + c) * plan.item_floats + 2 * KB + (ds * group + g) * row_floats;
                    &partials[at..at + row_floats]
                };
                let max = (0..plan.chunks).map(|c| row(c)[0]).fold(f32::NEG_INFINITY, f32::max);
                let dst = &mut out[((b * shape.seq + s) * hq + h) * d..][..d];
                if max == f32::NEG_INFINITY {
                    dst.fill(0.0);
                    continue;
                }
                acc.fill(0.0);
                let mut total = 0f32;
                for c in 0..plan.chunks {
                    let part = row(c);
                    if part[0] == f32::NEG_INFINITY {
                        continue;
                    }
                    let w = (part[0] - max).exp();
                    total += w * part[1];
                    for (a, &x) in acc.iter_mut().zip(&part[2..]) {
                        *a += w * x;
                    }
                }
                let inv = 1.0 / total;
                for (o, &a) in dst.iter_mut().zip(&acc) {
                    *o = a * inv;
                }
            }
        }
    }
}

/// Round `values` once to `dtype` into `output`'s bytes.
fn store_output(dtype: DType, values: &[f32], output: &mut [u8]) {
    match dtype {
        DType::F32 => {
            for (dst, v) in output.chunks_exact_mut(4).zip(values) {
                dst.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::BF16 => {
            for (dst, v) in output.chunks_exact_mut(2).zip(values) {
                dst.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
        DType::F16 => {
            for (dst, v) in output.chunks_exact_mut(2).zip(values) {
                dst.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        DType::U32 => unreachable!("the spec's dtype is a float"),
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
        let shape = check_against_spec(&self.spec, inputs, caches)?;
        Ok(vec![(self.spec.dtype, shape.output_shape())])
    }

    fn run(
        &self,
        inputs: &[&Tensor],
        caches: &mut [&mut PagedKVCacheCollection],
        outputs: &mut [Tensor],
        ctx: &DeviceContextPtr,
    ) -> Result<()> {
        let call = checked_call(&self.spec, inputs, caches, outputs)?;
        self.launch(&call.shape, call.q, call.valid_lengths, call.cache, call.output.as_bytes_mut(), ctx)
    }
}

/// The config a spec bakes in.
pub(crate) fn config_of(spec: &MhaSpec) -> AttentionConfig {
    AttentionConfig { mask: spec.mask, window: spec.window, scale: spec.scale }
}
