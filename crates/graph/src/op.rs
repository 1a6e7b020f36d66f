//! The op interface and the registry that lists ops by name.
//!
//! An op's IR-level definition — name, parameters, signature, shape rules,
//! kernel key — is an [`OpDef`]. Kernels are not part of it: they live with
//! the op in its `ops/` crate and are reached by the compile step, so this
//! crate never depends on a backend.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvjit_core::{Backend, DType, KernelKey};
use serde::{Deserialize, Serialize};

use crate::{ConstantInit, Dim, GraphError, RandomInit, Recipe, RecipeKind, Result, TensorType, ValueType};

/// A node parameter value as graph files spell it: `true`, `16`, `0.125`,
/// `"bf16"`, `[4, "seq", 32, 128]`.
///
/// Which values a parameter accepts is the op's [`ParamSpec`]; the validator
/// checks every node's parameters against its op's specs before the op sees
/// them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ParamValue {
    /// A flag.
    Bool(bool),
    /// A non-negative integer (sizes, counts).
    Int(u64),
    /// A number with a fraction or a sign (a softmax scale, a RoPE base).
    Float(f64),
    /// A name (dtypes and other enumerations).
    Str(String),
    /// A list of dims: sizes or graph symbols (a reshape's target shape).
    Dims(Vec<Dim>),
}

impl std::fmt::Display for ParamValue {
    /// The value as a graph file spells it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ParamValue::Bool(b) => write!(f, "{b}"),
            ParamValue::Int(i) => write!(f, "{i}"),
            ParamValue::Float(x) => write!(f, "{x:?}"),
            ParamValue::Str(s) => write!(f, "{s}"),
            ParamValue::Dims(dims) => {
                let dims: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
                write!(f, "[{}]", dims.join(", "))
            }
        }
    }
}

impl From<usize> for ParamValue {
    fn from(v: usize) -> Self {
        ParamValue::Int(v as u64)
    }
}

impl From<bool> for ParamValue {
    fn from(b: bool) -> Self {
        ParamValue::Bool(b)
    }
}

impl From<f64> for ParamValue {
    fn from(x: f64) -> Self {
        ParamValue::Float(x)
    }
}

impl From<&str> for ParamValue {
    fn from(s: &str) -> Self {
        ParamValue::Str(s.to_string())
    }
}

impl From<DType> for ParamValue {
    fn from(d: DType) -> Self {
        ParamValue::Str(d.name().to_string())
    }
}

impl From<Vec<Dim>> for ParamValue {
    fn from(dims: Vec<Dim>) -> Self {
        ParamValue::Dims(dims)
    }
}

/// A node's parameters, by name.
pub type Params = BTreeMap<String, ParamValue>;

/// What a parameter takes, and in what range.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ParamKind {
    /// An integer in `min..=max`.
    Int {
        /// Smallest value.
        min: u64,
        /// Largest value.
        max: u64,
    },
    /// A finite number in `min..=max` (integers are accepted as numbers).
    Float {
        /// Smallest value.
        min: f64,
        /// Largest value.
        max: f64,
    },
    /// `true` or `false`.
    Bool,
    /// A dtype name (its op says which dtypes it serves).
    DType,
    /// One of these names.
    Choice(&'static [&'static str]),
    /// A list of dims: sizes ≥ 1 or symbol names.
    Dims,
}

impl ParamKind {
    /// A size or count: an integer in 1..=u32::MAX.
    pub const SIZE: ParamKind = ParamKind::Int { min: 1, max: u32::MAX as u64 };

