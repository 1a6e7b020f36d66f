//! A small GGUF writer, for tests (here and in other crates) that need
//! GGUF files: metadata of every value type, tensors of the types kvjit
//! reads (quantized by [`quantize`], a plain encoder — valid blocks, not
//! ggml's exact rounding), and the raw pieces ([`put_string`], …) for
//! crafting malformed files by hand.

use half::{bf16, f16};

use crate::{GgmlType, QK_K, ValueType};

/// A metadata value to write.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs, reason = "each variant is the GGUF value type of the same name")]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// An array of `ValueType` elements (each element must be of that
    /// type; written as given, so a test can also write a mismatch).
    Array(ValueType, Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    /// Its GGUF value type.
    pub fn value_type(&self) -> ValueType {
        match self {
            MetaValue::U8(_) => ValueType::U8,
            MetaValue::I8(_) => ValueType::I8,
            MetaValue::U16(_) => ValueType::U16,
            MetaValue::I16(_) => ValueType::I16,
            MetaValue::U32(_) => ValueType::U32,
            MetaValue::I32(_) => ValueType::I32,
            MetaValue::F32(_) => ValueType::F32,
            MetaValue::Bool(_) => ValueType::Bool,
            MetaValue::String(_) => ValueType::String,
            MetaValue::Array(..) => ValueType::Array,
            MetaValue::U64(_) => ValueType::U64,
            MetaValue::I64(_) => ValueType::I64,
            MetaValue::F64(_) => ValueType::F64,
        }
    }

    /// An array of strings.
    pub fn strings<S: AsRef<str>>(items: impl IntoIterator<Item = S>) -> MetaValue {
        MetaValue::Array(ValueType::String, items.into_iter().map(|s| MetaValue::String(s.as_ref().into())).collect())
    }

    /// An array of i32s.
    pub fn i32s(items: impl IntoIterator<Item = i32>) -> MetaValue {
        MetaValue::Array(ValueType::I32, items.into_iter().map(MetaValue::I32).collect())
    }

    /// An array of f32s.
    pub fn f32s(items: impl IntoIterator<Item = f32>) -> MetaValue {
        MetaValue::Array(ValueType::F32, items.into_iter().map(MetaValue::F32).collect())
    }

    /// Append the value (without its type tag) to `out`.
    pub fn put(&self, out: &mut Vec<u8>) {
        match self {
            MetaValue::U8(v) => out.push(*v),
            MetaValue::I8(v) => out.push(*v as u8),
            MetaValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::Bool(v) => out.push(u8::from(*v)),
            MetaValue::String(s) => put_string(out, s),
            MetaValue::Array(elem, items) => {
                put_u32(out, elem.id());
                put_u64(out, items.len() as u64);
                for item in items {
                    item.put(out);
                }
            }
            MetaValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        }
    }
}

impl From<&str> for MetaValue {
    fn from(s: &str) -> Self {
        MetaValue::String(s.into())
    }
}
impl From<String> for MetaValue {
    fn from(s: String) -> Self {
        MetaValue::String(s)
    }
}
impl From<u32> for MetaValue {
    fn from(v: u32) -> Self {
        MetaValue::U32(v)
    }
}
impl From<i32> for MetaValue {
    fn from(v: i32) -> Self {
        MetaValue::I32(v)
    }
}
impl From<u64> for MetaValue {
    fn from(v: u64) -> Self {
        MetaValue::U64(v)
    }
}
impl From<f32> for MetaValue {
    fn from(v: f32) -> Self {
        MetaValue::F32(v)
    }
}
impl From<bool> for MetaValue {
    fn from(v: bool) -> Self {
        MetaValue::Bool(v)
    }
}

