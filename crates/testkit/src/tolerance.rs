//! Named tolerances: how far a result may be from what it is checked
//! against, one rule per kind of comparison ([`Tolerance`]), and one
//! comparison over many elements that reports the worst of them
//! ([`compare`], [`Comparison`]).
//!
//! The constants are the ones every test of the fused QKV op used to carry
//! its own copy of; each rule's formula is written out on its variant.

use std::fmt;

use half::{bf16, f16};
use kvjit_core::{DType, Tensor};

/// f32 accumulation error allowed per accumulated term, relative to the
/// scale of the products: 4 units of f32 roundoff (2^-24).
///
/// Two f32 sums of the same K products in different orders (the reference
/// left to right with separate multiply and add; a JIT or GPU kernel with
/// FMA, k-split partial sums or tiles) each stay within about
/// 2^-24·|partial sum| per step, well inside 4 units per term at the
/// largest product.
pub const F32_TOL_PER_K: f64 = 4.0 / (1u64 << 24) as f64;

/// Two bf16/f16 results rounded from f32 sums that are within the f32
/// tolerance of each other: this many spacings (ulps) of the destination
/// dtype at the result's magnitude on top of it (rounding to nearest moves
/// them at most one ulp further apart).
pub const ROUNDING_UNITS: f64 = 1.0;

/// A value stored as bf16/f16 against an exact (f64) value: this many unit
/// roundoffs of the dtype, relative to the value (1 = correctly rounded from
/// an accurate f32 sum).
pub const STORED_ROUNDOFF_UNITS: f64 = 1.0;

/// Half the spacing of f16 subnormals (2^-25): the absolute rounding error
/// below f16's normal range.
pub const F16_SUBNORMAL_HALF_STEP: f64 = 1.0 / (1u64 << 25) as f64;

/// The absolute floor of [`Tolerance::RelativeToTerms`] (so that two exact
/// zeros, whose bound is otherwise zero, compare within it).
pub const RELATIVE_FLOOR: f64 = 1e-30;

/// Half an ulp at 1.0 of a float dtype, relative: 2^-24 (f32), 2^-8
/// (bf16), 2^-11 (f16).
///
/// # Panics
///
/// For [`DType::U32`].
pub fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1.0 / (1u64 << 24) as f64,
        DType::BF16 => 1.0 / 256.0,
        DType::F16 => 1.0 / 2048.0,
        DType::F8E4M3 => 1.0 / 16.0,
        _ => panic!("unit_roundoff: float elements only, got {dtype}"),
    }
}

/// The largest finite value of a float dtype.
///
/// # Panics
///
/// For [`DType::U32`].
pub fn max_finite(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => f64::from(f32::MAX),
        DType::BF16 => bf16::MAX.to_f64(),
        DType::F16 => f16::MAX.to_f64(),
        DType::F8E4M3 => f64::from(kvjit_core::fp8::E4M3_MAX),
        _ => panic!("max_finite: float elements only, got {dtype}"),
    }
}

/// The spacing of `dtype` values at magnitude `|v|`: from `|v|` rounded to
/// `dtype` up to the next representable value. At and beyond the largest
/// finite value (infinities included) it is the last finite spacing, below
/// that value, never infinite.
///
/// # Panics
///
/// For [`DType::U32`].
pub fn ulp(dtype: DType, v: f64) -> f64 {
    let a = v.abs().min(max_finite(dtype));
    match dtype {
        DType::F32 => {
            let r = a as f32;
            if r == f32::MAX {
                f64::from(r) - f64::from(f32::from_bits(r.to_bits() - 1))
            } else {
                f64::from(f32::from_bits(r.to_bits() + 1)) - f64::from(r)
            }
        }
        DType::BF16 => {
            let r = bf16::from_f64(a);
            if r == bf16::MAX {
                r.to_f64() - bf16::from_bits(r.to_bits() - 1).to_f64()
            } else {
                bf16::from_bits(r.to_bits() + 1).to_f64() - r.to_f64()
            }
        }
        DType::F16 => {
            let r = f16::from_f64(a);
            if r == f16::MAX {
                r.to_f64() - f16::from_bits(r.to_bits() - 1).to_f64()
            } else {
                f16::from_bits(r.to_bits() + 1).to_f64() - r.to_f64()
            }
        }
        DType::F8E4M3 => {
            use kvjit_core::fp8::{e4m3_from_f32, e4m3_to_f32};
            let r = e4m3_from_f32(a as f32);
            if r == 0x7e {
                f64::from(e4m3_to_f32(r)) - f64::from(e4m3_to_f32(r - 1))
            } else {
                f64::from(e4m3_to_f32(r + 1)) - f64::from(e4m3_to_f32(r))
            }
        }
        _ => panic!("ulp: float elements only, got {dtype}"),
    }
}

