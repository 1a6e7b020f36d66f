//! Structured control flow for emitters: counted loops with carried values
//! ([`counted_loop`]), two-way branches ([`when`], [`if_else`]) and a
//! branch on one of a few values ([`match_cases`]), each leaving the
//! builder in the block after it.

use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::{BlockArg, InstBuilder, Type, Value};
use cranelift_frontend::FunctionBuilder;

/// Emit `for i in (start..end).step_by(step)` with loop-carried values:
/// the header tests `i < end` (signed) and the body jumps back to it (the
/// loop shape Cranelift's x64 lowering handles best). `body` gets the
/// builder in the body block, `i` and the carried values, and returns the
/// carried values for the next iteration. Returns the carried values after
/// the loop.
pub fn counted_loop(
    b: &mut FunctionBuilder,
    start: Value,
    end: Value,
    step: i64,
    carried: &[Value],
    body: impl FnOnce(&mut FunctionBuilder, Value, &[Value]) -> Vec<Value>,
) -> Vec<Value> {
    let index_ty = b.func.dfg.value_type(start);
    let header = b.create_block();
    let body_block = b.create_block();
    let exit = b.create_block();
    b.append_block_param(header, index_ty);
    let carried_types: Vec<Type> = carried.iter().map(|&v| b.func.dfg.value_type(v)).collect();
    for &t in &carried_types {
        b.append_block_param(header, t);
        b.append_block_param(exit, t);
    }
    let args = |i: Value, vals: &[Value]| -> Vec<BlockArg> {
        std::iter::once(i).chain(vals.iter().copied()).map(BlockArg::Value).collect()
    };
    let entry_args = args(start, carried);
    b.ins().jump(header, &entry_args);

    b.switch_to_block(header);
    let params = b.block_params(header).to_vec();
    let (i, vals) = (params[0], params[1..].to_vec());
    let more = b.ins().icmp(IntCC::SignedLessThan, i, end);
    let exit_args: Vec<BlockArg> = vals.iter().copied().map(BlockArg::Value).collect();
    b.ins().brif(more, body_block, &[], exit, &exit_args);

    b.switch_to_block(body_block);
    let next_vals = body(b, i, &vals);
    let next_i = b.ins().iadd_imm_s(i, step);
    let back_args = args(next_i, &next_vals);
    b.ins().jump(header, &back_args);

    b.switch_to_block(exit);
    b.block_params(exit).to_vec()
}

/// Emit `if cond { then }` (`cond` an integer, true when nonzero).
pub fn when(b: &mut FunctionBuilder, cond: Value, then: impl FnOnce(&mut FunctionBuilder)) {
    let (then_block, join) = (b.create_block(), b.create_block());
    b.ins().brif(cond, then_block, &[], join, &[]);
    b.switch_to_block(then_block);
    then(b);
    b.ins().jump(join, &[]);
    b.switch_to_block(join);
}

/// Emit `if cond { then } else { otherwise }` (`cond` an integer, true when
/// nonzero).
pub fn if_else(
    b: &mut FunctionBuilder,
    cond: Value,
    then: impl FnOnce(&mut FunctionBuilder),
    otherwise: impl FnOnce(&mut FunctionBuilder),
) {
    let (then_block, else_block, join) = (b.create_block(), b.create_block(), b.create_block());
    b.ins().brif(cond, then_block, &[], else_block, &[]);
    b.switch_to_block(then_block);
    then(b);
    b.ins().jump(join, &[]);
    b.switch_to_block(else_block);
    otherwise(b);
    b.ins().jump(join, &[]);
    b.switch_to_block(join);
}

/// Emit `match value { c => arm(c), … }` over `cases` (`value` an integer;
/// no arm runs for a value not listed): a chain of equality tests, one per
/// case in order — the shape for a handful of cases, such as the tile
/// heights of a remainder.
pub fn match_cases(
    b: &mut FunctionBuilder,
    value: Value,
    cases: &[usize],
    mut arm: impl FnMut(&mut FunctionBuilder, usize),
) {
    let done = b.create_block();
    for &case in cases {
        let this = b.create_block();
        let next = b.create_block();
        let is_this = b.ins().icmp_imm_s(IntCC::Equal, value, case as i64);
        b.ins().brif(is_this, this, &[], next, &[]);
        b.switch_to_block(this);
        arm(b, case);
        b.ins().jump(done, &[]);
        b.switch_to_block(next);
    }
    b.ins().jump(done, &[]);
    b.switch_to_block(done);
}
