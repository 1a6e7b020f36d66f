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

use crate::fp8::F8E4M3;
use crate::{DType, Element, Error, Result};

/// A tensor's elements, borrowed and typed: what [`Tensor::data`] gives.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum TensorData<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// bf16 elements.
    BF16(&'a [bf16]),
    /// f16 elements.
    F16(&'a [f16]),
    /// u32 elements.
    U32(&'a [u32]),
    /// FP8 E4M3 codes.
    F8E4M3(&'a [F8E4M3]),
    /// Weight blocks of a block format ([`DType::BLOCK_FORMATS`]), as
    /// stored.
    Blocks(DType, &'a [u8]),
}

/// An element type a [`Tensor`] can store.
pub trait Storable: bytemuck::Pod + Send + Sync + 'static {
    /// The dtype tag of this element type.
    const DTYPE: DType;
}
impl Storable for f32 {
    const DTYPE: DType = DType::F32;
}
impl Storable for bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Storable for f16 {
    const DTYPE: DType = DType::F16;
}
impl Storable for u32 {
    const DTYPE: DType = DType::U32;
}
impl Storable for F8E4M3 {
    const DTYPE: DType = DType::F8E4M3;
}

/// Elements the process owns: one `Vec` per dtype, so every element is
/// naturally aligned.
#[derive(Clone, Debug)]
enum OwnedData {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    U32(Vec<u32>),
    F8E4M3(Vec<F8E4M3>),
    /// Blocks of a block format: bytes.
    Blocks(DType, Vec<u8>),
    /// Elements of `dtype` in anonymous memory advised to use transparent
    /// huge pages ([`Tensor::zeros_in_huge_pages`]).
    Pages(DType, HugePages),
}

/// Writable anonymous memory advised to use transparent huge pages:
/// page-aligned, so it holds elements of any dtype; a clone is a copy.
#[derive(Debug)]
struct HugePages(memmap2::MmapMut);

impl HugePages {
    /// `len` zero bytes (untouched until written), or `None` when the
    /// system cannot map them.
    fn zeroed(len: usize) -> Option<Self> {
        let memory = memmap2::MmapMut::map_anon(len).ok()?;
        #[cfg(target_os = "linux")]
        {
            // Advice only: where transparent huge pages are off it changes nothing.
            let _ = memory.advise(memmap2::Advice::HugePage);
        }
        Some(HugePages(memory))
    }
}

impl Clone for HugePages {
    fn clone(&self) -> Self {
        let mut copy = HugePages::zeroed(self.0.len())
            .unwrap_or_else(|| panic!("out of memory copying {} bytes of tensor data", self.0.len()));
        copy.0.copy_from_slice(&self.0);
        copy
    }
}

impl OwnedData {
    /// Zero-filled storage of `len` storage units (elements, or bytes of a
    /// block format); an allocation the system
    /// cannot satisfy is an error ([`Error::OutOfMemory`]), not an abort.
    fn zeros(dtype: DType, len: usize) -> Result<Self> {
        // Zero is all-zero bits in every dtype, so the allocator's zeroed
        // memory serves as is: large buffers come as untouched zero pages
        // (no memset, no faults until first written).
        fn zeroed<T: bytemuck::Zeroable>(len: usize, dtype: DType) -> Result<Vec<T>> {
            bytemuck::allocation::try_zeroed_vec(len)
                .map_err(|_| Error::OutOfMemory { bytes: len.saturating_mul(dtype.size_bytes()) })
        }
        Ok(match dtype {
            DType::F32 => OwnedData::F32(zeroed(len, dtype)?),
            DType::BF16 => OwnedData::BF16(zeroed(len, dtype)?),
            DType::F16 => OwnedData::F16(zeroed(len, dtype)?),
            DType::U32 => OwnedData::U32(zeroed(len, dtype)?),
            DType::F8E4M3 => OwnedData::F8E4M3(zeroed(len, dtype)?),
            format => OwnedData::Blocks(format, zeroed(len, dtype)?),
        })
    }

    /// Take a typed vector without copying it.
    fn from_vec<T: Storable>(values: Vec<T>) -> Self {
        let values: Box<dyn std::any::Any> = Box::new(values);
        let wrong = "Storable is implemented for the five dtypes only";
        match T::DTYPE {
            DType::F32 => OwnedData::F32(*values.downcast().expect(wrong)),
            DType::BF16 => OwnedData::BF16(*values.downcast().expect(wrong)),
            DType::F16 => OwnedData::F16(*values.downcast().expect(wrong)),
            DType::U32 => OwnedData::U32(*values.downcast().expect(wrong)),
            DType::F8E4M3 => OwnedData::F8E4M3(*values.downcast().expect(wrong)),
            _ => unreachable!("{wrong}"),
        }
    }

    fn from_le_bytes(dtype: DType, bytes: &[u8]) -> Result<Self> {
        let mut data = OwnedData::zeros(dtype, bytes.len() / dtype.size_bytes())?;
        data.as_bytes_mut().copy_from_slice(bytes);
        Ok(data)
    }

    fn dtype(&self) -> DType {
        match self {
            OwnedData::F32(_) => DType::F32,
            OwnedData::BF16(_) => DType::BF16,
            OwnedData::F16(_) => DType::F16,
            OwnedData::U32(_) => DType::U32,
            OwnedData::F8E4M3(_) => DType::F8E4M3,
            OwnedData::Blocks(format, _) | OwnedData::Pages(format, _) => *format,
        }
    }

    fn as_bytes(&self) -> &[u8] {
        match self {
            OwnedData::F32(v) => bytemuck::cast_slice(v),
            OwnedData::BF16(v) => bytemuck::cast_slice(v),
            OwnedData::F16(v) => bytemuck::cast_slice(v),
            OwnedData::U32(v) => bytemuck::cast_slice(v),
            OwnedData::F8E4M3(v) => bytemuck::cast_slice(v),
            OwnedData::Blocks(_, v) => v,
            OwnedData::Pages(_, pages) => &pages.0,
        }
    }

    fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            OwnedData::F32(v) => bytemuck::cast_slice_mut(v),
            OwnedData::BF16(v) => bytemuck::cast_slice_mut(v),
            OwnedData::F16(v) => bytemuck::cast_slice_mut(v),
            OwnedData::U32(v) => bytemuck::cast_slice_mut(v),
            OwnedData::F8E4M3(v) => bytemuck::cast_slice_mut(v),
            OwnedData::Blocks(_, v) => v,
            OwnedData::Pages(_, pages) => &mut pages.0,
        }
    }
}

/// Elements borrowed from a read-only memory mapping (a weights file, a
/// compiled artifact, or anonymous memory filled once): `len` bytes at
/// `offset`, aligned for `dtype`.
#[derive(Clone)]
pub struct MappedBytes {
    map: Arc<memmap2::Mmap>,
    offset: usize,
    len: usize,
    dtype: DType,
}

impl MappedBytes {
    /// `len` bytes at `offset` of `map` as elements of `dtype`, or `None`
    /// when the range is outside the mapping, not a whole number of
    /// elements, or not aligned for the dtype (the caller copies those).
    pub fn new(map: Arc<memmap2::Mmap>, offset: usize, len: usize, dtype: DType) -> Option<Self> {
        let end = offset.checked_add(len)?;
        let bytes = map.get(offset..end)?;
        let aligned = (bytes.as_ptr() as usize).is_multiple_of(dtype.size_bytes());
        (aligned && len.is_multiple_of(dtype.size_bytes())).then_some(Self { map, offset, len, dtype })
    }

    fn as_bytes(&self) -> &[u8] {
        &self.map[self.offset..self.offset + self.len]
    }
}

impl std::fmt::Debug for MappedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MappedBytes({} bytes of {} at offset {})", self.len, self.dtype, self.offset)
    }
}

