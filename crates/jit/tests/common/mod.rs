//! The conversion tests' harness: a JIT loop over two buffers and a call
//! into it.

use kvjit_jit::cranelift_codegen::ir::{InstBuilder, Value, types};
use kvjit_jit::cranelift_frontend::FunctionBuilder;
use kvjit_jit::ir::counted_loop;
use kvjit_jit::{CaptureText, JitFunction, compile_function, pointer_type};

/// `extern "C" fn(src, dst, n)` as compiled by [`kernel`].
type Kernel = extern "C" fn(*const u8, *mut u8, i64);

/// Compile `fn(src, dst, n)` looping `i` over `0..n` in steps of `step`
/// elements; `body` gets the builder, `src + i·src_size`, `dst + i·dst_size`.
pub fn kernel(
    name: &str,
    step: i64,
    src_size: i64,
    dst_size: i64,
    body: impl Fn(&mut FunctionBuilder, Value, Value),
) -> JitFunction {
    let ptr = pointer_type();
    compile_function(name, &[ptr, ptr, types::I64], &[], CaptureText::default(), |b, args| {
        let (src, dst, n) = (args[0], args[1], args[2]);
        let zero = b.ins().iconst(types::I64, 0);
        counted_loop(b, zero, n, step, &[], |b, i, _| {
            let s = b.ins().imul_imm_s(i, src_size);
            let s = b.ins().iadd(src, s);
            let d = b.ins().imul_imm_s(i, dst_size);
            let d = b.ins().iadd(dst, d);
            body(b, s, d);
            vec![]
        });
        b.ins().return_(&[]);
    })
    .unwrap()
}

/// Run a [`kernel`] over `src` (elements of `S`) into `dst` (elements of
/// `D`); `n` is the element count the kernel loops over.
pub fn run<S, D>(f: &JitFunction, src: &[S], dst: &mut [D], n: usize) {
    // SAFETY: every kernel here was compiled by `kernel` with signature
    // (ptr, ptr, i64) -> (), System V, matching `Kernel`; each reads
    // `n·src_size` bytes of `src` and writes `n·dst_size` of `dst`, which the
    // callers size accordingly; `f` outlives the call.
    let call: Kernel = unsafe { std::mem::transmute(f.entry()) };
    call(src.as_ptr().cast(), dst.as_mut_ptr().cast(), n as i64);
}
