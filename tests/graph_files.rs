//! Graph files end to end: a graph saved and loaded again compiles and runs
//! to byte-identical outputs and caches (random-init weights saved as their
//! recipe, data constants through a safetensors file beside the JSON), the
//! JSON form is a fixed point of load-then-save, node order in a file does
//! not matter, and every malformed file gets a typed error naming the
//! problem — never a panic.
//!
//! The snapshot of `examples/*.json` lives in `tests/examples.rs`.

mod common;

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use common::{chain_graph, compile_cpu, constant_data, reference_run, run_ok, small_graph};
use kvjit::fused_qkv::{OP_ALIAS, OP_NAME};
use kvjit::models::llama::LayerConfig;
use kvjit::scenario::Scenario;
use kvjit::{
    CompileOptions, DType, Executable, Graph, GraphError, Registry, Tensor, compile, graph_from_json, graph_to_json,
    load_graph, read_safetensors, save_graph, specialize, standard_registry, write_safetensors,
};
use kvjit_graph::ValueDef;
use kvjit_testkit::{Caches, Tensors, assert_caches_identical, assert_outputs_identical, assert_tensors_identical};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use serde_json::{Value, json};

// ---------------------------------------------------------------- helpers

/// The data constants of a graph (those without a recipe), by name: what a
/// weights file holds.
fn weights_of(graph: &Graph) -> BTreeMap<String, Tensor> {
    graph
        .constants()
        .filter_map(|(_, v)| match &v.def {
            ValueDef::Constant { data, init: None } => Some((v.name.clone().unwrap(), (**data).clone())),
            _ => None,
        })
        .collect()
}

fn json_of(graph: &Graph) -> Value {
    serde_json::from_str(&graph_to_json(graph, None)).expect("graph_to_json writes JSON")
}

fn from_value(
    json: &Value,
    registry: &Registry,
    weights: Option<&BTreeMap<String, Tensor>>,
) -> Result<Graph, GraphError> {
    graph_from_json(&json.to_string(), registry.ops(), weights)
}

/// Load a small-graph JSON that must be rejected; the error.
fn rejected(json: &Value) -> GraphError {
    match from_value(json, &standard_registry(), None) {
        Ok(_) => panic!("malformed graph file was accepted:\n{json:#}"),
        Err(e) => e,
    }
}

/// The id of the value named `name` in a graph file.
fn id_of(json: &Value, name: &str) -> String {
    json["values"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no value '{name}' in the file"))["id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The entry of the value named `name`, writable.
fn value_entry<'j>(json: &'j mut Value, name: &str) -> &'j mut Value {
    json["values"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no value '{name}' in the file"))
}

/// Unwrap `InNode`, checking which node it names.
fn in_node<'e>(error: &'e GraphError, node: &str) -> &'e GraphError {
    match error {
        GraphError::InNode { node: n, source, .. } => {
            assert_eq!(n.to_string(), node, "error names the wrong node: {error}");
            source
        }
        other => panic!("expected an error inside node {node}, got {other:?}"),
    }
}

fn assert_message(error: &impl std::fmt::Display, parts: &[&str]) {
    let message = error.to_string();
    for part in parts {
        assert!(message.contains(part), "message {message:?} does not mention {part:?}");
    }
}

/// Run `exe_a` on a seeded prefill and `decode_steps` decode steps of
/// `graph_a`, and `exe_b` on the same inputs and a copy of the same caches;
/// outputs and caches must be byte-identical after every step. With
/// `same_seed_scenario`, `exe_b`'s inputs come from its own scenario made
/// from `graph_b` with the same seed (and must equal `graph_a`'s).
fn assert_same_runs(
    (graph_a, exe_a): (&Graph, &Executable),
    (graph_b, exe_b): (&Graph, &Executable),
    seed: u64,
    decode_steps: usize,
    same_seed_scenario: bool,
) {
    let mut a = Scenario::prefill(graph_a, seed).unwrap();
    let mut b = if same_seed_scenario { Some(Scenario::prefill(graph_b, seed).unwrap()) } else { None };
    for step in 0..=decode_steps {
        if step > 0 {
            a.advance().unwrap();
            a.next_decode_step().unwrap();
            if let Some(b) = &mut b {
                b.advance().unwrap();
                b.next_decode_step().unwrap();
            }
        }
        let (inputs_b, mut caches_b): (Tensors, Caches) = match &b {
            Some(b) => {
                assert_outputs_identical(&b.inputs, &a.inputs);
                assert_caches_identical(&b.caches, &a.caches);
                (b.inputs.clone(), b.caches.clone())
            }
            None => (a.inputs.clone(), a.caches.clone()),
        };
        let out_a = run_ok(exe_a, &a.inputs, &mut a.caches);
        let out_b = run_ok(exe_b, &inputs_b, &mut caches_b);
        assert_outputs_identical(&out_b.outputs, &out_a.outputs);
        assert_caches_identical(&caches_b, &a.caches);
        if let Some(b) = &mut b {
            b.caches = caches_b;
        }
    }
}

// ---------------------------------------------------------------- round trips

#[test]
fn random_init_graph_round_trips_as_a_recipe_without_a_weights_file() {
    let registry = standard_registry();
    let graph = small_graph(&registry);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small.json");
    save_graph(&graph, &path).unwrap();

    let files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(files, ["small.json"], "no weights file for recipe weights");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert!(json.get("weights").is_none(), "no weights file is named");
    for entry in json["values"].as_array().unwrap() {
        if entry["kind"] == "constant" {
            assert!(entry["init"].is_object(), "constant saved as recipe: {entry}");
        }
    }

    let loaded = load_graph(&path, registry.ops()).unwrap();
    for (_, value) in graph.constants() {
        let name = value.name.as_deref().unwrap();
        assert_tensors_identical(
            &format!("regenerated '{name}'"),
            &constant_data(&loaded, name),
            &constant_data(&graph, name),
        );
    }
    let (exe, exe_loaded) = (compile_cpu(&graph, &registry), compile_cpu(&loaded, &registry));
    assert_same_runs((&graph, &exe), (&loaded, &exe_loaded), 11, 2, true);
}

