//! Tables in the weight block formats, decoded on gather: every format ×
//! output dtype × row width, the JIT bit for bit against the reference and
//! both against rows dequantized in the test with the one definition of
//! the blocks (`kvjit_core::quant::dequantize`), rounded to the output's
//! dtype; refusals at specialize.

mod common;

use std::sync::Arc;

use common::{ctx, jit, random_ids};
use kvjit_core::{DType, Target, Tensor, bf16, f16};
use kvjit_graph::{Dim, GraphBuilder, OpRegistry};
use kvjit_op::checks::StepDims;
use kvjit_op::{Compiled, Defined};
use kvjit_op_gather::{GatherOp, GatherSpec, ReferenceKernel, gather_as};
use kvjit_runtime::Kernel;
use kvjit_testkit::blocks::random_blocks;
use kvjit_testkit::{Guarded, nan_bytes, poison};
use rand::SeedableRng;
use rand::rngs::SmallRng;

fn spec(table: DType, dtype: DType, vocab: usize, hidden: usize, step: StepDims) -> GatherSpec {
    GatherSpec { target: Target::Cpu, dtype, table, vocab, hidden, step }
}

/// Row `ids[r]` of `table` dequantized and rounded to `dtype`, as bytes.
fn expected(table: &Tensor, ids: &Tensor, dtype: DType) -> Vec<u8> {
    let hidden = table.shape()[1];
    let row_bytes = table.dtype().storage_bytes(hidden).unwrap();
    let mut values = vec![0f32; hidden];
    let mut out = Vec::new();
    for &id in ids.as_slice::<u32>().unwrap() {
        let row = &table.as_bytes()[id as usize * row_bytes..][..row_bytes];
        kvjit_core::quant::dequantize(table.dtype(), row, &mut values).unwrap();
        for &v in &values {
            match dtype {
                DType::F32 => out.extend(v.to_le_bytes()),
                DType::BF16 => out.extend(bf16::from_f32(v).to_le_bytes()),
                _ => out.extend(f16::from_f32(v).to_le_bytes()),
            }
        }
    }
    out
}

#[test]
fn block_rows_decode_bit_for_bit_into_every_output_dtype() {
    let mut rng = SmallRng::seed_from_u64(63);
    let vocab = 19;
    for format in DType::BLOCK_FORMATS {
        let block = format.block().0;
        for hidden in [block, 3 * block] {
            let table = random_blocks(format, vocab, hidden, &mut rng);
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                for (batch, seq) in [(1, 1), (2, 5)] {
                    let ids = random_ids(&mut rng, vocab, batch, seq);
                    let want = expected(&table, &ids, dtype);
                    let shape = [batch, seq, hidden];
                    let what = format!("{format} h{hidden} -> {dtype} [{batch}, {seq}]");
                    let reference =
                        Compiled::new(ReferenceKernel::new(spec(format, dtype, vocab, hidden, StepDims::ANY)));
                    let mut out = Tensor::zeros(dtype, &shape).unwrap();
                    poison(&mut out);
                    reference.run(&[&table, &ids], &mut [], std::slice::from_mut(&mut out), &ctx(1)).unwrap();
                    assert_eq!(out.as_bytes(), want, "reference, {what}");
                    for step in [StepDims::ANY, StepDims::fixed(batch, seq)] {
                        let kernel = jit(spec(format, dtype, vocab, hidden, step));
                        for threads in [1, 3] {
                            let mut out = Guarded::new(64, &nan_bytes(dtype, batch * seq * hidden), 64);
                            kernel.run_into(&[&table, &ids], &mut [], out.body_mut(), &ctx(threads)).unwrap();
                            out.assert_guards(&what);
                            assert_eq!(out.body(), want, "JIT, {what} {step:?} {threads} threads");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn block_tables_are_specialized_with_their_output_dtype_and_refused_when_it_cannot_be() {
    let mut registry = OpRegistry::new();
    registry.register(Arc::new(Defined(GatherOp))).unwrap();
    let mut rng = SmallRng::seed_from_u64(64);
    let build = |table: Tensor, dtype: Option<DType>| {
        let mut b = GraphBuilder::new("g", &registry);
        let ids = b.input("ids", DType::U32, &[Dim::Static(1), Dim::from("seq")]).unwrap();
        let table = b.constant("table", table).unwrap();
        let out = gather_as(&mut b, table, ids, dtype).map_err(|e| e.to_string())?;
        b.output("out", out).unwrap();
        Ok::<_, String>(b.finish().unwrap().value(out).ty.to_string())
    };
    let q8 = || random_blocks(DType::Q8_0, 4, 64, &mut SmallRng::seed_from_u64(1));
    assert!(build(q8(), None).unwrap().contains("f32"), "decodes to f32 by default");
    assert!(build(q8(), Some(DType::BF16)).unwrap().contains("bf16"));
    let err = build(q8(), Some(DType::U32)).unwrap_err();
    assert!(err.contains("f32, bf16 or f16"), "{err}");
    // A float table's output is its own dtype.
    let plain = Tensor::random(DType::F32, &[4, 8], &mut rng, -1.0, 1.0).unwrap();
    let err = build(plain, Some(DType::BF16)).unwrap_err();
    assert!(err.contains("f32"), "{err}");
    // The key names the table's format.
    use kvjit_core::KernelSpec;
    let key = spec(DType::Q4K, DType::F32, 10, 256, StepDims::ANY).key().to_string();
    assert!(key.ends_with(".wq4_k"), "{key}");
}
