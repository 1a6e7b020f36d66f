//! Weights in the block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), kept
//! quantized and decoded by the kernels as they read: every format × tier
//! × row count × K (block multiples, N with a narrower last panel) against
//! the f64 product of the dequantized weights, every epilogue, the packed
//! weight taken back from an artifact, any thread count giving the same
//! bits, and the refusals.
//!
//! The tolerance is the arithmetic's own: the f32 accumulation bound every
//! matmul test uses, plus — where the 256-bit tier streams one row through
//! its integer GEMV, on activations rounded to 16-bit integers per block of
//! 32 — the most that rounding can move each element (half a step,
//! `max|x_b|/32258`, of each block's activation scale times the block's
//! `Σ|w|`, [`activation_rounding_bound`]), carried through the epilogue
//! like the accumulation error.

mod common;

use std::sync::Arc;

use common::*;
use kvjit_core::{CodeTier, DType, Tensor};
use kvjit_graph::{Dim, GraphBuilder};
use kvjit_op::gemm::WeightOrientation;
use kvjit_op_matmul::{Epilogue, MatmulParams, MatmulSpec, matmul};
use kvjit_testkit::blocks::{activation_rounding_bound, random_blocks};
use rand::SeedableRng;

/// K values for `format`: one block, several, and (32-weight blocks) a
/// count that is not a multiple of the 256-value k block.
fn ks(format: DType) -> Vec<usize> {
    let block = format.block().0;
    if block == 32 { vec![32, 96, 288, 544] } else { vec![256, 512] }
}

fn block_spec(format: DType, dtype: DType, tier: CodeTier, k: usize, n: usize, rows: Option<usize>) -> MatmulSpec {
    MatmulSpec { weights: format, ..spec(Epilogue::None, dtype, tier, WeightOrientation::NK, (k, n), rows) }
}

/// Whether a call of `rows` rows goes through the integer GEMV (one per
/// row, on activations quantized per block).
fn integer_route(spec: &MatmulSpec, rows: usize) -> bool {
    spec.tier().is_some_and(|tier| kvjit_op::gemm::gemv_per_row(tier, spec.weights, rows))
}

/// [`check_close`] with the integer GEMV's activation rounding added to
/// each GEMM's error where the call took that route.
fn assert_block_close(spec: &MatmulSpec, inputs: &Inputs, got: &Tensor, want: &Tensor, what: &str) {
    let rows = inputs.a.numel() / spec.k();
    let mut terms = terms(spec, inputs);
    if integer_route(spec, rows) {
        let a = inputs.a.to_f32_vec().unwrap();
        let weights: Vec<Vec<f32>> = inputs.weights.iter().map(|w| w.to_f32_vec().unwrap()).collect();
        let per_k = kvjit_testkit::tolerance::F32_TOL_PER_K * spec.k() as f64;
        for (i, t) in terms.iter_mut().enumerate() {
            let (r, col) = (i / spec.n, i % spec.n);
            let row = &a[r * spec.k()..][..spec.k()];
            let rounding = |w: &[f32]| activation_rounding_bound(row, &w[col * spec.k()..][..spec.k()]) * 1.01;
            // The bound scales Σ|a·w| by per_k: grow it by the rounding.
            t.abs_sum += rounding(&weights[0]) / per_k;
            if spec.epilogue == Epilogue::SwiGlu {
                t.abs_sum_up += rounding(&weights[1]) / per_k;
            }
        }
    }
    let (g, w) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
    for (i, ((&g, &w), t)) in g.iter().zip(&w).zip(&terms).enumerate() {
        let (g, w) = (f64::from(g), f64::from(w));
        let allowed = bound(spec, t, g, w);
        assert!(
            (g - w).abs() <= allowed,
            "{what}: [{}, {}] = {g}, reference {w}: error {:e} > allowed {allowed:e}",
            i / spec.n,
            i % spec.n,
            (g - w).abs()
        );
    }
}

fn block_inputs(rng: &mut impl rand::Rng, spec: &MatmulSpec, rows: usize) -> Inputs {
    let a = random(rng, spec.dtype, &[rows, spec.k()]);
    let weights = (0..spec.epilogue.weights()).map(|_| random_blocks(spec.weights, spec.n, spec.k(), rng)).collect();
    let other = spec.epilogue.has_operand().then(|| random(rng, spec.dtype, &[rows, spec.n]));
    Inputs { a, weights, other }
}

#[test]
fn every_format_tier_row_count_and_k_matches_the_f64_product() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(24);
    let n = 40; // two panels of 16 and a narrower one (five of 8 on Cranelift)
    for format in DType::BLOCK_FORMATS {
        for tier in tiers() {
            for k in ks(format) {
                // A few rows run an integer GEMV per row (per format and
                // CPU: `gemv_rows`, 4 to 191), more decode k blocks for row
                // tiles (each limit and the row past it); 197 is a full
                // block of 192 and a short one.
                for rows in [1, 2, 4, 5, 8, 9, 16, 17, 64, 65, 191, 192, 197] {
                    for (dtype, baked) in [(DType::F32, true), (DType::F32, false), (DType::BF16, true)] {
                        let spec = block_spec(format, dtype, tier, k, n, baked.then_some(rows));
                        let inputs = block_inputs(&mut rng, &spec, rows);
                        let jit = Jit::new(spec, Some(inputs.weights.iter().cloned().map(Arc::new).collect()));
                        let tensors = inputs.tensors();
                        let got = run_jit(&jit, &tensors, &[rows, n], 2);
                        let want = run_reference(spec, &tensors, &[rows, n]);
                        assert_block_close(&spec, &inputs, &got, &want, &format!("{} rows {rows}", name(&spec)));
                        // A call passing other (uncached) weights packs them itself.
                        let other = block_inputs(&mut rng, &spec, rows);
                        let got = run_jit(&jit, &other.tensors(), &[rows, n], 1);
                        let want = run_reference(spec, &other.tensors(), &[rows, n]);
                        assert_block_close(&spec, &other, &got, &want, &format!("{} per-call weights", name(&spec)));
                    }
                }
            }
        }
    }
}

