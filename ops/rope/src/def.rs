//! The op's IR definition: parameters, signature, shape rules, kernel key,
//! and the kernels it builds per target.

use kvjit_core::{Backend, DType};
use kvjit_graph::{
    ArgSpec, Dim, GraphBuilder, GraphError, PagedParams, RecipeKind, ValueId, ValueType, input_error,
    paged_cache_input, step_inputs, tensor_input,
};
use kvjit_op::checks::StepDims;
use kvjit_op::{Op, Specialized, add_node};

use crate::{JitKernel, RopeSpec};

/// The op's name in graphs (MAX's).
pub const OP_NAME: &str = "mo.fused_qk_rope.padded.paged";

kvjit_op::params! {
    /// The parameters of a RoPE node, for [`fused_qk_rope`].
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct RopeParams {
        /// Dtype of `q_proj`, `freqs_cis` and the output.
        dtype: DType,
        /// Rotate `(x[2j], x[2j+1])` (GGUF) rather than `(x[j], x[j + D/2])`
        /// (Hugging Face `rotate_half`).
        interleaved: bool,
        /// KV heads Hkv of the cache.
        num_kv_heads: usize,
        /// Head size D (of Q and of the cache).
        head_size: usize,
        /// Tokens per cache page.
        page_size: usize,
    }
}

/// Add a RoPE node to `b`: Q (`q_proj [B, S, Hq, D]`) rotated by position
/// into the returned value (`[B, S, Hq, D]`), and the K of this step's valid
/// tokens rotated in place in `kv_collection` at layer `layer_idx`. The
/// typed form of
/// `b.node(OP_NAME, params, &[q_proj, kv_collection, freqs_cis, layer_idx, valid_lengths])`.
pub fn fused_qk_rope(
    b: &mut GraphBuilder<'_>,
    [q_proj, kv_collection, freqs_cis, layer_idx, valid_lengths]: [ValueId; 5],
    params: RopeParams,
) -> Result<ValueId, GraphError> {
    Ok(add_node::<RopeOp, 5>(b, &params, [q_proj, kv_collection, freqs_cis, layer_idx, valid_lengths])?[0])
}

/// The paged RoPE op. Parameters: `dtype` (f32, bf16, f16), `interleaved`,
/// `num_kv_heads`, `head_size` (even), `page_size`. Inputs:
/// `q_proj [B, S, Hq, D]`, `kv_collection`, `freqs_cis [max_seq, D]`,
/// `layer_idx` (u32 scalar), `valid_lengths [B]` (u32). Output:
/// `output [B, S, Hq, D]`.
#[derive(Clone, Copy, Debug, Default)]
pub struct RopeOp;

/// The argument holding the RoPE table (`[max_seq, D]`: a row per position).
pub const FREQS_CIS: &str = "freqs_cis";

const INPUTS: &[ArgSpec] = &[
    ArgSpec::tensor("q_proj"),
    ArgSpec::KV_COLLECTION,
    ArgSpec::tensor(FREQS_CIS),
    ArgSpec::LAYER_IDX,
    ArgSpec::VALID_LENGTHS,
];

/// Largest head size the CPU kernel serves (its per-row cos/sin table lives
/// on the stack: `8·D` bytes, and for an FP8 cache a dequantized K head,
/// `4·D` more).
pub const MAX_JIT_HEAD_SIZE: usize = 1024;

impl Op for RopeOp {
    const NAME: &'static str = OP_NAME;
    const INPUTS: &'static [ArgSpec] = INPUTS;
    type Params = RopeParams;
    type Spec = RopeSpec;
    type Cpu = JitKernel;

    fn specialize(&self, params: &RopeParams, inputs: &[&ValueType], backend: Backend) -> Specialized<RopeSpec> {
        let RopeParams { dtype, interleaved, num_kv_heads, head_size, page_size } = *params;
        if !dtype.is_compute_float() {
            return Err(GraphError::Param {
                param: "dtype".into(),
                problem: format!("must be f32, bf16 or f16, got {dtype}"),
            });
        }
        if !head_size.is_multiple_of(2) {
            return Err(GraphError::Param {
                param: "head_size".into(),
                problem: format!("must be even (RoPE rotates pairs of elements), got {head_size}"),
            });
        }

        let q = tensor_input(inputs, 0);
        let expected_q = || format!("{dtype}[B, S, Hq, {head_size}] with Hq a multiple of {num_kv_heads}");
        let (batch, seq, num_q_heads) = match q.shape.as_slice() {
            [b, s, Dim::Static(hq), Dim::Static(d)]
                if q.dtype == dtype && *d == head_size && *hq > 0 && hq.is_multiple_of(num_kv_heads) =>
            {
                (b, s, *hq)
            }
            _ => return Err(input_error("q_proj", expected_q(), q)),
        };
        let paged = PagedParams { num_kv_heads, head_size, page_size };
        let cache = paged_cache_input(inputs, 1, paged, batch)?;
        let freqs = tensor_input(inputs, 2);
        if freqs.dtype != dtype || !matches!(freqs.shape.as_slice(), [_, Dim::Static(d)] if *d == head_size) {
            return Err(input_error(FREQS_CIS, format!("{dtype}[max_seq, {head_size}]"), freqs));
        }
        step_inputs(inputs, [3, 4], batch)?;
        Ok(RopeSpec {
            target: backend.target(),
            dtype,
            cache: cache.params(),
            interleaved,
            num_q_heads,
            step: StepDims::of(batch, seq),
        })
    }

    /// Its `freqs_cis` table ([`RopeInit`](crate::RopeInit)).
    fn recipes(&self) -> &'static [RecipeKind] {
        const RECIPES: &[RecipeKind] = &[RecipeKind::of::<crate::RopeInit>()];
        RECIPES
    }
}
