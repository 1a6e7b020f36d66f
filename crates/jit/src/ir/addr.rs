//! Address arithmetic for emitters: the address of an indexed element
//! ([`element`], [`offset`]), the constant displacements of loads and
//! stores, checked ([`Displacements`]), and sizes a kernel either bakes in
//! or reads at run time ([`Size`]).

use cranelift_codegen::ir::{InstBuilder, Value, types};
use cranelift_frontend::FunctionBuilder;
use kvjit_core::KernelKey;

use crate::JitError;

/// The constant displacements one kernel's loads and stores use: all in
/// `0..=max` bytes, with `max` checked once, when the kernel is built, to
/// fit the signed 32-bit displacement Cranelift encodes. The emitter
/// converts each displacement with [`of`](Self::of), so none can wrap: a
/// kernel too large for its displacements is refused with
/// [`JitError::Unsupported`] before any code is emitted.
#[derive(Clone, Copy, Debug)]
pub struct Displacements {
    /// At most `i32::MAX`.
    max: usize,
}

impl Displacements {
    /// Displacements up to `max` bytes (`None`: computing the bound
    /// overflowed) for the kernel `key`, refused past `i32::MAX`.
    pub fn up_to(key: &KernelKey, max: Option<usize>) -> Result<Self, JitError> {
        match max {
            Some(max) if i32::try_from(max).is_ok() => Ok(Self { max }),
            Some(max) => Err(Self::refusal(key, format!("{max} bytes"))),
            None => Err(Self::refusal(key, "more bytes than a usize holds".into())),
        }
    }

    fn refusal(key: &KernelKey, reach: String) -> JitError {
        JitError::Unsupported {
            key: key.to_string(),
            reason: format!(
                "its loads and stores reach {reach} past an address, beyond the 2³¹ − 1 a displacement encodes"
            ),
        }
    }

    /// The largest displacement, in bytes.
    pub fn max(self) -> usize {
        self.max
    }

    /// `bytes` as the displacement of a load or store.
    ///
    /// # Panics
    /// When `bytes` exceeds the bound checked when the kernel was built: the
    /// emitter formed a displacement its kernel's bound does not cover (a
    /// bug in the emitter, stopped here rather than wrapped).
    #[track_caller]
    pub fn of(self, bytes: usize) -> i32 {
        match i32::try_from(bytes) {
            Ok(displacement) if bytes <= self.max => displacement,
            _ => {
                panic!("a displacement of {bytes} bytes, past the {} bytes checked when the kernel was built", self.max)
            }
        }
    }
}

/// `index · bytes` (`index` an `I64`): one shift when `bytes` is a power of
/// two, else one multiply by the constant.
///
/// # Panics
/// When `bytes` exceeds `i64::MAX` (kernels bound their sizes when built).
pub fn offset(b: &mut FunctionBuilder, index: Value, bytes: usize) -> Value {
    if bytes.is_power_of_two() {
        b.ins().ishl_imm_u(index, i64::from(bytes.trailing_zeros()))
    } else {
        b.ins().imul_imm_s(index, i64::try_from(bytes).expect("a stride past i64::MAX: kernels bound their sizes"))
    }
}

/// `base + index · bytes`: the address of element `index` of an array of
/// `bytes`-byte elements at `base` (see [`offset`]).
pub fn element(b: &mut FunctionBuilder, base: Value, index: Value, bytes: usize) -> Value {
    let at = offset(b, index, bytes);
    b.ins().iadd(base, at)
}

/// A size (an element count, a stride) the code either bakes in as a
/// constant or reads at run time (an `I64` value, typically an argument
/// word): one emitter then serves both a specialized kernel and a generic
/// one.
#[derive(Clone, Copy, Debug)]
pub enum Size {
    /// Baked into the code.
    Known(usize),
    /// Read at run time.
    Runtime(Value),
}

impl Size {
    /// `v · self · factor` (`v` an `I64`): one multiply by a constant when
    /// the size is known, else a multiply by the size (and one by `factor`
    /// first, unless it is 1).
    pub fn times(self, b: &mut FunctionBuilder, v: Value, factor: i64) -> Value {
        match self {
            Size::Known(n) => b.ins().imul_imm_s(v, n as i64 * factor),
            Size::Runtime(n) => {
                let scaled = if factor == 1 { n } else { b.ins().imul_imm_s(n, factor) };
                b.ins().imul(v, scaled)
            }
        }
    }

    /// The size as an `I64` value.
    pub fn value(self, b: &mut FunctionBuilder) -> Value {
        match self {
            Size::Known(n) => b.ins().iconst(types::I64, n as i64),
            Size::Runtime(n) => n,
        }
    }
}
