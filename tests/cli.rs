//! The `kvjit` binary end to end: exit codes, one-line errors, and the
//! contents of `--output` checked against a direct reference call.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kvjit::fused_qkv::reference::fused_qkv_matmul;
use kvjit::{
    DType, PagedKVCacheCollection, Tensor, ValueDef, load_graph, read_safetensors, standard_registry, write_safetensors,
};
use rand::{SeedableRng, seq::SliceRandom};

fn kvjit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvjit")).args(args).output().expect("the kvjit binary starts")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn example(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples").join(name).display().to_string()
}

/// Exit status 1 and exactly one line on stderr, starting with `error: `.
fn assert_one_line_error(out: &Output, needle: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line expected: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(err.contains(needle), "'{needle}' not in: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn default_run_is_the_8b_decoder_layer_with_its_matmuls_fused() {
    let out = kvjit(&["run", "--steps", "1", "--batch", "2", "--seq", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("graph 'llama3_8b_decoder_layer'"), "{text}");
    let tier = kvjit::widest_cpu_tier();
    for key in [
        "rms_norm.cpu.bf16.h4096.rowsany.".to_string(),
        format!("fused_qkv_bshd_paged.cpu-{tier}.bf16.k4096.q4096.hkv8.d128.p16.l1.kvbf16.bany.sany [jit]"),
        "reshape.cpu.bf16.o0in0.o1in1.o2x32.o3x128 [view]".into(),
        "fused_qk_rope_paged.cpu.bf16.hq32.hkv8.d128.p16.l1.kvbf16.il0.bany.sany [jit]".into(),
        format!("mha_padded_paged.cpu-{tier}.bf16.hq32.hkv8.d128.p16.l1.kvbf16.causal1.w0."),
        format!("matmul_add.cpu-{tier}.bf16.k4096.n4096.rowsany.tb1 [jit]"),
        format!("swiglu_matmul.cpu-{tier}.bf16.k4096.n14336.rowsany.tb1 [jit]"),
        format!("matmul_add.cpu-{tier}.bf16.k14336.n4096.rowsany.tb1 [jit]"),
    ] {
        assert!(text.contains(&key), "{key} not in {text}");
    }
    assert!(text.contains("output 'hidden_state_out': bf16[2, 1, 4096] checksum"), "{text}");
    assert!(text.contains("tokens written"), "{text}");
    // Unfused, the same layer runs every node as its own kernel, and the
    // output agrees within bf16 rounding (the checksums are printed to six
    // decimals of sums over 8192 values; compare the magnitudes' sums).
    let unfused = kvjit(&["run", "--steps", "1", "--batch", "2", "--seq", "3", "--no-fuse"]);
    assert!(unfused.status.success(), "{}", stderr(&unfused));
    let unfused_text = stdout(&unfused);
    assert!(!unfused_text.contains("swiglu_matmul") && unfused_text.contains("silu.cpu.bf16"), "{unfused_text}");
    let abs_sum = |text: &str| -> f64 {
        let line = text.lines().find(|l| l.starts_with("output 'hidden_state_out'")).unwrap();
        line.split("abs_sum=").nth(1).unwrap().trim().parse().unwrap()
    };
    let (fused, unfused) = (abs_sum(&text), abs_sum(&unfused_text));
    assert!((fused - unfused).abs() <= 0.01 * unfused, "fused {fused} vs unfused {unfused}");
}

/// `--bind batch=N` alone sizes the example scenario too (it once kept
/// its default batch of 4 and failed the bound input shape).
#[test]
fn a_bound_batch_sizes_the_example_scenario() {
    let out = kvjit(&["run", &example("small_two_layers.json"), "--bind", "batch=2", "--steps", "0"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let first_step = stdout(&out).lines().find(|l| l.starts_with("0 ")).map(str::to_string).unwrap_or_default();
    let valid: Vec<&str> = first_step.split('[').nth(1).and_then(|v| v.split(']').next()).unwrap().split(',').collect();
    assert_eq!(valid.len(), 2, "two sequences' valid lengths: {first_step}");
}

#[test]
fn same_seed_same_checksum_and_other_seed_differs() {
    let checksum = |seed: &str| {
        let out = kvjit(&["run", &example("small_two_layers.json"), "--seed", seed, "--steps", "1"]);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out).lines().filter(|l| l.contains("checksum")).map(str::to_string).collect::<Vec<_>>()
    };
    let first = checksum("3");
    assert_eq!(first.len(), 2);
    assert_eq!(first, checksum("3"));
    assert_ne!(first, checksum("4"));
}

#[test]
fn decode_steps_grow_every_sequence_by_one_token_each() {
    let dir = tempfile::tempdir().unwrap();
    let lengths_after = |steps: &str| {
        let path = dir.path().join(format!("out{steps}.safetensors"));
        let out =
            kvjit(&["run", &example("small_two_layers.json"), "--steps", steps, "--output", path.to_str().unwrap()]);
        assert!(out.status.success(), "{}", stderr(&out));
        read_safetensors(&path).unwrap()["kv_cache.cache_lengths"].to_u32_vec().unwrap()
    };
    let after_prefill = lengths_after("0");
    let after_three = lengths_after("3");
    assert_eq!(after_prefill.len(), 4);
    for (a, b) in after_prefill.iter().zip(&after_three) {
        assert_eq!(b - a, 3);
    }
}

/// Inputs for the small example written to a file, and what a direct
/// reference call makes of them.
struct GivenInputs {
    path: PathBuf,
    expected_q: Vec<Tensor>,
    expected_cache: PagedKVCacheCollection,
    valid: Vec<u32>,
}

fn given_inputs(dir: &Path) -> GivenInputs {
    let registry = standard_registry();
    let graph = load_graph(Path::new(&example("small_two_layers.json")), registry.ops()).unwrap();
    let weights: Vec<Tensor> = graph
        .constants()
        .map(|(_, v)| match &v.def {
            ValueDef::Constant { data, .. } => (**data).clone(),
            _ => unreachable!(),
        })
        .collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let params = graph.kv_caches().next().unwrap().1.ty.as_kv_cache().unwrap().params();
    let (batch, seq) = (3, 5);
    let mut cache = PagedKVCacheCollection::new(params, 48, batch, 16).unwrap();
    let mut order: Vec<u32> = (0..48).collect();
    order.shuffle(&mut rng);
    cache.set_allocation_order(order).unwrap();
    cache.set_blocks(Tensor::random(DType::F32, cache.blocks().shape(), &mut rng, -1.0, 1.0).unwrap()).unwrap();
    cache.reserve(&[9, 0, 6]).unwrap();
    cache.advance(&[9, 0, 6]).unwrap();
    let valid = vec![5u32, 2, 4];
    cache.reserve(&valid).unwrap();
    let hidden = Tensor::random(DType::F32, &[batch, seq, 64], &mut rng, -1.0, 1.0).unwrap();
    let valid_t = Tensor::from_vec(&[batch], valid.clone()).unwrap();

    let mut named: Vec<(String, Tensor)> = vec![
        ("hidden_state".into(), hidden.clone()),
        ("valid_lengths".into(), valid_t.clone()),
        ("layers.0.layer_idx".into(), Tensor::scalar_u32(0)),
        ("layers.1.layer_idx".into(), Tensor::scalar_u32(1)),
    ];
    named.extend(cache.to_tensors("kv_cache").unwrap());
    let path = dir.join("inputs.safetensors");
    write_safetensors(&path, named.iter().map(|(n, t)| (n.as_str(), t))).unwrap();

    let mut expected_q = Vec::new();
    for (layer, weight) in weights.iter().enumerate() {
        let mut q = Tensor::zeros(DType::F32, &[batch, seq, 64]).unwrap();
        let layer_idx = Tensor::scalar_u32(layer as u32);
        fused_qkv_matmul(&hidden, weight, &mut cache, &layer_idx, &valid_t, &mut q).unwrap();
        expected_q.push(q);
    }
    GivenInputs { path, expected_q, expected_cache: cache, valid }
}

fn run_given(dir: &Path, given: &GivenInputs, kernel: &str) -> BTreeMap<String, Tensor> {
    let out_path = dir.join(format!("out-{kernel}.safetensors"));
    let out = kvjit(&[
        "run",
        &example("small_two_layers.json"),
        "--inputs",
        given.path.to_str().unwrap(),
        "--output",
        out_path.to_str().unwrap(),
        "--steps",
        "0",
        "--kernel",
        kernel,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains(&format!("[{kernel}]")), "{}", stdout(&out));
    read_safetensors(&out_path).unwrap()
}

/// Largest |a - b| over two float tensors of one shape.
fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.shape(), b.shape());
    a.to_f32_vec().unwrap().iter().zip(b.to_f32_vec().unwrap()).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn jit_output_file_matches_the_reference_within_tolerance() {
    let dir = tempfile::tempdir().unwrap();
    let given = given_inputs(dir.path());
    let written = run_given(dir.path(), &given, "jit");
    // K = 64 products of values below 1 in magnitude: f32 rounding differences
    // (FMA, summation order) stay far below 1e-4.
    assert!(max_abs_diff(&written["layers.0.q"], &given.expected_q[0]) < 1e-4);
    assert!(max_abs_diff(&written["layers.1.q"], &given.expected_q[1]) < 1e-4);
    assert!(max_abs_diff(&written["kv_cache.blocks"], given.expected_cache.blocks()) < 1e-4);
}

#[test]
fn output_file_holds_what_a_direct_reference_call_computes() {
    let dir = tempfile::tempdir().unwrap();
    let given = given_inputs(dir.path());
    let written = run_given(dir.path(), &given, "reference");
    assert_eq!(written["layers.0.q"], given.expected_q[0]);
    assert_eq!(written["layers.1.q"], given.expected_q[1]);
    assert_eq!(&written["kv_cache.blocks"], given.expected_cache.blocks());
    let advanced: Vec<u32> =
        given.expected_cache.cache_lengths().iter().zip(&given.valid).map(|(c, v)| c + v).collect();
    assert_eq!(written["kv_cache.cache_lengths"].to_u32_vec().unwrap(), advanced);
    assert_eq!(written["kv_cache.lookup_table"].to_u32_vec().unwrap(), given.expected_cache.lookup_table());
}

#[test]
fn bad_inputs_files_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let given = given_inputs(dir.path());
    let graph = example("small_two_layers.json");

    let bytes = std::fs::read(&given.path).unwrap();
    let truncated = dir.path().join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    assert_one_line_error(
        &kvjit(&["run", &graph, "--inputs", truncated.to_str().unwrap()]),
        "not a valid safetensors file",
    );

    let mut tensors: BTreeMap<String, Tensor> = read_safetensors(&given.path).unwrap();
    tensors.remove("kv_cache.lookup_table");
    let missing = dir.path().join("missing.safetensors");
    write_safetensors(&missing, tensors.iter().map(|(n, t)| (n.as_str(), t))).unwrap();
    assert_one_line_error(&kvjit(&["run", &graph, "--inputs", missing.to_str().unwrap()]), "kv_cache.lookup_table");

    let mut tensors: BTreeMap<String, Tensor> = read_safetensors(&given.path).unwrap();
    tensors.insert("layers.1.layer_idx".into(), Tensor::scalar_u32(9));
    let bad_layer = dir.path().join("bad_layer.safetensors");
    write_safetensors(&bad_layer, tensors.iter().map(|(n, t)| (n.as_str(), t))).unwrap();
    assert_one_line_error(
        &kvjit(&["run", &graph, "--inputs", bad_layer.to_str().unwrap()]),
        "layer_idx 9 out of range: cache has 2 layers",
    );
}

#[test]
fn bad_graphs_and_arguments_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    assert_one_line_error(&kvjit(&["run", "/nonexistent/graph.json"]), "/nonexistent/graph.json");
    let bad_json = dir.path().join("bad.json");
    std::fs::write(&bad_json, "{\"format\": \"kvjit-graph\", ").unwrap();
    assert_one_line_error(&kvjit(&["validate", bad_json.to_str().unwrap()]), "malformed graph file");
    let future = dir.path().join("future.json");
    std::fs::write(&future, "{\"format\": \"kvjit-graph\", \"version\": 99}").unwrap();
    assert_one_line_error(&kvjit(&["inspect", future.to_str().unwrap()]), "version 99 is not supported");
    // --batch and a --bind of batch that disagree: refused naming both.
    assert_one_line_error(
        &kvjit(&["run", &example("small_two_layers.json"), "--batch", "3", "--bind", "batch=2"]),
        "--batch 3 disagrees with --bind batch=2",
    );
    // Missing arguments are named on the one line.
    assert_one_line_error(&kvjit(&["generate"]), "not provided: --prompt <PROMPT> <MODEL>");
    let unknown_flag = kvjit(&["run", "--no-such-flag"]);
    assert_eq!(unknown_flag.status.code(), Some(1));
    assert_eq!(stderr(&unknown_flag).lines().count(), 1, "{}", stderr(&unknown_flag));
    assert_one_line_error(&kvjit(&["inspect", &example("small_two_layers.json"), "--bind", "heads=2"]), "heads");
    // A thread count past what a pool takes: one line, before a thread is
    // spawned (100 000 threads once aborted the process).
    assert_one_line_error(&kvjit(&["run", "--threads", "100000"]), "at most 1024 threads");
    // An output file that cannot be written: refused before the run (no
    // step table printed), the file left alone where it exists.
    let nowhere = dir.path().join("no_such_dir").join("out.safetensors");
    let out = kvjit(&["run", &example("small_two_layers.json"), "--output", nowhere.to_str().unwrap()]);
    assert_one_line_error(&out, "--output");
    assert!(stdout(&out).is_empty(), "ran before refusing: {}", stdout(&out));
}

/// A reader that goes away (`kvjit run | head`) ends the run quietly with
/// the status of a death by SIGPIPE (141), not a panic on the closed
/// stdout.
#[cfg(unix)]
#[test]
fn a_closed_stdout_ends_the_run_quietly() {
    use std::io::Read as _;
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvjit"))
        .args(["run", "--steps", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the kvjit binary starts");
    // Closed before the first line is printed (the built-in layer takes
    // about a second to compile first).
    drop(child.stdout.take());
    let status = child.wait().unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert_eq!(status.code(), Some(141), "stderr: {err}");
    assert!(err.is_empty(), "nothing on stderr: {err}");
}

/// `--target cuda` is a one-line `CUDA target unavailable: …` error where
/// there is no usable device, and a successful run where there is one (this
/// test once asserted the error unconditionally, failing on GPU machines).
#[test]
fn the_cuda_target_runs_or_says_why_it_is_unavailable() {
    let out = kvjit(&["run", &example("small_two_layers.json"), "--target", "cuda", "--steps", "1"]);
    match kvjit::cuda_availability() {
        Err(reason) => {
            assert_one_line_error(&out, "CUDA target unavailable:");
            assert!(stderr(&out).contains(&reason.to_string()), "{} vs {reason}", stderr(&out));
            eprintln!("skipped: no CUDA device ({reason})");
        }
        Ok(()) => {
            assert!(out.status.success(), "a CUDA device is present, yet: {}", stderr(&out));
            assert_eq!(stdout(&out).matches("checksum").count(), 2, "{}", stdout(&out));
        }
    }
}

/// An input whose rank does not fit the op (`layer_idx` declared `[1]`, not
/// a scalar) is refused by `validate`, not first by `run`.
#[test]
fn validate_refuses_an_input_of_the_wrong_rank() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(example("small_two_layers.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let entry = json["values"].as_array_mut().unwrap().iter_mut().find(|v| v["name"] == "layers.1.layer_idx").unwrap();
    entry["shape"] = serde_json::json!([1]);
    let path = dir.path().join("rank.json");
    std::fs::write(&path, json.to_string()).unwrap();
    let path = path.to_str().unwrap();
    assert_one_line_error(&kvjit(&["validate", path]), "argument 'layer_idx': expected u32[] (a scalar), got u32[1]");
    assert_one_line_error(&kvjit(&["run", path]), "argument 'layer_idx'");
}

/// `kvjit compare` (what scripts/gpu-check.sh runs on the CUDA and CPU
/// `--output` files): the JIT and reference runs of one graph agree; a file
/// with one element of one tensor changed fails with one line naming that
/// tensor and its max error.
#[test]
fn compare_accepts_agreeing_runs_and_names_the_first_tensor_that_differs() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str| dir.path().join(name).display().to_string();
    for (kernel, out) in [("jit", file("jit.safetensors")), ("reference", file("ref.safetensors"))] {
        let run =
            kvjit(&["run", &example("small_two_layers.json"), "--kernel", kernel, "--steps", "2", "--output", &out]);
        assert!(run.status.success(), "{}", stderr(&run));
    }
    let same = kvjit(&["compare", &file("jit.safetensors"), &file("ref.safetensors")]);
    assert!(same.status.success(), "{}{}", stdout(&same), stderr(&same));
    let text = stdout(&same);
    assert!(text.contains("ok: ") && !text.contains("MISMATCH"), "{text}");
    assert!(text.contains("tensor 'kv_cache.blocks'") && text.contains("tensor 'layers.1.q'"), "{text}");

    let mut tensors = read_safetensors(Path::new(&file("ref.safetensors"))).unwrap();
    let q = tensors.get_mut("layers.1.q").unwrap();
    let mut values = q.to_f32_vec().unwrap();
    values[3] += 1.0;
    *q = Tensor::from_f32(q.dtype(), q.shape(), &values).unwrap();
    write_safetensors(Path::new(&file("bad.safetensors")), tensors.iter().map(|(n, t)| (n.as_str(), t))).unwrap();
    let differ = kvjit(&["compare", &file("jit.safetensors"), &file("bad.safetensors")]);
    assert_one_line_error(&differ, "1 of ");
    assert!(stderr(&differ).contains("first: tensor 'layers.1.q' (f32["), "{}", stderr(&differ));
    assert!(stderr(&differ).contains("at element 3"), "{}", stderr(&differ));
    assert!(stdout(&differ).contains("MISMATCH tensor 'layers.1.q'"), "{}", stdout(&differ));
}

#[test]
fn validate_and_inspect_describe_the_graph() {
    let graph = example("small_two_layers.json");
    let out = kvjit(&["validate", &graph]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "ok: graph 'small_two_layers' is valid (2 nodes, 2 outputs)");

    let out = kvjit(&["inspect", &graph, "--bind", "batch=2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    // One canonical name: the key specialize gives a node names the CPU
    // tier, and is the key its kernel is built and compiled under.
    let key = format!("fused_qkv_bshd_paged.cpu-{}.f32.k64.q64.hkv2.d16.p4.l2.kvf32.b2.sany", kvjit::widest_cpu_tier());
    assert_eq!(text.matches(&format!("kernel: {key}")).count(), 2, "{text}");
    assert_eq!(text.matches(&format!("{key} [jit]")).count(), 2, "{text}");
    assert!(text.contains("f32[2, seq, 64]"), "{text}");
    assert!(text.contains("layers.1.q = "), "{text}");

    let help = kvjit(&["--help"]);
    assert!(help.status.success());
    assert!(stdout(&help).contains("inspect"));
}

/// `--cpu-tier` picks the JIT kernels' code tier: the key names it, both
/// tiers agree with the reference run, an artifact runs on the tier it was
/// compiled for (and refuses another), and an unknown tier is a one-line
/// error.
#[test]
fn cpu_tier_option_picks_the_tier_and_every_tier_agrees_with_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str| dir.path().join(name).display().to_string();
    let graph = example("small_two_layers.json");
    let reference =
        kvjit(&["run", &graph, "--kernel", "reference", "--steps", "1", "--output", &file("reference.safetensors")]);
    assert!(reference.status.success(), "{}", stderr(&reference));
    let mut tiers = vec!["cranelift".to_string()];
    if kvjit::widest_cpu_tier() != kvjit::CodeTier::Cranelift {
        tiers.push(kvjit::widest_cpu_tier().to_string());
    }
    for tier in &tiers {
        let out = file(&format!("{tier}.safetensors"));
        let run = kvjit(&["run", &graph, "--cpu-tier", tier, "--steps", "1", "--output", &out]);
        assert!(run.status.success(), "{}", stderr(&run));
        assert!(stdout(&run).contains(&format!("fused_qkv_bshd_paged.cpu-{tier}.f32.")), "{}", stdout(&run));
        let same = kvjit(&["compare", &out, &file("reference.safetensors")]);
        assert!(same.status.success(), "{tier}: {}{}", stdout(&same), stderr(&same));
    }

    let artifact = file("model.kvjit");
    let compiled = kvjit(&["compile", &graph, "-o", &artifact, "--cpu-tier", "cranelift"]);
    assert!(compiled.status.success(), "{}", stderr(&compiled));
    let run = kvjit(&["run", &artifact, "--steps", "1"]);
    assert!(run.status.success(), "{}", stderr(&run));
    assert!(stdout(&run).contains("fused_qkv_bshd_paged.cpu-cranelift.f32."), "{}", stdout(&run));
    if tiers.len() > 1 {
        let other = kvjit(&["run", &artifact, "--steps", "1", "--cpu-tier", &tiers[1]]);
        assert_one_line_error(&other, "the artifact was compiled for --cpu-tier cranelift");
    }
    let unknown = kvjit(&["run", &graph, "--cpu-tier", "avx512"]);
    assert!(!unknown.status.success());
    assert!(stderr(&unknown).contains("unknown CPU tier 'avx512'"), "{}", stderr(&unknown));
}

#[test]
fn the_built_in_step_runs_on_an_fp8_cache_and_its_files_carry_the_scales() {
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("first.safetensors");
    let out = kvjit(&[
        "run",
        "--kv-cache-dtype",
        "f8e4m3",
        "--steps",
        "0",
        "--batch",
        "2",
        "--seq",
        "3",
        "--output",
        first.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for op in ["fused_qkv_bshd_paged", "fused_qk_rope_paged", "mha_padded_paged"] {
        assert!(text.lines().any(|l| l.contains(op) && l.contains(".kvf8e4m3.g128.")), "{op} not FP8 in {text}");
    }
    let tensors = read_safetensors(&first).unwrap();
    let scales = &tensors["kv_cache.scales"];
    assert_eq!(scales.dtype(), DType::F32);
    assert_eq!(tensors["kv_cache.blocks"].dtype(), DType::F8E4M3);
    assert_eq!(scales.shape()[..5], tensors["kv_cache.blocks"].shape()[..5]);
    assert_eq!(scales.shape()[5], 1, "D = 128 = g: one scale per token and head");
    assert!(scales.to_f32_vec().unwrap().iter().all(|s| s.is_finite() && *s >= 0.0));
    // The cache it wrote, with a decode step's inputs, is a valid input.
    let mut next: BTreeMap<String, Tensor> =
        tensors.iter().filter(|(n, _)| n.starts_with("kv_cache.")).map(|(n, t)| (n.clone(), t.clone())).collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    next.insert("hidden_state".into(), Tensor::random(DType::BF16, &[2, 1, 4096], &mut rng, -1.0, 1.0).unwrap());
    next.insert("valid_lengths".into(), Tensor::from_vec(&[2], vec![1u32, 1]).unwrap());
    next.insert("layer_idx".into(), Tensor::scalar_u32(0));
    let inputs = dir.path().join("next.safetensors");
    write_safetensors(&inputs, next.iter().map(|(n, t)| (n.as_str(), t))).unwrap();
    let second = dir.path().join("second.safetensors");
    let out = kvjit(&[
        "run",
        "--kv-cache-dtype",
        "f8e4m3",
        "--steps",
        "0",
        "--inputs",
        inputs.to_str().unwrap(),
        "--output",
        second.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let after = read_safetensors(&second).unwrap();
    assert_ne!(after["kv_cache.scales"], tensors["kv_cache.scales"], "the decode step wrote its tokens' scales");
    // Without its scales the cache is refused with one line.
    let mut missing = tensors.clone();
    missing.remove("kv_cache.scales");
    let broken = dir.path().join("broken.safetensors");
    write_safetensors(&broken, missing.iter().map(|(n, t)| (n.as_str(), t))).unwrap();
    let out = kvjit(&["run", "--kv-cache-dtype", "f8e4m3", "--steps", "0", "--inputs", broken.to_str().unwrap()]);
    assert_one_line_error(&out, "kv_cache.scales");
}

#[test]
fn the_example_scenario_refuses_caches_over_the_memory_limit_before_allocating_them() {
    // The graph's kv_cache declaration sizes the caches `kvjit run` makes
    // for its example scenario: 600000 pages of 2048 bytes (and a u32 of
    // page order each) are 1.23 GB, over the 1 GiB default limit.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big_cache.json");
    let text = std::fs::read_to_string(example("small_two_layers.json")).unwrap();
    let big = text.replace("\"num_pages\": 48", "\"num_pages\": 600000");
    assert_ne!(big, text);
    std::fs::write(&path, big).unwrap();
    let out = kvjit(&["run", path.to_str().unwrap(), "--steps", "0"]);
    // Pages, plus the page table of 4 sequences of 16 pages (and lengths).
    assert_one_line_error(&out, "KV caches need 1231200272 bytes (cache 'kv_cache': 1231200272 bytes)");
    assert!(stderr(&out).contains("more than the memory budget of 1073741824 bytes"), "{}", stderr(&out));
    assert!(stdout(&out).is_empty(), "nothing ran: {}", stdout(&out));

    // The check counts what the caches take, exactly (48 pages of 2052
    // bytes and the 272-byte table), then what the inputs take.
    let graph = load_graph(Path::new(&example("small_two_layers.json")), standard_registry().ops()).unwrap();
    let needed = 48 * 2052 + 272;
    let err = kvjit::scenario::Scenario::prefill_within(&graph, 7, 4, 8, needed - 1).err().expect("over the budget");
    assert!(err.to_string().contains(&format!("KV caches need {needed} bytes")), "{err}");
    let err = kvjit::scenario::Scenario::prefill_within(&graph, 7, 4, 8, needed).err().expect("no room for inputs");
    assert!(err.to_string().contains("KV caches and inputs need"), "{err}");
    let mut scenario = None;
    for budget in needed..needed + (1 << 20) {
        if let Ok(made) = kvjit::scenario::Scenario::prefill_within(&graph, 7, 4, 8, budget) {
            scenario = Some((made, budget));
            break;
        }
    }
    let (scenario, budget) = scenario.expect("a budget that holds the caches and inputs");
    let cache = &scenario.caches["kv_cache"];
    let tables = 4 * (cache.lookup_table().len() + cache.cache_lengths().len() + cache.num_pages());
    assert_eq!((cache.blocks().as_bytes().len() + tables) as u64, needed);
    let inputs: usize = scenario.inputs.values().map(|t| t.as_bytes().len()).sum();
    assert_eq!(budget, needed + inputs as u64, "the smallest budget that runs is caches plus inputs");
}

/// A graph with no hidden-state input (here one `mo.add`) runs from given
/// inputs with `--steps 0`; asked for decode steps it is refused before its
/// first step, not aborted after it.
#[test]
fn given_inputs_without_a_hidden_state_make_no_decode_steps() {
    let dir = tempfile::tempdir().unwrap();
    let graph = dir.path().join("add.json");
    std::fs::write(
        &graph,
        r#"{"format":"kvjit-graph","version":1,"name":"add",
 "values":[{"kind":"input","id":"v0","name":"a","dtype":"f32","shape":[4]},
           {"kind":"input","id":"v1","name":"b","dtype":"f32","shape":[4]}],
 "nodes":[{"id":"n0","op":"mo.add","inputs":["v0","v1"],"outputs":["v2"]}],
 "outputs":[{"name":"sum","value":"v2"}]}"#,
    )
    .unwrap();
    let inputs = dir.path().join("in.safetensors");
    let a = Tensor::from_f32(DType::F32, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
    let b = Tensor::from_f32(DType::F32, &[4], &[0.5, -2.0, 7.0, 0.25]).unwrap();
    write_safetensors(&inputs, [("a", &a), ("b", &b)]).unwrap();
    let output = dir.path().join("out.safetensors");
    let (graph, inputs, output) = (graph.to_str().unwrap(), inputs.to_str().unwrap(), output.to_str().unwrap());
    let once = kvjit(&["run", graph, "--inputs", inputs, "--steps", "0", "--output", output]);
    assert!(once.status.success(), "{}", stderr(&once));
    let sum = read_safetensors(Path::new(output)).unwrap()["sum"].to_f32_vec().unwrap();
    assert_eq!(sum, [1.5, 0.0, 10.0, 4.25]);
    let decode = kvjit(&["run", graph, "--inputs", inputs, "--steps", "2"]);
    assert_one_line_error(&decode, "no hidden-state input");
    assert!(stdout(&decode).is_empty(), "nothing runs before the refusal: {}", stdout(&decode));
}

/// Every command that takes a model or graph path refuses a FIFO as not a
/// regular file rather than blocking on opening it (`tokenize`, `generate`
/// and `import` sniffed the file's magic with a plain open, which blocks
/// until a writer comes).
#[cfg(unix)]
#[test]
fn a_fifo_given_as_a_model_or_graph_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("model.bin");
    if !Command::new("mkfifo").arg(&fifo).status().is_ok_and(|s| s.success()) {
        eprintln!("no mkfifo here: skipped");
        return;
    }
    let fifo = fifo.to_str().unwrap();
    let out_dir = dir.path().join("out");
    let out_dir = out_dir.to_str().unwrap();
    for args in [
        vec!["validate", fifo],
        vec!["inspect", fifo],
        vec!["run", fifo],
        vec!["tokenize", fifo, "--prompt", "hi"],
        vec!["generate", fifo, "--prompt", "hi"],
        vec!["import", fifo, "--output", out_dir],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvjit"))
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                child.kill().unwrap();
                panic!("{args:?} blocked on the FIFO");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        assert_one_line_error(&out, "not a regular file");
    }
}

/// Names and values a file echoes into an error reach the terminal escaped
/// and cut short: an op name of 100 000 characters with escape sequences
/// gives one printable line of about 2000, and `compare` escapes the
/// tensor names it prints and says which file holds a tensor it refuses.
#[test]
fn echoed_names_are_escaped_and_cut_short() {
    let dir = tempfile::tempdir().unwrap();
    let graph = dir.path().join("g.json");
    let op = format!("mo.\u{1b}[31m{}\u{7}", "x".repeat(100_000));
    let text = format!(
        r#"{{"format":"kvjit-graph","version":1,"name":"g",
 "values":[{{"kind":"input","id":"v0","name":"a","dtype":"f32","shape":[4]}}],
 "nodes":[{{"id":"n0","op":{},"inputs":["v0","v0"],"outputs":["v1"]}}],
 "outputs":[{{"name":"o","value":"v1"}}]}}"#,
        serde_json::to_string(&op).unwrap()
    );
    std::fs::write(&graph, text).unwrap();
    let out = kvjit(&["validate", graph.to_str().unwrap()]);
    assert_one_line_error(&out, "node n0 (mo.\\u{1b}[31mxxx");
    let err = stderr(&out);
    assert!(!err.contains('\u{1b}') && !err.contains('\u{7}'), "{err}");
    assert!(err.contains("more characters)") && err.chars().count() < 2200, "{} characters", err.chars().count());

    let (a, b) = (dir.path().join("a.safetensors"), dir.path().join("b.safetensors"));
    let one = Tensor::from_f32(DType::F32, &[1], &[1.0]).unwrap();
    let two = Tensor::from_f32(DType::F32, &[1], &[2.0]).unwrap();
    write_safetensors(&a, [("t\u{1b}[2J", &one)]).unwrap();
    write_safetensors(&b, [("t\u{1b}[2J", &two)]).unwrap();
    let out = kvjit(&["compare", a.to_str().unwrap(), b.to_str().unwrap()]);
    assert_one_line_error(&out, "tensor 't\\u{1b}[2J'");
    assert!(!stdout(&out).contains('\u{1b}'), "{}", stdout(&out));

    // An F64 tensor: the error names the file it is in.
    let header = br#"{"x":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&1.0f64.to_le_bytes());
    let f64_file = dir.path().join("f64.safetensors");
    std::fs::write(&f64_file, bytes).unwrap();
    let out = kvjit(&["compare", a.to_str().unwrap(), f64_file.to_str().unwrap()]);
    assert_one_line_error(&out, &format!("{}: not a valid safetensors file: tensor 'x'", f64_file.display()));
}

/// A prefill longer than the example cache holds is refused before its
/// inputs are made (4 million tokens of the 8B layer's hidden state took
/// 4 GB before the page check refused them).
#[test]
fn a_prefill_longer_than_the_cache_is_refused_before_its_inputs_are_made() {
    let out = kvjit(&["run", "--seq", "4000000"]);
    assert_one_line_error(&out, "prefill of 4000000 tokens takes 250000 pages of 16, but cache 'kv_cache' holds");
    assert!(stdout(&out).is_empty(), "nothing ran: {}", stdout(&out));
}

/// `compare --tolerance` takes a finite tolerance of at least 0: NaN or a
/// negative one (which called identical tensors a mismatch) is refused.
#[test]
fn compare_refuses_a_tolerance_that_matches_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a.safetensors");
    write_safetensors(&file, [("t", &Tensor::from_f32(DType::F32, &[2], &[1.0, -3.0]).unwrap())]).unwrap();
    let file = file.to_str().unwrap();
    for bad in ["nan", "-1", "inf"] {
        let out = kvjit(&["compare", file, file, &format!("--tolerance={bad}")]);
        assert_one_line_error(&out, &format!("must be finite and ≥ 0, got {bad}"));
    }
    let out = kvjit(&["compare", file, file, "--tolerance", "0"]);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// A symbol bound twice to different sizes is refused (the last `--bind`
/// silently won); bound twice to one size it runs.
#[test]
fn disagreeing_binds_are_refused() {
    let graph = example("small_attention.json");
    for args in [vec!["run"], vec!["inspect", &graph]] {
        let out = kvjit(&[&args[..], &["--bind", "batch=4", "--bind", "batch=2"]].concat());
        assert_one_line_error(&out, "--bind batch=4 and --bind batch=2 disagree");
    }
    let out = kvjit(&["run", "--bind", "batch=2", "--bind", "batch=2", "--steps", "0"]);
    assert!(out.status.success(), "{}", stderr(&out));
}
