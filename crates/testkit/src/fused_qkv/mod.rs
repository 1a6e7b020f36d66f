//! The fused QKV op (`kvjit-op-fused-qkv`) in the kit: its [`Problem`]
//! ([`QkvProblem`]) and its differential checker ([`differential`]).
//!
//! They live here rather than in the op's `tests/` so that the `op_call`
//! fuzz target (its own workspace) can depend on them like on any crate,
//! instead of including test files by `#[path]`.

pub mod differential;

use std::sync::Arc;

use kvjit_core::{CacheElement, DType, KvCacheParams, PagedKVCacheCollection, Tensor};
use kvjit_jit::CaptureText;
use kvjit_op::Compiled;
use kvjit_op::checks::StepDims;
use kvjit_op_fused_qkv::{CudaKernel, FusedQkvSpec, JitKernel, ReferenceKernel, Sizes, reference};
use kvjit_runtime::Kernel;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::poison::poison;
use crate::problem::{Args, Problem, RunResult, named};
use crate::tolerance::Tolerance;
use crate::values::{max_abs_finite, u32s, uniform};
use crate::{Caches, OnTarget, Target};

/// Input tensor names, in the op's argument order (the cache, `kv_cache`,
/// sits between `weight` and `layer_idx`).
pub const INPUTS: [&str; 4] = ["hidden_state", "weight", "layer_idx", "valid_lengths"];
/// The cache's name.
pub const CACHE: &str = "kv_cache";
/// The output's name.
pub const OUTPUT: &str = "output";

/// A random valid fused-QKV call: shapes, cached history, valid lengths and
/// a shuffled page allocation; uniform values in [-1, 1); the cache poisoned
/// with NaN, so every slot the call writes is compared and every other one
/// must stay NaN. K is a multiple of 8, so the CUDA kernel takes it too.
///
/// Tolerances: [`Tolerance::Exact`] on the CPU reference target (the same
/// code as the reference), [`Tolerance::RelativeToScale`] with the case's
/// `max|x| · max|w|` on the JIT and CUDA targets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QkvProblem {
    /// Seed of the values and the page allocation.
    pub seed: u64,
    /// Activation dtype (hidden state, weight, output).
    pub dtype: DType,
    /// Cache dtype.
    pub cache_dtype: DType,
    /// Sequences B.
    pub batch: usize,
    /// Padded length S.
    pub seq: usize,
    /// Hidden size K (a multiple of 8).
    pub k: usize,
    /// Q columns.
    pub q_dim: usize,
    /// KV heads Hkv.
    pub num_kv_heads: usize,
    /// Head size D.
    pub head_size: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Layers L.
    pub num_layers: usize,
    /// The layer written.
    pub layer: u32,
    /// Tokens already cached, per sequence.
    pub history: Vec<u32>,
    /// Valid tokens, per sequence (at most S).
    pub valid: Vec<u32>,
    /// Give the kernels the weight at build (a constant) or not.
    pub const_weight: bool,
    /// Bake B and S into the spec.
    pub static_dims: bool,
}

impl QkvProblem {
    /// The spec for `target`'s device (on the CPU, the widest tier this
    /// CPU runs).
    pub fn spec(&self, device: kvjit_core::Target) -> FusedQkvSpec {
        FusedQkvSpec {
            backend: widest_backend(device),
            dtype: self.dtype,
            weights: self.dtype,
            cache: self.cache_params(),
            k: self.k,
            q_dim: self.q_dim,
            step: StepDims { batch: self.static_dims.then_some(self.batch), seq: self.static_dims.then_some(self.seq) },
            sizes: Sizes::Baked,
        }
    }

    fn cache_params(&self) -> KvCacheParams {
        KvCacheParams {
            element: CacheElement::new(self.cache_dtype, None).expect("the problem's caches are float caches"),
            num_layers: self.num_layers,
            page_size: self.page_size,
            num_kv_heads: self.num_kv_heads,
            head_size: self.head_size,
        }
    }

    fn n(&self) -> usize {
        self.q_dim + 2 * self.num_kv_heads * self.head_size
    }

    fn poisoned_output(&self) -> Tensor {
        let mut output = Tensor::zeros(self.dtype, &[self.batch, self.seq, self.q_dim]).expect("an output");
        poison(&mut output);
        output
    }

    /// Run `kernel` on `args` with a poisoned output.
    fn run_kernel(&self, kernel: &dyn Kernel, args: &mut Args, target: &OnTarget) -> RunResult {
        let Args { tensors, caches } = args;
        let inputs = INPUTS.map(|n| &tensors[n]);
        let cache = caches.get_mut(CACHE).expect("the cache");
        let mut outputs = [self.poisoned_output()];
        kernel.run(&inputs, &mut [cache], &mut outputs, &target.ctx)?;
        let [output] = outputs;
        Ok(named([(OUTPUT, output)]))
    }
}

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

