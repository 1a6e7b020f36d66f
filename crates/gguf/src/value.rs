//! Metadata values, borrowed from the file's bytes.

use crate::ValueType;

/// A metadata value. Strings and arrays borrow the file's bytes; their
/// lengths were checked against the file when it was opened.
#[derive(Clone, Copy, Debug, PartialEq)]
#[allow(missing_docs, reason = "each variant holds a value of the GGUF type of the same name")]
pub enum Value<'a> {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    /// A string's bytes (GGUF says UTF-8; [`Value::as_str`] checks it).
    String(&'a [u8]),
    Array(Array<'a>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl<'a> Value<'a> {
    /// Its type.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// An integer value of any width, widened to i128 (`None` for other types).
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// A floating value (f32, or f64 rounded to f32).
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    /// A string value, if it is valid UTF-8.
    pub fn as_str(&self) -> Option<&'a str> {
        match *self {
            Value::String(bytes) => std::str::from_utf8(bytes).ok(),
            _ => None,
        }
    }
}

/// An array value: `len` elements of one type, borrowed from the file.
/// Nested arrays are refused when the file is opened, so elements are
/// scalars or strings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Array<'a> {
    pub(crate) elem: ValueType,
    pub(crate) len: usize,
    /// The elements' bytes as stored (strings with their length prefixes).
    pub(crate) bytes: &'a [u8],
}

impl<'a> Array<'a> {
    /// The declared element type: elements are read at exactly this width.
    pub fn elem_type(&self) -> ValueType {
        self.elem
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements in order.
    pub fn iter(&self) -> ArrayIter<'a> {
        ArrayIter { elem: self.elem, left: self.len, bytes: self.bytes }
    }
}

/// The elements of an [`Array`], decoded one by one at their declared width.
pub struct ArrayIter<'a> {
    elem: ValueType,
    left: usize,
    bytes: &'a [u8],
}

impl<'a> Iterator for ArrayIter<'a> {
    type Item = Value<'a>;

    fn next(&mut self) -> Option<Value<'a>> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        // The file's check walked these bytes already: every length fits.
        let (value, rest) = decode_scalar(self.elem, self.bytes)?;
        self.bytes = rest;
        Some(value)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for ArrayIter<'_> {}

/// A scalar or string of type `ty` at the start of `bytes`, and the bytes
/// after it; `None` if `bytes` is too short (or `ty` is an array).
pub(crate) fn decode_scalar(ty: ValueType, bytes: &[u8]) -> Option<(Value<'_>, &[u8])> {
    fn take<const N: usize>(bytes: &[u8]) -> Option<([u8; N], &[u8])> {
        let (head, rest) = bytes.split_first_chunk::<N>()?;
        Some((*head, rest))
    }
    Some(match ty {
        ValueType::U8 => take::<1>(bytes).map(|(b, r)| (Value::U8(b[0]), r))?,
        ValueType::I8 => take::<1>(bytes).map(|(b, r)| (Value::I8(b[0] as i8), r))?,
        ValueType::Bool => take::<1>(bytes).map(|(b, r)| (Value::Bool(b[0] != 0), r))?,
        ValueType::U16 => take(bytes).map(|(b, r)| (Value::U16(u16::from_le_bytes(b)), r))?,
        ValueType::I16 => take(bytes).map(|(b, r)| (Value::I16(i16::from_le_bytes(b)), r))?,
        ValueType::U32 => take(bytes).map(|(b, r)| (Value::U32(u32::from_le_bytes(b)), r))?,
        ValueType::I32 => take(bytes).map(|(b, r)| (Value::I32(i32::from_le_bytes(b)), r))?,
        ValueType::F32 => take(bytes).map(|(b, r)| (Value::F32(f32::from_le_bytes(b)), r))?,
        ValueType::U64 => take(bytes).map(|(b, r)| (Value::U64(u64::from_le_bytes(b)), r))?,
        ValueType::I64 => take(bytes).map(|(b, r)| (Value::I64(i64::from_le_bytes(b)), r))?,
        ValueType::F64 => take(bytes).map(|(b, r)| (Value::F64(f64::from_le_bytes(b)), r))?,
        ValueType::String => {
            let (len, rest) = take::<8>(bytes)?;
            let len = usize::try_from(u64::from_le_bytes(len)).ok()?;
            if len > rest.len() {
                return None;
            }
            let (s, rest) = rest.split_at(len);
            (Value::String(s), rest)
        }
        ValueType::Array => return None,
    })
}
