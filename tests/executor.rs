//! The executor end to end: multi-step runs against the reference, every
//! input error typed and leaving the caches byte-for-byte unchanged, compile
//! errors, shape specialization, and one executable shared by two caches.

mod common;

use std::collections::BTreeMap;

use common::{chain_graph, chain_graph_with, compile_cpu, executor, reference_run, run_ok, small_graph};
use kvjit::scenario::Scenario;
use kvjit::{
    CompileOptions, DType, DeviceContextPtr, Error, Executable, GraphError, KvCacheParams, PagedKVCacheCollection,
    RuntimeError, Target, Tensor, UNASSIGNED_PAGE, compile, standard_registry,
};
use kvjit_testkit::{Caches, Tensors, assert_caches_identical, assert_outputs_identical};

/// Run expecting failure; the caches must come back byte-identical.
fn run_err(exe: &Executable, inputs: &Tensors, caches: &mut Caches) -> RuntimeError {
    let before = caches.clone();
    let err = match executor().run(exe, inputs, caches) {
        Ok(_) => panic!("the run succeeded"),
        Err(e) => e,
    };
    assert_caches_identical(caches, &before);
    err
}

fn assert_message(error: &impl std::fmt::Display, parts: &[&str]) {
    let message = error.to_string();
    for part in parts {
        assert!(message.contains(part), "message {message:?} does not mention {part:?}");
    }
}

