//! [`KernelKey`]: everything a kernel may bake in, and its one canonical name.

use std::fmt;

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

/// Everything a specialized kernel may bake in: op, target, dtype and an
/// ordered list of labelled fields.
///
/// Its [`Display`](fmt::Display) form, e.g.
/// `fused_qkv_bshd_paged.cpu.bf16.k4096.q4096.hkv8.d128.p16.l32.kvbf16.bany.sany`,
/// is the one canonical name used as JIT symbol, CUDA variant name, kernel
/// cache key and benchmark id. Ops build keys through [`KernelKey::new`] and
/// [`KernelKey::with`]; nothing else spells these names.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KernelKey {
    op: String,
    target: Target,
    /// The code tier within the target (`avx2` in `cpu-avx2`), when the
    /// kernel's code depends on one.
    variant: Option<String>,
    dtype: DType,
    fields: Vec<(String, KeyField)>,
}

impl KernelKey {
    /// A key with no dims yet.
    pub fn new(op: &str, target: Target, dtype: DType) -> Self {
        Self { op: op.to_string(), target, variant: None, dtype, fields: Vec::new() }
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
