//! The reference implementation: plain Rust that follows the contract line
//! by line, in f64 — the ground truth every fast path is tested against.
//!
//! For each valid query `(b, s)` (`s < valid_lengths[b]`) and query head
//! `h`, with `cl = cache_lengths[b]` and KV head `h / (Hq / Hkv)`: the keys
//! and values are the cache entries of sequence b, layer `layer_idx`, at
//! positions `lo ≤ p < hi` where `hi = cl + s + 1` under `causal`, else
//! `cl + valid_lengths[b]`, and `lo = cl + s + 1 − window` with a window
//! (else 0). `out = softmax(scale · q·Kᵀ) · V`, rounded once to the dtype;
//! padded query rows are zero.

use kvjit_core::{PagedKVCacheCollection, Result, Storable, Tensor, TensorData, bf16, f16};

use kvjit_op::checks::StepArgs;

use crate::call::{AttentionConfig, CallShape, check_call, check_output};

/// The exact (f64) result of a call, `[B, S, Hq, D]` row-major, after the
/// full validation of [`check_call`].
pub fn mha_f64(
    q: &Tensor,
    kv_collection: &PagedKVCacheCollection,
    layer_idx: &Tensor,
    valid_lengths: &Tensor,
    config: &AttentionConfig,
) -> Result<(CallShape, Vec<f64>)> {
    let shape = check_call(q, StepArgs { kv_collection, layer_idx, valid_lengths }, config)?;
    let q = q.to_f32_vec()?;
    let valid = valid_lengths.as_slice::<u32>()?;
    let (hq, d) = (shape.num_heads, shape.head_size);
    let group = shape.group();
    let scale = f64::from(config.scale);
    let mut out = vec![0f64; q.len()];
    for (b, &v) in valid.iter().enumerate() {
        let cl = kv_collection.cache_lengths()[b] as usize;
        let v = v as usize;
        let (lo_all, hi_all) = shape.key_ranges[b];
        // K and V rows of every position the sequence reads, widened.
        let rows: Vec<(Vec<f32>, Vec<f32>)> = (lo_all..hi_all)
            .map(|p| {
                let (page, slot) = kv_collection.locate(b, p)?;
                Ok((
                    kv_collection.read_slot(page as usize, 0, shape.layer, slot)?,
                    kv_collection.read_slot(page as usize, 1, shape.layer, slot)?,
                ))
            })
            .collect::<Result<_>>()?;
        for s in 0..v {
            let (lo, hi) = config.key_range(cl, v, s);
            for h in 0..hq {
                let kvh = h / group;
                let at = ((b * shape.seq + s) * hq + h) * d;
                let qrow = &q[at..at + d];
                let scores: Vec<f64> = (lo..hi)
                    .map(|p| {
                        let k = &rows[p - lo_all].0[kvh * d..][..d];
                        scale * qrow.iter().zip(k).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum::<f64>()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|&x| (x - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for (p, w) in (lo..hi).zip(&weights) {
                    let vrow = &rows[p - lo_all].1[kvh * d..][..d];
                    for (o, &x) in out[at..at + d].iter_mut().zip(vrow) {
                        *o += w / total * f64::from(x);
                    }
                }
            }
        }
    }
    Ok((shape, out))
}

/// Run the op: validate everything (writing nothing on error), then write
/// `output` (`[B, S, Hq, D]`, q's dtype) rounded once from the f64 result.
pub fn mha(
    q: &Tensor,
    kv_collection: &PagedKVCacheCollection,
    layer_idx: &Tensor,
    valid_lengths: &Tensor,
    config: &AttentionConfig,
    output: &mut Tensor,
) -> Result<CallShape> {
    let shape = check_call(q, StepArgs { kv_collection, layer_idx, valid_lengths }, config)?;
    check_output(&shape, q.dtype(), output)?;
    let (shape, exact) = mha_f64(q, kv_collection, layer_idx, valid_lengths, config)?;
    fn store<T: Storable>(dst: &mut [T], exact: &[f64], round: fn(f64) -> T) {
        for (d, &x) in dst.iter_mut().zip(exact) {
            *d = round(x);
        }
    }
    match output.data() {
        TensorData::F32(_) => store::<f32>(output.as_mut_slice()?, &exact, |x| x as f32),
        TensorData::BF16(_) => store::<bf16>(output.as_mut_slice()?, &exact, bf16::from_f64),
        TensorData::F16(_) => store::<f16>(output.as_mut_slice()?, &exact, f16::from_f64),
        TensorData::U32(_) | TensorData::F8E4M3(_) | TensorData::Blocks(..) => {
            unreachable!("check_output accepts only q's float dtype")
        }
    }
    Ok(shape)
}
