//! `kvjit bench` end to end on toy sizes (`--tiny`): the Markdown table, the
//! JSON figures and the SVG plot are all there and well-formed, options pick
//! what runs, and bad options fail with one `error:` line. No test looks at
//! how fast anything is.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

fn kvjit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvjit")).args(args).output().expect("the kvjit binary starts")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Exit status 1 and exactly one line on stderr, starting with `error: `.
fn assert_one_line_error(out: &Output, needle: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line expected: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(err.contains(needle), "'{needle}' not in: {err}");
    assert!(out.stdout.is_empty(), "nothing on stdout: {}", stdout(out));
}

/// A minimal XML well-formedness check: balanced, properly nested tags with
/// quoted attributes, one root element, `&` only in entities.
fn check_well_formed_xml(text: &str) -> Result<String, String> {
    fn check_entities(s: &str) -> Result<(), String> {
        for (i, _) in s.match_indices('&') {
            let rest = &s[i + 1..];
            let end = rest.find(';').ok_or_else(|| format!("bare '&' in {s:?}"))?;
            let name = &rest[..end];
            let ok = ["amp", "lt", "gt", "quot", "apos"].contains(&name)
                || name
                    .strip_prefix('#')
                    .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric()));
            if !ok {
                return Err(format!("unknown entity &{name};"));
            }
        }
        Ok(())
    }
    let mut stack: Vec<String> = Vec::new();
    let mut root = None;
    let mut rest = text;
    while let Some(open) = rest.find('<') {
        let between = &rest[..open];
        if stack.is_empty() && !between.trim().is_empty() {
            return Err(format!("text outside the root: {between:?}"));
        }
        check_entities(between)?;
        rest = &rest[open..];
        if let Some(body) = rest.strip_prefix("<?") {
            rest = &body[body.find("?>").ok_or("unclosed <?")? + 2..];
            continue;
        }
        if let Some(body) = rest.strip_prefix("<!--") {
            rest = &body[body.find("-->").ok_or("unclosed comment")? + 3..];
            continue;
        }
        let close = rest.find('>').ok_or("unclosed tag")?;
        let tag = &rest[1..close];
        rest = &rest[close + 1..];
        if let Some(name) = tag.strip_prefix('/') {
            let open_name = stack.pop().ok_or_else(|| format!("</{name}> closes nothing"))?;
            if open_name != name.trim() {
                return Err(format!("<{open_name}> closed by </{name}>"));
            }
            continue;
        }
        let self_closing = tag.ends_with('/');
        let tag = tag.trim_end_matches('/');
        let name_end = tag.find(char::is_whitespace).unwrap_or(tag.len());
        let name = &tag[..name_end];
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_:".contains(c)) {
            return Err(format!("bad tag name in <{tag}>"));
        }
        // Attributes: name="value", separated by whitespace.
        let mut attrs = tag[name_end..].trim();
        while !attrs.is_empty() {
            let eq = attrs.find("=\"").ok_or_else(|| format!("unquoted attribute in <{tag}>"))?;
            let attr = attrs[..eq].trim();
            if attr.is_empty() || !attr.chars().all(|c| c.is_ascii_alphanumeric() || "-_:".contains(c)) {
                return Err(format!("bad attribute name {attr:?} in <{name}>"));
            }
            let value_and_rest = &attrs[eq + 2..];
            let end = value_and_rest.find('"').ok_or_else(|| format!("unterminated attribute in <{name}>"))?;
            check_entities(&value_and_rest[..end])?;
            if value_and_rest[..end].contains('<') {
                return Err(format!("'<' in an attribute of <{name}>"));
            }
            attrs = value_and_rest[end + 1..].trim_start();
        }
        if stack.is_empty() {
            if root.is_some() {
                return Err(format!("second root element <{name}>"));
            }
            root = Some(name.to_string());
        }
        if !self_closing {
            stack.push(name.to_string());
        }
    }
    if !rest.trim().is_empty() {
        return Err(format!("text after the root: {rest:?}"));
    }
    if let Some(open) = stack.pop() {
        return Err(format!("<{open}> never closed"));
    }
    root.ok_or_else(|| "no element".to_string())
}

