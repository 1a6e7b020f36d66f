//! The JIT against the f64 reference, for every form (`mo.matmul`,
//! `kvjit.matmul_silu`, the add, mul and silu_mul epilogues and
//! `kvjit.swiglu_matmul`), dtype (f32, bf16, f16), weight orientation
//! (`[N, K]` and `[K, N]`) and CPU tier (the 256-bit one where the CPU has
//! it), on random non-zero inputs: each kernel baked for its row count and
//! the generic one (rows left to the call, which picks the GEMV or the
//! blocked schedule at run time) on the same calls; 1 and 3 threads give
//! the same bytes; every output NaN-poisoned between canary guards.
//!
//! The shapes reach every edge of the schedules: one row (the GEMV), 2–7
//! rows (the remainders of the 6-row and 4-row tiles; 2-row for SwiGLU on
//! the Cranelift tier), past 64 and 192 rows (the tiers' row blocks, with a
//! last block of one row), N not a multiple of either panel width (37, 20
//! and 1) and N a multiple of both (16), odd K (19 and 1) and K past the
//! 256-value k blocks (600 and 300).
//!
//! The tolerance ([`common::bound`]) is the f32 accumulation bound of each
//! element's own terms (`4·2⁻²⁴·K·Σ|a·w|`) carried through the epilogue,
//! plus one rounding step of the dtype at the result.

mod common;

use common::{
    DTYPES, EPILOGUES, Jit, ORIENTATIONS, assert_close, assert_same_bytes, bound, check_close, inputs, run_jit,
    run_reference, spec, terms, tiers,
};
use kvjit_core::{DType, Tensor};
use kvjit_op_matmul::Epilogue;
use rand::SeedableRng;
use rand::rngs::SmallRng;

/// (K, N), and the row counts run on a kernel of that K and N.
const SHAPES: &[((usize, usize), &[usize])] = &[
    ((19, 37), &[1, 2, 3, 4, 5, 6, 7]),
    ((24, 20), &[64, 65, 193]),
    ((600, 24), &[1, 5, 13, 193]),
    ((300, 40), &[200]),
    ((8, 16), &[3, 8]),
    ((1, 1), &[1, 2]),
];

/// `a`'s leading dims for `m` rows: one dim, or two for even counts (the
/// rows of a `[..., K]` tensor are the product of its leading dims).
fn leading(m: usize) -> Vec<usize> {
    if m.is_multiple_of(2) && m >= 4 { vec![2, m / 2] } else { vec![m] }
}

/// Every dtype, orientation, tier and shape of one epilogue: the baked and
/// the generic kernel against the reference, thread counts alike; prints
/// the worst error relative to the tolerance per dtype and tier.
fn check_epilogue(epilogue: Epilogue, seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    for tier in tiers() {
        for dtype in DTYPES {
            let mut worst = 0f64;
            for orientation in ORIENTATIONS {
                for &((k, n), row_counts) in SHAPES {
                    let generic = Jit::new(spec(epilogue, dtype, tier, orientation, (k, n), None), None);
                    for &m in row_counts {
                        let spec = spec(epilogue, dtype, tier, orientation, (k, n), Some(m));
                        let inputs = inputs(&mut rng, &spec, &leading(m));
                        let tensors = inputs.tensors();
                        let shape = inputs.output_shape(&spec);
                        let want = run_reference(spec, &tensors, &shape);
                        let baked = Jit::new(spec, None);
                        for (kernel, rows) in [(&baked, "baked"), (&generic, "any")] {
                            let what = format!("{} (rows {rows}) on [{m}, {k}]", kernel.kernel().key());
                            let got = run_jit(kernel, &tensors, &shape, 1);
                            worst = worst.max(assert_close(&spec, &inputs, &got, &want, &what));
                            let threads = run_jit(kernel, &tensors, &shape, 3);
                            assert_same_bytes(&threads, &got, &format!("{what}: 3 threads against 1"));
                        }
                    }
                }
            }
            println!("{} {dtype} {tier:?}: worst error {worst:.3} of the tolerance", epilogue.kernel_name());
        }
    }
}

#[test]
fn matmul_matches_the_reference() {
    check_epilogue(Epilogue::None, 1);
}

#[test]
fn matmul_silu_matches_the_reference() {
    check_epilogue(Epilogue::Silu, 2);
}

