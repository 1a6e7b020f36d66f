//! The emitter kit's small helpers against plain Rust: element addresses
//! (`addr::element`, a shift for power-of-two strides), checked constant
//! displacements (`addr::Displacements`), sizes baked in or read at run
//! time (`addr::Size`), branches (`when`, `if_else`) and shuffles
//! (`shuffle::f32x4`, `shuffle::transpose_sum`).

use kvjit_core::{DType, KernelKey, Target};
use kvjit_jit::cranelift_codegen::ir::condcodes::IntCC;
use kvjit_jit::cranelift_codegen::ir::{InstBuilder, Value, types};
use kvjit_jit::cranelift_frontend::FunctionBuilder;
use kvjit_jit::ir::addr::{self, Displacements, Size};
use kvjit_jit::ir::{if_else, match_cases, mem, shuffle, when};
use kvjit_jit::{CaptureText, JitError, JitFunction, compile_function};

mod common;
use common::{kernel, run};

/// `extern "C" fn(i64, i64) -> i64`, as compiled by [`binary`].
type Binary = extern "C" fn(i64, i64) -> i64;

/// Compile `fn(x, y) -> i64` whose body `f` makes the result from `x`, `y`.
fn binary(name: &str, f: impl FnOnce(&mut FunctionBuilder, [Value; 2]) -> Value) -> JitFunction {
    let capture = CaptureText { clif: true, disasm: false };
    compile_function(name, &[types::I64, types::I64], &[types::I64], capture, |b, args| {
        let result = f(b, [args[0], args[1]]);
        b.ins().return_(&[result]);
    })
    .unwrap()
}

fn call(f: &JitFunction, x: i64, y: i64) -> i64 {
    // SAFETY: every function passed here was compiled by `binary` with
    // signature (i64, i64) -> i64 in the host's C convention, matching
    // `Binary`; it touches no memory, and `f` outlives the call.
    let entry: Binary = unsafe { std::mem::transmute(f.entry()) };
    entry(x, y)
}

#[test]
fn element_is_base_plus_index_times_stride_shifting_for_powers_of_two() {
    for bytes in [1usize, 2, 4, 8, 12, 24, 64, 4100, 1 << 20, 3 << 30] {
        let f = binary("element", |b, [base, index]| addr::element(b, base, index, bytes));
        for (base, index) in [(0i64, 0i64), (1000, 3), (-8, 7), (1 << 40, 12_345), (5, -2), (1, 1 << 33)] {
            let want = base.wrapping_add(index.wrapping_mul(bytes as i64));
            assert_eq!(call(&f, base, index), want, "{base} + {index}·{bytes}");
        }
        let clif = f.clif().unwrap();
        let (shift, multiply) = (clif.contains("ishl"), clif.contains("imul"));
        assert_eq!((shift, multiply), (bytes.is_power_of_two(), !bytes.is_power_of_two()), "{bytes}:\n{clif}");
    }
}

#[test]
fn sizes_known_or_read_at_run_time_multiply_alike() {
    // `x · size · 3`, the size baked in (7) or read from the second argument.
    let known = binary("size_known", |b, [x, _]| Size::Known(7).times(b, x, 3));
    let runtime = binary("size_runtime", |b, [x, n]| Size::Runtime(n).times(b, x, 3));
    let value = binary("size_value", |b, [_, n]| Size::Runtime(n).value(b));
    let known_value = binary("size_known_value", |b, _| Size::Known(7).value(b));
    for x in [0, 1, -5, 1 << 40] {
        assert_eq!(call(&known, x, 0), x * 21);
        assert_eq!(call(&runtime, x, 7), x * 21);
    }
    assert_eq!(call(&value, 0, 123), 123);
    assert_eq!(call(&known_value, 0, 0), 7);
}

fn key() -> KernelKey {
    KernelKey::new("displacements_test", Target::Cpu, DType::F32)
}

#[test]
fn displacements_past_i32_are_refused_at_build() {
    let fits = Displacements::up_to(&key(), Some(i32::MAX as usize)).unwrap();
    assert_eq!(fits.max(), i32::MAX as usize);
    assert_eq!(fits.of(i32::MAX as usize), i32::MAX);
    assert_eq!(fits.of(0), 0);
    for (max, reach) in [(Some(i32::MAX as usize + 1), "2147483648 bytes"), (None, "more bytes than a usize holds")] {
        match Displacements::up_to(&key(), max) {
            Err(JitError::Unsupported { key: k, reason }) => {
                assert_eq!(k, key().to_string());
                assert!(reason.contains(reach), "{reason}");
            }
            other => panic!("{max:?}: expected Unsupported, got {other:?}"),
        }
    }
}