/// Where a tensor's elements live.
#[derive(Clone, Debug)]
enum Storage {
    Owned(OwnedData),
    Mapped(MappedBytes),
}

impl Storage {
    fn dtype(&self) -> DType {
        match self {
            Storage::Owned(data) => data.dtype(),
            Storage::Mapped(mapped) => mapped.dtype,
        }
    }

    fn as_bytes(&self) -> &[u8] {
        match self {
            Storage::Owned(data) => data.as_bytes(),
            Storage::Mapped(mapped) => mapped.as_bytes(),
        }
    }

    /// Number of stored elements (whole blocks' elements for a block
    /// format).
    fn len(&self) -> usize {
        self.dtype().elements_in(self.as_bytes().len())
    }

    /// The elements, typed. Mapped bytes were checked aligned for their
    /// dtype when mapped, so the casts cannot fail.
    fn typed(&self) -> TensorData<'_> {
        let bytes = self.as_bytes();
        match self.dtype() {
            DType::F32 => TensorData::F32(bytemuck::cast_slice(bytes)),
            DType::BF16 => TensorData::BF16(bytemuck::cast_slice(bytes)),
            DType::F16 => TensorData::F16(bytemuck::cast_slice(bytes)),
            DType::U32 => TensorData::U32(bytemuck::cast_slice(bytes)),
            DType::F8E4M3 => TensorData::F8E4M3(bytemuck::cast_slice(bytes)),
            format => TensorData::Blocks(format, bytes),
        }
    }
}

