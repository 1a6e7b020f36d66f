//! GGUF as a weights source: a checked reader over a memory-mapped file.
//!
//! [`Gguf::open`] maps the file and checks its whole header before anything
//! is allocated in proportion to what it declares: the magic, the version
//! (2 or 3, little-endian), the tensor and metadata counts against the bytes
//! left, every string and array length against the bytes left (checked
//! arithmetic; arrays are walked, never pre-allocated; nested arrays are
//! refused), every value type, `general.alignment` (a power of two, at most
//! 1 MiB), every tensor's dims (at most 4, their product checked against
//! 2⁶³), type (unknown ids refused, naming the id), alignment, byte size
//! (whole blocks of its type) inside the data section, and that no two
//! tensors overlap. A file that fails any check is one
//! [`kvjit_core::Error::BadTensorFile`] line; no input panics, hangs or
//! allocates more than its own size.
//!
//! Metadata is read typed ([`Gguf::get_u32`], [`Gguf::get_str_array`], …;
//! a missing or mistyped key is a [`kvjit_core::Error::GgufMetadata`] naming
//! it). Tensors come as [`kvjit_core::Tensor`]s in row-major shape (GGUF
//! lists dims innermost first: `ne = [K, N]` is shape `[N, K]`):
//! F32/F16/BF16 data in its own dtype is borrowed from the mapping (no
//! copy); anything else is converted or dequantized ([`dequant`]) into the
//! dtype the caller asks for ([`Gguf::tensor`]).
//!
//! Mapped tensors read the file's pages as they are: the file must not be
//! modified while kvjit runs (as for every memory-mapping loader).

pub mod dequant;
mod parse;
mod types;
mod value;
pub mod writer;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvjit_core::{DType, Error, LoadedTensors, MappedBytes, Result, Tensor, WeightLoad, bf16, f16};

pub use parse::{DEFAULT_ALIGNMENT, MAGIC, MAX_ALIGNMENT, MAX_DIMS};
pub use types::{GgmlType, QK_K, ValueType};
pub use value::{Array, ArrayIter, Value};

use parse::StoredValue;

/// A tensor entry of a GGUF file, checked against the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    name: String,
    ggml_type: GgmlType,
    ne: Vec<u64>,
    offset: u64,
    size: u64,
}

impl TensorInfo {
    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its GGML type.
    pub fn ggml_type(&self) -> GgmlType {
        self.ggml_type
    }

    /// Its dims as GGUF stores them, innermost first (`ne[0]` is the row).
    pub fn ne(&self) -> &[u64] {
        &self.ne
    }

    /// Its row-major shape (the dims reversed): a `[N, K]` matrix has
    /// `ne = [K, N]`.
    pub fn shape(&self) -> Vec<usize> {
        // Each dim fits usize: their product was checked to.
        self.ne.iter().rev().map(|&d| d as usize).collect()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.ne.iter().product::<u64>() as usize
    }

    /// Bytes of its data.
    pub fn byte_size(&self) -> usize {
        self.size as usize
    }

    /// Offset of its data from the start of the data section.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

/// A GGUF file, mapped and checked ([`Gguf::open`]).
pub struct Gguf {
    path: PathBuf,
    map: Arc<memmap2::Mmap>,
    version: u32,
    alignment: u64,
    metadata: Vec<(String, StoredValue)>,
    keys: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    names: HashMap<String, usize>,
    data_start: usize,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

fn bad(path: &Path, problem: String) -> Error {
    Error::BadTensorFile { path: path.to_path_buf(), format: "GGUF", problem }
}

impl Gguf {
    /// Map the GGUF file at `path` (a regular file) and check its header.
    pub fn open(path: &Path) -> Result<Gguf> {
        Gguf::open_with(path, WeightLoad::Map)
    }

    /// [`Gguf::open`], the file mapped ([`WeightLoad::Map`]) or read into
    /// anonymous huge-page memory ([`WeightLoad::Copy`]); tensors borrow
    /// from either.
    pub fn open_with(path: &Path, mode: WeightLoad) -> Result<Gguf> {
        let (mut file, len) = kvjit_core::open_regular_file(path)?;
        if len < 24 {
            return Err(bad(path, format!("{len} bytes is too short for a GGUF header (24 bytes)")));
        }
        let len = usize::try_from(len).map_err(|_| Error::OutOfMemory { bytes: usize::MAX })?;
        let map = match mode {
            WeightLoad::Map => kvjit_core::map_file(path, &file)?,
            WeightLoad::Copy => kvjit_core::copy_to_anonymous(path, &mut file, 0, len)?,
        };
        let map = map.ok_or_else(|| bad(path, "the file is empty".into()))?;
        if map.len() != len {
            return Err(bad(path, format!("the file changed size while it was opened ({len} → {})", map.len())));
        }
        Gguf::from_map(path, map)
    }

