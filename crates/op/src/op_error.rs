//! [`op_error!`](crate::op_error): an op's own contract error as a
//! [`kvjit_core::Error`], declared in one line.

/// Make an op's error enum convertible into [`kvjit_core::Error::Op`]
/// (tagged with the op's name, downcast back with
/// `Error::op_error::<MyError>()`), so `?` and `.into()` carry it.
///
/// ```
/// #[derive(Debug)]
/// pub struct TooWide;
/// impl std::fmt::Display for TooWide {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         f.write_str("too wide")
///     }
/// }
/// impl std::error::Error for TooWide {}
/// kvjit_op::op_error!(TooWide, "mo.example");
/// let error: kvjit_core::Error = TooWide.into();
/// assert!(error.op_error::<TooWide>().is_some());
/// ```
#[macro_export]
macro_rules! op_error {
    ($error:ty, $op_name:expr) => {
        impl ::std::convert::From<$error> for $crate::core::Error {
            fn from(error: $error) -> Self {
                $crate::core::Error::op($op_name, error)
            }
        }
    };
}
