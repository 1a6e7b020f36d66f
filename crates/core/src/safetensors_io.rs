//! Reading and writing tensors as safetensors files (weights, inputs, outputs).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use crate::tensor::MappedBytes;
use crate::{DType, Error, Result, Tensor};

/// The safetensors dtype of a kvjit dtype: a block format (which
/// safetensors has no name for) travels as U8 bytes, its format and
/// logical shape in the header's metadata ([`block_metadata_key`]).
fn to_file_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::U32 => Dtype::U32,
        DType::F8E4M3 => Dtype::F8_E4M3,
        // Every other dtype is a weight block format.
        _ => Dtype::U8,
    }
}

/// The metadata key that records the block format and logical shape of
/// tensor `name` (stored as U8 bytes): value `"q4_1:576,576"`.
fn block_metadata_key(name: &str) -> String {
    format!("kvjit.blocks.{name}")
}

/// The dtype and logical shape of a U8 tensor `name` that metadata
/// `value` names as blocks (`"q4_1:576,576"`).
fn parse_block_metadata(name: &str, value: &str) -> Result<(DType, Vec<usize>)> {
    let bad = || Error::UnsupportedFileDType { name: name.to_string(), dtype: format!("U8 blocks '{value}'") };
    let (format, shape) = value.split_once(':').ok_or_else(bad)?;
    let dtype: DType = format.parse().map_err(|_| bad())?;
    if !dtype.is_block_format() {
        return Err(bad());
    }
    let shape = if shape.is_empty() {
        Vec::new()
    } else {
        shape.split(',').map(|d| d.parse::<usize>().map_err(|_| bad())).collect::<Result<_>>()?
    };
    Ok((dtype, shape))
}

/// The dtype and logical shape of a file's tensor: its own, or for U8
/// bytes the metadata names as blocks, theirs (their byte count checked).
fn file_tensor_type(
    name: &str,
    dtype: Dtype,
    shape: &[usize],
    metadata: Option<&std::collections::HashMap<String, String>>,
) -> Result<(DType, Vec<usize>)> {
    match metadata.and_then(|m| m.get(&block_metadata_key(name))) {
        Some(value) if dtype == Dtype::U8 => {
            let (format, logical) = parse_block_metadata(name, value)?;
            let bytes = Tensor::storage_bytes(format, &logical)?;
            if shape != [bytes] {
                return Err(Error::ByteCount {
                    dtype: format,
                    shape: logical,
                    expected: bytes,
                    got: shape.iter().product(),
                });
            }
            Ok((format, logical))
        }
        _ => Ok((from_file_dtype(name, dtype)?, shape.to_vec())),
    }
}

fn from_file_dtype(name: &str, dtype: Dtype) -> Result<DType> {
    match dtype {
        Dtype::F32 => Ok(DType::F32),
        Dtype::BF16 => Ok(DType::BF16),
        Dtype::F16 => Ok(DType::F16),
        Dtype::U32 => Ok(DType::U32),
        Dtype::F8_E4M3 => Ok(DType::F8E4M3),
        other => Err(Error::UnsupportedFileDType { name: name.to_string(), dtype: format!("{other:?}") }),
    }
}

/// Serialize named tensors to safetensors bytes (strided tensors are packed).
pub fn tensors_to_safetensors<'a>(tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>) -> Result<Vec<u8>> {
    let packed: Vec<(&str, Tensor)> = tensors.into_iter().map(|(n, t)| (n, t.to_contiguous())).collect();
    let mut metadata = std::collections::HashMap::new();
    let views = packed
        .iter()
        .map(|(name, t)| {
            let shape = if t.dtype().is_block_format() {
                let dims: Vec<String> = t.shape().iter().map(|d| d.to_string()).collect();
                metadata.insert(block_metadata_key(name), format!("{}:{}", t.dtype(), dims.join(",")));
                vec![t.as_bytes().len()]
            } else {
                t.shape().to_vec()
            };
            TensorView::new(to_file_dtype(t.dtype()), shape, t.as_bytes()).map(|v| (*name, v))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Safetensors(e.to_string()))?;
    safetensors::serialize(views, (!metadata.is_empty()).then_some(metadata))
        .map_err(|e| Error::Safetensors(e.to_string()))
}

