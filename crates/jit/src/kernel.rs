//! The one ABI every kvjit CPU kernel is compiled for, the process-wide
//! registry of compiled kernels, the seen-shape specialization policy, and
//! the one place JIT code is called.
//!
//! **The kernel ABI.** Every kernel is
//! `extern "C" fn(args: *const u64, begin: i64, end: i64)` (the host's C
//! convention, [`crate::c_call_conv`]): `args`
//! points at the call's argument words — buffer addresses and run-time
//! sizes, in the order the op's emitter reads them with
//! [`KernelParams::arg`] — and `[begin, end)` is the range of work items
//! (weight panels, heads, …) this invocation computes. One signature for
//! every op means one typed entry point ([`launch`]) instead of a
//! `transmute` per op, and the split of work over the worker pool lives here
//! once: [`launch`] cuts `0..items` into one contiguous range per worker of
//! the context's pool.
//!
//! **The registry.** [`kernels`] is the process-wide [`KernelCache`]: one
//! compiled kernel per [`KernelKey`], shared by every node, graph and thread
//! while anyone holds it, freed with its last user; [`compile_log`] lists
//! every compile and its cause (also a `tracing` event).
//!
//! **The seen-shape policy.** A kernel whose key leaves dims symbolic can ask
//! [`SeenShapes`] for code specialized to the dims of each call, compiled on
//! first sight (at most [`MAX_SEEN_SHAPES`] per kernel) and cached in the
//! registry like any other key.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use cranelift_codegen::ir::{InstBuilder, Value, types};
use cranelift_frontend::FunctionBuilder;
use kvjit_core::KernelKey;
use kvjit_runtime::DeviceContextPtr;

use crate::ir::mem;
use crate::{CaptureText, CompileCause, CompileRecord, JitError, JitFunction, KernelCache, compile_function};

/// The parameters of a kernel's entry block: where its argument words are,
/// and the range of work items this invocation computes.
#[derive(Clone, Copy, Debug)]
pub struct KernelParams {
    /// Address of the argument words (`*const u64`).
    pub args: Value,
    /// First work item (inclusive), an `i64`.
    pub begin: Value,
    /// Last work item (exclusive), an `i64`.
    pub end: Value,
}

impl KernelParams {
    /// Load the 8-byte field at byte `offset` of the kernel's argument
    /// struct (an address or a size) as an `i64`. The offset is
    /// `std::mem::offset_of!` of the op's `#[repr(C)]` argument struct, so
    /// the host that fills the struct and the code that reads it share one
    /// description.
    pub fn field(&self, b: &mut FunctionBuilder, offset: usize) -> Value {
        let offset = i32::try_from(offset).expect("a kernel's argument struct is a handful of words");
        b.ins().load(types::I64, mem().with_readonly(), self.args, offset)
    }

    /// Load word `index` of an argument block that is a plain `[u64; N]`
    /// (probes and tests; ops declare a [`KernelArgs`] struct instead).
    pub fn arg(&self, b: &mut FunctionBuilder, index: usize) -> Value {
        self.field(b, index * 8)
    }
}

/// A kernel's argument struct: `#[repr(C)]`, made of 8-byte words
/// (addresses as `u64`, sizes as `u64` or `i64`), which the emitter reads
/// with [`KernelParams::field`] at `offset_of!` of each field.
///
/// # Safety
///
/// The implementing type must be `#[repr(C)]` with only 8-byte integer
/// fields, so every `offset_of!` is a multiple of 8 inside the struct.
pub unsafe trait KernelArgs: Sync {}

// SAFETY: an array of u64 is laid out as consecutive 8-byte words.
unsafe impl<const N: usize> KernelArgs for [u64; N] {}

