//! Comparing two sets of named tensors — e.g. the `--output` files of the
//! same `kvjit run` on two targets — within a named tolerance.
//!
//! Float tensors are compared by their **normalized max error**:
//! `max_i |a_i − b_i| / max_i |b_i|` (the largest difference relative to the
//! tensor's largest magnitude, so elements near zero, where a relative error
//! means nothing, do not dominate). NaN matches only NaN. Integer tensors
//! (cache lengths, page tables) must be equal. A tensor in one set only, or
//! of another dtype or shape, is a mismatch.

use std::collections::BTreeMap;

use kvjit_core::{DType, Tensor, TensorData};

/// How far two float tensors may differ, as a normalized max error per
/// stored dtype (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    /// For f32 tensors.
    pub f32: f64,
    /// For bf16 tensors.
    pub bf16: f64,
    /// For f16 tensors.
    pub f16: f64,
    /// For FP8 cache codes (compared as their unscaled values).
    pub f8e4m3: f64,
}

impl Default for Tolerance {
    /// Two correct kernels that sum the same products in different orders:
    /// f32 `1e-4` (the f32 roundoff of a K = 4096 dot product is ~1e-5 of its
    /// largest value); bf16 `2⁻⁶` and f16 `2⁻⁹` (four half-ulps of the stored
    /// dtype: one rounding apart, plus the sums' own error). A wrong
    /// element — a missed column, a stale page slot — is off by the order of
    /// the values themselves, far beyond any of these. FP8 codes `2⁻³`: one
    /// E4M3 step (at most 32 at 448), as codes of a block quantized from
    /// sums a rounding apart may be.
    fn default() -> Self {
        Self { f32: 1e-4, bf16: 1.0 / 64.0, f16: 1.0 / 512.0, f8e4m3: 1.0 / 8.0 }
    }
}

impl Tolerance {
    /// Every dtype's tolerance set to `value`.
    pub fn uniform(value: f64) -> Self {
        Self { f32: value, bf16: value, f16: value, f8e4m3: value }
    }

    /// The tolerance for tensors stored as `dtype` (0 for integers and
    /// weight blocks: their bytes compare exactly).
    pub fn for_dtype(&self, dtype: DType) -> f64 {
        match dtype {
            DType::F32 => self.f32,
            DType::BF16 => self.bf16,
            DType::F16 => self.f16,
            DType::F8E4M3 => self.f8e4m3,
            // U32 and the weight block formats.
            _ => 0.0,
        }
    }
}

/// How one named tensor compared.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorComparison {
    /// The tensor's name.
    pub name: String,
    /// `dtype[shape]` of the first set's tensor (or `-` when absent).
    pub ty: String,
    /// Largest absolute difference (infinite for NaN against a number or a
    /// dtype/shape/presence mismatch).
    pub max_error: f64,
    /// `max_error / max |b|` (equal to `max_error` when `b` is all zero).
    pub normalized_error: f64,
    /// Flat index of the element with the largest difference.
    pub worst_element: Option<usize>,
    /// The tolerance it was held to.
    pub tolerance: f64,
    /// Why it cannot be compared element by element, if so.
    pub problem: Option<String>,
}

impl TensorComparison {
    /// Within tolerance.
    pub fn matches(&self) -> bool {
        self.problem.is_none() && self.normalized_error <= self.tolerance
    }
}

impl std::fmt::Display for TensorComparison {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tensor '{}' ({})", self.name.escape_debug(), self.ty)?;
        if let Some(problem) = &self.problem {
            return write!(f, ": {problem}");
        }
        write!(f, ": max error {:.3e} (normalized {:.3e}", self.max_error, self.normalized_error)?;
        if let Some(i) = self.worst_element.filter(|_| self.max_error > 0.0) {
            write!(f, ", at element {i}")?;
        }
        write!(f, "; tolerance {:.1e})", self.tolerance)
    }
}

fn type_of(t: &Tensor) -> String {
    format!("{}{:?}", t.dtype(), t.shape())
}

