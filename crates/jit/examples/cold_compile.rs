//! Cold-start JIT latency: how long the first kernels compiled in a fresh
//! process take, and where that time goes.
//!
//! The kernel is a stand-in with the shape of the generic fused QKV kernel
//! (`fused_qkv_bshd_paged…k4096.q4096.hkv8.d128…bany.sany`, the one
//! `kvjit run` compiles): a block/panel/row-group loop nest, 3 segments,
//! 4×8 f32 FMA tiles with a 4× unrolled k loop plus the 1-, 2- and 3-row
//! remainder tiles, and the Q / paged-K/V epilogues — about 7 KB of code.
//!
//! Modes (the first argument; every run must be a fresh process, since only
//! the first compile in a process is cold):
//!
//! - `api` (default): three compiles through [`kvjit_jit::compile_kernel`],
//!   each with its `compile_time()` (what the kernel cache logs) split into
//!   Cranelift's passes (verifier, lowering, register allocation, the rest)
//!   and everything else (building the IR, ISA, module, finalizing), and the
//!   page faults it took.
//! - `warm`: the same after a candidate warm-up (the host ISA and a small
//!   kernel compiled and freed) ran on a background thread while the main
//!   thread did 30 ms of other start-up work.
//! - `warm-inline`: the same with the warm-up on the main thread, the one
//!   that compiles, before the 30 ms.
//! - `phases`: the bare Cranelift pipeline, step by step: host ISA,
//!   `JITModule::new`, declare, IR build, one verifier pass, codegen (with an
//!   ISA that does not verify), finalize.
//!
//! The second argument picks the kernel: `generic` (default) or `decode`
//! (specialized for B = S = 1: one leftover-row tile instead of three).
//!
//! ```text
//! cargo build --release -p kvjit-jit --example cold_compile
//! for i in $(seq 15); do target/release/examples/cold_compile api; done
//! for i in $(seq 15); do target/release/examples/cold_compile api decode; done
//! for i in $(seq 5); do target/release/examples/cold_compile phases; done
//! ```

use std::any::Any;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use cranelift_codegen::ir::{self, AbiParam, InstBuilder, Signature, Value, condcodes::IntCC, types};
use cranelift_codegen::isa::CallConv;
use cranelift_codegen::settings::{self, Configurable};
use cranelift_codegen::timing::{self, Pass, Profiler};
use cranelift_codegen::{Context, verify_function};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use cranelift_jit::{JITBuilder, JITModule};
use cranelift_module::{Linkage, Module};
use kvjit_core::{DType, KernelKey, Target};
use kvjit_jit::ir::{counted_loop, load_f32x4_raw, load_splat_f32x4, mem, store_f32x4};
use kvjit_jit::{CaptureText, KernelParams, compile_kernel};

const NR: usize = 8;
const MR: usize = 4;
const MC: i64 = 64;
const K_UNROLL: usize = 4;

/// The kernel's sizes: Llama-3-8B's QKV projection.
struct Shape {
    /// Rows, when the key fixes them (`None`: symbolic, so the kernel has
    /// tiles for 1, 2 and 3 leftover rows too).
    m: Option<usize>,
    k: usize,
    q_dim: usize,
    kv_dim: usize,
    dtype: DType,
    kv_stride: i64,
}

/// The shape named by the second argument: `generic` (default; B and S
/// symbolic, as `kvjit run` compiles it) or `decode` (specialized for
/// B = S = 1, as the compile-latency bench's one-node case).
fn shape() -> Shape {
    let m = match std::env::args().nth(2).as_deref() {
        None | Some("generic") => None,
        Some("decode") => Some(1),
        Some(other) => panic!("unknown shape {other}: generic or decode"),
    };
    Shape { m, k: 4096, q_dim: 4096, kv_dim: 1024, dtype: DType::F32, kv_stride: 16 * 1024 }
}