/// Append a little-endian u32.
pub fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Append a little-endian u64.
pub fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Append a GGUF string: its u64 length, then its bytes.
pub fn put_string(out: &mut Vec<u8>, s: &str) {
    put_u64(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// A tensor to write.
#[derive(Clone, Debug)]
struct TensorEntry {
    name: String,
    ty: GgmlType,
    ne: Vec<u64>,
    data: Vec<u8>,
}

/// Builds a GGUF file: metadata in the order added, then the tensor
/// entries, then the data, each tensor at the next multiple of the
/// alignment.
#[derive(Clone, Debug)]
pub struct GgufWriter {
    /// The version written (3 unless changed).
    pub version: u32,
    /// The data alignment; anything but 32 is also written as
    /// `general.alignment` (u32), unless that key was added by hand.
    pub alignment: u32,
    kvs: Vec<(String, MetaValue)>,
    tensors: Vec<TensorEntry>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        GgufWriter { version: 3, alignment: 32, kvs: Vec::new(), tensors: Vec::new() }
    }
}

impl GgufWriter {
    /// An empty version-3 file with the default alignment.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a metadata entry.
    pub fn kv(&mut self, key: &str, value: impl Into<MetaValue>) -> &mut Self {
        self.kvs.push((key.to_string(), value.into()));
        self
    }

    /// Add a tensor of row-major `shape` whose blocks are `data` as stored.
    ///
    /// # Panics
    /// If `data` is not the size `ty` and `shape` need.
    pub fn tensor_raw(&mut self, name: &str, ty: GgmlType, shape: &[usize], data: Vec<u8>) -> &mut Self {
        let ne: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        let size = crate::parse::tensor_bytes(ty, &ne).expect("a valid shape for the type");
        assert_eq!(data.len() as u64, size, "tensor '{name}': {ty}{shape:?} needs {size} bytes");
        self.tensors.push(TensorEntry { name: name.to_string(), ty, ne, data });
        self
    }

    /// Add a tensor of row-major `shape` holding `values` encoded as `ty`
    /// ([`quantize`]).
    ///
    /// # Panics
    /// If `values` does not fill `shape`, or `ty` is not one [`quantize`]
    /// writes, or rows are not whole blocks of `ty`.
    pub fn tensor(&mut self, name: &str, ty: GgmlType, shape: &[usize], values: &[f32]) -> &mut Self {
        assert_eq!(values.len(), shape.iter().product::<usize>(), "tensor '{name}': values for {shape:?}");
        let data = quantize(ty, values).unwrap_or_else(|| panic!("cannot write {ty}"));
        self.tensor_raw(name, ty, shape, data)
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut kvs: Vec<(String, MetaValue)> = self.kvs.clone();
        if self.alignment != 32 && !kvs.iter().any(|(k, _)| k == "general.alignment") {
            kvs.insert(0, ("general.alignment".into(), MetaValue::U32(self.alignment)));
        }
        let align = (self.alignment as usize).max(1);
        let mut out = Vec::new();
        out.extend_from_slice(&crate::MAGIC);
        put_u32(&mut out, self.version);
        put_u64(&mut out, self.tensors.len() as u64);
        put_u64(&mut out, kvs.len() as u64);
        for (key, value) in &kvs {
            put_string(&mut out, key);
            put_u32(&mut out, value.value_type().id());
            value.put(&mut out);
        }
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for t in &self.tensors {
            put_string(&mut out, &t.name);
            put_u32(&mut out, t.ne.len() as u32);
            for &d in &t.ne {
                put_u64(&mut out, d);
            }
            put_u32(&mut out, t.ty.id());
            put_u64(&mut out, offset as u64);
            offsets.push(offset);
            offset = (offset + t.data.len()).next_multiple_of(align);
        }
        out.resize(out.len().next_multiple_of(align), 0);
        let data_start = out.len();
        for (t, at) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + at, 0);
            out.extend_from_slice(&t.data);
        }
        out
    }

    /// Write the file.
    pub fn write(&self, path: &std::path::Path) -> std::io::Result<()> {
        std::fs::write(path, self.to_bytes())
    }
}

fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

/// `values` (whole blocks of `ty`) encoded as `ty`: F32, F16, BF16, Q8_0,
/// Q4_0, Q4_1, Q4_K or Q6_K (`None` for other types or a partial block). A
/// plain encoder: valid blocks close to the values, not ggml's rounding.
pub fn quantize(ty: GgmlType, values: &[f32]) -> Option<Vec<u8>> {
    if !values.len().is_multiple_of(ty.block_size()) {
        return None;
    }
    let mut out = Vec::with_capacity(values.len() / ty.block_size() * ty.type_size());
    match ty {
        GgmlType::F32 => values.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgmlType::F16 => values.iter().for_each(|&v| out.extend_from_slice(&f16_bytes(v))),
        GgmlType::BF16 => values.iter().for_each(|&v| out.extend_from_slice(&bf16::from_f32(v).to_le_bytes())),
        GgmlType::Q8_0 => {
            for block in values.chunks_exact(32) {
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = f16::from_f32(amax / 127.0);
                let id = if d.to_f32() == 0.0 { 0.0 } else { 1.0 / d.to_f32() };
                out.extend_from_slice(&d.to_le_bytes());
                out.extend(block.iter().map(|v| (v * id).round().clamp(-127.0, 127.0) as i8 as u8));
            }
        }
        GgmlType::Q4_0 => {
            for block in values.chunks_exact(32) {
                let max = block.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = f16::from_f32(max / -8.0);
                let id = if d.to_f32() == 0.0 { 0.0 } else { 1.0 / d.to_f32() };
                out.extend_from_slice(&d.to_le_bytes());
                let q = |v: f32| ((v * id).round() + 8.0).clamp(0.0, 15.0) as u8;
                out.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
            }
        }
        GgmlType::Q4_1 => {
            for block in values.chunks_exact(32) {
                let min = block.iter().copied().fold(f32::INFINITY, f32::min);
                let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = f16::from_f32((max - min) / 15.0);
                let m = f16::from_f32(min);
                let id = if d.to_f32() == 0.0 { 0.0 } else { 1.0 / d.to_f32() };
                out.extend_from_slice(&d.to_le_bytes());
                out.extend_from_slice(&m.to_le_bytes());
                let q = |v: f32| ((v - m.to_f32()) * id).round().clamp(0.0, 15.0) as u8;
                out.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
            }
        }
        GgmlType::Q4K => values.chunks_exact(QK_K).for_each(|b| quantize_q4_k(b, &mut out)),
        GgmlType::Q6K => values.chunks_exact(QK_K).for_each(|b| quantize_q6_k(b, &mut out)),
        _ => return None,
    }
    Some(out)
}

