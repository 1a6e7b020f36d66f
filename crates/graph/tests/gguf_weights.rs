//! A graph file whose `weights` names a GGUF file: constants by tensor
//! name, borrowed when stored in their declared dtype, converted or
//! dequantized otherwise; shapes checked; the path confined.

use std::path::Path;

use kvjit_core::{DType, Error, Tensor, WeightLoad, bf16, f16};
use kvjit_gguf::writer::{GgufWriter, quantize};
use kvjit_gguf::{GgmlType, dequant};
use kvjit_graph::{Graph, GraphBuilder, GraphError, Params, ValueDef, graph_to_json, load_graph, load_graph_with};

mod common;
use common::registry;

fn values(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * 0.61 + seed).cos() * 2.0).collect()
}

/// A graph whose constants are `(name, dtype, shape)`, each read by a lookup
/// node, written as `dir/model.json` naming `weights`.
fn graph_file(dir: &Path, constants: &[(&str, DType, &[usize])], weights: &str) -> std::path::PathBuf {
    let registry = registry();
    let mut b = GraphBuilder::new("g", &registry);
    let x = b.input("x", DType::F32, &[2.into()]).unwrap();
    for (i, (name, dtype, shape)) in constants.iter().enumerate() {
        let c = b.constant(name, Tensor::zeros(*dtype, shape).unwrap()).unwrap();
        let y = b.node("test.lookup", Params::new(), &[c, x]).unwrap()[0];
        b.output(&format!("y{i}"), y).unwrap();
    }
    let path = dir.join("model.json");
    std::fs::write(&path, graph_to_json(&b.finish().unwrap(), Some(weights))).unwrap();
    path
}

fn constant<'g>(graph: &'g Graph, name: &str) -> &'g Tensor {
    graph
        .constants()
        .find_map(|(_, v)| match &v.def {
            ValueDef::Constant { data, .. } if v.name.as_deref() == Some(name) => Some(data.as_ref()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("constant {name}"))
}

/// The f32 values GGUF stores for `values` encoded as `ty`.
fn stored(ty: GgmlType, values: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; values.len()];
    dequant::dequantize(ty, &quantize(ty, values).unwrap(), &mut out).unwrap();
    out
}

#[test]
fn constants_are_borrowed_converted_or_dequantized_into_their_declared_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let (norm, emb, proj, k, v) =
        (values(8, 0.0), values(4 * 64, 1.0), values(3 * 32, 2.0), values(256, 3.0), values(6, 4.0));
    let mut w = GgufWriter::new();
    w.kv("general.architecture", "llama")
        .tensor("norm", GgmlType::F32, &[8], &norm)
        .tensor("emb", GgmlType::Q8_0, &[4, 64], &emb)
        .tensor("proj", GgmlType::Q4_1, &[3, 32], &proj)
        .tensor("k", GgmlType::Q6K, &[1, 256], &k)
        .tensor("v", GgmlType::BF16, &[2, 3], &v)
        // A type kvjit cannot dequantize is fine while no constant names it.
        .tensor_raw("unused", GgmlType::Q5K, &[256], vec![0; 176]);
    w.write(&dir.path().join("m.gguf")).unwrap();
    let constants: &[(&str, DType, &[usize])] = &[
        ("norm", DType::F32, &[8]),
        ("emb", DType::BF16, &[4, 64]),
        ("proj", DType::F32, &[3, 32]),
        ("k", DType::F16, &[1, 256]),
        ("v", DType::F32, &[2, 3]),
    ];
    let path = graph_file(dir.path(), constants, "m.gguf");
    for mode in [WeightLoad::Map, WeightLoad::Copy] {
        let graph = load_graph_with(&path, &registry(), mode).unwrap();
        let norm_t = constant(&graph, "norm");
        assert!(norm_t.is_mapped(), "an f32 constant borrows the file's f32 tensor");
        assert_eq!(norm_t.to_f32_vec().unwrap(), norm);
        let emb_t = constant(&graph, "emb");
        assert_eq!((emb_t.dtype(), emb_t.shape()), (DType::BF16, &[4, 64][..]));
        let want: Vec<bf16> = stored(GgmlType::Q8_0, &emb).iter().map(|&x| bf16::from_f32(x)).collect();
        assert_eq!(emb_t.as_slice::<bf16>().unwrap(), &want[..]);
        assert_eq!(constant(&graph, "proj").to_f32_vec().unwrap(), stored(GgmlType::Q4_1, &proj));
        let want: Vec<f16> = stored(GgmlType::Q6K, &k).iter().map(|&x| f16::from_f32(x)).collect();
        assert_eq!(constant(&graph, "k").as_slice::<f16>().unwrap(), &want[..]);
        let want: Vec<f32> = v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
        assert_eq!(constant(&graph, "v").to_f32_vec().unwrap(), want);
    }
}

#[test]
fn a_shape_that_disagrees_is_refused_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = GgufWriter::new();
    w.tensor("w", GgmlType::Q8_0, &[2, 32], &values(64, 0.0));
    w.write(&dir.path().join("m.gguf")).unwrap();
    // The transposed shape: a reader that forgot GGUF's innermost-first dims.
    let path = graph_file(dir.path(), &[("w", DType::F32, &[32, 2])], "m.gguf");
    let err = load_graph(&path, &registry()).unwrap_err().to_string();
    assert!(
        err.ends_with(
            "m.gguf: tensor 'w': it is Q8_0[2, 32] (GGUF dims [32, 2], innermost first), but the graph's constant 'w' is f32[32, 2]"
        ),
        "{err}"
    );
    assert!(!err.contains('\n'));
}

#[test]
fn missing_tensors_bad_files_and_paths_outside_the_folder_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = GgufWriter::new();
    w.tensor("other", GgmlType::F32, &[2], &[1.0, 2.0]);
    let bytes = w.to_bytes();
    std::fs::write(dir.path().join("m.gguf"), &bytes).unwrap();
    let path = graph_file(dir.path(), &[("w", DType::F32, &[2])], "m.gguf");
    let err = load_graph(&path, &registry()).unwrap_err().to_string();
    assert_eq!(err, "tensor 'w' not found in the weights file");

    std::fs::write(dir.path().join("cut.gguf"), &bytes[..bytes.len() - 1]).unwrap();
    let path = graph_file(dir.path(), &[("other", DType::F32, &[2])], "cut.gguf");
    let err = load_graph(&path, &registry()).unwrap_err();
    assert!(matches!(&err, GraphError::Tensor(Error::BadTensorFile { format: "GGUF", .. })), "{err:?}");

    let path = graph_file(dir.path(), &[("other", DType::U32, &[2])], "m.gguf");
    let err = load_graph(&path, &registry()).unwrap_err().to_string();
    assert!(err.contains("tensor 'other': GGUF weights load as f32, bf16 or f16, not u32"), "{err}");

    let path = graph_file(dir.path(), &[("other", DType::F32, &[2])], "../m.gguf");
    assert!(matches!(load_graph(&path, &registry()), Err(GraphError::WeightsPath { .. })));
    let path = graph_file(dir.path(), &[("other", DType::F32, &[2])], "M.GGUF");
    std::fs::write(dir.path().join("M.GGUF"), &bytes).unwrap();
    let graph = load_graph(&path, &registry()).unwrap();
    assert_eq!(constant(&graph, "other").to_f32_vec().unwrap(), vec![1.0, 2.0]);
}