#[test]
#[should_panic(expected = "a displacement of 65 bytes, past the 64 bytes checked when the kernel was built")]
fn a_displacement_past_the_checked_bound_panics_instead_of_wrapping() {
    Displacements::up_to(&key(), Some(64)).unwrap().of(65);
}

#[test]
fn when_and_if_else_take_the_branch_their_condition_names() {
    // Per i64 x: out[0] = if x > 0 { 1 } else { 2 }; out[1] = 7 when x is
    // even, else untouched.
    let branches = kernel("branches", 1, 8, 16, |b, s, d| {
        let x = b.ins().load(types::I64, mem(), s, 0);
        let positive = b.ins().icmp_imm_s(IntCC::SignedGreaterThan, x, 0);
        let store = |b: &mut FunctionBuilder, v: i64, at: i32| {
            let v = b.ins().iconst(types::I64, v);
            b.ins().store(mem(), v, d, at);
        };
        if_else(b, positive, |b| store(b, 1, 0), |b| store(b, 2, 0));
        let odd = b.ins().band_imm_s(x, 1);
        let even = b.ins().icmp_imm_s(IntCC::Equal, odd, 0);
        when(b, even, |b| store(b, 7, 8));
    });
    let xs = [5i64, -3, 0, 8, -4, 1 << 41, 3];
    let mut out = vec![[-1i64; 2]; xs.len()];
    run(&branches, &xs, &mut out, xs.len());
    for (&x, &[chosen, maybe]) in xs.iter().zip(&out) {
        assert_eq!(chosen, if x > 0 { 1 } else { 2 }, "if_else for {x}");
        assert_eq!(maybe, if x % 2 == 0 { 7 } else { -1 }, "when for {x}");
    }
}

#[test]
fn match_cases_runs_the_arm_of_the_listed_value_only() {
    // Per i64 x: out = 10·x for x in {1, 3, 4}, else untouched.
    let matched = kernel("match_cases", 1, 8, 8, |b, s, d| {
        let x = b.ins().load(types::I64, mem(), s, 0);
        match_cases(b, x, &[1, 3, 4], |b, case| {
            let v = b.ins().iconst(types::I64, 10 * case as i64);
            b.ins().store(mem(), v, d, 0);
        });
    });
    let xs = [0i64, 1, 2, 3, 4, 5, -1, 1 << 40 | 3];
    let mut out = vec![-1i64; xs.len()];
    run(&matched, &xs, &mut out, xs.len());
    for (&x, &got) in xs.iter().zip(&out) {
        assert_eq!(got, if [1, 3, 4].contains(&x) { 10 * x } else { -1 }, "x = {x}");
    }
}

#[test]
fn shuffles_pick_the_named_lanes() {
    let src: Vec<f32> = (0..8 * 3).map(|i| i as f32 * 1.5 - 7.0).collect();
    for lanes in [[0, 4, 1, 5], [2, 6, 3, 7], [0, 1, 4, 5], [1, 0, 3, 2], [0, 2, 4, 6], [7, 7, 0, 3]] {
        let f = kernel("shuffle", 1, 32, 16, |b, s, d| {
            let x = b.ins().load(types::F32X4, mem(), s, 0);
            let y = b.ins().load(types::F32X4, mem(), s, 16);
            let picked = shuffle::f32x4(b, x, y, lanes);
            b.ins().store(mem(), picked, d, 0);
        });
        let mut out = vec![[f32::NAN; 4]; 3];
        run(&f, &src, &mut out, 3);
        for (item, got) in out.iter().enumerate() {
            let want = lanes.map(|l| src[8 * item + usize::from(l)]);
            assert_eq!(*got, want, "lanes {lanes:?} of item {item}");
        }
    }
}

#[test]
fn transpose_sum_sums_each_vector() {
    // Small integers: every order of the adds is exact.
    let src: Vec<f32> = (0..16 * 2).map(|i| ((i * 7) % 23) as f32 - 11.0).collect();
    let f = kernel("transpose_sum", 1, 64, 16, |b, s, d| {
        let vectors = [0, 16, 32, 48].map(|at| b.ins().load(types::F32X4, mem(), s, at));
        let sums = shuffle::transpose_sum(b, vectors);
        b.ins().store(mem(), sums, d, 0);
    });
    let mut out = vec![[f32::NAN; 4]; 2];
    run(&f, &src, &mut out, 2);
    for (item, got) in out.iter().enumerate() {
        let want: [f32; 4] = std::array::from_fn(|v| src[16 * item + 4 * v..][..4].iter().sum());
        assert_eq!(*got, want, "item {item}");
    }
}
