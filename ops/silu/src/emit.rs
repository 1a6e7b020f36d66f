//! The `mo.silu` arithmetic on one `F32X4` vector is the shared
//! [`kvjit_jit::ir::math::silu_f32x4`] (the fused GEMM epilogues use the
//! same code, so fused and unfused results agree bit for bit in f32); the
//! platform's elementwise map ([`kvjit_op::elementwise::compile_map`])
//! loads each vector from the dtype and rounds it once on the store.

pub(crate) use kvjit_jit::ir::math::silu_f32x4;
