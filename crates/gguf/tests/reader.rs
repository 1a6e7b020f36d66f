//! The GGUF reader on files the writer makes and on files crafted by hand
//! to break each check (the classes GGUF loaders have shipped bugs for).

use std::path::{Path, PathBuf};

use kvjit_core::{DType, Error, WeightLoad, bf16};
use kvjit_gguf::writer::{GgufWriter, MetaValue, put_string, put_u32, put_u64, quantize};
use kvjit_gguf::{GgmlType, Gguf, Value, ValueType, dequant};

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// The one-line refusal of `bytes`, the same from a file and from memory.
fn refusal(bytes: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "bad.gguf", bytes);
    let from_file = Gguf::open(&path).expect_err("the file is refused");
    assert!(matches!(from_file, Error::BadTensorFile { format: "GGUF", .. }), "{from_file:?}");
    let message = from_file.to_string();
    assert!(!message.contains('\n'), "one line: {message}");
    let from_memory = Gguf::from_bytes("bad.gguf", bytes).expect_err("the bytes are refused").to_string();
    assert_eq!(message.replace(&path.display().to_string(), "bad.gguf"), from_memory);
    message
}

/// A file whose header says `tensors` and `kvs`, then `body`.
fn raw(version: u32, tensors: u64, kvs: u64, body: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    put_u32(&mut out, version);
    put_u64(&mut out, tensors);
    put_u64(&mut out, kvs);
    body(&mut out);
    out
}

/// One metadata entry: `key`, type id `ty`, then `value` as raw bytes.
fn kv(out: &mut Vec<u8>, key: &str, ty: u32, value: &[u8]) {
    put_string(out, key);
    put_u32(out, ty);
    out.extend_from_slice(value);
}

/// One tensor entry.
fn tensor_entry(out: &mut Vec<u8>, name: &str, ne: &[u64], ty: u32, offset: u64) {
    put_string(out, name);
    put_u32(out, ne.len() as u32);
    ne.iter().for_each(|&d| put_u64(out, d));
    put_u32(out, ty);
    put_u64(out, offset);
}

fn pad_to(out: &mut Vec<u8>, align: usize) {
    out.resize(out.len().next_multiple_of(align), 0);
}

fn values(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * 0.37 + seed).sin() * 3.0).collect()
}