/// How far a value `got` may be from the value `want` it is checked against.
///
/// Every rule treats non-finite values alike (see [`allows`](Self::allows)):
/// NaN only where NaN is expected, and an infinity only where the same
/// infinity is expected or where rounding to the rule's dtype may have
/// overflowed on one side only.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Tolerance {
    /// Bit for bit: exact arithmetic (dyadic inputs) or the same code path.
    Exact,
    /// `units` spacings of `dtype` at the larger magnitude of the two:
    /// `units · ulp(dtype, max(|got|, |want|))`.
    Ulps {
        /// The dtype whose spacing counts.
        dtype: DType,
        /// How many spacings.
        units: f64,
    },
    /// An absolute and a relative part: `abs + rel · |want|`.
    AbsRel {
        /// Absolute part.
        abs: f64,
        /// Relative to the expected value.
        rel: f64,
    },
    /// Two f32 accumulations of the same `k` products, in different orders,
    /// each then rounded to `dtype`, with `scale` bounding every product
    /// (`max|x| · max|w|` over the whole case):
    /// `F32_TOL_PER_K · k · scale`, plus [`ROUNDING_UNITS`] ulps of `dtype` at
    /// the larger magnitude unless `dtype` is f32. A kernel against the
    /// reference on the same inputs.
    RelativeToScale {
        /// The dtype both results are stored in.
        dtype: DType,
        /// Products per result (K).
        k: usize,
        /// `max|x| · max|w|`.
        scale: f64,
    },
    /// Two f32 accumulations of the same `k` products, each rounded once to
    /// `dtype`, with this element's own `abs_sum = Σ_k |x_k · w_k|`:
    /// `2 · unit_roundoff(dtype) · |want| + k · F32_TOL_PER_K · abs_sum +`
    /// [`RELATIVE_FLOOR`]. The CUDA kernel against the reference.
    RelativeToTerms {
        /// The dtype both results are stored in.
        dtype: DType,
        /// Products per result (K).
        k: usize,
        /// `Σ_k |x_k · w_k|` of this element.
        abs_sum: f64,
    },
    /// One f32 accumulation of `k` products, stored as `dtype`, against the
    /// exact (f64) sum `want`, with this element's `abs_sum = Σ_k |x_k·w_k|`:
    /// `F32_TOL_PER_K · k · abs_sum` for f32; for bf16/f16
    /// [`STORED_ROUNDOFF_UNITS`]` · unit_roundoff · |want| + (1 + unit_roundoff)
    /// · F32_TOL_PER_K · k · abs_sum`, plus [`F16_SUBNORMAL_HALF_STEP`] for f16.
    AgainstExact {
        /// The dtype the result is stored in.
        dtype: DType,
        /// Products per result (K).
        k: usize,
        /// `Σ_k |x_k · w_k|` of this element.
        abs_sum: f64,
    },
}

