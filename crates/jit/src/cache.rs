//! The kernel cache: one compiled kernel per key, shared while anyone uses it.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use kvjit_core::KernelKey;

/// Why a kernel was compiled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompileCause {
    /// A graph node needed it when the graph was built.
    GraphBuild,
    /// A generic kernel saw this shape at run time and the policy asked for a
    /// specialized kernel.
    ShapeSeen(String),
    /// The kernel had been compiled before, but every user had dropped it.
    Recompile,
}

impl fmt::Display for CompileCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CompileCause::GraphBuild => f.write_str("graph build"),
            CompileCause::ShapeSeen(shape) => write!(f, "shape seen at run time ({shape})"),
            CompileCause::Recompile => f.write_str("recompile after every user dropped it"),
        }
    }
}

/// One entry of the compile log.
#[derive(Clone, Debug)]
pub struct CompileRecord {
    /// The kernel's canonical name.
    pub key: String,
    /// Why it was compiled.
    pub cause: CompileCause,
    /// How long it took.
    pub duration: Duration,
    /// Machine-code bytes.
    pub code_size: usize,
}

/// What a cache stores must say how long it took to make and how big it is.
pub trait CompiledArtifact: Send + Sync {
    /// Compile time.
    fn compile_time(&self) -> Duration;
    /// Machine-code bytes.
    fn code_size(&self) -> usize;
}

impl CompiledArtifact for crate::JitFunction {
    fn compile_time(&self) -> Duration {
        crate::JitFunction::compile_time(self)
    }
    fn code_size(&self) -> usize {
        crate::JitFunction::code_size(self)
    }
}

/// A key's slot: the live kernel (if any) and whether one was ever compiled.
type Slot<T> = Arc<Mutex<(Weak<T>, bool)>>;

/// Compiled kernels by key. The cache holds only weak references: a kernel
/// lives while some executable uses it and its code is freed with the last
/// user. Compiles of the same key are serialized (the second caller waits and
/// gets the first one's kernel); different keys compile concurrently.
pub struct KernelCache<T> {
    slots: Mutex<HashMap<KernelKey, Slot<T>>>,
    log: Mutex<Vec<CompileRecord>>,
}

impl<T> Default for KernelCache<T> {
    fn default() -> Self {
        Self { slots: Mutex::new(HashMap::new()), log: Mutex::new(Vec::new()) }
    }
}

impl<T: CompiledArtifact> KernelCache<T> {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// The live kernel for `key`, or the result of `compile` (recorded in the
    /// log with `cause`, and as a `tracing` event).
    pub fn get_or_compile<E>(
        &self,
        key: &KernelKey,
        cause: CompileCause,
        compile: impl FnOnce() -> Result<T, E>,
    ) -> Result<Arc<T>, E> {
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            slots.entry(key.clone()).or_insert_with(|| Arc::new(Mutex::new((Weak::new(), false)))).clone()
        };
        let mut entry = slot.lock().unwrap_or_else(|p| p.into_inner());
        let (weak, compiled_before) = &mut *entry;
        if let Some(live) = weak.upgrade() {
            return Ok(live);
        }
        let cause = if *compiled_before && cause == CompileCause::GraphBuild { CompileCause::Recompile } else { cause };
        let compiled = Arc::new(compile()?);
        *weak = Arc::downgrade(&compiled);
        *compiled_before = true;
        let record = CompileRecord {
            key: key.to_string(),
            cause,
            duration: compiled.compile_time(),
            code_size: compiled.code_size(),
        };
        tracing::info!(
            kernel = %record.key,
            cause = %record.cause,
            compile_ms = record.duration.as_secs_f64() * 1e3,
            code_bytes = record.code_size,
            "compiled kernel"
        );
        self.log.lock().unwrap_or_else(|p| p.into_inner()).push(record);
        Ok(compiled)
    }

    /// Every compile so far, oldest first.
    pub fn log(&self) -> Vec<CompileRecord> {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Keys with a live kernel.
    pub fn live_keys(&self) -> Vec<KernelKey> {
        let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let mut keys: Vec<KernelKey> = slots
            .iter()
            .filter(|(_, s)| s.lock().is_ok_and(|e| e.0.strong_count() > 0))
            .map(|(k, _)| k.clone())
            .collect();
        keys.sort();
        keys
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use kvjit_core::{DType, Target};

    use super::*;

    struct Fake;
    impl CompiledArtifact for Fake {
        fn compile_time(&self) -> Duration {
            Duration::from_millis(1)
        }
        fn code_size(&self) -> usize {
            10
        }
    }

    #[test]
    fn compiles_once_while_used_and_again_after_drop() {
        let cache = KernelCache::<Fake>::new();
        let key = KernelKey::new("k", Target::Cpu, DType::F32);
        let compiles = AtomicUsize::new(0);
        let make = || {
            compiles.fetch_add(1, Ordering::SeqCst);
            Ok::<_, ()>(Fake)
        };
        let a = cache.get_or_compile(&key, CompileCause::GraphBuild, make).unwrap();
        let b = cache.get_or_compile(&key, CompileCause::GraphBuild, make).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(compiles.load(Ordering::SeqCst), 1);
        assert_eq!(cache.live_keys(), vec![key.clone()]);
        drop((a, b));
        assert!(cache.live_keys().is_empty());
        let _c = cache.get_or_compile(&key, CompileCause::GraphBuild, make).unwrap();
        assert_eq!(compiles.load(Ordering::SeqCst), 2);
        let causes: Vec<_> = cache.log().into_iter().map(|r| r.cause).collect();
        assert_eq!(causes, vec![CompileCause::GraphBuild, CompileCause::Recompile]);
    }

    #[test]
    fn concurrent_requests_for_one_key_compile_once() {
        let cache = KernelCache::<Fake>::new();
        let key = KernelKey::new("k", Target::Cpu, DType::F32);
        let compiles = AtomicUsize::new(0);
        let kernels: Vec<Arc<Fake>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        cache
                            .get_or_compile(&key, CompileCause::GraphBuild, || {
                                compiles.fetch_add(1, Ordering::SeqCst);
                                std::thread::sleep(Duration::from_millis(5));
                                Ok::<_, ()>(Fake)
                            })
                            .unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(compiles.load(Ordering::SeqCst), 1);
        assert!(kernels.iter().all(|k| Arc::ptr_eq(k, &kernels[0])));
    }
}