/// A file with metadata of every type and a tensor of every type kvjit reads.
/// A tensor the test writes: name, type, row-major shape, values.
type Written = (&'static str, GgmlType, Vec<usize>, Vec<f32>);

fn every_type() -> (GgufWriter, Vec<Written>) {
    let mut w = GgufWriter::new();
    w.kv("general.architecture", "llama")
        .kv("llama.block_count", 2u32)
        .kv("llama.rope.freq_base", 100000.0f32)
        .kv("general.file_type", MetaValue::I32(3))
        .kv("big", MetaValue::U64(1 << 40))
        .kv("neg", MetaValue::I64(-5))
        .kv("small", MetaValue::U8(7))
        .kv("f64", MetaValue::F64(0.25))
        .kv("flag", true)
        .kv("tokenizer.ggml.tokens", MetaValue::strings(["a", "b", "<0x0A>", "héllo"]))
        .kv("tokenizer.ggml.token_type", MetaValue::i32s([1, 1, 6, 1]))
        .kv("tokenizer.ggml.scores", MetaValue::f32s([0.0, -1.0, -2.5, 3.0]))
        .kv("u16s", MetaValue::Array(ValueType::U16, vec![MetaValue::U16(65535), MetaValue::U16(1)]))
        .kv("empty", MetaValue::Array(ValueType::String, vec![]));
    let tensors = vec![
        ("f32", GgmlType::F32, vec![3, 5], values(15, 0.0)),
        ("f16", GgmlType::F16, vec![2, 4], values(8, 1.0)),
        ("bf16", GgmlType::BF16, vec![4, 2], values(8, 2.0)),
        ("q8_0", GgmlType::Q8_0, vec![3, 64], values(192, 3.0)),
        ("q4_0", GgmlType::Q4_0, vec![2, 32], values(64, 4.0)),
        ("q4_1", GgmlType::Q4_1, vec![2, 1, 32], values(64, 5.0)),
        ("q4_k", GgmlType::Q4K, vec![2, 256], values(512, 6.0)),
        ("q6_k", GgmlType::Q6K, vec![256], values(256, 7.0)),
        ("norm", GgmlType::F32, vec![7], values(7, 8.0)),
    ];
    for (name, ty, shape, v) in &tensors {
        w.tensor(name, *ty, shape, v);
    }
    (w, tensors)
}

#[test]
fn a_written_file_reads_back_metadata_and_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let (w, tensors) = every_type();
    let path = write(dir.path(), "m.gguf", &w.to_bytes());
    for mode in [WeightLoad::Map, WeightLoad::Copy] {
        let g = Gguf::open_with(&path, mode).unwrap();
        assert_eq!((g.version(), g.alignment()), (3, 32));
        assert_eq!(g.architecture().unwrap(), "llama");
        assert_eq!(g.arch_key("block_count").unwrap(), "llama.block_count");
        assert_eq!(g.get_u32("llama.block_count").unwrap(), 2);
        assert_eq!(g.get_u64("llama.block_count").unwrap(), 2);
        assert_eq!(g.get_u32("general.file_type").unwrap(), 3);
        assert_eq!(g.get_u32("small").unwrap(), 7);
        assert_eq!(g.get_u64("big").unwrap(), 1 << 40);
        assert_eq!(g.get_i64_opt("neg").unwrap(), Some(-5));
        assert_eq!(g.get_f32("llama.rope.freq_base").unwrap(), 100000.0);
        assert_eq!(g.get_f32("f64").unwrap(), 0.25);
        assert!(g.get_bool("flag").unwrap());
        assert_eq!(g.get_str_array("tokenizer.ggml.tokens").unwrap(), vec!["a", "b", "<0x0A>", "héllo"]);
        assert_eq!(g.get_i32_array("tokenizer.ggml.token_type").unwrap(), vec![1, 1, 6, 1]);
        assert_eq!(g.get_u32_array("tokenizer.ggml.token_type").unwrap(), vec![1, 1, 6, 1]);
        assert_eq!(g.get_f32_array("tokenizer.ggml.scores").unwrap(), vec![0.0, -1.0, -2.5, 3.0]);
        assert_eq!(g.get_i32_array("u16s").unwrap(), vec![65535, 1]);
        assert!(g.get_str_array("empty").unwrap().is_empty());
        assert_eq!(g.get_u32_opt("absent").unwrap(), None);
        assert_eq!(g.keys().count(), 14);
        assert!(matches!(g.get("u16s"), Some(Value::Array(a)) if a.elem_type() == ValueType::U16 && a.len() == 2));

        assert_eq!(g.tensors().len(), tensors.len());
        for (name, ty, shape, v) in &tensors {
            let info = g.tensor_info(name).unwrap();
            assert_eq!(info.ggml_type(), *ty, "{name}");
            assert_eq!(&info.shape(), shape, "{name}");
            assert_eq!(info.ne().iter().rev().map(|&d| d as usize).collect::<Vec<_>>(), *shape);
            assert_eq!(info.offset() % 32, 0);
            // The f32 reference: the stored blocks, dequantized.
            let stored = quantize(*ty, v).unwrap();
            assert_eq!(g.tensor_data(name).unwrap(), &stored[..], "{name}");
            let mut want = vec![0f32; v.len()];
            dequant::dequantize(*ty, &stored, &mut want).unwrap();
            let tol = match ty {
                GgmlType::F32 => 0.0,
                GgmlType::F16 | GgmlType::BF16 => 0.02,
                _ => 0.5,
            };
            for (a, b) in want.iter().zip(v) {
                assert!((a - b).abs() <= tol, "{name}: {a} vs {b}");
            }
            let (as_f32, borrowed) = g.load_tensor(name, DType::F32).unwrap();
            assert_eq!(as_f32.shape(), &shape[..]);
            assert_eq!(as_f32.to_f32_vec().unwrap(), want, "{name} as f32");
            assert_eq!(borrowed, *ty == GgmlType::F32, "{name}");
            let as_bf16 = g.tensor(name, DType::BF16).unwrap();
            let want_bf16: Vec<bf16> = want.iter().map(|&x| bf16::from_f32(x)).collect();
            assert_eq!(as_bf16.as_slice::<bf16>().unwrap(), &want_bf16[..], "{name} as bf16");
            let (as_f16, borrowed) = g.load_tensor(name, DType::F16).unwrap();
            assert_eq!(borrowed, *ty == GgmlType::F16, "{name}");
            assert_eq!(as_f16.shape(), &shape[..]);
        }
        assert!(g.tensor("f32", DType::F32).unwrap().is_mapped());
        let loaded = g.load_tensors([("f32", DType::F32), ("q8_0", DType::BF16)]).unwrap();
        assert_eq!((loaded.mapped_bytes, loaded.copied_bytes), (60, 384));
    }
}

#[test]
fn missing_and_mistyped_keys_name_the_key() {
    let (w, _) = every_type();
    let g = Gguf::from_bytes("m.gguf", &w.to_bytes()).unwrap();
    let err = g.get_u32("llama.context_length").unwrap_err();
    assert!(matches!(&err, Error::GgufMetadata { key, .. } if &**key == "llama.context_length"));
    assert_eq!(err.to_string(), "m.gguf: missing metadata key llama.context_length");
    assert_eq!(
        g.get_u32("general.architecture").unwrap_err().to_string(),
        "m.gguf: metadata key general.architecture is a string, expected u32"
    );
    assert_eq!(g.get_u32("neg").unwrap_err().to_string(), "m.gguf: metadata key neg = -5 does not fit u32");
    assert_eq!(
        g.get_str_array("tokenizer.ggml.scores").unwrap_err().to_string(),
        "m.gguf: metadata key tokenizer.ggml.scores is an array of f32, expected an array of string"
    );
    assert!(g.get_i32_array("tokenizer.ggml.tokens").unwrap_err().to_string().contains("an array of string"));
    assert!(g.get_f32("flag").unwrap_err().to_string().contains("is a bool, expected f32"));
    assert_eq!(g.tensor("nope", DType::F32).unwrap_err().to_string(), "tensor 'nope' not found in m.gguf");
    assert!(g.tensor("f32", DType::U32).unwrap_err().to_string().contains("f32, bf16 or f16, not u32"));
    let mut w = GgufWriter::new();
    w.tensor_raw("iq2", GgmlType::Iq2Xxs, &[256], vec![0; 66]);
    let g = Gguf::from_bytes("m.gguf", &w.to_bytes()).unwrap();
    let err = g.tensor("iq2", DType::F32).unwrap_err().to_string();
    assert!(err.starts_with("m.gguf: tensor 'iq2': GGML type IQ2_XXS is not one kvjit reads"), "{err}");
}