#[test]
fn data_constant_graph_round_trips_through_a_safetensors_file() {
    let registry = standard_registry();
    for dtype in [DType::F32, DType::BF16] {
        let graph = chain_graph(&registry, dtype);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chain.json");
        save_graph(&graph, &path).unwrap();

        let weights_path = dir.path().join("chain.safetensors");
        assert!(weights_path.is_file(), "weights file written beside the JSON");
        let json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(json["weights"], "chain.safetensors");
        let stored = read_safetensors(&weights_path).unwrap();
        let expected = weights_of(&graph);
        assert_eq!(
            stored.keys().collect::<Vec<_>>(),
            ["layers.0.qkv_weight", "layers.1.layer_idx", "layers.1.qkv_weight"]
        );
        for (name, tensor) in &expected {
            assert_tensors_identical(&format!("stored '{name}'"), &stored[name], tensor);
        }

        let loaded = load_graph(&path, registry.ops()).unwrap();
        assert_eq!(weights_of(&loaded).len(), expected.len());
        for (name, tensor) in &expected {
            assert_tensors_identical(&format!("{dtype} loaded '{name}'"), &constant_data(&loaded, name), tensor);
        }
        let (exe, exe_loaded) = (compile_cpu(&graph, &registry), compile_cpu(&loaded, &registry));
        assert_same_runs((&graph, &exe), (&loaded, &exe_loaded), 5, 2, true);

        // And the chain really chains: layer 1 reads layer 0's output.
        let mut scenario = Scenario::prefill(&loaded, 6).unwrap();
        let mut expected_caches = scenario.caches.clone();
        let expected = reference_run(&loaded, &scenario.inputs, &mut expected_caches);
        let out = run_ok(&exe_loaded, &scenario.inputs, &mut scenario.caches);
        assert_outputs_identical(&out.outputs, &expected);
        assert_caches_identical(&scenario.caches, &expected_caches);
    }
}

