//! Reliability through the facade: the promises of the README's "Guarantees
//! and errors", checked through `compile` and `Executor::run` on every
//! available target (the CPU JIT, the CPU reference; CUDA when a device
//! exists — otherwise `skipped: no CUDA device (<reason>)` is printed).
//!
//! - **Transactional errors**: for every validation error the executor or a
//!   kernel raises, the failed call leaves the output and the whole cache
//!   byte-identical, and the next valid call gives bit for bit what it gives
//!   on buffers that never saw the failure.
//! - **Concurrency**: one executable run from several threads at once on
//!   separate caches gives what serial runs give; the kernel cache compiles a
//!   key requested by many threads at once exactly once, and different keys
//!   side by side; colliding (page, slot) writes are refused with nothing
//!   written.
//! - **Memory budget**: a graph whose buffers exceed
//!   `CompileOptions::memory_budget` is refused at build with
//!   `Error::MemoryBudget`, nothing compiled; the CLI's `--memory-budget`
//!   gives a one-line error.
//! - **Random graphs** (proptest): 1–3 fused nodes over 1–2 shared caches,
//!   random layer indices and chains, compiled with JIT and with reference
//!   kernels, give byte-identical outputs and caches (inputs are exact
//!   dyadic values, so every summation order agrees), and a graph whose node
//!   names a missing layer is refused alike with nothing written.
//!   `KVJIT_PROPTEST_CASES=N` runs N cases instead of [`GRAPH_CASES`].
//! - **Regressions** found by fuzzing (fuzz/) are named tests at the end.
//!
//! JIT memory returning after executables are dropped is in
//! `tests/jit_memory.rs` (its own binary: it reads a process-wide counter).

mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Barrier;

use common::{constant_data, small_graph};
use kvjit::fused_qkv::cpu_jit::compile_log;
use kvjit::fused_qkv::{FusedQkvSpec, JitKernel, OP_NAME};
use kvjit::models::llama::{LayerConfig, qkv_layer_graph};
use kvjit::op::Compiled;
use kvjit::op::checks::StepDims;
use kvjit::scenario::Scenario;
use kvjit::{
    BuildOptions, CacheElement, CompileOptions, CoreError, DType, DeviceContextPtr, Dim, Error, Executable, Executor,
    Graph, GraphBuilder, KernelImpl, KvCacheParams, KvCacheType, MemoryEstimate, PagedKVCacheCollection, ParamValue,
    Params, Registry, RuntimeError, Tensor, UNASSIGNED_PAGE, compile, specialize, standard_registry,
};
use kvjit_jit::CaptureText;
use kvjit_runtime::Kernel;
use kvjit_testkit::values::dyadic;
use kvjit_testkit::{Caches, Tensors, assert_caches_identical, assert_outputs_identical};
use proptest::prelude::*;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

// ---------------------------------------------------------------------------
// Targets
// ---------------------------------------------------------------------------

/// A target the promises are checked on, with what the facade needs for it.
struct OnTarget {
    name: &'static str,
    options: CompileOptions,
    executor: Executor,
}

fn build(implementation: KernelImpl) -> BuildOptions {
    BuildOptions { implementation, ..BuildOptions::default() }
}