/// Emit the kernel body (the fused QKV kernel's loop nest and tiles).
fn emit(b: &mut FunctionBuilder, p: KernelParams, s: &Shape) {
    let [x, w, out, blocks, row_offsets, m_arg] = [0, 1, 2, 3, 4, 5].map(|i| p.arg(b, i));
    let m = match s.m {
        Some(m) => b.ins().iconst(types::I64, m as i64),
        None => m_arg,
    };
    let zero = b.ins().iconst(types::I64, 0);
    counted_loop(b, zero, m, MC, &[], |b, block_start, _| {
        let block_end = b.ins().iadd_imm_s(block_start, MC);
        let block_end = b.ins().smin(block_end, m);
        let mut first_panel = 0;
        for (destination, columns) in [(0, s.q_dim), (1, s.kv_dim), (2, s.kv_dim)] {
            let panels = columns.div_ceil(NR);
            let lo = b.ins().iconst(types::I64, first_panel as i64);
            let lo = b.ins().smax(lo, p.begin);
            let hi = b.ins().iconst(types::I64, (first_panel + panels) as i64);
            let hi = b.ins().smin(hi, p.end);
            counted_loop(b, lo, hi, 1, &[], |b, index, _| {
                let offset = b.ins().imul_imm_s(index, (s.k * NR * s.dtype.size_bytes()) as i64);
                let panel_w = b.ins().iadd(w, offset);
                let rel = b.ins().iadd_imm_s(index, -(first_panel as i64));
                let column = b.ins().imul_imm_s(rel, NR as i64);
                let tile = |b: &mut FunctionBuilder, mr: usize, row: Value| {
                    emit_tile(b, s, mr, row, [x, panel_w, out, blocks, row_offsets, column], destination);
                };
                let rows = b.ins().isub(block_end, block_start);
                let whole = b.ins().band_imm_s(rows, !(MR as i64 - 1));
                let full_end = b.ins().iadd(block_start, whole);
                counted_loop(b, block_start, full_end, MR as i64, &[], |b, row, _| {
                    tile(b, MR, row);
                    Vec::new()
                });
                let rest = b.ins().isub(block_end, full_end);
                let remainders: Vec<usize> = match s.m {
                    Some(m) => Some(m % MR).filter(|&r| r > 0).into_iter().collect(),
                    None => (1..MR).collect(),
                };
                kvjit_jit::ir::match_cases(b, rest, &remainders, |b, mr| tile(b, mr, full_end));
                Vec::new()
            });
            first_panel += panels;
        }
        Vec::new()
    });
}

/// An `mr`×NR register tile over all of k, then its epilogue.
fn emit_tile(b: &mut FunctionBuilder, s: &Shape, mr: usize, row: Value, bases: [Value; 6], destination: u8) {
    let [x, w, out, blocks, row_offsets, column] = bases;
    let size = s.dtype.size_bytes() as i32;
    let sets = [4, 4, 2, 1, 1][mr];
    let zero = b.ins().f32const(0.0);
    let zero = b.ins().splat(types::F32X4, zero);
    let row_offset = b.ins().imul_imm_s(row, (s.k * 4) as i64);
    let x_rows = b.ins().iadd(x, row_offset);
    let acc_index = |set: usize, i: usize, h: usize| (set * mr + i) * 2 + h;
    let step = |b: &mut FunctionBuilder, kk: Value, count: usize, accs: &mut [Value]| {
        let x_off = b.ins().ishl_imm_u(kk, 2);
        let x_at = b.ins().iadd(x_rows, x_off);
        let w_off = b.ins().imul_imm_s(kk, (NR as i32 * size) as i64);
        let w_at = b.ins().iadd(w, w_off);
        for u in 0..count {
            let halves = [
                load_f32x4_raw(b, s.dtype, w_at, (u * NR) as i32 * size),
                load_f32x4_raw(b, s.dtype, w_at, (u * NR + 4) as i32 * size),
            ];
            for i in 0..mr {
                for (h, &wv) in halves.iter().enumerate() {
                    let xb = load_splat_f32x4(b, DType::F32, x_at, ((i * s.k + u) * 4) as i32);
                    let acc = &mut accs[acc_index(u % sets, i, h)];
                    *acc = b.ins().fma(xb, wv, *acc);
                }
            }
        }
    };
    let start = b.ins().iconst(types::I64, 0);
    let end = b.ins().iconst(types::I64, (s.k - s.k % K_UNROLL) as i64);
    let mut accs = counted_loop(b, start, end, K_UNROLL as i64, &vec![zero; sets * mr * 2], |b, kk, carried| {
        let mut accs = carried.to_vec();
        step(b, kk, K_UNROLL, &mut accs);
        accs
    });
    for set in 1..sets {
        for i in 0..mr {
            for h in 0..2 {
                accs[acc_index(0, i, h)] = b.ins().fadd(accs[acc_index(0, i, h)], accs[acc_index(set, i, h)]);
            }
        }
    }
    for i in 0..mr {
        let r = b.ins().iadd_imm_s(row, i as i64);
        let (base, after) = if destination == 0 {
            let element = b.ins().imul_imm_s(r, s.q_dim as i64);
            let element = b.ins().iadd(element, column);
            let bytes = b.ins().imul_imm_s(element, size as i64);
            (b.ins().iadd(out, bytes), None)
        } else {
            let slot_at = b.ins().ishl_imm_u(r, 3);
            let slot_at = b.ins().iadd(row_offsets, slot_at);
            let slot = b.ins().load(types::I64, mem(), slot_at, 0);
            let store = b.create_block();
            let after = b.create_block();
            let writes = b.ins().icmp_imm_s(IntCC::SignedGreaterThanOrEqual, slot, 0);
            b.ins().brif(writes, store, &[], after, &[]);
            b.switch_to_block(store);
            let element = b.ins().iadd_imm_s(slot, if destination == 2 { s.kv_stride } else { 0 });
            let element = b.ins().iadd(element, column);
            let bytes = b.ins().imul_imm_s(element, size as i64);
            (b.ins().iadd(blocks, bytes), Some(after))
        };
        for h in 0..2 {
            let value = accs[acc_index(0, i, h)];
            store_f32x4(b, s.dtype, value, base, 4 * h as i32 * size);
        }
        if let Some(after) = after {
            b.ins().jump(after, &[]);
            b.switch_to_block(after);
        }
    }
}

