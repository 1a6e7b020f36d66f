//! An input of role `Constant` must be a graph constant: a node whose such
//! input is a graph input or another node's output is refused when it is
//! added and when a loaded graph is validated.

use kvjit_core::DType;
use kvjit_graph::{GraphBuilder, Params, RandomInit, graph_from_json, graph_to_json};

mod common;
use common::registry;

#[test]
fn a_constant_input_must_be_a_graph_constant() {
    let registry = registry();
    let mut b = GraphBuilder::new("lookup", &registry);
    let init = RandomInit { seed: 1, low: -1.0, high: 1.0 };
    let table = b.random_constant("table", DType::F32, &[4], init).unwrap();
    let not_constant = b.input("not_constant", DType::F32, &[4.into()]).unwrap();
    let x = b.input("x", DType::F32, &[4.into()]).unwrap();
    let out = b.node("test.lookup", Params::new(), &[table, x]).unwrap()[0];
    b.output("y", out).unwrap();

    for refused in [not_constant, out] {
        let err = b.node("test.lookup", Params::new(), &[refused, x]).unwrap_err().to_string();
        assert!(err.contains("table") && err.contains("a graph constant"), "{err}");
    }
    let graph = b.finish().unwrap();

    // A file naming an input where the constant goes is refused at load.
    let json = graph_to_json(&graph, None);
    assert!(graph_from_json(&json, &registry, None).is_ok());
    let table_entry = "\"inputs\": [\n        \"v0\",";
    assert!(json.contains(table_entry), "{json}");
    let swapped = json.replace(table_entry, "\"inputs\": [\n        \"v1\",");
    let err = graph_from_json(&swapped, &registry, None).unwrap_err().to_string();
    assert!(err.contains("a graph constant"), "{err}");
}
