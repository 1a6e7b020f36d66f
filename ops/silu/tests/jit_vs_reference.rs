//! The JIT against the reference: random inputs over dtypes, ranks and
//! sizes (vector tails, work-item edges), baked and run-time element
//! counts and several thread counts, each output NaN-poisoned between
//! canary guards; every bf16 and f16 input exhaustively; a sweep of f32;
//! the limits at ±∞, NaN and signed zeros.

mod common;

use common::{jit, random_x, run_jit, run_reference, spec, tensor};
use kvjit_core::{DType, Tensor};
use kvjit_op::Compiled;
use kvjit_op_silu::ELEMENTS_PER_ITEM;
use kvjit_runtime::Kernel;
use kvjit_testkit::tolerance::to_f64;
use kvjit_testkit::{Comparison, Tolerance, compare, compare_tensors};
use rand::SeedableRng;
use rand::rngs::SmallRng;

/// How far the JIT may be from the reference, in ulps of the output dtype:
/// f32 3 (measured worst over every f32 in [−104, −64] and every 3rd–7th
/// elsewhere: 3 for x < 0, 1 for x > 0); bf16 and f16 1 (a result rounded
/// from f32 may land one step off where the exact value is near a tie).
fn tolerance(dtype: DType) -> Tolerance {
    let units = if dtype == DType::F32 { 3.0 } else { 1.0 };
    Tolerance::Ulps { dtype, units }
}

fn check(what: &str, got: &Tensor, want: &Tensor) -> Comparison {
    let comparison = compare_tensors(tolerance(got.dtype()), got, want);
    comparison.assert_ok(what);
    comparison
}

#[test]
fn random_inputs_match_over_dtypes_ranks_sizes_and_threads() {
    let mut rng = SmallRng::seed_from_u64(21);
    let item = ELEMENTS_PER_ITEM;
    let shapes: &[&[usize]] = &[
        &[],
        &[1],
        &[3],
        &[4],
        &[7],
        &[2, 9],
        &[3, 5, 7],
        &[2, 1, 3, 4],
        &[item - 1],
        &[item + 5],
        &[3, item + 2],
        &[5, 1000, 7],
    ];
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let range = if dtype == DType::F16 { 11.0 } else { 90.0 };
        for shape in shapes {
            let x = random_x(&mut rng, dtype, shape, range);
            let want = run_reference(&x);
            for elements in [Some(x.numel()), None] {
                let kernel = jit(spec(dtype, elements));
                for threads in [1, 2, 3, 8] {
                    let got = run_jit(&kernel, &x, threads);
                    check(&format!("{dtype} {shape:?}, n {elements:?}, {threads} threads"), &got, &want);
                }
            }
        }
    }
}

/// A generic kernel serves every element count, and the platform's
/// `Kernel` path (`OpKernel::run`) writes what `run_into` writes.
#[test]
fn one_generic_kernel_serves_every_count_through_both_entry_points() {
    let mut rng = SmallRng::seed_from_u64(22);
    let kernel = Compiled::new(jit(spec(DType::BF16, None)));
    for n in [1, 2, 5, 64, 2 * ELEMENTS_PER_ITEM + 3] {
        let x = random_x(&mut rng, DType::BF16, &[n], 20.0);
        let mut out = Tensor::zeros(DType::BF16, &[n]).unwrap();
        kvjit_testkit::poison(&mut out);
        kernel.run(&[&x], &mut [], std::slice::from_mut(&mut out), &common::ctx(3)).unwrap();
        assert_eq!(out, run_jit(kernel.kernel(), &x, 2), "n = {n}");
        check(&format!("n = {n}"), &out, &run_reference(&x));
    }
}

/// Every bf16 and f16 value (NaNs, infinities, zeros, subnormals) in one
/// tensor: at most one step off, and how many are off at all.
#[test]
fn every_bf16_and_f16_input_is_within_one_step() {
    for dtype in [DType::BF16, DType::F16] {
        let bytes: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
        let x = Tensor::from_le_bytes(dtype, &[1 << 16], &bytes).unwrap();
        let got = run_jit(&jit(spec(dtype, Some(1 << 16))), &x, 4);
        let want = run_reference(&x);
        let comparison = check(&format!("every {dtype}"), &got, &want);
        let off = got.as_bytes().chunks(2).zip(want.as_bytes().chunks(2)).filter(|(g, w)| g != w).count();
        let nans = x.to_f32_vec().unwrap().iter().filter(|v| v.is_nan()).count();
        println!("{dtype}: {comparison}; {off} of 65536 differ in bits ({nans} NaN inputs)");
    }
}

/// f32 bit patterns across the whole range (every 4099th; positive inputs
/// within 1 ulp), and a random sweep that covers where the formula
/// changes (`|x|` = 64) and where results leave the normal range (x < −87).
#[test]
fn an_f32_sweep_is_within_the_measured_ulps() {
    let spread: Vec<u32> = (0..u32::MAX / 4099).map(|k| k * 4099).collect();
    let x = Tensor::from_le_bytes(DType::F32, &[spread.len()], &bytemuck_bytes(&spread)).unwrap();
    let (got, want) = (run_jit(&jit(spec(DType::F32, None)), &x, 4), run_reference(&x));
    println!("f32 over every 4099th pattern: {}", check("f32 sweep", &got, &want));
    let positive = |t: &Tensor| -> Vec<f64> {
        to_f64(t).into_iter().zip(&spread).filter(|(_, bits)| **bits < 0x8000_0000).map(|(v, _)| v).collect()
    };
    let one_ulp = Tolerance::Ulps { dtype: DType::F32, units: 1.0 };
    compare(one_ulp, &positive(&got), &positive(&want)).assert_ok("f32 sweep, x ≥ 0");
    let mut rng = SmallRng::seed_from_u64(23);
    let x = random_x(&mut rng, DType::F32, &[1 << 20], 120.0);
    let comparison = check("f32 random", &run_jit(&jit(spec(DType::F32, None)), &x, 4), &run_reference(&x));
    println!("f32 random in ±120: {comparison}");
}

fn bytemuck_bytes(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// The limits, and signed zeros, bit for bit in every dtype.
#[test]
fn infinities_nan_and_zeros_take_their_limits() {
    let inputs = [f32::NEG_INFINITY, f32::INFINITY, -0.0, 0.0, -1e30, 1e30, -200.0, f32::NAN, -f32::NAN];
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let x = tensor(dtype, &inputs);
        let got = run_jit(&jit(spec(dtype, None)), &x, 1).to_f32_vec().unwrap();
        let want = run_reference(&x).to_f32_vec().unwrap();
        let large = if dtype == DType::F16 { f32::INFINITY } else { 1e30 };
        let expected = [-0.0, f32::INFINITY, -0.0, 0.0, -0.0, large, -0.0];
        for (i, e) in expected.iter().enumerate() {
            let (g, w, e) = (got[i], want[i], tensor(dtype, &[*e]).to_f32_vec().unwrap()[0]);
            assert_eq!((g.to_bits(), w.to_bits()), (e.to_bits(), e.to_bits()), "{dtype}: silu({})", inputs[i]);
        }
        assert!(got[7..].iter().chain(&want[7..]).all(|v| v.is_nan()), "{dtype}: NaN in, NaN out");
    }
}