/// Minor page faults of this process so far (Linux; 0 elsewhere): each is
/// a first touch of a fresh page (heap growth, new mmaps, code pages).
fn minor_faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesized command name; minflt is field 10.
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    after_name.split_whitespace().nth(7).and_then(|f| f.parse().ok()).unwrap_or(0)
}

fn ms(d: Duration) -> String {
    format!("{:7.3}", d.as_secs_f64() * 1e3)
}

fn key(i: usize) -> KernelKey {
    KernelKey::new(&format!("cold_compile_{i}"), Target::Cpu, DType::F32)
}

/// A Cranelift profiler that sums each pass's own time (children excluded)
/// on this thread, at full resolution (Cranelift's default one prints whole
/// milliseconds).
struct SelfTimes;

thread_local! {
    static OPEN: RefCell<Vec<(Pass, Instant, Duration)>> = const { RefCell::new(Vec::new()) };
    static SELF_TIME: RefCell<BTreeMap<&'static str, Duration>> = const { RefCell::new(BTreeMap::new()) };
}

struct PassToken;

impl Profiler for SelfTimes {
    fn start_pass(&self, pass: Pass) -> Box<dyn Any> {
        OPEN.with_borrow_mut(|open| open.push((pass, Instant::now(), Duration::ZERO)));
        Box::new(PassToken)
    }
}

impl Drop for PassToken {
    fn drop(&mut self) {
        OPEN.with_borrow_mut(|open| {
            let (pass, start, children) = open.pop().expect("a pass is open");
            let total = start.elapsed();
            SELF_TIME.with_borrow_mut(|t| *t.entry(pass.description()).or_default() += total - children);
            if let Some(parent) = open.last_mut() {
                parent.2 += total;
            }
        });
    }
}

