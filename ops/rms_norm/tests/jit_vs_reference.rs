//! The JIT against the reference: random rows over dtypes, widths H from 1
//! to 8192 (vector tails, non-multiples of 4 and 16), magnitudes over many
//! decades, weight offsets, baked and run-time row counts; 1, 2 and 3
//! threads give identical bytes; each output NaN-poisoned between canary
//! guards. Then the edges: epsilon dominating, rows near the top and the
//! bottom of the f32 range, H = 1, infinities and NaN.
//!
//! Measured (worst over `measured_error_over_dtypes_widths_and_magnitudes`,
//! x over six decades, run with `--nocapture` to see it per H): f32 2–3
//! ulps for H ≤ 257, 4 at H = 1000, 3 at 4096, 5 at 8191 and 8192; bf16
//! exact up to H = 1000 and one step from 4096; f16 one step from H = 257.
//! The tolerance is that plus one for f32 (`F32_ULPS` = 6), one step for
//! bf16 and f16.

mod common;

use common::{EPSILON, allowed_ulps, jit, random, run_jit, run_reference, spec, ulps};
use kvjit_core::{DType, Tensor};
use kvjit_op_rms_norm::RmsNormSpec;
use kvjit_testkit::tolerance::ulp;
use rand::SeedableRng;
use rand::rngs::SmallRng;

const WIDTHS: &[usize] = &[1, 2, 3, 4, 5, 7, 12, 15, 16, 17, 31, 33, 64, 100, 257, 1000, 4095, 4096, 4097, 8191, 8192];

/// JIT (at every thread count, identical bytes) against the reference:
/// the worst distance in ulps, asserted within the tolerance.
fn check(spec: RmsNormSpec, x: &Tensor, weight: &Tensor, what: &str) -> f64 {
    let kernel = jit(spec);
    let want = run_reference(spec, x, weight);
    let got = run_jit(&kernel, x, weight, 1);
    for threads in [2, 3] {
        let again = run_jit(&kernel, x, weight, threads);
        assert_eq!(again.as_bytes(), got.as_bytes(), "{what}: {threads} threads differ from 1");
    }
    let error = ulps(&got, &want);
    assert!(error <= allowed_ulps(spec.dtype), "{what}: {error} ulps of {}", spec.dtype);
    error
}

#[test]
fn measured_error_over_dtypes_widths_and_magnitudes() {
    let mut rng = SmallRng::seed_from_u64(51);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        // f16 holds 6e−8..65504: keep x and the outputs inside it.
        let decades: &[(f32, f32)] =
            if dtype == DType::F16 { &[(-2.0, 2.0), (-1.0, 0.0)] } else { &[(-3.0, 3.0), (-12.0, -8.0), (8.0, 12.0)] };
        let mut worst = vec![0f64; WIDTHS.len()];
        for (w, &width) in WIDTHS.iter().enumerate() {
            let rows = (4096 / width).clamp(2, 9);
            for (d, &decade) in decades.iter().enumerate() {
                let x = random(&mut rng, dtype, &[rows, width], decade);
                let weight = random(&mut rng, dtype, &[width], (-0.5, 0.5));
                let weight_offset = if d == 1 { 1.0 } else { 0.0 };
                for baked in [Some(rows), None] {
                    let spec = RmsNormSpec { weight_offset, ..spec(dtype, width, baked) };
                    let what = format!("{dtype} [{rows}, {width}], x ~ 10^{decade:?}, rows {baked:?}");
                    worst[w] = worst[w].max(check(spec, &x, &weight, &what));
                }
            }
        }
        let per_width: Vec<String> = WIDTHS.iter().zip(&worst).map(|(h, e)| format!("H {h}: {e}")).collect();
        println!("{dtype}: worst ulps {}", per_width.join(", "));
    }
}

/// Leading dims of any rank, symbolic (a generic kernel), zero rows.
#[test]
fn any_leading_shape_is_rows_of_h() {
    let mut rng = SmallRng::seed_from_u64(52);
    let kernel_spec = spec(DType::BF16, 24, None);
    for shape in [&[24][..], &[2, 3, 24], &[1, 2, 1, 5, 24], &[0, 24], &[0, 3, 24]] {
        let x = random(&mut rng, DType::BF16, shape, (-1.0, 1.0));
        let weight = random(&mut rng, DType::BF16, &[24], (-0.5, 0.5));
        check(kernel_spec, &x, &weight, &format!("{shape:?}"));
    }
}

/// Work items of many short rows (H = 3: 1365 rows an item) and of one
/// row each (H = 4096), with a short last item: every row written once,
/// the same bytes at every thread count.
#[test]
fn work_items_cover_every_row_once() {
    let mut rng = SmallRng::seed_from_u64(56);
    for (rows, width) in [(2 * 1365 + 7, 3), (5, 4096), (1366, 3)] {
        let x = random(&mut rng, DType::F32, &[rows, width], (-2.0, 2.0));
        let weight = random(&mut rng, DType::F32, &[width], (-0.5, 0.5));
        for baked in [Some(rows), None] {
            check(spec(DType::F32, width, baked), &x, &weight, &format!("[{rows}, {width}], rows {baked:?}"));
        }
    }
}