#[test]
fn every_epilogue_reads_block_weights() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(25);
    for tier in tiers() {
        for format in [DType::Q4_1, DType::Q6K] {
            for epilogue in EPILOGUES {
                for rows in [1, 6] {
                    let k = format.block().0 * 2;
                    let spec = MatmulSpec { epilogue, ..block_spec(format, DType::F32, tier, k, 24, Some(rows)) };
                    let inputs = block_inputs(&mut rng, &spec, rows);
                    let jit = Jit::new(spec, Some(inputs.weights.iter().cloned().map(Arc::new).collect()));
                    let got = run_jit(&jit, &inputs.tensors(), &[rows, 24], 2);
                    let want = run_reference(spec, &inputs.tensors(), &[rows, 24]);
                    assert_block_close(&spec, &inputs, &got, &want, &name(&spec));
                }
            }
        }
    }
}

#[test]
fn the_packed_blocks_come_back_from_an_artifact_and_any_thread_count_gives_the_same_bits() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(26);
    for tier in tiers() {
        for format in DType::BLOCK_FORMATS {
            let k = format.block().0 * 2;
            for rows in [1, 8] {
                let spec = block_spec(format, DType::F32, tier, k, 72, Some(rows));
                let inputs = block_inputs(&mut rng, &spec, rows);
                let jit = Jit::new(spec, Some(inputs.weights.iter().cloned().map(Arc::new).collect()));
                let one = run_jit(&jit, &inputs.tensors(), &[rows, 72], 1);
                for threads in [2, 3, 5] {
                    let again = run_jit(&jit, &inputs.tensors(), &[rows, 72], threads);
                    assert_same_bytes(&again, &one, &format!("{} on {threads} threads", name(&spec)));
                }
                let [(index, prepared)] = jit.prepared_constants().try_into().unwrap();
                assert_eq!(index, 1);
                // Block panels on the 256-bit tier keep the format's bytes
                // (padding panels aside); the Cranelift tier's are f32.
                let want_dtype = if tier == CodeTier::Avx2 { format } else { DType::F32 };
                assert_eq!(prepared.data.dtype(), want_dtype, "{}", name(&spec));
                // Through a safetensors file, as an artifact stores it.
                let bytes = kvjit_core::tensors_to_safetensors([("w", &*prepared.data)]).unwrap();
                let data = kvjit_core::tensors_from_safetensors(&bytes).unwrap().remove("w").unwrap();
                let prepared = kvjit_core::PreparedConstant { layout: prepared.layout.clone(), data: Arc::new(data) };
                let loaded = Jit::with_prepared(spec, &prepared).unwrap();
                let tensors = [&inputs.a, &*prepared.data];
                assert_same_bytes(&run_jit(&loaded, &tensors, &[rows, 72], 2), &one, "from the artifact");
            }
        }
    }
}

#[test]
fn keys_name_the_weight_format() {
    let spec = block_spec(DType::Q4_1, DType::F32, CodeTier::Cranelift, 64, 16, Some(1));
    let key = name(&spec);
    assert!(key.ends_with(".tb1.wq4_1"), "{key}");
    let plain = MatmulSpec { weights: DType::F32, ..spec };
    assert!(!name(&plain).contains(".w"), "{}", name(&plain));
}

#[test]
fn block_weights_are_refused_where_they_cannot_be_read() {
    let registry = registry();
    let mut rng = rand::rngs::StdRng::seed_from_u64(27);
    let build = |format: DType, k: usize, transpose_b: bool, weight_shape: [usize; 2]| {
        let mut b = GraphBuilder::new("g", &registry);
        let a = b.input("a", DType::F32, &[Dim::Static(1), Dim::Static(k)]).unwrap();
        let w = b.constant("w", Tensor::zeros(format, &weight_shape).unwrap()).unwrap();
        matmul(&mut b, a, w, MatmulParams { transpose_b }).map(drop).map_err(|e| e.to_string())
    };
    // [N, K] of whole blocks: accepted.
    build(DType::Q4_1, 64, true, [8, 64]).unwrap();
    // [K, N] blocks run along N: refused naming the formats.
    let err = build(DType::Q4_1, 64, false, [64, 32]).unwrap_err();
    assert!(err.contains("transpose_b = false"), "{err}");
    // K disagreeing with a: refused.
    let err = build(DType::Q8_0, 96, true, [8, 64]).unwrap_err();
    assert!(err.contains("q4_1") || err.contains("q8_0"), "{err}");
    // A call whose weight is another format than the kernel reads is refused before anything is written.
    let spec = block_spec(DType::Q4_0, DType::F32, CodeTier::Cranelift, 64, 16, Some(1));
    let jit = Jit::new(spec, None);
    let a = random(&mut rng, DType::F32, &[1, 64]);
    let wrong = random_blocks(DType::Q4_1, 16, 64, &mut rng);
    let mut out = vec![0xAAu8; 16 * 4];
    let err = jit.run_into(&[&a, &wrong], &mut out, &ctx(1)).unwrap_err().to_string();
    assert!(err.contains("q4_0") && err.contains("q4_1"), "{err}");
    assert!(out.iter().all(|&b| b == 0xAA), "nothing written");
    // Rows of a block tensor must be whole blocks.
    assert!(Tensor::zeros(DType::Q4K, &[4, 300]).is_err());
}