#[test]
fn tensor_dims_whose_product_wraps_are_refused() {
    // 2^42+1 · 2^22 = 2^64 + 2^22: wraps to 2^22 in 64 bits.
    for ne in [vec![(1u64 << 42) + 1, 1 << 22], vec![1 << 32, 1 << 32], vec![1 << 62, 4], vec![0, 1 << 40, 1 << 40]] {
        let bytes = raw(3, 1, 0, |out| {
            tensor_entry(out, "w", &ne, 0, 0);
            pad_to(out, 32);
            out.extend_from_slice(&[0; 64]);
        });
        let message = refusal(&bytes);
        assert!(message.contains("more elements than GGML's limit"), "{ne:?}: {message}");
    }
    let bytes = raw(3, 1, 0, |out| tensor_entry(out, "w", &[u64::MAX], 0, 0));
    assert!(refusal(&bytes).contains("dim 0 is 18446744073709551615"));
    let bytes = raw(3, 1, 0, |out| tensor_entry(out, "w", &[1, 1, 1, 1, 1], 0, 0));
    assert!(refusal(&bytes).contains("has 5 dims"));
    // Elements that fit, bytes that do not.
    let bytes = raw(3, 1, 0, |out| tensor_entry(out, "w", &[1 << 62], 28, 0)); // F64: 2^65 bytes
    assert!(refusal(&bytes).contains("more bytes than fit in 64 bits"));
}

#[test]
fn string_and_array_lengths_of_2_63_are_refused_before_any_allocation() {
    let huge = 1u64 << 63;
    // A key of 2^63 bytes.
    let bytes = raw(3, 0, 1, |out| {
        put_u64(out, huge);
        out.extend_from_slice(&[0; 16]);
    });
    assert!(refusal(&bytes).contains(&format!("metadata key 0 (declared {huge} bytes long) needs {huge} bytes")));
    // A string value of 2^63 bytes.
    let bytes = raw(3, 0, 1, |out| kv(out, "k", 8, &huge.to_le_bytes()));
    assert!(refusal(&bytes).contains("metadata 'k' (declared 9223372036854775808 bytes long)"));
    // An array of 2^63 u8, of 2^63 u64 (the byte count overflows), of 2^63 strings.
    for (elem, expected) in [
        (0u32, "needs 9223372036854775808 bytes"),
        (10, "overflow a 64-bit byte count"),
        (8, "declares 9223372036854775808 strings"),
    ] {
        let bytes = raw(3, 0, 1, |out| {
            let mut v = elem.to_le_bytes().to_vec();
            v.extend_from_slice(&huge.to_le_bytes());
            kv(out, "tokenizer.ggml.tokens", 9, &v);
        });
        let message = refusal(&bytes);
        assert!(message.contains(expected), "{elem}: {message}");
    }
    // A string array whose count fits but whose second string does not.
    let bytes = raw(3, 0, 1, |out| {
        let mut v = 8u32.to_le_bytes().to_vec();
        v.extend_from_slice(&2u64.to_le_bytes());
        v.extend_from_slice(&1u64.to_le_bytes());
        v.push(b'a');
        v.extend_from_slice(&huge.to_le_bytes());
        v.extend_from_slice(&[0; 16]);
        kv(out, "t", 9, &v);
    });
    assert!(refusal(&bytes).contains("element 1 of metadata 't' (declared 9223372036854775808 bytes long)"));
    // A tensor name of 2^63 bytes.
    let bytes = raw(3, 1, 0, |out| {
        put_u64(out, huge);
        out.extend_from_slice(&[0; 32]);
    });
    assert!(refusal(&bytes).contains("the name of tensor 0 (declared"));
    // Counts that the file cannot hold.
    for (tensors, kvs) in [(huge, 0), (0, huge), (u64::MAX, u64::MAX), (1, 1)] {
        let bytes = raw(3, tensors, kvs, |out| out.extend_from_slice(&[0; 30]));
        let message = refusal(&bytes);
        assert!(message.contains("only 30 are left after the header"), "{tensors} {kvs}: {message}");
    }
}

