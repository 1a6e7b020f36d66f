//! The header check: everything the file declares is bounded by the bytes
//! it has before anything is allocated for it.

use std::collections::HashMap;
use std::ops::Range;

use crate::{GgmlType, ValueType};

/// The GGUF magic, `GGUF` in file order.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// The data alignment when the file sets no `general.alignment`.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The largest `general.alignment` accepted (1 MiB).
pub const MAX_ALIGNMENT: u64 = 1 << 20;
/// The most dims a GGML tensor has.
pub const MAX_DIMS: usize = 4;

/// Bytes of the smallest possible metadata entry: an empty key (8), a
/// value type (4), a one-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Bytes of the smallest possible tensor entry: an empty name (8),
/// `n_dims` (4), no dims, a type (4), an offset (8).
const MIN_TENSOR_BYTES: u64 = 8 + 4 + 4 + 8;

/// A metadata value as found: its type and where its bytes are.
#[derive(Clone, Debug)]
pub(crate) struct StoredValue {
    pub ty: ValueType,
    /// For arrays: the element type and count.
    pub elem: Option<(ValueType, usize)>,
    /// Scalars: the value's bytes; strings: the characters (after the
    /// length); arrays: the elements (strings with their lengths).
    pub range: Range<usize>,
}

/// A tensor entry, checked.
#[derive(Clone, Debug)]
pub(crate) struct RawTensor {
    pub name: String,
    pub ggml_type: GgmlType,
    pub ne: Vec<u64>,
    pub offset: u64,
    pub size: u64,
}

pub(crate) struct Parsed {
    pub version: u32,
    pub alignment: u64,
    pub metadata: Vec<(String, StoredValue)>,
    pub tensors: Vec<RawTensor>,
    pub data_start: usize,
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn left(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// `n` bytes, or an error naming `what` when fewer are left.
    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], String> {
        let left = self.left();
        match usize::try_from(n) {
            Ok(n) if n <= left => {
                let bytes = &self.bytes[self.pos..self.pos + n];
                self.pos += n;
                Ok(bytes)
            }
            _ => Err(format!("{} needs {n} bytes at offset {}, but only {left} are left", what(), self.pos)),
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], String> {
        Ok(self.take(N as u64, what)?.try_into().expect("take gave N bytes"))
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, String> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, String> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A length-prefixed string's bytes: the length is checked against
    /// what is left before anything else.
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<&'a [u8], String> {
        let len = self.u64(&|| format!("the length of {}", what()))?;
        self.take(len, &|| format!("{} (declared {len} bytes long)", what()))
    }
}

fn utf8<'a>(bytes: &'a [u8], what: &dyn Fn() -> String) -> Result<&'a str, String> {
    std::str::from_utf8(bytes).map_err(|e| format!("{} is not valid UTF-8 ({e})", what()))
}

