//! The reference implementation: plain, obviously correct Rust that follows
//! the contract line by line, computing in f64 and rounding once to the
//! stored dtype. Every fast path is tested against it.
//!
//! For each row `r = b·S + s`:
//! - `s ≥ valid_lengths[b]` (padded): `output[b, s, :, :] = 0` (MAX leaves
//!   these rows undefined; kvjit defines them as zero) and the cache is not
//!   touched;
//! - otherwise, with `pos = cache_lengths[b] + s`, `c_j = freqs_cis[pos, 2j]`,
//!   `s_j = freqs_cis[pos, 2j + 1]` (j < D/2), and the pair `(a, b)` being
//!   `(x[2j], x[2j+1])` when `interleaved`, `(x[j], x[j + D/2])` otherwise:
//!   `a' = a·c_j − b·s_j`, `b' = b·c_j + a·s_j`, for every head of Q
//!   (written to `output`) and every KV head of K at layer `layer_idx`,
//!   page `lookup_table[b, pos / page_size]`, slot `pos % page_size`
//!   (rewritten in place, in the cache dtype). V is never touched.
//!
//! An FP8 (`f8e4m3`) cache stores a K head as D codes and D/g scales:
//! the head is dequantized whole (`code · scale`, in f32, as the cache reads
//! it back; the rotation mixes elements of different g-blocks), rotated in
//! f64, rounded once to f32, and every g-block requantized with a fresh
//! scale by [`fp8::quantize_block`] (`scale = max|y| / 448` over the finite
//! values, codes rounded to nearest even and saturated, ±∞ to ±448):
//! exactly the K heads' codes and scales of the rotated
//! tokens change.

use kvjit_core::{DType, Element, F8E4M3, PagedKVCacheCollection, Result, Tensor, TensorData, bf16, f16, fp8};

use crate::CallShape;
use kvjit_op::checks::StepArgs;

use crate::call::{check_call, check_output};

/// An element type the reference rounds f64 results to, once.
trait Stored: Element {
    fn to_f64(self) -> f64;
    fn from_f64(value: f64) -> Self;
}

impl Stored for f32 {
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn from_f64(value: f64) -> Self {
        value as f32
    }
}

impl Stored for bf16 {
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn from_f64(value: f64) -> Self {
        kvjit_op::round_bf16(value)
    }
}

impl Stored for f16 {
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn from_f64(value: f64) -> Self {
        kvjit_op::round_f16(value)
    }
}

/// The pairs `(a, b)` of a head of size `d`, as element indices.
pub fn pair_indices(d: usize, interleaved: bool) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..d / 2).map(move |j| if interleaved { (j, 2 * j, 2 * j + 1) } else { (j, j, j + d / 2) })
}

/// Rotate one head `x` (f64) by the cos/sin row `freqs` (`[c0, s0, c1, s1, …]`).
fn rotate(x: &[f64], freqs: &[f64], interleaved: bool, out: &mut [f64]) {
    for (j, a, b) in pair_indices(x.len(), interleaved) {
        let (c, s) = (freqs[2 * j], freqs[2 * j + 1]);
        out[a] = x[a] * c - x[b] * s;
        out[b] = x[b] * c + x[a] * s;
    }
}