/// Parse safetensors bytes into named tensors. Truncated or malformed data,
/// and dtypes kvjit does not handle, are errors.
pub fn tensors_from_safetensors(bytes: &[u8]) -> Result<BTreeMap<String, Tensor>> {
    // The crate keeps the last of two entries naming one tensor: refuse
    // them first (a header length out of range is the crate's to report).
    let header_len = bytes.get(..8).map(|n| u64::from_le_bytes(n.try_into().expect("8 bytes")));
    let header_bytes = header_len.and_then(|n| bytes.get(8..usize::try_from(n).ok()?.checked_add(8)?));
    if let Some(header_bytes) = header_bytes {
        crate::json::parse_strict(header_bytes).map_err(|e| Error::Safetensors(format!("header: {e}")))?;
    }
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| Error::Safetensors(e.to_string()))?;
    let file = SafeTensors::deserialize(bytes).map_err(|e| Error::Safetensors(e.to_string()))?;
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let (dtype, shape) = file_tensor_type(&name, view.dtype(), view.shape(), header.metadata().as_ref())?;
            let tensor = Tensor::from_le_bytes(dtype, &shape, view.data())?;
            Ok((name, tensor))
        })
        .collect()
}

/// Write named tensors to a safetensors file.
pub fn write_safetensors<'a>(path: &Path, tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>) -> Result<()> {
    let bytes = tensors_to_safetensors(tensors)?;
    std::fs::write(path, bytes).map_err(|source| Error::Io { path: path.to_path_buf(), source })
}

/// How the data of a tensor file comes into memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightLoad {
    /// Map the file and borrow every aligned tensor from the mapping (no
    /// copy; pages come in from the page cache as kernels touch them).
    #[default]
    Map,
    /// Read the data into anonymous memory the process owns, advised to
    /// use transparent huge pages where the kernel allows them.
    Copy,
}

impl std::str::FromStr for WeightLoad {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "map" => Ok(WeightLoad::Map),
            "copy" => Ok(WeightLoad::Copy),
            other => Err(format!("unknown weight load mode '{other}' (expected map or copy)")),
        }
    }
}

/// The tensors of a file and how they were loaded.
#[derive(Debug, Default)]
pub struct LoadedTensors {
    /// Tensors by name.
    pub tensors: BTreeMap<String, Tensor>,
    /// Bytes borrowed from the file's mapping.
    pub mapped_bytes: u64,
    /// Bytes copied: everything in [`WeightLoad::Copy`] mode; with
    /// [`WeightLoad::Map`], only tensors misaligned for their dtype.
    pub copied_bytes: u64,
}

/// Read every tensor of a safetensors file, mapped ([`WeightLoad::Map`]).
/// See [`load_safetensors`].
pub fn read_safetensors(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    Ok(load_safetensors(path, WeightLoad::Map)?.tensors)
}

/// A checked safetensors header: where the data starts and each tensor's
/// name, dtype, shape and byte range inside the data.
pub struct SafetensorsHeader {
    /// Byte offset of the data section in the file.
    pub data_start: u64,
    /// Tensors in file order: name, dtype, shape, data range.
    pub tensors: Vec<(String, DType, Vec<usize>, std::ops::Range<usize>)>,
}

/// Read and check only the header of a safetensors file: the file must be
/// a regular file; the header length, every tensor's `data_offsets` (in
/// order, contiguous, not reversed) and every shape's byte size (without
/// overflow) must fit the real file size, and the dtypes must be ones kvjit
/// handles. Nothing of the data is read, mapped or allocated.
pub fn read_safetensors_header(path: &Path) -> Result<SafetensorsHeader> {
    let (mut file, file_len) = open_regular_file(path)?;
    read_header(path, &mut file, file_len)
}