    /// Why `value` is not of this kind, if it is not.
    pub fn check(&self, value: &ParamValue) -> std::result::Result<(), String> {
        let ok = match (self, value) {
            (ParamKind::Int { min, max }, ParamValue::Int(v)) => (min..=max).contains(&v),
            (ParamKind::Float { min, max }, ParamValue::Float(v)) => v.is_finite() && (min..=max).contains(&v),
            (ParamKind::Float { min, max }, ParamValue::Int(v)) => (min..=max).contains(&&(*v as f64)),
            (ParamKind::Bool, ParamValue::Bool(_)) => true,
            (ParamKind::DType, ParamValue::Str(s)) => {
                return s.parse::<DType>().map(|_| ()).map_err(|e| e.to_string());
            }
            (ParamKind::Choice(names), ParamValue::Str(s)) => names.contains(&s.as_str()),
            (ParamKind::Dims, ParamValue::Dims(dims)) => dims.iter().all(|d| d.as_static() != Some(0)),
            _ => false,
        };
        if ok { Ok(()) } else { Err(format!("must be {self}, got {value:?}")) }
    }
}

impl std::fmt::Display for ParamKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ParamKind::Int { min, max } => write!(f, "an integer in {min}..={max}"),
            ParamKind::Float { min, max } => write!(f, "a finite number in [{min:?}, {max:?}]"),
            ParamKind::Bool => write!(f, "true or false"),
            ParamKind::DType => write!(f, "a dtype name"),
            ParamKind::Choice(names) => write!(f, "one of {}", names.join(", ")),
            ParamKind::Dims => write!(f, "a list of dims (sizes >= 1 or symbol names)"),
        }
    }
}

/// One parameter an op takes.
#[derive(Clone, Copy, Debug)]
pub struct ParamSpec {
    /// Its name in graph files.
    pub name: &'static str,
    /// What it takes.
    pub kind: ParamKind,
    /// Whether a node must give it (optional ones have a documented default).
    pub required: bool,
}

impl ParamSpec {
    /// A required parameter.
    pub const fn required(name: &'static str, kind: ParamKind) -> Self {
        Self { name, kind, required: true }
    }

    /// An optional parameter.
    pub const fn optional(name: &'static str, kind: ParamKind) -> Self {
        Self { name, kind, required: false }
    }
}

fn param<'p>(params: &'p Params, name: &str) -> Result<&'p ParamValue> {
    params.get(name).ok_or_else(|| GraphError::Param { param: name.to_string(), problem: "is missing".into() })
}

fn wrong(name: &str, kind: ParamKind, value: &ParamValue) -> GraphError {
    GraphError::Param { param: name.to_string(), problem: format!("must be {kind}, got {value:?}") }
}

/// A required size parameter (an integer in 1..=u32::MAX).
pub fn param_usize(params: &Params, name: &str) -> Result<usize> {
    match param(params, name)? {
        ParamValue::Int(v) if *v > 0 && *v <= u32::MAX as u64 => Ok(*v as usize),
        other => Err(wrong(name, ParamKind::SIZE, other)),
    }
}

/// An optional size parameter.
pub fn param_usize_opt(params: &Params, name: &str) -> Result<Option<usize>> {
    params.contains_key(name).then(|| param_usize(params, name)).transpose()
}

/// A required dtype parameter.
pub fn param_dtype(params: &Params, name: &str) -> Result<DType> {
    match param(params, name)? {
        ParamValue::Str(s) => s
            .parse()
            .map_err(|e: kvjit_core::Error| GraphError::Param { param: name.to_string(), problem: e.to_string() }),
        other => Err(wrong(name, ParamKind::DType, other)),
    }
}

/// An optional flag, `default` when absent.
pub fn param_bool(params: &Params, name: &str, default: bool) -> Result<bool> {
    match params.get(name) {
        None => Ok(default),
        Some(ParamValue::Bool(b)) => Ok(*b),
        Some(other) => Err(wrong(name, ParamKind::Bool, other)),
    }
}

/// An optional finite number, `None` when absent.
pub fn param_f64_opt(params: &Params, name: &str) -> Result<Option<f64>> {
    match params.get(name) {
        None => Ok(None),
        Some(ParamValue::Float(x)) if x.is_finite() => Ok(Some(*x)),
        Some(ParamValue::Int(i)) => Ok(Some(*i as f64)),
        Some(other) => Err(wrong(name, ParamKind::Float { min: f64::MIN, max: f64::MAX }, other)),
    }
}

