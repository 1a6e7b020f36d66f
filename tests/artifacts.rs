//! Compiled artifacts (`kvjit compile`): running from an artifact gives the
//! same outputs and caches, bit for bit, as running from the graph file; the
//! artifact's weights are borrowed from the mapped file in the kernels'
//! packed layout (no packing at load); a stale, foreign, truncated or
//! tampered artifact is refused with a clear error, never run.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::chain_graph;
use kvjit::artifact::{
    ARTIFACT_ALIGN, ARTIFACT_MAGIC, ArtifactHeader, KVJIT_BUILD, cpu_features, cpu_requirements, missing_cpu_features,
};
use kvjit::scenario::Scenario;
use kvjit::{
    ArtifactError, CompileOptions, DType, Error, Executor, Graph, KernelImpl, Registry, RunOutput, Target, ValueDef,
    WeightLoad, compile, load_artifact, load_artifact_with, load_graph_with, save_graph, standard_registry,
    write_artifact,
};
use kvjit_testkit::{assert_caches_identical, assert_outputs_identical};

fn kvjit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvjit")).args(args).output().expect("the kvjit binary starts")
}

/// Run prefill then two decode steps; every step's outputs and the caches.
fn run_steps(exe: &kvjit::Executable, graph: &Graph) -> (Vec<RunOutput>, Scenario) {
    let executor = Executor::new(kvjit::DeviceContextPtr::cpu(2).unwrap());
    let mut scenario = Scenario::prefill(graph, 11).unwrap();
    let mut outs = Vec::new();
    for step in 0..3 {
        if step > 0 {
            scenario.next_decode_step().unwrap();
        }
        outs.push(executor.run(exe, &scenario.inputs, &mut scenario.caches).unwrap());
        scenario.advance().unwrap();
    }
    (outs, scenario)
}

/// A chain graph saved as a graph file (weights in a safetensors file
/// beside it) and compiled into `model.kvjit` in the same folder.
fn saved_model(dir: &Path, registry: &Registry, dtype: DType) -> (PathBuf, PathBuf) {
    let graph_path = dir.join("model.json");
    save_graph(&chain_graph(registry, dtype), &graph_path).unwrap();
    let graph = load_graph_with(&graph_path, registry.ops(), WeightLoad::Map).unwrap();
    let artifact = dir.join("model.kvjit");
    let summary = write_artifact(&graph, registry, &CompileOptions::default(), &artifact, Some(&graph_path)).unwrap();
    assert_eq!((summary.prepared, summary.plain), (2, 1), "two packed weights, one u32 layer index");
    (graph_path, artifact)
}

#[test]
fn running_from_an_artifact_equals_running_from_the_graph_file_bit_for_bit() {
    let registry = standard_registry();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let dir = tempfile::tempdir().unwrap();
        let (graph_path, artifact) = saved_model(dir.path(), &registry, dtype);
        for weights in [WeightLoad::Map, WeightLoad::Copy] {
            let graph = load_graph_with(&graph_path, registry.ops(), weights).unwrap();
            let from_graph = compile(&graph, &registry, &CompileOptions::default()).unwrap();
            let (expected, expected_scenario) = run_steps(&from_graph, &graph);

            let loaded = load_artifact_with(&artifact, &registry, weights).unwrap();
            let from_artifact = loaded.compile(&registry).unwrap();
            let (got, got_scenario) = run_steps(&from_artifact, &loaded.graph);
            eprintln!("checking {dtype} with {weights:?} weights");
            // (The helpers name the tensor that differs; the loop order
            // names dtype, load mode and step in the backtrace.)
            for (e, g) in expected.iter().zip(&got) {
                assert_outputs_identical(&g.outputs, &e.outputs);
            }
            assert_caches_identical(&got_scenario.caches, &expected_scenario.caches);
        }
    }
}