/// This thread's pass times since the last call: the verifier, lowering,
/// register allocation, and the other passes (CFG, dominator tree,
/// unreachable code, constant phis, emission).
fn take_pass_times() -> [(&'static str, Duration); 4] {
    let times = SELF_TIME.with_borrow_mut(std::mem::take);
    let get = |desc: &str| times.get(desc).copied().unwrap_or_default();
    let [verify, lower, regalloc] = ["Verify Cranelift IR", "VCode lowering", "Register allocation"].map(get);
    let all: Duration = times.values().sum();
    [("verify", verify), ("lower", lower), ("regalloc", regalloc), ("other", all - verify - lower - regalloc)]
}

/// Three compiles through the public API; prints each `compile_time()` and
/// Cranelift's passes within it (the rest — "ir+setup" — is building the
/// IR, the ISA, the module and finalizing).
fn api(label: &str, process_start: Instant) {
    let shape = shape();
    timing::set_thread_profiler(Box::new(SelfTimes));
    for i in 0..3 {
        let faults_before = minor_faults();
        let f = compile_kernel(&key(i), CaptureText::default(), |b, p| emit(b, p, &shape)).unwrap();
        let faults = minor_faults() - faults_before;
        let passes = take_pass_times();
        let in_passes: Duration = passes.iter().map(|p| p.1).sum();
        let mut line = format!(
            "{label} compile{}: total {} ms = ir+setup {}",
            i + 1,
            ms(f.compile_time()),
            ms(f.compile_time() - in_passes)
        );
        for (name, d) in passes {
            line += &format!(" {name} {}", ms(d));
        }
        println!("{line} | faults {faults} ({} B)", f.code_size());
    }
    println!("{label} process {} ms", ms(process_start.elapsed()));
}

/// The bare Cranelift pipeline (what `compile_function` does), each step
/// timed.
fn phases() {
    let shape = shape();
    let mut verifier_off = None;
    for i in 0..3 {
        let mut t = Instant::now();
        let mut lap = || {
            let now = Instant::now();
            let d = now - t;
            t = now;
            d
        };
        let isa = kvjit_jit::host_isa().unwrap();
        let d_isa = lap();
        // Built outside the timings: the same ISA without the verifier, so
        // that codegen can be timed apart from verification.
        let quiet = verifier_off
            .get_or_insert_with(|| {
                let mut flags = settings::builder();
                for (name, value) in [("opt_level", "none"), ("is_pic", "false"), ("enable_verifier", "false")] {
                    flags.set(name, value).unwrap();
                }
                cranelift_native::builder().unwrap().finish(settings::Flags::new(flags)).unwrap()
            })
            .clone();
        lap();
        let mut module = JITModule::new(JITBuilder::with_isa(quiet, cranelift_module::default_libcall_names()));
        let d_module = lap();
        let ptr = isa.pointer_type();
        let mut sig = Signature::new(CallConv::triple_default(isa.triple()));
        sig.params.extend([ptr, types::I64, types::I64].map(AbiParam::new));
        let id = module.declare_function(&format!("k{i}"), Linkage::Export, &sig).unwrap();
        let d_declare = lap();
        let mut ctx = Context::new();
        ctx.func = ir::Function::with_name_signature(ir::UserFuncName::user(0, id.as_u32()), sig);
        let mut fctx = FunctionBuilderContext::new();
        {
            let mut b = FunctionBuilder::new(&mut ctx.func, &mut fctx);
            let entry = b.create_block();
            b.append_block_params_for_function_params(entry);
            b.switch_to_block(entry);
            b.seal_block(entry);
            let &[args, begin, end] = b.block_params(entry) else { unreachable!() };
            emit(&mut b, KernelParams { args, begin, end }, &shape);
            b.ins().return_(&[]);
            b.seal_all_blocks();
            b.finalize(module.target_config());
        }
        let d_ir = lap();
        let insts = ctx.func.dfg.num_insts();
        verify_function(&ctx.func, &*isa).unwrap();
        let d_verify = lap();
        module.define_function(id, &mut ctx).unwrap();
        let d_codegen = lap();
        let code = ctx.compiled_code().unwrap().code_buffer().len();
        module.finalize_definitions().unwrap();
        let _entry = module.get_finalized_function(id);
        let d_finalize = lap();
        let total = d_isa + d_module + d_declare + d_ir + d_verify + d_codegen + d_finalize;
        println!(
            "compile{}: isa {} module {} declare {} ir {} verify {} codegen {} finalize {} | total {} ms ({insts} insts, {code} B)",
            i + 1,
            ms(d_isa),
            ms(d_module),
            ms(d_declare),
            ms(d_ir),
            ms(d_verify),
            ms(d_codegen),
            ms(d_finalize),
            ms(total),
        );
        // SAFETY: nothing called the module's code or keeps a pointer to it.
        unsafe { module.free_memory() };
    }
}

/// A candidate warm-up: build the host ISA and compile (then free) a small
/// kernel — a loop of f32x4 loads, an FMA and a store. Returns its time.
fn warm_up() -> Duration {
    let started = Instant::now();
    let small = compile_kernel(&key(99), CaptureText::default(), |b, p| {
        let src = p.arg(b, 0);
        let acc = kvjit_jit::ir::splat_f32(b, 0.0);
        counted_loop(b, p.begin, p.end, 1, &[acc], |b, i, carried| {
            let at = b.ins().imul_imm_s(i, 16);
            let at = b.ins().iadd(src, at);
            let x = load_f32x4_raw(b, DType::F32, at, 0);
            let acc = b.ins().fma(x, x, carried[0]);
            store_f32x4(b, DType::F32, acc, at, 0);
            vec![acc]
        });
    });
    drop(small.unwrap());
    started.elapsed()
}

/// Spin for 30 ms: the other start-up work (graph building, weights).
fn other_start_up_work() {
    let busy = Instant::now();
    while busy.elapsed() < Duration::from_millis(30) {
        std::hint::spin_loop();
    }
}

fn main() {
    let process_start = Instant::now();
    match std::env::args().nth(1).as_deref().unwrap_or("api") {
        "api" => api("api", process_start),
        "warm" => {
            let warm = std::thread::spawn(warm_up);
            other_start_up_work();
            let took = warm.join().unwrap();
            println!("warm-up (background thread) {} ms", ms(took));
            api("warm", process_start);
        }
        "warm-inline" => {
            let took = warm_up();
            println!("warm-up (main thread) {} ms", ms(took));
            other_start_up_work();
            api("warm-inline", process_start);
        }
        "phases" => phases(),
        other => panic!("unknown mode {other}: api, warm, warm-inline or phases"),
    }
}