/// Check and index a whole GGUF image. Nothing is allocated in proportion
/// to a declared size: counts are bounded by the bytes left before any
/// vector is reserved, and arrays are walked, not copied.
pub(crate) fn parse(bytes: &[u8]) -> Result<Parsed, String> {
    let mut r = Reader { bytes, pos: 0 };
    if bytes.len() < 4 {
        return Err(format!("{} bytes is too short for the 4-byte GGUF magic", bytes.len()));
    }
    let magic = r.array::<4>(&|| "the magic".into())?;
    if magic != MAGIC {
        return Err(format!("bad magic {magic:02x?} (expected \"GGUF\")"));
    }
    let version = r.u32(&|| "the version".into())?;
    match version {
        2 | 3 => {}
        1 => return Err("version 1 is not supported (kvjit reads GGUF versions 2 and 3)".into()),
        v if matches!(v.swap_bytes(), 2 | 3) => {
            return Err(format!("version {v}: a big-endian GGUF file, which kvjit does not read"));
        }
        v => return Err(format!("unknown version {v} (kvjit reads GGUF versions 2 and 3)")),
    }
    let tensor_count = r.u64(&|| "the tensor count".into())?;
    let kv_count = r.u64(&|| "the metadata count".into())?;
    let left = r.left() as u128;
    let least =
        u128::from(tensor_count) * u128::from(MIN_TENSOR_BYTES) + u128::from(kv_count) * u128::from(MIN_KV_BYTES);
    if least > left {
        return Err(format!(
            "declares {tensor_count} tensors and {kv_count} metadata entries, which need at least {least} bytes, \
             but only {left} are left after the header"
        ));
    }
    // Both counts are now bounded by the file size.
    let (tensor_count, kv_count) = (tensor_count as usize, kv_count as usize);

    let mut metadata = Vec::with_capacity(kv_count);
    let mut keys: HashMap<&str, usize> = HashMap::with_capacity(kv_count);
    for i in 0..kv_count {
        let key = r.string(&|| format!("metadata key {i}"))?;
        let key = utf8(key, &|| format!("metadata key {i}"))?;
        // Names come from the file: control characters are escaped.
        let what = |key: &str| format!("metadata '{}'", key.escape_debug());
        if keys.insert(key, i).is_some() {
            return Err(format!("{} appears twice", what(key)));
        }
        let type_id = r.u32(&|| format!("the value type of {}", what(key)))?;
        let ty = ValueType::from_id(type_id)
            .ok_or_else(|| format!("{} has unknown value type {type_id} (GGUF defines 0-12)", what(key)))?;
        let value = read_value(&mut r, ty, &|| what(key))?;
        metadata.push((key.to_string(), value));
    }

    let alignment = match keys.get("general.alignment").map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(v) if v.ty == ValueType::U32 => {
            let a = u64::from(u32::from_le_bytes(bytes[v.range.clone()].try_into().expect("4 bytes")));
            if !a.is_power_of_two() || a > MAX_ALIGNMENT {
                return Err(format!("general.alignment {a} must be a power of two no larger than {MAX_ALIGNMENT}"));
            }
            a
        }
        Some(v) => return Err(format!("general.alignment is a {}, but GGUF stores it as a u32", v.ty)),
    };

    let mut tensors = Vec::with_capacity(tensor_count);
    let mut names: HashMap<&str, ()> = HashMap::with_capacity(tensor_count);
    for i in 0..tensor_count {
        let name = r.string(&|| format!("the name of tensor {i}"))?;
        let name = utf8(name, &|| format!("the name of tensor {i}"))?;
        let what = || format!("tensor '{}'", name.escape_debug());
        if names.insert(name, ()).is_some() {
            return Err(format!("{} appears twice", what()));
        }
        let n_dims = r.u32(&|| format!("the dim count of {}", what()))?;
        if n_dims as usize > MAX_DIMS {
            return Err(format!("{} has {n_dims} dims (GGML tensors have at most {MAX_DIMS})", what()));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            let dim = r.u64(&|| format!("dim {d} of {}", what()))?;
            if dim > i64::MAX as u64 {
                return Err(format!("{}: dim {d} is {dim}, more than GGML's limit of 2^63-1", what()));
            }
            ne.push(dim);
        }
        let type_id = r.u32(&|| format!("the type of {}", what()))?;
        let ggml_type =
            GgmlType::from_id(type_id).ok_or_else(|| format!("{} has unknown GGML type id {type_id}", what()))?;
        let offset = r.u64(&|| format!("the offset of {}", what()))?;
        let size = tensor_bytes(ggml_type, &ne).map_err(|problem| format!("{}: {problem}", what()))?;
        if offset % alignment != 0 {
            return Err(format!("{}: offset {offset} is not a multiple of the alignment {alignment}", what()));
        }
        tensors.push(RawTensor { name: name.to_string(), ggml_type, ne, offset, size });
    }

    let header_end = r.pos as u64;
    let data_start = header_end.next_multiple_of(alignment);
    let data_len = (bytes.len() as u64).saturating_sub(data_start);
    for t in &tensors {
        let end = t.offset.checked_add(t.size);
        if end.is_none_or(|end| end > data_len) {
            return Err(format!(
                "tensor '{}' ({} bytes at offset {} of the data) runs past the {data_len}-byte data section",
                t.name.escape_debug(),
                t.size,
                t.offset
            ));
        }
    }
    let mut order: Vec<&RawTensor> = tensors.iter().filter(|t| t.size > 0).collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        if pair[0].offset + pair[0].size > pair[1].offset {
            return Err(format!(
                "tensors '{}' (bytes {}..{}) and '{}' (from byte {}) overlap",
                pair[0].name,
                pair[0].offset,
                pair[0].offset + pair[0].size,
                pair[1].name,
                pair[1].offset
            ));
        }
    }
    // data_start ≤ bytes.len() whenever a tensor has bytes; otherwise it
    // is not used to slice.
    let data_start = data_start.min(bytes.len() as u64) as usize;
    Ok(Parsed { version, alignment, metadata, tensors, data_start })
}

