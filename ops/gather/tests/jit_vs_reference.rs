//! The JIT against the reference, bit for bit, and both against the rows
//! indexed in the test: random tables (random bit patterns) over dtypes,
//! row lengths with every tail (16-byte vectors, 8/4/2-byte pieces, rows
//! longer than the 64-byte loop step), batch shapes, baked and run-time B
//! and S and 1/2/3 threads, each output NaN-poisoned between guards.

mod common;

use common::{expected_bytes, jit, random_ids, random_table, run_jit, run_reference, spec};
use kvjit_core::DType;
use kvjit_op::checks::StepDims;
use rand::SeedableRng;
use rand::rngs::SmallRng;

#[test]
fn random_tables_and_ids_are_copied_bit_for_bit() {
    let mut rng = SmallRng::seed_from_u64(61);
    let vocab = 37;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for hidden in [1, 2, 3, 4, 7, 8, 13, 16, 33, 64, 67, 130] {
            let table = random_table(&mut rng, dtype, vocab, hidden);
            for (batch, seq) in [(1, 1), (2, 3), (3, 7), (1, 40)] {
                let ids = random_ids(&mut rng, vocab, batch, seq);
                let want = expected_bytes(&table, &ids);
                let reference = run_reference(spec(dtype, vocab, hidden, StepDims::ANY), &table, &ids);
                assert_eq!(reference.as_bytes(), want, "reference, {dtype} h{hidden} [{batch}, {seq}]");
                for step in [StepDims::ANY, StepDims::fixed(batch, seq)] {
                    let kernel = jit(spec(dtype, vocab, hidden, step));
                    for threads in [1, 2, 3] {
                        let got = run_jit(&kernel, &table, &ids, threads);
                        assert_eq!(got.as_bytes(), want, "JIT, {dtype} h{hidden} [{batch}, {seq}] {step:?} {threads}t");
                    }
                }
            }
        }
    }
}

/// Every id of a table, including the first and last rows, in one batch.
#[test]
fn every_row_of_the_table_is_reachable() {
    let mut rng = SmallRng::seed_from_u64(62);
    let (vocab, hidden) = (300, 24);
    let table = random_table(&mut rng, DType::BF16, vocab, hidden);
    let ids: Vec<u32> = (0..vocab as u32).rev().collect();
    let ids = kvjit_core::Tensor::from_vec(&[3, 100], ids).unwrap();
    let got = run_jit(&jit(spec(DType::BF16, vocab, hidden, StepDims::ANY)), &table, &ids, 3);
    assert_eq!(got.as_bytes(), expected_bytes(&table, &ids));
}
