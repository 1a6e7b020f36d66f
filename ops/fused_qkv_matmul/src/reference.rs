//! The reference implementation: plain, obviously correct Rust that follows
//! the contract line by line. Every fast path is tested against it; it is
//! also the CPU kernel until the JIT lands.
//!
//! For each row `r = b·S + t` and column `n` of `C = X·Wᵀ`, accumulated in
//! f32 in order of k:
//! - `n < q_dim`: `output[b, t, n] = C[r, n]`, for every t;
//! - otherwise, only if `t < valid_lengths[b]`: the K (then V) column
//!   `j = n − q_dim − kv·kv_dim` is stored at head `j / D`, lane `j % D` of
//!   slot `pos % page_size` of page `lookup_table[b, pos / page_size]`,
//!   `pos = cache_lengths[b] + t`, layer `layer_idx`. An FP8 cache stores
//!   each g-block of a head's values with its own scale
//!   ([`kvjit_core::fp8::quantize_block`]).

use kvjit_core::{
    DType, Element, PagedKVCacheCollection, Result, Tensor, TensorData, bf16, expect_arg, f16, shape_mismatch,
};

use crate::CallShape;
use kvjit_op::checks::StepArgs;

use crate::call::check_call;

/// Run the op: validate everything (writing nothing on error), then write
/// `output` and the K/V of valid tokens into `kv_collection`.
pub fn fused_qkv_matmul(
    hidden_state: &Tensor,
    weight: &Tensor,
    kv_collection: &mut PagedKVCacheCollection,
    layer_idx: &Tensor,
    valid_lengths: &Tensor,
    output: &mut Tensor,
) -> Result<CallShape> {
    let shape = check_call(hidden_state, weight, StepArgs { kv_collection, layer_idx, valid_lengths })?.shape;
    expect_arg("output", output, hidden_state.dtype())?;
    if output.shape() != shape.output_shape() {
        return Err(shape_mismatch("output", format!("{:?} ([B, S, q_dim])", shape.output_shape()), output));
    }
    write(&shape, hidden_state, weight, kv_collection, valid_lengths, output)?;
    Ok(shape)
}

/// Write a checked call (`shape` from the op's check of exactly these
/// arguments, `output` of its shape): Q into `output`, the valid tokens'
/// K and V into the cache.
pub(crate) fn write(
    shape: &CallShape,
    hidden_state: &Tensor,
    weight: &Tensor,
    kv_collection: &mut PagedKVCacheCollection,
    valid_lengths: &Tensor,
    output: &mut Tensor,
) -> Result<()> {
    let valid = valid_lengths.as_slice::<u32>()?;
    // Block weights are read as their dequantized f32 values.
    let dequantized = match weight.data() {
        TensorData::Blocks(..) => Some(weight.to_f32_vec()?),
        _ => None,
    };
    macro_rules! with_weight {
        ($x:expr, $t:ty) => {
            match &dequantized {
                Some(w) => run::<$t, f32>(shape, $x, w, kv_collection, valid, output.as_mut_slice()?),
                None => run::<$t, $t>(shape, $x, weight.as_slice()?, kv_collection, valid, output.as_mut_slice()?),
            }
        };
    }
    match hidden_state.data() {
        TensorData::F32(x) => with_weight!(x, f32),
        TensorData::BF16(x) => with_weight!(x, bf16),
        TensorData::F16(x) => with_weight!(x, f16),
        _ => unreachable!("the check accepts only float activations"),
    }
    Ok(())
}

fn run<T: Element, W: Element>(
    shape: &CallShape,
    x: &[T],
    w: &[W],
    cache: &mut PagedKVCacheCollection,
    valid: &[u32],
    output: &mut [T],
) {
    match cache.blocks().dtype() {
        DType::F32 => run_typed::<T, W>(shape, x, w, cache, valid, output, store_plain::<f32>),
        DType::BF16 => run_typed::<T, W>(shape, x, w, cache, valid, output, store_plain::<bf16>),
        DType::F16 => run_typed::<T, W>(shape, x, w, cache, valid, output, store_plain::<f16>),
        DType::F8E4M3 => run_typed::<T, W>(shape, x, w, cache, valid, output, store_quantized),
        _ => unreachable!("caches hold floats"),
    }
}

/// Where a token's K/V go: page, slot and layer.
#[derive(Clone, Copy)]
struct Slot {
    page: usize,
    slot: usize,
    layer: usize,
}

/// Store a token's K then V (`kv_values`, 2·Hkv·D values) rounded to the
/// cache dtype `C`.
fn store_plain<C: Element>(cache: &mut PagedKVCacheCollection, at: Slot, kv_values: &[f32]) {
    let p = *cache.params();
    for (j, &value) in kv_values.iter().enumerate() {
        let (kv, head, d) = (j / p.kv_dim(), (j % p.kv_dim()) / p.head_size, j % p.head_size);
        let offset = cache.element_offset(at.page, kv, at.layer, at.slot, head, d);
        cache.blocks_slice_mut::<C>().expect("cache dtype matched above")[offset] = C::from_f32(value);
    }
}

/// Store a token's K then V into an FP8 cache: each g-block of a head
/// quantized with its own scale ([`kvjit_core::fp8::quantize_block`]).
fn store_quantized(cache: &mut PagedKVCacheCollection, at: Slot, kv_values: &[f32]) {
    let p = *cache.params();
    let g = p.scale_granularity().expect("an f8e4m3 cache has a granularity");
    let mut codes = vec![0u8; g];
    for (block, values) in kv_values.chunks_exact(g).enumerate() {
        let j = block * g;
        let (kv, head, d) = (j / p.kv_dim(), (j % p.kv_dim()) / p.head_size, j % p.head_size);
        let scale = kvjit_core::fp8::quantize_block(values, &mut codes);
        let offset = cache.element_offset(at.page, kv, at.layer, at.slot, head, d);
        let scale_offset = cache.scale_offset(at.page, kv, at.layer, at.slot, head, d / g);
        let (blocks, scales) = cache.blocks_and_scales_mut();
        blocks[offset..offset + g].copy_from_slice(&codes);
        scales.expect("an f8e4m3 cache has scales")[scale_offset] = scale;
    }
}

fn run_typed<T: Element, W: Element>(
    shape: &CallShape,
    x: &[T],
    w: &[W],
    cache: &mut PagedKVCacheCollection,
    valid: &[u32],
    output: &mut [T],
    store: fn(&mut PagedKVCacheCollection, Slot, &[f32]),
) {
    let CallShape { batch, seq, k, n, q_dim, layer, .. } = *shape;
    let mut row = vec![0f32; k];
    let mut c = vec![0f32; n];
    for (b, &valid_length) in valid.iter().enumerate().take(batch) {
        for t in 0..seq {
            let r = b * seq + t;
            for (dst, src) in row.iter_mut().zip(&x[r * k..(r + 1) * k]) {
                *dst = src.to_f32();
            }
            for (col, out) in c.iter_mut().enumerate() {
                let w_row = &w[col * k..(col + 1) * k];
                *out = row.iter().zip(w_row).fold(0f32, |acc, (&xv, wv)| acc + xv * wv.to_f32());
            }
            for (col, &value) in c[..q_dim].iter().enumerate() {
                output[r * q_dim + col] = T::from_f32(value);
            }
            if t >= valid_length as usize {
                continue;
            }
            let position = cache.cache_lengths()[b] as usize + t;
            let (page, slot) = cache.locate(b, position).expect("check_call validated every valid token's page");
            store(cache, Slot { page: page as usize, slot, layer }, &c[q_dim..]);
        }
    }
}