    /// Check `bytes` as a GGUF image (copied into memory kvjit owns; tensors
    /// borrow from that copy). `name` stands for the file in messages.
    pub fn from_bytes(name: &str, bytes: &[u8]) -> Result<Gguf> {
        let path = Path::new(name);
        if bytes.len() < 24 {
            return Err(bad(path, format!("{} bytes is too short for a GGUF header (24 bytes)", bytes.len())));
        }
        let mut memory =
            memmap2::MmapMut::map_anon(bytes.len()).map_err(|_| Error::OutOfMemory { bytes: bytes.len() })?;
        memory.copy_from_slice(bytes);
        let map = memory.make_read_only().map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        Gguf::from_map(path, Arc::new(map))
    }

    fn from_map(path: &Path, map: Arc<memmap2::Mmap>) -> Result<Gguf> {
        let parsed = parse::parse(&map).map_err(|problem| bad(path, problem))?;
        let keys = parsed.metadata.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect();
        let tensors: Vec<TensorInfo> = parsed
            .tensors
            .into_iter()
            .map(|t| TensorInfo { name: t.name, ggml_type: t.ggml_type, ne: t.ne, offset: t.offset, size: t.size })
            .collect();
        let names = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(Gguf {
            path: path.to_path_buf(),
            map,
            version: parsed.version,
            alignment: parsed.alignment,
            metadata: parsed.metadata,
            keys,
            tensors,
            names,
            data_start: parsed.data_start,
        })
    }

    /// The file (or the name given to [`Gguf::from_bytes`]).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Byte offset of the data section in the file.
    pub fn data_offset(&self) -> usize {
        self.data_start
    }

    // ---- metadata ----

    /// The metadata keys, in file order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.metadata.iter().map(|(k, _)| k.as_str())
    }

    /// The value of `key`, if the file has it.
    pub fn get(&self, key: &str) -> Option<Value<'_>> {
        let stored = &self.metadata[*self.keys.get(key)?].1;
        let bytes = &self.map[stored.range.clone()];
        Some(match (stored.ty, stored.elem) {
            (ValueType::String, _) => Value::String(bytes),
            (ValueType::Array, Some((elem, len))) => Value::Array(Array { elem, len, bytes }),
            (ty, _) => value::decode_scalar(ty, bytes).expect("a checked scalar").0,
        })
    }

    fn metadata_error(&self, key: &str, problem: String) -> Error {
        Error::GgufMetadata { path: self.path.clone().into(), key: key.into(), problem: problem.into() }
    }

    fn required<T>(&self, key: &str, value: Result<Option<T>>) -> Result<T> {
        value?.ok_or_else(|| self.metadata_error(key, format!("missing metadata key {key}")))
    }

    fn wrong_type(&self, key: &str, value: &Value<'_>, expected: &str) -> Error {
        let got = match value {
            Value::Array(a) => format!("an array of {}", a.elem_type()),
            other => format!("a {}", other.value_type()),
        };
        self.metadata_error(key, format!("metadata key {key} is {got}, expected {expected}"))
    }

    /// `key` as an integer of any width that fits `T`.
    fn integer<T: TryFrom<i128>>(&self, key: &str, expected: &str) -> Result<Option<T>> {
        let Some(value) = self.get(key) else { return Ok(None) };
        let n = value.as_integer().ok_or_else(|| self.wrong_type(key, &value, expected))?;
        T::try_from(n)
            .map(Some)
            .map_err(|_| self.metadata_error(key, format!("metadata key {key} = {n} does not fit {expected}")))
    }

    /// `key` as a u32 (stored as any integer type whose value fits), or `None` if absent.
    pub fn get_u32_opt(&self, key: &str) -> Result<Option<u32>> {
        self.integer(key, "u32")
    }

