//! The reference: [`silu`] of every element in f64, rounded once to the
//! dtype ([`kvjit_op::store_f64`]). The JIT is tested against it.

/// `x / (1 + e^−x)`, and its limit −0 at `x = −∞` (where the formula
/// gives NaN); `+∞` gives `+∞`, NaN gives NaN.
pub fn silu(x: f64) -> f64 {
    if x == f64::NEG_INFINITY { -0.0 } else { x / (1.0 + (-x).exp()) }
}

/// The reference kernel of a spec.
pub type ReferenceKernel = kvjit_op::Reference<crate::SiluSpec>;
