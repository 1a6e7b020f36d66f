//! The JIT against the reference, bit for bit: computing in f32 and
//! rounding once is the correctly rounded result in every dtype (f32 has
//! at least 2p + 2 bits for bf16's and f16's p, and for f32 operands a sum
//! or product is exact or correctly rounded in f64 before its one rounding
//! to f32), so any difference is a bug. Random operands over dtypes,
//! ranks and sizes (empty, vector tails, work-item edges), baked and run-time
//! element counts and several thread counts, each output NaN-poisoned
//! between canary guards; random bit patterns of every class, operands of
//! nearby and distant exponents (cancellation, sums that round near a tie
//! of the output dtype); infinities, NaN and signed zeros against Rust's
//! own f32 arithmetic.

mod common;

use common::{DTYPES, OPERATIONS, assert_bits, differing, jit, random, run_jit, run_reference, spec};
use kvjit_core::{DType, Tensor};
use kvjit_op::Compiled;
use kvjit_op_binary::{BinaryOperation, ELEMENTS_PER_ITEM};
use kvjit_runtime::Kernel;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

#[test]
fn random_operands_match_over_dtypes_ranks_sizes_and_threads() {
    let mut rng = SmallRng::seed_from_u64(51);
    let item = ELEMENTS_PER_ITEM;
    let shapes: &[&[usize]] = &[
        &[],
        &[0],
        &[3, 0, 2],
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
    for operation in OPERATIONS {
        for dtype in DTYPES {
            let range = if dtype == DType::F16 { 200.0 } else { 1e4 };
            for shape in shapes {
                let (a, b) = (random(&mut rng, dtype, shape, range), random(&mut rng, dtype, shape, range));
                let want = run_reference(operation, &a, &b);
                for elements in [Some(a.numel()), None] {
                    let kernel = jit(spec(operation, dtype, elements));
                    for threads in [1, 2, 3] {
                        let got = run_jit(&kernel, &a, &b, threads);
                        let what = format!("{operation:?} {dtype} {shape:?}, n {elements:?}, {threads} threads");
                        assert_bits(&what, &got, &want);
                    }
                }
            }
        }
    }
}

/// A generic kernel serves every element count, and the platform's
/// `Kernel` path (`OpKernel::run`) writes what `run_into` writes.
#[test]
fn one_generic_kernel_serves_every_count_through_both_entry_points() {
    let mut rng = SmallRng::seed_from_u64(52);
    for operation in OPERATIONS {
        let kernel = Compiled::new(jit(spec(operation, DType::BF16, None)));
        for n in [1, 2, 5, 64, 2 * ELEMENTS_PER_ITEM + 3] {
            let (a, b) = (random(&mut rng, DType::BF16, &[n], 50.0), random(&mut rng, DType::BF16, &[n], 50.0));
            let mut out = Tensor::zeros(DType::BF16, &[n]).unwrap();
            kvjit_testkit::poison(&mut out);
            kernel.run(&[&a, &b], &mut [], std::slice::from_mut(&mut out), &common::ctx(3)).unwrap();
            assert_eq!(out, run_jit(kernel.kernel(), &a, &b, 2), "{operation:?} n = {n}");
            assert_bits(&format!("{operation:?} n = {n}"), &out, &run_reference(operation, &a, &b));
        }
    }
}

/// `bits` of `dtype` as a tensor.
fn from_bits(dtype: DType, bits: &[u32]) -> Tensor {
    let bytes: Vec<u8> = match dtype {
        DType::F32 => bits.iter().flat_map(|w| w.to_le_bytes()).collect(),
        _ => bits.iter().flat_map(|&w| (w as u16).to_le_bytes()).collect(),
    };
    Tensor::from_le_bytes(dtype, &[bits.len()], &bytes).unwrap()
}

/// Random bit patterns (NaNs, infinities, zeros, subnormals, every
/// exponent), and pairs whose exponents differ by 0 to 30 (cancellation in
/// a sum, a small operand landing near a rounding tie of the large one):
/// not one element may differ. Prints how many were compared.
#[test]
fn bit_patterns_of_every_class_and_exponent_gap_match_exactly() {
    let mut rng = SmallRng::seed_from_u64(53);
    let n = 1 << 17;
    for dtype in DTYPES {
        let (width, mantissa) =
            if dtype == DType::F32 { (32, 23) } else { (16, if dtype == DType::BF16 { 7 } else { 10 }) };
        let mask = if width == 32 { u32::MAX } else { 0xffff };
        let a_bits: Vec<u32> = (0..n).map(|_| rng.r#gen::<u32>() & mask).collect();
        let any_b: Vec<u32> = (0..n).map(|_| rng.r#gen::<u32>() & mask).collect();
        // b: a's exponent lowered by 0..=30 steps (clamped at 0), random
        // sign and mantissa.
        let near_b: Vec<u32> = a_bits
            .iter()
            .map(|&a| {
                let exponent = (a & !(1 << (width - 1)) & mask) >> mantissa;
                let lowered = exponent.saturating_sub(rng.gen_range(0..=30));
                let sign = rng.r#gen::<u32>() & (1 << (width - 1));
                sign | (lowered << mantissa) | (rng.r#gen::<u32>() & ((1 << mantissa) - 1))
            })
            .collect();
        let a = from_bits(dtype, &a_bits);
        for (what, b_bits) in [("random patterns", &any_b), ("exponent gaps 0-30", &near_b)] {
            let b = from_bits(dtype, b_bits);
            for operation in OPERATIONS {
                let got = run_jit(&jit(spec(operation, dtype, None)), &a, &b, 2);
                let want = run_reference(operation, &a, &b);
                let (off, first) = differing(&got, &want);
                println!("{operation:?} {dtype} {what}: {off} of {n} differ from the reference");
                assert_eq!(off, 0, "{operation:?} {dtype} {what}: first (index, got, want) {first:?}");
            }
        }
    }
}

/// Infinities, NaN, signed zeros, the largest finite value and the
/// smallest subnormal, every pair, bit for bit against Rust's f32
/// arithmetic on the widened operands rounded once to the dtype (an
/// oracle independent of both kernels), for the JIT and the reference.
#[test]
fn special_values_take_ieee_results() {
    for dtype in DTYPES {
        let max = Tensor::from_le_bytes(dtype, &[1], &max_bytes(dtype)).unwrap().to_f32_vec().unwrap()[0];
        let tiny = from_bits(dtype, &[1]).to_f32_vec().unwrap()[0];
        let specials = [f32::NEG_INFINITY, f32::INFINITY, -0.0, 0.0, 1.0, -1.0, max, -max, tiny, -tiny, f32::NAN];
        let pairs: Vec<(f32, f32)> = specials.iter().flat_map(|&a| specials.iter().map(move |&b| (a, b))).collect();
        let tensor = |values: Vec<f32>| Tensor::from_f32(dtype, &[values.len()], &values).unwrap();
        let (a, b) = (tensor(pairs.iter().map(|p| p.0).collect()), tensor(pairs.iter().map(|p| p.1).collect()));
        for operation in OPERATIONS {
            let f32_op = |x: f32, y: f32| match operation {
                BinaryOperation::Add => x + y,
                BinaryOperation::Mul => x * y,
            };
            let want = tensor(pairs.iter().map(|&(x, y)| f32_op(x, y)).collect());
            assert_bits(
                &format!("{operation:?} {dtype} JIT"),
                &run_jit(&jit(spec(operation, dtype, None)), &a, &b, 1),
                &want,
            );
            assert_bits(&format!("{operation:?} {dtype} reference"), &run_reference(operation, &a, &b), &want);
        }
    }
}

/// The bytes of `dtype`'s largest finite value.
fn max_bytes(dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => f32::MAX.to_le_bytes().to_vec(),
        DType::BF16 => 0x7f7fu16.to_le_bytes().to_vec(),
        _ => 0x7bffu16.to_le_bytes().to_vec(),
    }
}