#[test]
fn alignment_must_be_a_sane_power_of_two_stored_as_u32() {
    for (value, ty, expected) in [
        (
            (1u64 << 30).to_le_bytes()[..4].to_vec(),
            4u32,
            "general.alignment 1073741824 must be a power of two no larger than 1048576",
        ),
        (0u32.to_le_bytes().to_vec(), 4, "general.alignment 0 must be"),
        (48u32.to_le_bytes().to_vec(), 4, "general.alignment 48 must be"),
        (32u64.to_le_bytes().to_vec(), 10, "general.alignment is a u64, but GGUF stores it as a u32"),
    ] {
        let bytes = raw(3, 0, 1, |out| kv(out, "general.alignment", ty, &value));
        let message = refusal(&bytes);
        assert!(message.contains(expected), "{message}");
    }
    // A legal alignment of 64 (and of 1) is honoured.
    for align in [64u32, 1] {
        let mut w = GgufWriter::new();
        w.alignment = align;
        w.tensor("a", GgmlType::F32, &[3], &[1.0, 2.0, 3.0]).tensor("b", GgmlType::F16, &[2], &[4.0, 5.0]);
        let g = Gguf::from_bytes("a.gguf", &w.to_bytes()).unwrap();
        assert_eq!(g.alignment(), u64::from(align));
        assert_eq!(g.data_offset() % align as usize, 0);
        assert_eq!(g.tensor("b", DType::F32).unwrap().to_f32_vec().unwrap(), vec![4.0, 5.0]);
    }
}

#[test]
fn arrays_are_read_at_their_declared_element_width() {
    // token_type declared as i8 (1 byte each), the last entry of the file:
    // reading it as i32 must widen each byte, never read 4 bytes per element.
    let bytes = raw(3, 0, 1, |out| {
        let mut v = 1u32.to_le_bytes().to_vec(); // i8
        v.extend_from_slice(&5u64.to_le_bytes());
        v.extend_from_slice(&[1, 2, 0xff, 6, 0x80]);
        kv(out, "tokenizer.ggml.token_type", 9, &v);
    });
    let g = Gguf::from_bytes("n.gguf", &bytes).unwrap();
    assert_eq!(g.get_i32_array("tokenizer.ggml.token_type").unwrap(), vec![1, 2, -1, 6, -128]);
    let err = g.get_u32_array("tokenizer.ggml.token_type").unwrap_err().to_string();
    assert_eq!(err, "n.gguf: metadata key tokenizer.ggml.token_type[2] = -1 does not fit u32");
    assert!(g.get_str_array("tokenizer.ggml.token_type").unwrap_err().to_string().contains("an array of i8"));
    // Tokens declared as u8 are not strings.
    let bytes = raw(3, 0, 1, |out| {
        let mut v = 0u32.to_le_bytes().to_vec();
        v.extend_from_slice(&3u64.to_le_bytes());
        v.extend_from_slice(b"abc");
        kv(out, "tokenizer.ggml.tokens", 9, &v);
    });
    let g = Gguf::from_bytes("n.gguf", &bytes).unwrap();
    assert!(
        g.get_str_array("tokenizer.ggml.tokens")
            .unwrap_err()
            .to_string()
            .contains("an array of u8, expected an array of string")
    );
    // An i32 array one byte short of its count.
    let bytes = raw(3, 0, 1, |out| {
        let mut v = 5u32.to_le_bytes().to_vec();
        v.extend_from_slice(&2u64.to_le_bytes());
        v.extend_from_slice(&[0; 7]);
        kv(out, "k", 9, &v);
    });
    assert!(refusal(&bytes).contains("metadata 'k' (2 elements of i32) needs 8 bytes"));
}

#[test]
fn malformed_metadata_is_refused() {
    let nested = {
        let mut v = 9u32.to_le_bytes().to_vec();
        v.extend_from_slice(&1u64.to_le_bytes());
        v
    };
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (raw(3, 0, 1, |out| kv(out, "k", 13, &[0; 8])), "metadata 'k' has unknown value type 13"),
        // A key's control characters are escaped, not sent to the terminal.
        (raw(3, 0, 1, |out| kv(out, "k\u{1b}[31m", 13, &[0; 8])), "metadata 'k\\u{1b}[31m' has unknown value type 13"),
        (
            raw(3, 0, 1, |out| {
                kv(out, "k", 9, &{
                    let mut v = 99u32.to_le_bytes().to_vec();
                    v.extend_from_slice(&[0; 8]);
                    v
                })
            }),
            "an array of unknown value type 99",
        ),
        (raw(3, 0, 1, |out| kv(out, "k", 9, &nested)), "metadata 'k' is an array of arrays"),
        (raw(3, 0, 1, |out| kv(out, "k", 7, &[2])), "metadata 'k' is a bool of value 2"),
        (
            raw(3, 0, 2, |out| {
                kv(out, "k", 0, &[1]);
                kv(out, "k", 0, &[2]);
            }),
            "metadata 'k' appears twice",
        ),
        (
            raw(3, 0, 1, |out| {
                put_u64(out, 2);
                out.extend_from_slice(&[0xff, 0xfe]);
                put_u32(out, 0);
                out.push(0);
            }),
            "metadata key 0 is not valid UTF-8",
        ),
        (
            raw(3, 0, 1, |out| {
                put_u64(out, 1);
                out.push(b'k');
                put_u32(out, 4);
                out.extend_from_slice(&[0; 2]);
            }),
            "metadata 'k' needs 4 bytes",
        ),
    ];
    for (bytes, expected) in cases {
        let message = refusal(&bytes);
        assert!(message.contains(expected), "expected '{expected}' in: {message}");
    }
    // A string value that is not UTF-8 opens, and get_str names the key.
    let g =
        Gguf::from_bytes("s.gguf", &raw(3, 0, 1, |out| kv(out, "name", 8, &[1, 0, 0, 0, 0, 0, 0, 0, 0xff]))).unwrap();
    assert_eq!(g.get_str("name").unwrap_err().to_string(), "s.gguf: metadata key name is not valid UTF-8");
    assert!(matches!(g.get("name"), Some(Value::String(b"\xff"))));
}

