//! How a reference kernel stores what it computed: results in f64, each
//! rounded exactly once to the output's dtype ([`store_f64`]).

use kvjit_core::{DType, Error, Result, Tensor, bf16, f16};

/// Write `values` (f64, one per element, row-major) into `output`, each
/// rounded once to its dtype (f32, bf16 or f16): to nearest, ties to even,
/// overflowing to ±∞, NaN staying NaN. (`half`'s `from_f64` drops the low
/// 32 bits of the f64 before rounding, so it can miss a value just past a
/// tie; this does not.)
///
/// # Errors
///
/// [`Error::ElementCount`] when `values` does not hold one value per
/// element, [`Error::NotFloat`] for a u32 or FP8 `output` (nothing is
/// written then).
pub fn store_f64(output: &mut Tensor, values: &[f64]) -> Result<()> {
    if values.len() != output.numel() {
        return Err(Error::ElementCount {
            shape: output.shape().to_vec(),
            expected: output.numel(),
            got: values.len(),
        });
    }
    match output.dtype() {
        DType::F32 => output.as_mut_slice::<f32>()?.iter_mut().zip(values).for_each(|(o, &v)| *o = v as f32),
        DType::BF16 => {
            output.as_mut_slice::<bf16>()?.iter_mut().zip(values).for_each(|(o, &v)| *o = round_bf16(v));
        }
        DType::F16 => {
            output.as_mut_slice::<f16>()?.iter_mut().zip(values).for_each(|(o, &v)| *o = round_f16(v));
        }
        dtype => {
            return Err(Error::NotFloat { what: "storing f64 results rounded once (f32, bf16, f16)".into(), dtype });
        }
    }
    Ok(())
}

/// `value` rounded once to bf16: to nearest, ties to even, overflowing to
/// ±∞, NaN staying NaN (see [`store_f64`] for why not `bf16::from_f64`).
pub fn round_bf16(value: f64) -> bf16 {
    bf16::from_bits(round_16(value, bf16::from_f64(value).to_bits(), 0x7f7f, |b| bf16::from_bits(b).to_f64()))
}

/// `value` rounded once to f16, as [`round_bf16`].
pub fn round_f16(value: f64) -> f16 {
    f16::from_bits(round_16(value, f16::from_f64(value).to_bits(), 0x7bff, |b| f16::from_bits(b).to_f64()))
}

/// `value` rounded to nearest, ties to even, in a 16-bit float format
/// (`widen` its bits' value, `max_bits` its largest finite value), given
/// `approx`, the format's value within one step of it.
fn round_16(value: f64, approx: u16, max_bits: u16, widen: impl Fn(u16) -> f64) -> u16 {
    if !value.is_finite() {
        return approx;
    }
    let sign = if value.is_sign_negative() { 0x8000 } else { 0 };
    let max = widen(max_bits);
    if value.abs() >= max + (max - widen(max_bits - 1)) / 2.0 {
        return sign | (max_bits + 1); // infinity
    }
    let mut best = approx;
    let mut best_err = f64::INFINITY;
    for c in [approx.wrapping_sub(1), approx, approx.wrapping_add(1)] {
        let v = widen(c);
        if c & 0x8000 != approx & 0x8000 || !v.is_finite() {
            continue;
        }
        let err = (v - value).abs();
        if err < best_err || (err == best_err && c & 1 == 0) {
            (best, best_err) = (c, err);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(dtype: DType, values: &[f64]) -> Vec<f32> {
        let mut t = Tensor::zeros(dtype, &[values.len()]).unwrap();
        store_f64(&mut t, values).unwrap();
        t.to_f32_vec().unwrap()
    }

    #[test]
    fn rounds_once_even_just_past_a_tie() {
        let past = |ulp: f64| 1.0 + ulp / 2.0 + 2f64.powi(-40);
        assert_eq!(stored(DType::BF16, &[past(2f64.powi(-7))]), [1.0 + 2f32.powi(-7)]);
        assert_eq!(stored(DType::F16, &[past(2f64.powi(-10))]), [1.0 + 2f32.powi(-10)]);
        let tie = 1.0 + 2f64.powi(-8);
        assert_eq!(stored(DType::BF16, &[tie, -tie]), [1.0, -1.0]);
        let f32_past = 1.0 + 2f64.powi(-24) + 2f64.powi(-50);
        assert_eq!(stored(DType::F32, &[f32_past]), [1.0 + f32::EPSILON]);
    }

    #[test]
    fn overflow_infinities_and_nan() {
        let got = stored(DType::F16, &[70000.0, -70000.0, f64::NEG_INFINITY, f64::NAN, -0.0]);
        assert_eq!(got[..3], [f32::INFINITY, f32::NEG_INFINITY, f32::NEG_INFINITY]);
        assert!(got[3].is_nan());
        assert_eq!(got[4].to_bits(), (-0f32).to_bits());
    }

    #[test]
    fn refuses_a_wrong_count_or_dtype_writing_nothing() {
        let mut t = Tensor::from_f32(DType::BF16, &[2], &[5.0, 6.0]).unwrap();
        assert!(matches!(store_f64(&mut t, &[1.0]), Err(Error::ElementCount { expected: 2, got: 1, .. })));
        assert_eq!(t.to_f32_vec().unwrap(), [5.0, 6.0]);
        let mut ids = Tensor::from_vec(&[1], vec![7u32]).unwrap();
        assert!(matches!(store_f64(&mut ids, &[1.0]), Err(Error::NotFloat { dtype: DType::U32, .. })));
    }
}