fn read_header(path: &Path, file: &mut std::fs::File, file_len: u64) -> Result<SafetensorsHeader> {
    use std::io::Read;
    let bad = |problem: String| Error::BadTensorFile { path: path.to_path_buf(), format: "safetensors", problem };
    let io = |source| Error::Io { path: path.to_path_buf(), source };
    if file_len < 8 {
        return Err(bad(format!("{file_len} bytes is too short for the 8-byte header length")));
    }
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes).map_err(io)?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > file_len - 8 {
        return Err(bad(format!("header length {header_len} runs past the end of the {file_len}-byte file")));
    }
    let mut header = Vec::new();
    header.try_reserve_exact(header_len as usize).map_err(|_| Error::OutOfMemory { bytes: header_len as usize })?;
    file.take(header_len).read_to_end(&mut header).map_err(io)?;
    if header.len() as u64 != header_len {
        return Err(bad(format!("the file ended inside its {header_len}-byte header")));
    }
    // The `safetensors` crate checks, while parsing, that the ranges are in
    // order, contiguous and not reversed, and that each shape × dtype size
    // equals its range, without overflow.
    // Read strictly first: serde_json would keep the last of two entries
    // naming one tensor.
    let metadata: safetensors::tensor::Metadata =
        crate::json::parse_strict(&header).and_then(serde_json::from_value).map_err(|e| bad(format!("header: {e}")))?;
    let data_start = 8 + header_len;
    let data_len = metadata.data_len() as u64;
    if data_start.checked_add(data_len) != Some(file_len) {
        return Err(bad(format!(
            "the header describes {data_len} bytes of data but the file holds {} after its header",
            file_len - data_start
        )));
    }
    let mut tensors = Vec::with_capacity(metadata.tensors().len());
    for name in metadata.offset_keys() {
        let info = metadata.info(&name).expect("offset_keys names tensors of the metadata");
        let (dtype, shape) =
            file_tensor_type(&name, info.dtype, &info.shape, metadata.metadata().as_ref()).map_err(|e| {
                // Name the tensor where the error does not already.
                let message = e.to_string();
                match message.contains(&format!("'{name}'")) {
                    true => bad(message),
                    false => bad(format!("tensor '{}': {message}", name.escape_debug())),
                }
            })?;
        let (start, end) = info.data_offsets;
        tensors.push((name, dtype, shape, start..end));
    }
    Ok(SafetensorsHeader { data_start, tensors })
}

/// Load every tensor of a safetensors file. The header is checked first
/// ([`read_safetensors_header`]), so a file whose ranges do not fit is
/// refused before anything is mapped or allocated. With
/// [`WeightLoad::Map`] every tensor aligned for its dtype borrows the
/// mapping; misaligned ones are copied (and counted in
/// [`LoadedTensors::copied_bytes`]).
///
/// Mapped tensors read the file's pages as they are: the file must not be
/// modified or truncated while kvjit runs (the contract of every
/// memory-mapping loader).
pub fn load_safetensors(path: &Path, mode: WeightLoad) -> Result<LoadedTensors> {
    let (mut file, file_len) = open_regular_file(path)?;
    let header = read_header(path, &mut file, file_len)?;
    let data_len = (file_len - header.data_start) as usize;
    let (map, base) = match mode {
        WeightLoad::Map => (map_file(path, &file)?, header.data_start as usize),
        WeightLoad::Copy => (copy_to_anonymous(path, &mut file, header.data_start, data_len)?, 0),
    };
    let mut loaded = LoadedTensors::default();
    for (name, dtype, shape, range) in header.tensors {
        let bytes = range.len();
        let mapped = map.as_ref().and_then(|map| MappedBytes::new(map.clone(), base + range.start, bytes, dtype));
        let tensor = match mapped {
            Some(mapped) => {
                if mode == WeightLoad::Map {
                    loaded.mapped_bytes += bytes as u64;
                } else {
                    loaded.copied_bytes += bytes as u64;
                }
                Tensor::from_mapped(&shape, mapped)?
            }
            None => {
                loaded.copied_bytes += bytes as u64;
                // No mapping only when the data section is empty (every
                // tensor zero-sized): their ranges are all empty then.
                let data: &[u8] = map.as_deref().map_or(&[], |map| &map[base..]);
                Tensor::from_le_bytes(dtype, &shape, &data[range])?
            }
        };
        loaded.tensors.insert(name, tensor);
    }
    Ok(loaded)
}