impl Tolerance {
    /// The rule's name, in a word.
    pub fn name(&self) -> &'static str {
        match self {
            Tolerance::Exact => "exact",
            Tolerance::Ulps { .. } => "ulps",
            Tolerance::AbsRel { .. } => "abs-rel",
            Tolerance::RelativeToScale { .. } => "relative-to-scale",
            Tolerance::RelativeToTerms { .. } => "relative-to-terms",
            Tolerance::AgainstExact { .. } => "against-exact",
        }
    }

    /// The dtype the rule rounds to, if it names one.
    pub fn dtype(&self) -> Option<DType> {
        match *self {
            Tolerance::Exact | Tolerance::AbsRel { .. } => None,
            Tolerance::Ulps { dtype, .. }
            | Tolerance::RelativeToScale { dtype, .. }
            | Tolerance::RelativeToTerms { dtype, .. }
            | Tolerance::AgainstExact { dtype, .. } => Some(dtype),
        }
    }

    /// The largest `|got − want|` the rule allows for this pair (0 for
    /// [`Exact`](Self::Exact)); see each variant for its formula.
    pub fn bound(&self, got: f64, want: f64) -> f64 {
        let larger = || got.abs().max(want.abs());
        match *self {
            Tolerance::Exact => 0.0,
            Tolerance::Ulps { dtype, units } => units * ulp(dtype, larger()),
            Tolerance::AbsRel { abs, rel } => abs + rel * want.abs(),
            Tolerance::RelativeToScale { dtype, k, scale } => {
                let accumulation = F32_TOL_PER_K * k as f64 * scale;
                match dtype {
                    DType::F32 => accumulation,
                    _ => accumulation + ROUNDING_UNITS * ulp(dtype, larger()),
                }
            }
            Tolerance::RelativeToTerms { dtype, k, abs_sum } => {
                2.0 * unit_roundoff(dtype) * want.abs() + k as f64 * F32_TOL_PER_K * abs_sum + RELATIVE_FLOOR
            }
            Tolerance::AgainstExact { dtype, k, abs_sum } => {
                let accumulation = F32_TOL_PER_K * k as f64 * abs_sum;
                let (roundoff, floor) = match dtype {
                    DType::F32 => return accumulation,
                    DType::BF16 => (unit_roundoff(dtype), 0.0),
                    DType::F16 => (unit_roundoff(dtype), F16_SUBNORMAL_HALF_STEP),
                    // Unscaled E4M3: subnormal steps of 2⁻⁹.
                    DType::F8E4M3 => (unit_roundoff(dtype), 1.0 / 1024.0),
                    _ => panic!("AgainstExact: float elements only, got {dtype}"),
                };
                STORED_ROUNDOFF_UNITS * roundoff * want.abs() + (1.0 + roundoff) * accumulation + floor
            }
        }
    }

    /// Whether `got` passes against `want`:
    ///
    /// - NaN on either side: only NaN on both;
    /// - [`Exact`](Self::Exact): the same bits;
    /// - an infinity on either side: the same infinity, or (for rules with a
    ///   dtype) the same sign with the finite side within the bound of the
    ///   dtype's largest finite value (one side's rounding overflowed);
    /// - otherwise `|got − want| ≤ bound(got, want)`.
    pub fn allows(&self, got: f64, want: f64) -> bool {
        if got.is_nan() || want.is_nan() {
            return got.is_nan() && want.is_nan();
        }
        if *self == Tolerance::Exact {
            return got.to_bits() == want.to_bits();
        }
        let bound = self.bound(got, want);
        if got.is_infinite() || want.is_infinite() {
            let finite = if want.is_infinite() { got } else { want };
            return got == want
                || (got.signum() == want.signum()
                    && self.dtype().is_some_and(|d| finite.abs() + bound >= max_finite(d)));
        }
        (got - want).abs() <= bound
    }
}

impl fmt::Display for Tolerance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Tolerance::Exact => write!(f, "exact"),
            Tolerance::Ulps { dtype, units } => write!(f, "ulps ({units} of {dtype})"),
            Tolerance::AbsRel { abs, rel } => write!(f, "abs-rel ({abs:e} + {rel:e}·|want|)"),
            Tolerance::RelativeToScale { dtype, k, scale } => {
                write!(f, "relative-to-scale ({dtype}, K = {k}, scale {scale:e})")
            }
            Tolerance::RelativeToTerms { dtype, k, abs_sum } => {
                write!(f, "relative-to-terms ({dtype}, K = {k}, Σ|x·w| = {abs_sum:e})")
            }
            Tolerance::AgainstExact { dtype, k, abs_sum } => {
                write!(f, "against-exact ({dtype}, K = {k}, Σ|x·w| = {abs_sum:e})")
            }
        }
    }
}

/// One compared element.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Element {
    /// Its index (as the caller numbers elements).
    pub index: usize,
    /// The value checked.
    pub got: f64,
    /// The value it is checked against.
    pub want: f64,
    /// `|got − want|` (0 for equal bits or two NaNs, infinite where one side
    /// is NaN or the infinities differ).
    pub error: f64,
    /// What the tolerance allows here.
    pub bound: f64,
    /// Whether the tolerance allows it.
    pub passed: bool,
}