fn quantize_q4_k(block: &[f32], out: &mut Vec<u8>) {
    let mut scale = [0f32; 8];
    let mut min = [0f32; 8];
    for (j, sub) in block.chunks_exact(32).enumerate() {
        let lo = sub.iter().copied().fold(0f32, f32::min);
        let hi = sub.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        scale[j] = (hi - lo) / 15.0;
        min[j] = -lo;
    }
    let d = f16::from_f32(scale.iter().copied().fold(0f32, f32::max) / 63.0);
    let dmin = f16::from_f32(min.iter().copied().fold(0f32, f32::max) / 63.0);
    let code =
        |v: f32, step: f16| if step.to_f32() == 0.0 { 0 } else { (v / step.to_f32()).round().clamp(0.0, 63.0) as u8 };
    let sc: Vec<u8> = scale.iter().map(|&s| code(s, d)).collect();
    let m: Vec<u8> = min.iter().map(|&v| code(v, dmin)).collect();
    out.extend_from_slice(&d.to_le_bytes());
    out.extend_from_slice(&dmin.to_le_bytes());
    let mut packed = [0u8; 12];
    for j in 0..4 {
        packed[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        packed[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        packed[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
    }
    out.extend_from_slice(&packed);
    let q = |j: usize, v: f32| {
        let step = d.to_f32() * f32::from(sc[j]);
        let offset = dmin.to_f32() * f32::from(m[j]);
        if step == 0.0 { 0 } else { ((v + offset) / step).round().clamp(0.0, 15.0) as u8 }
    };
    for chunk in 0..4 {
        for l in 0..32 {
            let low = q(2 * chunk, block[64 * chunk + l]);
            let high = q(2 * chunk + 1, block[64 * chunk + 32 + l]);
            out.push(low | (high << 4));
        }
    }
}

fn quantize_q6_k(block: &[f32], out: &mut Vec<u8>) {
    let mut scale = [0f32; 16];
    for (j, sub) in block.chunks_exact(16).enumerate() {
        scale[j] = sub.iter().fold(0f32, |m, v| m.max(v.abs())) / 31.0;
    }
    let d = f16::from_f32(scale.iter().copied().fold(0f32, f32::max) / 127.0);
    let sc: Vec<i8> = scale
        .iter()
        .map(|&s| if d.to_f32() == 0.0 { 0 } else { (s / d.to_f32()).round().clamp(-128.0, 127.0) as i8 })
        .collect();
    let mut q = [0u8; QK_K];
    for (i, (&v, q)) in block.iter().zip(q.iter_mut()).enumerate() {
        let step = d.to_f32() * f32::from(sc[i / 16]);
        let code = if step == 0.0 { 0.0 } else { (v / step).round().clamp(-32.0, 31.0) };
        *q = (code as i32 + 32) as u8;
    }
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for half in 0..2 {
        let q = &q[128 * half..];
        for l in 0..32 {
            ql[64 * half + l] = (q[l] & 0x0f) | ((q[l + 64] & 0x0f) << 4);
            ql[64 * half + l + 32] = (q[l + 32] & 0x0f) | ((q[l + 96] & 0x0f) << 4);
            qh[32 * half + l] =
                (q[l] >> 4) | ((q[l + 32] >> 4) << 2) | ((q[l + 64] >> 4) << 4) | ((q[l + 96] >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|&s| s as u8));
    out.extend_from_slice(&d.to_le_bytes());
}
