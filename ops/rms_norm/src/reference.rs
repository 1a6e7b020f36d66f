//! The reference: [`rms_norm_row`] of every row in f64, rounded once to
//! the dtype ([`kvjit_op::store_f64`]). The JIT is tested against it.

/// One row: `x · 1/sqrt(mean(x²) + epsilon) · (weight + weight_offset)`,
/// all in f64 (no f32 input overflows or underflows `x²` there). A row
/// holding ±∞ gives ±0 where `x` is finite and NaN where it is infinite;
/// NaN anywhere gives NaN everywhere; an all-zero row with `epsilon = 0`
/// gives NaN (0 · ∞).
pub fn rms_norm_row(x: &[f32], weight: &[f64], epsilon: f32, weight_offset: f32) -> impl Iterator<Item = f64> {
    let squares: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let inverse = 1.0 / (squares / x.len() as f64 + f64::from(epsilon)).sqrt();
    let offset = f64::from(weight_offset);
    x.iter().zip(weight).map(move |(&v, &w)| f64::from(v) * inverse * (w + offset))
}

/// The reference kernel of a spec.
pub type ReferenceKernel = kvjit_op::Reference<crate::RmsNormSpec>;
