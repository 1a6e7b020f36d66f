//! The FP8 store kernel: a second Cranelift kernel of an FP8 cache's launch
//! sequence, quantizing the rows the main kernel staged in f32 into the
//! cache, each g-block with its own scale.

use std::mem::offset_of;
use std::sync::Arc;

use kvjit_core::{DType, KernelKey, KeyField, Result, Target};
use kvjit_jit::cranelift_codegen::ir::{InstBuilder, condcodes::IntCC, types};
use kvjit_jit::cranelift_frontend::FunctionBuilder;
use kvjit_jit::ir::addr::{self, Size};
use kvjit_jit::ir::{counted_loop, e4m3, mem, when};
use kvjit_jit::{CaptureText, JitError, JitFunction, compile_kernel};

use crate::{FusedQkvSpec, Sizes};

/// The FP8 store kernel's arguments; its work items are rows.
#[repr(C)]
pub(super) struct Fp8StoreArgs {
    /// The staged K/V, f32 `[M, 2·kv_dim]` (each row's K then V).
    pub stage: u64,
    /// Per row, the element offset of its K in the cache's blocks (-1:
    /// padded row, nothing stored).
    pub row_offsets: u64,
    /// The cache's blocks (one byte per element).
    pub blocks: u64,
    /// The cache's f32 scales.
    pub scales: u64,
    /// Hkv·D (read by the unspecialized kernel only, like the next two).
    pub kv_dim: u64,
    /// Elements from a token's K to its V in the blocks.
    pub kv_stride: u64,
    /// Values per scale, g.
    pub g: u64,
}

// SAFETY: `#[repr(C)]` and made of u64 words only.
unsafe impl kvjit_jit::KernelArgs for Fp8StoreArgs {}

/// The key of the FP8 store kernel for `spec` (sizes left to run time for
/// the unspecialized kernel).
fn fp8_store_key(spec: &FusedQkvSpec) -> KernelKey {
    let runtime_sizes = spec.sizes == Sizes::Runtime;
    let size = |n: usize| if runtime_sizes { KeyField::Dynamic } else { KeyField::size(n) };
    KernelKey::new("fused_qkv_fp8_store", Target::Cpu, DType::F32)
        .with("kvdim", size(spec.kv_dim()))
        .with("g", size(spec.cache.scale_granularity().unwrap_or(0)))
        .with("kvs", size(spec.kv_stride()))
}

/// Compile (or fetch) the kernel quantizing an FP8 cache's staged rows:
/// for each valid row in the thread's range, K then V, each g-block of
/// Hkv·D values with its own scale (`e4m3::quantize_block`), codes at the
/// row's page slot and scales at the same index divided by g.
pub(super) fn compile_fp8_store(spec: &FusedQkvSpec) -> Result<Arc<JitFunction>, JitError> {
    let key = fp8_store_key(spec);
    let runtime_sizes = spec.sizes == Sizes::Runtime;
    let Some(g) = spec.cache.scale_granularity() else {
        return Err(JitError::Unsupported {
            key: key.to_string(),
            reason: "an f8e4m3 cache needs a granularity".into(),
        });
    };
    let build = || {
        compile_kernel(&key, CaptureText::default(), |b, params| {
            let field = |b: &mut FunctionBuilder, offset: usize| params.field(b, offset);
            let (stage, row_offsets, blocks, scales) = (
                field(b, offset_of!(Fp8StoreArgs, stage)),
                field(b, offset_of!(Fp8StoreArgs, row_offsets)),
                field(b, offset_of!(Fp8StoreArgs, blocks)),
                field(b, offset_of!(Fp8StoreArgs, scales)),
            );
            let sized = |b: &mut FunctionBuilder, offset: usize, n: usize| {
                let size = if runtime_sizes { Size::Runtime(field(b, offset)) } else { Size::Known(n) };
                size.value(b)
            };
            let kv_dim = sized(b, offset_of!(Fp8StoreArgs, kv_dim), spec.kv_dim());
            let kv_stride = sized(b, offset_of!(Fp8StoreArgs, kv_stride), spec.kv_stride());
            let g = sized(b, offset_of!(Fp8StoreArgs, g), g);
            let blocks_per_row = b.ins().udiv(kv_dim, g);
            let g_bytes = b.ins().ishl_imm_u(g, 2);
            let row_floats = b.ins().ishl_imm_u(kv_dim, 1);
            counted_loop(b, params.begin, params.end, 1, &[], |b, row, _| {
                let at = addr::element(b, row_offsets, row, 8);
                let slot = b.ins().load(types::I64, mem(), at, 0);
                let writes = b.ins().icmp_imm_s(IntCC::SignedGreaterThanOrEqual, slot, 0);
                when(b, writes, |b| {
                    let first = b.ins().imul(row, row_floats);
                    for kv in 0..2 {
                        let (element, staged) = if kv == 0 {
                            (slot, first)
                        } else {
                            (b.ins().iadd(slot, kv_stride), b.ins().iadd(first, kv_dim))
                        };
                        let src = addr::element(b, stage, staged, 4);
                        let codes = b.ins().iadd(blocks, element);
                        let scale_index = b.ins().udiv(element, g);
                        let scale_at = addr::element(b, scales, scale_index, 4);
                        let zero = b.ins().iconst(types::I64, 0);
                        counted_loop(b, zero, blocks_per_row, 1, &[], |b, block, _| {
                            let src_at = b.ins().imul(block, g_bytes);
                            let src_at = b.ins().iadd(src, src_at);
                            let codes_at = b.ins().imul(block, g);
                            let codes_at = b.ins().iadd(codes, codes_at);
                            let scale = addr::element(b, scale_at, block, 4);
                            e4m3::quantize_block(b, src_at, g, codes_at, scale);
                            Vec::new()
                        });
                    }
                });
                Vec::new()
            });
        })
    };
    kvjit_jit::compile_or_fetch(&key, CaptureText::default(), build)
}