/// The whole file, mapped read-only (`None` for an empty file).
pub fn map_file(path: &Path, file: &std::fs::File) -> Result<Option<Arc<memmap2::Mmap>>> {
    if file.metadata().map_err(|source| Error::Io { path: path.to_path_buf(), source })?.len() == 0 {
        return Ok(None);
    }
    // SAFETY: `file` is a regular file (checked by `open_regular_file`)
    // opened read-only, and kvjit never writes through the mapping. Its
    // length was checked against the header before this call, and every
    // slice taken from the mapping is range-checked (`MappedBytes::new`).
    // What no process can check is another process changing the file while
    // it is mapped; the README states that weight files must not be
    // modified while kvjit runs, as every memory-mapping loader does.
    let map = unsafe { memmap2::Mmap::map(file) }.map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    Ok(Some(Arc::new(map)))
}

/// `len` bytes of `file` from `offset`, read into anonymous memory advised
/// to use transparent huge pages, then made read-only (`None` when `len`
/// is 0).
pub fn copy_to_anonymous(
    path: &Path,
    file: &mut std::fs::File,
    offset: u64,
    len: usize,
) -> Result<Option<Arc<memmap2::Mmap>>> {
    use std::io::{Read, Seek};
    if len == 0 {
        return Ok(None);
    }
    let io = |source| Error::Io { path: path.to_path_buf(), source };
    let mut memory = memmap2::MmapMut::map_anon(len).map_err(|_| Error::OutOfMemory { bytes: len })?;
    #[cfg(target_os = "linux")]
    {
        // Advice only: where transparent huge pages are off it changes nothing.
        let _ = memory.advise(memmap2::Advice::HugePage);
    }
    file.seek(std::io::SeekFrom::Start(offset)).map_err(io)?;
    file.read_exact(&mut memory).map_err(io)?;
    Ok(Some(Arc::new(memory.make_read_only().map_err(io)?)))
}

/// The bytes of `path`, which must be a regular file (after symlinks).
pub fn read_regular_file(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let (file, len) = open_regular_file(path)?;
    let mut bytes = Vec::new();
    bytes.try_reserve_exact(len as usize).map_err(|_| Error::OutOfMemory { bytes: len as usize })?;
    file.take(len).read_to_end(&mut bytes).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    Ok(bytes)
}