    /// `key` as a u32; an error names a missing key.
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.required(key, self.get_u32_opt(key))
    }

    /// `key` as a u64 (any integer type whose value fits), or `None` if absent.
    pub fn get_u64_opt(&self, key: &str) -> Result<Option<u64>> {
        self.integer(key, "u64")
    }

    /// `key` as a u64; an error names a missing key.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.required(key, self.get_u64_opt(key))
    }

    /// `key` as an i64 (any integer type whose value fits), or `None` if absent.
    pub fn get_i64_opt(&self, key: &str) -> Result<Option<i64>> {
        self.integer(key, "i64")
    }

    /// `key` as an f32 (stored as f32, or f64 rounded), or `None` if absent.
    pub fn get_f32_opt(&self, key: &str) -> Result<Option<f32>> {
        let Some(value) = self.get(key) else { return Ok(None) };
        value.as_f32().map(Some).ok_or_else(|| self.wrong_type(key, &value, "f32"))
    }

    /// `key` as an f32; an error names a missing key.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.required(key, self.get_f32_opt(key))
    }

    /// `key` as a bool, or `None` if absent.
    pub fn get_bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(other) => Err(self.wrong_type(key, &other, "bool")),
        }
    }

    /// `key` as a bool; an error names a missing key.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.required(key, self.get_bool_opt(key))
    }

    /// `key` as a UTF-8 string, or `None` if absent.
    pub fn get_str_opt(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(value @ Value::String(_)) => value
                .as_str()
                .map(Some)
                .ok_or_else(|| self.metadata_error(key, format!("metadata key {key} is not valid UTF-8"))),
            Some(other) => Err(self.wrong_type(key, &other, "string")),
        }
    }

    /// `key` as a UTF-8 string; an error names a missing key.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.required(key, self.get_str_opt(key))
    }

    /// `key` as an array, or `None` if absent.
    pub fn get_array_opt(&self, key: &str) -> Result<Option<Array<'_>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(other) => Err(self.wrong_type(key, &other, "an array")),
        }
    }

    /// `key` as an array; an error names a missing key.
    pub fn get_array(&self, key: &str) -> Result<Array<'_>> {
        self.required(key, self.get_array_opt(key))
    }

    /// `key` as an array of strings' bytes (GGUF says UTF-8, but some
    /// vocabularies hold raw bytes); `None` if absent.
    pub fn get_bytes_array_opt(&self, key: &str) -> Result<Option<Vec<&[u8]>>> {
        let Some(array) = self.get_array_opt(key)? else { return Ok(None) };
        if array.elem_type() != ValueType::String {
            return Err(self.wrong_type(key, &Value::Array(array), "an array of string"));
        }
        Ok(Some(
            array
                .iter()
                .map(|v| match v {
                    Value::String(b) => b,
                    _ => unreachable!("a string array holds strings"),
                })
                .collect(),
        ))
    }

    /// `key` as an array of UTF-8 strings; `None` if absent.
    pub fn get_str_array_opt(&self, key: &str) -> Result<Option<Vec<&str>>> {
        let Some(bytes) = self.get_bytes_array_opt(key)? else { return Ok(None) };
        let strings = bytes
            .into_iter()
            .enumerate()
            .map(|(i, b)| {
                std::str::from_utf8(b)
                    .map_err(|_| self.metadata_error(key, format!("metadata key {key}[{i}] is not valid UTF-8")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(strings))
    }

    /// `key` as an array of UTF-8 strings; an error names a missing key.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        self.required(key, self.get_str_array_opt(key))
    }

    fn integer_array<T: TryFrom<i128>>(&self, key: &str, expected: &str) -> Result<Option<Vec<T>>> {
        let Some(array) = self.get_array_opt(key)? else { return Ok(None) };
        let mut out = Vec::with_capacity(array.len());
        for (i, v) in array.iter().enumerate() {
            let n = v.as_integer().ok_or_else(|| {
                self.wrong_type(key, &Value::Array(array), &format!("an array of integers ({expected})"))
            })?;
            let n = T::try_from(n).map_err(|_| {
                self.metadata_error(key, format!("metadata key {key}[{i}] = {n} does not fit {expected}"))
            })?;
            out.push(n);
        }
        Ok(Some(out))
    }

    /// `key` as i32s, from an array of any integer type whose values fit
    /// (each element read at its declared width); `None` if absent.
    pub fn get_i32_array_opt(&self, key: &str) -> Result<Option<Vec<i32>>> {
        self.integer_array(key, "i32")
    }

    /// `key` as i32s; an error names a missing key.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>> {
        self.required(key, self.get_i32_array_opt(key))
    }

    /// `key` as u32s, from an array of any integer type whose values fit;
    /// `None` if absent.
    pub fn get_u32_array_opt(&self, key: &str) -> Result<Option<Vec<u32>>> {
        self.integer_array(key, "u32")
    }

    /// `key` as u32s; an error names a missing key.
    pub fn get_u32_array(&self, key: &str) -> Result<Vec<u32>> {
        self.required(key, self.get_u32_array_opt(key))
    }

    /// `key` as f32s (an array of f32, or f64 rounded); `None` if absent.
    pub fn get_f32_array_opt(&self, key: &str) -> Result<Option<Vec<f32>>> {
        let Some(array) = self.get_array_opt(key)? else { return Ok(None) };
        array
            .iter()
            .map(|v| v.as_f32().ok_or_else(|| self.wrong_type(key, &Value::Array(array), "an array of f32")))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// `key` as f32s; an error names a missing key.
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        self.required(key, self.get_f32_array_opt(key))
    }

    /// `general.architecture` (e.g. `llama`).
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    /// The architecture's own key `{architecture}.{suffix}`, e.g.
    /// `arch_key("block_count")` is `llama.block_count` in a Llama file.
    pub fn arch_key(&self, suffix: &str) -> Result<String> {
        Ok(format!("{}.{suffix}", self.architecture()?))
    }

    // ---- tensors ----

    /// The tensor entries, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The entry of tensor `name`.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.names.get(name).map(|&i| &self.tensors[i])
    }

    fn info_or_missing(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor_info(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            context: format!(" in {}", self.path.display()),
        })
    }

    /// The stored bytes of tensor `name` (its blocks, as in the file).
    pub fn tensor_data(&self, name: &str) -> Result<&[u8]> {
        let info = self.info_or_missing(name)?;
        Ok(self.bytes_of(info))
    }

    fn bytes_of(&self, info: &TensorInfo) -> &[u8] {
        // Checked at open: offset + size lies inside the data section.
        let start = self.data_start + info.offset as usize;
        &self.map[start..start + info.size as usize]
    }

    /// Tensor `name` as a `dtype` tensor (f32, bf16 or f16) in row-major
    /// shape. Data stored in that dtype is borrowed from the mapping (copied
    /// only if misaligned for it); other float types are converted and
    /// quantized types dequantized ([`dequant::dequantize`]) into fresh
    /// memory, rounding once to `dtype`. A `dtype` that is a weight block
    /// format ([`DType::BLOCK_FORMATS`]) takes the tensor's blocks as
    /// stored, borrowed from the mapping, when it is stored in that format;
    /// IQ4_NL, Q4_0 or Q5_0 asked for as Q8_0 ([`GgmlType::exact_in_q8_0`])
    /// loads as the Q8_0 blocks of the same values, and any of the types
    /// [`GgmlType::exact_in_q8_min`] asked for as q8_min as the q8_min
    /// blocks of the same values, and so for q8_kmin
    /// ([`GgmlType::exact_in_q8_kmin`], [`Gguf::holds_exactly`]); other
    /// types are refused.
    pub fn tensor(&self, name: &str, dtype: DType) -> Result<Tensor> {
        Ok(self.load_tensor(name, dtype)?.0)
    }

    /// Whether tensor `name` loads as the block format `dtype` with every
    /// value as stored: stored in it, or rewritable into it exactly
    /// ([`Gguf::tensor`]; for q8_min and q8_kmin this reads the blocks'
    /// scales, [`dequant::holds_in`]).
    pub fn holds_exactly(&self, name: &str, dtype: DType) -> bool {
        let Some(info) = self.tensor_info(name) else { return false };
        info.ggml_type.block_format() == Some(dtype) || dequant::holds_in(info.ggml_type, self.bytes_of(info), dtype)
    }

    /// [`Gguf::tensor`], and whether it borrows the mapping (`true`) or was
    /// made (`false`: copied, converted or dequantized).
    pub fn load_tensor(&self, name: &str, dtype: DType) -> Result<(Tensor, bool)> {
        let info = self.info_or_missing(name)?;
        let refuse = |problem: String| Error::GgufTensor {
            path: self.path.clone().into(),
            name: name.into(),
            problem: problem.into(),
        };
        if dtype.is_block_format() {
            // Blocks are kept as stored: borrowed from the mapping (blocks
            // are bytes, aligned anywhere), never requantized.
            if info.ggml_type.block_format() == Some(dtype) {
                let start = self.data_start + info.offset as usize;
                let mapped = MappedBytes::new(self.map.clone(), start, info.size as usize, dtype)
                    .expect("the tensor's bytes were checked to lie in the mapping at open");
                return Ok((Tensor::from_mapped(&info.shape(), mapped)?, true));
            }
            // Or rewritten as blocks of exactly the same values: IQ4_NL,
            // Q4_0 and Q5_0 as Q8_0; any of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
            // and IQ4_NL as q8_min; any of Q4_K, Q5_K and Q6_K as q8_kmin.
            let (fits, blocks) = match dtype {
                DType::Q8_0 => (info.ggml_type.exact_in_q8_0(), dequant::to_q8_0(info.ggml_type, self.bytes_of(info))),
                DType::Q8Min => {
                    (info.ggml_type.exact_in_q8_min(), dequant::to_q8_min(info.ggml_type, self.bytes_of(info)))
                }
                DType::Q8KMin => {
                    (info.ggml_type.exact_in_q8_kmin(), dequant::to_q8_kmin(info.ggml_type, self.bytes_of(info)))
                }
                _ => (false, None),
            };
            return match blocks {
                Some(blocks) => Ok((Tensor::from_le_bytes(dtype, &info.shape(), &blocks)?, false)),
                None if fits => Err(refuse(format!(
                    "its {} blocks do not all hold exactly in {dtype}: a scale is not finite or too large \
                     (load it as f32, bf16 or f16)",
                    info.ggml_type
                ))),
                None => Err(refuse(format!(
                    "it is stored as {}, not {dtype} blocks (kvjit keeps blocks as stored; load it as f32, bf16 or f16)",
                    info.ggml_type
                ))),
            };
        }
        if !dtype.is_compute_float() {
            return Err(refuse(format!(
                "GGUF weights load as f32, bf16 or f16, not {dtype} (or as the block format they are stored in)"
            )));
        }
        if !info.ggml_type.is_supported() {
            return Err(refuse(format!(
                "GGML type {} is not one kvjit reads (it reads {})",
                info.ggml_type,
                GgmlType::supported_names()
            )));
        }
        let shape = info.shape();
        let bytes = self.bytes_of(info);
        let stored = match info.ggml_type {
            GgmlType::F32 => Some(DType::F32),
            GgmlType::F16 => Some(DType::F16),
            GgmlType::BF16 => Some(DType::BF16),
            _ => None,
        };
        if stored == Some(dtype) {
            let start = self.data_start + info.offset as usize;
            return match MappedBytes::new(self.map.clone(), start, bytes.len(), dtype) {
                Some(mapped) => Ok((Tensor::from_mapped(&shape, mapped)?, true)),
                None => Ok((Tensor::from_le_bytes(dtype, &shape, bytes)?, false)),
            };
        }
        let tensor = Tensor::anonymous(dtype, &shape, |out| {
            dequantize_into(info.ggml_type, bytes, dtype, out).expect("sizes were checked at open");
        })?;
        Ok((tensor, false))
    }

    /// Load the tensors `wanted` names, each as its dtype
    /// ([`Gguf::load_tensor`]), counting borrowed and made bytes.
    pub fn load_tensors<'n>(&self, wanted: impl IntoIterator<Item = (&'n str, DType)>) -> Result<LoadedTensors> {
        let mut loaded = LoadedTensors::default();
        for (name, dtype) in wanted {
            let (tensor, borrowed) = self.load_tensor(name, dtype)?;
            let bytes = tensor.as_bytes().len() as u64;
            if borrowed {
                loaded.mapped_bytes += bytes;
            } else {
                loaded.copied_bytes += bytes;
            }
            loaded.tensors.insert(name.to_string(), tensor);
        }
        Ok(loaded)
    }
}