#[test]
fn artifact_weights_are_borrowed_from_the_mapping_in_the_kernels_layout() {
    let registry = standard_registry();
    let dir = tempfile::tempdir().unwrap();
    let (_, artifact) = saved_model(dir.path(), &registry, DType::BF16);
    let loaded = load_artifact(&artifact, &registry).unwrap();
    let prepared: Vec<_> = loaded
        .graph
        .constants()
        .filter_map(|(_, v)| match &v.def {
            ValueDef::Prepared { data } => Some(data.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(prepared.len(), 2);
    let exe = loaded.compile(&registry).unwrap();
    for (step, constant) in exe.steps().iter().zip(&prepared) {
        assert!(constant.data.is_mapped(), "the packed weight is borrowed from the file");
        let taken = step.kernel.prepared_constants();
        assert_eq!(taken.len(), 1);
        assert!(taken[0].1.data.shares_storage_with(&constant.data), "the kernel packed nothing at load");
        assert_eq!(taken[0].1.layout, constant.layout);
    }
}

/// The artifact's header and data section, to rewrite with a changed header.
fn read_artifact(path: &Path) -> (serde_json::Value, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let header_len = u64::from_le_bytes(bytes[8..16].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&bytes[16..16 + header_len]).unwrap();
    let data_start = (16 + header_len as u64).next_multiple_of(ARTIFACT_ALIGN) as usize;
    (header, bytes[data_start..].to_vec())
}

fn write_raw_artifact(path: &Path, header: &serde_json::Value, data: &[u8]) {
    let header = serde_json::to_vec(header).unwrap();
    let mut bytes = ARTIFACT_MAGIC.to_vec();
    bytes.extend_from_slice(&(header.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&header);
    bytes.resize((bytes.len() as u64).next_multiple_of(ARTIFACT_ALIGN) as usize, 0);
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

/// A change to an artifact's header and data section.
type Edit = Box<dyn FnOnce(&mut serde_json::Value, &mut Vec<u8>)>;

fn tampered(
    dir: &Path,
    original: &Path,
    name: &str,
    edit: impl FnOnce(&mut serde_json::Value, &mut Vec<u8>),
) -> PathBuf {
    let (mut header, mut data) = read_artifact(original);
    edit(&mut header, &mut data);
    let path = dir.join(name);
    write_raw_artifact(&path, &header, &data);
    path
}

fn load_error(path: &Path) -> String {
    match load_artifact(path, &standard_registry()).and_then(|a| a.compile(&standard_registry()).map(|_| ())) {
        Ok(()) => panic!("{} was accepted", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn stale_artifacts_are_refused_naming_what_differs() {
    let registry = standard_registry();
    let dir = tempfile::tempdir().unwrap();
    let (_, artifact) = saved_model(dir.path(), &registry, DType::F32);
    // The unchanged rewrite loads: the helpers themselves change nothing.
    let same = tampered(dir.path(), &artifact, "same.kvjit", |_, _| {});
    load_artifact(&same, &registry).unwrap().compile(&registry).unwrap();

    // What the kernels need of the CPU is recorded, not the writer's CPU.
    let header: ArtifactHeader = serde_json::from_value(read_artifact(&artifact).0).unwrap();
    assert_eq!(header.cpu_tier, kvjit::widest_cpu_tier().requested(), "auto is recorded as the tier it resolved to");
    assert_eq!(header.cpu_requires, cpu_requirements(Target::Cpu, KernelImpl::Fast, header.cpu_tier));
    assert_eq!((header.build.as_str(), header.build.len()), (KVJIT_BUILD, 20));
    // Another build of the same release (same packing, same keys) loads it.
    let other_build = tampered(dir.path(), &artifact, "build.kvjit", |h, _| h["build"] = "src-0123456789abcdef".into());
    load_artifact(&other_build, &registry).unwrap().compile(&registry).unwrap();

    let cases: Vec<(&str, Edit, &str)> = vec![
        ("version", Box::new(|h, _| h["kvjit_version"] = "0.0.1-other".into()), "made for kvjit 0.0.1-other"),
        (
            "features",
            Box::new(|h, _| h["cpu_requires"].as_array_mut().unwrap().push("avx-9000".into())),
            "CPU features",
        ),
        ("features named", Box::new(|h, _| h["cpu_requires"][0] = "z80".into()), "but this is a CPU without z80;"),
        ("format", Box::new(|h, _| h["version"] = 99.into()), "artifact version 99"),
        (
            "layout version",
            Box::new(|h, _| h["layout_version"] = "0000000000000000".into()),
            "made for packed layout version 0000000000000000",
        ),
        // The first key that differs, not the whole lists.
        ("keys", Box::new(|h, _| h["kernel_keys"][0] = "other.key".into()), "(step 0: other.key)"),
    ];
    for (name, edit, expected) in cases {
        let path = tampered(dir.path(), &artifact, &format!("{name}.kvjit"), edit);
        let message = load_error(&path);
        assert!(message.contains("stale artifact") && message.contains(expected), "{name}: {message}");
    }
    let stale = tampered(dir.path(), &artifact, "stale.kvjit", |h, _| h["kvjit_version"] = "0.0.1-other".into());
    assert!(matches!(load_artifact(&stale, &registry), Err(Error::Artifact(ArtifactError::Stale { .. }))));
}

#[test]
fn malformed_artifacts_are_refused_before_anything_is_mapped() {
    let registry = standard_registry();
    let dir = tempfile::tempdir().unwrap();
    let (graph_path, artifact) = saved_model(dir.path(), &registry, DType::F32);
    let header: ArtifactHeader = serde_json::from_value(read_artifact(&artifact).0).unwrap();
    assert_eq!(header.constants.len(), 3);
    let cases: Vec<(&str, Edit, &str)> = vec![
        ("truncated", Box::new(|_, d| d.truncate(d.len() / 2)), "run past the"),
        ("offset past the end", Box::new(|h, _| h["constants"][0]["offset"] = (1u64 << 40).into()), "run past the"),
        ("misaligned", Box::new(|h, _| h["constants"][0]["offset"] = 8.into()), "is not 4096-aligned"),
        (
            "overlapping",
            Box::new(move |h, _| h["constants"][1]["offset"] = h["constants"][0]["offset"].clone()),
            "overlap",
        ),
        ("size", Box::new(|h, _| h["constants"][0]["shape"] = serde_json::json!([3])), "takes 12"),
        (
            "overflow",
            Box::new(|h, _| h["constants"][0]["shape"] = serde_json::json!([4294967296u64, 4294967296u64, 16])),
            "has more elements than fit in memory",
        ),
        ("unknown field", Box::new(|h, _| h["extra"] = 1.into()), "unknown field"),
        (
            "undeclared constant",
            Box::new(|h, _| h["constants"][0]["name"] = "not_in_the_graph".into()),
            "constant 'not_in_the_graph' is stored, but the graph declares no constant of that name",
        ),
        ("wrong format", Box::new(|h, _| h["format"] = "kvjit-graph".into()), "header format"),
        (
            "layout",
            Box::new(|h, _| h["constants"][0]["layout"] = "fused_qkv.panels.v0".into()),
            "prepared weight: expected layout",
        ),
        (
            "reference build",
            Box::new(|h, _| h["implementation"] = "reference".into()),
            "which the kernel fused_qkv_bshd_paged.cpu",
        ),
    ];
    for (name, edit, expected) in cases {
        let path = tampered(dir.path(), &artifact, &format!("{name}.kvjit"), edit);
        let message = load_error(&path);
        assert!(message.contains(expected), "{name}: {message}");
    }
    // Not an artifact at all: a graph file, a short file, a header length
    // past the end.
    assert!(load_error(&graph_path).contains("does not start with KVJITART"));
    let short = dir.path().join("short.kvjit");
    std::fs::write(&short, b"KVJIT").unwrap();
    assert!(load_error(&short).contains("too short"));
    let huge = dir.path().join("huge.kvjit");
    let mut bytes = ARTIFACT_MAGIC.to_vec();
    bytes.extend_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&huge, bytes).unwrap();
    assert!(load_error(&huge).contains("runs past the end"));
}

#[test]
fn the_cli_compiles_and_runs_an_artifact_and_rebuilds_a_stale_one_from_its_graph_file() {
    let registry = standard_registry();
    let dir = tempfile::tempdir().unwrap();
    let graph_path = dir.path().join("model.json");
    save_graph(&chain_graph(&registry, DType::BF16), &graph_path).unwrap();
    let artifact = dir.path().join("model.kvjit");
    let (g, a) = (graph_path.to_str().unwrap(), artifact.to_str().unwrap());
    let out = kvjit(&["compile", g, "-o", a]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("2 constant(s) in kernel layout"));

    let outputs = |args: &[&str], file: &str| -> PathBuf {
        let path = dir.path().join(file);
        let mut all = args.to_vec();
        all.extend(["--output", path.to_str().unwrap()]);
        let out = kvjit(&all);
        assert!(out.status.success(), "{all:?}: {}", String::from_utf8_lossy(&out.stderr));
        path
    };
    let from_graph = outputs(&["run", g], "graph.safetensors");
    let from_copy = outputs(&["run", g, "--weights", "copy"], "copy.safetensors");
    let from_artifact = outputs(&["run", a], "artifact.safetensors");
    let from_artifact_copy = outputs(&["run", a, "--weights", "copy"], "artifact-copy.safetensors");
    let bytes = |p: &Path| std::fs::read(p).unwrap();
    assert_eq!(bytes(&from_graph), bytes(&from_artifact), "artifact run differs from the graph-file run");
    assert_eq!(bytes(&from_graph), bytes(&from_copy), "copied weights differ from mapped ones");
    assert_eq!(bytes(&from_graph), bytes(&from_artifact_copy), "copied artifact weights differ");

    // --memory-budget applies to an artifact's buffers as to a graph file's.
    let over = kvjit(&["run", a, "--memory-budget", "1K"]);
    let err = String::from_utf8_lossy(&over.stderr);
    assert_eq!(over.status.code(), Some(1), "{err}");
    assert!(err.starts_with("error: graph needs") && err.contains("memory budget of 1024 bytes"), "{err}");

    let validated = kvjit(&["validate", a]);
    assert!(validated.status.success() && String::from_utf8_lossy(&validated.stdout).starts_with("ok: graph"));

    // Stale with its graph file beside it: rebuilt from the graph file, said so.
    let (mut header, data) = read_artifact(&artifact);
    header["kvjit_version"] = "0.0.1-other".into();
    write_raw_artifact(&artifact, &header, &data);
    let rebuilt = kvjit(&["run", a]);
    assert!(rebuilt.status.success(), "{}", String::from_utf8_lossy(&rebuilt.stderr));
    assert!(String::from_utf8_lossy(&rebuilt.stderr).contains("stale artifact; building from"));
    // Without it: one error line naming the mismatch.
    std::fs::remove_file(&graph_path).unwrap();
    let refused = kvjit(&["run", a]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1));
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error: ") && err.contains("stale artifact: made for kvjit 0.0.1-other"), "{err}");
}

#[test]
fn an_artifact_with_an_init_recipe_is_refused_before_the_recipe_is_materialized() {
    // The writer stores every constant's data; a recipe in an artifact's
    // graph can only be crafted, and would make the loader generate it (a
    // 68 KB artifact once made 256 MiB this way).
    let registry = standard_registry();
    let dir = tempfile::tempdir().unwrap();
    let (_, artifact) = saved_model(dir.path(), &registry, DType::F32);
    let path = tampered(dir.path(), &artifact, "recipe.kvjit", |h, _| {
        h["graph"]["values"].as_array_mut().unwrap().push(serde_json::json!({
            "kind": "constant",
            "id": "v1000",
            "name": "unused",
            "dtype": "f32",
            "shape": [1u64 << 26],
            "init": {"seed": 1, "low": -1.0, "high": 1.0}
        }));
    });
    let message = match load_artifact(&path, &registry) {
        Ok(_) => panic!("an artifact with an init recipe was loaded (and its 256 MiB constant generated)"),
        Err(e) => e.to_string(),
    };
    assert!(message.contains("not a valid kvjit artifact"), "{message}");
    assert!(message.contains("constant 'unused' has an \"init\" recipe"), "{message}");
    let out = kvjit(&["validate", path.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error: ") && err.contains("constant 'unused' has an \"init\" recipe"), "{err}");
}

#[test]
fn the_committed_fuzz_seed_artifacts_load_wherever_their_kernels_run() {
    // fuzz/corpus/artifact holds the tiny chain per dtype pair on each CPU
    // tier; each must load and compile on any host with its tier's
    // features (else fuzzing them never gets past the header). A seed
    // this build calls stale needs writing again:
    // `cargo run --manifest-path fuzz/Cargo.toml --example write_seeds`.
    let registry = standard_registry();
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/artifact");
    let mut tiers = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(&corpus).unwrap() {
        let path = entry.unwrap().path();
        let required: Vec<String> = serde_json::from_value(read_artifact(&path).0["cpu_requires"].clone())
            .unwrap_or_else(|e| panic!("{}: no cpu_requires ({e}); write the seeds again", path.display()));
        // Host-independent: what it needs, an AVX2-only x86-64 has (as
        // does an AVX-512 one, this machine when the seeds were written).
        let avx2_only = ["x86_64", "sse4.1", "avx", "avx2", "fma", "f16c"].map(String::from);
        let missing = missing_cpu_features(&required, &avx2_only);
        assert!(missing.is_empty(), "{}: an AVX2-only x86-64 lacks {missing:?}", path.display());
        let runs_here = missing_cpu_features(&required, &cpu_features()).is_empty();
        match load_artifact(&path, &registry).and_then(|a| a.compile(&registry).map(|_| a.options.build.cpu_tier)) {
            Ok(tier) => {
                assert!(runs_here, "{}", path.display());
                tiers.insert(tier);
            }
            Err(e) if !runs_here => assert!(e.to_string().contains("CPU features"), "{}: {e}", path.display()),
            Err(e) => panic!("{}: {e}; write the seeds again", path.display()),
        }
    }
    let expected = if kvjit_jit::microkernel::avx2_available() { 2 } else { 1 };
    assert_eq!(tiers.len(), expected, "seeds of every tier this CPU runs: {tiers:?}");
}

/// A whole model (`tiny_llama`: gather → 2 decoder layers → logits with the
/// tied embedding) from an artifact equals the model from its graph, bit
/// for bit, fused and unfused: every matmul weight is stored in its
/// kernel's packed layout — except SwiGLU's gate and up (one packed tensor
/// of both, which no single constant is) and the tied embedding (the
/// gather reads it plain); the norms and the RoPE table stay plain; and
/// the artifact records whether it fuses.
#[test]
fn a_whole_model_runs_from_its_artifact_fused_or_not() {
    use kvjit::models::llama::{LlamaConfig, model_graph};
    let registry = standard_registry();
    let graph = model_graph(&LlamaConfig::tiny(), registry.ops()).unwrap();
    for (fuse, prepared, plain) in [(true, 6, 11), (false, 10, 7)] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.kvjit");
        let options = CompileOptions { fuse, ..CompileOptions::default() };
        let summary = write_artifact(&graph, &registry, &options, &path, None).unwrap();
        assert_eq!((summary.prepared, summary.plain), (prepared, plain), "fuse = {fuse}");
        let loaded = load_artifact(&path, &registry).unwrap();
        assert_eq!(loaded.header.fuse, fuse);
        assert_eq!(loaded.options.fuse, fuse);
        let from_artifact = loaded.compile(&registry).unwrap();
        let fused_steps = from_artifact.steps().iter().filter(|s| s.label.contains('+')).count();
        assert_eq!(fused_steps > 0, fuse, "the artifact compiles as it was written");
        let (got, got_scenario) = run_steps(&from_artifact, &loaded.graph);
        let (expected, expected_scenario) = run_steps(&compile(&graph, &registry, &options).unwrap(), &graph);
        for (e, g) in expected.iter().zip(&got) {
            assert_outputs_identical(&g.outputs, &e.outputs);
        }
        assert_caches_identical(&got_scenario.caches, &expected_scenario.caches);
    }
}
