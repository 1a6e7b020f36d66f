//! FP8 E4M3 (OCP "E4M3FN"): 1 sign, 4 exponent (bias 7), 3 mantissa bits;
//! no infinities, one NaN pattern per sign (`S.1111.111`), largest finite
//! value ±448, smallest subnormal 2⁻⁹.
//!
//! The conversions an FP8 KV cache needs: [`e4m3_from_f32`] rounds to
//! nearest, ties to even, and saturates to ±448 (what CUDA's
//! `cvt.rn.satfinite.e4m3x2.f32` does: ±∞ and everything past 448 become
//! ±448, NaN stays NaN); [`e4m3_to_f32`] is exact.

/// One E4M3 code as a tensor element (the `f8e4m3` dtype): the byte as
/// stored. [`Element`](crate::Element) converts with [`e4m3_to_f32`] and
/// [`e4m3_from_f32`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
pub struct F8E4M3(pub u8);

impl F8E4M3 {
    /// The code's value (exact in f32; NaN for the NaN codes).
    pub fn to_f32(self) -> f32 {
        e4m3_to_f32(self.0)
    }

    /// `value` rounded to nearest even, saturated to ±448, NaN kept.
    pub fn from_f32(value: f32) -> Self {
        Self(e4m3_from_f32(value))
    }
}

/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The canonical NaN code (positive sign).
pub const E4M3_NAN: u8 = 0x7f;

/// `value` as E4M3: round to nearest, ties to even; saturated to ±448
/// (±∞ included); NaN → NaN (its sign kept); −0 → −0.
pub fn e4m3_from_f32(value: f32) -> u8 {
    let sign = ((value.to_bits() >> 24) & 0x80) as u8;
    if value.is_nan() {
        return sign | E4M3_NAN;
    }
    let magnitude = value.abs();
    if magnitude >= E4M3_MAX {
        return sign | 0x7e; // 448 = 1.110₂ · 2⁸
    }
    if magnitude < f32::from_bits(0x3c80_0000) {
        // Below 2⁻⁶, the smallest normal: subnormal steps of 2⁻⁹. Scaling
        // by 2⁹ is exact, and rounding to an integer in 0..=8 gives the code
        // (8 is the smallest normal, 0x08).
        return sign | (magnitude * 512.0).round_ties_even() as u8;
    }
    // Normal: round the f32 mantissa to 3 bits (ties to even) on the bits;
    // a carry moves into the exponent, which is rebiased from 127 to 7.
    let bits = magnitude.to_bits();
    let rounded = (bits + 0x7_ffff + ((bits >> 20) & 1)) >> 20;
    sign | (rounded - ((127 - 7) << 3)) as u8
}

/// The value of an E4M3 code (exact in f32).
pub fn e4m3_to_f32(code: u8) -> f32 {
    let magnitude = code & 0x7f;
    let value = if magnitude == E4M3_NAN {
        f32::NAN
    } else if magnitude < 0x08 {
        f32::from(magnitude) / 512.0
    } else {
        // Exponent e (1..=15) and mantissa m: (8 + m) · 2^(e − 10).
        let exponent = i32::from(magnitude >> 3);
        f32::from(8 + (magnitude & 7)) * 2f32.powi(exponent - 10)
    };
    if code & 0x80 != 0 { -value } else { value }
}

/// Quantize one block of values (a token's head, or a `g`-wide part of it)
/// with its own scale, as the FP8 KV cache stores it, writing one code per
/// value to `codes` (as long as `values`) and returning the scale.
///
/// - `scale = max|x| / 448` over the block's finite values: ±∞ and NaN never
///   set it, and it is 0 when no finite value is nonzero.
/// - Each code is `e4m3_from_f32(x / scale)`: rounded to nearest even and
///   saturated to ±448, so ±∞ stores ±448 (`0x7e` / `0xfe`) and reads back
///   as ± the block's finite absmax. In a block of scale 0 a finite `x`
///   codes `x · 0` (±0, not 0 / 0): a block of zeros stores zeros, and one
///   whose only nonzero values are ±∞ stores them as ±448 (reading back as
///   ±0).
/// - NaN stores NaN.
pub fn quantize_block(values: &[f32], codes: &mut [u8]) -> f32 {
    assert_eq!(values.len(), codes.len(), "one code per value");
    let max = values.iter().filter(|v| v.is_finite()).fold(0f32, |m, v| m.max(v.abs()));
    let scale = max / E4M3_MAX;
    for (code, &value) in codes.iter_mut().zip(values) {
        let scaled = if scale == 0.0 && value.is_finite() { value * 0.0 } else { value / scale };
        *code = e4m3_from_f32(scaled);
    }
    scale
}