#[test]
fn matmul_add_matches_the_reference() {
    check_epilogue(Epilogue::Add, 3);
}

#[test]
fn matmul_mul_matches_the_reference() {
    check_epilogue(Epilogue::Mul, 4);
}

#[test]
fn matmul_silu_mul_matches_the_reference() {
    check_epilogue(Epilogue::SiluMul, 5);
}

#[test]
fn swiglu_matmul_matches_the_reference() {
    check_epilogue(Epilogue::SwiGlu, 6);
}

/// The tolerance could fail: in f32 it is below the smallest term a
/// product of the inputs can make (1/16), even at K = 600 — a dropped,
/// doubled or misplaced term is caught — and a result off by one such term
/// is refused.
#[test]
fn the_f32_tolerance_is_tighter_than_one_term() {
    let mut rng = SmallRng::seed_from_u64(7);
    for k in [19, 600] {
        let spec = spec(Epilogue::None, DType::F32, tiers()[0], ORIENTATIONS[0], (k, 24), Some(5));
        let inputs = inputs(&mut rng, &spec, &[5]);
        let want = run_reference(spec, &inputs.tensors(), &[5, 24]);
        let terms = terms(&spec, &inputs);
        let largest = want
            .to_f32_vec()
            .unwrap()
            .iter()
            .zip(&terms)
            .map(|(&w, t)| bound(&spec, t, f64::from(w), f64::from(w)))
            .fold(0f64, f64::max);
        assert!(largest < 1.0 / 16.0, "K {k}: the tolerance {largest} admits a whole term");
        let mut off = want.to_f32_vec().unwrap();
        off[7] += 1.0 / 16.0;
        let off = Tensor::from_f32(DType::F32, &[5, 24], &off).unwrap();
        let refused = check_close(&spec, &inputs, &off, &want);
        assert!(refused.as_ref().is_err_and(|e| e.starts_with("[0, 7]")), "K {k}: one term off gave {refused:?}");
    }
}

/// Calls of no rows write nothing and succeed, on the generic kernel and
/// on one baked for zero rows; the same kernel then runs a call with rows.
#[test]
fn zero_rows_write_nothing() {
    let mut rng = SmallRng::seed_from_u64(8);
    for tier in tiers() {
        for epilogue in EPILOGUES {
            for rows in [None, Some(0)] {
                let spec = spec(epilogue, DType::BF16, tier, ORIENTATIONS[1], (19, 37), rows);
                let jit = Jit::new(spec, None);
                for leading in [&[0][..], &[3, 0]] {
                    let inputs = inputs(&mut rng, &spec, leading);
                    let shape = inputs.output_shape(&spec);
                    let got = run_jit(&jit, &inputs.tensors(), &shape, 2);
                    assert_eq!(got.numel(), 0);
                }
                if rows.is_none() {
                    let inputs = inputs(&mut rng, &spec, &[3]);
                    let got = run_jit(&jit, &inputs.tensors(), &[3, 37], 2);
                    let want = run_reference(spec, &inputs.tensors(), &[3, 37]);
                    assert_close(&spec, &inputs, &got, &want, &format!("{} after zero rows", jit.kernel().key()));
                }
            }
        }
    }
}

/// More threads than panel groups (N = 20 has 2 or 3), and a wide N split
/// unevenly: every column written once, the same bytes at every count.
#[test]
fn thread_counts_split_panel_groups_without_changing_a_bit() {
    let mut rng = SmallRng::seed_from_u64(9);
    for tier in tiers() {
        for (k, n, m) in [(24, 20, 7), (40, 333, 9), (40, 333, 1)] {
            for epilogue in [Epilogue::None, Epilogue::SwiGlu, Epilogue::Add] {
                let spec = spec(epilogue, DType::F32, tier, ORIENTATIONS[0], (k, n), None);
                let jit = Jit::new(spec, None);
                let inputs = inputs(&mut rng, &spec, &[m]);
                let tensors = inputs.tensors();
                let one = run_jit(&jit, &tensors, &[m, n], 1);
                let want = run_reference(spec, &tensors, &[m, n]);
                assert_close(&spec, &inputs, &one, &want, &format!("{} [{m}, {k}]", jit.kernel().key()));
                for threads in [2, 3, 5, 8] {
                    let got = run_jit(&jit, &tensors, &[m, n], threads);
                    assert_same_bytes(&got, &one, &format!("{} [{m}, {k}]: {threads} threads", jit.kernel().key()));
                }
            }
        }
    }
}

