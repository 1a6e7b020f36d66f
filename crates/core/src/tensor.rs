//! Host tensors.
//!
//! A [`Tensor`] holds typed storage ([`TensorData`], one `Vec` per dtype, so
//! every element is naturally aligned and no byte reinterpretation is needed
//! to read it) plus a shape and element strides. The storage is shared
//! copy-on-write: cloning a tensor, [`Tensor::reshaped`] and
//! [`Tensor::permuted`] copy no elements, and the first write through a
//! tensor whose storage is shared copies it (so a clone never sees another
//! clone's writes, and a tensor that is written while shared pays one copy). Tensors made by the
//! constructors are contiguous row-major; [`Tensor::permuted`] makes strided
//! views for callers that hold transposed data, and [`Tensor::to_contiguous`]
//! packs them back. Kernels require contiguous tensors and say so when they
//! get anything else.

use std::sync::Arc;

use half::{bf16, f16};
use rand::Rng;

use crate::{DType, Element, Error, Result};

/// Typed storage of a tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    /// f32 elements.
    F32(Vec<f32>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// f16 elements.
    F16(Vec<f16>),
    /// u32 elements.
    U32(Vec<u32>),
}

/// An element type a [`Tensor`] can store.
pub trait Storable: bytemuck::Pod + Send + Sync + 'static {
    /// The dtype tag of this element type.
    const DTYPE: DType;
    /// The storage as a slice of this type, if it holds this type.
    fn slice(data: &TensorData) -> Option<&[Self]>;
    /// The storage as a mutable slice of this type, if it holds this type.
    fn slice_mut(data: &mut TensorData) -> Option<&mut [Self]>;
    /// Wrap a vector of this type as storage.
    fn wrap(values: Vec<Self>) -> TensorData;
}

macro_rules! storable {
    ($ty:ty, $variant:ident) => {
        impl Storable for $ty {
            const DTYPE: DType = DType::$variant;
            fn slice(data: &TensorData) -> Option<&[Self]> {
                match data {
                    TensorData::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(data: &mut TensorData) -> Option<&mut [Self]> {
                match data {
                    TensorData::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn wrap(values: Vec<Self>) -> TensorData {
                TensorData::$variant(values)
            }
        }
    };
}
storable!(f32, F32);
storable!(bf16, BF16);
storable!(f16, F16);
storable!(u32, U32);

impl TensorData {
    /// Zero-filled storage of `len` elements.
    /// Zero-filled storage of `len` elements; an allocation the system
    /// cannot satisfy is an error ([`Error::OutOfMemory`]), not an abort.
    pub fn zeros(dtype: DType, len: usize) -> Result<Self> {
        fn filled<T: Clone>(len: usize, value: T, dtype: DType) -> Result<Vec<T>> {
            let mut v = Vec::new();
            v.try_reserve_exact(len)
                .map_err(|_| Error::OutOfMemory { bytes: len.saturating_mul(dtype.size_bytes()) })?;
            v.resize(len, value);
            Ok(v)
        }
        Ok(match dtype {
            DType::F32 => TensorData::F32(filled(len, 0.0, dtype)?),
            DType::BF16 => TensorData::BF16(filled(len, bf16::ZERO, dtype)?),
            DType::F16 => TensorData::F16(filled(len, f16::ZERO, dtype)?),
            DType::U32 => TensorData::U32(filled(len, 0, dtype)?),
        })
    }

    /// The dtype of the stored elements.
    pub fn dtype(&self) -> DType {
        match self {
            TensorData::F32(_) => DType::F32,
            TensorData::BF16(_) => DType::BF16,
            TensorData::F16(_) => DType::F16,
            TensorData::U32(_) => DType::U32,
        }
    }

    /// Number of stored elements.
    pub fn len(&self) -> usize {
        match self {
            TensorData::F32(v) => v.len(),
            TensorData::BF16(v) => v.len(),
            TensorData::F16(v) => v.len(),
            TensorData::U32(v) => v.len(),
        }
    }

    /// Whether no element is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The raw little-endian bytes of the storage.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            TensorData::F32(v) => bytemuck::cast_slice(v),
            TensorData::BF16(v) => bytemuck::cast_slice(v),
            TensorData::F16(v) => bytemuck::cast_slice(v),
            TensorData::U32(v) => bytemuck::cast_slice(v),
        }
    }

    /// The raw bytes of the storage, writable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            TensorData::F32(v) => bytemuck::cast_slice_mut(v),
            TensorData::BF16(v) => bytemuck::cast_slice_mut(v),
            TensorData::F16(v) => bytemuck::cast_slice_mut(v),
            TensorData::U32(v) => bytemuck::cast_slice_mut(v),
        }
    }

    fn from_le_bytes(dtype: DType, bytes: &[u8]) -> Result<Self> {
        let mut data = TensorData::zeros(dtype, bytes.len() / dtype.size_bytes())?;
        data.as_bytes_mut().copy_from_slice(bytes);
        Ok(data)
    }
}