/// Compile a kernel for `key` with the kernel ABI. `build` emits the body
/// from the entry block (the `return` is appended after it).
pub fn compile_kernel(
    key: &KernelKey,
    capture: CaptureText,
    build: impl FnOnce(&mut FunctionBuilder, KernelParams),
) -> Result<JitFunction, JitError> {
    let ptr = crate::pointer_type();
    let mut function = compile_function(&key.symbol(), &[ptr, types::I64, types::I64], &[], capture, |b, params| {
        let &[args, begin, end] = params else { unreachable!("the kernel ABI has three parameters") };
        build(b, KernelParams { args, begin, end });
        b.ins().return_(&[]);
    })?;
    function.kernel_abi = true;
    Ok(function)
}

/// Contiguous ranges [`launch_uneven`] cuts its items into per thread of
/// the pool; threads claim ranges as they finish theirs, the last range
/// first, so items of unequal cost (causal prefill's query blocks) balance
/// out. (Measured on causal prefill attention, 2 threads: 1.3× one range
/// per thread; 8 ranges per thread, claimed last first, no faster than 4.)
pub const UNEVEN_PARTS_PER_THREAD: usize = 4;

/// The machine-code type of every kernel (see the module docs).
type KernelEntry = unsafe extern "C" fn(args: *const u64, begin: i64, end: i64);

/// Run `code` over the work items `0..items`, one contiguous range per
/// thread of `ctx`'s CPU pool (inline when it has one thread or there is at
/// most one item; a non-CPU context runs inline too): for items of equal
/// cost, each thread streaming one range (see [`launch_uneven`] for the
/// others). Returns when every range is done.
///
/// Which range a worker gets never changes what an item computes. Results
/// are therefore independent of the number of threads only if the caller's
/// items (how many, and what each covers) are chosen without regard to it,
/// the kernel computes each item the same way wherever it runs, and the
/// caller combines items' results in a fixed order.
///
/// # Safety
///
/// `code` must come from [`compile_kernel`] for an op whose emitter reads its
/// argument struct `A` (with [`KernelParams::field`] at `offset_of!` of its
/// fields), and for every range inside
/// `0..items` every load and store the code makes must be inside the buffers
/// `args` points to, with different ranges writing disjoint memory. Callers
/// state which validation established that (for kvjit's ops: the op's
/// argument check, run before any kernel writes).
pub unsafe fn launch<A: KernelArgs>(code: &JitFunction, args: &A, items: usize, ctx: &DeviceContextPtr) {
    // SAFETY: the caller's contract is this function's.
    unsafe { launch_in_parts(code, args, items, ctx, 1) }
}

/// [`launch`] for items of unequal cost, the costlier the later (causal
/// prefill's query blocks: block i attends to i + 1 blocks of keys):
/// [`UNEVEN_PARTS_PER_THREAD`] contiguous ranges per thread, claimed as
/// threads finish theirs, from the last range down — the costliest start
/// first and the cheap ones fill in at the end (longest first). With cost
/// ∝ keys, 2 threads on a 64-block causal prefill claiming the first range
/// first finish 12 % after an even split, the last first at it; measured
/// (Llama-3-8B heads, bf16 cache, 2 threads, alternating runs, medians of
/// 40 calls): a 2048-token prefill 317 → 281 ms, 512 tokens 29.2–33.3 →
/// 28.3–30.6 ms (fastest calls 25.4–29.2 → 24.3–25.1 ms).
///
/// # Safety
///
/// As for [`launch`].
pub unsafe fn launch_uneven<A: KernelArgs>(code: &JitFunction, args: &A, items: usize, ctx: &DeviceContextPtr) {
    // SAFETY: the caller's contract is this function's.
    unsafe { launch_in_parts(code, args, items, ctx, UNEVEN_PARTS_PER_THREAD) }
}

