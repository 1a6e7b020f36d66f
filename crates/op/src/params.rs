//! Node parameters declared once: [`params!`](crate::params) writes an op's
//! parameter struct, its [`ParamSpec`] table, and the two conversions
//! to and from a graph file's [`Params`], from one list of typed fields.

use kvjit_core::DType;
use kvjit_graph::{Dim, GraphError, ParamKind, ParamSpec, ParamValue, Params};

/// A type a node parameter can have: what it accepts, and how it is read
/// from and written to a graph file's value.
pub trait Param: Sized {
    /// What the validator accepts for it.
    const KIND: ParamKind;
    /// Whether a node must give it (`Option<T>` is optional).
    const REQUIRED: bool = true;

    /// Read the value (`None`: the node does not give it).
    fn read(value: Option<&ParamValue>, name: &str) -> Result<Self, GraphError>;

    /// The value as a graph file spells it (`None`: write no entry).
    fn write(&self) -> Option<ParamValue>;
}

/// An enumeration spelled by name in graph files (a mask, a layout); its
/// [`Param`] impl accepts exactly [`NAMES`](Self::NAMES).
pub trait Choice: Sized + Copy {
    /// Every name it accepts.
    const NAMES: &'static [&'static str];
    /// The value a name stands for.
    fn from_name(name: &str) -> Option<Self>;
    /// Its name.
    fn name(self) -> &'static str;
}

fn wrong(name: &str, kind: ParamKind, value: Option<&ParamValue>) -> GraphError {
    let problem = match value {
        None => "is missing".to_string(),
        Some(value) => format!("must be {kind}, got {value:?}"),
    };
    GraphError::Param { param: name.to_string(), problem }
}

impl Param for usize {
    const KIND: ParamKind = ParamKind::SIZE;

    fn read(value: Option<&ParamValue>, name: &str) -> Result<Self, GraphError> {
        match value {
            Some(ParamValue::Int(v)) if *v > 0 && *v <= u64::from(u32::MAX) => Ok(*v as usize),
            other => Err(wrong(name, Self::KIND, other)),
        }
    }

    fn write(&self) -> Option<ParamValue> {
        Some(ParamValue::from(*self))
    }
}

impl Param for bool {
    const KIND: ParamKind = ParamKind::Bool;

    fn read(value: Option<&ParamValue>, name: &str) -> Result<Self, GraphError> {
        match value {
            Some(ParamValue::Bool(b)) => Ok(*b),
            other => Err(wrong(name, Self::KIND, other)),
        }
    }

    fn write(&self) -> Option<ParamValue> {
        Some(ParamValue::Bool(*self))
    }
}

impl Param for DType {
    const KIND: ParamKind = ParamKind::DType;

    fn read(value: Option<&ParamValue>, name: &str) -> Result<Self, GraphError> {
        match value {
            Some(ParamValue::Str(s)) => s
                .parse()
                .map_err(|e: kvjit_core::Error| GraphError::Param { param: name.to_string(), problem: e.to_string() }),
            other => Err(wrong(name, Self::KIND, other)),
        }
    }

    fn write(&self) -> Option<ParamValue> {
        Some(ParamValue::from(*self))
    }
}

/// A finite f32 (a softmax scale): numbers in `[-f32::MAX, f32::MAX]`.
impl Param for f32 {
    const KIND: ParamKind = ParamKind::Float { min: -(f32::MAX as f64), max: f32::MAX as f64 };

    fn read(value: Option<&ParamValue>, name: &str) -> Result<Self, GraphError> {
        let x = match value {
            Some(ParamValue::Float(x)) => *x,
            Some(ParamValue::Int(i)) => *i as f64,
            other => return Err(wrong(name, Self::KIND, other)),
        };
        let narrowed = x as f32;
        if narrowed.is_finite() { Ok(narrowed) } else { Err(wrong(name, Self::KIND, value)) }
    }

    fn write(&self) -> Option<ParamValue> {
        Some(ParamValue::Float(f64::from(*self)))
    }
}

impl Param for Vec<Dim> {
    const KIND: ParamKind = ParamKind::Dims;

    fn read(value: Option<&ParamValue>, name: &str) -> Result<Self, GraphError> {
        match value {
            Some(ParamValue::Dims(dims)) => Ok(dims.clone()),
            other => Err(wrong(name, Self::KIND, other)),
        }
    }