/// A required name out of `choices`.
pub fn param_choice<'p>(params: &'p Params, name: &str, choices: &'static [&'static str]) -> Result<&'p str> {
    match param(params, name)? {
        ParamValue::Str(s) if choices.contains(&s.as_str()) => Ok(s),
        other => Err(wrong(name, ParamKind::Choice(choices), other)),
    }
}

/// A required list of dims.
pub fn param_dims<'p>(params: &'p Params, name: &str) -> Result<&'p [Dim]> {
    match param(params, name)? {
        ParamValue::Dims(dims) => Ok(dims),
        other => Err(wrong(name, ParamKind::Dims, other)),
    }
}

/// What kind of value an op argument takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgKind {
    /// A tensor.
    Tensor,
    /// A paged KV cache (written in place).
    KvCache,
}

/// What an input means beyond its type — what a generator of example
/// inputs needs to know to make *valid* values for it (see `kvjit::scenario`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgRole {
    /// Any values of its type (activations, weights).
    Data,
    /// A u32 scalar naming a layer of the node's KV cache (`< L`).
    LayerIndex,
    /// u32 `[B]`: the valid tokens of each padded sequence (`≤ S`); the
    /// node's cache advances by them after a step.
    ValidLengths,
    /// The paged KV cache.
    Cache,
    /// A graph constant (a weight, an embedding table): a node whose input
    /// of this role is not one is refused when it is added or validated.
    Constant,
}

/// One input of an op's signature.
#[derive(Clone, Copy, Debug)]
pub struct ArgSpec {
    /// Argument name, as in the op's documentation.
    pub name: &'static str,
    /// What kind of value it takes.
    pub kind: ArgKind,
    /// What its values mean.
    pub role: ArgRole,
}

impl ArgSpec {
    /// A tensor of any values.
    pub const fn tensor(name: &'static str) -> Self {
        Self { name, kind: ArgKind::Tensor, role: ArgRole::Data }
    }

    /// The paged KV cache.
    pub const fn cache(name: &'static str) -> Self {
        Self { name, kind: ArgKind::KvCache, role: ArgRole::Cache }
    }

    /// A tensor that must be a graph constant (a weight the kernel packs,
    /// an embedding table).
    pub const fn constant(name: &'static str) -> Self {
        Self { name, kind: ArgKind::Tensor, role: ArgRole::Constant }
    }

    /// A u32 scalar layer index into the node's cache.
    pub const fn layer_index(name: &'static str) -> Self {
        Self { name, kind: ArgKind::Tensor, role: ArgRole::LayerIndex }
    }

    /// The u32 `[B]` valid lengths of a padded batch.
    pub const fn valid_lengths(name: &'static str) -> Self {
        Self { name, kind: ArgKind::Tensor, role: ArgRole::ValidLengths }
    }

    /// A paged op's cache, by the name MAX gives it.
    pub const KV_COLLECTION: Self = Self::cache("kv_collection");
    /// A paged op's layer index, by the name MAX gives it.
    pub const LAYER_IDX: Self = Self::layer_index("layer_idx");
    /// A paged op's valid lengths, by the name MAX gives it.
    pub const VALID_LENGTHS: Self = Self::valid_lengths("valid_lengths");
}

/// [`GraphError::InputType`] for argument `arg`: what was `expected`, and
/// the type it got.
pub fn input_error(arg: &str, expected: String, got: &impl std::fmt::Display) -> GraphError {
    GraphError::InputType { arg: arg.into(), expected, got: got.to_string() }
}

/// Input `i` of a node as a tensor type (argument kinds are checked before
/// [`OpDef::infer`] runs, so an [`ArgSpec::tensor`] input is one).
pub fn tensor_input<'a>(inputs: &[&'a ValueType], i: usize) -> &'a TensorType {
    inputs[i].as_tensor().expect("argument kinds are checked before infer")
}

/// The KV-cache parameters a paged op is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedParams {
    /// KV heads.
    pub num_kv_heads: usize,
    /// Head size D.
    pub head_size: usize,
    /// Tokens per page.
    pub page_size: usize,
}