/// The small graph compiled without bindings, and a prefill scenario for it.
fn small_setup(seed: u64) -> (Executable, Scenario) {
    let registry = standard_registry();
    let graph = small_graph(&registry);
    let exe = compile_cpu(&graph, &registry);
    let scenario = Scenario::prefill(&graph, seed).unwrap();
    (exe, scenario)
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

// ---------------------------------------------------------------- multi-step

#[test]
fn prefill_then_three_decode_steps_write_what_the_reference_writes() {
    let registry = standard_registry();
    let graph = small_graph(&registry);
    let exe = compile_cpu(&graph, &registry);
    let mut scenario = Scenario::prefill(&graph, 42).unwrap();
    for step in 0..4 {
        if step > 0 {
            scenario.next_decode_step().unwrap();
            assert_eq!(scenario.inputs["hidden_state"].shape(), [4, 1, 64]);
        }
        let valid = scenario.inputs["valid_lengths"].to_u32_vec().unwrap();
        if step > 0 {
            assert_eq!(valid, [1, 1, 1, 1], "decode writes one token per sequence");
        } else {
            assert_eq!(valid[0], 8, "prefill: the first sequence fills the padding");
        }
        let lengths_before = scenario.caches["kv_cache"].cache_lengths().to_vec();

        let mut expected_caches = scenario.caches.clone();
        let expected = reference_run(&graph, &scenario.inputs, &mut expected_caches);
        let out = run_ok(&exe, &scenario.inputs, &mut scenario.caches);
        assert_outputs_identical(&out.outputs, &expected);
        assert_caches_identical(&scenario.caches, &expected_caches);
        assert_eq!(out.timings.iter().map(|t| exe.steps()[t.step].label.as_str()).collect::<Vec<_>>(), ["n0", "n1"]);

        assert_eq!(scenario.caches["kv_cache"].cache_lengths(), lengths_before, "a run does not advance the cache");
        scenario.advance().unwrap();
        expected_caches.get_mut("kv_cache").unwrap().advance(&valid).unwrap();
        let cache = &scenario.caches["kv_cache"];
        let want = &expected_caches["kv_cache"];
        let grown: Vec<u32> = lengths_before.iter().zip(&valid).map(|(l, v)| l + v).collect();
        assert_eq!(cache.cache_lengths(), grown, "step {step}");
        for layer in 0..2 {
            for (b, (&start, &count)) in lengths_before.iter().zip(&valid).enumerate() {
                for pos in start as usize..(start + count) as usize {
                    let (k, v) = cache.read_token(layer, b, pos).unwrap();
                    let (want_k, want_v) = want.read_token(layer, b, pos).unwrap();
                    assert_eq!(bits(&k), bits(&want_k), "K, step {step} layer {layer} b {b} pos {pos}");
                    assert_eq!(bits(&v), bits(&want_v), "V, step {step} layer {layer} b {b} pos {pos}");
                }
            }
        }
    }
}

// ---------------------------------------------------------------- input errors

#[test]
fn a_missing_input_is_named_with_its_type() {
    let (exe, mut s) = small_setup(1);
    s.inputs.remove("valid_lengths");
    let err = run_err(&exe, &s.inputs, &mut s.caches);
    assert!(
        matches!(&err, RuntimeError::MissingInput { name, expected }
            if name == "valid_lengths" && expected == "u32[batch]"),
        "{err:?}"
    );
    assert_message(&err, &["missing input 'valid_lengths' (u32[batch])"]);
}

#[test]
fn an_input_of_the_wrong_dtype_is_rejected() {
    let (exe, mut s) = small_setup(2);
    let hidden = s.inputs["hidden_state"].to_f32_vec().unwrap();
    let shape = s.inputs["hidden_state"].shape().to_vec();
    s.inputs.insert("hidden_state".into(), Tensor::from_f32(DType::BF16, &shape, &hidden).unwrap());
    let err = run_err(&exe, &s.inputs, &mut s.caches);
    assert!(
        matches!(&err, RuntimeError::InputDType { name, expected: DType::F32, got: DType::BF16 }
            if name == "hidden_state"),
        "{err:?}"
    );
    assert_message(&err, &["input 'hidden_state': expected dtype f32, got bf16"]);

    let (exe, mut s) = small_setup(2);
    s.inputs.insert("layers.0.layer_idx".into(), Tensor::from_f32(DType::F32, &[], &[0.0]).unwrap());
    let err = run_err(&exe, &s.inputs, &mut s.caches);
    assert!(matches!(err, RuntimeError::InputDType { .. }), "{err:?}");
}

#[test]
fn a_wrong_static_dim_or_rank_is_an_input_shape_error() {
    let (exe, mut s) = small_setup(3);
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(0);
    s.inputs.insert("hidden_state".into(), Tensor::random(DType::F32, &[4, 8, 63], &mut rng, -1.0, 1.0).unwrap());
    let err = run_err(&exe, &s.inputs, &mut s.caches);
    assert!(
        matches!(&err, RuntimeError::InputShape { name, expected, got }
            if name == "hidden_state" && expected == "[batch, seq, 64]" && got == &[4, 8, 63]),
        "{err:?}"
    );
    assert_message(&err, &["input 'hidden_state': expected shape [batch, seq, 64], got [4, 8, 63]"]);

    let (exe, mut s) = small_setup(3);
    s.inputs.insert("layers.1.layer_idx".into(), Tensor::from_vec(&[1, 1], vec![1u32]).unwrap());
    let err = run_err(&exe, &s.inputs, &mut s.caches);
    assert!(matches!(&err, RuntimeError::InputShape { name, .. } if name == "layers.1.layer_idx"), "{err:?}");
}

#[test]
fn inputs_that_disagree_on_a_symbol_are_a_symbol_conflict() {
    let (exe, mut s) = small_setup(4);
    s.inputs.insert("valid_lengths".into(), Tensor::from_vec(&[3], vec![1u32, 1, 1]).unwrap());
    let err = run_err(&exe, &s.inputs, &mut s.caches);
    match &err {
        RuntimeError::SymbolConflict { symbol, first, first_from, second, second_from } => {
            assert_eq!(symbol, "batch");
            assert_eq!((*first, first_from.as_str()), (4, "hidden_state axis 0"));
            assert_eq!((*second, second_from.as_str()), (3, "valid_lengths axis 0"));
        }
        other => panic!("expected SymbolConflict, got {other:?}"),
    }
    assert_message(&err, &["symbol 'batch' is 4 from hidden_state axis 0 but 3 from valid_lengths axis 0"]);

    // The cache's batch is the same symbol.
    let registry = standard_registry();
    let graph = small_graph(&registry);
    let two = Scenario::prefill_with(&graph, 4, 2, 8).unwrap();
    let (exe, mut four) = small_setup(4);
    let err = run_err(&exe, &two.inputs, &mut four.caches);
    assert!(
        matches!(&err, RuntimeError::SymbolConflict { symbol, first: 2, second: 4, second_from, .. }
            if symbol == "batch" && second_from == "cache kv_cache batch"),
        "{err:?}"
    );
}

#[test]
fn an_input_the_graph_does_not_take_is_rejected_with_the_names_it_takes() {
    let (exe, mut s) = small_setup(5);
    s.inputs.insert("temperature".into(), Tensor::scalar_u32(1));
    let err = run_err(&exe, &s.inputs, &mut s.caches);
    match &err {
        RuntimeError::UnexpectedInput { name, known } => {
            assert_eq!(name, "temperature");
            for expected in ["hidden_state", "valid_lengths", "layers.1.layer_idx", "kv_cache"] {
                assert!(known.contains(expected), "{known}");
            }
        }
        other => panic!("expected UnexpectedInput, got {other:?}"),
    }
    assert_message(&err, &["'temperature' is not an input or KV cache of this graph"]);

    // A cache under a name the graph does not know.
    let (exe, mut s) = small_setup(5);
    let cache = s.caches.remove("kv_cache").unwrap();
    s.caches.insert("kv".into(), cache);
    let err = run_err(&exe, &s.inputs, &mut s.caches);
    assert!(matches!(&err, RuntimeError::UnexpectedInput { name, .. } if name == "kv"), "{err:?}");
}

#[test]
fn a_tensor_supplied_under_the_cache_name_is_rejected() {
    let (exe, mut s) = small_setup(5);
    s.inputs.insert("kv_cache".into(), Tensor::scalar_u32(0));
    let err = run_err(&exe, &s.inputs, &mut s.caches);
    assert!(matches!(&err, RuntimeError::UnexpectedInput { name, .. } if name == "kv_cache"), "{err:?}");
}

#[test]
fn a_missing_cache_is_named() {
    let (exe, s) = small_setup(6);
    let err = run_err(&exe, &s.inputs, &mut BTreeMap::new());
    assert!(matches!(&err, RuntimeError::MissingCache(name) if name == "kv_cache"), "{err:?}");
    assert_message(&err, &["missing KV cache 'kv_cache'"]);
}

#[test]
fn a_cache_with_another_layout_is_a_cache_mismatch() {
    let (exe, s) = small_setup(7);
    let params = *s.caches["kv_cache"].params();
    let cases = [
        (KvCacheParams { page_size: 8, ..params }, 48, "layout is"),
        (KvCacheParams { element: kvjit::CacheElement::BF16, ..params }, 48, "layout is"),
        (KvCacheParams { num_layers: 3, ..params }, 48, "layout is"),
        (params, 40, "num_pages is 40, the graph expects 48"),
    ];
    for (params, pages, problem) in cases {
        let mut caches: Caches =
            [("kv_cache".to_string(), PagedKVCacheCollection::new(params, pages, 4, 16).unwrap())].into();
        let err = run_err(&exe, &s.inputs, &mut caches);
        match &err {
            RuntimeError::CacheMismatch { name, problem: p } => {
                assert_eq!(name, "kv_cache");
                assert!(p.contains(problem), "{p}");
            }
            other => panic!("{params:?} with {pages} pages: expected CacheMismatch, got {other:?}"),
        }
        assert_message(&err, &["KV cache 'kv_cache'", problem]);
    }
}

#[test]
fn a_bad_second_node_stops_the_run_before_the_first_node_writes() {
    let registry = standard_registry();
    let graph = small_graph(&registry);
    let exe = compile_cpu(&graph, &registry);
    for (input, node) in [("layers.1.layer_idx", "n1"), ("layers.0.layer_idx", "n0")] {
        let mut s = Scenario::prefill(&graph, 8).unwrap();
        let good = s.inputs[input].clone();
        s.inputs.insert(input.into(), Tensor::scalar_u32(5));
        // run_err checks that neither node wrote the cache.
        let err = run_err(&exe, &s.inputs, &mut s.caches);
        match &err {
            RuntimeError::Kernel { step, key, source } => {
                assert_eq!(step, node);
                let tier = kvjit::widest_cpu_tier();
                assert!(key.starts_with(&format!("fused_qkv_bshd_paged.cpu-{tier}.f32.")), "{key}");
                assert!(
                    matches!(source, kvjit_core::Error::LayerOutOfRange { layer_idx: 5, num_layers: 2 }),
                    "{source:?}"
                );
            }
            other => panic!("expected a kernel error, got {other:?}"),
        }
        assert_message(
            &err,
            &[&format!("node {node} (fused_qkv_bshd_paged."), "layer_idx 5 out of range: cache has 2 layers"],
        );

        // The failed run left nothing behind: fixing the input gives the
        // reference result.
        s.inputs.insert(input.into(), good);
        let mut expected_caches = s.caches.clone();
        let expected = reference_run(&graph, &s.inputs, &mut expected_caches);
        let out = run_ok(&exe, &s.inputs, &mut s.caches);
        assert_outputs_identical(&out.outputs, &expected);
        assert_caches_identical(&s.caches, &expected_caches);
    }
}

#[test]
fn other_kernel_rejections_write_nothing() {
    // A valid length beyond the padded seq_len.
    let (exe, mut s) = small_setup(9);
    s.inputs.insert("valid_lengths".into(), Tensor::from_vec(&[4], vec![8u32, 9, 1, 1]).unwrap());
    let err = run_err(&exe, &s.inputs, &mut s.caches);
    assert!(
        matches!(
            &err,
            RuntimeError::Kernel {
                source: kvjit_core::Error::ValidLengthTooLong { batch: 1, valid_length: 9, seq_len: 8 },
                ..
            }
        ),
        "{err:?}"
    );

    // A page the step needs that was never assigned.
    let (exe, mut s) = small_setup(9);
    let last = {
        let cache = &s.caches["kv_cache"];
        let valid = s.inputs["valid_lengths"].to_u32_vec().unwrap();
        (cache.cache_lengths()[0] + valid[0] - 1) as usize / cache.params().page_size
    };
    s.caches.get_mut("kv_cache").unwrap().lookup_table_mut()[last] = UNASSIGNED_PAGE;
    let err = run_err(&exe, &s.inputs, &mut s.caches);
    assert!(
        matches!(&err, RuntimeError::Kernel { source: kvjit_core::Error::PhysicalPageOutOfRange { batch: 0, .. }, .. }),
        "{err:?}"
    );
}

#[test]
fn a_bad_node_after_a_dependency_stops_the_run_before_anything_is_written() {
    let registry = standard_registry();
    let scenario = Scenario::prefill(&chain_graph(&registry, DType::F32), 10).unwrap();
    let graph = chain_graph_with(&registry, DType::F32, true);
    let exe = compile_cpu(&graph, &registry);
    let mut inputs = scenario.inputs.clone();
    let mut caches = scenario.caches.clone();
    inputs.insert("layers.1.layer_idx".into(), Tensor::scalar_u32(1));
    // The graph runs with a good layer index...
    let mut expected_caches = caches.clone();
    let expected = reference_run(&graph, &inputs, &mut expected_caches);
    let mut good_run = caches.clone();
    let out = run_ok(&exe, &inputs, &mut good_run);
    assert_outputs_identical(&out.outputs, &expected);
    assert_caches_identical(&good_run, &expected_caches);
    // ...and a bad one for the second node must leave the cache untouched.
    inputs.insert("layers.1.layer_idx".into(), Tensor::scalar_u32(7));
    let err = run_err(&exe, &inputs, &mut caches);
    assert!(matches!(&err, RuntimeError::Kernel { step, .. } if step == "n1"), "{err:?}");
}

// ---------------------------------------------------------------- compile errors

#[test]
fn the_cuda_target_is_a_typed_unavailable_error() {
    let registry = standard_registry();
    let graph = small_graph(&registry);
    if kvjit_runtime::cuda_availability().is_ok() {
        eprintln!("skipped: a CUDA device is present, so the CUDA target is available");
        return;
    }
    let options = CompileOptions { target: Target::Cuda, ..CompileOptions::default() };
    let err = match compile(&graph, &registry, &options) {
        Ok(_) => panic!("no CUDA device here, yet the CUDA target compiled"),
        Err(e) => e,
    };
    assert!(matches!(err, Error::Runtime(RuntimeError::TargetUnavailable { target: Target::Cuda, .. })), "{err:?}");
    assert!(err.to_string().starts_with("CUDA target unavailable:"), "{err}");
    let err = DeviceContextPtr::for_target(Target::Cuda, 1).unwrap_err();
    assert!(err.to_string().starts_with("CUDA target unavailable:"), "{err}");
}

#[test]
fn binding_an_unknown_symbol_or_zero_is_a_binding_error() {
    let registry = standard_registry();
    let graph = small_graph(&registry);
    for (symbol, size, problem) in [
        ("heads", 2, "is not a symbol of this graph (its symbols: batch, seq)"),
        ("seq", 0, "must be bound to at least 1"),
    ] {
        let options = CompileOptions { bindings: [(symbol.to_string(), size)].into(), ..common::reference_options() };
        let err = match compile(&graph, &registry, &options) {
            Ok(_) => panic!("{symbol}={size} was accepted"),
            Err(e) => e,
        };
        match &err {
            Error::Graph(GraphError::Binding { symbol: s, problem: p }) => {
                assert_eq!(s, symbol);
                assert_eq!(p, problem);
            }
            other => panic!("expected a binding error, got {other:?}"),
        }
        assert_message(&err, &[&format!("symbol '{symbol}': {problem}")]);
    }
}

#[test]
fn inputs_that_contradict_a_binding_are_an_input_shape_error() {
    let registry = standard_registry();
    let graph = small_graph(&registry);
    let options = CompileOptions { bindings: [("batch".to_string(), 3)].into(), ..common::reference_options() };
    let exe = compile(&graph, &registry, &options).unwrap();
    let mut four = Scenario::prefill(&graph, 11).unwrap();
    let err = run_err(&exe, &four.inputs, &mut four.caches);
    assert!(
        matches!(&err, RuntimeError::InputShape { name, expected, got }
            if name == "hidden_state" && expected == "[3, seq, 64]" && got == &[4, 8, 64]),
        "{err:?}"
    );

    let mut three = Scenario::prefill_with(&graph, 11, 3, 8).unwrap();
    let mut expected_caches = three.caches.clone();
    let expected = reference_run(&graph, &three.inputs, &mut expected_caches);
    let out = run_ok(&exe, &three.inputs, &mut three.caches);
    assert_outputs_identical(&out.outputs, &expected);
    assert_caches_identical(&three.caches, &expected_caches);
}

// ---------------------------------------------------------------- specialization

#[test]
fn bound_symbols_are_baked_into_kernel_keys_and_do_not_change_results() {
    let registry = standard_registry();
    let graph = small_graph(&registry);
    let generic = compile_cpu(&graph, &registry);
    let options = CompileOptions {
        bindings: [("batch".to_string(), 2), ("seq".to_string(), 5)].into(),
        ..common::reference_options()
    };
    let specialized = compile(&graph, &registry, &options).unwrap();
    let keys = |exe: &Executable| exe.steps().iter().map(|s| s.kernel.key().to_string()).collect::<Vec<_>>();
    // The JIT and the reference kernels carry the one key specialize made,
    // naming the CPU tier `auto` resolved to.
    let base = format!("fused_qkv_bshd_paged.cpu-{}.f32.k64.q64.hkv2.d16.p4.l2.kvf32", kvjit::widest_cpu_tier());
    assert_eq!(keys(&generic), vec![format!("{base}.bany.sany"); 2]);
    assert_eq!(keys(&specialized), vec![format!("{base}.b2.s5"); 2]);
    assert!(specialized.steps().iter().all(|s| s.kernel.key().is_fully_static()));
    assert!(!generic.steps()[0].kernel.key().is_fully_static());

    let seq_only = CompileOptions { bindings: [("seq".to_string(), 1)].into(), ..common::reference_options() };
    let decode = compile(&graph, &registry, &seq_only).unwrap();
    assert!(keys(&decode).iter().all(|k| k.ends_with(".bany.s1")));

    let scenario = Scenario::prefill_with(&graph, 12, 2, 5).unwrap();
    let (mut caches_generic, mut caches_specialized) = (scenario.caches.clone(), scenario.caches.clone());
    let out_generic = run_ok(&generic, &scenario.inputs, &mut caches_generic);
    let out_specialized = run_ok(&specialized, &scenario.inputs, &mut caches_specialized);
    assert_outputs_identical(&out_specialized.outputs, &out_generic.outputs);
    assert_caches_identical(&caches_specialized, &caches_generic);
    assert_eq!(
        out_specialized
            .timings
            .iter()
            .map(|t| specialized.steps()[t.step].kernel.key().to_string())
            .collect::<Vec<_>>(),
        keys(&specialized)
    );

    // The specialized kernels take only the bound shape.
    let other = Scenario::prefill_with(&graph, 12, 2, 6).unwrap();
    let err = run_err(&specialized, &other.inputs, &mut other.caches.clone());
    assert!(matches!(&err, RuntimeError::InputShape { expected, .. } if expected == "[2, 5, 64]"), "{err:?}");
}

// ---------------------------------------------------------------- sharing

/// Prefill and two decode steps; outputs and caches after each step.
fn steps_alone(exe: &Executable, mut scenario: Scenario) -> Vec<(Tensors, Caches)> {
    let mut results = Vec::new();
    for step in 0..3 {
        if step > 0 {
            scenario.advance().unwrap();
            scenario.next_decode_step().unwrap();
        }
        let out = run_ok(exe, &scenario.inputs, &mut scenario.caches);
        results.push((out.outputs, scenario.caches.clone()));
    }
    results
}

#[test]
fn one_executable_serves_two_caches_alternately() {
    let registry = standard_registry();
    let graph = small_graph(&registry);
    let exe = compile_cpu(&graph, &registry);
    let make_a = || Scenario::prefill(&graph, 13).unwrap();
    let make_b = || Scenario::prefill_with(&graph, 14, 3, 6).unwrap();
    let alone_a = steps_alone(&exe, make_a());
    let alone_b = steps_alone(&exe, make_b());

    let shared = executor();
    let (mut a, mut b) = (make_a(), make_b());
    for step in 0..3 {
        for (scenario, alone, name) in [(&mut a, &alone_a, "a"), (&mut b, &alone_b, "b")] {
            if step > 0 {
                scenario.advance().unwrap();
                scenario.next_decode_step().unwrap();
            }
            let out = shared
                .run(&exe, &scenario.inputs, &mut scenario.caches)
                .unwrap_or_else(|e| panic!("{name} step {step}: {e}"));
            assert_outputs_identical(&out.outputs, &alone[step].0);
            assert_caches_identical(&scenario.caches, &alone[step].1);
        }
    }
    // The two scenarios really are different problems.
    assert_ne!(alone_a[0].0["layers.0.q"].shape(), alone_b[0].0["layers.0.q"].shape());
}

// ---------------------------------------------------------------- buffer reuse

/// An executor makes each run's step outputs in the buffers its last run
/// left (zeroed first): a run of it must write exactly what a fresh
/// executor writes, whatever ran before it, and never touch outputs the
/// caller kept from an earlier run.
#[test]
fn a_reused_executor_writes_what_a_fresh_one_writes_and_leaves_kept_outputs_alone() {
    use kvjit::models::llama::{HIDDEN_STATE_OUT, LlamaConfig, decoder_layer_graph};
    let registry = standard_registry();
    let graph = decoder_layer_graph(&LlamaConfig::tiny(), registry.ops()).unwrap();
    let exe = compile(&graph, &registry, &CompileOptions::default()).unwrap();
    let reused = executor();
    let mut kept: Vec<(Tensor, Vec<f32>)> = Vec::new();
    // Prefill, two decode steps (same shapes: their buffers are reused),
    // then a prefill of other shapes and a decode step after it.
    for (seed, batch, seq) in [(21, 3, 5), (22, 2, 7)] {
        let mut scenario = Scenario::prefill_with(&graph, seed, batch, seq).unwrap();
        for step in 0..3 {
            if step > 0 {
                scenario.advance().unwrap();
                scenario.next_decode_step().unwrap();
            }
            let mut fresh_caches = scenario.caches.clone();
            let want = executor().run(&exe, &scenario.inputs, &mut fresh_caches).unwrap();
            let got = reused.run(&exe, &scenario.inputs, &mut scenario.caches).unwrap();
            assert_outputs_identical(&got.outputs, &want.outputs);
            assert_caches_identical(&scenario.caches, &fresh_caches);
            // Keep the first decode step's output; drop the others so their
            // buffers go back to the executor.
            if step == 1 {
                let output = got.outputs[HIDDEN_STATE_OUT].clone();
                let values = output.to_f32_vec().unwrap();
                assert!(values.iter().any(|&v| v != 0.0));
                kept.push((output, values));
            }
        }
    }
    for (output, values) in &kept {
        assert_eq!(bits(&output.to_f32_vec().unwrap()), bits(values), "a later run wrote a kept output");
    }
}

/// A large run releases each step output after the last step that reads
/// it: a chain of five 64 MiB elementwise steps (320 MiB in all, over
/// `RELEASE_DEAD_ABOVE`) holds at most two outputs at once, and computes
/// what the reference computes. A small run keeps every output.
#[test]
fn a_large_run_releases_outputs_after_their_last_reader() {
    use kvjit::ops::{add, silu};
    let registry = standard_registry();
    let build = |len: usize| {
        let mut b = kvjit::GraphBuilder::new("chain", registry.ops());
        let x = b.input("x", DType::F32, &[kvjit::Dim::from(len)]).unwrap();
        let mut v = silu(&mut b, x).unwrap();
        for _ in 0..3 {
            v = silu(&mut b, v).unwrap();
        }
        let out = add(&mut b, v, x).unwrap();
        b.output("y", out).unwrap();
        b.finish().unwrap()
    };
    for (len, releases) in [(16 << 20, true), (1 << 16, false)] {
        let graph = build(len);
        let exe = compile_cpu(&graph, &registry);
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(5);
        let x = Tensor::random(DType::F32, &[len], &mut rng, -2.0, 2.0).unwrap();
        let inputs: Tensors = [("x".to_string(), x)].into();
        let run = executor().run(&exe, &inputs, &mut Caches::new()).unwrap();
        let output = (len * 4) as u64;
        let all = 5 * output;
        if releases {
            assert!(all > kvjit::RELEASE_DEAD_ABOVE);
            assert_eq!(run.peak_output_bytes, 2 * output, "a step's input and output at once");
        } else {
            assert_eq!(run.peak_output_bytes, all, "a small run keeps every output");
        }
        let reference = reference_run(&graph, &inputs, &mut Caches::new());
        assert_outputs_identical(&run.outputs, &reference);
    }
}
