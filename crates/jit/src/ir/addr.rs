//! Address arithmetic for emitters: the address of an indexed element
//! ([`element`], [`offset`]), and sizes a kernel either bakes in or reads
//! at run time ([`Size`]).

use cranelift_codegen::ir::{InstBuilder, Value, types};
use cranelift_frontend::FunctionBuilder;

/// `index · bytes` (`index` an `I64`): one shift when `bytes` is a power of
/// two, else one multiply by the constant.
pub fn offset(b: &mut FunctionBuilder, index: Value, bytes: i64) -> Value {
    if bytes > 0 && bytes.count_ones() == 1 {
        b.ins().ishl_imm_u(index, i64::from(bytes.trailing_zeros()))
    } else {
        b.ins().imul_imm_s(index, bytes)
    }
}

/// `base + index · bytes`: the address of element `index` of an array of
/// `bytes`-byte elements at `base` (see [`offset`]).
pub fn element(b: &mut FunctionBuilder, base: Value, index: Value, bytes: i64) -> Value {
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
