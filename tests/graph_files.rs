use kvjit::*;
#[test]
fn dump() {
    let r = standard_registry();
    let g = demo::layer_graph(&demo::LayerConfig::small(), r.ops()).unwrap();
    for (i, v) in g.values().iter().enumerate() { println!("v{i} {:?} {:?}", v.name, v.def); }
    for n in g.nodes() { println!("{:?} {:?} -> {:?}", n.id, n.inputs, n.outputs); }
    println!("{:?}", g.outputs());
}