#[test]
fn llama3_8b_graph_saves_as_a_small_recipe_file_and_keeps_its_kernel_keys() {
    let registry = standard_registry();
    let graph = kvjit::models::llama::qkv_layer_graph(&LayerConfig::llama3_8b(), registry.ops()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("llama.json");
    save_graph(&graph, &path).unwrap();
    assert!(!dir.path().join("llama.safetensors").exists());
    assert!(std::fs::metadata(&path).unwrap().len() < 8 * 1024, "a 100 MB weight is saved as its recipe");
    let loaded = load_graph(&path, registry.ops()).unwrap();
    assert_eq!(graph_to_json(&loaded, None), graph_to_json(&graph, None));
    let keys = |g: &Graph| {
        specialize(g, registry.ops(), kvjit::cpu_backend(), &BTreeMap::new())
            .unwrap()
            .kernel_keys()
            .iter()
            .map(|k| k.to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(keys(&loaded), keys(&graph));
    let tier = kvjit::widest_cpu_tier();
    assert_eq!(
        keys(&graph),
        [format!("fused_qkv_bshd_paged.cpu-{tier}.f32.k4096.q4096.hkv8.d128.p16.l1.kvf32.bany.sany")]
    );
}

#[test]
fn json_is_a_fixed_point_of_load_then_save() {
    let registry = standard_registry();
    for graph in [small_graph(&registry), chain_graph(&registry, DType::F32)] {
        let weights = weights_of(&graph);
        let first = graph_to_json(&graph, Some("w.safetensors"));
        let loaded = graph_from_json(&first, registry.ops(), Some(&weights)).unwrap();
        let second = graph_to_json(&loaded, Some("w.safetensors"));
        assert_eq!(second, first, "{}: load-then-save changed the JSON", graph.name());
        let again = graph_from_json(&second, registry.ops(), Some(&weights)).unwrap();
        assert_eq!(graph_to_json(&again, Some("w.safetensors")), second);
    }
}

#[test]
fn op_alias_loads_and_is_saved_under_the_canonical_name() {
    let registry = standard_registry();
    let mut json = json_of(&small_graph(&registry));
    json["nodes"][1]["op"] = json!(OP_ALIAS);
    let graph = from_value(&json, &registry, None).unwrap();
    assert_eq!(graph.nodes()[1].op, OP_NAME);
    assert_eq!(json_of(&graph), json_of(&small_graph(&registry)));
}

#[test]
fn node_and_value_order_in_a_file_does_not_matter() {
    let registry = standard_registry();
    for graph in [small_graph(&registry), chain_graph(&registry, DType::F32)] {
        let weights = weights_of(&graph);
        let exe = compile_cpu(&graph, &registry);
        let original = json_of(&graph);
        let mut variants = Vec::new();
        let mut reversed = original.clone();
        reversed["nodes"].as_array_mut().unwrap().reverse();
        variants.push(("nodes reversed", reversed.clone()));
        reversed["values"].as_array_mut().unwrap().reverse();
        variants.push(("nodes and values reversed", reversed));
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..3 {
            let mut shuffled = original.clone();
            shuffled["nodes"].as_array_mut().unwrap().shuffle(&mut rng);
            shuffled["values"].as_array_mut().unwrap().shuffle(&mut rng);
            variants.push(("nodes and values shuffled", shuffled));
        }
        for (what, json) in variants {
            let loaded = from_value(&json, &registry, Some(&weights))
                .unwrap_or_else(|e| panic!("{}, {what}: {e}", graph.name()));
            let exe_loaded = compile_cpu(&loaded, &registry);
            // Same inputs for both: the demo scenario picks layer_idx values
            // by node order, which a reordered file changes.
            assert_same_runs((&graph, &exe), (&loaded, &exe_loaded), 21, 1, false);
        }
    }
}

// ---------------------------------------------------------------- malformed files

#[test]
fn bad_json_syntax_is_a_json_error() {
    let registry = standard_registry();
    let good = graph_to_json(&small_graph(&registry), None);
    for text in ["", "{", "{\"format\": \"kvjit-graph\", \"version\": 1,}", &good[..good.len() / 2], "kvjit-graph v1"] {
        let err = graph_from_json(text, registry.ops(), None).unwrap_err();
        assert!(matches!(err, GraphError::Json(_)), "{text:?}: {err:?}");
        assert_message(&err, &["malformed graph file"]);
    }
}

#[test]
fn json_that_is_not_a_graph_file_is_rejected_by_its_format_marker() {
    let registry = standard_registry();
    let mut wrong_format = json_of(&small_graph(&registry));
    wrong_format["format"] = json!("onnx");
    let mut format_not_a_string = wrong_format.clone();
    format_not_a_string["format"] = json!(1);
    let cases = [
        (json!([1, 2, 3]), None),
        (json!("kvjit-graph"), None),
        (json!(null), None),
        (json!({}), None),
        (json!({"version": 1}), None),
        (format_not_a_string, None),
        (wrong_format, Some("onnx")),
    ];
    for (json, found_format) in cases {
        let err = rejected(&json);
        match &err {
            GraphError::NotAGraphFile { found, expected } => {
                assert_eq!(found.as_deref(), found_format, "{json}");
                assert_eq!(*expected, "kvjit-graph");
            }
            other => panic!("{json}: expected NotAGraphFile, got {other:?}"),
        }
        assert_message(&err, &["not a kvjit graph file", "kvjit-graph"]);
    }
}

#[test]
fn unknown_or_future_versions_are_reported_as_such() {
    let registry = standard_registry();
    let good = json_of(&small_graph(&registry));
    let with_version = |v: Option<Value>| {
        let mut json = good.clone();
        match v {
            Some(v) => json["version"] = v,
            None => {
                json.as_object_mut().unwrap().remove("version");
            }
        }
        json
    };
    // A future version may change the schema: the version is reported, not
    // the fields this build does not know.
    let mut future = with_version(Some(json!(2)));
    future["attention_masks"] = json!([]);
    future["nodes"][0]["fusion"] = json!("flash");
    let cases = [
        (with_version(Some(json!(2))), "2"),
        (future, "2"),
        (with_version(Some(json!(0))), "0"),
        (with_version(Some(json!("1"))), "\"1\""),
        (with_version(Some(json!(1.5))), "1.5"),
        (with_version(Some(json!(-1))), "-1"),
        (with_version(Some(json!(null))), "null"),
        (with_version(None), "(missing)"),
    ];
    for (json, found_version) in cases {
        let err = rejected(&json);
        match &err {
            GraphError::UnsupportedVersion { found, supported } => {
                assert_eq!(found, found_version);
                assert_eq!(*supported, 1);
            }
            other => panic!("version {found_version}: expected UnsupportedVersion, got {other:?}"),
        }
        assert_message(&err, &[&format!("version {found_version} is not supported"), "reads version 1"]);
    }
}

#[test]
fn unknown_op_is_reported_with_the_known_ops() {
    let registry = standard_registry();
    let mut json = json_of(&small_graph(&registry));
    json["nodes"][1]["op"] = json!("softmax");
    let err = rejected(&json);
    match in_node(&err, "n1") {
        GraphError::UnknownOp { name, known } => {
            assert_eq!(name, "softmax");
            assert!(known.contains(OP_NAME), "known ops: {known}");
        }
        other => panic!("expected UnknownOp, got {other:?}"),
    }
    assert_message(&err, &["node n1", "unknown op 'softmax'", OP_NAME]);
}

#[test]
fn unknown_fields_are_json_errors_wherever_they_are() {
    let registry = standard_registry();
    let good = json_of(&small_graph(&registry));
    let mut cases: Vec<(&str, Value)> = Vec::new();
    let mut j = good.clone();
    j["nodes"][0]["attrs"] = json!({});
    cases.push(("attrs", j));
    let mut j = good.clone();
    j["extra"] = json!(1);
    cases.push(("extra", j));
    let mut j = good.clone();
    j["outputs"][0]["dtype"] = json!("f32");
    cases.push(("dtype", j));
    let mut j = good.clone();
    value_entry(&mut j, "kv_cache")["layout"] = json!("bshd");
    cases.push(("layout", j));
    let mut j = good.clone();
    value_entry(&mut j, "hidden_state")["optional"] = json!(true);
    cases.push(("optional", j));
    let mut j = good.clone();
    value_entry(&mut j, "layers.0.qkv_weight")["init"]["distribution"] = json!("normal");
    cases.push(("distribution", j));
    let mut j = good.clone();
    value_entry(&mut j, "layers.0.qkv_weight")["kind"] = json!("parameter");
    cases.push(("parameter", j));
    for (field, json) in cases {
        let err = rejected(&json);
        assert!(matches!(err, GraphError::Json(_)), "unknown `{field}`: {err:?}");
        assert_message(&err, &["malformed graph file", field]);
    }
}

#[test]
fn dangling_value_references_are_reported_where_they_are() {
    let registry = standard_registry();
    let good = json_of(&small_graph(&registry));

    let mut json = good.clone();
    json["nodes"][1]["inputs"][3] = json!("v99");
    let err = rejected(&json);
    match &err {
        GraphError::DanglingValue { place, value } => {
            assert_eq!(place, "node n1");
            assert_eq!(value.to_string(), "v99");
        }
        other => panic!("expected DanglingValue, got {other:?}"),
    }
    assert_message(&err, &["node n1 refers to v99", "not defined"]);

    let mut json = good.clone();
    json["outputs"][1]["value"] = json!("v42");
    let err = rejected(&json);
    match &err {
        GraphError::DanglingValue { place, value } => {
            assert_eq!(place, "output 'layers.1.q'");
            assert_eq!(value.to_string(), "v42");
        }
        other => panic!("expected DanglingValue, got {other:?}"),
    }
    assert_message(&err, &["output 'layers.1.q' refers to v42"]);

    // An id that is not spelled vN is a schema error that names the id.
    let mut json = good;
    json["nodes"][0]["inputs"][0] = json!("hidden_state");
    let err = rejected(&json);
    assert!(matches!(err, GraphError::Json(_)), "{err:?}");
    assert_message(&err, &["'hidden_state' is not a value id"]);
}

/// A hand-written file of two fused-QKV nodes that read each other's output
/// as their hidden state. The weights are deliberately mis-shaped: the cycle
/// must be reported before any shape is looked at.
fn cyclic_file() -> Value {
    let params = json!({"dtype": "f32", "num_kv_heads": 2, "head_size": 16, "page_size": 4});
    json!({
        "format": "kvjit-graph",
        "version": 1,
        "name": "cycle",
        "values": [
            {"kind": "input", "id": "v0", "name": "valid_lengths", "dtype": "u32", "shape": ["batch"]},
            {"kind": "kv_cache", "id": "v1", "name": "kv_cache", "dtype": "f32", "num_layers": 2,
             "page_size": 4, "num_kv_heads": 2, "head_size": 16, "num_pages": 8,
             "batch": "batch", "max_pages_per_seq": 2},
            {"kind": "constant", "id": "v2", "name": "w", "dtype": "f32", "shape": [5, 3],
             "init": {"seed": 0, "low": -1.0, "high": 1.0}},
            {"kind": "input", "id": "v3", "name": "layer_idx", "dtype": "u32", "shape": []}
        ],
        "nodes": [
            {"id": "n0", "op": OP_NAME, "params": params.clone(),
             "inputs": ["v11", "v2", "v1", "v3", "v0"], "outputs": ["v10"]},
            {"id": "n1", "op": OP_NAME, "params": params,
             "inputs": ["v10", "v2", "v1", "v3", "v0"], "outputs": ["v11"]}
        ],
        "outputs": [{"name": "q", "value": "v10"}]
    })
}

#[test]
fn a_cycle_between_two_nodes_is_reported_before_shapes() {
    let err = rejected(&cyclic_file());
    match &err {
        GraphError::Cycle(nodes) => assert_eq!(nodes, "n0, n1"),
        other => panic!("expected Cycle, got {other:?}"),
    }
    assert_message(&err, &["cycle through nodes n0, n1"]);

    // Nodes reading their own output are cycles of one.
    let mut json = cyclic_file();
    json["nodes"][0]["inputs"][0] = json!("v10");
    json["nodes"][1]["inputs"][0] = json!("v11");
    let err = rejected(&json);
    match &err {
        GraphError::Cycle(nodes) => assert_eq!(nodes, "n0, n1"),
        other => panic!("expected Cycle, got {other:?}"),
    }
}

#[test]
fn a_cycle_error_names_only_the_nodes_on_the_cycle() {
    // n0 reads its own output; n1 reads n0's output but is on no cycle.
    let mut json = cyclic_file();
    json["nodes"][0]["inputs"][0] = json!("v10");
    json["nodes"][1]["inputs"][0] = json!("v10");
    match rejected(&json) {
        GraphError::Cycle(nodes) => assert_eq!(nodes, "n0"),
        other => panic!("expected Cycle, got {other:?}"),
    }
}

#[test]
fn duplicate_ids_are_rejected() {
    let registry = standard_registry();
    let good = json_of(&small_graph(&registry));
    let hidden = id_of(&good, "hidden_state");
    let layer0_out = good["nodes"][0]["outputs"][0].clone();

    let mut two_values = good.clone();
    value_entry(&mut two_values, "valid_lengths")["id"] = json!(hidden);
    let mut two_nodes = good.clone();
    two_nodes["nodes"][1]["id"] = json!("n0");
    let mut output_is_declared = good.clone();
    output_is_declared["nodes"][1]["outputs"][0] = json!(hidden);
    let mut two_producers = good.clone();
    two_producers["nodes"][1]["outputs"][0] = layer0_out.clone();

    for (what, json, id) in [
        ("two values", two_values, hidden.clone()),
        ("two nodes", two_nodes, "n0".into()),
        ("a node output that is also a declared value", output_is_declared, hidden),
        ("two nodes producing one value", two_producers, layer0_out.as_str().unwrap().into()),
    ] {
        let err = rejected(&json);
        match &err {
            GraphError::DuplicateId { id: got } => assert_eq!(got, &id, "{what}"),
            other => panic!("{what}: expected DuplicateId, got {other:?}"),
        }
        assert_message(&err, &[&format!("{id} is defined twice")]);
    }
}

#[test]
fn duplicate_names_are_rejected() {
    let registry = standard_registry();
    let good = json_of(&small_graph(&registry));

    let mut two_inputs = good.clone();
    value_entry(&mut two_inputs, "layers.1.layer_idx")["name"] = json!("layers.0.layer_idx");
    let mut input_and_cache = good.clone();
    value_entry(&mut input_and_cache, "kv_cache")["name"] = json!("hidden_state");
    let mut two_outputs = good.clone();
    two_outputs["outputs"][1]["name"] = json!("layers.0.q");

    for (json, name) in
        [(two_inputs, "layers.0.layer_idx"), (input_and_cache, "hidden_state"), (two_outputs, "layers.0.q")]
    {
        let err = rejected(&json);
        match &err {
            GraphError::DuplicateName(got) => assert_eq!(got, name),
            other => panic!("expected DuplicateName({name}), got {other:?}"),
        }
        assert_message(&err, &[&format!("name '{name}' is used twice")]);
    }
}

/// Save the chain graph to a fresh directory; the directory, the graph
/// file's path and the weights file's path.
fn saved_chain() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let registry = standard_registry();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("chain.json");
    save_graph(&chain_graph(&registry, DType::F32), &path).unwrap();
    let weights = dir.path().join("chain.safetensors");
    (dir, path, weights)
}

/// Replace one tensor of a safetensors file (or drop it, with `None`).
fn rewrite_weights(path: &Path, name: &str, replacement: Option<Tensor>) {
    let mut tensors = read_safetensors(path).unwrap();
    match replacement {
        Some(t) => tensors.insert(name.to_string(), t),
        None => tensors.remove(name),
    };
    write_safetensors(path, tensors.iter().map(|(n, t)| (n.as_str(), t))).unwrap();
}

fn load_error(path: &Path) -> GraphError {
    match load_graph(path, standard_registry().ops()) {
        Ok(_) => panic!("{} was accepted", path.display()),
        Err(e) => e,
    }
}

/// A constant that has an `init` recipe and also a tensor in the weights
/// file is ambiguous: refused, naming the constant (it used to be accepted
/// silently, the recipe winning).
#[test]
fn a_constant_with_both_a_recipe_and_data_in_the_weights_file_is_refused_by_name() {
    let (_dir, path, weights) = saved_chain();
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert!(read_safetensors(&weights).unwrap().contains_key("layers.0.qkv_weight"));
    value_entry(&mut json, "layers.0.qkv_weight")["init"] = json!({"seed": 1, "low": -1.0, "high": 1.0});
    std::fs::write(&path, json.to_string()).unwrap();
    let err = load_error(&path);
    assert!(matches!(&err, GraphError::AmbiguousConstant { name } if name == "layers.0.qkv_weight"), "{err:?}");
    assert_message(
        &err,
        &["constant 'layers.0.qkv_weight'", "both an \"init\" recipe and a tensor in the weights file"],
    );
}

#[test]
fn a_tensor_missing_from_the_weights_file_is_named() {
    let (_dir, path, weights) = saved_chain();
    rewrite_weights(&weights, "layers.1.qkv_weight", None);
    let err = load_error(&path);
    match &err {
        GraphError::Tensor(kvjit_core::Error::MissingTensor { name, .. }) => {
            assert_eq!(name, "layers.1.qkv_weight")
        }
        other => panic!("expected MissingTensor, got {other:?}"),
    }
    assert_message(&err, &["tensor 'layers.1.qkv_weight' not found", "weights file"]);

    // A file that names no weights file at all says so.
    let registry = standard_registry();
    let json = graph_to_json(&chain_graph(&registry, DType::F32), None);
    let err = graph_from_json(&json, registry.ops(), None).unwrap_err();
    assert!(
        matches!(
            &err,
            GraphError::Tensor(kvjit_core::Error::MissingTensor { name, .. })
                if name == "layers.0.qkv_weight"
        ),
        "{err:?}"
    );
    assert_message(&err, &["names no weights file"]);
}

#[test]
fn weights_of_the_wrong_shape_or_dtype_are_constant_mismatches() {
    let mut rng = StdRng::seed_from_u64(0);
    let cases = [
        ("layers.0.qkv_weight", Tensor::random(DType::F32, &[128, 32], &mut rng, -1.0, 1.0).unwrap(), "f32[128, 64]"),
        ("layers.0.qkv_weight", Tensor::random(DType::F32, &[64, 128], &mut rng, -1.0, 1.0).unwrap(), "f32[128, 64]"),
        ("layers.1.qkv_weight", Tensor::random(DType::BF16, &[128, 64], &mut rng, -1.0, 1.0).unwrap(), "f32[128, 64]"),
        ("layers.1.layer_idx", Tensor::from_vec(&[1], vec![1u32]).unwrap(), "u32[]"),
        ("layers.1.layer_idx", Tensor::from_f32(DType::F32, &[], &[1.0]).unwrap(), "u32[]"),
    ];
    for (name, tensor, declared) in cases {
        let (_dir, path, weights) = saved_chain();
        let (dtype, shape) = (tensor.dtype(), tensor.shape().to_vec());
        rewrite_weights(&weights, name, Some(tensor));
        let err = load_error(&path);
        match &err {
            GraphError::ConstantMismatch { name: got_name, dtype: got_dtype, shape: got_shape, .. } => {
                assert_eq!(got_name, name);
                assert_eq!((*got_dtype, got_shape), (dtype, &shape));
            }
            other => panic!("{name} as {dtype}{shape:?}: expected ConstantMismatch, got {other:?}"),
        }
        assert_message(&err, &[&format!("constant '{name}'"), declared]);
    }
}

#[test]
fn a_truncated_weights_file_is_a_safetensors_error() {
    let (_dir, path, weights) = saved_chain();
    let bytes = std::fs::read(&weights).unwrap();
    for cut in [0, 7, 8, 100, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&weights, &bytes[..cut]).unwrap();
        let err = load_error(&path);
        assert!(matches!(err, GraphError::Tensor(kvjit_core::Error::BadTensorFile { .. })), "cut at {cut}: {err:?}");
        assert_message(&err, &["not a valid safetensors file"]);
    }
}

#[test]
fn a_missing_weights_file_is_an_io_error_naming_it() {
    let (_dir, path, weights) = saved_chain();
    std::fs::remove_file(&weights).unwrap();
    let err = load_error(&path);
    match &err {
        GraphError::Tensor(kvjit_core::Error::Io { path: p, source }) => {
            assert_eq!(p, &weights);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected an Io error, got {other:?}"),
    }
    assert_message(&err, &["chain.safetensors"]);
}

#[test]
fn a_missing_graph_file_is_an_io_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nowhere.json");
    let err = load_error(&path);
    match &err {
        GraphError::Io { path: p, source } => {
            assert_eq!(p, &path);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected an Io error, got {other:?}"),
    }
    assert_message(&err, &["nowhere.json"]);
}

#[test]
fn missing_unknown_and_out_of_range_params_are_named_with_their_node() {
    let registry = standard_registry();
    let good = json_of(&small_graph(&registry));
    let with_params = |edit: &dyn Fn(&mut serde_json::Map<String, Value>)| {
        let mut json = good.clone();
        edit(json["nodes"][1]["params"].as_object_mut().unwrap());
        json
    };
    let cases: [(Value, &str, &str); 8] = [
        (
            with_params(&|p| {
                p.remove("page_size");
            }),
            "page_size",
            "is missing",
        ),
        (
            with_params(&|p| {
                p.insert("alpha".into(), json!(1));
            }),
            "alpha",
            "is not a parameter of this op (it takes dtype, num_kv_heads, head_size, page_size)",
        ),
        (
            with_params(&|p| {
                p.insert("page_size".into(), json!(0));
            }),
            "page_size",
            "must be an integer in 1..=4294967295",
        ),
        (
            with_params(&|p| {
                p.insert("head_size".into(), json!(4294967296u64));
            }),
            "head_size",
            "must be an integer in 1..=4294967295",
        ),
        (
            with_params(&|p| {
                p.insert("num_kv_heads".into(), json!("2"));
            }),
            "num_kv_heads",
            "must be an integer",
        ),
        (
            with_params(&|p| {
                p.insert("dtype".into(), json!("f64"));
            }),
            "dtype",
            "unknown dtype 'f64'",
        ),
        (
            with_params(&|p| {
                p.insert("dtype".into(), json!("u32"));
            }),
            "dtype",
            "must be f32, bf16 or f16",
        ),
        (
            with_params(&|p| {
                p.insert("dtype".into(), json!(32));
            }),
            "dtype",
            "must be a dtype name",
        ),
    ];
    for (json, param, problem) in cases {
        let err = rejected(&json);
        match in_node(&err, "n1") {
            GraphError::Param { param: got, .. } => assert_eq!(got, param),
            other => panic!("{param}: expected Param, got {other:?}"),
        }
        assert_message(&err, &["node n1", &format!("parameter '{param}'"), problem]);
    }
}

#[test]
fn params_whose_product_overflows_are_a_typed_error_not_a_panic() {
    // num_kv_heads·head_size fits in u64, twice it does not.
    let registry = standard_registry();
    let mut json = json_of(&small_graph(&registry));
    for key in ["num_kv_heads", "head_size"] {
        json["nodes"][0]["params"][key] = json!(4294967295u64);
        value_entry(&mut json, "kv_cache")[key] = json!(4294967295u64);
    }
    let result = catch_unwind(AssertUnwindSafe(|| from_value(&json, &registry, None)));
    let err = match result {
        Err(_) => panic!("loading a file with huge params panicked"),
        Ok(Ok(_)) => panic!("a weight [128, 64] cannot serve kv_dim = 2^64 - 2^33 + 1"),
        Ok(Err(e)) => e,
    };
    assert!(matches!(in_node(&err, "n0"), GraphError::Param { param, .. } if param == "num_kv_heads"), "{err:?}");
}

#[test]
fn names_with_control_characters_are_refused_at_load() {
    // Names are printed: an escape sequence or a NUL from a crafted file
    // must not reach the terminal.
    let registry = standard_registry();
    let good = json_of(&small_graph(&registry));
    for name in ["evil\u{1b}[31m", "nul\u{0}", "two\nlines"] {
        let mut graph_name = good.clone();
        graph_name["name"] = json!(name);
        let mut value_name = good.clone();
        value_entry(&mut value_name, "kv_cache")["name"] = json!(name);
        for json in [graph_name, value_name] {
            let err = rejected(&json);
            assert_message(&err, &["holds a control character"]);
            assert!(!err.to_string().chars().any(char::is_control), "{err}");
        }
    }
}

#[test]
fn a_page_table_row_longer_than_the_cache_is_refused_at_load() {
    // A row of 2³² entries once made `kvjit generate` fill 17 GB of table.
    let registry = standard_registry();
    let mut json = json_of(&small_graph(&registry));
    let pages = value_entry(&mut json, "kv_cache")["num_pages"].as_u64().unwrap();
    value_entry(&mut json, "kv_cache")["max_pages_per_seq"] = json!(pages + 1);
    let err = rejected(&json);
    assert!(matches!(&err, GraphError::Param { param, .. } if param == "max_pages_per_seq"), "{err:?}");
    assert_message(&err, &[&format!("is {}, more than its {pages} pages", pages + 1)]);
}

#[test]
fn a_cache_of_no_pages_is_refused_at_load() {
    // max_pages_per_seq 0 once passed validate and compile.
    let registry = standard_registry();
    for field in ["num_pages", "max_pages_per_seq"] {
        let mut json = json_of(&small_graph(&registry));
        value_entry(&mut json, "kv_cache")[field] = json!(0);
        let err = rejected(&json);
        assert!(matches!(&err, GraphError::Param { param, .. } if param == field), "{err:?}");
        assert_message(&err, &["must be at least 1"]);
    }
}

#[test]
fn a_layer_count_past_u32_is_refused_at_load() {
    // Layer indices are u32: 2³² layers once passed validation and made
    // `kvjit run` divide by zero (the count cast to u32).
    let registry = standard_registry();
    let mut json = json_of(&small_graph(&registry));
    value_entry(&mut json, "kv_cache")["num_layers"] = json!(4294967296u64);
    let err = rejected(&json);
    assert!(matches!(&err, GraphError::Param { param, .. } if param == "num_layers"), "{err:?}");
    assert_message(&err, &["num_layers", "must be at most 4294967295"]);
}

#[test]
fn an_input_shape_the_op_rejects_is_named_with_its_argument() {
    let registry = standard_registry();
    let good = json_of(&small_graph(&registry));

    let mut weight_wrong_k = good.clone();
    value_entry(&mut weight_wrong_k, "layers.1.qkv_weight")["shape"] = json!([128, 32]);
    let mut weight_too_narrow = good.clone();
    value_entry(&mut weight_too_narrow, "layers.1.qkv_weight")["shape"] = json!([64, 64]);
    let mut hidden_bf16 = good.clone();
    value_entry(&mut hidden_bf16, "hidden_state")["dtype"] = json!("bf16");
    let mut hidden_rank2 = good.clone();
    value_entry(&mut hidden_rank2, "hidden_state")["shape"] = json!(["batch", 64]);
    let mut symbolic_k = good.clone();
    value_entry(&mut symbolic_k, "hidden_state")["shape"] = json!(["batch", "seq", "hidden"]);
    let mut valid_other_batch = good.clone();
    value_entry(&mut valid_other_batch, "valid_lengths")["shape"] = json!(["sequences"]);
    let mut layer_idx_vector = good.clone();
    value_entry(&mut layer_idx_vector, "layers.1.layer_idx")["shape"] = json!([2]);
    // A one-element vector is not a scalar either: refused here, when the
    // node is added, not only when the graph runs.
    let mut layer_idx_one = good.clone();
    value_entry(&mut layer_idx_one, "layers.1.layer_idx")["shape"] = json!([1]);
    let mut cache_page_size = good.clone();
    value_entry(&mut cache_page_size, "kv_cache")["page_size"] = json!(8);

    for (json, arg, expected) in [
        (weight_wrong_k, "weight", "f32[q_dim + 2*32, 64]"),
        (weight_too_narrow, "weight", "with q_dim >= 1"),
        (hidden_bf16, "hidden_state", "f32[B, S, K]"),
        (hidden_rank2, "hidden_state", "f32[B, S, K]"),
        (symbolic_k, "hidden_state", "with a static K"),
        (valid_other_batch, "valid_lengths", "u32[batch]"),
        (layer_idx_vector, "layer_idx", "u32[] (a scalar)"),
        (layer_idx_one, "layer_idx", "u32[] (a scalar)"),
        (cache_page_size, "kv_collection", "page_size=4"),
    ] {
        let err = rejected(&json);
        // Every node reads the changed value; the first one reports it.
        let node = if arg == "weight" || arg == "layer_idx" { "n1" } else { "n0" };
        match in_node(&err, node) {
            GraphError::InputType { arg: got, .. } => assert_eq!(got, arg),
            other => panic!("{arg}: expected InputType, got {other:?}"),
        }
        assert_message(&err, &[&format!("argument '{arg}'"), expected]);
    }
}

#[test]
fn a_wrong_number_of_node_inputs_or_outputs_is_an_arg_count_error() {
    let registry = standard_registry();
    let good = json_of(&small_graph(&registry));

    let mut four_inputs = good.clone();
    four_inputs["nodes"][1]["inputs"].as_array_mut().unwrap().pop();
    let mut six_inputs = good.clone();
    let extra = good["nodes"][1]["inputs"][4].clone();
    six_inputs["nodes"][1]["inputs"].as_array_mut().unwrap().push(extra);
    let mut two_outputs = good.clone();
    two_outputs["nodes"][1]["outputs"].as_array_mut().unwrap().push(json!("v50"));
    let mut no_outputs = good.clone();
    no_outputs["nodes"][1]["outputs"] = json!([]);
    no_outputs["outputs"].as_array_mut().unwrap().pop();

    for (json, what, expected, got) in [
        (four_inputs, "inputs", 5, 4),
        (six_inputs, "inputs", 5, 6),
        (two_outputs, "outputs", 1, 2),
        (no_outputs, "outputs", 1, 0),
    ] {
        let err = rejected(&json);
        match in_node(&err, "n1") {
            GraphError::ArgCount { what: w, expected: e, got: g, .. } => {
                assert_eq!((*w, *e, *g), (what, expected, got))
            }
            other => panic!("{what} {got}: expected ArgCount, got {other:?}"),
        }
        assert_message(&err, &[&format!("takes {expected} {what}, got {got}")]);
    }
}

#[test]
fn a_cache_where_a_tensor_is_expected_is_an_arg_kind_error() {
    let registry = standard_registry();
    let good = json_of(&small_graph(&registry));
    let cache = id_of(&good, "kv_cache");
    let hidden = id_of(&good, "hidden_state");

    let mut cache_as_hidden = good.clone();
    cache_as_hidden["nodes"][1]["inputs"][0] = json!(cache);
    let mut tensor_as_cache = good.clone();
    tensor_as_cache["nodes"][1]["inputs"][2] = json!(hidden);
    for (json, arg, expected) in
        [(cache_as_hidden, "hidden_state", "tensor"), (tensor_as_cache, "kv_collection", "KV cache")]
    {
        let err = rejected(&json);
        match in_node(&err, "n1") {
            GraphError::ArgKind { arg: a, expected: e } => assert_eq!((a.as_str(), *e), (arg, expected)),
            other => panic!("{arg}: expected ArgKind, got {other:?}"),
        }
        assert_message(&err, &[&format!("argument '{arg}' must be a {expected}")]);
    }

    // A graph output must be a tensor too.
    let mut cache_as_output = good;
    cache_as_output["outputs"][0]["value"] = json!(cache);
    let err = rejected(&cache_as_output);
    assert!(matches!(&err, GraphError::ArgKind { arg, expected: "tensor" } if arg == "output 'layers.0.q'"), "{err:?}");
}

/// Every JSON pointer to a scalar, array or object inside `json`.
fn pointers(json: &Value, at: String, out: &mut Vec<String>) {
    match json {
        Value::Object(map) => {
            for (k, v) in map {
                let p = format!("{at}/{k}");
                out.push(p.clone());
                pointers(v, p, out);
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                let p = format!("{at}/{i}");
                out.push(p.clone());
                pointers(v, p, out);
            }
        }
        _ => {}
    }
}

fn remove_at(json: &mut Value, pointer: &str) {
    let (parent, key) = pointer.rsplit_once('/').unwrap();
    match json.pointer_mut(parent).unwrap() {
        Value::Object(map) => {
            map.remove(key);
        }
        Value::Array(items) => {
            items.remove(key.parse::<usize>().unwrap());
        }
        _ => unreachable!(),
    }
}

/// Every single-field edit of a valid file (removing it, or replacing it by
/// null, a negative, zero, a small or a huge number, a string, an empty array
/// or object) loads, or fails with a typed error; what loads also compiles
/// or fails with a typed error. Nothing panics.
#[test]
fn single_field_edits_of_a_valid_file_never_panic() {
    let registry = standard_registry();
    let mut panics = Vec::new();
    let mut edits = 0;
    for graph in [small_graph(&registry), chain_graph(&registry, DType::F32)] {
        let weights = weights_of(&graph);
        let good = json_of(&graph);
        let mut paths = Vec::new();
        pointers(&good, String::new(), &mut paths);
        for path in paths {
            // A constant's shape is allocated when it is generated: a huge
            // dim there is an allocation failure (an abort), not a panic.
            let allocates = path.contains("/shape") && {
                let entry = path.split("/shape").next().unwrap();
                good.pointer(entry).is_some_and(|v| v["kind"] == "constant")
            };
            let mut replacements = vec![json!(null), json!(-1), json!(0), json!(3), json!("x"), json!([]), json!({})];
            if !allocates {
                replacements.push(json!(4294967295u64));
                replacements.push(json!(u64::MAX));
            }
            let mut variants = vec![{
                let mut j = good.clone();
                remove_at(&mut j, &path);
                j
            }];
            for r in replacements {
                let mut j = good.clone();
                *j.pointer_mut(&path).unwrap() = r;
                variants.push(j);
            }
            for json in variants {
                edits += 1;
                let outcome = catch_unwind(AssertUnwindSafe(|| {
                    if let Ok(graph) = from_value(&json, &registry, Some(&weights)) {
                        let _ = compile(&graph, &registry, &CompileOptions::default());
                    }
                }));
                if outcome.is_err() {
                    panics.push(format!("{}: {path}", graph.name()));
                }
            }
        }
    }
    assert!(edits > 500, "only {edits} edits tried");
    assert!(panics.is_empty(), "edits that panicked: {panics:#?}");
}

#[test]
fn fp8_cache_granularity_defaults_to_128_and_must_divide_the_head_size() {
    let registry = standard_registry();
    let graph =
        kvjit::models::llama::attention_step_graph(&kvjit::models::llama::LlamaConfig::llama3_8b(), registry.ops())
            .unwrap();
    let mut file: Value = serde_json::from_str(&graph_to_json(&graph, None)).unwrap();
    let cache = file["values"].as_array_mut().unwrap().iter_mut().find(|v| v["kind"] == "kv_cache").unwrap();
    cache["dtype"] = json!("f8e4m3");
    let load = |file: &Value| graph_from_json(&file.to_string(), registry.ops(), None);
    // Without a granularity: the default, 128, named in every cache-reading key.
    let loaded = load(&file).unwrap();
    let (_, value) = loaded.kv_caches().next().unwrap();
    assert_eq!(value.ty.as_kv_cache().unwrap().scale_granularity, Some(128));
    for (g, ok) in [(32, true), (48, false), (0, false)] {
        let cache = file["values"].as_array_mut().unwrap().iter_mut().find(|v| v["kind"] == "kv_cache").unwrap();
        cache["scale_granularity"] = json!(g);
        match load(&file) {
            Ok(_) => assert!(ok, "g = {g} was accepted"),
            Err(e) => {
                assert!(!ok, "g = {g}: {e}");
                assert!(e.to_string().contains("scale_granularity"), "{e}");
            }
        }
    }
    // A granularity on a bf16 cache is refused too.
    let cache = file["values"].as_array_mut().unwrap().iter_mut().find(|v| v["kind"] == "kv_cache").unwrap();
    cache["dtype"] = json!("bf16");
    cache["scale_granularity"] = json!(128);
    assert!(load(&file).unwrap_err().to_string().contains("f8e4m3 caches only"));
}

/// The small chain's graph file with `recipes` more unused f32 constants,
/// each made by a random recipe: (name, element count).
fn with_recipes(recipes: &[(&str, u64)]) -> Value {
    let mut json = json_of(&small_graph(&standard_registry()));
    let values = json["values"].as_array_mut().unwrap();
    for (i, (name, elements)) in recipes.iter().enumerate() {
        values.push(json!({
            "kind": "constant",
            "id": format!("v{}", 1000 + i),
            "name": name,
            "dtype": "f32",
            "shape": [elements],
            "init": {"seed": i, "low": -1.0, "high": 1.0}
        }));
    }
    json
}

#[test]
fn recipes_are_refused_before_they_make_more_than_the_recipe_budget() {
    let registry = standard_registry();
    // Within the budget: loads. Two recipes of 600 KiB: the second crosses
    // a 1 MiB budget and is named, with its bytes and the total (the
    // graph's own two [128, 64] f32 weights are recipes too: 64 KiB).
    let one = with_recipes(&[("first", 150 << 10)]).to_string();
    kvjit::graph_from_json_within(&one, registry.ops(), None, 1 << 20).unwrap();
    let two = with_recipes(&[("first", 150 << 10), ("second", 150 << 10)]).to_string();
    let err = kvjit::graph_from_json_within(&two, registry.ops(), None, 1 << 20).unwrap_err();
    assert!(matches!(&err, GraphError::RecipeBudget { name, bytes: 614_400, .. } if name == "second"), "{err:?}");
    assert_message(&err, &["constant 'second'", "614400 bytes", "recipes to 1294336 bytes", "budget of 1048576 bytes"]);
    // Without a budget of its own, a load has the default limit: one
    // element more than it is refused before anything is generated.
    assert_eq!(kvjit::DEFAULT_MEMORY_LIMIT, 1 << 30);
    let over = with_recipes(&[("huge", (kvjit::DEFAULT_MEMORY_LIMIT / 4) + 1)]).to_string();
    let err = graph_from_json(&over, registry.ops(), None).unwrap_err();
    assert_message(&err, &["constant 'huge'", "1073741828 bytes", "budget of 1073741824 bytes"]);
}

#[test]
fn the_cli_refuses_a_recipe_over_its_memory_budget_naming_the_constant() {
    // A 2 MiB recipe under `--memory-budget 1M` is refused while loading
    // (before: generated, then refused by the compile estimate, which does
    // not say which constant).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("recipe.json");
    std::fs::write(&path, with_recipes(&[("big", 1 << 19)]).to_string()).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvjit"))
        .args(["run", path.to_str().unwrap(), "--memory-budget", "1M"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error: "), "{err}");
    assert_message(&err, &["constant 'big'", "init recipe makes 2097152 bytes", "budget of 1048576 bytes"]);
    // `kvjit compile` takes the same budget; without one, 2 MiB is within
    // the default limit.
    let artifact = dir.path().join("recipe.kvjit");
    let compile = |budget: &[&str]| {
        let mut args = vec!["compile", path.to_str().unwrap(), "-o", artifact.to_str().unwrap()];
        args.extend(budget);
        std::process::Command::new(env!("CARGO_BIN_EXE_kvjit")).args(args).output().unwrap()
    };
    let refused = compile(&["--memory-budget", "1M"]);
    assert_eq!(refused.status.code(), Some(1));
    assert_message(&String::from_utf8_lossy(&refused.stderr), &["constant 'big'", "budget of 1048576 bytes"]);
    assert!(compile(&[]).status.success());
}
