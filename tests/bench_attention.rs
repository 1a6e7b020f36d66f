//! `kvjit bench --ops attention` end to end on toy sizes (`--tiny`): the
//! Markdown tables and the JSON figures are there, every configuration was
//! validated (kvjit against gather + gemm), and options of the QKV suite are
//! refused with one `error:` line. No test looks at how fast anything is.

use std::process::{Command, Output};

use serde_json::Value;

fn kvjit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvjit")).args(args).output().expect("the kvjit binary starts")
}

#[test]
fn tiny_attention_bench_prints_tables_and_writes_json() {
    let dir = tempfile::tempdir().unwrap();
    let json_path = dir.path().join("attention.json");
    let out = kvjit(&["bench", "--ops", "attention", "--tiny", "--json", json_path.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {stderr}");
    for heading in ["## Decode (S = 1)", "## Prefill", "## RoPE alone", "## Whole attention step graph", "## Targets"] {
        assert!(stdout.contains(heading), "'{heading}' missing: {stdout}");
    }
    assert!(!stdout.contains("## Errors"), "{stdout}");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    assert_eq!(json["ops"], "attention");
    let decode = json["decode"].as_array().unwrap();
    assert_eq!(decode.len(), 8, "2 contexts × 2 batches × 2 dtypes");
    for d in decode {
        assert!(d["kvjit"]["time"]["median"].as_f64().unwrap() > 0.0, "{d}");
        assert!(d["gather_gemm"]["time"]["median"].as_f64().unwrap() > 0.0, "{d}");
        assert!(d["normalized_error"].as_f64().unwrap() <= 1.0 / 64.0, "{d}");
        assert!(d["kvjit"]["share_of_read_roof"]["median"].as_f64().unwrap() > 0.0, "{d}");
    }
    assert!(json["step"]["time"]["median"].as_f64().unwrap() > 0.0);
    assert!(json["errors"].as_array().unwrap().is_empty());
    assert!(!json["targets"].as_array().unwrap().is_empty());
}

#[test]
fn attention_bench_refuses_qkv_options() {
    let out = kvjit(&["bench", "--ops", "attention", "--tiny", "--ms", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("error: ") && stderr.contains("--ms applies to --ops qkv only"), "{stderr}");
    assert!(out.stdout.is_empty());
}
