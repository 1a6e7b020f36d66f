//! `launch` and `launch_uneven` run every item exactly once, on pools of
//! any size, including items fewer than the threads and not a multiple of
//! the parts.

use kvjit_core::{DType, KernelKey, Target};
use kvjit_jit::cranelift_codegen::ir::{InstBuilder, types};
use kvjit_jit::ir::{counted_loop, mem};
use kvjit_jit::{CaptureText, JitFunction, compile_kernel};
use kvjit_runtime::DeviceContextPtr;

/// `out[i] += i + 1` for every item i (a u32 counter per item: an item run
/// twice or skipped shows).
fn count_kernel() -> JitFunction {
    let key = KernelKey::new("launch_test", Target::Cpu, DType::U32);
    compile_kernel(&key, CaptureText::default(), |b, p| {
        let output = p.arg(b, 0);
        counted_loop(b, p.begin, p.end, 1, &[], |b, i, _| {
            let at = b.ins().ishl_imm_u(i, 2);
            let dst = b.ins().iadd(output, at);
            let old = b.ins().load(types::I32, mem(), dst, 0);
            let index = b.ins().ireduce(types::I32, i);
            let new = b.ins().iadd(old, index);
            let new = b.ins().iadd_imm_u(new, 1);
            b.ins().store(mem(), new, dst, 0);
            Vec::new()
        });
    })
    .unwrap()
}

#[test]
fn every_item_runs_once_on_any_pool_even_or_uneven() {
    let code = count_kernel();
    for threads in [1, 2, 3, 5] {
        let ctx = DeviceContextPtr::cpu(threads).unwrap();
        for items in [0usize, 1, 2, 3, 7, 19, 64, 1001] {
            for uneven in [false, true] {
                // Poisoned: every slot starts at 7, so each must read 7 + i + 1.
                let mut out = vec![7u32; items + 4];
                let args = [out.as_mut_ptr() as u64];
                // SAFETY: item i reads and writes only out[i]; out holds
                // `items` (+ 4 guard) u32; ranges are disjoint.
                unsafe {
                    if uneven {
                        kvjit_jit::launch_uneven(&code, &args, items, &ctx);
                    } else {
                        kvjit_jit::launch(&code, &args, items, &ctx);
                    }
                }
                let want: Vec<u32> = (0..items as u32).map(|i| 8 + i).chain([7; 4]).collect();
                assert_eq!(out, want, "{threads} threads, {items} items, uneven {uneven}");
            }
        }
    }
}