/// A NaN in one row of `a` and in one column's weights (one of each
/// sibling for SwiGLU) makes that row and that column of the result NaN,
/// as the reference has it, and changes no other element by a bit: tiles
/// and panels keep rows and columns apart, and their padding is never
/// stored.
#[test]
fn a_nan_stays_in_its_row_and_column() {
    let mut rng = SmallRng::seed_from_u64(10);
    let (m, k, n) = (9, 21, 37);
    for tier in tiers() {
        for orientation in ORIENTATIONS {
            for epilogue in EPILOGUES {
                let spec = spec(epilogue, DType::F32, tier, orientation, (k, n), None);
                let jit = Jit::new(spec, None);
                let clean = inputs(&mut rng, &spec, &[m]);
                let want_clean = run_jit(&jit, &clean.tensors(), &[m, n], 2);
                let (row, column) = (m - 2, 17);
                let mut poisoned = clean.clone();
                let mut a = clean.a.to_f32_vec().unwrap();
                a[row * k + 5] = f32::NAN;
                poisoned.a = Tensor::from_f32(DType::F32, &[m, k], &a).unwrap();
                for (j, weight) in poisoned.weights.iter_mut().enumerate() {
                    let mut w = weight.to_f32_vec().unwrap();
                    let kk = 3 + 7 * j;
                    match orientation {
                        kvjit_op::gemm::WeightOrientation::NK => w[column * k + kk] = f32::NAN,
                        kvjit_op::gemm::WeightOrientation::KN => w[kk * n + column] = f32::NAN,
                    }
                    *weight = Tensor::from_f32(DType::F32, weight.shape(), &w).unwrap();
                }
                let got = run_jit(&jit, &poisoned.tensors(), &[m, n], 3).to_f32_vec().unwrap();
                let want = run_reference(spec, &poisoned.tensors(), &[m, n]).to_f32_vec().unwrap();
                let clean = want_clean.to_f32_vec().unwrap();
                let what = format!("{} with a NaN at row {row}, column {column}", jit.kernel().key());
                for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    let (r, c) = (i / n, i % n);
                    if r == row || c == column {
                        assert!(g.is_nan() && w.is_nan(), "{what}: [{r}, {c}] = {g}, reference {w}");
                    } else {
                        assert_eq!(g.to_bits(), clean[i].to_bits(), "{what}: [{r}, {c}] changed");
                    }
                }
            }
        }
    }
}

/// Random shapes (M up to 70, K up to 300, N up to 50), forms, dtypes,
/// orientations, tiers and baked or generic rows, each against the
/// reference, 1 and 2 threads alike. (3000 cases passed once; 150 run.)
#[test]
fn random_shapes_match_the_reference() {
    use rand::Rng;
    let mut rng = SmallRng::seed_from_u64(11);
    let tiers = tiers();
    for case in 0..150 {
        let (m, k, n) = (rng.gen_range(1..=70), rng.gen_range(1..=300), rng.gen_range(1..=50));
        let epilogue = EPILOGUES[rng.gen_range(0..EPILOGUES.len())];
        let dtype = DTYPES[rng.gen_range(0..DTYPES.len())];
        let orientation = ORIENTATIONS[rng.gen_range(0..2)];
        let tier = tiers[rng.gen_range(0..tiers.len())];
        let rows = rng.r#gen::<bool>().then_some(m);
        let spec = spec(epilogue, dtype, tier, orientation, (k, n), rows);
        let jit = Jit::new(spec, None);
        let inputs = inputs(&mut rng, &spec, &[m]);
        let tensors = inputs.tensors();
        let want = run_reference(spec, &tensors, &[m, n]);
        let what = format!("case {case}: {} on [{m}, {k}]", jit.kernel().key());
        let got = run_jit(&jit, &tensors, &[m, n], 1);
        assert_close(&spec, &inputs, &got, &want, &what);
        assert_same_bytes(&run_jit(&jit, &tensors, &[m, n], 2), &got, &format!("{what}: 2 threads against 1"));
    }
}
