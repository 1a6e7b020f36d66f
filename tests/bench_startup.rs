//! `kvjit bench --startup` end to end on one layer and one run: the table
//! has every figure, the JSON file has them too, and bad options fail with
//! one `error:` line. No test looks at how fast anything is.

use std::process::{Command, Output};

use serde_json::Value;

fn kvjit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvjit")).args(args).output().expect("the kvjit binary starts")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Exit status 1, one line on stderr starting with `error: `, containing `needle`.
fn assert_one_line_error(out: &Output, needle: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line expected: {err}");
    assert!(err.starts_with("error: ") && err.contains(needle), "'{needle}' not in: {err}");
}

#[test]
fn one_layer_startup_reports_every_figure() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("startup.json");
    let out = kvjit(&[
        "bench",
        "--startup",
        "--startup-layers",
        "1",
        "--startup-runs",
        "1",
        "--threads",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "stderr: {}\nstdout: {text}", stderr(&out));
    assert!(text.starts_with("# kvjit bench --startup (1 layers, 1 runs, 1 threads)"), "{text}");
    for row in [
        "| `cat model.safetensors`",
        "| `kvjit validate model.json` |",
        "| graph file → first output, `--weights map` |",
        "| graph file → first output, `--weights copy` |",
        "| artifact → first output |",
        "| peak RSS, artifact |",
        "| decode step, graph file, copy |",
        "| decode step time, copy / map |",
    ] {
        assert!(text.contains(row), "no row '{row}' in:\n{text}");
    }
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["mode"], "startup");
    assert_eq!(report["weight_bytes"], 6144 * 4096 * 2);
    for figure in ["cat_safetensors", "validate", "first_output_map", "first_output_copy", "first_output_artifact"] {
        assert!(report[figure]["wall_s"]["median"].as_f64().unwrap() > 0.0, "{figure}: {report}");
    }
    assert!(report["first_output_artifact"]["peak_rss_bytes"]["median"].as_f64().unwrap() > 0.0);
    assert!(report["first_output_map"]["jit"]["first_s"]["median"].as_f64().unwrap() > 0.0);
    assert!(report["first_output_map"]["command"].as_str().unwrap().contains("--threads 1"));
    for figure in ["decode_map", "decode_copy", "decode_artifact"] {
        assert_eq!(report[figure]["step_s"]["samples"], 20, "{figure}: {report}");
    }
}

#[test]
fn bad_startup_options_fail_with_one_line() {
    let out = kvjit(&["bench", "--startup", "--startup-layers", "0"]);
    assert_one_line_error(&out, "--startup-layers must be at least 1");
    let out = kvjit(&["bench", "--startup", "--startup-runs", "0"]);
    assert_one_line_error(&out, "--startup-runs must be at least 1");
    let out = kvjit(&["bench", "--startup-layers", "2"]);
    assert_one_line_error(&out, "required");
    let out = kvjit(&["bench", "--startup", "--quick"]);
    assert_one_line_error(&out, "cannot be used with");
    if cfg!(target_os = "linux") {
        // More weights than the machine's memory: refused before a byte is
        // written (it once began writing them to the temporary folder).
        let out = kvjit(&["bench", "--startup", "--startup-layers", "100000000"]);
        assert_one_line_error(&out, "more than this machine's");
    }
}
