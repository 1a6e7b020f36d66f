//! [`KernelKey`]: everything a kernel may bake in, and its one canonical
//! name; [`KernelSpec`]: the op's typed form of it, which the key carries.

use std::any::Any;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::{DType, Target};

/// One labelled entry of a kernel key: a dim baked into the kernel, a dim
/// left to run time, or a secondary dtype (e.g. the cache's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KeyField {
    /// Known when the graph is built; the kernel may bake it in.
    Static(u64),
    /// Symbolic in the graph; the kernel reads it at run time.
    Dynamic,
    /// A dtype other than the key's compute dtype.
    DType(DType),
}

impl KeyField {
    /// A size baked into the kernel.
    pub fn size(size: usize) -> Self {
        KeyField::Static(size as u64)
    }

    /// A dim: baked in when known, else left to run time.
    pub fn dim(size: Option<usize>) -> Self {
        size.map_or(KeyField::Dynamic, KeyField::size)
    }
}

impl fmt::Display for KeyField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyField::Static(v) => write!(f, "{v}"),
            KeyField::Dynamic => f.write_str("any"),
            KeyField::DType(d) => f.write_str(d.name()),
        }
    }
}

/// The typed form of an op's kernel key: the op's own struct of everything
/// its kernels bake in. An op's `specialize` makes one, the key carries it
/// ([`KernelKey::of`]) to the op's kernel builder, which takes it back with
/// [`KernelKey::spec`]; [`key_name`](Self::key_name) is the one place that
/// spells it.
pub trait KernelSpec: Clone + fmt::Debug + Send + Sync + 'static {
    /// The canonical name: op, target, dtype and labelled fields (a key
    /// that holds no spec).
    fn key_name(&self) -> KernelKey;

    /// The key holding this spec.
    fn key(&self) -> KernelKey {
        KernelKey::of(self)
    }
}

/// Everything a specialized kernel may bake in: op, target, dtype and an
/// ordered list of labelled fields, and (for keys an op made) the op's
/// typed [`KernelSpec`].
///
/// Its [`Display`](fmt::Display) form, e.g.
/// `fused_qkv_bshd_paged.cpu-avx2.bf16.k4096.q4096.hkv8.d128.p16.l32.kvbf16.bany.sany`,
/// is the one canonical name used as JIT symbol, CUDA variant name, kernel
/// cache key, benchmark id, log line and artifact record. Equality, order
/// and hash are those of the name (the spec is a function of it). Ops build
/// names through [`KernelKey::new`] and [`KernelKey::with`] in their
/// [`KernelSpec::key_name`]; nothing else spells them.
#[derive(Clone)]
pub struct KernelKey {
    op: String,
    target: Target,
    /// The code tier within the target (`avx2` in `cpu-avx2`), when the
    /// kernel's code depends on one.
    variant: Option<String>,
    dtype: DType,
    fields: Vec<(String, KeyField)>,
    spec: Option<Arc<dyn Any + Send + Sync>>,
}

impl KernelKey {
    /// The key of `spec`: its name, holding the spec.
    pub fn of<S: KernelSpec>(spec: &S) -> Self {
        Self { spec: Some(Arc::new(spec.clone())), ..spec.key_name() }
    }

    /// The typed spec this key holds, if it holds one of type `S` (an op's
    /// builder takes its own spec back; a key of another op gives `None`).
    pub fn spec<S: KernelSpec>(&self) -> Option<&S> {
        self.spec.as_deref()?.downcast_ref()
    }

    fn name_parts(&self) -> NameParts<'_> {
        (&self.op, self.target, self.variant.as_deref(), self.dtype, &self.fields)
    }
}

/// What a key's name is made of (equality, order and hash compare these).
type NameParts<'a> = (&'a str, Target, Option<&'a str>, DType, &'a [(String, KeyField)]);

impl PartialEq for KernelKey {
    fn eq(&self, other: &Self) -> bool {
        self.name_parts() == other.name_parts()
    }
}

impl Eq for KernelKey {}

impl Hash for KernelKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.name_parts().hash(state);
    }
}

impl PartialOrd for KernelKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for KernelKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.name_parts().cmp(&other.name_parts())
    }
}

impl fmt::Debug for KernelKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KernelKey({self})")
    }
}