/// The build-time check every paged op makes of its cache argument (input
/// `i`): a float cache with `params`' layout whose batch is `batch`. Gives
/// the cache's type.
pub fn paged_cache_input<'a>(
    inputs: &[&'a ValueType],
    i: usize,
    params: PagedParams,
    batch: &Dim,
) -> Result<&'a crate::KvCacheType> {
    let PagedParams { num_kv_heads, head_size, page_size } = params;
    let cache = inputs[i].as_kv_cache().expect("argument kinds are checked before infer");
    let layout_ok = cache.num_kv_heads == num_kv_heads
        && cache.head_size == head_size
        && cache.page_size == page_size
        && cache.dtype.is_float()
        && crate::same_dim(&cache.batch, batch);
    if !layout_ok {
        return Err(input_error(
            "kv_collection",
            format!(
                "a float cache with num_kv_heads={num_kv_heads}, head_size={head_size}, page_size={page_size}, batch={batch}"
            ),
            cache,
        ));
    }
    Ok(cache)
}

/// The build-time check every paged op makes of its step arguments:
/// `layer_idx` (input `layer`) a u32 scalar, `valid_lengths` (input
/// `valid`) u32 `[batch]`.
pub fn step_inputs(inputs: &[&ValueType], [layer, valid]: [usize; 2], batch: &Dim) -> Result<()> {
    let layer_idx = tensor_input(inputs, layer);
    if layer_idx.dtype != DType::U32 || !layer_idx.shape.is_empty() {
        return Err(input_error("layer_idx", "u32[] (a scalar)".into(), layer_idx));
    }
    let valid_lengths = tensor_input(inputs, valid);
    if valid_lengths.dtype != DType::U32 || !matches!(valid_lengths.shape.as_slice(), [b] if crate::same_dim(b, batch))
    {
        return Err(input_error("valid_lengths", format!("u32[{batch}]"), valid_lengths));
    }
    Ok(())
}

/// The IR-level definition of an op: one per op, registered in an
/// [`OpRegistry`].
pub trait OpDef: Send + Sync {
    /// Canonical name, as graph files write it.
    fn name(&self) -> &'static str;
    /// Other names the op answers to.
    fn aliases(&self) -> &'static [&'static str] {
        &[]
    }
    /// The parameters the op takes, with their kinds and ranges; the
    /// validator refuses unknown names, missing required ones and values
    /// out of kind or range before [`infer`](Self::infer) runs.
    fn params(&self) -> &'static [ParamSpec];
    /// Input signature, in order.
    fn inputs(&self) -> &'static [ArgSpec];
    /// Output names, in order.
    fn outputs(&self) -> &'static [&'static str];
    /// Check the parameters and input types and infer the output types.
    fn infer(&self, params: &Params, inputs: &[&ValueType]) -> Result<Vec<TensorType>>;
    /// The kernel key for these (already inferred) inputs on `backend`,
    /// holding the op's typed spec ([`KernelKey::of`]).
    fn kernel_key(&self, params: &Params, inputs: &[&ValueType], backend: Backend) -> Result<KernelKey>;
    /// Whether a kernel exists for `key` on its target: `Err(reason)` when
    /// none does (no CUDA variant for it, sizes past what the generated code
    /// can address, ...). [`specialize`](crate::specialize) refuses such keys
    /// as [`GraphError::Unsupported`], so no key that cannot be built is ever
    /// shown or compiled. Default: every key is served.
    fn supports(&self, key: &KernelKey) -> std::result::Result<(), String> {
        let _ = key;
        Ok(())
    }
    /// Inputs whose constant data this op's fast CPU kernel keeps a packed
    /// copy of (counted by memory estimates). Default: none.
    fn packed_constant_inputs(&self) -> &'static [usize] {
        &[]
    }
    /// Whether the op runs no kernel: its output is a view of its first
    /// input's buffer, with the inferred type (a reshape). The executor hands
    /// the consumer that view; no kernel is built.
    fn is_view(&self) -> bool {
        false
    }
    /// The constant recipes this op brings (its tables, made from a few
    /// numbers instead of stored): registering the op registers them, so
    /// graph files may name them in `init`. Default: none.
    fn recipes(&self) -> &'static [RecipeKind] {
        &[]
    }
}