impl Element {
    /// `error / bound` (infinite for a nonzero error against a zero bound).
    pub fn ratio(&self) -> f64 {
        if self.error == 0.0 {
            0.0
        } else if self.bound > 0.0 {
            self.error / self.bound
        } else {
            f64::INFINITY
        }
    }

    /// Failures first, then by [`ratio`](Self::ratio).
    fn worse_than(&self, other: &Element) -> bool {
        (!self.passed, self.ratio()) > (!other.passed, other.ratio())
    }
}

impl fmt::Display for Element {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[{}] = {} ({:#x}), want {} ({:#x}); error {:e}, allowed {:e}",
            self.index,
            self.got,
            self.got.to_bits(),
            self.want,
            self.want.to_bits(),
            self.error,
            self.bound
        )
    }
}

/// The result of comparing many elements under one tolerance: how many, how
/// many failed, the first failure and the worst element (failures first,
/// then the largest error relative to its bound).
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    /// The rule.
    pub tolerance: Tolerance,
    /// Elements compared.
    pub elements: usize,
    /// Elements the rule refused.
    pub failures: usize,
    /// The first refused element.
    pub first_failure: Option<Element>,
    /// The worst element.
    pub worst: Option<Element>,
}

impl Comparison {
    /// An empty comparison under `tolerance`, to [`push`](Self::push) into.
    pub fn new(tolerance: Tolerance) -> Self {
        Self { tolerance, elements: 0, failures: 0, first_failure: None, worst: None }
    }

    /// Compare one element; returns whether it passed.
    pub fn push(&mut self, index: usize, got: f64, want: f64) -> bool {
        let passed = self.tolerance.allows(got, want);
        let error = if got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()) {
            0.0
        } else {
            let e = (got - want).abs();
            if e.is_nan() { f64::INFINITY } else { e }
        };
        let element = Element { index, got, want, error, bound: self.tolerance.bound(got, want), passed };
        self.elements += 1;
        if !passed {
            self.failures += 1;
            self.first_failure.get_or_insert(element);
        }
        if self.worst.is_none_or(|w| element.worse_than(&w)) {
            self.worst = Some(element);
        }
        passed
    }

    /// Whether every element passed.
    pub fn is_ok(&self) -> bool {
        self.failures == 0
    }

    /// Panics, naming `what`, the rule, the first failure and the worst
    /// element, unless every element passed.
    pub fn assert_ok(&self, what: &str) {
        if !self.is_ok() {
            let first = self.first_failure.expect("a failure");
            panic!("{what}: {self}; first failure {first}");
        }
    }
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} elements, {} outside", self.tolerance, self.elements, self.failures)?;
        if let Some(worst) = &self.worst {
            write!(f, "; worst {worst}")?;
        }
        Ok(())
    }
}

/// Compare `got` with `want` element by element under `tolerance`.
///
/// # Panics
///
/// If the lengths differ.
pub fn compare(tolerance: Tolerance, got: &[f64], want: &[f64]) -> Comparison {
    assert_eq!(got.len(), want.len(), "compare: {} values against {}", got.len(), want.len());
    let mut comparison = Comparison::new(tolerance);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        comparison.push(i, g, w);
    }
    comparison
}

/// A float tensor's values, widened to f64 (exactly).
///
/// # Panics
///
/// For a u32 tensor.
pub fn to_f64(t: &Tensor) -> Vec<f64> {
    t.to_f32_vec().expect("a float tensor").into_iter().map(f64::from).collect()
}

