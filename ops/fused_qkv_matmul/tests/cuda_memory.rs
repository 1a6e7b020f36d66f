//! Device memory of the CUDA kernel over fresh contexts (its own test binary,
//! so no other test allocates device memory while the counter is read).
//!
//! Needs a CUDA device: without one it prints `skipped: no CUDA device
//! (<reason>)` (`KVJIT_REQUIRE_CUDA=1` makes that a failure).

use std::sync::Arc;

use kvjit_core::{Backend, CacheElement, CodeTier, DType, KvCacheParams, PagedKVCacheCollection, Tensor};
use kvjit_cuda::live_device_bytes;
use kvjit_op::Compiled;
use kvjit_op::checks::StepDims;
use kvjit_op_fused_qkv::{CudaKernel, FusedQkvSpec, ReferenceKernel, Sizes};
use kvjit_runtime::{DeviceContextPtr, Kernel};
use kvjit_testkit::values::uniform;
use kvjit_testkit::{Tolerance, compare_tensors, cuda_or_skip};
use rand::SeedableRng;
use rand::rngs::StdRng;

/// One call's arguments: B = 2, S = 5 (valid 5 and 2), K = 64, q_dim = 32,
/// Hkv = 2, D = 8, page size 4, f32 throughout, random values.
struct Problem {
    spec: FusedQkvSpec,
    inputs: [Arc<Tensor>; 4],
    cache: PagedKVCacheCollection,
    output: Tensor,
}

fn problem() -> Problem {
    let mut rng = StdRng::seed_from_u64(17);
    let spec = FusedQkvSpec {
        backend: Backend::Cuda,
        dtype: DType::F32,
        weights: DType::F32,
        cache: KvCacheParams { element: CacheElement::F32, num_layers: 2, page_size: 4, num_kv_heads: 2, head_size: 8 },
        k: 64,
        q_dim: 32,
        step: StepDims { batch: None, seq: None },
        sizes: Sizes::Baked,
    };
    let params =
        KvCacheParams { element: CacheElement::F32, num_layers: 2, page_size: 4, num_kv_heads: 2, head_size: 8 };
    let mut cache = PagedKVCacheCollection::new(params, 16, 2, 4).unwrap();
    cache.reserve(&[5, 2]).unwrap();
    cache.set_blocks(uniform(&mut rng, DType::F32, cache.blocks().shape())).unwrap();
    let random = |rng: &mut StdRng, shape: &[usize]| Arc::new(uniform(rng, DType::F32, shape));
    let inputs = [
        random(&mut rng, &[2, 5, 64]),
        random(&mut rng, &[64, 64]),
        Arc::new(Tensor::scalar_u32(1)),
        Arc::new(Tensor::from_vec(&[2], vec![5u32, 2]).unwrap()),
    ];
    let output = Tensor::zeros(DType::F32, &[2, 5, 32]).unwrap();
    Problem { spec, inputs, cache, output }
}

fn run(kernel: &dyn Kernel, p: &Problem, ctx: &DeviceContextPtr) -> (Tensor, PagedKVCacheCollection) {
    let (mut output, mut cache) = (p.output.clone(), p.cache.clone());
    let inputs: Vec<&Tensor> = p.inputs.iter().map(|t| &**t).collect();
    kernel.run(&inputs, &mut [&mut cache], std::slice::from_mut(&mut output), ctx).unwrap();
    (output, cache)
}

/// Within 1e-4 · (1 + |want|): this test is about memory, not accuracy.
fn assert_close(got: &Tensor, want: &Tensor, what: &str) {
    compare_tensors(Tolerance::AbsRel { abs: 1e-4, rel: 1e-4 }, got, want).assert_ok(what);
}

/// A long-lived kernel run on fresh contexts gives its device memory back
/// when each context is dropped (its functions, uploaded weight, scratch and
/// the device's resident cache copy), and a kernel dropped while its context
/// lives frees its own state there. Before the fix each context's state
/// stayed in the kernel (holding the device alive) until the kernel went.
#[test]
fn fresh_contexts_and_dropped_kernels_give_their_device_memory_back() {
    let Some(ctx) = cuda_or_skip() else { return };
    drop(ctx);
    let p = problem();
    let kernel = Compiled::new(CudaKernel::new(p.spec, Some(p.inputs[1].clone())).unwrap());
    let reference =
        Compiled::new(ReferenceKernel::new(FusedQkvSpec { backend: Backend::Cpu(CodeTier::Cranelift), ..p.spec }));
    let (want_out, want_cache) = run(&reference, &p, &DeviceContextPtr::cpu(1).unwrap());
    let baseline = live_device_bytes();
    for round in 0..12 {
        let ctx = DeviceContextPtr::cuda(0).unwrap();
        let (output, cache) = run(&kernel, &p, &ctx);
        assert_close(&output, &want_out, &format!("round {round}: output"));
        assert_close(cache.blocks(), want_cache.blocks(), &format!("round {round}: cache"));
        assert!(live_device_bytes() > baseline, "round {round}: the run allocated nothing on the device?");
        assert_eq!(ctx.kernel_states(), 1, "round {round}");
        drop(ctx);
        assert_eq!(live_device_bytes(), baseline, "round {round}: the dropped context's device memory stayed");
    }

    let ctx = DeviceContextPtr::cuda(0).unwrap();
    run(&kernel, &p, &ctx);
    let with_kernel = live_device_bytes();
    drop(kernel);
    assert_eq!(ctx.kernel_states(), 0, "the dropped kernel's state stayed in the context");
    assert!(live_device_bytes() < with_kernel, "dropping the kernel freed nothing");
    drop(ctx);
    assert_eq!(live_device_bytes(), baseline, "the context's resident cache copy stayed");
}

/// The device copy of a cache is uploaded once, stays current across the
/// kernel's own writes (mirrored into the host), and is uploaded again after
/// any other write to the host blocks — what a device reader of the cache
/// (attention) relies on.
#[test]
fn the_device_cache_is_uploaded_again_only_after_a_host_write() {
    let Some(ctx) = cuda_or_skip() else { return };
    let device = ctx.cuda_context().expect("a CUDA context").device().clone();
    let p = problem();
    let kernel = Compiled::new(CudaKernel::new(p.spec, Some(p.inputs[1].clone())).unwrap());
    let inputs: Vec<&Tensor> = p.inputs.iter().map(|t| &**t).collect();
    let (mut output, mut cache) = (p.output.clone(), p.cache.clone());
    let mut call = |cache: &mut PagedKVCacheCollection| {
        kernel.run(&inputs, &mut [cache], std::slice::from_mut(&mut output), &ctx).unwrap();
        device.kv_cache_uploads()
    };
    let first = call(&mut cache);
    assert_eq!(call(&mut cache), first, "the kernel's own writes left the copy current");
    cache.blocks_bytes_mut()[0] ^= 1; // a host edit
    assert_eq!(call(&mut cache), first + 1, "a host write makes the copy stale");
    let mut other = cache.clone(); // another cache: its own copy
    assert_eq!(call(&mut other), first + 2);
}
