//! The JIT against the reference, bit for bit, and both against the rows
//! indexed in the test: random padded batches (random bit patterns) over
//! dtypes, row lengths with every tail, valid lengths from 0 (zeros) to S,
//! baked and run-time B and S and 1/2/3 threads, each output NaN-poisoned
//! between guards.

mod common;

use common::{expected_bytes, jit, lengths, random_x, run_jit, run_reference, spec};
use kvjit_core::DType;
use kvjit_op::checks::StepDims;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

#[test]
fn random_batches_pick_each_last_valid_row_bit_for_bit() {
    let mut rng = SmallRng::seed_from_u64(91);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for hidden in [1, 2, 3, 5, 8, 13, 16, 33, 64, 67, 130] {
            for (batch, seq) in [(1, 1), (2, 3), (5, 7), (9, 2)] {
                let x = random_x(&mut rng, dtype, &[batch, seq, hidden]);
                // The first sequence empty, the last full, the rest random.
                let mut valid: Vec<u32> = (0..batch).map(|_| rng.gen_range(0..=seq as u32)).collect();
                valid[0] = 0;
                valid[batch - 1] = seq as u32;
                let valid = lengths(&valid);
                let want = expected_bytes(&x, &valid);
                let what = format!("{dtype} h{hidden} [{batch}, {seq}] valid {valid:?}");
                let reference = run_reference(spec(dtype, hidden, StepDims::ANY), &x, &valid);
                assert_eq!(reference.as_bytes(), want, "reference, {what}");
                for step in [StepDims::ANY, StepDims::fixed(batch, seq)] {
                    let kernel = jit(spec(dtype, hidden, step));
                    for threads in [1, 2, 3] {
                        let got = run_jit(&kernel, &x, &valid, threads);
                        assert_eq!(got.as_bytes(), want, "JIT, {what}, {step:?}, {threads} threads");
                    }
                }
            }
        }
    }
}

/// One generic kernel serves batches of any B and S.
#[test]
fn one_generic_kernel_serves_every_batch() {
    let mut rng = SmallRng::seed_from_u64(92);
    let kernel = jit(spec(DType::BF16, 40, StepDims::ANY));
    for (batch, seq) in [(1, 50), (4, 1), (3, 17), (16, 5)] {
        let x = random_x(&mut rng, DType::BF16, &[batch, seq, 40]);
        let valid = lengths(&(0..batch).map(|_| rng.gen_range(0..=seq as u32)).collect::<Vec<_>>());
        assert_eq!(run_jit(&kernel, &x, &valid, 2).as_bytes(), expected_bytes(&x, &valid), "[{batch}, {seq}]");
    }
}
