//! JIT-compiling one function and owning its machine code.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use cranelift_codegen::ir::{AbiParam, Signature, Type, Value, types};
use cranelift_codegen::isa::{CallConv, OwnedTargetIsa};
use cranelift_codegen::settings::{self, Configurable};
use cranelift_codegen::{Context, ir};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use cranelift_jit::{JITBuilder, JITModule};
use cranelift_module::{Linkage, Module};

use crate::JitError;

static LIVE_CODE_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Bytes of JIT machine code currently alive in this process (compiled and
/// not yet freed).
pub fn live_code_bytes() -> usize {
    LIVE_CODE_BYTES.load(Ordering::SeqCst)
}

/// The host ISA with native features, at `opt_level=none`; built once.
///
/// Cranelift's IR verifier runs in builds with debug assertions (so in every
/// `cargo test`), or when the environment variable `KVJIT_JIT_VERIFY` is set
/// (not empty, not `0`) when the ISA is first built. Release builds skip it:
/// it runs four times per compile (on entry and after each IR pass), about
/// 2 ms of the 7 ms a compile of the generic fused QKV kernel took.
pub fn host_isa() -> Result<OwnedTargetIsa, JitError> {
    static ISA: OnceLock<Result<OwnedTargetIsa, String>> = OnceLock::new();
    ISA.get_or_init(|| {
        let verify =
            cfg!(debug_assertions) || std::env::var_os("KVJIT_JIT_VERIFY").is_some_and(|v| !v.is_empty() && v != "0");
        let mut flags = settings::builder();
        for (name, value) in
            [("opt_level", "none"), ("is_pic", "false"), ("enable_verifier", if verify { "true" } else { "false" })]
        {
            flags.set(name, value).map_err(|e| format!("{name}={value}: {e}"))?;
        }
        let isa_builder = cranelift_native::builder().map_err(str::to_string)?;
        isa_builder.finish(settings::Flags::new(flags)).map_err(|e| e.to_string())
    })
    .clone()
    .map_err(JitError::Isa)
}

/// The calling convention every JIT function is emitted in: the C convention
/// of `triple`, so the host calls JIT code through `extern "C"` fn pointers
/// and JIT code calls `extern "C"` Rust functions (the micro-kernels, through
/// [`crate::ir::call_native`]) with the same ABI — System V on Linux and
/// macOS x86-64, the Windows x64 convention on Windows, AAPCS64 (Apple's
/// variant on macOS) on AArch64. Hard-coding System V would be a different
/// ABI from `extern "C"` on Windows.
pub fn c_call_conv(triple: &target_lexicon::Triple) -> CallConv {
    CallConv::triple_default(triple)
}

/// The pointer type of the host ISA (I64 on 64-bit hosts).
pub fn pointer_type() -> Type {
    host_isa().map_or(types::I64, |isa| isa.pointer_type())
}

/// Which texts to keep from a compile, for introspection.
#[derive(Clone, Copy, Debug, Default)]
pub struct CaptureText {
    /// Keep the Cranelift IR (CLIF) text.
    pub clif: bool,
    /// Keep the disassembled machine code.
    pub disasm: bool,
}

/// A JIT-compiled function and the module that owns its code. Dropping it
/// frees the code.
pub struct JitFunction {
    // Only touched in `drop`; the mutex makes the owner `Sync`
    // (`JITModule` keeps symbol lookups in a `RefCell`).
    module: Mutex<Option<JITModule>>,
    entry: *const u8,
    name: String,
    code_size: usize,
    compile_time: Duration,
    clif: Option<String>,
    disasm: Option<String>,
    /// Compiled by [`compile_kernel`](crate::compile_kernel) with the kernel
    /// ABI, so [`launch`](crate::launch) may call it.
    pub(crate) kernel_abi: bool,
}

// SAFETY: `entry` points to immutable, finalized machine code that lives as
// long as `self`; the module is only reached through the mutex.
unsafe impl Send for JitFunction {}
// SAFETY: as above; shared access only reads `entry` and the texts.
unsafe impl Sync for JitFunction {}

impl JitFunction {
    /// Address of the compiled code; valid while `self` is alive.
    pub fn entry(&self) -> *const u8 {
        self.entry
    }

    /// The function's symbol name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Machine-code bytes.
    pub fn code_size(&self) -> usize {
        self.code_size
    }

    /// Wall time of IR building plus code generation.
    pub fn compile_time(&self) -> Duration {
        self.compile_time
    }

    /// The Cranelift IR, if captured.
    pub fn clif(&self) -> Option<&str> {
        self.clif.as_deref()
    }

    /// The disassembly, if captured.
    pub fn disasm(&self) -> Option<&str> {
        self.disasm.as_deref()
    }

    /// What a kernel running this code reports
    /// ([`Kernel::code_info`](kvjit_runtime::Kernel::code_info)).
    pub fn code_info(&self) -> kvjit_runtime::CodeInfo {
        kvjit_runtime::CodeInfo {
            compile_time: self.compile_time,
            code_size: self.code_size,
            ir: self.clif.clone(),
            disasm: self.disasm.clone(),
        }
    }
}

impl Drop for JitFunction {
    fn drop(&mut self) {
        let module = self.module.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(module) = module {
            // SAFETY: `entry` is private to this value and every caller
            // borrows `self` for the whole call, so no call into this code can
            // be running or start after drop.
            unsafe { module.free_memory() };
            LIVE_CODE_BYTES.fetch_sub(self.code_size, Ordering::SeqCst);
        }
    }
}

/// Cranelift's per-compile working state: the function being built, its
/// CFG and dominator tree, the register allocator's state, and the
/// frontend's SSA tables. Kept per thread between compiles, so that a
/// compile reuses the last one's buffers instead of allocating them again
/// (about 0.1 ms of a 2.5–4.5 ms fused QKV compile). A thread that has
/// compiled keeps one, as large as the largest function it compiled. Per
/// thread because Cranelift's register-allocator context is not `Send`.
struct Scratch {
    ctx: Context,
    fctx: FunctionBuilderContext,
}

thread_local! {
    static SCRATCH: Cell<Option<Box<Scratch>>> = const { Cell::new(None) };
}

impl Scratch {
    /// This thread's scratch (empty), or a new one if it has none — also
    /// when a compile is already using it further up this thread's stack.
    fn take() -> Box<Scratch> {
        SCRATCH.take().unwrap_or_else(|| Box::new(Scratch { ctx: Context::new(), fctx: FunctionBuilderContext::new() }))
    }

    /// Clear and keep for this thread's next compile. (Dropped instead, on
    /// the error paths that skip this.)
    fn put_back(mut self: Box<Self>) {
        self.ctx.clear();
        SCRATCH.set(Some(self));
    }
}

/// Compile one function `name(params…) -> returns…` in the host's C calling
/// convention ([`c_call_conv`]: callable through an `extern "C"` fn pointer). `build` gets the
/// builder positioned in the entry block and the parameter values, and must
/// emit the whole body including the return.
pub fn compile_function(
    name: &str,
    params: &[Type],
    returns: &[Type],
    capture: CaptureText,
    build: impl FnOnce(&mut FunctionBuilder, &[Value]),
) -> Result<JitFunction, JitError> {
    let started = Instant::now();
    let isa = host_isa()?;
    let mut module = JITModule::new(JITBuilder::with_isa(isa.clone(), cranelift_module::default_libcall_names()));
    let mut sig = Signature::new(c_call_conv(isa.triple()));
    sig.params.extend(params.iter().map(|&t| AbiParam::new(t)));
    sig.returns.extend(returns.iter().map(|&t| AbiParam::new(t)));
    let codegen_error = |message: String| JitError::Codegen { name: name.to_string(), message };
    let id = module.declare_function(name, Linkage::Export, &sig).map_err(|e| codegen_error(e.to_string()))?;

    let mut scratch = Scratch::take();
    let Scratch { ctx, fctx } = &mut *scratch;
    ctx.func.name = ir::UserFuncName::user(0, id.as_u32());
    ctx.func.signature = sig;
    {
        let mut builder = FunctionBuilder::new(&mut ctx.func, fctx);
        let entry = builder.create_block();
        builder.append_block_params_for_function_params(entry);
        builder.switch_to_block(entry);
        builder.seal_block(entry);
        let args = builder.block_params(entry).to_vec();
        build(&mut builder, &args);
        builder.seal_all_blocks();
        builder.finalize(module.target_config());
    }
    let clif = capture.clif.then(|| ctx.func.display().to_string());
    ctx.set_disasm(capture.disasm);
    module.define_function(id, ctx).map_err(|e| codegen_error(format!("{e:?}")))?;
    let compiled = ctx.compiled_code().expect("define_function compiled the function");
    let code_size = compiled.code_buffer().len();
    let disasm = if capture.disasm { compiled.vcode.clone() } else { None };
    scratch.put_back();
    module.finalize_definitions().map_err(|e| codegen_error(e.to_string()))?;
    let entry = module.get_finalized_function(id);
    LIVE_CODE_BYTES.fetch_add(code_size, Ordering::SeqCst);
    Ok(JitFunction {
        module: Mutex::new(Some(module)),
        entry,
        name: name.to_string(),
        code_size,
        compile_time: started.elapsed(),
        clif,
        disasm,
        kernel_abi: false,
    })
}

#[cfg(test)]
mod tests {
    use cranelift_codegen::ir::InstBuilder;

    use super::*;

    #[test]
    fn jit_functions_use_the_c_calling_convention_of_their_target() {
        let conv = |triple: &str| c_call_conv(&triple.parse().unwrap());
        assert_eq!(conv("x86_64-unknown-linux-gnu"), CallConv::SystemV);
        assert_eq!(conv("x86_64-apple-darwin"), CallConv::SystemV);
        assert_eq!(conv("x86_64-pc-windows-msvc"), CallConv::WindowsFastcall);
        assert_eq!(conv("aarch64-unknown-linux-gnu"), CallConv::SystemV);
        assert_eq!(conv("aarch64-apple-darwin"), CallConv::AppleAarch64);
        // The host's: what Rust's `extern "C"` is on this platform.
        let host = host_isa().unwrap();
        let expected = if cfg!(all(windows, target_arch = "x86_64")) {
            CallConv::WindowsFastcall
        } else if cfg!(all(target_vendor = "apple", target_arch = "aarch64")) {
            CallConv::AppleAarch64
        } else {
            CallConv::SystemV
        };
        assert_eq!(c_call_conv(host.triple()), expected);
    }

    #[test]
    fn compiles_calls_and_frees_a_function() {
        let before = live_code_bytes();
        let f = compile_function(
            "add_one",
            &[types::I64],
            &[types::I64],
            CaptureText { clif: true, disasm: true },
            |b, args| {
                let v = b.ins().iadd_imm_s(args[0], 1);
                b.ins().return_(&[v]);
            },
        )
        .unwrap();
        assert!(f.clif().unwrap().contains("iadd"));
        assert!(f.disasm().is_some());
        assert!(live_code_bytes() >= before + f.code_size());
        // SAFETY: the function was compiled with signature (i64) -> i64,
        // System V, and `f` outlives the call.
        let add_one: extern "C" fn(i64) -> i64 = unsafe { std::mem::transmute(f.entry()) };
        assert_eq!(add_one(41), 42);
        drop(f);
    }

    /// `name(x) = x + n`.
    fn add(name: &str, n: i64) -> JitFunction {
        compile_function(name, &[types::I64], &[types::I64], CaptureText { clif: true, disasm: false }, |b, args| {
            let v = b.ins().iadd_imm_s(args[0], n);
            b.ins().return_(&[v]);
        })
        .unwrap()
    }

    fn call(f: &JitFunction, x: i64) -> i64 {
        // SAFETY: every function passed here was compiled with signature
        // (i64) -> i64, System V, and `f` outlives the call.
        let entry: extern "C" fn(i64) -> i64 = unsafe { std::mem::transmute(f.entry()) };
        entry(x)
    }

    #[test]
    fn compiles_reusing_the_threads_scratch_including_nested_and_after_errors() {
        // Each compile on this thread reuses the last one's Context: nothing
        // of the previous function may leak into the next.
        let small = add("first", 1);
        let big = compile_function("sum", &[types::I64], &[types::I64], CaptureText::default(), |b, args| {
            let mut v = args[0];
            for i in 0..200 {
                v = b.ins().iadd_imm_s(v, i);
            }
            b.ins().return_(&[v]);
        })
        .unwrap();
        let after_big = add("after_big", 3);
        assert_eq!((call(&small, 1), call(&big, 0), call(&after_big, 1)), (2, 19900, 4));
        assert_eq!(after_big.clif().unwrap().matches("iadd").count(), 1);

        // A compile started while building another one gets its own scratch.
        let mut inner = None;
        let outer = compile_function("outer", &[types::I64], &[types::I64], CaptureText::default(), |b, args| {
            inner = Some(add("inner", 10));
            let v = b.ins().iadd_imm_s(args[0], 20);
            b.ins().return_(&[v]);
        })
        .unwrap();
        assert_eq!((call(&outer, 1), call(&inner.unwrap(), 1)), (21, 11));

        // Invalid IR (no return value for an i64 return): the verifier, on
        // in builds with debug assertions, rejects it; the next compile is
        // unaffected.
        if cfg!(debug_assertions) {
            let error = compile_function("bad", &[types::I64], &[types::I64], CaptureText::default(), |b, _| {
                b.ins().return_(&[]);
            });
            assert!(matches!(error, Err(JitError::Codegen { .. })), "{:?}", error.err());
            assert_eq!(call(&add("after_error", 5), 1), 6);
        }
    }
}