/// The kit's targets — CPU JIT, CPU reference, and CUDA when a device
/// exists (otherwise a line `skipped: no CUDA device (<reason>)`) — each
/// with compile options and an executor on its context.
fn targets() -> Vec<OnTarget> {
    kvjit_testkit::targets()
        .into_iter()
        .map(|t| OnTarget {
            name: t.name(),
            options: CompileOptions {
                target: t.target.device(),
                build: t.target.build_options(),
                ..CompileOptions::default()
            },
            executor: Executor::new(t.ctx),
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Transactional errors through the executor
// ---------------------------------------------------------------------------

/// The small two-layer graph's prefill: 4 sequences padded to 8 tokens, with
/// history, on a 48-page cache of page size 4 and 16 pages per sequence.
fn prefill(graph: &Graph) -> Scenario {
    Scenario::prefill(graph, 21).unwrap()
}

/// `caches` with the metadata (lengths, page table, MAX scalars) of
/// `pristine` and the blocks of `after` where the layouts agree: what the
/// next valid call runs on after a failed one.
fn repaired(after: &Caches, pristine: &Caches) -> Caches {
    let mut fixed = pristine.clone();
    for (name, cache) in &mut fixed {
        if let Some(a) = after.get(name)
            && a.params() == cache.params()
            && a.blocks().shape() == cache.blocks().shape()
        {
            cache.set_blocks(a.blocks().clone()).unwrap();
        }
    }
    fixed
}

/// The page and slot sequence `b`'s token `t` writes.
fn slot_of(cache: &PagedKVCacheCollection, b: usize, t: usize) -> (usize, u32, usize) {
    let pos = cache.cache_lengths()[b] as usize + t;
    let (page, slot) = cache.locate(b, pos).unwrap();
    (pos / cache.params().page_size, page, slot)
}

type Mutation = fn(&mut Tensors, &mut Caches);
/// A named mutation of a valid step and the error it must give.
type Case = (&'static str, Mutation, fn(&RuntimeError) -> bool);

/// Break a valid step with `mutate` on every target: the run is refused with
/// an error `expect` accepts, every cache is byte-identical, and the valid
/// step afterwards gives bit for bit what it gives on caches that never saw
/// the failure.
fn assert_transactional(what: &str, mutate: Mutation, expect: impl Fn(&RuntimeError) -> bool) {
    let registry = standard_registry();
    let graph = small_graph(&registry);
    for target in targets() {
        let name = format!("{} / {what}", target.name);
        let exe = compile(&graph, &registry, &target.options).unwrap_or_else(|e| panic!("{name}: {e}"));
        let good = prefill(&graph);
        let mut want_caches = good.caches.clone();
        let want = target.executor.run(&exe, &good.inputs, &mut want_caches).unwrap();

        let (mut inputs, mut caches) = (good.inputs.clone(), good.caches.clone());
        mutate(&mut inputs, &mut caches);
        let before = caches.clone();
        let err = match target.executor.run(&exe, &inputs, &mut caches) {
            Ok(_) => panic!("{name}: the broken step ran"),
            Err(e) => e,
        };
        assert!(expect(&err), "{name}: unexpected error {err:?}");
        assert!(!err.to_string().contains('\n'), "{name}: a message spans lines: {err}");
        assert_caches_identical(&caches, &before);

        let mut next = repaired(&caches, &good.caches);
        let out = target.executor.run(&exe, &good.inputs, &mut next).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_outputs_identical(&out.outputs, &want.outputs);
        assert_caches_identical(&next, &want_caches);
    }
}

fn kernel_error(err: &RuntimeError, step: &str, matches: impl Fn(&CoreError) -> bool) -> bool {
    matches!(err, RuntimeError::Kernel { step: s, source, .. } if s == step && matches(source))
}

#[test]
fn executor_input_errors_are_transactional_on_every_target() {
    let cases: [Case; 8] = [
        (
            "missing input",
            |i, _| drop(i.remove("valid_lengths")),
            |e| matches!(e, RuntimeError::MissingInput { name, .. } if name == "valid_lengths"),
        ),
        (
            "unexpected input",
            |i, _| drop(i.insert("bogus".into(), Tensor::scalar_u32(1))),
            |e| matches!(e, RuntimeError::UnexpectedInput { name, .. } if name == "bogus"),
        ),
        (
            "input dtype",
            |i, _| drop(i.insert("hidden_state".into(), Tensor::zeros(DType::BF16, &[4, 8, 64]).unwrap())),
            |e| matches!(e, RuntimeError::InputDType { got: DType::BF16, .. }),
        ),
        (
            "input shape",
            |i, _| drop(i.insert("hidden_state".into(), Tensor::zeros(DType::F32, &[4, 8, 32]).unwrap())),
            |e| matches!(e, RuntimeError::InputShape { got, .. } if got == &[4, 8, 32]),
        ),
        (
            "symbol conflict",
            |i, _| drop(i.insert("valid_lengths".into(), Tensor::from_vec(&[5], vec![1u32; 5]).unwrap())),
            |e| matches!(e, RuntimeError::SymbolConflict { symbol, first: 4, second: 5, .. } if symbol == "batch"),
        ),
        (
            "missing cache",
            |_, c| drop(c.remove("kv_cache")),
            |e| matches!(e, RuntimeError::MissingCache(name) if name == "kv_cache"),
        ),
        (
            "cache layout",
            |_, c| {
                let params = KvCacheParams { page_size: 8, ..*c["kv_cache"].params() };
                c.insert("kv_cache".into(), PagedKVCacheCollection::new(params, 48, 4, 16).unwrap());
            },
            |e| matches!(e, RuntimeError::CacheMismatch { name, .. } if name == "kv_cache"),
        ),
        (
            "cache page count",
            |_, c| {
                let params = *c["kv_cache"].params();
                c.insert("kv_cache".into(), PagedKVCacheCollection::new(params, 47, 4, 16).unwrap());
            },
            |e| matches!(e, RuntimeError::CacheMismatch { problem, .. } if problem.contains("num_pages is 47")),
        ),
    ];
    for (what, mutate, expect) in cases {
        assert_transactional(what, mutate, expect);
    }
}

#[test]
fn kernel_argument_errors_are_transactional_on_every_target() {
    let cases: [Case; 8] = [
        (
            "valid length > seq",
            |i, _| drop(i.insert("valid_lengths".into(), Tensor::from_vec(&[4], vec![8u32, 8, 9, 1]).unwrap())),
            |e| {
                kernel_error(e, "n0", |s| {
                    matches!(s, CoreError::ValidLengthTooLong { batch: 2, valid_length: 9, seq_len: 8 })
                })
            },
        ),
        (
            // The second node's layer: the first node would already have
            // written, were the checks not all done first.
            "layer out of range in the second node",
            |i, _| drop(i.insert("layers.1.layer_idx".into(), Tensor::scalar_u32(2))),
            |e| kernel_error(e, "n1", |s| matches!(s, CoreError::LayerOutOfRange { layer_idx: 2, num_layers: 2 })),
        ),
        (
            "logical page beyond the table",
            |_, c| c.get_mut("kv_cache").unwrap().cache_lengths_mut()[3] = 64,
            |e| kernel_error(e, "n0", |s| matches!(s, CoreError::LogicalPageOutOfRange { batch: 3, .. })),
        ),
        (
            "physical page past the cache",
            |_, c| {
                let cache = c.get_mut("kv_cache").unwrap();
                let (logical, _, _) = slot_of(cache, 3, 0);
                cache.lookup_table_mut()[3 * 16 + logical] = 48;
            },
            |e| {
                kernel_error(e, "n0", |s| {
                    matches!(s, CoreError::PhysicalPageOutOfRange { batch: 3, physical_page: 48, num_pages: 48, .. })
                })
            },
        ),
        (
            "unassigned page for a valid token",
            |_, c| {
                let cache = c.get_mut("kv_cache").unwrap();
                let (logical, _, _) = slot_of(cache, 3, 0);
                cache.lookup_table_mut()[3 * 16 + logical] = UNASSIGNED_PAGE;
            },
            |e| {
                kernel_error(e, "n0", |s| {
                    matches!(s, CoreError::PhysicalPageOutOfRange { physical_page: UNASSIGNED_PAGE, .. })
                })
            },
        ),
        (
            "two sequences writing one slot",
            |_, c| {
                let cache = c.get_mut("kv_cache").unwrap();
                let (logical, _, slot) = slot_of(cache, 3, 0);
                // Sequence 0 writes all 8 of its tokens: one of them lands in this slot.
                let t0 = (0..8).find(|&t| slot_of(cache, 0, t).2 == slot).unwrap();
                let (_, page, _) = slot_of(cache, 0, t0);
                cache.lookup_table_mut()[3 * 16 + logical] = page;
            },
            |e| {
                kernel_error(e, "n0", |s| {
                    matches!(s, CoreError::SlotCollision { first_batch: 0, second_batch: 3, second_t: 0, .. })
                })
            },
        ),
        (
            "one sequence mapping two logical pages to one page",
            |_, c| {
                let cache = c.get_mut("kv_cache").unwrap();
                // Sequence 0's 8 tokens span at least two logical pages.
                let (first, page, _) = slot_of(cache, 0, 0);
                cache.lookup_table_mut()[first + 1] = page;
            },
            |e| {
                kernel_error(e, "n0", |s| matches!(s, CoreError::SlotCollision { first_batch: 0, second_batch: 0, .. }))
            },
        ),
        (
            "strided hidden state",
            |i, _| {
                let hidden = &i["hidden_state"];
                let view = hidden.permuted(&[1, 0, 2]).unwrap().to_contiguous().permuted(&[1, 0, 2]).unwrap();
                assert!(!view.is_contiguous());
                i.insert("hidden_state".into(), view);
            },
            |e| kernel_error(e, "n0", |s| matches!(s, CoreError::NotContiguous { arg } if arg == "hidden_state")),
        ),
    ];
    for (what, mutate, expect) in cases {
        assert_transactional(what, mutate, expect);
    }
}

// ---------------------------------------------------------------------------
// Transactional errors of a kernel called directly (output buffer included)
// ---------------------------------------------------------------------------

/// One call of the first node's kernel, with its own output tensor.
#[derive(Clone)]
struct KernelCall {
    hidden: Tensor,
    weight: Tensor,
    layer_idx: Tensor,
    valid: Tensor,
    cache: PagedKVCacheCollection,
    output: Tensor,
}

impl KernelCall {
    fn new(graph: &Graph, seed: u64) -> Self {
        let s = Scenario::prefill(graph, seed).unwrap();
        let mut output = Tensor::zeros(DType::F32, &[4, 8, 64]).unwrap();
        output.fill_f32(f32::NAN).unwrap();
        Self {
            hidden: s.inputs["hidden_state"].clone(),
            weight: constant_data(graph, "layers.0.qkv_weight"),
            layer_idx: s.inputs["layers.0.layer_idx"].clone(),
            valid: s.inputs["valid_lengths"].clone(),
            cache: s.caches["kv_cache"].clone(),
            output,
        }
    }

    fn bytes(&self) -> (Vec<u8>, Vec<u8>, Vec<u32>, Vec<u32>, u32, u32) {
        let c = &self.cache;
        (
            self.output.as_bytes().to_vec(),
            c.blocks().as_bytes().to_vec(),
            c.cache_lengths().to_vec(),
            c.lookup_table().to_vec(),
            c.max_seq_length,
            c.max_cache_length,
        )
    }

    fn run(&mut self, kernel: &dyn Kernel, ctx: &DeviceContextPtr) -> kvjit::Result<(), CoreError> {
        let inputs = [&self.hidden, &self.weight, &self.layer_idx, &self.valid];
        kernel.run(&inputs, &mut [&mut self.cache], std::slice::from_mut(&mut self.output), ctx)
    }
}

#[test]
fn kernel_errors_leave_output_and_cache_byte_identical_on_every_target() {
    type Case = (&'static str, fn(&mut KernelCall), fn(&CoreError) -> bool);
    let cases: [Case; 10] = [
        (
            "valid_lengths of B + 1",
            |c| c.valid = Tensor::from_vec(&[5], vec![1u32; 5]).unwrap(),
            |e| matches!(e, CoreError::ShapeMismatch { arg, .. } if arg == "valid_lengths"),
        ),
        (
            "weight dtype",
            |c| c.weight = Tensor::zeros(DType::BF16, c.weight.shape()).unwrap(),
            |e| matches!(e, CoreError::DTypeMismatch { arg, .. } if arg == "weight"),
        ),
        (
            "cache layout",
            |c| {
                let params = KvCacheParams { page_size: 8, ..*c.cache.params() };
                c.cache = PagedKVCacheCollection::new(params, 48, 4, 16).unwrap();
            },
            |e| matches!(e, kvjit_core::Error::CacheLayout { what: "page_size", .. }),
        ),
        (
            "strided weight",
            |c| c.weight = c.weight.permuted(&[1, 0]).unwrap().to_contiguous().permuted(&[1, 0]).unwrap(),
            |e| matches!(e, CoreError::NotContiguous { arg } if arg == "weight"),
        ),
        (
            "output shape",
            |c| c.output = Tensor::zeros(DType::F32, &[4, 8, 65]).unwrap(),
            |e| matches!(e, CoreError::ShapeMismatch { arg, .. } if arg == "output"),
        ),
        (
            "valid length > seq",
            |c| c.valid = Tensor::from_vec(&[4], vec![1u32, 1, 1, 9]).unwrap(),
            |e| matches!(e, CoreError::ValidLengthTooLong { batch: 3, .. }),
        ),
        ("layer", |c| c.layer_idx = Tensor::scalar_u32(7), |e| matches!(e, CoreError::LayerOutOfRange { .. })),
        (
            "logical page",
            |c| c.cache.cache_lengths_mut()[3] = 64,
            |e| matches!(e, CoreError::LogicalPageOutOfRange { .. }),
        ),
        (
            "physical page",
            |c| {
                let (logical, _, _) = slot_of(&c.cache, 2, 0);
                c.cache.lookup_table_mut()[2 * 16 + logical] = 1000;
            },
            |e| matches!(e, CoreError::PhysicalPageOutOfRange { batch: 2, physical_page: 1000, .. }),
        ),
        (
            "slot collision",
            |c| {
                let (logical, _, slot) = slot_of(&c.cache, 2, 0);
                let t0 = (0..8).find(|&t| slot_of(&c.cache, 0, t).2 == slot).unwrap();
                c.cache.lookup_table_mut()[2 * 16 + logical] = slot_of(&c.cache, 0, t0).1;
            },
            |e| matches!(e, CoreError::SlotCollision { .. }),
        ),
    ];
    let registry = standard_registry();
    let graph = small_graph(&registry);
    for target in targets() {
        let exe = compile(&graph, &registry, &target.options).unwrap();
        let kernel = exe.steps()[0].kernel.clone();
        let ctx = target.executor.context();
        let mut want = KernelCall::new(&graph, 5);
        want.run(kernel.as_ref(), ctx).unwrap();
        for (what, breaker, expect) in cases {
            let name = format!("{} / {what}", target.name);
            let pristine = KernelCall::new(&graph, 5);
            let mut call = pristine.clone();
            breaker(&mut call);
            let before = call.bytes();
            let err = call.run(kernel.as_ref(), ctx).expect_err(&name);
            assert!(expect(&err), "{name}: unexpected error {err:?}");
            assert!(call.bytes() == before, "{name}: the failed call changed its output or cache");
            let checked = kernel.check(&[&call.hidden, &call.weight, &call.layer_idx, &call.valid], &[&call.cache]);
            assert_eq!(checked.is_err(), what != "output shape", "{name}: check disagrees with run: {checked:?}");

            // The next valid call, on the buffers the failure left.
            let mut next = pristine.clone();
            if call.cache.params() == pristine.cache.params() {
                next.cache.set_blocks(call.cache.blocks().clone()).unwrap();
            }
            if call.output.shape() == pristine.output.shape() {
                next.output = call.output.clone();
            }
            next.run(kernel.as_ref(), ctx).unwrap_or_else(|e| panic!("{name}: next call: {e}"));
            assert!(next.bytes() == want.bytes(), "{name}: the next valid call differs from a fresh one");
        }
    }
}

// ---------------------------------------------------------------------------
// Concurrency
// ---------------------------------------------------------------------------

/// Three steps (a prefill, two decodes) of `scenario`: outputs and caches after each.
fn three_steps(exe: &Executable, executor: &Executor, mut scenario: Scenario) -> Vec<(Tensors, Caches)> {
    let mut results = Vec::new();
    for step in 0..3 {
        if step > 0 {
            scenario.advance().unwrap();
            scenario.next_decode_step().unwrap();
        }
        let out = executor.run(exe, &scenario.inputs, &mut scenario.caches).unwrap();
        results.push((out.outputs, scenario.caches.clone()));
    }
    results
}

#[test]
fn one_executable_runs_from_several_threads_at_once_on_separate_caches() {
    let registry = standard_registry();
    let graph = small_graph(&registry);
    let exe = compile(&graph, &registry, &CompileOptions::default()).unwrap();
    let scenarios = || (0..6).map(|i| Scenario::prefill_with(&graph, 40 + i, 1 + i as usize % 4, 3 + i as usize));
    let shared = Executor::new(DeviceContextPtr::cpu(3).unwrap());
    let serial: Vec<_> = scenarios().map(|s| three_steps(&exe, &shared, s.unwrap())).collect();
    let barrier = Barrier::new(6);
    let concurrent: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = scenarios()
            .enumerate()
            .map(|(i, s)| {
                let (exe, shared, barrier) = (&exe, &shared, &barrier);
                scope.spawn(move || {
                    let own = Executor::new(DeviceContextPtr::cpu(1 + i % 3).unwrap());
                    barrier.wait();
                    three_steps(exe, if i % 2 == 0 { shared } else { &own }, s.unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (alone, together)) in serial.iter().zip(&concurrent).enumerate() {
        for (step, ((out_a, caches_a), (out_t, caches_t))) in alone.iter().zip(together).enumerate() {
            eprintln!("scenario {i} step {step}");
            assert_outputs_identical(out_t, out_a);
            assert_caches_identical(caches_t, caches_a);
        }
    }
}

/// A spec no other test compiles (K = 1019, q_dim = 31, Hkv 3, D 7, page 13, L 5).
fn unusual_spec(seq: usize) -> FusedQkvSpec {
    FusedQkvSpec {
        backend: kvjit::cpu_backend(),
        dtype: DType::BF16,
        weights: DType::BF16,
        cache: KvCacheParams {
            element: CacheElement::F16,
            num_layers: 5,
            page_size: 13,
            num_kv_heads: 3,
            head_size: 7,
        },
        k: 1019,
        q_dim: 31,
        step: StepDims { batch: None, seq: Some(seq) },
        sizes: kvjit::fused_qkv::Sizes::Baked,
    }
}

fn compiles_of(key: &str) -> usize {
    compile_log().iter().filter(|r| r.key == key).count()
}

/// The key a JIT kernel for `spec` compiles under: the spec's own key,
/// which names the CPU tier.
fn jit_key(spec: &FusedQkvSpec) -> String {
    kvjit::KernelSpec::key(spec).to_string()
}

#[test]
fn the_kernel_cache_compiles_one_key_once_when_many_threads_ask_at_once() {
    let spec = unusual_spec(3);
    let key = jit_key(&spec);
    assert_eq!(compiles_of(&key), 0, "{key} compiled before the test");
    let barrier = Barrier::new(8);
    let kernels: Vec<Compiled<JitKernel>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    Compiled::new(JitKernel::new(spec, None, CaptureText::default()).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(compiles_of(&key), 1, "{key}: one compile for eight concurrent requests");
    let sizes: Vec<usize> = kernels.iter().map(|k| k.code_info().code_size).collect();
    assert!(sizes.iter().all(|&s| s == sizes[0] && s > 0), "{sizes:?}");
}

#[test]
fn the_kernel_cache_compiles_different_keys_side_by_side() {
    // Six keys (seq 10..16 baked in), each asked for by two threads at once.
    let specs: Vec<FusedQkvSpec> = (10..16).map(unusual_spec).collect();
    let keys: Vec<String> = specs.iter().map(jit_key).collect();
    assert!(keys.iter().all(|k| compiles_of(k) == 0));
    let barrier = Barrier::new(12);
    let kernels: Vec<(usize, Compiled<JitKernel>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..12)
            .map(|i| {
                let (spec, barrier) = (specs[i % 6], &barrier);
                s.spawn(move || {
                    barrier.wait();
                    (i % 6, Compiled::new(JitKernel::new(spec, None, CaptureText::default()).unwrap()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for key in &keys {
        assert_eq!(compiles_of(key), 1, "{key}");
    }
    // Every kernel computes its own shape: run each against the reference.
    for (i, kernel) in &kernels {
        let seq = 10 + i;
        let (hidden, weight, layer, valid, cache) = unusual_call(seq);
        let mut want_cache = cache.clone();
        let mut want = Tensor::zeros(DType::BF16, &[1, seq, 31]).unwrap();
        kvjit::fused_qkv::reference::fused_qkv_matmul(&hidden, &weight, &mut want_cache, &layer, &valid, &mut want)
            .unwrap();
        let mut got_cache = cache.clone();
        let mut got = [Tensor::zeros(DType::BF16, &[1, seq, 31]).unwrap()];
        let ctx = DeviceContextPtr::cpu(2).unwrap();
        kernel.run(&[&hidden, &weight, &layer, &valid], &mut [&mut got_cache], &mut got, &ctx).unwrap();
        assert!(got[0].as_bytes() == want.as_bytes(), "seq {seq}: output");
        assert!(got_cache.blocks().as_bytes() == want_cache.blocks().as_bytes(), "seq {seq}: cache");
    }
}

/// A call for [`unusual_spec`] with exact (dyadic) values, so any summation
/// order gives the same bits.
fn unusual_call(seq: usize) -> (Tensor, Tensor, Tensor, Tensor, PagedKVCacheCollection) {
    let mut rng = StdRng::seed_from_u64(seq as u64);
    let hidden = dyadic(&mut rng, DType::BF16, &[1, seq, 1019], 4);
    let weight = dyadic(&mut rng, DType::BF16, &[31 + 42, 1019], 8);
    let params =
        KvCacheParams { element: CacheElement::F16, num_layers: 5, page_size: 13, num_kv_heads: 3, head_size: 7 };
    let mut cache = PagedKVCacheCollection::new(params, 5, 1, 4).unwrap();
    cache.set_allocation_order(vec![3, 0, 4, 1, 2]).unwrap();
    cache.reserve(&[5]).unwrap();
    cache.advance(&[5]).unwrap();
    cache.reserve(&[seq as u32 - 1]).unwrap();
    let valid = Tensor::from_vec(&[1], vec![seq as u32 - 1]).unwrap();
    (hidden, weight, Tensor::scalar_u32(4), valid, cache)
}

#[test]
fn colliding_slot_writes_are_refused_with_nothing_written_on_every_target() {
    // Two sequences of 3 tokens on a cache of page size 4; the table sends
    // both to page 1, sequence 1 starting at slot 2: its tokens 0 and 1 would
    // land on sequence 0's slots 2 and 3.
    let registry = standard_registry();
    let config = LayerConfig { num_pages: 4, max_pages_per_seq: 2, num_layers: 1, ..LayerConfig::small() };
    let graph = qkv_layer_graph(&config, registry.ops()).unwrap();
    for target in targets() {
        let exe = compile(&graph, &registry, &target.options).unwrap();
        let mut rng = StdRng::seed_from_u64(3);
        let inputs: Tensors = [
            ("hidden_state", Tensor::random(DType::F32, &[2, 3, 64], &mut rng, -1.0, 1.0).unwrap()),
            ("valid_lengths", Tensor::from_vec(&[2], vec![3u32, 3]).unwrap()),
            ("layer_idx", Tensor::scalar_u32(0)),
        ]
        .into_iter()
        .map(|(n, t)| (n.to_string(), t))
        .collect();
        let params =
            KvCacheParams { element: CacheElement::F32, num_layers: 1, page_size: 4, num_kv_heads: 2, head_size: 16 };
        let blocks = Tensor::random(DType::F32, &[4, 2, 1, 4, 2, 16], &mut rng, -1.0, 1.0).unwrap();
        let cache = |lengths: Vec<u32>, table: Vec<u32>| {
            let c = PagedKVCacheCollection::from_parts(blocks.clone(), lengths, table, 2).unwrap();
            assert_eq!(c.params(), &params);
            Caches::from([("kv_cache".to_string(), c)])
        };
        let mut colliding = cache(vec![0, 2], vec![1, UNASSIGNED_PAGE, 1, 3]);
        let before = colliding.clone();
        let err = target.executor.run(&exe, &inputs, &mut colliding).expect_err(target.name);
        assert!(
            matches!(
                &err,
                RuntimeError::Kernel {
                    source: CoreError::SlotCollision {
                        first_batch: 0,
                        first_t: 2,
                        second_batch: 1,
                        second_t: 0,
                        page: 1,
                        slot: 2
                    },
                    ..
                }
            ),
            "{}: {err:?}",
            target.name
        );
        assert!(err.to_string().ends_with("tokens (batch 0, t 2) and (batch 1, t 0) would both write page 1 slot 2"));
        assert_caches_identical(&colliding, &before);

        // Moved apart (sequence 1 on page 2), the same step runs.
        let mut apart = cache(vec![0, 2], vec![1, UNASSIGNED_PAGE, 2, 3]);
        target.executor.run(&exe, &inputs, &mut apart).unwrap_or_else(|e| panic!("{}: {e}", target.name));
        // Padded rows write nothing, so they may share slots: sequence 1's one
        // valid token goes to page 2, its padded rows would reach page 1.
        let mut padded_share = cache(vec![0, 3], vec![1, UNASSIGNED_PAGE, 2, 1]);
        let mut inputs = inputs.clone();
        inputs.insert("valid_lengths".into(), Tensor::from_vec(&[2], vec![3u32, 1]).unwrap());
        target.executor.run(&exe, &inputs, &mut padded_share).unwrap_or_else(|e| panic!("{}: {e}", target.name));
    }
}

// ---------------------------------------------------------------------------
// Memory budget
// ---------------------------------------------------------------------------

/// A layer config no other test compiles.
fn budget_config() -> LayerConfig {
    LayerConfig {
        name: "budget".into(),
        hidden_size: 72,
        num_q_heads: 3,
        num_kv_heads: 1,
        head_size: 24,
        ..LayerConfig::small()
    }
}

#[test]
fn a_graph_over_the_memory_budget_is_refused_at_build_with_nothing_compiled() {
    let registry = standard_registry();
    let config = budget_config();
    let graph = qkv_layer_graph(&config, registry.ops()).unwrap();
    // Constants: 2 layers of [120, 72] f32 (a packed copy more for the JIT);
    // outputs: symbolic; cache: 48 pages × 2 × 2 layers × 4 slots × 24 f32,
    // and the page allocation order (a u32 per page).
    let constants = 2 * 120 * 72 * 4;
    let caches = 48 * 2 * 2 * 4 * 24 * 4 + 48 * 4;
    assert_eq!(constants, 69_120);
    assert_eq!(caches, 73_920);
    let jit_needs = 2 * constants + caches;
    let keys: Vec<String> = specialize(&graph, registry.ops(), kvjit::cpu_backend(), &BTreeMap::new())
        .unwrap()
        .kernel_keys()
        .iter()
        .map(|k| k.to_string())
        .collect();

    let budget = |budget: u64, implementation| CompileOptions {
        memory_budget: Some(budget),
        build: build(implementation),
        ..CompileOptions::default()
    };
    let err = compile(&graph, &registry, &budget(jit_needs - 1, KernelImpl::Fast)).err().expect("over budget");
    match &err {
        Error::MemoryBudget { needed, budget, estimate } => {
            assert_eq!((*needed, *budget), (jit_needs, jit_needs - 1));
            assert_eq!((estimate.constants, estimate.outputs, estimate.caches), (2 * constants, 0, caches));
            let unknown = ["kv_cache.lookup_table", "v5", "v8"].map(String::from).to_vec();
            assert_eq!(estimate.unknown, unknown, "the symbolic outputs and the table of the symbolic batch");
        }
        other => panic!("expected MemoryBudget, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        format!(
            "graph needs {jit_needs} bytes ({} constants, 0 outputs, {caches} KV caches), more than the memory budget of {} bytes",
            2 * constants,
            jit_needs - 1
        )
    );
    for key in &keys {
        assert_eq!(compiles_of(key), 0, "{key} was compiled for a refused graph");
    }

    // The reference kernels keep no packed copy; at the budget exactly, both compile.
    compile(&graph, &registry, &budget(constants + caches, KernelImpl::Reference)).unwrap();
    compile(&graph, &registry, &budget(jit_needs, KernelImpl::Fast)).unwrap();
    // Bound symbols make the outputs count: 2 outputs of [4, 8, 72] f32.
    let bound = CompileOptions {
        bindings: BTreeMap::from([("batch".to_string(), 4), ("seq".to_string(), 8)]),
        ..budget(jit_needs, KernelImpl::Fast)
    };
    match compile(&graph, &registry, &bound) {
        Err(Error::MemoryBudget { needed, estimate, .. }) => {
            assert_eq!(estimate.outputs, 2 * 4 * 8 * 72 * 4);
            // …and the page table of the now static batch: 4 × 16 u32 of
            // lookup table, 4 u32 of cache lengths.
            assert_eq!(needed, jit_needs + estimate.outputs + 4 * 17 * 4);
            assert!(estimate.unknown.is_empty());
        }
        other => panic!("expected MemoryBudget, got {:?}", other.err()),
    }
    let bound_graph = specialize(&graph, registry.ops(), kvjit::cpu_backend(), &bound.bindings).unwrap();
    assert_eq!(
        MemoryEstimate::of(bound_graph.graph(), &registry, bound.target, &bound.build).total(),
        jit_needs + 2 * 4 * 8 * 72 * 4 + 4 * 17 * 4
    );
}

fn kvjit_cli(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvjit")).args(args).output().expect("the kvjit binary starts")
}

fn assert_one_line_error(out: &std::process::Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line expected: {err}");
    assert!(err.starts_with("error: ") && err.contains(needle), "'{needle}' not in: {err}");
}

#[test]
fn the_cli_refuses_a_graph_over_its_memory_budget_in_one_line() {
    // The 8B QKV layer: a 6144 × 4096 f32 weight (and its packed copy)
    // alone is 192 MiB.
    let layer = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/llama3_8b_layer.json");
    let out = kvjit_cli(&["run", layer, "--memory-budget", "100M"]);
    assert_one_line_error(&out, "more than the memory budget of 104857600 bytes");
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("error: graph needs 209"), "{out:?}");
    assert!(out.stdout.is_empty(), "nothing ran: {}", String::from_utf8_lossy(&out.stdout));

    let small = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/small_two_layers.json");
    assert_one_line_error(&kvjit_cli(&["run", small, "--memory-budget", "100K"]), "memory budget of 102400 bytes");
    let fits = kvjit_cli(&["run", small, "--memory-budget", "1M", "--steps", "0"]);
    assert!(fits.status.success(), "{}", String::from_utf8_lossy(&fits.stderr));
    let bad = kvjit_cli(&["run", small, "--memory-budget", "12Q"]);
    assert_eq!(bad.status.code(), Some(1));
    assert_eq!(String::from_utf8_lossy(&bad.stderr).lines().count(), 1);
}

// ---------------------------------------------------------------------------
// Random graphs: JIT and reference kernels through the executor
// ---------------------------------------------------------------------------

/// Graph cases per run when `KVJIT_PROPTEST_CASES` is not set.
const GRAPH_CASES: u32 = 96;

/// Where a node's hidden state comes from.
#[derive(Clone, Copy, Debug)]
enum Hidden {
    /// The graph input `hidden_state`.
    Input,
    /// The Q output of an earlier node (f32 graphs only: q_dim = K).
    Node(usize),
}

/// One fused node.
#[derive(Clone, Copy, Debug)]
struct NodeSpec {
    cache: usize,
    layer: u32,
    /// `layer_idx` as a graph input (else a u32 constant).
    layer_input: bool,
    hidden: Hidden,
}

/// A random graph and the step it runs.
#[derive(Clone, Debug)]
struct GraphCase {
    seed: u64,
    dtype: DType,
    cache_dtype: DType,
    k: usize,
    num_kv_heads: usize,
    head_size: usize,
    page_size: usize,
    /// Layers of each cache (1 or 2 caches).
    cache_layers: Vec<usize>,
    nodes: Vec<NodeSpec>,
    batch: usize,
    seq: usize,
    history: Vec<u32>,
    valid: Vec<u32>,
    /// Bind batch and seq at compile time.
    bind: bool,
    /// Make the `layer_idx` input of this node name a missing layer.
    bad_node: Option<usize>,
}

fn graph_case() -> impl Strategy<Value = GraphCase> {
    let dims = (
        prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F16)],
        prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F16)],
        1usize..=16,
        1usize..=3,
        1usize..=6,
        1usize..=5,
        proptest::collection::vec(1usize..=3, 1..=2),
    );
    let step = (1usize..=3, 1usize..=6, any::<u64>(), any::<bool>());
    (
        dims,
        step,
        proptest::collection::vec((any::<usize>(), any::<u32>(), any::<bool>(), any::<usize>()), 1..=3),
        any::<Option<usize>>(),
    )
        .prop_flat_map(
            |((dtype, cache_dtype, k, hkv, d, ps, cache_layers), (batch, seq, seed, bind), raw_nodes, bad)| {
                let nodes: Vec<NodeSpec> = raw_nodes
                    .iter()
                    .enumerate()
                    .map(|(i, &(cache, layer, layer_input, from))| {
                        let cache = cache % cache_layers.len();
                        let hidden = if dtype == DType::F32 && i > 0 && from % 2 == 0 {
                            Hidden::Node(from / 2 % i)
                        } else {
                            Hidden::Input
                        };
                        NodeSpec { cache, layer: layer % cache_layers[cache] as u32, layer_input, hidden }
                    })
                    .collect();
                // About one case in four names a missing layer (where the layer is an input).
                let bad_node =
                    bad.filter(|v| v % 4 == 0).map(|v| v / 4 % nodes.len()).filter(|&b| nodes[b].layer_input);
                let lengths = proptest::collection::vec((0u32..=6, 0u32..=seq as u32), batch);
                let case = GraphCase {
                    seed,
                    dtype,
                    cache_dtype,
                    k,
                    num_kv_heads: hkv,
                    head_size: d,
                    page_size: ps,
                    cache_layers: cache_layers.clone(),
                    nodes,
                    batch,
                    seq,
                    history: Vec::new(),
                    valid: Vec::new(),
                    bind,
                    bad_node,
                };
                (Just(case), lengths)
            },
        )
        .prop_map(|(case, lengths)| GraphCase {
            history: lengths.iter().map(|&(h, _)| h).collect(),
            valid: lengths.iter().map(|&(_, v)| v).collect(),
            ..case
        })
}

impl GraphCase {
    fn pages_per_seq(&self) -> usize {
        (6 + self.seq).div_ceil(self.page_size)
    }

    fn graph(&self, registry: &Registry) -> Graph {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let mut b = GraphBuilder::new("random", registry.ops());
        let batch = Dim::from("batch");
        let hidden =
            b.input("hidden_state", self.dtype, &[batch.clone(), Dim::from("seq"), Dim::from(self.k)]).unwrap();
        let valid = b.input("valid_lengths", DType::U32, std::slice::from_ref(&batch)).unwrap();
        let caches: Vec<_> = self
            .cache_layers
            .iter()
            .enumerate()
            .map(|(i, &layers)| {
                let ty = KvCacheType {
                    dtype: self.cache_dtype,
                    num_layers: layers,
                    page_size: self.page_size,
                    num_kv_heads: self.num_kv_heads,
                    head_size: self.head_size,
                    scale_granularity: None,
                    num_pages: Dim::from(self.batch * self.pages_per_seq()),
                    batch: batch.clone(),
                    max_pages_per_seq: Dim::from(self.pages_per_seq()),
                };
                b.kv_cache(&format!("cache{i}"), ty).unwrap()
            })
            .collect();
        let params: Params = [
            ("dtype", ParamValue::from(self.dtype)),
            ("num_kv_heads", self.num_kv_heads.into()),
            ("head_size", self.head_size.into()),
            ("page_size", self.page_size.into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let n = self.k + 2 * self.num_kv_heads * self.head_size;
        let mut outputs = Vec::new();
        for (i, node) in self.nodes.iter().enumerate() {
            let weight = b.constant(&format!("w{i}"), dyadic(&mut rng, self.dtype, &[n, self.k], 8)).unwrap();
            let layer = if node.layer_input {
                b.input(&format!("layer_idx{i}"), DType::U32, &[]).unwrap()
            } else {
                b.constant(&format!("layer_idx{i}"), Tensor::scalar_u32(node.layer)).unwrap()
            };
            let x = match node.hidden {
                Hidden::Input => hidden,
                Hidden::Node(j) => outputs[j],
            };
            let q = b.node(OP_NAME, params.clone(), &[x, weight, caches[node.cache], layer, valid]).unwrap()[0];
            b.output(&format!("q{i}"), q).unwrap();
            outputs.push(q);
        }
        b.finish().unwrap()
    }

    fn step(&self) -> (Tensors, Caches) {
        let mut rng = StdRng::seed_from_u64(self.seed ^ 0x5eed);
        let mut inputs: Tensors = BTreeMap::new();
        inputs.insert("hidden_state".into(), dyadic(&mut rng, self.dtype, &[self.batch, self.seq, self.k], 4));
        inputs.insert("valid_lengths".into(), Tensor::from_vec(&[self.batch], self.valid.clone()).unwrap());
        for (i, node) in self.nodes.iter().enumerate() {
            if node.layer_input {
                let layer = if self.bad_node == Some(i) { self.cache_layers[node.cache] as u32 } else { node.layer };
                inputs.insert(format!("layer_idx{i}"), Tensor::scalar_u32(layer));
            }
        }
        let mut caches = Caches::new();
        for (i, &layers) in self.cache_layers.iter().enumerate() {
            let params = KvCacheParams {
                element: CacheElement::new(self.cache_dtype, None).unwrap(),
                num_layers: layers,
                page_size: self.page_size,
                num_kv_heads: self.num_kv_heads,
                head_size: self.head_size,
            };
            let pages = self.batch * self.pages_per_seq();
            let mut cache = PagedKVCacheCollection::new(params, pages, self.batch, self.pages_per_seq()).unwrap();
            let mut order: Vec<u32> = (0..pages as u32).collect();
            order.shuffle(&mut rng);
            cache.set_allocation_order(order).unwrap();
            cache
                .set_blocks(Tensor::random(self.cache_dtype, cache.blocks().shape(), &mut rng, -1.0, 1.0).unwrap())
                .unwrap();
            cache.reserve(&self.history).unwrap();
            cache.advance(&self.history).unwrap();
            cache.reserve(&self.valid).unwrap();
            caches.insert(format!("cache{i}"), cache);
        }
        (inputs, caches)
    }
}

/// Compile `case` with JIT and reference kernels and run its step with each.
fn check_graph_case(case: &GraphCase) {
    let registry = standard_registry();
    let graph = case.graph(&registry);
    let bindings: BTreeMap<String, usize> = if case.bind {
        BTreeMap::from([("batch".to_string(), case.batch), ("seq".to_string(), case.seq)])
    } else {
        BTreeMap::new()
    };
    let [jit, reference] = [KernelImpl::Fast, KernelImpl::Reference].map(|i| {
        let options = CompileOptions { bindings: bindings.clone(), build: build(i), ..CompileOptions::default() };
        compile(&graph, &registry, &options).unwrap_or_else(|e| panic!("{case:?}: {e}"))
    });
    let (inputs, caches) = case.step();
    let executor = Executor::new(DeviceContextPtr::cpu(2).unwrap());
    let (mut jit_caches, mut reference_caches) = (caches.clone(), caches.clone());
    let got = executor.run(&jit, &inputs, &mut jit_caches);
    let want = executor.run(&reference, &inputs, &mut reference_caches);
    match (got, want) {
        (Ok(got), Ok(want)) => {
            assert!(case.bad_node.is_none(), "{case:?}: a missing layer was accepted");
            assert_outputs_identical(&got.outputs, &want.outputs);
            assert_caches_identical(&jit_caches, &reference_caches);
        }
        (Err(got), Err(want)) => {
            assert!(case.bad_node.is_some(), "{case:?}: refused: {want}");
            // The same message, key included: both kernels were built from
            // the key specialize made, which names the CPU tier.
            assert_eq!(got.to_string(), want.to_string(), "{case:?}");
            assert!(
                matches!(&want, RuntimeError::Kernel { source: CoreError::LayerOutOfRange { .. }, .. }),
                "{want:?}"
            );
            assert_caches_identical(&jit_caches, &caches);
            assert_caches_identical(&reference_caches, &caches);
        }
        (got, want) => panic!("{case:?}: JIT {:?}, reference {:?}", got.err(), want.err()),
    }
}

fn graph_config() -> proptest::test_runner::Config {
    let cases = std::env::var("KVJIT_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(GRAPH_CASES);
    proptest::test_runner::Config { cases, failure_persistence: None, ..Default::default() }
}

proptest! {
    #![proptest_config(graph_config())]

    #[test]
    fn random_graphs_give_identical_bytes_with_jit_and_reference_kernels(case in graph_case()) {
        check_graph_case(&case);
    }
}

#[test]
fn a_three_node_chain_over_two_caches_is_identical_with_both_kernels() {
    let node = |cache, layer, hidden| NodeSpec { cache, layer, layer_input: true, hidden };
    check_graph_case(&GraphCase {
        seed: 9,
        dtype: DType::F32,
        cache_dtype: DType::BF16,
        k: 16,
        num_kv_heads: 2,
        head_size: 5,
        page_size: 3,
        cache_layers: vec![2, 3],
        nodes: vec![node(1, 2, Hidden::Input), node(0, 1, Hidden::Node(0)), node(1, 2, Hidden::Node(1))],
        batch: 3,
        seq: 5,
        history: vec![4, 0, 6],
        valid: vec![5, 2, 0],
        bind: false,
        bad_node: None,
    });
}

// ---------------------------------------------------------------------------
// Regressions: bugs found while fuzzing (fuzz/) and reviewing the loaders.
// Each failed (ignored, with its bug) until the library was fixed.
// ---------------------------------------------------------------------------

#[test]
fn regression_random_init_wider_than_f32_is_an_error_not_a_panic() {
    let text = r#"{"format": "kvjit-graph", "version": 1, "name": "wide", "values": [
        {"kind": "constant", "id": "v0", "name": "w", "dtype": "f32", "shape": [2],
         "init": {"seed": 1, "low": -3e38, "high": 3e38}}], "nodes": []}"#;
    let registry = standard_registry();
    let load = std::panic::AssertUnwindSafe(|| kvjit::graph_from_json(text, registry.ops(), None).map(|_| ()));
    let result = std::panic::catch_unwind(load);
    match result {
        Ok(Err(e)) => assert!(e.to_string().contains("init"), "{e}"),
        Ok(Ok(())) => {} // a generator that handles the full range is fine too
        Err(_) => panic!("loading a graph file panicked"),
    }
}

#[test]
fn regression_zero_element_tensor_with_huge_dims_is_not_a_panic() {
    let header = r#"{"t":{"dtype":"F32","shape":[0,1099511627776,1099511627776],"data_offsets":[0,0]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    let result = std::panic::catch_unwind(|| kvjit::tensors_from_safetensors(&bytes).map(|t| t.len()));
    assert!(result.is_ok(), "parsing a safetensors file panicked");
    // Either a typed error or an empty tensor: both are fine.
}

#[test]
fn regression_kvjit_run_with_seq_0_does_not_panic() {
    let small = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/small_two_layers.json");
    let out = kvjit_cli(&["run", small, "--seq", "0", "--steps", "0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.status.success() || (out.status.code() == Some(1) && err.lines().count() == 1), "{err}");
}

#[test]
fn regression_a_huge_page_table_is_a_one_line_error_not_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge_table.json");
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/small_two_layers.json")).unwrap();
    let huge = text.replace("\"max_pages_per_seq\": 16", "\"max_pages_per_seq\": 1099511627776");
    assert_ne!(huge, text);
    std::fs::write(&path, huge).unwrap();
    let out = kvjit_cli(&["run", path.to_str().unwrap(), "--memory-budget", "1G", "--steps", "0"]);
    assert_one_line_error(&out, "");
}
