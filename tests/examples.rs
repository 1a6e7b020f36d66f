//! The example graph files under `examples/` are exactly what the builder API
//! makes for the example configs (a snapshot of the graph files, not of any
//! generated code). Regenerate them with `KVJIT_BLESS=1 cargo test --test examples`.

use std::path::Path;

use kvjit::demo::{LayerConfig, layer_graph};
use kvjit::{ValueDef, graph_to_json, load_graph, standard_registry};

fn check_example(config: LayerConfig, file: &str) {
    let registry = standard_registry();
    let graph = layer_graph(&config, registry.ops()).unwrap();
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
    check_example(LayerConfig::llama3_8b(), "llama3_8b_layer.json");
}

#[test]
fn small_two_layer_file_matches_the_builder() {
    check_example(LayerConfig::small(), "small_two_layers.json");
}
