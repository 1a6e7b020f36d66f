//! The vectorized exp against f64 `exp` over its whole input range.

use kvjit_core::{DType, KernelKey, Target};
use kvjit_jit::cranelift_codegen::ir::{InstBuilder, types};
use kvjit_jit::ir::math::{EXP_MAX_REL_ERROR, exp_f32x4};
use kvjit_jit::ir::{counted_loop, mem};
use kvjit_jit::{CaptureText, JitFunction, compile_kernel};
use kvjit_runtime::DeviceContextPtr;

/// `out[4i..4i+4] = exp(in[4i..4i+4])` for every item i.
fn exp_kernel() -> JitFunction {
    let key = KernelKey::new("exp_test", Target::Cpu, DType::F32);
    compile_kernel(&key, CaptureText::default(), |b, p| {
        let input = p.arg(b, 0);
        let output = p.arg(b, 1);
        counted_loop(b, p.begin, p.end, 1, &[], |b, i, _| {
            let at = b.ins().ishl_imm_u(i, 4);
            let src = b.ins().iadd(input, at);
            let dst = b.ins().iadd(output, at);
            let x = b.ins().load(types::F32X4, mem(), src, 0);
            let y = exp_f32x4(b, x);
            b.ins().store(mem(), y, dst, 0);
            Vec::new()
        });
    })
    .unwrap()
}

fn run_exp(xs: &[f32]) -> Vec<f32> {
    let mut input = xs.to_vec();
    input.resize(xs.len().div_ceil(4) * 4, 0.0);
    let mut out = vec![f32::NAN; input.len()];
    let code = exp_kernel();
    let args = [input.as_ptr() as u64, out.as_mut_ptr() as u64];
    // SAFETY: item i reads input[4i..4i+4] and writes out[4i..4i+4]; both
    // hold `items · 4` floats.
    unsafe { kvjit_jit::launch(&code, &args, input.len() / 4, &DeviceContextPtr::cpu(2).unwrap()) };
    out.truncate(xs.len());
    out
}

#[test]
fn exp_is_accurate_over_the_whole_range() {
    let n = 1_000_000;
    let (lo, hi) = (-104.0f64, 89.0f64);
    let mut xs: Vec<f32> = (0..=n).map(|i| (lo + (hi - lo) * i as f64 / n as f64) as f32).collect();
    // Near zero, tiny values, the reduction boundaries and the clamp edges.
    xs.extend([0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, f32::MIN_POSITIVE, 0.346_573_6, -0.346_573_6]);
    xs.extend((-200..=200).map(|k| k as f32 * std::f32::consts::LN_2));
    xs.extend([-87.336_54, -87.33, -87.34, -103.97, -103.98, 88.72, 88.722_83, 88.73]);
    let ys = run_exp(&xs);
    let min_normal = f64::from(f32::MIN_POSITIVE);
    let (mut worst, mut worst_x) = (0f64, 0f32);
    for (&x, &y) in xs.iter().zip(&ys) {
        let want = f64::from(x).exp();
        let got = f64::from(y);
        if want > f64::from(f32::MAX) {
            assert_eq!(y, f32::INFINITY, "exp({x}) overflows");
        } else if want >= min_normal {
            let rel = (got - want).abs() / want;
            if rel > worst {
                (worst, worst_x) = (rel, x);
            }
            assert!(rel <= EXP_MAX_REL_ERROR, "exp({x}) = {y}, want {want}: relative error {rel:e}");
        } else {
            // Subnormal (or zero) results: the relative bound plus half a
            // subnormal step.
            let bound = EXP_MAX_REL_ERROR * want + 2f64.powi(-150);
            assert!((got - want).abs() <= bound, "exp({x}) = {y:e}, want {want:e}");
            assert!(y >= 0.0);
        }
    }
    println!("max relative error {worst:e} ({:.3} units of 2^-24) at x = {worst_x}", worst * 2f64.powi(24));
}

#[test]
fn exp_special_inputs() {
    let xs = [f32::NEG_INFINITY, -1e30, -1000.0, -104.0, -150.0, f32::INFINITY, 1e30, 89.0, f32::NAN, 0.0];
    let ys = run_exp(&xs);
    for (x, y) in xs.iter().zip(&ys).take(5) {
        assert_eq!(y.to_bits(), 0, "exp({x}) must be +0, got {y}");
    }
    for (x, y) in xs.iter().zip(&ys).skip(5).take(3) {
        assert_eq!(*y, f32::INFINITY, "exp({x})");
    }
    assert!(ys[8].is_nan());
    assert_eq!(ys[9], 1.0);
    // -inf − -inf never reaches exp in the kernel, but NaN in stays NaN out.
}