/// [`launch`] with `parts_per_thread` ranges per thread.
///
/// # Safety
///
/// As for [`launch`].
unsafe fn launch_in_parts<A: KernelArgs>(
    code: &JitFunction,
    args: &A,
    items: usize,
    ctx: &DeviceContextPtr,
    parts_per_thread: usize,
) {
    assert!(code.kernel_abi, "{} was not compiled with the kernel ABI", code.name());
    // SAFETY: `compile_kernel` compiled `code` with exactly this signature
    // (pointer, i64, i64; System V) — checked by the flag above — and `code`
    // outlives every call below (they end before this function returns).
    let entry = unsafe { std::mem::transmute::<*const u8, KernelEntry>(code.entry()) };
    // The job must be `'static` to reach the pool's threads: it carries
    // the arguments' address, which `run` below outlives (it returns only
    // once every part has finished, and a part never starts after that).
    let args = std::ptr::from_ref(args).cast::<u64>() as usize;
    let run = move |begin: usize, end: usize| {
        // SAFETY: the caller guarantees every access of the code for a range
        // inside 0..items stays inside the buffers of `args`, and that ranges
        // write disjoint memory; `args` is borrowed for the whole call.
        unsafe { entry(args as *const u64, begin as i64, end as i64) }
    };
    let threads = ctx.cpu_context().map_or(1, |c| c.threads()).min(items).max(1);
    match ctx.cpu_context() {
        Some(cpu) if threads > 1 => {
            // Parts are claimed in index order: part t runs range
            // parts − 1 − t, the last range first.
            let parts = items.min(threads * parts_per_thread);
            cpu.workers().run(parts, move |t| {
                let range = parts - 1 - t;
                run(items * range / parts, items * (range + 1) / parts)
            });
        }
        _ => run(0, items),
    }
}

/// Every compiled CPU kernel in the process, by key.
static KERNELS: LazyLock<KernelCache<JitFunction>> = LazyLock::new(KernelCache::new);

/// The process-wide kernel registry (see the module docs).
pub fn kernels() -> &'static KernelCache<JitFunction> {
    &KERNELS
}

/// The kernel for `key` from the process-wide registry, compiled by `build`
/// on first use ([`CompileCause::GraphBuild`]). A compile that keeps its IR
/// or disassembly (`capture`) bypasses the registry, so the texts always
/// exist (a registered kernel may have been compiled without them).
pub fn compile_or_fetch(
    key: &KernelKey,
    capture: CaptureText,
    build: impl FnOnce() -> Result<JitFunction, JitError>,
) -> Result<Arc<JitFunction>, JitError> {
    if capture.clif || capture.disasm {
        return build().map(Arc::new);
    }
    KERNELS.get_or_compile(key, CompileCause::GraphBuild, build)
}

/// Every CPU kernel compiled in this process so far and why, oldest first.
pub fn compile_log() -> Vec<CompileRecord> {
    KERNELS.log()
}

/// Shapes a generic kernel specializes for, at most, under the seen-shape
/// policy (beyond that it runs its generic code).
pub const MAX_SEEN_SHAPES: usize = 16;

/// The seen-shape policy of one generic kernel: code specialized for each set
/// of run-time dims it has run with, compiled on first sight.
#[derive(Default)]
pub struct SeenShapes {
    compiled: Mutex<HashMap<Vec<usize>, Arc<JitFunction>>>,
}

impl SeenShapes {
    /// An empty policy.
    pub fn new() -> Self {
        Self::default()
    }