/// Every op a graph may use, found by name or alias, and the constant
/// recipes they bring.
#[derive(Clone)]
pub struct OpRegistry {
    ops: Vec<Arc<dyn OpDef>>,
    recipes: Vec<RecipeKind>,
}

impl Default for OpRegistry {
    fn default() -> Self {
        Self { ops: Vec::new(), recipes: BUILT_IN_RECIPES.to_vec() }
    }
}

/// The recipes every registry knows: seeded random weights, for any op.
const BUILT_IN_RECIPES: &[RecipeKind] = &[RecipeKind::of::<RandomInit>()];

impl OpRegistry {
    /// A registry of no ops (its graphs may still hold inputs, caches and
    /// [`RandomInit`] constants).
    pub fn new() -> Self {
        Self::default()
    }

    /// Add an op and its recipes; its names, its recipes' names and their
    /// markers must not clash with ones already registered (nothing is
    /// added when one does).
    pub fn register(&mut self, op: Arc<dyn OpDef>) -> Result<()> {
        for name in std::iter::once(op.name()).chain(op.aliases().iter().copied()) {
            if self.find(name).is_some() {
                return Err(GraphError::DuplicateOp(name.to_string()));
            }
        }
        for (i, kind) in op.recipes().iter().enumerate() {
            let mut earlier = self.recipes.iter().chain(&op.recipes()[..i]);
            if let Some(clash) = earlier.find(|k| k.name() == kind.name() || k.marker() == kind.marker()) {
                return Err(GraphError::DuplicateRecipe {
                    name: kind.name(),
                    marker: kind.marker(),
                    registered: clash.name(),
                });
            }
        }
        self.recipes.extend_from_slice(op.recipes());
        self.ops.push(op);
        Ok(())
    }

    /// Every recipe graphs built with this registry may use.
    pub fn recipes(&self) -> &[RecipeKind] {
        &self.recipes
    }

    /// Read a graph file's `init` object: the registered recipe whose
    /// marker field it holds, or a [`RandomInit`] when it holds none.
    /// Fields that are not the recipe's, or missing ones, are refused
    /// ([`GraphError::Json`], naming them), as is an object holding the
    /// markers of two recipes.
    pub fn read_recipe(&self, fields: serde_json::Value) -> Result<ConstantInit> {
        let marked: Vec<&RecipeKind> = self.recipes.iter().filter(|k| fields.get(k.marker()).is_some()).collect();
        let kind = match marked.as_slice() {
            [] => {
                return RecipeKind::of::<RandomInit>().read(fields).map_err(|e| {
                    let markers: Vec<String> =
                        self.recipes.iter().map(|k| format!("\"{}\" ({})", k.marker(), k.name())).collect();
                    GraphError::Json(serde::de::Error::custom(format!(
                        "{e} (an \"init\" without the field that marks a registered recipe, {}, is read as {})",
                        markers.join(", "),
                        RandomInit::NAME
                    )))
                });
            }
            [kind] => **kind,
            [a, b, ..] => {
                return Err(GraphError::Json(serde::de::Error::custom(format!(
                    "an \"init\" holds fields of two recipes, {} (\"{}\") and {} (\"{}\"): give one",
                    a.name(),
                    a.marker(),
                    b.name(),
                    b.marker()
                ))));
            }
        };
        Ok(kind.read(fields)?)
    }

    fn find(&self, name: &str) -> Option<&Arc<dyn OpDef>> {
        self.ops.iter().find(|op| op.name() == name || op.aliases().contains(&name))
    }

    /// The op with this name or alias.
    pub fn get(&self, name: &str) -> Result<&Arc<dyn OpDef>> {
        self.find(name).ok_or_else(|| GraphError::UnknownOp {
            name: name.to_string(),
            known: self.ops.iter().map(|op| op.name()).collect::<Vec<_>>().join(", "),
        })
    }

    /// Every registered op.
    pub fn ops(&self) -> impl Iterator<Item = &Arc<dyn OpDef>> {
        self.ops.iter()
    }
}
