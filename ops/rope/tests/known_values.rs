//! Rotations whose results are known exactly: a table made in the test with
//! position 0 the identity, 90° (`(a, b) → (−b, a)`), 180° (negation) and a
//! dyadic (cos, sin) = (0.5, 0.75) whose products are exact in every
//! dtype, so the JIT and the reference must give these very bits; checked
//! for both layouts, every dtype pair, on Q and on K in the cache (V and
//! the other layer untouched).

use kvjit_core::{CacheElement, DType, KvCacheParams, Target, Tensor};
use kvjit_jit::CaptureText;
use kvjit_op::Compiled;
use kvjit_op::checks::StepDims;
use kvjit_op_rope::{JitKernel, ReferenceKernel, RopeSpec};
use kvjit_runtime::{DeviceContextPtr, Kernel};
use kvjit_testkit::{block_index, cache_from_table, u32s};

const D: usize = 8;
/// `(cos, sin)` of positions 0..4.
const ROWS: [(f32, f32); 4] = [(1.0, 0.0), (0.0, 1.0), (-1.0, 0.0), (0.5, 0.75)];

/// x = [1, 2, …, 8] / 8 for head 0, its negation for head 1.
fn head(h: usize) -> [f32; D] {
    std::array::from_fn(|i| if h == 0 { (i + 1) as f32 / 8.0 } else { -((i + 1) as f32) / 8.0 })
}

/// The expected rotation of `x` at position `pos`, written out per layout.
fn expected(x: [f32; D], pos: usize, interleaved: bool) -> [f32; D] {
    let (c, s) = ROWS[pos];
    let mut out = [0.0; D];
    let pairs: Vec<(usize, usize)> = if interleaved {
        (0..D / 2).map(|j| (2 * j, 2 * j + 1)).collect()
    } else {
        (0..D / 2).map(|j| (j, j + D / 2)).collect()
    };
    for (a, b) in pairs {
        out[a] = x[a] * c - x[b] * s;
        out[b] = x[b] * c + x[a] * s;
    }
    out
}

#[test]
fn the_literal_layouts() {
    let x = head(0).map(|v| v * 8.0);
    assert_eq!(expected(x, 1, false), [-5.0, -6.0, -7.0, -8.0, 1.0, 2.0, 3.0, 4.0]);
    assert_eq!(expected(x, 1, true), [-2.0, 1.0, -4.0, 3.0, -6.0, 5.0, -8.0, 7.0]);
    assert_eq!(expected(x, 2, true), x.map(|v| -v));
    assert_eq!(expected(x, 0, false), x);
}

#[test]
fn known_rotations_are_exact_on_every_kernel() {
    let ctx = DeviceContextPtr::cpu(2).unwrap();
    for dtype in DType::FLOATS {
        for cache_dtype in DType::FLOATS {
            for interleaved in [false, true] {
                check(dtype, cache_dtype, interleaved, &ctx);
            }
        }
    }
}

fn check(dtype: DType, cache_dtype: DType, interleaved: bool, ctx: &DeviceContextPtr) {
    // One sequence of 4 tokens from position 0, Hq = 2, Hkv = 2 (both heads
    // get `head(h)`), page size 2 over pages 3 and 1, layers 2 (layer 1).
    let freqs: Vec<f32> = ROWS.iter().flat_map(|&(c, s)| (0..D / 2).flat_map(move |_| [c, s])).collect();
    let freqs = Tensor::from_f32(dtype, &[4, D], &freqs).unwrap();
    let q: Vec<f32> = (0..4).flat_map(|_| [head(0), head(1)].concat()).collect();
    let q = Tensor::from_f32(dtype, &[1, 4, 2, D], &q).unwrap();
    let shape = [4, 2, 2, 2, 2, D];
    let mut cache = cache_from_table(cache_dtype, shape, &[0], &[3, 1, u32::MAX], 3);
    let fill: Vec<f32> = (0..shape.iter().product::<usize>()).map(|i| (i % 13) as f32 / 4.0 - 1.5).collect();
    cache.set_blocks(Tensor::from_f32(cache_dtype, &shape, &fill).unwrap()).unwrap();
    let place = |pos: usize| ([3, 1][pos / 2], pos % 2);
    {
        let mut blocks = cache.blocks().to_f32_vec().unwrap();
        for pos in 0..4 {
            let (page, slot) = place(pos);
            for h in 0..2 {
                let at = block_index(&shape, [page, 0, 1, slot, h, 0]);
                blocks[at..at + D].copy_from_slice(&head(h));
            }
        }
        cache.set_blocks(Tensor::from_f32(cache_dtype, &shape, &blocks).unwrap()).unwrap();
    }
    let spec = RopeSpec {
        target: Target::Cpu,
        dtype,
        cache: KvCacheParams {
            element: CacheElement::new(cache_dtype, None).unwrap(),
            num_layers: 2,
            page_size: 2,
            num_kv_heads: 2,
            head_size: D,
        },
        interleaved,
        num_q_heads: 2,
        step: StepDims { batch: Some(1), seq: Some(4) },
    };
    let jit = Compiled::new(JitKernel::new(spec, CaptureText::default()).unwrap());
    for kernel in [&Compiled::new(ReferenceKernel::new(spec)) as &dyn Kernel, &jit] {
        let what = format!("{} {dtype}/{cache_dtype} interleaved={interleaved}", kernel.implementation());
        let mut cache = cache.clone();
        let mut out = [Tensor::zeros(dtype, &[1, 4, 2, D]).unwrap()];
        let inputs = [&q, &freqs, &Tensor::scalar_u32(1), &u32s(&[4])];
        kernel.run(&inputs, &mut [&mut cache], &mut out, ctx).unwrap();
        let got = out[0].to_f32_vec().unwrap();
        let blocks = cache.blocks().to_f32_vec().unwrap();
        let mut touched = std::collections::HashSet::new();
        for pos in 0..4 {
            let (page, slot) = place(pos);
            for h in 0..2 {
                let want = expected(head(h), pos, interleaved);
                assert_eq!(got[(pos * 2 + h) * D..][..D], want, "{what}: Q at position {pos}, head {h}");
                let at = block_index(&shape, [page, 0, 1, slot, h, 0]);
                assert_eq!(blocks[at..at + D], want, "{what}: K at position {pos}, head {h}");
                touched.extend(at..at + D);
            }
        }
        // Position 0 is the identity bit for bit; everything else in the
        // cache (V, layer 0, other slots and pages) is untouched.
        let before = cache_bytes_of(&shape, cache_dtype, &fill, &touched);
        let size = cache_dtype.size_bytes();
        for (i, want) in before {
            assert_eq!(&cache.blocks().as_bytes()[i * size..(i + 1) * size], &want[..], "{what}: blocks[{i}] changed");
        }
    }
}

/// The bytes of every element of `fill` outside `touched`, by index.
fn cache_bytes_of(
    shape: &[usize; 6],
    dtype: DType,
    fill: &[f32],
    touched: &std::collections::HashSet<usize>,
) -> Vec<(usize, Vec<u8>)> {
    let t = Tensor::from_f32(dtype, shape, fill).unwrap();
    let size = dtype.size_bytes();
    (0..fill.len())
        .filter(|i| !touched.contains(i))
        .map(|i| (i, t.as_bytes()[i * size..(i + 1) * size].to_vec()))
        .collect()
}