/// Compare two tensors of one name.
pub fn compare_tensors(name: &str, a: &Tensor, b: &Tensor, tolerance: &Tolerance) -> TensorComparison {
    let mut result = TensorComparison {
        name: name.to_string(),
        ty: type_of(a),
        max_error: f64::INFINITY,
        normalized_error: f64::INFINITY,
        worst_element: None,
        tolerance: tolerance.for_dtype(a.dtype()),
        problem: None,
    };
    if a.dtype() != b.dtype() || a.shape() != b.shape() {
        result.problem = Some(format!("the other is {}", type_of(b)));
        return result;
    }
    let (mut max_error, mut worst, mut scale) = (0.0f64, None, 0.0f64);
    let mut visit = |i: usize, x: f64, y: f64| {
        let error = match (x.is_nan(), y.is_nan()) {
            (true, true) => 0.0,
            (false, false) if x == y => 0.0, // also equal infinities
            (false, false) => (x - y).abs(),
            _ => f64::INFINITY,
        };
        if error > max_error || (error.is_nan() && !max_error.is_nan()) {
            (max_error, worst) = (error, Some(i));
        }
        if y.is_finite() {
            scale = scale.max(y.abs());
        }
    };
    if let Err(problem) = for_each_pair(a, b, &mut visit) {
        result.problem = Some(problem);
        return result;
    }
    result.max_error = max_error;
    result.normalized_error = if scale > 0.0 { max_error / scale } else { max_error };
    result.worst_element = worst;
    result
}

/// Elements of a block format dequantized at a time: the comparison holds
/// two such chunks of f32, never a whole tensor's values (converting whole
/// tensors, a 1 GiB bf16 file took 4 GiB a side); the other dtypes are
/// read in place.
const CHUNK: usize = 1 << 16;

/// Call `visit(i, a_i, b_i)` for every element of two tensors of one dtype
/// and shape, in row-major order: read in place, or a block format's
/// dequantized [`CHUNK`] (whole blocks) at a time. Tensors that are not contiguous
/// (views made in this process; files hold none) are converted whole.
fn for_each_pair(a: &Tensor, b: &Tensor, visit: &mut impl FnMut(usize, f64, f64)) -> Result<(), String> {
    if !a.is_contiguous() || !b.is_contiguous() {
        let (x, y) = match a.dtype() {
            DType::U32 => (
                a.to_u32_vec().map(|v| v.into_iter().map(f64::from).collect::<Vec<_>>()),
                b.to_u32_vec().map(|v| v.into_iter().map(f64::from).collect::<Vec<_>>()),
            ),
            _ => (
                a.to_f32_vec().map(|v| v.into_iter().map(f64::from).collect::<Vec<_>>()),
                b.to_f32_vec().map(|v| v.into_iter().map(f64::from).collect::<Vec<_>>()),
            ),
        };
        let (x, y) = (x.map_err(|e| e.to_string())?, y.map_err(|e| e.to_string())?);
        x.iter().zip(&y).enumerate().for_each(|(i, (&x, &y))| visit(i, x, y));
        return Ok(());
    }
    fn pairs<T: Copy>(a: &[T], b: &[T], to_f64: impl Fn(T) -> f64, visit: &mut impl FnMut(usize, f64, f64)) {
        a.iter().zip(b).enumerate().for_each(|(i, (&x, &y))| visit(i, to_f64(x), to_f64(y)));
    }
    match (a.data(), b.data()) {
        (TensorData::F32(x), TensorData::F32(y)) => pairs(x, y, f64::from, visit),
        (TensorData::BF16(x), TensorData::BF16(y)) => pairs(x, y, |v| f64::from(v.to_f32()), visit),
        (TensorData::F16(x), TensorData::F16(y)) => pairs(x, y, |v| f64::from(v.to_f32()), visit),
        (TensorData::F8E4M3(x), TensorData::F8E4M3(y)) => pairs(x, y, |v| f64::from(v.to_f32()), visit),
        (TensorData::U32(x), TensorData::U32(y)) => pairs(x, y, f64::from, visit),
        (TensorData::Blocks(format, x), TensorData::Blocks(_, y)) => {
            let (block, size) = format.block();
            let blocks_per_chunk = (CHUNK / block).max(1);
            let (mut wa, mut wb) = (vec![0f32; blocks_per_chunk * block], vec![0f32; blocks_per_chunk * block]);
            for (c, (x, y)) in x.chunks(blocks_per_chunk * size).zip(y.chunks(blocks_per_chunk * size)).enumerate() {
                let n = x.len() / size * block;
                kvjit_core::quant::dequantize(format, x, &mut wa[..n]).map_err(|e| e.to_string())?;
                kvjit_core::quant::dequantize(format, y, &mut wb[..n]).map_err(|e| e.to_string())?;
                let first = c * blocks_per_chunk * block;
                wa[..n].iter().zip(&wb[..n]).enumerate().for_each(|(i, (&x, &y))| {
                    visit(first + i, f64::from(x), f64::from(y));
                });
            }
        }
        _ => return Err(format!("the two are stored differently ({} and {})", a.dtype(), b.dtype())),
    }
    Ok(())
}