/// Run the op: validate everything (writing nothing on error), then write
/// `output` (rotated Q, zero rows for padded tokens) and rotate the K of
/// every valid token in `kv_collection` in place.
pub fn fused_qk_rope(
    q_proj: &Tensor,
    kv_collection: &mut PagedKVCacheCollection,
    freqs_cis: &Tensor,
    layer_idx: &Tensor,
    valid_lengths: &Tensor,
    interleaved: bool,
    output: &mut Tensor,
) -> Result<CallShape> {
    let dtype = kvjit_op::expect_float_step("q_proj", q_proj, layer_idx, valid_lengths)?;
    kvjit_core::expect_arg("freqs_cis", freqs_cis, dtype)?;
    kvjit_core::expect_arg("output", output, dtype)?;
    let shape = check_call(q_proj, freqs_cis, StepArgs { kv_collection, layer_idx, valid_lengths })?;
    check_output(&shape, output)?;
    let valid = valid_lengths.as_slice::<u32>()?;
    let cache_dtype = kv_collection.params().dtype();
    macro_rules! dispatch {
        ($q:expr, $f:expr, $t:ty) => {{
            let output = output.as_mut_slice()?;
            match cache_dtype {
                DType::F32 => run::<$t, f32>(&shape, $q, $f, kv_collection, valid, interleaved, output),
                DType::BF16 => run::<$t, bf16>(&shape, $q, $f, kv_collection, valid, interleaved, output),
                DType::F16 => run::<$t, f16>(&shape, $q, $f, kv_collection, valid, interleaved, output),
                DType::F8E4M3 => run::<$t, F8E4M3>(&shape, $q, $f, kv_collection, valid, interleaved, output),
                _ => unreachable!("caches hold float elements"),
            }
        }};
    }
    match (q_proj.data(), freqs_cis.data()) {
        (TensorData::F32(q), TensorData::F32(f)) => dispatch!(q, f, f32),
        (TensorData::BF16(q), TensorData::BF16(f)) => dispatch!(q, f, bf16),
        (TensorData::F16(q), TensorData::F16(f)) => dispatch!(q, f, f16),
        _ => unreachable!("check_call accepts only matching float dtypes"),
    }
    Ok(shape)
}

/// Where one K head lives in the cache: `[page, 0, layer, slot, head, :]`.
#[derive(Clone, Copy)]
struct KHead {
    page: usize,
    layer: usize,
    slot: usize,
    head: usize,
}

/// A cache element type: how the reference rotates one K head stored in it.
trait CacheElement {
    /// Rotate `[page, 0, layer, slot, head, :]` in place by the cos/sin row
    /// `freqs` (f64).
    fn rotate_k(cache: &mut PagedKVCacheCollection, k: KHead, freqs: &[f64], interleaved: bool);
}

fn run<T: Stored, C: CacheElement>(
    shape: &CallShape,
    q: &[T],
    freqs_cis: &[T],
    cache: &mut PagedKVCacheCollection,
    valid: &[u32],
    interleaved: bool,
    output: &mut [T],
) {
    let CallShape { batch, seq, num_q_heads, num_kv_heads, head_size: d, layer, .. } = *shape;
    let row_len = num_q_heads * d;
    let (mut x, mut rotated) = (vec![0f64; d], vec![0f64; d]);
    for (b, &valid_length) in valid.iter().enumerate().take(batch) {
        for s in 0..seq {
            let r = b * seq + s;
            let out_row = &mut output[r * row_len..(r + 1) * row_len];
            if s >= valid_length as usize {
                out_row.fill(T::from_f64(0.0));
                continue;
            }
            let pos = cache.cache_lengths()[b] as usize + s;
            let freqs: Vec<f64> = freqs_cis[pos * d..(pos + 1) * d].iter().map(|v| v.to_f64()).collect();
            for h in 0..num_q_heads {
                let head = &q[r * row_len + h * d..][..d];
                x.iter_mut().zip(head).for_each(|(x, v)| *x = v.to_f64());
                rotate(&x, &freqs, interleaved, &mut rotated);
                for (o, &v) in out_row[h * d..(h + 1) * d].iter_mut().zip(&rotated) {
                    *o = T::from_f64(v);
                }
            }
            let (page, slot) = cache.locate(b, pos).expect("check_call validated every valid token's page");
            for head in 0..num_kv_heads {
                C::rotate_k(cache, KHead { page: page as usize, layer, slot, head }, &freqs, interleaved);
            }
        }
    }
}

/// f32, bf16, f16: read, rotate in f64, round once to the cache dtype.
impl<C: Stored> CacheElement for C {
    fn rotate_k(cache: &mut PagedKVCacheCollection, k: KHead, freqs: &[f64], interleaved: bool) {
        let d = cache.params().head_size;
        let offset = cache.element_offset(k.page, 0, k.layer, k.slot, k.head, 0);
        let blocks = cache.blocks_slice_mut::<C>().expect("the dispatch matched C to the cache dtype");
        let head = &mut blocks[offset..offset + d];
        let x: Vec<f64> = head.iter().map(|v| v.to_f64()).collect();
        let mut rotated = vec![0f64; d];
        rotate(&x, freqs, interleaved, &mut rotated);
        for (k, &v) in head.iter_mut().zip(&rotated) {
            *k = C::from_f64(v);
        }
    }
}