impl Problem for QkvProblem {
    fn generate(rng: &mut StdRng) -> Self {
        let batch = rng.gen_range(1..=3);
        let seq = *[1, 1, 2, 5, 9].choose(rng).expect("seq lengths");
        let page_size = rng.gen_range(1..=6);
        let num_layers = rng.gen_range(1..=3);
        Self {
            seed: rng.r#gen(),
            dtype: *FLOATS.choose(rng).expect("dtypes"),
            cache_dtype: *FLOATS.choose(rng).expect("dtypes"),
            batch,
            seq,
            k: 8 * rng.gen_range(1..=6),
            q_dim: rng.gen_range(1..=20),
            num_kv_heads: rng.gen_range(1..=3),
            head_size: rng.gen_range(1..=9),
            page_size,
            num_layers,
            layer: rng.gen_range(0..num_layers as u32),
            history: (0..batch).map(|_| rng.gen_range(0..=2 * page_size as u32)).collect(),
            valid: (0..batch).map(|_| rng.gen_range(0..=seq as u32)).collect(),
            const_weight: rng.gen_bool(0.5),
            static_dims: rng.gen_bool(0.5),
        }
    }

    fn inputs(&self) -> Args {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let hidden = uniform(&mut rng, self.dtype, &[self.batch, self.seq, self.k]);
        let weight = uniform(&mut rng, self.dtype, &[self.n(), self.k]);
        let params = self.cache_params();
        let max_pages_per_seq = (2 * self.page_size + self.seq).div_ceil(self.page_size) + 1;
        let num_pages = self.batch * max_pages_per_seq + 2;
        let mut cache = PagedKVCacheCollection::new(params, num_pages, self.batch, max_pages_per_seq)
            .expect("a cache of this layout");
        let mut order: Vec<u32> = (0..num_pages as u32).collect();
        order.shuffle(&mut rng);
        cache.set_allocation_order(order).expect("a permutation");
        cache.reserve(&self.history).expect("pages for the history");
        cache.advance(&self.history).expect("history");
        cache.reserve(&self.valid).expect("pages for the valid tokens");
        cache.fill_blocks_f32(f32::NAN).expect("a float cache");
        let tensors = named([
            (INPUTS[0], hidden),
            (INPUTS[1], weight),
            (INPUTS[2], Tensor::scalar_u32(self.layer)),
            (INPUTS[3], u32s(&self.valid)),
        ]);
        Args { tensors, caches: Caches::from([(CACHE.to_string(), cache)]) }
    }

    fn reference(&self, args: &mut Args) -> RunResult {
        let Args { tensors, caches } = args;
        let [hidden, weight, layer, valid] = INPUTS.map(|n| &tensors[n]);
        let cache = caches.get_mut(CACHE).expect("the cache");
        let mut output = self.poisoned_output();
        reference::fused_qkv_matmul(hidden, weight, cache, layer, valid, &mut output)?;
        Ok(named([(OUTPUT, output)]))
    }

    fn run(&self, target: &OnTarget, args: &mut Args) -> RunResult {
        let spec = self.spec(target.target.device());
        let weight = self.const_weight.then(|| Arc::new(args.tensor(INPUTS[1]).clone()));
        match target.target {
            Target::CpuJit => {
                let kernel = JitKernel::new(spec, weight, CaptureText::default())?;
                self.run_kernel(&Compiled::new(kernel), args, target)
            }
            Target::CpuReference => self.run_kernel(&Compiled::new(ReferenceKernel::new(spec)), args, target),
            Target::Cuda => {
                let kernel = CudaKernel::new(spec, weight)?;
                self.run_kernel(&Compiled::new(kernel), args, target)
            }
        }
    }

    fn tolerance(&self, target: Target, args: &Args, name: &str) -> Tolerance {
        let dtype = if name == CACHE { self.cache_dtype } else { self.dtype };
        match target {
            Target::CpuReference => Tolerance::Exact,
            Target::CpuJit | Target::Cuda => {
                let scale = max_abs_finite(args.tensor(INPUTS[0])) * max_abs_finite(args.tensor(INPUTS[1]));
                Tolerance::RelativeToScale { dtype, k: self.k, scale }
            }
        }
    }
}

/// The backend of `device`: CUDA, or the CPU on the widest tier it runs
/// (resolved here, at the kit's build boundary).
pub fn widest_backend(device: kvjit_core::Target) -> kvjit_core::Backend {
    match device {
        kvjit_core::Target::Cpu => kvjit_core::Backend::Cpu(
            kvjit_jit::microkernel::resolve_tier(kvjit_core::CpuTier::Auto)
                .expect("the automatic tier always resolves"),
        ),
        kvjit_core::Target::Cuda => kvjit_core::Backend::Cuda,
    }
}