/// [`compare`] two float tensors of one dtype and shape.
///
/// # Panics
///
/// If dtypes or shapes differ, or for u32 tensors.
pub fn compare_tensors(tolerance: Tolerance, got: &Tensor, want: &Tensor) -> Comparison {
    assert_eq!(got.dtype(), want.dtype(), "compare_tensors: dtypes");
    assert_eq!(got.shape(), want.shape(), "compare_tensors: shapes");
    compare(tolerance, &to_f64(got), &to_f64(want))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ulp_is_the_spacing_and_finite_at_the_top() {
        assert_eq!(ulp(DType::F32, 1.0), f64::from(f32::EPSILON));
        assert_eq!(ulp(DType::BF16, 1.0), 1.0 / 128.0);
        assert_eq!(ulp(DType::F16, 1.0), 1.0 / 1024.0);
        for dtype in DType::FLOATS {
            let top = ulp(dtype, max_finite(dtype));
            assert!(top.is_finite() && top > 0.0, "{dtype}: {top}");
            assert_eq!(ulp(dtype, f64::INFINITY), top, "{dtype}");
        }
    }

    #[test]
    fn non_finite_values_need_their_match() {
        let t = Tolerance::RelativeToScale { dtype: DType::BF16, k: 4, scale: 1.0 };
        assert!(t.allows(f64::NAN, f64::NAN));
        assert!(!t.allows(f64::NAN, 1.0) && !t.allows(1.0, f64::NAN));
        assert!(t.allows(f64::INFINITY, f64::INFINITY));
        assert!(!t.allows(f64::NEG_INFINITY, f64::INFINITY));
        // Overflow on one side only, from a value at the top of bf16's range.
        assert!(t.allows(f64::INFINITY, max_finite(DType::BF16)));
        // Never from a small one (the bound at the top is finite).
        assert!(!t.allows(f64::INFINITY, 1.0) && !t.allows(1.0, f64::INFINITY));
        assert!(!Tolerance::AbsRel { abs: 1.0, rel: 1.0 }.allows(f64::INFINITY, 1e300));
    }

    #[test]
    fn exact_means_the_same_bits() {
        assert!(Tolerance::Exact.allows(0.5, 0.5));
        assert!(!Tolerance::Exact.allows(-0.0, 0.0));
        assert!(!Tolerance::Exact.allows(1.0, 1.0 + f64::EPSILON));
    }

    #[test]
    fn the_formulas_are_the_documented_ones() {
        let k = 10;
        let scale = 0.5;
        let acc = F32_TOL_PER_K * k as f64 * scale;
        let f32_rule = Tolerance::RelativeToScale { dtype: DType::F32, k, scale };
        assert_eq!(f32_rule.bound(3.0, 3.0), acc);
        let bf16_rule = Tolerance::RelativeToScale { dtype: DType::BF16, k, scale };
        assert_eq!(bf16_rule.bound(3.0, 2.0), acc + ulp(DType::BF16, 3.0));
        let terms = Tolerance::RelativeToTerms { dtype: DType::F16, k, abs_sum: 2.0 };
        assert_eq!(terms.bound(0.0, -1.0), 2.0 / 2048.0 + k as f64 * F32_TOL_PER_K * 2.0 + RELATIVE_FLOOR);
        // A value of 1 after one product: bf16 may be off by 2^-8, f16 by
        // 2^-11 (plus the subnormal floor), f32 by 4·2^-24 only.
        let exact = |dtype| Tolerance::AgainstExact { dtype, k: 1, abs_sum: 1.0 }.bound(1.0, 1.0);
        assert!(exact(DType::F32) < 3e-7);
        assert!(exact(DType::F16) < 5e-4 && exact(DType::F16) > exact(DType::F32));
        assert!(exact(DType::BF16) < 4e-3 && exact(DType::BF16) > exact(DType::F16));
        assert_eq!(Tolerance::AbsRel { abs: 1e-4, rel: 1e-3 }.bound(0.0, -2.0), 1e-4 + 2e-3);
    }

    #[test]
    fn compare_reports_the_first_failure_and_the_worst_element() {
        let t = Tolerance::AbsRel { abs: 0.1, rel: 0.0 };
        let c = compare(t, &[1.0, 2.05, 3.5, 4.2, f64::NAN], &[1.0, 2.0, 3.0, 4.0, f64::NAN]);
        assert_eq!((c.elements, c.failures), (5, 2));
        assert_eq!(c.first_failure.unwrap().index, 2);
        assert_eq!(c.worst.unwrap().index, 2);
        assert!(!c.is_ok());
        let ok = compare(t, &[1.0, 2.05], &[1.0, 2.0]);
        assert!(ok.is_ok());
        assert_eq!(ok.worst.unwrap().index, 1);
        ok.assert_ok("within");
        let nan = compare(t, &[f64::NAN], &[0.0]);
        assert_eq!(nan.worst.unwrap().error, f64::INFINITY);
        assert!(std::panic::catch_unwind(|| c.assert_ok("outside")).is_err());
    }
}