/// FP8: dequantize all D values (`code · scale`, in f32), rotate in f64,
/// round to f32, and requantize each g-block with a fresh scale
/// ([`fp8::quantize_block`]), writing codes and scales.
impl CacheElement for F8E4M3 {
    fn rotate_k(cache: &mut PagedKVCacheCollection, k: KHead, freqs: &[f64], interleaved: bool) {
        let params = *cache.params();
        let d = params.head_size;
        let g = params.scale_granularity().expect("an f8e4m3 cache has a granularity (checked when built)");
        let offset = cache.element_offset(k.page, 0, k.layer, k.slot, k.head, 0);
        let scale_at = cache.scale_offset(k.page, 0, k.layer, k.slot, k.head, 0);
        let (blocks, scales) = cache.blocks_and_scales_mut();
        let codes = &mut blocks[offset..offset + d];
        let scales = &mut scales.expect("an f8e4m3 cache has scales (checked when built)")[scale_at..][..d / g];
        let mut values = vec![0f32; d];
        for ((values, codes), &scale) in values.chunks_exact_mut(g).zip(codes.chunks_exact(g)).zip(scales.iter()) {
            fp8::dequantize_block(codes, scale, values);
        }
        let x: Vec<f64> = values.iter().map(|&v| f64::from(v)).collect();
        let mut rotated = vec![0f64; d];
        rotate(&x, freqs, interleaved, &mut rotated);
        values.iter_mut().zip(&rotated).for_each(|(v, &r)| *v = r as f32);
        for ((values, codes), scale) in values.chunks_exact(g).zip(codes.chunks_exact_mut(g)).zip(scales.iter_mut()) {
            *scale = fp8::quantize_block(values, codes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Around every midpoint between adjacent finite values (and past the
    /// largest), the reference's rounding picks the nearest, ties to even.
    fn rounds_exactly<T: Stored>(bits: impl Fn(T) -> u16, from_bits: impl Fn(u16) -> T, max_bits: u16) {
        for lo in 0..max_bits {
            let (a, b) = (from_bits(lo).to_f64(), from_bits(lo + 1).to_f64());
            let mid = a + (b - a) / 2.0;
            let nudge = (b - a) * 1e-9;
            assert_eq!(bits(T::from_f64(mid - nudge)), lo, "below the midpoint of {lo:#x}");
            assert_eq!(bits(T::from_f64(mid + nudge)), lo + 1, "above the midpoint of {lo:#x}");
            assert_eq!(bits(T::from_f64(mid)), if lo.is_multiple_of(2) { lo } else { lo + 1 }, "tie at {lo:#x}");
            assert_eq!(bits(T::from_f64(-(mid + nudge))), 0x8000 | (lo + 1), "negative, {lo:#x}");
        }
        let max = from_bits(max_bits).to_f64();
        let half_step = (max - from_bits(max_bits - 1).to_f64()) / 2.0;
        assert_eq!(bits(T::from_f64(max + half_step * 0.99)), max_bits);
        assert_eq!(bits(T::from_f64(max + half_step)), max_bits + 1, "ties past the max round to infinity");
        assert!(T::from_f64(f64::NAN).to_f64().is_nan());
    }

    #[test]
    fn bf16_and_f16_round_once_to_nearest_even() {
        rounds_exactly::<bf16>(bf16::to_bits, bf16::from_bits, 0x7f7f);
        rounds_exactly::<f16>(f16::to_bits, f16::from_bits, 0x7bff);
        // What half's own from_f64 gets wrong (it drops the low 32 bits).
        let v = -0.5878909230232239;
        assert_eq!(<bf16 as Stored>::from_f64(v).to_f64(), -0.58984375);
    }

    #[test]
    fn both_layouts_pair_the_contracts_elements() {
        assert_eq!(pair_indices(8, true).collect::<Vec<_>>(), [(0, 0, 1), (1, 2, 3), (2, 4, 5), (3, 6, 7)]);
        assert_eq!(pair_indices(8, false).collect::<Vec<_>>(), [(0, 0, 4), (1, 1, 5), (2, 2, 6), (3, 3, 7)]);
    }
}
