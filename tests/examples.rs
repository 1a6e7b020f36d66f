//! The example graph files under `examples/` are exactly what the builder API
//! makes for the example configs (QKV layers, attention steps, a whole
//! decoder layer and a whole tiny model) (a snapshot of the graph files, not
//! of any generated code). Regenerate them with `KVJIT_BLESS=1 cargo test --test examples`.

use std::path::Path;

use kvjit::models::llama::{
    LayerConfig, LlamaConfig, attention_step_graph, decoder_layer_graph, model_graph, qkv_layer_graph,
};
use kvjit::{Graph, ValueDef, graph_to_json, load_graph, standard_registry};

fn check_example(graph: impl FnOnce(&kvjit::OpRegistry) -> Graph, file: &str) {
    let registry = standard_registry();
    let graph = graph(registry.ops());
    let json = graph_to_json(&graph, None);
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples").join(file);
    if std::env::var_os("KVJIT_BLESS").is_some() {
        std::fs::write(&path, &json).unwrap();
    }
    let on_disk = std::fs::read_to_string(&path).unwrap();
    assert_eq!(on_disk, json, "{file} is stale: rerun with KVJIT_BLESS=1");
    // The file loads through the same validator and yields the same graph.
    let loaded = load_graph(&path, registry.ops()).unwrap();
    assert_eq!(graph_to_json(&loaded, None), json);
    for (out, loaded_out) in graph.outputs().iter().zip(loaded.outputs()) {
        assert_eq!(out.name, loaded_out.name);
        assert_eq!(graph.value(out.value).ty, loaded.value(loaded_out.value).ty);
        assert!(matches!(loaded.value(loaded_out.value).def, ValueDef::NodeOutput { .. }));
    }
}

#[test]
fn llama3_8b_layer_file_matches_the_builder() {
    check_example(|ops| qkv_layer_graph(&LayerConfig::llama3_8b(), ops).unwrap(), "llama3_8b_layer.json");
}

#[test]
fn small_two_layer_file_matches_the_builder() {
    check_example(|ops| qkv_layer_graph(&LayerConfig::small(), ops).unwrap(), "small_two_layers.json");
}

#[test]
fn llama3_8b_attention_file_matches_the_builder() {
    check_example(|ops| attention_step_graph(&LlamaConfig::llama3_8b(), ops).unwrap(), "llama3_8b_attention.json");
}

#[test]
fn small_attention_file_matches_the_builder() {
    check_example(|ops| attention_step_graph(&LlamaConfig::small(), ops).unwrap(), "small_attention.json");
}

#[test]
fn llama3_8b_fp8_attention_file_matches_the_builder() {
    check_example(
        |ops| {
            let mut config = LlamaConfig::llama3_8b();
            config.layer.name = "llama3_8b_attention_fp8".into();
            config.layer.cache_dtype = Some(kvjit::DType::F8E4M3);
            attention_step_graph(&config, ops).unwrap()
        },
        "llama3_8b_attention_fp8.json",
    );
}

#[test]
fn llama3_8b_decoder_layer_file_matches_the_builder() {
    check_example(
        |ops| decoder_layer_graph(&LlamaConfig::llama3_8b_decoder_layer(), ops).unwrap(),
        "llama3_8b_decoder_layer.json",
    );
}

#[test]
fn tiny_llama_file_matches_the_builder() {
    check_example(|ops| model_graph(&LlamaConfig::tiny(), ops).unwrap(), "tiny_llama.json");
}