/// A graph constant in a kernel's own layout (packed panels, say), made
/// once from the constant's data: what a compiled artifact stores in its
/// place, so loading it needs no packing.
#[derive(Clone, Debug)]
pub struct PreparedConstant {
    /// Names the layout and everything it depends on (kernel, tile sizes,
    /// dims); a kernel takes a prepared constant only in the layout it
    /// would make itself.
    pub layout: String,
    /// The data in that layout.
    pub data: Arc<Tensor>,
}

/// Check an op argument: `expected` dtype and contiguous row-major
/// ([`Error::DTypeMismatch`], [`Error::NotContiguous`], naming `arg`). Every
/// kernel's argument check starts with this.
pub fn expect_arg(arg: &str, tensor: &Tensor, expected: DType) -> Result<()> {
    if tensor.dtype() != expected {
        return Err(Error::DTypeMismatch { arg: arg.into(), expected, got: tensor.dtype() });
    }
    if !tensor.is_contiguous() {
        return Err(Error::NotContiguous { arg: arg.into() });
    }
    Ok(())
}

/// [`Error::ShapeMismatch`] for argument `arg`: what was `expected`, and
/// the shape `got` has.
pub fn shape_mismatch(arg: &str, expected: String, got: &Tensor) -> Error {
    Error::ShapeMismatch { arg: arg.into(), expected, got: got.shape().to_vec() }
}

/// Row-major strides (in elements) of a contiguous tensor of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = Vec::with_capacity(shape.len());
    set_contiguous_strides(&mut strides, shape);
    strides
}

/// [`contiguous_strides`] written into `strides` (its allocation reused).
fn set_contiguous_strides(strides: &mut Vec<usize>, shape: &[usize]) {
    strides.clear();
    strides.resize(shape.len(), 1);
    for (stride, want) in strides.iter_mut().rev().zip(contiguous_strides_innermost_first(shape)) {
        *stride = want;
    }
}

/// The row-major strides of `shape`, innermost dim first, computed as they
/// are yielded (no allocation). Saturating: only a tensor with a zero dim
/// can overflow here, and it has no element to address.
fn contiguous_strides_innermost_first(shape: &[usize]) -> impl Iterator<Item = usize> + '_ {
    shape.iter().rev().scan(1usize, |next, &dim| {
        let stride = *next;
        *next = next.saturating_mul(dim);
        Some(stride)
    })
}

fn checked_numel(shape: &[usize]) -> Result<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(|| Error::ShapeOverflow(shape.to_vec()))
}

/// A host tensor: typed storage, a shape and element strides.
#[derive(Clone, Debug)]
pub struct Tensor {
    shape: Vec<usize>,
    strides: Vec<usize>,
    data: Arc<Storage>,
}

