//! Reading and writing tensors as safetensors files (weights, inputs, outputs).

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use crate::{DType, Error, Result, Tensor};

fn to_file_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::U32 => Dtype::U32,
    }
}

fn from_file_dtype(name: &str, dtype: Dtype) -> Result<DType> {
    match dtype {
        Dtype::F32 => Ok(DType::F32),
        Dtype::BF16 => Ok(DType::BF16),
        Dtype::F16 => Ok(DType::F16),
        Dtype::U32 => Ok(DType::U32),
        other => Err(Error::UnsupportedFileDType { name: name.to_string(), dtype: format!("{other:?}") }),
    }
}

/// Serialize named tensors to safetensors bytes (strided tensors are packed).
pub fn tensors_to_safetensors<'a>(tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>) -> Result<Vec<u8>> {
    let packed: Vec<(&str, Tensor)> = tensors.into_iter().map(|(n, t)| (n, t.to_contiguous())).collect();
    let views = packed
        .iter()
        .map(|(name, t)| {
            TensorView::new(to_file_dtype(t.dtype()), t.shape().to_vec(), t.as_bytes()).map(|v| (*name, v))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Safetensors(e.to_string()))?;
    safetensors::serialize(views, None).map_err(|e| Error::Safetensors(e.to_string()))
}

/// Parse safetensors bytes into named tensors. Truncated or malformed data,
/// and dtypes kvjit does not handle, are errors.
pub fn tensors_from_safetensors(bytes: &[u8]) -> Result<BTreeMap<String, Tensor>> {
    let file = SafeTensors::deserialize(bytes).map_err(|e| Error::Safetensors(e.to_string()))?;
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let dtype = from_file_dtype(&name, view.dtype())?;
            let tensor = Tensor::from_le_bytes(dtype, view.shape(), view.data())?;
            Ok((name, tensor))
        })
        .collect()
}

/// Write named tensors to a safetensors file.
pub fn write_safetensors<'a>(path: &Path, tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>) -> Result<()> {
    let bytes = tensors_to_safetensors(tensors)?;
    std::fs::write(path, bytes).map_err(|source| Error::Io { path: path.to_path_buf(), source })
}

/// Read every tensor of a safetensors file. Only a regular file is read (a
/// device such as `/dev/zero` or a FIFO is refused before it is opened, so
/// it can neither block nor feed endless data), and never more bytes than
/// the file's size when it was opened; the header's ranges are then checked
/// against those bytes by the `safetensors` parser.
pub fn read_safetensors(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    tensors_from_safetensors(&read_regular_file(path)?)
}

/// The bytes of `path`, which must be a regular file (after symlinks).
pub fn read_regular_file(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
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
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(metadata.len() as usize)
        .map_err(|_| Error::OutOfMemory { bytes: metadata.len() as usize })?;
    file.take(metadata.len()).read_to_end(&mut bytes).map_err(io)?;
    Ok(bytes)
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
}