/// The values of a block quantized by [`quantize_block`]: `code · scale`.
pub fn dequantize_block(codes: &[u8], scale: f32, values: &mut [f32]) {
    assert_eq!(values.len(), codes.len(), "one value per code");
    for (value, &code) in values.iter_mut().zip(codes) {
        *value = e4m3_to_f32(code) * scale;
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Every code's value from the OCP definition, computed another way (in
    /// f64, from the fields), with NaN as `None`.
    fn spec_value(code: u8) -> Option<f64> {
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let exponent = (code >> 3) & 0xf;
        let mantissa = f64::from(code & 7);
        match (exponent, code & 7) {
            (0xf, 7) => None,
            (0, _) => Some(sign * mantissa / 8.0 * 2f64.powi(1 - 7)),
            (e, _) => Some(sign * (1.0 + mantissa / 8.0) * 2f64.powi(i32::from(e) - 7)),
        }
    }

    /// The nearest finite code by brute force over the table: ties to the
    /// even mantissa, past ±448 saturated, NaN to NaN.
    fn nearest(value: f32) -> u8 {
        let sign = if value.is_sign_negative() { 0x80 } else { 0 };
        if value.is_nan() {
            return sign | E4M3_NAN;
        }
        let target = f64::from(value.abs());
        let mut best = 0u8;
        for code in 0..=0x7eu8 {
            let (d, best_d) = ((spec_value(code).unwrap() - target).abs(), (spec_value(best).unwrap() - target).abs());
            if d < best_d || (d == best_d && code & 1 == 0) {
                best = code;
            }
        }
        sign | best
    }

    #[test]
    fn every_code_decodes_to_its_ocp_value() {
        for code in 0..=255u8 {
            let got = e4m3_to_f32(code);
            match spec_value(code) {
                None => assert!(got.is_nan(), "{code:#04x}"),
                Some(want) => assert_eq!(f64::from(got), want, "{code:#04x}"),
            }
        }
        assert_eq!(e4m3_to_f32(0x7e), E4M3_MAX);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    }

    /// Every dequantized element lies within half an E4M3 step of its value
    /// (at its block's scale), on random blocks of mixed magnitudes; zero
    /// blocks store scale 0 and zeros; NaN stays NaN.
    #[test]
    fn blocks_dequantize_within_half_a_step_of_their_values() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for len in [1, 7, 64, 128] {
            for _ in 0..2000 {
                let magnitude = 2f32.powi(rng.gen_range(-20..20));
                let values: Vec<f32> = (0..len).map(|_| rng.gen_range(-1.0f32..1.0) * magnitude).collect();
                let mut codes = vec![0xaau8; len];
                let scale = quantize_block(&values, &mut codes);
                let mut back = vec![f32::NAN; len];
                dequantize_block(&codes, scale, &mut back);
                let max = values.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert_eq!(scale, max / E4M3_MAX);
                for (&x, &y) in values.iter().zip(&back) {
                    // Half a step at |x / scale|: 2⁻⁴ relative for normals,
                    // 2⁻¹⁰ absolute below 2⁻⁶ (plus f32 rounding).
                    let q = f64::from((x / scale).abs());
                    let half_step = if q >= 2f64.powi(-6) { q / 16.0 } else { 2f64.powi(-10) };
                    let bound = (half_step + q * 1e-6) * f64::from(scale);
                    assert!(f64::from((x - y).abs()) <= bound, "{x} came back as {y} (scale {scale})");
                }
            }
        }
        let mut codes = [0xaau8; 4];
        assert_eq!(quantize_block(&[0.0, -0.0, 0.0, 0.0], &mut codes), 0.0);
        assert_eq!(codes, [0x00, 0x80, 0x00, 0x00]);
        let scale = quantize_block(&[1.0, f32::NAN, -2.0, 0.5], &mut codes);
        assert_eq!(scale, 2.0 / E4M3_MAX);
        assert!(e4m3_to_f32(codes[1]).is_nan());
        assert_eq!(e4m3_to_f32(codes[2]), -E4M3_MAX, "the block's largest magnitude maps to ±448");
    }

    /// ±∞ saturates to the code ±448 without touching the scale, which
    /// comes from the block's finite values (hand-computed codes: 224 is
    /// 0x76, 112 is 0x6e, 448 is 0x7e, sign 0x80); a block whose only
    /// nonzero values are ±∞ has scale 0; NaN stays NaN beside ±∞.
    #[test]
    fn infinities_saturate_and_the_scale_comes_from_the_finite_values() {
        let mut codes = [0xaau8; 4];
        let scale = quantize_block(&[1.0, f32::INFINITY, -2.0, 0.5], &mut codes);
        assert_eq!(scale, 2.0 / E4M3_MAX, "the finite absmax over 448");
        assert_eq!(codes, [0x76, 0x7e, 0xfe, 0x6e]);

        let scale = quantize_block(&[f32::NAN, f32::NEG_INFINITY, 3.0, 0.0], &mut codes);
        assert_eq!(scale, 3.0 / E4M3_MAX);
        assert_eq!(codes[1..], [0xfe, 0x7e, 0x00]);
        assert_eq!(codes[0] & 0x7f, E4M3_NAN, "NaN stays NaN");

        // Only ±∞ and zeros: scale 0, ±∞ still ±448 (reading back as ±0).
        let scale = quantize_block(&[f32::INFINITY, 0.0, f32::NEG_INFINITY, -0.0], &mut codes);
        assert_eq!(scale.to_bits(), 0);
        assert_eq!(codes, [0x7e, 0x00, 0xfe, 0x80]);
        let mut back = [f32::NAN; 4];
        dequantize_block(&codes, scale, &mut back);
        assert_eq!(back.map(f32::to_bits), [0.0f32, 0.0, -0.0, -0.0].map(f32::to_bits));

        let mut pair = [0xaau8; 2];
        assert_eq!(quantize_block(&[f32::NEG_INFINITY, f32::NAN], &mut pair).to_bits(), 0);
        assert_eq!(pair[0], 0xfe);
        assert_eq!(pair[1] & 0x7f, E4M3_NAN);

        // The largest finite f32 beside ∞: both saturate, the scale is finite.
        let scale = quantize_block(&[f32::MAX, f32::INFINITY], &mut pair);
        assert_eq!(scale, f32::MAX / E4M3_MAX);
        assert_eq!(pair, [0x7e, 0x7e]);
    }

    #[test]
    fn every_finite_code_round_trips() {
        for code in 0..=255u8 {
            if code & 0x7f != E4M3_NAN {
                assert_eq!(e4m3_from_f32(e4m3_to_f32(code)), code, "{code:#04x}");
            }
        }
    }

    /// A million values against the brute-force nearest code: uniform at
    /// every scale, f32 subnormals, exact midpoints between neighbouring
    /// codes (ties), values just either side of them, values past 448, ±∞
    /// and NaN.
    #[test]
    fn a_million_values_round_to_the_nearest_even_code() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        let finite: Vec<f32> = (0..=0x7eu8).map(e4m3_to_f32).collect();
        let check = |value: f32| {
            let (got, want) = (e4m3_from_f32(value), nearest(value));
            assert_eq!(got, want, "{value:e} ({:#010x}): got {got:#04x}, want {want:#04x}", value.to_bits());
        };
        for special in [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, 448.0, 464.0, 480.0, 1e30] {
            check(special);
        }
        for pair in finite.windows(2) {
            let mid = (pair[0] + pair[1]) / 2.0; // exact in f32
            for value in [mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)] {
                check(value);
                check(-value);
            }
        }
        for _ in 0..1_000_000 {
            let value = match rng.gen_range(0..4) {
                0 => rng.gen_range(-500.0f32..500.0),
                1 => rng.gen_range(-1.0f32..1.0) * 2f32.powi(rng.gen_range(-12..10)),
                2 => f32::from_bits(rng.gen_range(0..0x0080_0000) | (rng.gen_range(0..2u32) << 31)), // f32 subnormals
                _ => f32::from_bits(rng.r#gen::<u32>()),                                             // any pattern
            };
            check(value);
        }
    }
}