/// Dequantize `bytes` of `ty` into `out`, the little-endian bytes of
/// elements of `dtype` (f32, bf16 or f16), a block of 256 elements at a time.
fn dequantize_into(ty: GgmlType, bytes: &[u8], dtype: DType, out: &mut [u8]) -> std::result::Result<(), String> {
    let (block, size) = (ty.block_size(), ty.type_size());
    // Whole blocks of at most 256 elements (a K-quant super-block).
    let per_chunk = (QK_K / block).max(1);
    let mut scratch = [0f32; QK_K];
    let esize = dtype.size_bytes();
    if out.len() != bytes.len() / size * block * esize {
        return Err(format!("{} output bytes for {} bytes of {ty}", out.len(), bytes.len()));
    }
    for (chunk, out) in bytes.chunks(per_chunk * size).zip(out.chunks_mut(per_chunk * block * esize)) {
        let n = chunk.len() / size * block;
        let values = &mut scratch[..n];
        dequant::dequantize(ty, chunk, values)?;
        match dtype {
            DType::F32 => {
                for (o, v) in out.chunks_exact_mut(4).zip(values.iter()) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
            DType::BF16 => {
                for (o, v) in out.chunks_exact_mut(2).zip(values.iter()) {
                    o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
                }
            }
            DType::F16 => {
                for (o, v) in out.chunks_exact_mut(2).zip(values.iter()) {
                    o.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
                }
            }
            other => return Err(format!("cannot dequantize into {other}")),
        }
    }
    Ok(())
}
