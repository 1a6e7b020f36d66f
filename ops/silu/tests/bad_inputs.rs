//! Every bad call is refused with its typed error before a byte of the
//! output is written: a wrong dtype, a strided `x`, an element count other
//! than the one baked in, the wrong arity, an output of the wrong dtype or
//! shape, and (for `run_into`) an output buffer of the wrong length — for
//! the JIT and the reference alike.

mod common;

use std::sync::Arc;

use common::{ctx, jit, random_x, spec};
use kvjit_core::{CacheElement, DType, Error, KvCacheParams, PagedKVCacheCollection};
use kvjit_op::Compiled;
use kvjit_op_silu::{ReferenceKernel, SiluSpec};
use kvjit_runtime::Kernel;
use kvjit_testkit::calls::{Check, poisoned, refused};
use kvjit_testkit::{Guarded, nan_bytes};
use rand::SeedableRng;
use rand::rngs::SmallRng;

fn kernels(spec: SiluSpec) -> [Arc<dyn Kernel>; 2] {
    [Arc::new(Compiled::new(jit(spec))), Arc::new(Compiled::new(ReferenceKernel::new(spec)))]
}

#[test]
fn wrong_dtype_strided_x_and_baked_count_are_refused() {
    let mut rng = SmallRng::seed_from_u64(31);
    let x = random_x(&mut rng, DType::BF16, &[4, 6], 8.0);
    for kernel in kernels(spec(DType::BF16, Some(24))) {
        let f32_x = random_x(&mut rng, DType::F32, &[4, 6], 8.0);
        let err = refused(&*kernel, &[&f32_x], vec![poisoned(DType::BF16, &[4, 6])], Check::Skip);
        assert!(matches!(err, Error::DTypeMismatch { expected: DType::BF16, got: DType::F32, .. }), "{err}");
        assert!(kernel.check(&[&f32_x], &[]).is_err());

        let strided = x.permuted(&[1, 0]).unwrap();
        let err = refused(&*kernel, &[&strided], vec![poisoned(DType::BF16, &[6, 4])], Check::Skip);
        assert!(matches!(err, Error::NotContiguous { .. }), "{err}");
        assert!(kernel.check(&[&strided], &[]).is_err());

        let other = random_x(&mut rng, DType::BF16, &[5, 5], 8.0);
        let err = refused(&*kernel, &[&other], vec![poisoned(DType::BF16, &[5, 5])], Check::Skip);
        assert!(matches!(err, Error::NotBuiltFor { arg: "x", .. }), "{err}");
        assert!(err.to_string().contains("24 elements (baked into silu.cpu.bf16.n24)"), "{err}");
        assert!(kernel.check(&[&other], &[]).is_err());

        // Another shape of the baked count is the same flat run: accepted.
        let mut out = vec![poisoned(DType::BF16, &[2, 12])];
        kernel.run(&[&x.reshaped(&[2, 12]).unwrap()], &mut [], &mut out, &ctx(1)).unwrap();
    }
}

#[test]
fn wrong_arity_and_outputs_are_refused() {
    let mut rng = SmallRng::seed_from_u64(32);
    let x = random_x(&mut rng, DType::F16, &[9], 8.0);
    for kernel in kernels(spec(DType::F16, None)) {
        let out = || poisoned(DType::F16, &[9]);
        for (tensors, outputs) in [(vec![], vec![out()]), (vec![&x, &x], vec![out()]), (vec![&x], vec![out(), out()])] {
            let err = refused(&*kernel, &tensors, outputs, Check::Skip);
            assert!(matches!(err, Error::KernelArguments { .. }), "{err}");
            assert!(err.to_string().contains("1 tensors (x), 0 KV caches and 1 outputs"), "{err}");
        }
        let params =
            KvCacheParams { element: CacheElement::F16, num_layers: 1, page_size: 4, num_kv_heads: 1, head_size: 8 };
        let mut cache = PagedKVCacheCollection::new(params, 2, 1, 1).unwrap();
        let before = out();
        let mut outputs = [out()];
        let err = kernel.run(&[&x], &mut [&mut cache], &mut outputs, &ctx(1)).unwrap_err();
        assert!(matches!(err, Error::KernelArguments { .. }) && outputs[0] == before, "{err}");

        let err = refused(&*kernel, &[&x], vec![poisoned(DType::F32, &[9])], Check::Skip);
        assert!(matches!(&err, Error::DTypeMismatch { arg, .. } if arg == "output"), "{err}");
        let err = refused(&*kernel, &[&x], vec![poisoned(DType::F16, &[3, 3])], Check::Skip);
        assert!(matches!(&err, Error::ShapeMismatch { arg, .. } if arg == "output"), "{err}");
    }
}

#[test]
fn run_into_refuses_a_buffer_of_the_wrong_length_or_a_bad_x() {
    let mut rng = SmallRng::seed_from_u64(33);
    let x = random_x(&mut rng, DType::F32, &[2, 7], 8.0);
    let kernel = jit(spec(DType::F32, Some(14)));
    for (x, len) in [(&x, 13), (&x, 15), (&random_x(&mut rng, DType::F32, &[15], 8.0), 15)] {
        let mut out = Guarded::new(16, &nan_bytes(DType::F32, len), 16);
        let before = out.clone();
        let err = kernel.run_into(&[x], &mut [], out.body_mut(), &ctx(2)).unwrap_err();
        assert!(matches!(err, Error::ByteCount { .. } | Error::NotBuiltFor { .. }), "{err}");
        assert!(out == before, "{len} elements: refused ({err}) but written");
    }
    let mut out = Guarded::new(16, &nan_bytes(DType::F32, 14), 16);
    let bf16_x = random_x(&mut rng, DType::BF16, &[14], 8.0);
    let err = kernel.run_into(&[&bf16_x], &mut [], out.body_mut(), &ctx(1)).unwrap_err();
    assert!(matches!(err, Error::DTypeMismatch { .. }) && out.body() == nan_bytes(DType::F32, 14), "{err}");
}
