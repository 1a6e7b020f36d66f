//! The dtype checks of a paged step's tensors, for an op's spec-less
//! functions (its reference), which have no [`CallContract`](crate::CallContract)
//! to declare them.

use kvjit_core::{DType, Error, Result, Tensor, expect_arg};

/// Check a step's tensors as a kernel's signature would: `primary` (named
/// `name` in errors) a contiguous compute-float tensor, `layer_idx` and
/// `valid_lengths` contiguous u32. Returns the primary's dtype, the call's
/// compute dtype.
pub fn expect_float_step(name: &str, primary: &Tensor, layer_idx: &Tensor, valid_lengths: &Tensor) -> Result<DType> {
    let dtype = primary.dtype();
    if !dtype.is_compute_float() {
        return Err(Error::NotFloat { what: name.into(), dtype });
    }
    expect_arg(name, primary, dtype)?;
    expect_arg("layer_idx", layer_idx, DType::U32)?;
    expect_arg("valid_lengths", valid_lengths, DType::U32)?;
    Ok(dtype)
}
