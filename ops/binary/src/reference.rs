//! The reference: the operation on every pair of elements in f64 ([`apply`]),
//! rounded once to the dtype ([`kvjit_op::store_f64`]). The JIT is tested
//! against it.

use crate::BinaryOperation;

/// `operation(a[i], b[i])` for every `i`, in f64 (exact for a product of
/// two f32s; a sum is rounded to f64 first, which rounding it to f32 then
/// does not change: 53 bits ≥ 2·24 + 2).
pub fn apply(operation: BinaryOperation, a: &[f32], b: &[f32]) -> Vec<f64> {
    a.iter().zip(b).map(|(&a, &b)| operation.apply(f64::from(a), f64::from(b))).collect()
}

/// The reference kernel of a spec.
pub type ReferenceKernel = kvjit_op::Reference<crate::BinarySpec>;