#[test]
fn magic_and_version_are_checked() {
    let mut bad_magic = raw(3, 0, 0, |_| {});
    bad_magic[0] = b'F';
    assert!(refusal(&bad_magic).contains("bad magic [46, 47, 55, 46]"));
    assert!(refusal(&raw(1, 0, 0, |_| {})).contains("version 1 is not supported"));
    assert!(refusal(&raw(3u32.swap_bytes(), 0, 0, |_| {})).contains("a big-endian GGUF file"));
    assert!(refusal(&raw(4, 0, 0, |_| {})).contains("unknown version 4"));
    assert!(refusal(b"GGUF").contains("4 bytes is too short for a GGUF header"));
    assert!(refusal(b"").contains("0 bytes is too short"));
    // Version 2 reads like 3; an empty file of no tensors and no metadata is valid.
    let g = Gguf::from_bytes("v2.gguf", &raw(2, 0, 0, |_| {})).unwrap();
    assert_eq!((g.version(), g.tensors().len()), (2, 0));
}

#[test]
fn tensor_entries_are_checked_against_the_data_section() {
    let f32_tensor = |ne: &[u64], ty: u32, offset: u64, data: usize| {
        let ne = ne.to_vec();
        raw(3, 1, 0, move |out| {
            tensor_entry(out, "w", &ne, ty, offset);
            pad_to(out, 32);
            out.resize(out.len() + data, 0);
        })
    };
    assert!(refusal(&f32_tensor(&[4], 1234, 0, 16)).contains("tensor 'w' has unknown GGML type id 1234"));
    assert!(refusal(&f32_tensor(&[4], 4, 0, 16)).contains("unknown GGML type id 4")); // removed Q4_2
    assert!(refusal(&f32_tensor(&[4], 0, 16, 64)).contains("offset 16 is not a multiple of the alignment 32"));
    assert!(
        refusal(&f32_tensor(&[8], 0, 0, 31))
            .contains("(32 bytes at offset 0 of the data) runs past the 31-byte data section")
    );
    assert!(refusal(&f32_tensor(&[8], 0, u64::MAX - 31, 31)).contains("runs past"));
    assert!(refusal(&f32_tensor(&[16], 8, 0, 34)).contains("rows of 16 elements are not whole Q8_0 blocks of 32"));
    // Overlap: b starts inside a.
    let bytes = raw(3, 2, 0, |out| {
        tensor_entry(out, "a", &[16], 0, 0);
        tensor_entry(out, "b", &[8], 0, 32);
        pad_to(out, 32);
        out.resize(out.len() + 64, 0);
    });
    assert!(refusal(&bytes).contains("tensors 'a' (bytes 0..64) and 'b' (from byte 32) overlap"));
    let bytes = raw(3, 2, 0, |out| {
        tensor_entry(out, "a", &[8], 0, 0);
        tensor_entry(out, "a", &[8], 0, 32);
    });
    assert!(refusal(&bytes).contains("tensor 'a' appears twice"));
    // Zero-sized tensors may share an offset; a 0-dim tensor is a scalar.
    let bytes = raw(3, 3, 0, |out| {
        tensor_entry(out, "e", &[0, 4], 0, 0);
        tensor_entry(out, "s", &[], 0, 0);
        tensor_entry(out, "f", &[32, 0], 2, 0);
        pad_to(out, 32);
        out.extend_from_slice(&7.5f32.to_le_bytes());
    });
    let g = Gguf::from_bytes("z.gguf", &bytes).unwrap();
    assert_eq!(g.tensor("e", DType::F32).unwrap().shape(), &[4, 0]);
    assert_eq!(g.tensor("s", DType::F32).unwrap().to_f32_vec().unwrap(), vec![7.5]);
}