    /// The code for a call with the run-time `dims` (named, e.g.
    /// `[("B", 4), ("S", 1)]`): the specialized kernel for them (compiled
    /// through the registry on first sight, `key` naming it and `compile`
    /// making it; the log's cause reads `B=4, S=1 for <generic_key>`), or
    /// `generic` once [`MAX_SEEN_SHAPES`] shapes have been specialized or
    /// when the compile fails (logged).
    pub fn code_for(
        &self,
        dims: &[(&str, usize)],
        generic: (&Arc<JitFunction>, &KernelKey),
        key: &KernelKey,
        compile: impl FnOnce() -> Result<JitFunction, JitError>,
    ) -> Arc<JitFunction> {
        let (generic, generic_key) = generic;
        let sizes: Vec<usize> = dims.iter().map(|&(_, size)| size).collect();
        let mut compiled = self.compiled.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(code) = compiled.get(&sizes) {
            return code.clone();
        }
        if compiled.len() >= MAX_SEEN_SHAPES {
            return generic.clone();
        }
        let named: Vec<String> = dims.iter().map(|(name, size)| format!("{name}={size}")).collect();
        let cause = CompileCause::ShapeSeen(format!("{} for {generic_key}", named.join(", ")));
        match KERNELS.get_or_compile(key, cause, compile) {
            Ok(code) => {
                compiled.insert(sizes, code.clone());
                code
            }
            Err(error) => {
                tracing::warn!(%error, %key, "specializing for a seen shape failed; running the generic kernel");
                generic.clone()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicI64, Ordering};

    use kvjit_core::{DType, Target};

    use crate::ir::addr::element;

    use super::*;

    /// `out[i] = args[1] + i` for every item i of the range (args[0] = out).
    fn fill_kernel(name: &str) -> JitFunction {
        let key = KernelKey::new(name, Target::Cpu, DType::U32);
        compile_kernel(&key, CaptureText::default(), |b, p| {
            let out = p.arg(b, 0);
            let base = p.arg(b, 1);
            crate::ir::counted_loop(b, p.begin, p.end, 1, &[], |b, i, _| {
                let value = b.ins().iadd(base, i);
                let at = element(b, out, i, 8);
                b.ins().store(mem(), value, at, 0);
                Vec::new()
            });
        })
        .unwrap()
    }

    #[test]
    fn launch_covers_every_item_once_for_any_thread_count() {
        let code = fill_kernel("fill_test");
        for threads in [1, 2, 3, 8] {
            let ctx = DeviceContextPtr::cpu(threads).unwrap();
            for items in [0, 1, 2, 7, 64] {
                let out: Vec<AtomicI64> = (0..items + 2).map(|_| AtomicI64::new(-1)).collect();
                let args = [out.as_ptr() as u64, 100];
                // SAFETY: the kernel writes out[i] for i in its range, and
                // every range is inside 0..items < out.len().
                unsafe { launch(&code, &args, items, &ctx) };
                let got: Vec<i64> = out.iter().map(|v| v.load(Ordering::SeqCst)).collect();
                let mut want: Vec<i64> = (0..items as i64).map(|i| 100 + i).collect();
                want.extend([-1, -1]);
                assert_eq!(got, want, "{threads} threads, {items} items");
            }
        }
    }

    /// One kernel per key while it is alive, compiled once; a compile that
    /// keeps its IR bypasses the registry (so the text exists) and is not
    /// shared; code_info reports what the compile kept.
    #[test]
    fn compile_or_fetch_shares_a_kernel_unless_its_text_is_kept() {
        let key = KernelKey::new("compile_or_fetch_test", Target::Cpu, DType::U32);
        let compiles = AtomicI64::new(0);
        let build = |capture: CaptureText| {
            compiles.fetch_add(1, Ordering::SeqCst);
            compile_kernel(&key, capture, |_, _| {})
        };
        let plain = CaptureText::default();
        let first = compile_or_fetch(&key, plain, || build(plain)).unwrap();
        let second = compile_or_fetch(&key, plain, || build(plain)).unwrap();
        assert!(Arc::ptr_eq(&first, &second));
        assert_eq!(compiles.load(Ordering::SeqCst), 1);
        assert_eq!(first.code_info().ir, None);
        let keep = CaptureText { clif: true, disasm: false };
        let kept = compile_or_fetch(&key, keep, || build(keep)).unwrap();
        assert!(!Arc::ptr_eq(&first, &kept));
        assert_eq!(compiles.load(Ordering::SeqCst), 2);
        let info = kept.code_info();
        assert!(info.ir.is_some_and(|ir| ir.contains("return")), "the kept IR");
        assert_eq!((info.code_size, info.disasm), (kept.code_size(), None));
    }

    #[test]
    #[should_panic(expected = "was not compiled with the kernel ABI")]
    fn launch_refuses_a_function_of_another_signature() {
        let f = compile_function("other", &[types::I64], &[], CaptureText::default(), |b, _| {
            b.ins().return_(&[]);
        })
        .unwrap();
        // SAFETY: refused before any call.
        unsafe { launch(&f, &[], 1, &DeviceContextPtr::cpu(1).unwrap()) };
    }
}