/// Equal dtype, shape, strides and stored bytes (wherever they live).
impl PartialEq for Tensor {
    fn eq(&self, other: &Self) -> bool {
        self.dtype() == other.dtype()
            && self.shape == other.shape
            && self.strides == other.strides
            && self.as_bytes() == other.as_bytes()
    }
}

impl Tensor {
    fn contiguous(shape: &[usize], data: Storage) -> Self {
        Self { shape: shape.to_vec(), strides: contiguous_strides(shape), data: Arc::new(data) }
    }

    /// Bytes a contiguous tensor of `dtype` and `shape` stores. A block
    /// format's rows must be whole blocks (its last dim a multiple of the
    /// block; [`Error::BlockShape`] otherwise).
    pub fn storage_bytes(dtype: DType, shape: &[usize]) -> Result<usize> {
        let numel = checked_numel(shape)?;
        let (block, _) = dtype.block();
        if block > 1 && !shape.last().is_some_and(|&last| last.is_multiple_of(block)) {
            return Err(Error::BlockShape { dtype, block, shape: shape.to_vec() });
        }
        dtype.storage_bytes(numel).ok_or_else(|| Error::ShapeOverflow(shape.to_vec()))
    }

    /// A zero-filled contiguous tensor (zero blocks for a block format).
    pub fn zeros(dtype: DType, shape: &[usize]) -> Result<Self> {
        let units = Self::storage_bytes(dtype, shape)? / dtype.size_bytes();
        Ok(Self::contiguous(shape, Storage::Owned(OwnedData::zeros(dtype, units)?)))
    }

    /// [`Tensor::zeros`] of `dtype` and `shape` made in this tensor's
    /// storage (zeroed in place, no allocation) when the storage is owned,
    /// held by this tensor alone (no clone, view or reshape shares it) and
    /// exactly as large; otherwise the tensor back, untouched. For callers
    /// that make the same buffers over and over (the executor's step
    /// outputs), where a fresh allocation costs an allocator call and, for
    /// large buffers, fresh page faults every time.
    pub fn rezeroed(mut self, dtype: DType, shape: &[usize]) -> std::result::Result<Self, Self> {
        let Ok(bytes) = Self::storage_bytes(dtype, shape) else { return Err(self) };
        match Arc::get_mut(&mut self.data) {
            Some(Storage::Owned(data)) if data.dtype() == dtype && data.as_bytes().len() == bytes => {
                data.as_bytes_mut().fill(0);
            }
            _ => return Err(self),
        }
        self.shape.clear();
        self.shape.extend_from_slice(shape);
        set_contiguous_strides(&mut self.strides, shape);
        Ok(self)
    }

    /// Whether this tensor alone holds its storage (no clone, view or
    /// reshape shares it), so that [`Tensor::rezeroed`] can reuse it.
    pub fn holds_storage_alone(&self) -> bool {
        Arc::strong_count(&self.data) == 1 && Arc::weak_count(&self.data) == 0
    }

    /// A contiguous tensor over `values`, which must hold exactly `shape`'s
    /// element count.
    pub fn from_vec<T: Storable>(shape: &[usize], values: Vec<T>) -> Result<Self> {
        let numel = checked_numel(shape)?;
        if numel != values.len() {
            return Err(Error::ElementCount { shape: shape.to_vec(), expected: numel, got: values.len() });
        }
        Ok(Self::contiguous(shape, Storage::Owned(OwnedData::from_vec(values))))
    }

    fn check_byte_count(dtype: DType, shape: &[usize], bytes: usize) -> Result<()> {
        let expected = Self::storage_bytes(dtype, shape)?;
        if bytes != expected {
            return Err(Error::ByteCount { dtype, shape: shape.to_vec(), expected, got: bytes });
        }
        Ok(())
    }

    /// A contiguous tensor from little-endian bytes, as stored in files
    /// (copied into memory the tensor owns).
    pub fn from_le_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Self> {
        Self::check_byte_count(dtype, shape, bytes.len())?;
        Ok(Self::contiguous(shape, Storage::Owned(OwnedData::from_le_bytes(dtype, bytes)?)))
    }