    fn write(&self) -> Option<ParamValue> {
        Some(ParamValue::Dims(self.clone()))
    }
}

impl<T: Choice> Param for T {
    const KIND: ParamKind = ParamKind::Choice(T::NAMES);

    fn read(value: Option<&ParamValue>, name: &str) -> Result<Self, GraphError> {
        match value {
            Some(ParamValue::Str(s)) => T::from_name(s).ok_or_else(|| wrong(name, Self::KIND, value)),
            other => Err(wrong(name, Self::KIND, other)),
        }
    }

    fn write(&self) -> Option<ParamValue> {
        Some(ParamValue::Str(self.name().to_string()))
    }
}

/// An optional parameter: absent is `None`, and `None` writes no entry.
impl<T: Param> Param for Option<T> {
    const KIND: ParamKind = T::KIND;
    const REQUIRED: bool = false;

    fn read(value: Option<&ParamValue>, name: &str) -> Result<Self, GraphError> {
        value.map(|v| T::read(Some(v), name)).transpose()
    }

    fn write(&self) -> Option<ParamValue> {
        self.as_ref().and_then(T::write)
    }
}

/// The [`ParamSpec`] of a field of type `T` named `name`.
pub const fn spec_of<T: Param>(name: &'static str) -> ParamSpec {
    ParamSpec { name, kind: T::KIND, required: T::REQUIRED }
}

/// An op's parameter struct, as [`params!`](crate::params) writes it.
pub trait OpParams: Sized + Send + Sync {
    /// What each parameter takes, in declaration order (the validator's table).
    const SPECS: &'static [ParamSpec];
    /// Read a node's parameters (the validator already checked kinds and
    /// ranges; this still refuses what it cannot read).
    fn read(params: &Params) -> Result<Self, GraphError>;
    /// The parameters as a graph file spells them.
    fn to_params(&self) -> Params;
}

/// Declare an op's parameters once: the struct (with public fields), its
/// [`OpParams`] impl (the [`ParamSpec`] table, reading and writing graph
/// file values). Field types are [`Param`]s: `usize` (a size), `bool`,
/// `DType`, `f32`, `Vec<Dim>`, a [`Choice`] enum, or `Option` of one
/// (optional, no entry when `None`).
///
/// ```
/// kvjit_op::params! {
///     /// The parameters of a scaling node.
///     #[derive(Clone, Copy, Debug, PartialEq)]
///     pub struct ScaleParams {
///         /// Element type.
///         dtype: kvjit_core::DType,
///         /// Factor, default 1.
///         factor: Option<f32>,
///     }
/// }
/// use kvjit_op::OpParams;
/// let p = ScaleParams { dtype: kvjit_core::DType::F32, factor: None };
/// assert_eq!(ScaleParams::read(&p.to_params()).unwrap(), p);
/// assert_eq!(ScaleParams::SPECS[1].name, "factor");
/// assert!(!ScaleParams::SPECS[1].required);
/// ```
#[macro_export]
macro_rules! params {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $( $(#[$field_meta:meta])* $field:ident : $ty:ty ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        $vis struct $name {
            $( $(#[$field_meta])* pub $field: $ty, )*
        }

        impl $name {
            /// The parameters as a graph file spells them.
            pub fn to_params(&self) -> $crate::graph::Params {
                <Self as $crate::OpParams>::to_params(self)
            }
        }

        impl $crate::OpParams for $name {
            const SPECS: &'static [$crate::graph::ParamSpec] =
                &[ $( $crate::param_spec::<$ty>(stringify!($field)) ),* ];

            fn read(params: &$crate::graph::Params) -> ::std::result::Result<Self, $crate::graph::GraphError> {
                Ok(Self { $( $field: <$ty as $crate::Param>::read(params.get(stringify!($field)), stringify!($field))?, )* })
            }

            fn to_params(&self) -> $crate::graph::Params {
                let mut params = $crate::graph::Params::new();
                $(
                    if let Some(value) = $crate::Param::write(&self.$field) {
                        params.insert(stringify!($field).to_string(), value);
                    }
                )*
                params
            }
        }
    };
}