impl KernelKey {
    /// A key with no dims yet.
    pub fn new(op: &str, target: Target, dtype: DType) -> Self {
        Self { op: op.to_string(), target, variant: None, dtype, fields: Vec::new(), spec: None }
    }

    /// Name the code tier the kernel is built for; the key's target then
    /// reads `target-variant` (e.g. `cpu-avx2`).
    pub fn with_variant(mut self, variant: &str) -> Self {
        self.variant = Some(variant.to_string());
        self
    }

    /// The code tier, if the key names one.
    pub fn variant(&self) -> Option<&str> {
        self.variant.as_deref()
    }

    /// Append a labelled field (labels are short lowercase tags like `k`, `hkv`).
    pub fn with(mut self, label: &str, dim: KeyField) -> Self {
        self.fields.push((label.to_string(), dim));
        self
    }

    /// Append a labelled field when there is one (optional parts of a key,
    /// like an FP8 cache's scale granularity `g`).
    pub fn with_if(self, label: &str, dim: Option<KeyField>) -> Self {
        match dim {
            Some(dim) => self.with(label, dim),
            None => self,
        }
    }

    /// The op's short kernel name.
    pub fn op(&self) -> &str {
        &self.op
    }

    /// The target the kernel runs on.
    pub fn target(&self) -> Target {
        self.target
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The labelled fields, in key order.
    pub fn fields(&self) -> &[(String, KeyField)] {
        &self.fields
    }

    /// The field with this label, if the key has it.
    pub fn get(&self, label: &str) -> Option<KeyField> {
        self.fields.iter().find(|(l, _)| l == label).map(|(_, d)| *d)
    }

    /// The size a [`KeyField::Static`] field holds; `None` if the field is
    /// absent, of another kind, or past `usize`.
    pub fn size(&self, label: &str) -> Option<usize> {
        match self.get(label)? {
            KeyField::Static(v) => usize::try_from(v).ok(),
            _ => None,
        }
    }

    /// A dim field: `Some(Some(size))` when baked in, `Some(None)` when left
    /// to run time, `None` if absent or not a dim.
    pub fn dim(&self, label: &str) -> Option<Option<usize>> {
        match self.get(label)? {
            KeyField::Static(v) => Some(usize::try_from(v).ok()),
            KeyField::Dynamic => Some(None),
            KeyField::DType(_) => None,
        }
    }

    /// The dtype a [`KeyField::DType`] field holds.
    pub fn dtype_field(&self, label: &str) -> Option<DType> {
        match self.get(label)? {
            KeyField::DType(d) => Some(d),
            _ => None,
        }
    }

    /// Whether no dim is left to run time (a fully specialized kernel).
    pub fn is_fully_static(&self) -> bool {
        self.fields.iter().all(|(_, d)| !matches!(d, KeyField::Dynamic))
    }

    /// The canonical name as a C identifier (dots become underscores), for
    /// symbol tables that do not accept dots.
    pub fn symbol(&self) -> String {
        self.to_string().replace('.', "_")
    }
}

impl fmt::Display for KernelKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.op, self.target)?;
        if let Some(variant) = &self.variant {
            write!(f, "-{variant}")?;
        }
        write!(f, ".{}", self.dtype)?;
        for (label, dim) in &self.fields {
            write!(f, ".{label}{dim}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_the_canonical_name() {
        let key = KernelKey::new("fused_qkv_bshd_paged", Target::Cpu, DType::BF16)
            .with("hkv", KeyField::Static(8))
            .with("b", KeyField::Dynamic);
        assert_eq!(key.to_string(), "fused_qkv_bshd_paged.cpu.bf16.hkv8.bany");
        assert_eq!(key.symbol(), "fused_qkv_bshd_paged_cpu_bf16_hkv8_bany");
        assert!(!key.is_fully_static());
        assert_eq!(key.get("hkv"), Some(KeyField::Static(8)));
        let tiered = key.clone().with_variant("avx2");
        assert_eq!(tiered.to_string(), "fused_qkv_bshd_paged.cpu-avx2.bf16.hkv8.bany");
        assert_eq!(tiered.variant(), Some("avx2"));
        assert_ne!(tiered, key);
    }
}
