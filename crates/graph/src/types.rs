//! Value types: tensors with static or symbolic dims, and KV caches.

use std::fmt;

use kvjit_core::{CacheElement, DType, KvCacheParams};
use serde::{Deserialize, Serialize};

/// One dimension: a number known when the graph is built, or a named symbol
/// (`"batch"`, `"seq"`) bound at run time. The same name means the same size
/// everywhere in a graph.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Dim {
    /// A known size.
    Static(usize),
    /// A named size bound at run time.
    Symbolic(String),
}

impl Dim {
    /// The size, if static.
    pub fn as_static(&self) -> Option<usize> {
        match self {
            Dim::Static(v) => Some(*v),
            Dim::Symbolic(_) => None,
        }
    }
}

impl From<usize> for Dim {
    fn from(v: usize) -> Self {
        Dim::Static(v)
    }
}

impl From<&str> for Dim {
    fn from(s: &str) -> Self {
        Dim::Symbolic(s.to_string())
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Static(v) => write!(f, "{v}"),
            Dim::Symbolic(s) => f.write_str(s),
        }
    }
}

/// Whether two dims are provably the same size: equal numbers, or the same
/// symbol. A number and a symbol are not the same (the symbol may be bound to
/// anything), so graphs must spell shared dims consistently.
pub fn same_dim(a: &Dim, b: &Dim) -> bool {
    a == b
}

/// The type of a tensor value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// Dims, outermost first.
    pub shape: Vec<Dim>,
}

impl TensorType {
    /// A tensor type from a dtype and dims.
    pub fn new(dtype: DType, shape: impl IntoIterator<Item = Dim>) -> Self {
        Self { dtype, shape: shape.into_iter().collect() }
    }

    /// The concrete shape, if every dim is static.
    pub fn static_shape(&self) -> Option<Vec<usize>> {
        self.shape.iter().map(Dim::as_static).collect()
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, d) in self.shape.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// The type of a paged KV cache value: its layout (fixed when the graph is
/// built) and its batch-facing dims (which may be symbolic).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvCacheType {
    /// Element type of cached K/V.
    pub dtype: DType,
    /// Layers L.
    pub num_layers: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// KV heads Hkv.
    pub num_kv_heads: usize,
    /// Head size D.
    pub head_size: usize,
    /// Values per scale of an `f8e4m3` cache (g, dividing D; graph files
    /// write `"scale_granularity"`, default 128 for `f8e4m3` when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_granularity: Option<usize>,
    /// Physical pages P.
    pub num_pages: Dim,
    /// Sequences B.
    pub batch: Dim,
    /// Width of the lookup table.
    pub max_pages_per_seq: Dim,
}

impl KvCacheType {
    /// What its elements are: the dtype with, for `f8e4m3`, the scale
    /// granularity ([`CacheElement::new`] refuses other pairings).
    pub fn element(&self) -> kvjit_core::Result<CacheElement> {
        CacheElement::new(self.dtype, self.scale_granularity)
    }

    /// The layout part, as the core cache type spells it.
    ///
    /// # Panics
    ///
    /// If the dtype and granularity do not pair ([`element`](Self::element)
    /// refuses them): a graph's caches were checked when they were added, so
    /// every cache of a graph pairs them.
    pub fn params(&self) -> KvCacheParams {
        self.try_params().expect("a graph's caches are checked when added")
    }

    /// [`params`](Self::params) of a cache type not (yet) in a graph: the
    /// pairing error instead of a panic.
    pub fn try_params(&self) -> kvjit_core::Result<KvCacheParams> {
        Ok(KvCacheParams {
            element: self.element()?,
            num_layers: self.num_layers,
            page_size: self.page_size,
            num_kv_heads: self.num_kv_heads,
            head_size: self.head_size,
        })
    }
}

impl fmt::Display for KvCacheType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "kv_cache<{}, layers={}, page_size={}, kv_heads={}, head_size={}{}, pages={}, batch={}, max_pages_per_seq={}>",
            self.dtype,
            self.num_layers,
            self.page_size,
            self.num_kv_heads,
            self.head_size,
            self.scale_granularity.map(|g| format!(", scale_granularity={g}")).unwrap_or_default(),
            self.num_pages,
            self.batch,
            self.max_pages_per_seq
        )
    }
}

/// The type of any value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ValueType {
    /// A tensor.
    Tensor(TensorType),
    /// A paged KV cache, written in place by the ops that take it.
    KvCache(KvCacheType),
}

impl ValueType {
    /// The tensor type, if this is a tensor.
    pub fn as_tensor(&self) -> Option<&TensorType> {
        match self {
            ValueType::Tensor(t) => Some(t),
            ValueType::KvCache(_) => None,
        }
    }

    /// The cache type, if this is a KV cache.
    pub fn as_kv_cache(&self) -> Option<&KvCacheType> {
        match self {
            ValueType::KvCache(c) => Some(c),
            ValueType::Tensor(_) => None,
        }
    }

    /// Every dim of the type, mutable (used to bind symbols).
    pub(crate) fn dims_mut(&mut self) -> Vec<&mut Dim> {
        match self {
            ValueType::Tensor(t) => t.shape.iter_mut().collect(),
            ValueType::KvCache(c) => vec![&mut c.num_pages, &mut c.batch, &mut c.max_pages_per_seq],
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueType::Tensor(t) => t.fmt(f),
            ValueType::KvCache(c) => c.fmt(f),
        }
    }
}
