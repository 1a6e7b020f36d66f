//! Random tensor values, drawn the one way every test draws them (so a seed
//! gives the same tensors wherever it is used).

use half::{bf16, f16};
use kvjit_core::{DType, Tensor};
use rand::Rng;

/// A `[len]` u32 tensor (valid lengths and friends).
pub fn u32s(values: &[u32]) -> Tensor {
    Tensor::from_vec(&[values.len()], values.to_vec()).expect("a u32 tensor")
}

/// Uniform in [-1, 1), rounded to `dtype` ([`Tensor::random`]).
///
/// # Panics
///
/// For a u32 `dtype`.
pub fn uniform(rng: &mut impl Rng, dtype: DType, shape: &[usize]) -> Tensor {
    uniform_in(rng, dtype, shape, -1.0, 1.0)
}

/// Uniform in [`low`, `high`), rounded to `dtype` ([`Tensor::random`]).
///
/// # Panics
///
/// For a u32 `dtype`.
pub fn uniform_in(rng: &mut impl Rng, dtype: DType, shape: &[usize], low: f32, high: f32) -> Tensor {
    Tensor::random(dtype, shape, rng, low, high).expect("a float tensor")
}

/// Uniform in [-1, 1), never closer to zero than `min_abs` (redrawn until
/// it is), rounded to `dtype`.
///
/// # Panics
///
/// For a u32 `dtype`.
pub fn uniform_nonzero(rng: &mut impl Rng, dtype: DType, shape: &[usize], min_abs: f32) -> Tensor {
    let numel = shape.iter().product();
    let values: Vec<f32> = (0..numel)
        .map(|_| {
            loop {
                let v: f32 = rng.gen_range(-1.0..1.0);
                if v.abs() >= min_abs {
                    break v;
                }
            }
        })
        .collect();
    Tensor::from_f32(dtype, shape, &values).expect("a float tensor")
}

/// Magnitudes uniform in [`min_abs`, `max_abs`) with a random sign, rounded
/// to `dtype` (never zero, which would hide an unwritten output).
///
/// # Panics
///
/// For a u32 `dtype`, or an empty range.
pub fn signed_magnitudes(rng: &mut impl Rng, dtype: DType, shape: &[usize], min_abs: f32, max_abs: f32) -> Tensor {
    let values: Vec<f32> = (0..shape.iter().product())
        .map(|_| {
            let magnitude = rng.gen_range(min_abs..max_abs);
            if rng.r#gen::<bool>() { magnitude } else { -magnitude }
        })
        .collect();
    Tensor::from_f32(dtype, shape, &values).expect("a float tensor")
}

/// Multiples of `1/denominator` in [-1, 1] (uniform over the
/// `2·denominator + 1` of them). For power-of-two denominators these are
/// exact in every float dtype, and the products and sums of a matmul of
/// modest size are exact in f32: any summation order gives the same bits.
///
/// # Panics
///
/// For a u32 `dtype` or a `denominator` below 1.
pub fn dyadic(rng: &mut impl Rng, dtype: DType, shape: &[usize], denominator: i32) -> Tensor {
    dyadic_scaled(rng, dtype, shape, denominator, 1.0)
}

/// [`dyadic`] values times `scale` (a power of two keeps them exact; small
/// scales reach f16's subnormals).
///
/// # Panics
///
/// For a u32 `dtype` or a `denominator` below 1.
pub fn dyadic_scaled(rng: &mut impl Rng, dtype: DType, shape: &[usize], denominator: i32, scale: f32) -> Tensor {
    assert!(denominator >= 1, "dyadic: denominator {denominator}");
    let numel = shape.iter().product();
    let values: Vec<f32> =
        (0..numel).map(|_| rng.gen_range(-denominator..=denominator) as f32 / denominator as f32 * scale).collect();
    Tensor::from_f32(dtype, shape, &values).expect("a float tensor")
}

/// A special value of `dtype` (or, one time in six, a uniform one): NaN,
/// +inf, -inf, -0, or ± the dtype's third/fifth/seventh smallest subnormal
/// (f32/bf16/f16).
///
/// # Panics
///
/// For a u32 `dtype`.
pub fn special_value(rng: &mut impl Rng, dtype: DType) -> f32 {
    let tiny = match dtype {
        DType::F32 => f32::from_bits(3),
        DType::BF16 => bf16::from_bits(5).to_f32(),
        DType::F16 => f16::from_bits(7).to_f32(),
        DType::F8E4M3 => kvjit_core::fp8::e4m3_to_f32(3),
        _ => panic!("special_value: float elements only"),
    };
    match rng.gen_range(0..6) {
        0 => f32::NAN,
        1 => f32::INFINITY,
        2 => f32::NEG_INFINITY,
        3 => -0.0,
        4 => tiny * if rng.gen_bool(0.5) { 1.0 } else { -1.0 },
        _ => rng.gen_range(-1.0..1.0),
    }
}

/// Uniform in [-1, 1), with one element in eight (on average) replaced by a
/// [`special_value`].
///
/// # Panics
///
/// For a u32 `dtype`.
pub fn with_specials(rng: &mut impl Rng, dtype: DType, shape: &[usize]) -> Tensor {
    let numel = shape.iter().product();
    let values: Vec<f32> = (0..numel)
        .map(|_| if rng.gen_ratio(1, 8) { special_value(rng, dtype) } else { rng.gen_range(-1.0..1.0) })
        .collect();
    Tensor::from_f32(dtype, shape, &values).expect("a float tensor")
}

/// The largest magnitude among a float tensor's finite values (0 if none).
///
/// # Panics
///
/// For a u32 tensor.
pub fn max_abs_finite(t: &Tensor) -> f64 {
    t.to_f32_vec()
        .expect("a float tensor")
        .iter()
        .filter(|v| v.is_finite())
        .fold(0f64, |m, &v| m.max(f64::from(v).abs()))
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    #[test]
    fn dyadic_values_are_multiples_of_the_denominator() {
        let t = dyadic(&mut StdRng::seed_from_u64(1), DType::BF16, &[64], 8);
        for v in t.to_f32_vec().unwrap() {
            assert!((-1.0..=1.0).contains(&v) && (v * 8.0).fract() == 0.0, "{v}");
        }
        let same = dyadic_scaled(&mut StdRng::seed_from_u64(1), DType::BF16, &[64], 8, 1.0);
        assert_eq!(t, same);
    }

    #[test]
    fn nonzero_values_keep_away_from_zero() {
        let t = uniform_nonzero(&mut StdRng::seed_from_u64(2), DType::F32, &[1000], 0.25);
        assert!(t.to_f32_vec().unwrap().iter().all(|v| v.abs() >= 0.25 && v.abs() < 1.0));
    }

    #[test]
    fn specials_show_up() {
        let t = with_specials(&mut StdRng::seed_from_u64(3), DType::F16, &[4000]);
        let v = t.to_f32_vec().unwrap();
        assert!(v.iter().any(|x| x.is_nan()) && v.iter().any(|x| x.is_infinite()));
        assert_eq!(max_abs_finite(&t), v.iter().filter(|x| x.is_finite()).fold(0f64, |m, &x| m.max(x.abs() as f64)));
    }
}
