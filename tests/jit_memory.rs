//! Dropping executables frees their JIT code: `kvjit_jit::live_code_bytes()`
//! returns to where it started after many graphs are built, run and
//! dropped.
//!
//! The counter is process-wide and tests in one binary run in parallel, so
//! this file is its own test binary with a single test.

use kvjit::fused_qkv::cpu_jit::compile_log;
use kvjit::models::llama::{LayerConfig, qkv_layer_graph};
use kvjit::scenario::Scenario;
use kvjit::{BuildOptions, CompileOptions, DType, DeviceContextPtr, Executor, KernelImpl, compile, standard_registry};
use kvjit_jit::{CompileCause, live_code_bytes};

/// Layer configs with distinct kernel keys (and one repeated).
fn configs() -> Vec<LayerConfig> {
    let small = LayerConfig::small();
    let mut configs = vec![small.clone()];
    for (i, dtype) in [DType::F32, DType::BF16, DType::F16].into_iter().enumerate() {
        configs.push(LayerConfig {
            name: format!("memory_{i}"),
            dtype,
            hidden_size: 24 + 8 * i,
            num_q_heads: 2 + i,
            num_kv_heads: 1 + i % 2,
            head_size: 4 + i,
            page_size: 2 + i,
            num_layers: 1 + i % 2,
            ..small.clone()
        });
    }
    configs.push(small);
    configs
}

#[test]
fn building_and_dropping_many_executables_returns_the_jit_memory() {
    let registry = standard_registry();
    let executor = Executor::new(DeviceContextPtr::cpu(2).unwrap());
    let start = live_code_bytes();
    let mut peak = start;
    for round in 0..4 {
        for (i, config) in configs().into_iter().enumerate() {
            let what = format!("round {round}, graph {i} ({})", config.name);
            let graph = qkv_layer_graph(&config, registry.ops()).unwrap();
            // Half of them also compile a kernel per shape seen at run time.
            let build = BuildOptions { specialize_shapes: (round + i) % 2 == 0, ..BuildOptions::default() };
            let exe = compile(&graph, &registry, &CompileOptions { build, ..CompileOptions::default() }).unwrap();
            let mut scenario = Scenario::prefill_with(&graph, i as u64, 2, 3).unwrap();
            for step in 0..2 {
                if step > 0 {
                    scenario.advance().unwrap();
                    scenario.next_decode_step().unwrap();
                }
                executor.run(&exe, &scenario.inputs, &mut scenario.caches).unwrap();
            }
            let live = live_code_bytes();
            assert!(live > start, "{what}: an executable with JIT kernels holds no code");
            peak = peak.max(live);
            drop(exe);
            assert_eq!(live_code_bytes(), start, "{what}: code outlived its executable");

            // Reference kernels hold no JIT code at all.
            let options = CompileOptions {
                build: BuildOptions { implementation: KernelImpl::Reference, ..BuildOptions::default() },
                ..CompileOptions::default()
            };
            let reference = compile(&graph, &registry, &options).unwrap();
            assert_eq!(live_code_bytes(), start, "{what}: reference kernels hold JIT code");
            drop(reference);

            // Kernels compiled with their IR and machine code kept (`kvjit
            // inspect`) bypass the kernel cache, and are freed all the same.
            let keep = BuildOptions { keep_ir: true, keep_disasm: round == 0, ..BuildOptions::default() };
            let inspected = compile(&graph, &registry, &CompileOptions { build: keep, ..CompileOptions::default() });
            assert!(live_code_bytes() > start);
            drop(inspected);
            assert_eq!(live_code_bytes(), start, "{what}: kept-text code outlived its executable");
        }
    }
    assert!(peak > start);

    // Two executables of one graph share their kernels: dropping one keeps
    // the other's code alive and running; dropping both frees it, and the
    // next build compiles again (logged as a recompile).
    let graph = qkv_layer_graph(&LayerConfig::small(), registry.ops()).unwrap();
    let a = compile(&graph, &registry, &CompileOptions::default()).unwrap();
    let with_a = live_code_bytes();
    let b = compile(&graph, &registry, &CompileOptions::default()).unwrap();
    assert_eq!(live_code_bytes(), with_a, "a second executable of the same graph compiled again");
    drop(a);
    assert_eq!(live_code_bytes(), with_a, "dropping one executable freed code another uses");
    let mut scenario = Scenario::prefill(&graph, 3).unwrap();
    executor.run(&b, &scenario.inputs, &mut scenario.caches).unwrap();
    drop(b);
    assert_eq!(live_code_bytes(), start);
    let key = a_key_of(&graph, &registry);
    let before = compile_log().iter().filter(|r| r.key == key).count();
    let again = compile(&graph, &registry, &CompileOptions::default()).unwrap();
    let records: Vec<_> = compile_log().into_iter().filter(|r| r.key == key).collect();
    assert_eq!(records.len(), before + 1);
    assert_eq!(records.last().unwrap().cause, CompileCause::Recompile);
    drop(again);
    assert_eq!(live_code_bytes(), start);
}

/// The key the first node's JIT kernel is compiled under: the key
/// specialize gives it, which names the CPU tier (`…cpu-avx2…`).
fn a_key_of(graph: &kvjit::Graph, registry: &kvjit::Registry) -> String {
    let specialized = kvjit::specialize(graph, registry.ops(), kvjit::cpu_backend(), &Default::default()).unwrap();
    specialized.kernel_keys()[0].to_string()
}