/// Compare every tensor of `a` with the same name in `b` (and report names
/// found in only one of them), in name order.
pub fn compare_sets(
    a: &BTreeMap<String, Tensor>,
    b: &BTreeMap<String, Tensor>,
    tolerance: &Tolerance,
) -> Vec<TensorComparison> {
    let missing = |name: &str, ty: String, which: &str| TensorComparison {
        name: name.to_string(),
        ty,
        max_error: f64::INFINITY,
        normalized_error: f64::INFINITY,
        worst_element: None,
        tolerance: 0.0,
        problem: Some(format!("only in the {which} set")),
    };
    let mut results: Vec<TensorComparison> = a
        .iter()
        .map(|(name, ta)| match b.get(name) {
            Some(tb) => compare_tensors(name, ta, tb, tolerance),
            None => missing(name, type_of(ta), "first"),
        })
        .collect();
    results.extend(b.iter().filter(|(n, _)| !a.contains_key(*n)).map(|(n, t)| missing(n, type_of(t), "second")));
    results.sort_by(|x, y| x.name.cmp(&y.name));
    results
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(values: &[f32]) -> Tensor {
        Tensor::from_f32(DType::F32, &[values.len()], values).unwrap()
    }

    #[test]
    fn differences_are_normalized_by_the_largest_magnitude() {
        let t = Tolerance::default();
        let c = compare_tensors("x", &f32s(&[10.0, 0.01, -4.0]), &f32s(&[10.0005, 0.0, -4.0]), &t);
        assert!((c.max_error - 0.01).abs() < 1e-7, "{c}");
        assert!((c.normalized_error - 0.01 / 10.0005).abs() < 1e-7, "{c}");
        assert_eq!(c.worst_element, Some(1));
        assert!(!c.matches(), "1e-4 of the scale is the f32 tolerance: {c}");
        assert!(compare_tensors("x", &f32s(&[10.0, 0.0001]), &f32s(&[10.0, 0.0]), &t).matches());
    }

    #[test]
    fn nan_matches_only_nan_and_integers_must_be_equal() {
        let t = Tolerance::uniform(0.5);
        assert!(compare_tensors("x", &f32s(&[f32::NAN, 1.0]), &f32s(&[f32::NAN, 1.0]), &t).matches());
        let c = compare_tensors("x", &f32s(&[f32::NAN, 1.0]), &f32s(&[0.0, 1.0]), &t);
        assert!(!c.matches() && c.max_error.is_infinite() && c.worst_element == Some(0), "{c}");
        let u = |v: Vec<u32>| Tensor::from_vec(&[v.len()], v).unwrap();
        assert!(compare_tensors("l", &u(vec![1, 2]), &u(vec![1, 2]), &t).matches());
        assert!(!compare_tensors("l", &u(vec![1, 2]), &u(vec![1, 3]), &t).matches(), "integers are exact");
    }

    #[test]
    fn fp8_codes_may_differ_by_one_step_not_two() {
        let t = Tolerance::default();
        let codes =
            |v: &[u8]| Tensor::from_vec(&[v.len()], v.iter().map(|&c| kvjit_core::F8E4M3(c)).collect()).unwrap();
        // 448 vs 416 (one step at the top, 32/448 of the scale) passes; 448
        // vs 384 (two steps) and -448 do not.
        assert!(compare_tensors("c", &codes(&[0x7e, 0x30]), &codes(&[0x7d, 0x30]), &t).matches());
        assert!(!compare_tensors("c", &codes(&[0x7e, 0x30]), &codes(&[0x7c, 0x30]), &t).matches());
        assert!(!compare_tensors("c", &codes(&[0x7e, 0x30]), &codes(&[0xfe, 0x30]), &t).matches());
    }

    #[test]
    fn other_types_and_missing_names_are_mismatches() {
        let t = Tolerance::default();
        let c = compare_tensors("x", &f32s(&[1.0]), &f32s(&[1.0, 2.0]), &t);
        assert_eq!(c.to_string(), "tensor 'x' (f32[1]): the other is f32[2]");
        let a = BTreeMap::from([("q".to_string(), f32s(&[1.0])), ("only_a".to_string(), f32s(&[1.0]))]);
        let b = BTreeMap::from([("q".to_string(), f32s(&[1.0])), ("only_b".to_string(), f32s(&[1.0]))]);
        let results = compare_sets(&a, &b, &t);
        let names: Vec<(&str, bool)> = results.iter().map(|c| (c.name.as_str(), c.matches())).collect();
        assert_eq!(names, [("only_a", false), ("only_b", false), ("q", true)]);
        assert_eq!(results[1].to_string(), "tensor 'only_b' (f32[1]): only in the second set");
    }

    /// Q8_0 blocks (an f16 scale, 32 i8) compared chunk by chunk: the one
    /// differing quant, in the last partial chunk, is found at its flat
    /// index with its dequantized difference.
    #[test]
    fn block_tensors_compare_across_chunks() {
        let blocks = CHUNK / 32 * 2 + 3;
        let mut bytes = Vec::new();
        for b in 0..blocks {
            bytes.extend_from_slice(&0x3800u16.to_le_bytes()); // f16 0.5
            bytes.extend((0..32).map(|j| ((b * 7 + j * 3) % 200) as u8 ^ 0x55));
        }
        let a = Tensor::from_le_bytes(DType::Q8_0, &[blocks * 32], &bytes).unwrap();
        let (block, byte) = (blocks - 2, 9);
        let mut changed = bytes.clone();
        changed[block * 34 + 2 + byte] = changed[block * 34 + 2 + byte].wrapping_add(3);
        let b = Tensor::from_le_bytes(DType::Q8_0, &[blocks * 32], &changed).unwrap();
        let t = Tolerance::default();
        assert!(compare_tensors("w", &a, &a, &t).matches());
        let c = compare_tensors("w", &a, &b, &t);
        assert_eq!(c.worst_element, Some(block * 32 + byte), "{c}");
        assert_eq!(c.max_error, 1.5, "{c}");
        assert!(!c.matches());
    }

    /// A permuted (strided) view compares in its logical order.
    #[test]
    fn strided_views_compare_in_logical_order() {
        let a = Tensor::from_f32(DType::F32, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let at = a.permuted(&[1, 0]).unwrap();
        let b = Tensor::from_f32(DType::F32, &[3, 2], &[1.0, 4.0, 2.0, 5.0, 3.0, 7.0]).unwrap();
        let c = compare_tensors("t", &at, &b, &Tolerance::default());
        assert_eq!((c.worst_element, c.max_error), (Some(5), 1.0), "{c}");
    }
}