/// Open `path` read-only if it is a regular file (after symlinks): a device
/// such as `/dev/zero` or a FIFO is refused before it is opened, so it can
/// neither block nor feed endless data. Gives the file and its size at open.
pub fn open_regular_file(path: &Path) -> Result<(std::fs::File, u64)> {
    let io = |source| Error::Io { path: path.to_path_buf(), source };
    let not_regular = || Error::NotARegularFile { path: path.to_path_buf() };
    if !std::fs::metadata(path).map_err(io)?.is_file() {
        return Err(not_regular());
    }
    let file = std::fs::File::open(path).map_err(io)?;
    let metadata = file.metadata().map_err(io)?;
    if !metadata.is_file() {
        return Err(not_regular()); // replaced between the two checks
    }
    Ok((file, metadata.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_are_read() {
        for path in ["/dev/zero", "/dev/null", "/"] {
            let err = read_safetensors(Path::new(path)).unwrap_err();
            assert!(matches!(err, Error::NotARegularFile { .. }), "{path}: {err:?}");
            assert_eq!(
                err.to_string(),
                format!("{path}: not a regular file (kvjit reads tensors from regular files only)")
            );
        }
    }

    #[test]
    fn round_trip_keeps_dtype_shape_and_bits() {
        let a = Tensor::from_f32(DType::BF16, &[2, 3], &[1.5, -2.0, 3.25, 0.1, 7.0, -0.5]).unwrap();
        let b = Tensor::scalar_u32(7);
        let bytes = tensors_to_safetensors([("a", &a), ("b", &b)]).unwrap();
        let back = tensors_from_safetensors(&bytes).unwrap();
        assert_eq!(back["a"], a);
        assert_eq!(back["b"], b);
    }

    #[test]
    fn truncated_file_is_an_error() {
        let a = Tensor::from_f32(DType::F32, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        let bytes = tensors_to_safetensors([("a", &a)]).unwrap();
        for cut in [0, 4, 8, bytes.len() - 1] {
            assert!(matches!(tensors_from_safetensors(&bytes[..cut]), Err(Error::Safetensors(_))), "cut {cut}");
        }
    }

    /// A safetensors file written by hand: the 8-byte length, `header`, `data`.
    fn raw_file(dir: &Path, header: &str, data: &[u8]) -> std::path::PathBuf {
        raw_file_with_len(dir, header.len() as u64, header, data)
    }

    fn raw_file_with_len(dir: &Path, header_len: u64, header: &str, data: &[u8]) -> std::path::PathBuf {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = dir.join(format!("t{n}.safetensors"));
        let mut bytes = header_len.to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(data);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn refusal(path: &Path) -> String {
        let header = read_safetensors_header(path).err().map(|e| e.to_string());
        for mode in [WeightLoad::Map, WeightLoad::Copy] {
            let load = load_safetensors(path, mode).err().map(|e| e.to_string());
            assert_eq!(load, header, "{mode:?} load and header check refuse alike");
        }
        header.expect("the file is refused")
    }

    #[test]
    fn headers_that_do_not_fit_the_file_are_refused_before_any_data_is_touched() {
        let dir = tempfile::tempdir().unwrap();
        let data = [7u8; 16];
        let cases: Vec<(&str, std::path::PathBuf, &str)> = vec![
            (
                "header length past the end",
                raw_file_with_len(dir.path(), 1 << 60, "{}", &[]),
                "header length 1152921504606846976 runs past the end",
            ),
            (
                "offsets past the end",
                raw_file(dir.path(), r#"{"a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}}"#, &data),
                "describes 32 bytes of data but the file holds 16",
            ),
            (
                "reversed offsets",
                raw_file(dir.path(), r#"{"a":{"dtype":"F32","shape":[0],"data_offsets":[16,0]}}"#, &data),
                "invalid offset for tensor `a`",
            ),
            (
                "overlapping offsets",
                raw_file(
                    dir.path(),
                    r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#,
                    &data,
                ),
                "invalid offset for tensor `b`",
            ),
            (
                "shape x dtype differs from the range",
                raw_file(dir.path(), r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}"#, &data),
                "invalid shape, data type, or offset",
            ),
            (
                "shape product overflows",
                raw_file(
                    dir.path(),
                    r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,16]}}"#,
                    &data,
                ),
                "overflow computing buffer size",
            ),
            (
                "dtype kvjit does not handle",
                raw_file(dir.path(), r#"{"a":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}}"#, &data),
                "dtype I64",
            ),
            ("too short for a header", raw_file_with_len(dir.path(), 0, "", &[]).with_extension("x"), ""),
        ];
        for (what, path, expected) in cases {
            if what == "too short for a header" {
                std::fs::write(&path, [1u8, 2, 3]).unwrap();
            }
            let message = refusal(&path);
            assert!(message.contains(expected), "{what}: {message}");
            if what != "dtype kvjit does not handle" {
                assert!(message.contains("not a valid safetensors file"), "{what}: {message}");
            }
        }
    }

    #[test]
    fn mapped_and_copied_loads_give_identical_tensors_and_count_their_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        use rand::SeedableRng;
        let a = Tensor::random(DType::BF16, &[3, 5], &mut rng, -1.0, 1.0).unwrap();
        let b = Tensor::random(DType::F32, &[7], &mut rng, -1.0, 1.0).unwrap();
        let c = Tensor::from_vec(&[2], vec![11u32, 12]).unwrap();
        let path = dir.path().join("w.safetensors");
        write_safetensors(&path, [("a", &a), ("b", &b), ("c", &c)]).unwrap();
        let mapped = load_safetensors(&path, WeightLoad::Map).unwrap();
        let copied = load_safetensors(&path, WeightLoad::Copy).unwrap();
        let total = (a.as_bytes().len() + b.as_bytes().len() + c.as_bytes().len()) as u64;
        assert_eq!(mapped.mapped_bytes + mapped.copied_bytes, total);
        assert_eq!((copied.mapped_bytes, copied.copied_bytes), (0, total));
        for (name, original) in [("a", &a), ("b", &b), ("c", &c)] {
            assert_eq!(&mapped.tensors[name], original, "{name} mapped");
            assert_eq!(&copied.tensors[name], original, "{name} copied");
            assert_eq!(mapped.tensors[name].as_bytes(), copied.tensors[name].as_bytes());
        }
        // The bf16 tensor starts right after the header, which the writer
        // pads to 8 bytes: it is aligned and borrowed from the file.
        assert!(mapped.tensors["a"].is_mapped());
    }

    /// A header naming one tensor twice (the `safetensors` crate and
    /// serde_json would keep the second entry) is refused by every reader.
    #[test]
    fn a_tensor_named_twice_is_refused() {
        // Valid but for the name: the second entry would silently read the
        // bytes as I32.
        let header = br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        file.extend_from_slice(&[0x3f; 4]);
        let err = tensors_from_safetensors(&file).unwrap_err().to_string();
        assert!(err.contains("duplicate key `a`"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("twice.safetensors");
        std::fs::write(&path, &file).unwrap();
        for mode in [WeightLoad::Map, WeightLoad::Copy] {
            let err = load_safetensors(&path, mode).unwrap_err().to_string();
            assert!(err.contains("duplicate key `a`"), "{mode:?}: {err}");
        }
    }

    #[test]
    fn block_tensors_travel_as_bytes_with_their_format_and_shape() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("blocks.safetensors");
        let bytes: Vec<u8> = (0..2 * 3 * 20).map(|i| (i * 7 % 251) as u8).collect();
        let q = Tensor::from_le_bytes(DType::Q4_1, &[2, 96], &bytes).unwrap();
        let f = Tensor::from_f32(DType::F32, &[2], &[1.5, -2.0]).unwrap();
        write_safetensors(&path, [("q", &q), ("f", &f)]).unwrap();
        for mode in [WeightLoad::Map, WeightLoad::Copy] {
            let loaded = load_safetensors(&path, mode).unwrap();
            assert_eq!(loaded.tensors["q"], q, "{mode:?}");
            assert_eq!(loaded.tensors["f"], f, "{mode:?}");
        }
        let parsed = tensors_from_safetensors(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(parsed["q"].dtype(), DType::Q4_1);
        assert_eq!(parsed["q"].shape(), &[2, 96]);
        // Metadata naming a shape the bytes do not fill is refused.
        let mut bad = std::collections::HashMap::new();
        bad.insert(block_metadata_key("q"), "q4_1:2,128".to_string());
        let view = TensorView::new(Dtype::U8, vec![bytes.len()], &bytes).unwrap();
        let file = safetensors::serialize([("q", view)], Some(bad)).unwrap();
        let err = tensors_from_safetensors(&file).unwrap_err().to_string();
        assert!(err.contains("q4_1"), "{err}");
    }

    #[test]
    fn dtype_errors_list_every_dtype() {
        let unknown = "f64".parse::<DType>().unwrap_err().to_string();
        let unsupported = from_file_dtype("t", Dtype::F64).unwrap_err().to_string();
        for dtype in DType::ALL {
            assert!(unknown.contains(&dtype.to_string()), "{dtype} not in: {unknown}");
            let file_name = format!("{:?}", to_file_dtype(dtype));
            assert!(unsupported.contains(&file_name), "{file_name} not in: {unsupported}");
            assert_eq!(dtype.is_block_format(), file_name == "U8", "{dtype}");
        }
    }

    #[test]
    fn a_file_of_zero_sized_tensors_loads_in_both_modes() {
        let dir = tempfile::tempdir().unwrap();
        let empty = Tensor::zeros(DType::F32, &[0, 4]).unwrap();
        let also_empty = Tensor::zeros(DType::BF16, &[3, 0]).unwrap();
        let path = dir.path().join("empty.safetensors");
        write_safetensors(&path, [("a", &empty), ("b", &also_empty)]).unwrap();
        for mode in [WeightLoad::Map, WeightLoad::Copy] {
            let loaded = load_safetensors(&path, mode).unwrap_or_else(|e| panic!("{mode:?}: {e}"));
            assert_eq!(loaded.tensors["a"], empty, "{mode:?}");
            assert_eq!(loaded.tensors["b"], also_empty, "{mode:?}");
            assert_eq!((loaded.mapped_bytes, loaded.copied_bytes), (0, 0), "{mode:?}");
        }
    }

    #[test]
    fn a_misaligned_tensor_is_copied_and_counted_and_writes_never_reach_the_file() {
        let dir = tempfile::tempdir().unwrap();
        // A 2-byte bf16 tensor first puts the f32 tensor at an odd multiple
        // of 2: it cannot be borrowed as f32 and is copied.
        let header = r#"{"a":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]},"b":{"dtype":"F32","shape":[2],"data_offsets":[2,10]}}"#;
        let padded = format!("{header:<width$}", width = header.len().next_multiple_of(8));
        let mut data = half::bf16::from_f32(1.5).to_le_bytes().to_vec();
        data.extend_from_slice(&2.5f32.to_le_bytes());
        data.extend_from_slice(&(-4.0f32).to_le_bytes());
        let path = raw_file(dir.path(), &padded, &data);
        let loaded = load_safetensors(&path, WeightLoad::Map).unwrap();
        assert_eq!((loaded.mapped_bytes, loaded.copied_bytes), (2, 8));
        assert!(loaded.tensors["a"].is_mapped());
        let mut b = loaded.tensors["b"].clone();
        assert!(!b.is_mapped());
        assert_eq!(b.to_f32_vec().unwrap(), vec![2.5, -4.0]);
        // Writing through a mapped tensor copies it first.
        let mut a = loaded.tensors["a"].clone();
        a.fill_f32(9.0).unwrap();
        b.fill_f32(9.0).unwrap();
        assert!(!a.is_mapped());
        assert_eq!(loaded.tensors["a"].to_f32_vec().unwrap(), vec![1.5]);
        let again = load_safetensors(&path, WeightLoad::Map).unwrap();
        assert_eq!(again.tensors["a"].to_f32_vec().unwrap(), vec![1.5]);
        assert_eq!(again.tensors["b"].to_f32_vec().unwrap(), vec![2.5, -4.0]);
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let status = std::process::Command::new("mkfifo").arg(&fifo).status();
        if !status.is_ok_and(|s| s.success()) {
            return; // no mkfifo on this system; /dev/zero is covered above
        }
        let err = load_safetensors(&fifo, WeightLoad::Map).unwrap_err();
        assert!(matches!(err, Error::NotARegularFile { .. }), "{err:?}");
        assert!(matches!(read_safetensors_header(&fifo), Err(Error::NotARegularFile { .. })));
    }
}
