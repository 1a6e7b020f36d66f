//! kvjit's dequantization of every GGML type it reads against gguf-py's
//! (`gguf.quants.dequantize`, numpy), bit for bit, on the random blocks of
//! `fixtures/gguf_py_dequant.json` (written by
//! `scripts/reference/run.sh --dequant-fixture`).

use kvjit_gguf::GgmlType;
use kvjit_gguf::dequant::dequantize;

fn hex(text: &str) -> Vec<u8> {
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex digits")).collect()
}

#[test]
fn every_supported_block_type_dequantizes_as_gguf_py_does() {
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/gguf_py_dequant.json")).expect("the fixture is JSON");
    let types = fixture["types"].as_object().expect("a map of types");
    let mut checked = Vec::new();
    for ty in GgmlType::all().filter(|t| t.is_supported() && t.block_size() > 1) {
        let entry = types.get(ty.name()).unwrap_or_else(|| panic!("the fixture has no {ty} blocks"));
        let blocks = hex(entry["blocks"].as_str().expect("hex"));
        let expected: Vec<f32> = hex(entry["values"].as_str().expect("hex"))
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(blocks.len() / ty.type_size() * ty.block_size(), expected.len(), "{ty}");
        let mut out = vec![f32::NAN; expected.len()];
        dequantize(ty, &blocks, &mut out).unwrap_or_else(|e| panic!("{ty}: {e}"));
        for (i, (&got, &want)) in out.iter().zip(&expected).enumerate() {
            let same = got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
            assert!(same, "{ty} element {i} (block {}): kvjit {got:e}, gguf-py {want:e}", i / ty.block_size());
        }
        checked.push(ty.name());
    }
    // Every quantized type kvjit reads is in the fixture, the new ones too.
    for name in ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "IQ4_NL", "IQ4_XS"] {
        assert!(checked.contains(&name), "{name} was not checked: {checked:?}");
    }
}