#[test]
fn the_xml_check_catches_what_it_should() {
    assert_eq!(check_well_formed_xml(r#"<svg a="1"><g><text>a &amp; b</text></g><line/></svg>"#).unwrap(), "svg");
    for bad in
        ["<svg><g></svg>", "<svg>a & b</svg>", r#"<svg a=1/>"#, "<svg/><svg/>", "<svg>", r#"<svg a="<"/>"#, "</svg>"]
    {
        assert!(check_well_formed_xml(bad).is_err(), "{bad}");
    }
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("JSON written")).expect("valid JSON")
}

fn assert_stats(v: &Value, what: &str) {
    for field in ["median", "min", "max", "q1", "q3"] {
        let x = v[field].as_f64().unwrap_or_else(|| panic!("{what}.{field} missing: {v}"));
        assert!(x.is_finite() && x > 0.0, "{what}.{field} = {x}");
    }
    assert!(v["min"].as_f64() <= v["median"].as_f64() && v["median"].as_f64() <= v["max"].as_f64(), "{what}: {v}");
    assert!(v["samples"].as_u64().unwrap() >= 2, "{what}: {v}");
}

#[test]
fn tiny_bench_prints_table_and_writes_json_and_svg() {
    let dir = tempfile::tempdir().unwrap();
    let json_path = dir.path().join("bench.json");
    let out = kvjit(&["bench", "--tiny", "--json", json_path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));

    // The table: header with every column, one row per implementation and M.
    let text = stdout(&out);
    let avx2 = kvjit::widest_cpu_tier() == kvjit::CodeTier::Avx2;
    let unspecialized_column = if avx2 { " vs kvjit unspecialized |" } else { "" };
    let header = format!(
        "| M | implementation | median | spread | GFLOP/s | weight GB/s | vs kvjit generic |{unspecialized_column} \
         vs kvjit specialized (Cranelift tier) | vs gemm+scatter | vs matrixmultiply+scatter | roof | of roof |"
    );
    assert!(text.contains(&header), "{header}\n{text}");
    assert!(text.contains("Roofs, 2 threads"), "{text}");
    let tier = kvjit::widest_cpu_tier();
    let key = format!("`fused_qkv_bshd_paged.cpu-{tier}.f32.k64.q64.hkv2.d16.p4.l1.kvf32.bany.sany`");
    assert!(text.contains(&key), "{key}: {text}");
    let mut labels = vec!["kvjit specialized", "kvjit generic"];
    if avx2 {
        labels.push("kvjit unspecialized");
    }
    labels.extend([
        "kvjit specialized (Cranelift tier)",
        "kvjit generic (Cranelift tier)",
        "reference",
        "gemm+scatter",
        "matrixmultiply+scatter",
    ]);
    for m in ["1", "8"] {
        for &label in &labels {
            let row = format!("| {m} | {label} |");
            let line = text.lines().find(|l| l.starts_with(&row)).unwrap_or_else(|| panic!("no row {row}: {text}"));
            assert_eq!(line.matches('|').count(), 13 + usize::from(avx2), "{line}");
            assert!(line.contains("bandwidth") || line.contains("fma"), "{line}");
        }
    }
    assert!(text.contains("## Compile latency"), "{text}");
    for case in ["1 node", "4 layers (one key)", "graph file + safetensors → first output"] {
        assert!(text.contains(case), "{case}: {text}");
    }
    assert!(stderr(&out).contains("roofline probes"), "progress on stderr: {}", stderr(&out));

    // The JSON: every figure with medians and spreads.
    let json = read_json(&json_path);
    assert_eq!(json["format"], "kvjit-bench");
    assert_eq!(json["mode"], "tiny");
    assert_eq!(json["threads"], 2);
    assert_stats(&json["roof"]["read_gbs"], "roof.read_gbs");
    assert_stats(&json["roof"]["fma_gflops"], "roof.fma_gflops");
    let groups = json["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 1);
    let group = &groups[0];
    assert_eq!(group["dtype"], "f32");
    assert_eq!(group["page_size"], 4);
    assert_eq!(group["shape"]["k"], 64);
    let points = group["points"].as_array().unwrap();
    assert_eq!(points.iter().map(|p| p["m"].as_u64().unwrap()).collect::<Vec<_>>(), vec![1, 8]);
    for p in points {
        assert!(["bandwidth", "fma"].contains(&p["roof"]["bound"].as_str().unwrap()), "{p}");
        assert!(p["roof"]["gflops"].as_f64().unwrap() > 0.0);
        assert!(p["flops"].as_f64().unwrap() > 0.0 && p["weight_bytes"].as_f64().unwrap() > 0.0);
        let impls = p["implementations"].as_array().unwrap();
        let ids: Vec<&str> = impls.iter().map(|i| i["implementation"].as_str().unwrap()).collect();
        let unspecialized = if avx2 { vec!["unspecialized"] } else { vec![] };
        assert_eq!(
            ids,
            [
                vec!["specialized", "generic"],
                unspecialized,
                vec![
                    "specialized_cranelift",
                    "generic_cranelift",
                    "reference",
                    "gemm_scatter",
                    "matrixmultiply_scatter"
                ]
            ]
            .concat()
        );
        for i in impls {
            let id = i["implementation"].as_str().unwrap();
            assert_stats(&i["time_s"], id);
            assert_stats(&i["gflops"], id);
            assert_stats(&i["weight_gbs"], id);
            assert!(i["fraction_of_roof"].as_f64().unwrap() > 0.0);
            let unspecialized = avx2.then_some("unspecialized");
            for baseline in ["generic", "specialized_cranelift", "gemm_scatter", "matrixmultiply_scatter"]
                .into_iter()
                .chain(unspecialized)
            {
                assert!(i["speedup_vs"][baseline].as_f64().unwrap() > 0.0, "{id} vs {baseline}: {i}");
            }
            let key = i["kernel_key"].as_str();
            let jit = ["specialized", "generic", "unspecialized"].iter().any(|p| id.starts_with(p));
            assert_eq!(key.is_some(), jit, "{i}");
        }
        let specialized = impls[0]["kernel_key"].as_str().unwrap();
        assert!(specialized.ends_with(&format!(".b{}.s{}", p["batch"], p["seq"])), "{specialized}");
    }
    let cases = json["compile_latency"]["cases"].as_array().unwrap();
    let ids: Vec<&str> = cases.iter().map(|c| c["case"].as_str().unwrap()).collect();
    assert_eq!(ids, ["graph_1_node", "graph_4_layers", "file_to_first_output"]);
    for c in cases {
        assert_stats(&c["time_s"], c["case"].as_str().unwrap());
        assert_eq!(c["jit_compiles"], 1, "the kernel cache compiles one key once: {c}");
    }

    // The plot, next to the JSON.
    let svg = std::fs::read_to_string(dir.path().join("bench.svg")).expect("SVG written next to the JSON");
    assert_eq!(check_well_formed_xml(&svg), Ok("svg".to_string()), "{svg}");
    assert!(svg.contains("roof: min(FMA, bandwidth × FLOP/byte)"), "the roof is in the legend: {svg}");
    let black_lines = svg.lines().filter(|l| l.starts_with("<polyline") && l.contains(r##"stroke="#000000""##)).count();
    assert!(black_lines >= 10, "the roof is drawn, dashed (black segments): {svg}");
    assert!(svg.matches("<polyline").count() >= 6, "five implementations and the roof: {svg}");
    assert!(stderr(&out).contains("bench.svg"), "{}", stderr(&out));
}

#[test]
fn options_pick_shapes_dtypes_pages_ms_implementations_and_threads() {
    let dir = tempfile::tempdir().unwrap();
    let json_path = dir.path().join("picked.json");
    let svg_path = dir.path().join("plot.svg");
    let out = kvjit(&[
        "bench",
        "--tiny",
        "--shapes",
        "32/2/1/16,48/3/1/8",
        "--dtypes",
        "bf16",
        "--pages",
        "8,2",
        "--ms",
        "3",
        "--impls",
        "gemm_scatter,specialized",
        "--threads",
        "1",
        "--no-compile",
        "--json",
        json_path.to_str().unwrap(),
        "--svg",
        svg_path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("| 3 | kvjit specialized |") && text.contains("| 3 | gemm+scatter |"), "{text}");
    assert!(!text.contains("kvjit generic |") && !text.contains("| reference |"), "{text}");
    assert!(!text.contains("vs kvjit generic") && !text.contains("Compile latency"), "{text}");
    assert!(text.contains("Roofs, 1 threads"), "{text}");
    let json = read_json(&json_path);
    assert_eq!(json["threads"], 1);
    assert!(json["compile_latency"].is_null());
    let groups = json["groups"].as_array().unwrap();
    let picked: Vec<(u64, &str, u64)> = groups
        .iter()
        .map(|g| (g["shape"]["k"].as_u64().unwrap(), g["dtype"].as_str().unwrap(), g["page_size"].as_u64().unwrap()))
        .collect();
    assert_eq!(picked, [(32, "bf16", 8), (32, "bf16", 2), (48, "bf16", 8), (48, "bf16", 2)]);
    for g in groups {
        let impls = g["points"][0]["implementations"].as_array().unwrap();
        assert_eq!(impls.len(), 2);
        assert_eq!(g["points"][0]["batch"], 3);
    }
    let svg = std::fs::read_to_string(&svg_path).expect("--svg names the plot");
    check_well_formed_xml(&svg).unwrap();
    assert!(!dir.path().join("picked.svg").exists());
}

#[test]
fn bad_options_fail_with_one_error_line() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no/such/dir/bench.json");
    let cases: [(&[&str], &str); 15] = [
        (&["bench", "--tiny", "--dtypes", "f64"], "f64"),
        (&["bench", "--tiny", "--dtypes", "u32"], "not a float type"),
        (&["bench", "--tiny", "--shapes", "7b"], "unknown shape '7b'"),
        (&["bench", "--tiny", "--shapes", "64/4/2"], "K/QH/KVH/D"),
        (&["bench", "--tiny", "--ms", "0"], "M must be at least 1"),
        (&["bench", "--tiny", "--pages", "0"], "page sizes must be at least 1"),
        (&["bench", "--tiny", "--impls", "cublas"], "unknown implementation 'cublas'"),
        // A value named twice ran every point of it twice.
        (&["bench", "--tiny", "--pages", "16,4,16"], "--pages names 16 twice"),
        (&["bench", "--tiny", "--shapes", "8b,8b"], "--shapes names 8b twice"),
        (&["bench", "--ops", "attention", "--tiny", "--dtypes", "bf16,bf16"], "--dtypes names bf16 twice"),
        (&["bench", "--tiny", "--ms", "18446744073709551615"], "more tokens than a cache's u32 positions hold"),
        (&["bench", "--tiny", "--json", missing.to_str().unwrap()], "cannot write"),
        (&["bench", "--quick", "--tiny"], "cannot be used with"),
        (
            &["bench", "--ops", "fp8", "--dtypes", "bf16"],
            "--dtypes applies to --ops qkv, attention, model and blocks only, not to --ops fp8",
        ),
        (&["bench", "--ops", "attention", "--svg", "a.svg"], "--svg applies to --ops qkv only, not to --ops attention"),
    ];
    for (args, needle) in cases {
        assert_one_line_error(&kvjit(args), needle);
    }
    assert!(!missing.exists());
}

/// `--ops fp8` runs through the driver of the other suites: a progress
/// display on stderr, the tables on stdout, the JSON file made before the
/// run (so a bad path fails before anything is measured or printed).
#[test]
fn tiny_fp8_bench_prints_tables_and_writes_json_made_before_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let json_path = dir.path().join("fp8.json");
    let out = kvjit(&["bench", "--ops", "fp8", "--tiny", "--json", json_path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for heading in ["## Fused QKV store", "## Decode attention", "## Attention-step graph"] {
        assert!(text.contains(heading), "'{heading}' missing: {text}");
    }
    assert!(stderr(&out).contains("fused QKV store, M = 16"), "progress on stderr: {}", stderr(&out));
    let json = read_json(&json_path);
    assert_eq!(json["mode"], "tiny");
    assert_eq!(json["granularity"], 128);
    assert_eq!(json["store"].as_array().unwrap().len(), 2);
    assert_stats(&json["attention"][0]["time"]["f8e4m3"], "attention[0].time.f8e4m3");
    assert_stats(&json["step"]["time"]["bf16"], "step.time.bf16");

    let missing = dir.path().join("no/such/dir/fp8.json");
    assert_one_line_error(
        &kvjit(&["bench", "--ops", "fp8", "--tiny", "--json", missing.to_str().unwrap()]),
        "cannot write",
    );
}

/// `--ops layer --tiny`: a toy decoder layer compiled fused and unfused,
/// validated against each other and timed side by side; the tables and the
/// JSON figures are there (no test looks at how fast anything is), and
/// `--no-fuse` times the unfused layer alone.
#[test]
fn tiny_layer_bench_prints_tables_and_writes_json() {
    let dir = tempfile::tempdir().unwrap();
    let json_path = dir.path().join("layer.json");
    let out = kvjit(&["bench", "--ops", "layer", "--tiny", "--json", json_path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for heading in ["## The layer step", "## Where the time goes", "## Steps: decode B=1 history 40", "## Targets"] {
        assert!(text.contains(heading), "'{heading}' missing: {text}");
    }
    assert!(!text.contains("## Errors"), "{text}");
    let json = read_json(&json_path);
    assert_eq!((json["ops"].as_str(), json["mode"].as_str()), (Some("layer"), Some("tiny")));
    let workloads = json["workloads"].as_array().unwrap();
    assert_eq!(workloads.len(), 3, "decode B=1, decode B=3, prefill");
    for w in workloads {
        assert!(w["normalized_error"].as_f64().unwrap() <= 1.0 / 64.0, "{w}");
        for graph in ["fused", "unfused"] {
            assert_stats(&w[graph]["time"], graph);
        }
    }
    assert_eq!(json["targets"].as_array().unwrap().len(), 6);
    assert!(json["errors"].as_array().unwrap().is_empty());

    let out = kvjit(&["bench", "--ops", "layer", "--tiny", "--no-fuse"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("| decode B=1 history 40 | unfused |"), "{text}");
    assert!(!text.contains("| decode B=1 history 40 | fused |"), "{text}");
    assert_one_line_error(
        &kvjit(&["bench", "--ops", "layer", "--tiny", "--ms", "4"]),
        "--ms applies to --ops qkv only",
    );
    assert_one_line_error(&kvjit(&["bench", "--tiny", "--no-fuse"]), "--no-fuse applies to --ops layer only");
}

/// A tiny Llama GGUF (2 layers, hidden 32, 4 query and 2 KV heads of 8,
/// FFN 64, vocabulary 40, tied head), every tensor F32: enough for the
/// model suite, which needs no tokenizer.
fn tiny_llama_gguf(path: &Path) {
    use kvjit::gguf::GgmlType;
    use kvjit::gguf::writer::{GgufWriter, MetaValue};
    let (layers, hidden, heads, kv_heads, head, ffn, vocab) = (2usize, 32usize, 4usize, 2usize, 8usize, 64usize, 40);
    let mut w = GgufWriter::new();
    w.kv("general.architecture", MetaValue::from("llama"));
    w.kv("llama.context_length", MetaValue::from(256u32));
    w.kv("llama.embedding_length", MetaValue::from(hidden as u32));
    w.kv("llama.block_count", MetaValue::from(layers as u32));
    w.kv("llama.feed_forward_length", MetaValue::from(ffn as u32));
    w.kv("llama.attention.head_count", MetaValue::from(heads as u32));
    w.kv("llama.attention.head_count_kv", MetaValue::from(kv_heads as u32));
    w.kv("llama.rope.dimension_count", MetaValue::from(head as u32));
    w.kv("llama.rope.freq_base", MetaValue::from(10000.0f32));
    w.kv("llama.attention.layer_norm_rms_epsilon", MetaValue::from(1e-5f32));
    let mut seed = 1u32;
    let mut values = |n: usize, scale: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                ((seed >> 8) as f32 / (1 << 24) as f32 - 0.5) * scale
            })
            .collect()
    };
    w.tensor("token_embd.weight", GgmlType::F32, &[vocab, hidden], &values(vocab * hidden, 1.0));
    for l in 0..layers {
        let ones = vec![1.0f32; hidden];
        w.tensor(&format!("blk.{l}.attn_norm.weight"), GgmlType::F32, &[hidden], &ones);
        for (name, n, k) in [
            ("attn_q", heads * head, hidden),
            ("attn_k", kv_heads * head, hidden),
            ("attn_v", kv_heads * head, hidden),
            ("attn_output", hidden, heads * head),
            ("ffn_gate", ffn, hidden),
            ("ffn_up", ffn, hidden),
            ("ffn_down", hidden, ffn),
        ] {
            w.tensor(&format!("blk.{l}.{name}.weight"), GgmlType::F32, &[n, k], &values(n * k, 0.5));
            if name == "attn_output" {
                w.tensor(&format!("blk.{l}.ffn_norm.weight"), GgmlType::F32, &[hidden], &ones);
            }
        }
    }
    w.tensor("output_norm.weight", GgmlType::F32, &[hidden], &vec![1.0f32; hidden]);
    w.write(path).unwrap();
}

/// `--ops model --tiny` on a tiny GGUF written here: the tables, the
/// targets, the llama.cpp row labelled as quoted, the JSON figures; no
/// `--gguf` is refused in one line.
#[test]
fn tiny_model_bench_prints_tables_and_writes_json() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    tiny_llama_gguf(&gguf);
    let json_path = dir.path().join("model.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvjit"))
        .args(["bench", "--ops", "model", "--tiny", "--gguf", gguf.to_str().unwrap()])
        .args(["--json", json_path.to_str().unwrap()])
        .env_remove("KVJIT_LLAMA_CPP")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let md = stdout(&out);
    for needle in [
        "## Tokens per second",
        "| kvjit f32 |",
        "llama.cpp (quoted, not measured in this run)",
        "llama.cpp peer: not installed",
        "## Decode steps: read roof and executor overhead",
        "## Where a decode step goes: f32 at context 32",
        "matmul(ffn_down)+add",
        "## Targets",
        "executor overhead",
    ] {
        assert!(md.contains(needle), "no '{needle}' in:\n{md}");
    }
    let json = read_json(&json_path);
    assert_eq!(json["suite"], "model");
    let f32 = &json["dtypes"][0];
    assert_eq!(f32["dtype"], "f32");
    assert_eq!(f32["prefill"].as_array().unwrap().len(), 2);
    let decode = &f32["decode"][1];
    assert_eq!(decode["context"], 32);
    assert!(decode["tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(decode["bytes"].as_f64().unwrap() > 0.0);
    assert_stats(&decode["time_s"], "decode time");
    // The share of the read roof: one sample per paired round (2 in the
    // tiny config), each a positive ratio.
    assert_stats(&decode["share_of_read_roof"], "decode share of the read roof");
    assert_eq!(decode["share_of_read_roof"]["samples"], 2);
    assert!(md.contains("share of the read roof (paired)"), "{md}");
    assert_eq!(json["llama_cpp"]["status"], "not installed");

    assert_one_line_error(&kvjit(&["bench", "--ops", "model", "--tiny"]), "--gguf");
}
