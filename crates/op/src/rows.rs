//! Row-wise inputs `[..., H]` (RMSNorm's `x`, a matmul's `a`): the row
//! width H a kernel bakes in (static, ≥ 1), the row count when every
//! leading dim is static, and a call's tensor checked against both.

use kvjit_core::{Error, KernelSpec, Result, Tensor};
use kvjit_graph::{GraphError, TensorType, ValueType, input_error, tensor_input};

/// The rows of a `[..., H]` tensor as a kernel bakes them: width H, and
/// the row count (the product of the leading dims) when it is static.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rows {
    /// Elements per row, H (the last dim).
    pub width: usize,
    /// Rows, if every leading dim is static (`None`: taken from each call).
    pub rows: Option<usize>,
}

/// Input `i` (named `arg`) as an f32, bf16 or f16 tensor `[..., H]` of
/// rank ≥ 1 with H static and ≥ 1, and its [`Rows`]; refused with one line
/// naming `arg` otherwise (also when the row count overflows a usize).
pub fn input<'a>(inputs: &[&'a ValueType], i: usize, arg: &str) -> Result<(&'a TensorType, Rows), GraphError> {
    let ty = tensor_input(inputs, i);
    let refuse = |why: &str| input_error(arg, format!("an f32, bf16 or f16 tensor [..., H] {why}"), ty);
    if !ty.dtype.is_compute_float() {
        return Err(refuse("(a float dtype)"));
    }
    let Some((last, leading)) = ty.shape.split_last() else { return Err(refuse("of rank ≥ 1")) };
    let width = match last.as_static() {
        Some(h) if h >= 1 => h,
        _ => return Err(refuse("with H static and ≥ 1")),
    };
    let rows = match leading.iter().map(|d| d.as_static()).collect::<Option<Vec<usize>>>() {
        None => None,
        Some(dims) => {
            let rows = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
            let fits = rows.and_then(|r| r.checked_mul(width)).is_some();
            if !fits {
                return Err(refuse("of at most usize::MAX elements"));
            }
            rows
        }
    };
    Ok((ty, Rows { width, rows }))
}

/// Check a call's `tensor` (named `arg`) against the rows `spec` baked in:
/// rank ≥ 1, last dim H, and the baked row count if there is one
/// ([`Error::NotBuiltFor`], naming the key). Returns its row count.
pub fn expect_rows(arg: &'static str, tensor: &Tensor, baked: Rows, spec: &impl KernelSpec) -> Result<usize> {
    let shape = tensor.shape();
    let rows = match shape.split_last() {
        Some((&width, leading)) if width == baked.width => leading.iter().product::<usize>(),
        _ => usize::MAX,
    };
    if rows == usize::MAX || baked.rows.is_some_and(|r| r != rows) {
        let rows = baked.rows.map_or("any number of".to_string(), |r| r.to_string());
        return Err(Error::NotBuiltFor {
            arg,
            expected: format!("[..., {}] with {rows} rows (baked into {})", baked.width, spec.key()),
            got: shape.to_vec(),
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use kvjit_core::{DType, KernelKey, Target};
    use kvjit_graph::Dim;

    use super::*;

    #[derive(Clone, Debug)]
    struct Spec;

    impl KernelSpec for Spec {
        fn key_name(&self) -> KernelKey {
            KernelKey::new("test", Target::Cpu, DType::F32)
        }
    }

    fn ty(dtype: DType, shape: Vec<Dim>) -> ValueType {
        ValueType::Tensor(TensorType::new(dtype, shape))
    }

    #[test]
    fn widths_rows_and_refusals() {
        let static_x = ty(DType::BF16, vec![Dim::Static(2), Dim::Static(3), Dim::Static(8)]);
        assert_eq!(input(&[&static_x], 0, "x").unwrap().1, Rows { width: 8, rows: Some(6) });
        let symbolic = ty(DType::F32, vec![Dim::from("batch"), Dim::Static(8)]);
        assert_eq!(input(&[&symbolic], 0, "x").unwrap().1, Rows { width: 8, rows: None });
        assert_eq!(input(&[&ty(DType::F16, vec![Dim::Static(5)])], 0, "x").unwrap().1.rows, Some(1));
        for (bad, why) in [
            (ty(DType::U32, vec![Dim::Static(8)]), "a float dtype"),
            (ty(DType::F32, vec![]), "rank ≥ 1"),
            (ty(DType::F32, vec![Dim::Static(2), Dim::from("h")]), "H static"),
            (ty(DType::F32, vec![Dim::Static(0)]), "H static and ≥ 1"),
            (ty(DType::F32, vec![Dim::Static(usize::MAX), Dim::Static(2)]), "usize::MAX"),
        ] {
            let err = input(&[&bad], 0, "x").unwrap_err().to_string();
            assert!(err.contains(why) && err.contains("x"), "{err}");
        }

        let t = Tensor::zeros(DType::F32, &[2, 3, 8]).unwrap();
        assert_eq!(expect_rows("x", &t, Rows { width: 8, rows: Some(6) }, &Spec).unwrap(), 6);
        assert_eq!(expect_rows("x", &t, Rows { width: 8, rows: None }, &Spec).unwrap(), 6);
        let err = expect_rows("x", &t, Rows { width: 8, rows: Some(5) }, &Spec).unwrap_err().to_string();
        assert!(err.contains("[..., 8] with 5 rows (baked into test.cpu.f32)") && err.contains("[2, 3, 8]"), "{err}");
        assert!(expect_rows("x", &t, Rows { width: 4, rows: None }, &Spec).is_err());
        let scalar = Tensor::zeros(DType::F32, &[]).unwrap();
        assert!(expect_rows("x", &scalar, Rows { width: 1, rows: None }, &Spec).is_err());
    }
}
