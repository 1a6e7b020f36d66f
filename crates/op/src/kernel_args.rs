//! [`kernel_args!`](crate::kernel_args): a JIT kernel's argument struct,
//! declared in one place with its `KernelArgs` impl.

/// Declare a JIT kernel's argument struct: `#[repr(C)]`, every field a
/// `u64` word (an address or a size), and its `kvjit_jit::KernelArgs`
/// impl. The emitter reads field `f` with
/// `params.field(b, offset_of!(Args, f))`; the launch fills it.
///
/// ```
/// kvjit_op::kernel_args! {
///     /// The arguments of a scaling kernel.
///     pub struct ScaleArgs {
///         /// Address of `x`.
///         x,
///         /// Elements of `x`.
///         elements,
///     }
/// }
/// let args = ScaleArgs { x: 0x1000, elements: 4 };
/// assert_eq!(std::mem::offset_of!(ScaleArgs, elements), 8);
/// assert_eq!(std::mem::size_of_val(&args), 16);
/// ```
#[macro_export]
macro_rules! kernel_args {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $( $(#[$field_meta:meta])* $field:ident ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[repr(C)]
        $vis struct $name {
            $( $(#[$field_meta])* pub $field: u64, )*
        }

        // SAFETY: `#[repr(C)]` with only u64 fields: any bit pattern is
        // valid, and the code reads each word at its `offset_of!`.
        unsafe impl $crate::jit_crate::KernelArgs for $name {}
    };
}