#[test]
fn a_file_cut_anywhere_is_refused_with_one_line() {
    let (w, _) = every_type();
    let bytes = w.to_bytes();
    for cut in 0..bytes.len() {
        let result = Gguf::from_bytes("cut.gguf", &bytes[..cut]);
        let err = result.expect_err(&format!("cut at {cut} of {}", bytes.len()));
        assert!(matches!(err, Error::BadTensorFile { .. }), "cut {cut}: {err:?}");
        assert!(!err.to_string().contains('\n'));
    }
    // A few cuts through a real file as well.
    let dir = tempfile::tempdir().unwrap();
    for cut in [0, 3, 23, 24, 100, bytes.len() / 2, bytes.len() - 1] {
        let path = write(dir.path(), "cut.gguf", &bytes[..cut]);
        assert!(matches!(Gguf::open(&path), Err(Error::BadTensorFile { .. })), "cut {cut}");
    }
    assert!(Gguf::from_bytes("whole.gguf", &bytes).is_ok());
}

#[test]
fn only_regular_files_are_opened() {
    for path in ["/dev/zero", "/"] {
        assert!(matches!(Gguf::open(Path::new(path)), Err(Error::NotARegularFile { .. })), "{path}");
    }
}

#[test]
fn mutated_files_are_refused_or_read_without_panicking() {
    let (w, _) = every_type();
    let original = w.to_bytes();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let extremes = [0u64, 1, 31, 32, 255, 1 << 31, 1 << 32, (1 << 42) + 1, 1 << 62, 1 << 63, u64::MAX];
    let mut accepted = 0;
    for _ in 0..3000 {
        let mut bytes = original.clone();
        for _ in 0..1 + next() % 3 {
            if bytes.is_empty() {
                break;
            }
            let at = (next() % bytes.len() as u64) as usize;
            match next() % 3 {
                0 => bytes[at] = next() as u8,
                1 => {
                    // An extreme little-endian u64 or u32 over whatever field is there.
                    let v = extremes[(next() % extremes.len() as u64) as usize].to_le_bytes();
                    let n = if next() % 2 == 0 { 8 } else { 4 };
                    let end = (at + n).min(bytes.len());
                    bytes[at..end].copy_from_slice(&v[..end - at]);
                }
                _ => bytes.truncate(at),
            }
        }
        let Ok(g) = Gguf::from_bytes("m.gguf", &bytes) else { continue };
        accepted += 1;
        for key in g.keys().map(str::to_string).collect::<Vec<_>>() {
            let _ = (g.get_u32(&key), g.get_f32(&key), g.get_str(&key), g.get_str_array(&key), g.get_i32_array(&key));
        }
        for info in g.tensors() {
            if info.numel() <= 1 << 20 {
                let _ = g.tensor(info.name(), DType::BF16);
            }
        }
    }
    assert!(accepted > 100, "some mutations (of tensor data, say) still read: {accepted}");
}

/// IQ4_NL loads as Q8_0 blocks holding the same values bit for bit (every
/// element an f16 scale times a level in −127..=113 per 32), as f32 the
/// same as its own dequantization, and so do Q4_0 and Q5_0 asked for as
/// Q8_0 (parts of one constant); Q5_0 and Q5_1 load as their own blocks,
/// borrowed; Q5_1 (an offset per block) does not load as Q8_0, nor any type
/// as a block format it is not held in.
#[test]
fn iq4_nl_loads_as_the_q8_0_blocks_of_the_same_values_and_q5_as_itself() {
    // Bytes from a fixed LCG; each block's f16 scale set to a normal value
    // of either sign, the rest (codes, fifth bits) as drawn.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut byte = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 56) as u8
    };
    let mut w = GgufWriter::new();
    let types =
        [("iq4_nl", GgmlType::Iq4Nl), ("q5_0", GgmlType::Q5_0), ("q5_1", GgmlType::Q5_1), ("q4_0", GgmlType::Q4_0)];
    for (name, ty) in types {
        let (rows, k) = (3, 64);
        let mut bytes: Vec<u8> = (0..rows * k / 32 * ty.type_size()).map(|_| byte()).collect();
        for block in bytes.chunks_exact_mut(ty.type_size()) {
            let sign = if block[4] & 1 == 1 { 2.0 } else { -0.02 };
            let scale = half::f16::from_f32((f32::from(block[3]) / 255.0 + 0.1) * sign);
            block[..2].copy_from_slice(&scale.to_bits().to_le_bytes());
        }
        w.tensor_raw(name, ty, &[rows, k], bytes);
    }
    let g = Gguf::from_bytes("m.gguf", &w.to_bytes()).unwrap();
    for (name, ty) in [("iq4_nl", GgmlType::Iq4Nl), ("q5_0", GgmlType::Q5_0), ("q4_0", GgmlType::Q4_0)] {
        let (q8, borrowed) = g.load_tensor(name, DType::Q8_0).unwrap();
        assert!(!borrowed, "{name}: rewritten into memory of its own");
        assert_eq!(q8.shape(), &[3, 64]);
        assert_eq!(q8.as_bytes().len(), 3 * 2 * 34);
        let mut from_q8 = vec![f32::NAN; 3 * 64];
        dequant::dequantize(GgmlType::Q8_0, q8.as_bytes(), &mut from_q8).unwrap();
        let mut direct = vec![f32::NAN; 3 * 64];
        dequant::dequantize(ty, g.tensor_data(name).unwrap(), &mut direct).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&from_q8), bits(&direct), "{name}");
        assert!(direct.iter().any(|&v| v > 1.0) && direct.iter().any(|&v| v < 0.0), "{name}: varied values");
    }
    for (name, format) in [("q5_0", DType::Q5_0), ("q5_1", DType::Q5_1)] {
        let (blocks, borrowed) = g.load_tensor(name, format).unwrap();
        assert!(borrowed, "{name}: borrowed from the mapping");
        assert_eq!(blocks.as_bytes(), g.tensor_data(name).unwrap(), "{name}");
    }
    let err = g.tensor("q5_1", DType::Q8_0).unwrap_err().to_string();
    assert!(err.contains("it is stored as Q5_1, not q8_0 blocks"), "{err}");
    let err = g.tensor("iq4_nl", DType::Q4_0).unwrap_err().to_string();
    assert!(err.contains("it is stored as IQ4_NL, not q4_0 blocks"), "{err}");
    assert_eq!(GgmlType::Q5_1.block_format(), Some(DType::Q5_1));
    assert_eq!(GgmlType::Q5K.block_format(), Some(DType::Q5K));
    assert_eq!(GgmlType::Q3K.block_format(), None);
    assert_eq!(GgmlType::Q4K.block_format(), Some(DType::Q4K));
    assert_eq!(GgmlType::Iq4Nl.block_format(), Some(DType::Iq4Nl));
    let (held, borrowed) = g.load_tensor("iq4_nl", DType::Iq4Nl).unwrap();
    assert!(borrowed && held.as_bytes() == g.tensor_data("iq4_nl").unwrap(), "IQ4_NL kept as stored");
}

/// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL each load as kvjit's q8_min
/// blocks of the same values (a zero's sign aside), into memory of their
/// own; a block whose offset `−c·d` is not an f16 (an infinite scale, or
/// |128·d| past 65504) is refused by name, and so is a type that q8_min
/// cannot hold. Q4_1 and Q5_1 keep their `d` and `m`, NaN included.
#[test]
fn the_32_blocks_types_load_as_the_q8_min_blocks_of_the_same_values() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut byte = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 56) as u8
    };
    let types = [
        ("q8_0", GgmlType::Q8_0),
        ("q4_0", GgmlType::Q4_0),
        ("q4_1", GgmlType::Q4_1),
        ("q5_0", GgmlType::Q5_0),
        ("q5_1", GgmlType::Q5_1),
        ("iq4_nl", GgmlType::Iq4Nl),
    ];
    let (rows, k) = (3, 96);
    let mut w = GgufWriter::new();
    for (name, ty) in types {
        let mut bytes: Vec<u8> = (0..rows * k / 32 * ty.type_size()).map(|_| byte()).collect();
        for (i, block) in bytes.chunks_exact_mut(ty.type_size()).enumerate() {
            // Normal scales of either sign, the largest that q8_min holds
            // for every type (|128·d| = 65408), and a subnormal one.
            let d = match i % 4 {
                0 => 511.0,
                1 => -3.0e-7,
                _ => (f32::from(block[5]) / 255.0 + 0.01) * if block[6] & 1 == 1 { 1.0 } else { -1.0 },
            };
            block[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        }
        w.tensor_raw(name, ty, &[rows, k], bytes);
    }
    let mut bad = |name: &str, ty: GgmlType, d: f32| {
        let mut bytes: Vec<u8> = (0..ty.type_size()).map(|_| byte()).collect();
        bytes[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        w.tensor_raw(name, ty, &[1, 32], bytes);
    };
    bad("q8_0_infinite", GgmlType::Q8_0, f32::INFINITY);
    bad("q8_0_large", GgmlType::Q8_0, 512.0);
    bad("q4_0_large", GgmlType::Q4_0, 8200.0);
    bad("q4_1_nan", GgmlType::Q4_1, f32::NAN);
    w.tensor_raw("q4_k", GgmlType::Q4K, &[1, 256], vec![0; 144]);
    let g = Gguf::from_bytes("m.gguf", &w.to_bytes()).unwrap();
    for (name, ty) in types {
        assert!(g.holds_exactly(name, DType::Q8Min), "{name}");
        let (blocks, borrowed) = g.load_tensor(name, DType::Q8Min).unwrap();
        assert!(!borrowed, "{name}: rewritten into memory of its own");
        assert_eq!(blocks.as_bytes().len(), rows * k / 32 * 36, "{name}");
        let mut held = vec![f32::NAN; rows * k];
        kvjit_core::quant::dequantize(DType::Q8Min, blocks.as_bytes(), &mut held).unwrap();
        let mut direct = vec![f32::NAN; rows * k];
        dequant::dequantize(ty, g.tensor_data(name).unwrap(), &mut direct).unwrap();
        for (i, (h, d)) in held.iter().zip(&direct).enumerate() {
            assert!(h == d || (h.is_nan() && d.is_nan()), "{name} element {i}: q8_min {h:e}, {ty} {d:e}");
        }
        assert!(direct.iter().any(|&v| v.abs() > 1000.0) && direct.iter().any(|&v| v < 0.0), "{name}: varied");
    }
    for name in ["q8_0_infinite", "q8_0_large", "q4_0_large"] {
        assert!(!g.holds_exactly(name, DType::Q8Min), "{name}");
        let err = g.tensor(name, DType::Q8Min).unwrap_err().to_string();
        assert!(err.contains("blocks do not all hold exactly in q8_min"), "{name}: {err}");
    }
    let (nan, _) = g.load_tensor("q4_1_nan", DType::Q8Min).unwrap();
    let mut held = vec![0.0; 32];
    kvjit_core::quant::dequantize(DType::Q8Min, nan.as_bytes(), &mut held).unwrap();
    assert!(held.iter().all(|v| v.is_nan()), "{held:?}");
    assert!(!g.holds_exactly("q4_k", DType::Q8Min));
    let err = g.tensor("q4_k", DType::Q8Min).unwrap_err().to_string();
    assert!(err.contains("it is stored as Q4_K, not q8_min blocks"), "{err}");
}

/// Q4_K, Q5_K, Q6_K, Q2_K, Q3_K and IQ4_XS each load as kvjit's q8_kmin
/// super-blocks of the same values (a zero's sign aside), into memory of their own; a
/// super-block with an infinite or NaN scale is refused by name, and so is
/// a type that q8_kmin cannot hold.
#[test]
fn the_k_quants_load_as_the_q8_kmin_blocks_of_the_same_values() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut byte = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 56) as u8
    };
    let types = [
        ("q4_k", GgmlType::Q4K),
        ("q5_k", GgmlType::Q5K),
        ("q6_k", GgmlType::Q6K),
        ("q2_k", GgmlType::Q2K),
        ("q3_k", GgmlType::Q3K),
        ("iq4_xs", GgmlType::Iq4Xs),
    ];
    // Where each type keeps its f16 d (and dmin).
    let scales_at = |ty: GgmlType| match ty {
        GgmlType::Q6K => vec![208],
        GgmlType::Q2K => vec![80, 82],
        GgmlType::Q3K => vec![108],
        GgmlType::Iq4Xs => vec![0],
        _ => vec![0, 2],
    };
    let (rows, k) = (2, 512);
    let mut w = GgufWriter::new();
    for (name, ty) in types {
        let mut bytes: Vec<u8> = (0..rows * k / 256 * ty.type_size()).map(|_| byte()).collect();
        for (i, block) in bytes.chunks_exact_mut(ty.type_size()).enumerate() {
            for (n, at) in scales_at(ty).into_iter().enumerate() {
                let magnitude = f32::from(block[20 + n]) / 255.0 * 0.01 + 1e-4;
                let d = if (i + n) % 2 == 0 { magnitude } else { -magnitude };
                block[at..at + 2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
            }
        }
        w.tensor_raw(name, ty, &[rows, k], bytes);
    }
    for (name, ty, d) in [("q6_k_nan", GgmlType::Q6K, f32::NAN), ("q4_k_infinite", GgmlType::Q4K, f32::INFINITY)] {
        let mut bytes: Vec<u8> = (0..ty.type_size()).map(|_| byte()).collect();
        let at = scales_at(ty)[0];
        bytes[at..at + 2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        w.tensor_raw(name, ty, &[1, 256], bytes);
    }
    w.tensor_raw("q8_0", GgmlType::Q8_0, &[1, 32], vec![0; 34]);
    let g = Gguf::from_bytes("m.gguf", &w.to_bytes()).unwrap();
    for (name, ty) in types {
        assert!(g.holds_exactly(name, DType::Q8KMin), "{name}");
        let (blocks, borrowed) = g.load_tensor(name, DType::Q8KMin).unwrap();
        assert!(!borrowed, "{name}: rewritten into memory of its own");
        assert_eq!(blocks.as_bytes().len(), rows * k / 256 * 308, "{name}");
        let mut held = vec![f32::NAN; rows * k];
        kvjit_core::quant::dequantize(DType::Q8KMin, blocks.as_bytes(), &mut held).unwrap();
        let mut direct = vec![f32::NAN; rows * k];
        dequant::dequantize(ty, g.tensor_data(name).unwrap(), &mut direct).unwrap();
        for (i, (h, d)) in held.iter().zip(&direct).enumerate() {
            assert!(h == d, "{name} element {i}: q8_kmin {h:e}, {ty} {d:e}");
        }
        assert!(direct.iter().any(|&v| v > 0.0) && direct.iter().any(|&v| v < 0.0), "{name}: varied");
    }
    for name in ["q6_k_nan", "q4_k_infinite"] {
        assert!(!g.holds_exactly(name, DType::Q8KMin), "{name}");
        let err = g.tensor(name, DType::Q8KMin).unwrap_err().to_string();
        assert!(err.contains("blocks do not all hold exactly in q8_kmin"), "{name}: {err}");
    }
    assert!(!g.holds_exactly("q8_0", DType::Q8KMin));
    let err = g.tensor("q8_0", DType::Q8KMin).unwrap_err().to_string();
    assert!(err.contains("it is stored as Q8_0, not q8_kmin blocks"), "{err}");
}