    /// A contiguous tensor whose elements are `mapped` bytes, borrowed (no
    /// copy). Writing through it copies the elements first.
    pub fn from_mapped(shape: &[usize], mapped: MappedBytes) -> Result<Self> {
        Self::check_byte_count(mapped.dtype, shape, mapped.len)?;
        Ok(Self::contiguous(shape, Storage::Mapped(mapped)))
    }

    /// A zero-filled contiguous tensor, like [`Tensor::zeros`], whose storage
    /// from 2 MiB on is anonymous memory advised to use transparent huge
    /// pages: for large buffers that kernels stream and write for a long
    /// time (a KV cache), which then cost a TLB miss per 2 MiB instead of
    /// per 4 KiB.
    pub fn zeros_in_huge_pages(dtype: DType, shape: &[usize]) -> Result<Self> {
        /// Below one huge page the advice cannot apply.
        const HUGE_PAGE: usize = 2 << 20;
        let len = Self::storage_bytes(dtype, shape)?;
        if len < HUGE_PAGE {
            return Self::zeros(dtype, shape);
        }
        let pages = HugePages::zeroed(len).ok_or(Error::OutOfMemory { bytes: len })?;
        Ok(Self::contiguous(shape, Storage::Owned(OwnedData::Pages(dtype, pages))))
    }

    /// A contiguous tensor of `dtype` and `shape` in fresh anonymous memory
    /// advised to use transparent huge pages, its bytes written once by
    /// `fill` and read-only after: for large constants made at build
    /// (packed weights), which then cost few page faults to make and few
    /// TLB misses to stream.
    pub fn anonymous(dtype: DType, shape: &[usize], fill: impl FnOnce(&mut [u8])) -> Result<Self> {
        let len = Self::storage_bytes(dtype, shape)?;
        if len == 0 {
            let mut t = Self::zeros(dtype, shape)?;
            fill(t.as_bytes_mut());
            return Ok(t);
        }
        let HugePages(mut memory) = HugePages::zeroed(len).ok_or(Error::OutOfMemory { bytes: len })?;
        fill(&mut memory);
        let map = memory.make_read_only().map_err(|_| Error::OutOfMemory { bytes: len })?;
        let mapped = MappedBytes::new(Arc::new(map), 0, len, dtype).expect("a fresh mapping is page-aligned");
        Self::from_mapped(shape, mapped)
    }

    /// A floating tensor from f32 values, each rounded to `dtype`.
    pub fn from_f32(dtype: DType, shape: &[usize], values: &[f32]) -> Result<Self> {
        match dtype {
            DType::F32 => Self::from_vec(shape, values.to_vec()),
            DType::BF16 => Self::from_vec(shape, values.iter().map(|&v| bf16::from_f32(v)).collect()),
            DType::F16 => Self::from_vec(shape, values.iter().map(|&v| f16::from_f32(v)).collect()),
            DType::F8E4M3 => Self::from_vec(shape, values.iter().map(|&v| F8E4M3::from_f32(v)).collect()),
            _ => Err(Error::NotFloat { what: "from_f32".into(), dtype }),
        }
    }

    /// A u32 scalar (shape `[]`), as used for `layer_idx`.
    pub fn scalar_u32(value: u32) -> Self {
        Self::contiguous(&[], Storage::Owned(OwnedData::U32(vec![value])))
    }

    /// A floating tensor of values drawn uniformly from `[low, high)`, rounded
    /// to `dtype`.
    pub fn random(dtype: DType, shape: &[usize], rng: &mut impl Rng, low: f32, high: f32) -> Result<Self> {
        let mut t = Self::zeros(dtype, shape)?;
        fn fill<T: Element>(values: &mut [T], rng: &mut impl Rng, low: f32, high: f32) {
            let uniform = rand::distributions::Uniform::new(low, high);
            for (v, x) in values.iter_mut().zip(rng.sample_iter(uniform)) {
                *v = T::from_f32(x);
            }
        }
        match t.owned_mut() {
            OwnedData::F32(v) => fill(v, rng, low, high),
            OwnedData::BF16(v) => fill(v, rng, low, high),
            OwnedData::F16(v) => fill(v, rng, low, high),
            OwnedData::F8E4M3(v) => fill(v, rng, low, high),
            OwnedData::U32(_) | OwnedData::Blocks(..) => return Err(Error::NotFloat { what: "random".into(), dtype }),
            OwnedData::Pages(..) => unreachable!("zeros() never makes huge-page storage"),
        }
        Ok(t)
    }