/// All-tiny rows: epsilon dominates, `y ≈ x / sqrt(epsilon) · w`.
#[test]
fn epsilon_dominates_tiny_rows() {
    let mut rng = SmallRng::seed_from_u64(53);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for width in [1, 7, 4096] {
            let x = random(&mut rng, dtype, &[3, width], (-5.0, -4.0));
            let weight = random(&mut rng, dtype, &[width], (-0.5, 0.5));
            let spec = RmsNormSpec { epsilon: 1e-2, ..spec(dtype, width, None) };
            check(spec, &x, &weight, &format!("{dtype} H {width}, tiny rows"));
            let got = run_jit(&jit(spec), &x, &weight, 2).to_f32_vec().unwrap();
            let (x, w) = (x.to_f32_vec().unwrap(), weight.to_f32_vec().unwrap());
            for (i, y) in got.iter().enumerate() {
                let plain = x[i] / 1e-2f32.sqrt() * w[i % width];
                let bound = 1e-5 * plain.abs() + ulp(dtype, f64::from(plain)) as f32;
                assert!((y - plain).abs() <= bound, "{dtype}: {y} against x/sqrt(eps)·w = {plain}");
            }
        }
    }
}

/// Rows at the top of the f32 range (x² overflows f32; x up to 3e38,
/// epsilon up to 1e38) and at the bottom (squares underflow, epsilon 0):
/// the rescaled sums give what the reference gives, finite.
#[test]
fn rows_past_the_f32_range_of_squares_neither_overflow_nor_underflow() {
    let mut rng = SmallRng::seed_from_u64(54);
    for dtype in [DType::F32, DType::BF16] {
        for width in [1, 5, 8192] {
            for (decade, epsilon) in [((18.0, 20.0), EPSILON), ((36.0, 38.5), EPSILON), ((18.0, 19.0), 1e38)] {
                let x = random(&mut rng, dtype, &[2, width], decade);
                let weight = random(&mut rng, dtype, &[width], (-0.5, 0.5));
                let spec = RmsNormSpec { epsilon, ..spec(dtype, width, Some(2)) };
                check(spec, &x, &weight, &format!("{dtype} H {width}, x ~ 10^{decade:?}, eps {epsilon}"));
                let got = run_jit(&jit(spec), &x, &weight, 1).to_f32_vec().unwrap();
                assert!(got.iter().all(|y| y.is_finite() && *y != 0.0), "{dtype} x ~ 10^{decade:?}: {got:?}");
            }
            // Squares of 1e−25..1e−20 underflow f32; with epsilon 0 the row
            // still normalizes to O(1).
            let x = random(&mut rng, dtype, &[2, width], (-25.0, -20.0));
            let weight = random(&mut rng, dtype, &[width], (-0.5, 0.5));
            let spec = RmsNormSpec { epsilon: 0.0, ..spec(dtype, width, None) };
            check(spec, &x, &weight, &format!("{dtype} H {width}, tiny x, eps 0"));
        }
    }
    // Subnormal f32 rows.
    let x = Tensor::from_f32(DType::F32, &[1, 5], &[1e-45, -3e-45, 1e-40, 2e-42, -7e-39]).unwrap();
    let weight = Tensor::from_f32(DType::F32, &[5], &[1.0, 0.5, -2.0, 1.5, 1.0]).unwrap();
    check(RmsNormSpec { epsilon: 0.0, ..spec(DType::F32, 5, None) }, &x, &weight, "subnormal row");
}

/// H = 1 with epsilon 0: `y = sign(x) · w` (within the tolerance).
#[test]
fn width_one_gives_the_sign_times_the_weight() {
    let mut rng = SmallRng::seed_from_u64(55);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let x = random(&mut rng, dtype, &[50, 1], (-3.0, 3.0));
        let weight = Tensor::from_f32(dtype, &[1], &[1.5]).unwrap();
        let spec = RmsNormSpec { epsilon: 0.0, ..spec(dtype, 1, Some(50)) };
        check(spec, &x, &weight, &format!("{dtype} H 1"));
        let got = run_jit(&jit(spec), &x, &weight, 3).to_f32_vec().unwrap();
        for (y, x) in got.iter().zip(x.to_f32_vec().unwrap()) {
            assert!((y - 1.5f32.copysign(x)).abs() <= 1.5 * f32::EPSILON * 4.0, "{dtype}: x {x} gave {y}");
        }
    }
}

/// Infinities, NaN and all-zero rows take what the reference gives, bit
/// for bit: ±0 beside an infinity and NaN at it, NaN rows stay NaN, zeros
/// stay zeros (NaN with epsilon 0: 0 · ∞).
#[test]
fn infinities_nan_and_zero_rows_agree_bit_for_bit() {
    let inf = f32::INFINITY;
    let rows = [
        [1.0, -inf, 2.0, -3.0, 0.5],
        [1.0, f32::NAN, 2.0, 3.0, 4.0],
        [0.0, -0.0, 0.0, 0.0, 0.0],
        [inf, inf, -inf, 1.0, -1.0],
    ];
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for epsilon in [EPSILON, 0.0] {
            let x = Tensor::from_f32(dtype, &[4, 5], rows.as_flattened()).unwrap();
            let weight = Tensor::from_f32(dtype, &[5], &[1.0, -2.0, 0.5, 1.0, 3.0]).unwrap();
            let spec = RmsNormSpec { epsilon, ..spec(dtype, 5, None) };
            let (got, want) = (run_jit(&jit(spec), &x, &weight, 2), run_reference(spec, &x, &weight));
            let (got, want) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let same = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
                assert!(same, "{dtype} eps {epsilon}, element {i}: JIT {g}, reference {w}");
            }
            assert!(want[0].to_bits() == 0 && want[1].is_nan() && want[3].to_bits() == (-0f32).to_bits());
            assert!(want[5..10].iter().all(|v| v.is_nan()));
            assert_eq!(want[10..15].iter().all(|v| v.is_nan()), epsilon == 0.0);
        }
    }
}