/// Read a value of type `ty`: scalars and strings are bounded by the bytes
/// left; arrays by their element size (fixed types) or walked element by
/// element (strings, each at least 8 bytes, so the count is bounded first).
fn read_value(r: &mut Reader<'_>, ty: ValueType, what: &dyn Fn() -> String) -> Result<StoredValue, String> {
    let start = r.pos;
    match ty {
        ValueType::String => {
            let s = r.string(what)?;
            let end = r.pos;
            Ok(StoredValue { ty, elem: None, range: end - s.len()..end })
        }
        ValueType::Array => {
            let elem_id = r.u32(&|| format!("the element type of {}", what()))?;
            let elem = ValueType::from_id(elem_id)
                .ok_or_else(|| format!("{} is an array of unknown value type {elem_id}", what()))?;
            if elem == ValueType::Array {
                return Err(format!("{} is an array of arrays, which kvjit does not read", what()));
            }
            let len = r.u64(&|| format!("the length of {}", what()))?;
            let elems_start = r.pos;
            match elem.fixed_size() {
                Some(size) => {
                    let bytes = len
                        .checked_mul(size as u64)
                        .ok_or_else(|| format!("{}: {len} elements of {elem} overflow a 64-bit byte count", what()))?;
                    r.take(bytes, &|| format!("{} ({len} elements of {elem})", what()))?;
                }
                None => {
                    let most = r.left() as u64 / 8;
                    if len > most {
                        return Err(format!(
                            "{} declares {len} strings, but the {} bytes left hold at most {most}",
                            what(),
                            r.left()
                        ));
                    }
                    for i in 0..len {
                        r.string(&|| format!("element {i} of {}", what()))?;
                    }
                }
            }
            Ok(StoredValue { ty, elem: Some((elem, len as usize)), range: elems_start..r.pos })
        }
        _ => {
            let size = ty.fixed_size().expect("scalars have a fixed size");
            let bytes = r.take(size as u64, what)?;
            if ty == ValueType::Bool && bytes[0] > 1 {
                return Err(format!("{} is a bool of value {} (expected 0 or 1)", what(), bytes[0]));
            }
            Ok(StoredValue { ty, elem: None, range: start..r.pos })
        }
    }
}

/// Bytes of a tensor of `ty` with GGUF dims `ne` (innermost first):
/// rows of whole blocks, every product checked.
pub(crate) fn tensor_bytes(ty: GgmlType, ne: &[u64]) -> Result<u64, String> {
    let overflow = || format!("dims {ne:?} have more elements than GGML's limit of 2^63-1");
    let elements = ne.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).ok_or_else(overflow)?;
    if elements > i64::MAX as u64 || usize::try_from(elements).is_err() {
        return Err(overflow());
    }
    let row = ne.first().copied().unwrap_or(1);
    let block = ty.block_size() as u64;
    if row % block != 0 {
        return Err(format!("rows of {row} elements are not whole {ty} blocks of {block}"));
    }
    let rows = ne.iter().skip(1).try_fold(1u64, |acc, &d| acc.checked_mul(d)).ok_or_else(overflow)?;
    (row / block)
        .checked_mul(ty.type_size() as u64)
        .and_then(|row_bytes| row_bytes.checked_mul(rows))
        .filter(|&b| usize::try_from(b).is_ok())
        .ok_or_else(|| format!("dims {ne:?} of {ty} need more bytes than fit in 64 bits"))
}