/// Row-major strides (in elements) of a contiguous tensor of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        // Saturating: only a tensor with a zero dim can overflow here, and it
        // has no element to address.
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1]);
    }
    strides
}

fn checked_numel(shape: &[usize]) -> Result<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(|| Error::ShapeOverflow(shape.to_vec()))
}

/// A host tensor: typed storage, a shape and element strides.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    strides: Vec<usize>,
    data: Arc<TensorData>,
}

impl Tensor {
    /// A zero-filled contiguous tensor.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Result<Self> {
        let numel = checked_numel(shape)?;
        Ok(Self {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            data: Arc::new(TensorData::zeros(dtype, numel)?),
        })
    }

    /// A contiguous tensor over `values`, which must hold exactly `shape`'s
    /// element count.
    pub fn from_vec<T: Storable>(shape: &[usize], values: Vec<T>) -> Result<Self> {
        Self::from_data(shape, T::wrap(values))
    }

    /// A contiguous tensor over typed storage.
    pub fn from_data(shape: &[usize], data: TensorData) -> Result<Self> {
        let numel = checked_numel(shape)?;
        if numel != data.len() {
            return Err(Error::ElementCount { shape: shape.to_vec(), expected: numel, got: data.len() });
        }
        Ok(Self { shape: shape.to_vec(), strides: contiguous_strides(shape), data: Arc::new(data) })
    }

    /// A contiguous tensor from little-endian bytes, as stored in files.
    pub fn from_le_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Self> {
        let numel = checked_numel(shape)?;
        let expected = numel.checked_mul(dtype.size_bytes()).ok_or_else(|| Error::ShapeOverflow(shape.to_vec()))?;
        if bytes.len() != expected {
            return Err(Error::ByteCount { dtype, shape: shape.to_vec(), expected, got: bytes.len() });
        }
        Self::from_data(shape, TensorData::from_le_bytes(dtype, bytes)?)
    }

    /// A floating tensor from f32 values, each rounded to `dtype`.
    pub fn from_f32(dtype: DType, shape: &[usize], values: &[f32]) -> Result<Self> {
        let data = match dtype {
            DType::F32 => TensorData::F32(values.to_vec()),
            DType::BF16 => TensorData::BF16(values.iter().map(|&v| bf16::from_f32(v)).collect()),
            DType::F16 => TensorData::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
            DType::U32 => {
                return Err(Error::NotFloat { what: "from_f32".into(), dtype });
            }
        };
        Self::from_data(shape, data)
    }

    /// A u32 scalar (shape `[]`), as used for `layer_idx`.
    pub fn scalar_u32(value: u32) -> Self {
        Self { shape: Vec::new(), strides: Vec::new(), data: Arc::new(TensorData::U32(vec![value])) }
    }

    /// A floating tensor of values drawn uniformly from `[low, high)`, rounded
    /// to `dtype`.
    pub fn random(dtype: DType, shape: &[usize], rng: &mut impl Rng, low: f32, high: f32) -> Result<Self> {
        let numel = checked_numel(shape)?;
        let mut t = Self::zeros(dtype, shape)?;
        fn fill<T: Element>(values: &mut [T], rng: &mut impl Rng, low: f32, high: f32) {
            for v in values {
                *v = T::from_f32(rng.gen_range(low..high));
            }
        }
        match Arc::make_mut(&mut t.data) {
            TensorData::F32(v) => fill(v, rng, low, high),
            TensorData::BF16(v) => fill(v, rng, low, high),
            TensorData::F16(v) => fill(v, rng, low, high),
            TensorData::U32(_) => return Err(Error::NotFloat { what: "random".into(), dtype }),
        }
        debug_assert_eq!(t.numel(), numel);
        Ok(t)
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// The dims.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Element strides, one per dim.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Number of elements the shape describes.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the elements lie in row-major order with no gaps.
    pub fn is_contiguous(&self) -> bool {
        self.data.len() == self.numel()
            && self
                .shape
                .iter()
                .zip(&self.strides)
                .zip(contiguous_strides(&self.shape))
                .all(|((&dim, &stride), want)| dim <= 1 || stride == want)
    }

    /// The typed storage.
    pub fn data(&self) -> &TensorData {
        &self.data
    }

    /// The storage as a typed slice; fails if `T` is not the tensor's dtype.
    pub fn as_slice<T: Storable>(&self) -> Result<&[T]> {
        let dtype = self.dtype();
        T::slice(&self.data).ok_or(Error::WrongDType { expected: T::DTYPE, got: dtype })
    }

    /// The storage as a writable typed slice; fails if `T` is not the dtype.
    pub fn as_mut_slice<T: Storable>(&mut self) -> Result<&mut [T]> {
        let dtype = self.dtype();
        T::slice_mut(Arc::make_mut(&mut self.data)).ok_or(Error::WrongDType { expected: T::DTYPE, got: dtype })
    }

    /// The storage's raw little-endian bytes.
    pub fn as_bytes(&self) -> &[u8] {
        self.data.as_bytes()
    }

    /// The storage's raw bytes, writable (kernels write outputs through
    /// this). Copies the storage first if it is shared.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        Arc::make_mut(&mut self.data).as_bytes_mut()
    }

    /// Whether `self` and `other` share storage (a clone, view or reshape of
    /// one another that neither has written since).
    pub fn shares_storage_with(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.data, &other.data)
    }

    /// The same contiguous elements under another shape with as many
    /// elements, sharing the storage (no copy).
    pub fn reshaped(&self, shape: &[usize]) -> Result<Self> {
        if !self.is_contiguous() {
            return Err(Error::NotContiguous { arg: "reshape".into() });
        }
        let numel = checked_numel(shape)?;
        if numel != self.numel() {
            return Err(Error::ElementCount { shape: shape.to_vec(), expected: numel, got: self.numel() });
        }
        Ok(Self { shape: shape.to_vec(), strides: contiguous_strides(shape), data: self.data.clone() })
    }

    /// Every element widened to f32, in logical row-major order.
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        fn widen<T: Element>(t: &Tensor, values: &[T]) -> Vec<f32> {
            t.logical_offsets().map(|o| values[o].to_f32()).collect()
        }
        Ok(match &*self.data {
            TensorData::F32(v) => widen(self, v),
            TensorData::BF16(v) => widen(self, v),
            TensorData::F16(v) => widen(self, v),
            TensorData::U32(_) => {
                return Err(Error::NotFloat { what: "to_f32_vec".into(), dtype: DType::U32 });
            }
        })
    }

    /// Every element of a u32 tensor, in logical row-major order.
    pub fn to_u32_vec(&self) -> Result<Vec<u32>> {
        let values = self.as_slice::<u32>()?;
        Ok(self.logical_offsets().map(|o| values[o]).collect())
    }

    /// Set every stored element to `value` rounded to the dtype (floats only).
    pub fn fill_f32(&mut self, value: f32) -> Result<()> {
        match Arc::make_mut(&mut self.data) {
            TensorData::F32(v) => v.fill(value),
            TensorData::BF16(v) => v.fill(bf16::from_f32(value)),
            TensorData::F16(v) => v.fill(f16::from_f32(value)),
            TensorData::U32(_) => {
                return Err(Error::NotFloat { what: "fill_f32".into(), dtype: DType::U32 });
            }
        }
        Ok(())
    }

    /// The same elements seen with dims reordered by `perm`, sharing the
    /// storage: `permuted(&[1, 0])` is a transpose.
    pub fn permuted(&self, perm: &[usize]) -> Result<Self> {
        let mut seen = vec![false; self.shape.len()];
        let valid = perm.len() == self.shape.len()
            && perm.iter().all(|&p| p < seen.len() && !std::mem::replace(&mut seen[p], true));
        if !valid {
            return Err(Error::BadPermutation { rank: self.shape.len(), perm: perm.to_vec() });
        }
        Ok(Self {
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            data: self.data.clone(),
        })
    }

    /// A contiguous copy (or a clone, if already contiguous).
    pub fn to_contiguous(&self) -> Self {
        if self.is_contiguous() {
            return self.clone();
        }
        fn gather<T: Storable>(t: &Tensor, values: &[T]) -> Vec<T> {
            t.logical_offsets().map(|o| values[o]).collect()
        }
        let data = match &*self.data {
            TensorData::F32(v) => TensorData::F32(gather(self, v)),
            TensorData::BF16(v) => TensorData::BF16(gather(self, v)),
            TensorData::F16(v) => TensorData::F16(gather(self, v)),
            TensorData::U32(v) => TensorData::U32(gather(self, v)),
        };
        Self { shape: self.shape.clone(), strides: contiguous_strides(&self.shape), data: Arc::new(data) }
    }

    /// Storage offsets of the elements in logical row-major order.
    fn logical_offsets(&self) -> impl Iterator<Item = usize> + '_ {
        let numel = self.numel();
        let mut index = vec![0usize; self.shape.len()];
        (0..numel).map(move |i| {
            if i > 0 {
                for axis in (0..index.len()).rev() {
                    index[axis] += 1;
                    if index[axis] < self.shape[axis] {
                        break;
                    }
                    index[axis] = 0;
                }
            }
            index.iter().zip(&self.strides).map(|(i, s)| i * s).sum()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_then_contiguous_moves_elements() {
        let t = Tensor::from_vec(&[2, 3], vec![1u32, 2, 3, 4, 5, 6]).unwrap();
        let tt = t.permuted(&[1, 0]).unwrap();
        assert!(!tt.is_contiguous());
        assert_eq!(tt.shape(), &[3, 2]);
        assert_eq!(tt.to_u32_vec().unwrap(), vec![1, 4, 2, 5, 3, 6]);
        let packed = tt.to_contiguous();
        assert!(packed.is_contiguous());
        assert_eq!(packed.as_slice::<u32>().unwrap(), &[1, 4, 2, 5, 3, 6]);
    }

    #[test]
    fn from_f32_rounds_to_nearest_even() {
        // 1 + 2^-8 lies exactly between two bf16 values; ties go to the even one (1.0).
        let t = Tensor::from_f32(DType::BF16, &[2], &[1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0]).unwrap();
        assert_eq!(t.to_f32_vec().unwrap(), vec![1.0, 1.0 + 4.0 / 256.0]);
    }

    #[test]
    fn wrong_element_count_and_dtype_are_errors() {
        assert!(matches!(Tensor::from_vec(&[2, 2], vec![1.0f32; 3]), Err(Error::ElementCount { .. })));
        let t = Tensor::zeros(DType::F16, &[2]).unwrap();
        assert!(matches!(t.as_slice::<f32>(), Err(Error::WrongDType { .. })));
        assert!(matches!(t.permuted(&[0, 0]), Err(Error::BadPermutation { .. })));
    }
}