    /// The storage, owned by this tensor alone: a shared or mapped storage
    /// is copied first (copy-on-write).
    fn owned_mut(&mut self) -> &mut OwnedData {
        let unique_owned = matches!(*self.data, Storage::Owned(_)) && Arc::get_mut(&mut self.data).is_some();
        if !unique_owned {
            let copy = match &*self.data {
                Storage::Owned(data) => data.clone(),
                Storage::Mapped(mapped) => {
                    // The mapping was validated when made; a copy of valid
                    // bytes of its dtype always converts.
                    OwnedData::from_le_bytes(mapped.dtype, mapped.as_bytes())
                        .unwrap_or_else(|e| panic!("copying mapped tensor data: {e}"))
                }
            };
            self.data = Arc::new(Storage::Owned(copy));
        }
        match Arc::get_mut(&mut self.data) {
            Some(Storage::Owned(data)) => data,
            _ => unreachable!("the storage was just made owned and unique"),
        }
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
        // No allocation: kernels ask this of every argument on every call.
        self.data.len() == self.numel()
            && self
                .shape
                .iter()
                .zip(&self.strides)
                .rev()
                .zip(contiguous_strides_innermost_first(&self.shape))
                .all(|((&dim, &stride), want)| dim <= 1 || stride == want)
    }

    /// Whether the elements are borrowed from a memory mapping (a weights
    /// file, an artifact) rather than owned.
    pub fn is_mapped(&self) -> bool {
        matches!(*self.data, Storage::Mapped(_))
    }

