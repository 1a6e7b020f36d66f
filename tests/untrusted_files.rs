//! Graph files from untrusted sources: the `weights` path a graph file names
//! is confined to the graph file's folder and must be a regular file; tensor
//! files given on the command line must be regular files; an object naming
//! a key twice is refused. Each refusal is one `error:` line, before
//! anything is opened or allocated.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kvjit::{GraphError, load_graph, save_graph, standard_registry};

fn kvjit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvjit")).args(args).output().expect("the kvjit binary starts")
}

/// A graph file in `dir` whose `weights` entry is `weights` (its constants
/// are seeded recipes, but a named weights file is opened all the same).
fn graph_naming(dir: &Path, weights: &str) -> PathBuf {
    let registry = standard_registry();
    let config = kvjit::models::llama::LayerConfig { num_layers: 1, ..kvjit::models::llama::LayerConfig::small() };
    let graph = kvjit::models::llama::qkv_layer_graph(&config, registry.ops()).unwrap();
    let path = dir.join("graph.json");
    save_graph(&graph, &path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let value: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut value = value;
    value["weights"] = serde_json::Value::String(weights.to_string());
    std::fs::write(&path, value.to_string()).unwrap();
    path
}

fn refused(path: &Path) -> GraphError {
    load_graph(path, standard_registry().ops()).expect_err("the graph file was accepted")
}

fn assert_one_line_error(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error: ") && err.contains(needle), "'{needle}' not in: {err}");
}

#[test]
fn weights_paths_outside_the_graph_folder_are_refused_before_opening() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(root.path().join("secret.safetensors"), b"not for you").unwrap();
    std::os::unix::fs::symlink(root.path().join("secret.safetensors"), dir.join("link.safetensors")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.join("zero.safetensors")).unwrap();
    let cases = [
        ("/etc/passwd", "must be a relative path"),
        ("../secret.safetensors", "must be a relative path"),
        ("sub/../../secret.safetensors", "must be a relative path"),
        ("link.safetensors", "outside the graph file's folder"),
        ("zero.safetensors", "outside the graph file's folder"),
    ];
    for (weights, why) in cases {
        let path = graph_naming(&dir, weights);
        let err = refused(&path);
        assert!(matches!(&err, GraphError::WeightsPath { name, .. } if name == weights), "{weights}: {err:?}");
        assert!(err.to_string().contains(why), "{weights}: {err}");
        assert_one_line_error(&kvjit(&["validate", path.to_str().unwrap()]), why);
    }
}

#[test]
fn a_fifo_or_a_folder_named_as_weights_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.safetensors");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo runs");
    assert!(made.success());
    std::fs::create_dir(dir.path().join("folder.safetensors")).unwrap();
    for weights in ["fifo.safetensors", "folder.safetensors"] {
        let path = graph_naming(dir.path(), weights);
        let err = refused(&path);
        assert!(err.to_string().contains("is not a regular file"), "{weights}: {err}");
    }
}

#[test]
fn tensor_files_on_the_command_line_must_be_regular_files() {
    let out = kvjit(&[
        "run",
        concat!(env!("CARGO_MANIFEST_DIR"), "/examples/small_two_layers.json"),
        "--inputs",
        "/dev/zero",
    ]);
    assert_one_line_error(&out, "/dev/zero: not a regular file");
    assert_one_line_error(&kvjit(&["compare", "/dev/zero", "/dev/null"]), "not a regular file");
}

/// A graph file naming a key twice in one object — where serde_json would
/// silently keep the second — is refused with the key and its position.
#[test]
fn a_key_named_twice_in_a_graph_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/small_attention.json")).unwrap();
    let first = text.find(r#""kind": "input","#).expect("the example has an input");
    for (what, edited) in [
        ("kind", format!("{}\"kind\": \"constant\", {}", &text[..first], &text[first..])),
        ("version", text.replacen(r#""version": 1,"#, r#""version": 1, "version": 1,"#, 1)),
    ] {
        assert_ne!(edited, text, "{what}: the edit applies");
        let path = dir.path().join(format!("{what}.json"));
        std::fs::write(&path, &edited).unwrap();
        let err = refused(&path).to_string();
        assert!(err.contains(&format!("duplicate key `{what}` at line")), "{err}");
        assert_one_line_error(&kvjit(&["inspect", path.to_str().unwrap()]), &format!("duplicate key `{what}`"));
    }
}