    /// The stored elements, typed.
    pub fn data(&self) -> TensorData<'_> {
        self.data.typed()
    }

    /// The storage as a typed slice; fails if `T` is not the tensor's dtype.
    pub fn as_slice<T: Storable>(&self) -> Result<&[T]> {
        let dtype = self.dtype();
        if dtype != T::DTYPE {
            return Err(Error::WrongDType { expected: T::DTYPE, got: dtype });
        }
        Ok(bytemuck::cast_slice(self.as_bytes()))
    }

    /// The storage as a writable typed slice; fails if `T` is not the dtype.
    /// Copies the storage first if it is shared or mapped.
    pub fn as_mut_slice<T: Storable>(&mut self) -> Result<&mut [T]> {
        let dtype = self.dtype();
        if dtype != T::DTYPE {
            return Err(Error::WrongDType { expected: T::DTYPE, got: dtype });
        }
        Ok(bytemuck::cast_slice_mut(self.owned_mut().as_bytes_mut()))
    }

    /// The storage's raw little-endian bytes.
    pub fn as_bytes(&self) -> &[u8] {
        self.data.as_bytes()
    }

    /// The storage's raw bytes, writable (kernels write outputs through
    /// this). Copies the storage first if it is shared or mapped.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        self.owned_mut().as_bytes_mut()
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
        Self::storage_bytes(self.dtype(), shape)?; // a block format's rows stay whole blocks
        Ok(Self { shape: shape.to_vec(), strides: contiguous_strides(shape), data: self.data.clone() })
    }

    /// Every element widened to f32 (a block format's dequantized), in
    /// logical row-major order.
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        fn widen<T: Element>(t: &Tensor, values: &[T]) -> Vec<f32> {
            t.map_elements(values, |v| v.to_f32())
        }
        Ok(match self.data() {
            TensorData::F32(v) => widen(self, v),
            TensorData::BF16(v) => widen(self, v),
            TensorData::F16(v) => widen(self, v),
            TensorData::F8E4M3(v) => widen(self, v),
            TensorData::Blocks(format, bytes) => {
                // Block tensors are contiguous (they refuse permutation).
                let mut out = vec![0f32; self.numel()];
                crate::quant::dequantize(format, bytes, &mut out)?;
                out
            }
            TensorData::U32(_) => {
                return Err(Error::NotFloat { what: "to_f32_vec".into(), dtype: DType::U32 });
            }
        })
    }

    /// Every element of a u32 tensor, in logical row-major order.
    pub fn to_u32_vec(&self) -> Result<Vec<u32>> {
        let values = self.as_slice::<u32>()?;
        Ok(self.map_elements(values, |v| v))
    }

    /// Set every stored element to `value` rounded to the dtype (floats only).
    pub fn fill_f32(&mut self, value: f32) -> Result<()> {
        if !self.dtype().is_float() {
            return Err(Error::NotFloat { what: "fill_f32".into(), dtype: self.dtype() });
        }
        let dtype = self.dtype();
        let bytes = self.owned_mut().as_bytes_mut();
        match dtype {
            DType::F32 => bytemuck::cast_slice_mut::<u8, f32>(bytes).fill(value),
            DType::BF16 => bytemuck::cast_slice_mut::<u8, bf16>(bytes).fill(bf16::from_f32(value)),
            DType::F16 => bytemuck::cast_slice_mut::<u8, f16>(bytes).fill(f16::from_f32(value)),
            DType::F8E4M3 => bytemuck::cast_slice_mut::<u8, F8E4M3>(bytes).fill(F8E4M3::from_f32(value)),
            _ => unreachable!("checked above"),
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
        if self.dtype().is_block_format() && perm.iter().enumerate().any(|(i, &p)| i != p) {
            // A block holds consecutive elements of a row: they cannot be
            // seen in another order.
            return Err(Error::NotFloat { what: "permuted (blocks keep their rows)".into(), dtype: self.dtype() });
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
        fn gather<T: Storable>(t: &Tensor, values: &[T]) -> OwnedData {
            OwnedData::from_vec(t.map_elements(values, |v| v))
        }
        let data = match self.data() {
            TensorData::F32(v) => gather(self, v),
            TensorData::BF16(v) => gather(self, v),
            TensorData::F16(v) => gather(self, v),
            TensorData::U32(v) => gather(self, v),
            TensorData::F8E4M3(v) => gather(self, v),
            TensorData::Blocks(..) => unreachable!("block tensors are never permuted"),
        };
        Self::contiguous(&self.shape, Storage::Owned(data))
    }

    /// `f` of each element of `values` (this tensor's storage) in logical
    /// row-major order: straight down the storage when contiguous (a loop
    /// the compiler vectorizes), else through the strides.
    fn map_elements<T: Copy, U>(&self, values: &[T], mut f: impl FnMut(T) -> U) -> Vec<U> {
        if self.is_contiguous() {
            values.iter().map(|&v| f(v)).collect()
        } else {
            self.logical_offsets().map(|o| f(values[o])).collect()
        }
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
    fn huge_page_tensors_are_zeroed_writable_storage_copied_on_clone() {
        // 3 MiB of f32: past one huge page, so the mapped storage.
        let mut t = Tensor::zeros_in_huge_pages(DType::F32, &[3, 1 << 18]).unwrap();
        assert!(t.as_slice::<f32>().unwrap().iter().all(|&x| x == 0.0));
        let values = t.as_mut_slice::<f32>().unwrap();
        for (i, v) in values.iter_mut().enumerate() {
            *v = i as f32;
        }
        let copy = t.clone();
        t.fill_f32(-2.5).unwrap();
        assert!(t.as_slice::<f32>().unwrap().iter().all(|&x| x == -2.5));
        let kept = copy.as_slice::<f32>().unwrap();
        assert!(kept.iter().enumerate().all(|(i, &x)| x == i as f32), "the clone kept its values");
        let mut shared = copy.clone();
        shared.as_mut_slice::<f32>().unwrap()[7] = 1e9;
        assert_eq!(copy.as_slice::<f32>().unwrap()[7], 7.0, "a write copies shared storage first");
        assert_eq!(shared.to_f32_vec().unwrap()[7], 1e9);
        // Below a huge page: plain zeros.
        let small = Tensor::zeros_in_huge_pages(DType::BF16, &[4, 8]).unwrap();
        assert_eq!(small, Tensor::zeros(DType::BF16, &[4, 8]).unwrap());
    }

    #[test]
    fn rezeroed_reuses_only_storage_held_alone_of_the_same_dtype_and_size() {
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(5);
        let t = Tensor::random(DType::F32, &[4, 6], &mut rng, 0.5, 1.0).unwrap();
        let address = t.as_bytes().as_ptr();
        // Same dtype and byte count under another shape: zeroed in place.
        let reused = t.rezeroed(DType::F32, &[3, 2, 4]).unwrap();
        assert_eq!(reused.as_bytes().as_ptr(), address, "the storage was reallocated");
        assert_eq!(reused, Tensor::zeros(DType::F32, &[3, 2, 4]).unwrap());
        assert!(reused.holds_storage_alone());

        // Shared with a clone or a view, of another dtype or size, or
        // mapped: handed back as it was.
        let t = Tensor::random(DType::BF16, &[2, 8], &mut rng, 0.5, 1.0).unwrap();
        let before = t.to_f32_vec().unwrap();
        let view = t.reshaped(&[16]).unwrap();
        assert!(!t.holds_storage_alone());
        let t = t.rezeroed(DType::BF16, &[16]).unwrap_err();
        drop(view);
        let t = t.rezeroed(DType::F16, &[2, 8]).unwrap_err();
        let t = t.rezeroed(DType::BF16, &[2, 9]).unwrap_err();
        let t = t.rezeroed(DType::Q8_0, &[1, 32]).unwrap_err();
        assert_eq!((t.shape(), t.to_f32_vec().unwrap()), (&[2, 8][..], before));
        let mapped = Tensor::anonymous(DType::BF16, &[2, 8], |bytes| bytes.fill(7)).unwrap();
        assert!(mapped.holds_storage_alone() && mapped.is_mapped());
        assert!(mapped.rezeroed(DType::BF16, &[2, 8]).is_err(), "mapped storage is read-only");
    }

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
    fn block_tensors_hold_whole_blocks_of_rows_and_dequantize() {
        // One Q8_0 block: d = 0.5 (f16 0x3800), q = 0, 1, ..., 31 (minus 16).
        let mut block = vec![0x00u8, 0x38];
        block.extend((0..32).map(|i| (i - 16i8) as u8));
        let t = Tensor::from_le_bytes(DType::Q8_0, &[1, 32], &block).unwrap();
        assert!(t.is_contiguous());
        assert_eq!(t.numel(), 32);
        let want: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.5).collect();
        assert_eq!(t.to_f32_vec().unwrap(), want);
        // Rows must be whole blocks; the bytes must be whole blocks.
        assert!(matches!(Tensor::zeros(DType::Q4_1, &[2, 48]), Err(Error::BlockShape { block: 32, .. })));
        assert!(matches!(Tensor::from_le_bytes(DType::Q8_0, &[1, 32], &block[..33]), Err(Error::ByteCount { .. })));
        assert!(matches!(t.reshaped(&[2, 16]), Err(Error::BlockShape { .. })));
        assert_eq!(t.reshaped(&[32]).unwrap().shape(), &[32]);
        assert!(t.permuted(&[1, 0]).is_err(), "blocks keep their rows");
        assert_eq!(Tensor::zeros(DType::Q4K, &[3, 512]).unwrap().as_bytes().len(), 3 * 2 * 144);
        assert!(Tensor::random(DType::Q4_0, &[1, 32], &mut rand::thread_rng(), 0.0, 1.0).is_err());
    }

    #[test]
    fn wrong_element_count_and_dtype_are_errors() {
        assert!(matches!(Tensor::from_vec(&[2, 2], vec![1.0f32; 3]), Err(Error::ElementCount { .. })));
        let t = Tensor::zeros(DType::F16, &[2]).unwrap();
        assert!(matches!(t.as_slice::<f32>(), Err(Error::WrongDType { .. })));
        assert!(matches!(t.permuted(&[0, 0]), Err(Error::BadPermutation { .. })));
    }
}
