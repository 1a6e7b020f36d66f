//! Small hand-computed cases that pin the op contract (DESIGN.md, "The op
//! contract"): where Q, K and V go, for which rows, in which dtype.
//!
//! Most cases use a *selection* weight: `W[n, k] = 1` iff `k == (n + 1) % K`,
//! so `C[b, t, n] = x(b, t, (n + 1) % K)`, with the hidden state holding its
//! own row-major index plus one, `x(b, t, k) = 1 + k + K·(t + S·b)`. Every
//! value is a small integer (exact in f32, bf16 and f16), and a column read
//! from `W` instead of `Wᵀ` selects `(n - 1) % K` and shows up at once. The
//! (page, slot) every valid token lands in is written out by hand in each test.

use std::collections::HashMap;

use kvjit_core::{CacheElement, DType, Error, PagedKVCacheCollection, Tensor, UNASSIGNED_PAGE, bf16, f16};
use kvjit_op::checks::StepArgs;
use kvjit_op_fused_qkv::{CallShape, check_call, reference::fused_qkv_matmul};
use kvjit_testkit::{Expect, assert_cache, block_index, blocks_shape, cache_from_table, poison_all, u32s};

const U: u32 = UNASSIGNED_PAGE;

/// One hand-built call with a selection weight (see the file docs).
#[derive(Clone, Debug)]
struct Case {
    dtype: DType,
    cache_dtype: DType,
    batch: usize,
    seq: usize,
    k: usize,
    q_dim: usize,
    hkv: usize,
    d: usize,
    layers: usize,
    page_size: usize,
    num_pages: usize,
    max_pages: usize,
    cache_lengths: Vec<u32>,
    table: Vec<u32>,
    valid: Vec<u32>,
    layer: u32,
}

/// A finished call: what came back and what the buffers hold now.
struct Ran {
    shape: CallShape,
    output: Tensor,
    cache: PagedKVCacheCollection,
    /// The cache blocks as they were just before the call (all NaN).
    poisoned: Vec<u8>,
}

impl Case {
    /// A one-layer f32 case; tests override the fields they care about.
    fn f32(batch: usize, seq: usize, q_dim: usize, hkv: usize, d: usize) -> Self {
        let n = q_dim + 2 * hkv * d;
        Self {
            dtype: DType::F32,
            cache_dtype: DType::F32,
            batch,
            seq,
            k: n,
            q_dim,
            hkv,
            d,
            layers: 1,
            page_size: 4,
            num_pages: 1,
            max_pages: 1,
            cache_lengths: vec![0; batch],
            table: vec![U; batch],
            valid: vec![seq as u32; batch],
            layer: 0,
        }
    }

    fn kv_dim(&self) -> usize {
        self.hkv * self.d
    }

    fn n(&self) -> usize {
        self.q_dim + 2 * self.kv_dim()
    }

    fn x(&self, b: usize, t: usize, k: usize) -> f64 {
        (1 + k + self.k * (t + self.seq * b)) as f64
    }

    /// `C[b, t, n]` for the selection weight.
    fn c(&self, b: usize, t: usize, n: usize) -> f64 {
        self.x(b, t, (n + 1) % self.k)
    }

    fn shape(&self) -> [usize; 6] {
        blocks_shape(self.num_pages, self.layers, self.page_size, self.hkv, self.d)
    }

    fn hidden(&self) -> Tensor {
        let (b, s, k) = (self.batch, self.seq, self.k);
        let mut values = Vec::with_capacity(b * s * k);
        for bi in 0..b {
            for t in 0..s {
                for ki in 0..k {
                    values.push(self.x(bi, t, ki) as f32);
                }
            }
        }
        Tensor::from_f32(self.dtype, &[b, s, k], &values).unwrap()
    }

    fn weight(&self) -> Tensor {
        let (n, k) = (self.n(), self.k);
        let mut values = vec![0f32; n * k];
        for row in 0..n {
            values[row * k + (row + 1) % k] = 1.0;
        }
        Tensor::from_f32(self.dtype, &[n, k], &values).unwrap()
    }

    fn cache(&self) -> PagedKVCacheCollection {
        cache_from_table(self.cache_dtype, self.shape(), &self.cache_lengths, &self.table, self.max_pages)
    }

    /// Run the op on NaN-poisoned buffers. Also checks that the call left the
    /// cache's bookkeeping (lengths, page table) alone.
    fn run(&self) -> Ran {
        let mut cache = self.cache();
        let mut output = Tensor::zeros(self.dtype, &[self.batch, self.seq, self.q_dim]).unwrap();
        let poisoned = poison_all(&mut output, &mut cache);
        let (table, lengths) = (cache.lookup_table().to_vec(), cache.cache_lengths().to_vec());
        let shape = fused_qkv_matmul(
            &self.hidden(),
            &self.weight(),
            &mut cache,
            &Tensor::scalar_u32(self.layer),
            &u32s(&self.valid),
            &mut output,
        )
        .unwrap();
        assert_eq!(cache.cache_lengths(), lengths, "the op changed cache_lengths");
        assert_eq!(cache.lookup_table(), table, "the op changed the lookup table");
        Ran { shape, output, cache, poisoned }
    }

    /// Assert the Q output of every row (padded ones included) and that the
    /// cache holds exactly the K/V of the tokens in `writes`, given as
    /// `(b, t, physical page, slot)`, and nothing else changed.
    fn check(&self, ran: &Ran, writes: &[(usize, usize, usize, usize)]) {
        let out = ran.output.to_f32_vec().unwrap();
        for b in 0..self.batch {
            for t in 0..self.seq {
                for n in 0..self.q_dim {
                    let got = out[(b * self.seq + t) * self.q_dim + n];
                    assert_eq!(got as f64, self.c(b, t, n), "output[{b}, {t}, {n}]");
                }
            }
        }
        let shape = self.shape();
        let mut expected = HashMap::new();
        for &(b, t, page, slot) in writes {
            for kv in 0..2 {
                for h in 0..self.hkv {
                    for d in 0..self.d {
                        let n = self.q_dim + kv * self.kv_dim() + h * self.d + d;
                        let idx = block_index(&shape, [page, kv, self.layer as usize, slot, h, d]);
                        let value = Expect::exact(self.c(b, t, n));
                        assert!(expected.insert(idx, value).is_none(), "writes overlap");
                    }
                }
            }
        }
        assert_cache(ran.cache.blocks(), &ran.poisoned, &expected, &format!("{self:?}"));
    }
}

#[test]
fn explicit_small_matmul_uses_the_weight_transposed() {
    // X [1, 2, 3], W [4, 3], Hkv = D = 1 so q_dim = 2, N = 4; one page of 16.
    let hidden = Tensor::from_f32(DType::F32, &[1, 2, 3], &[1., 2., 3., 4., 5., 6.]).unwrap();
    #[rustfmt::skip]
    let weight = Tensor::from_f32(DType::F32, &[4, 3], &[
        1., 0., 0.,
        0., 1., 1.,
        2., 0., -1.,
        1., 1., 1.,
    ]).unwrap();
    // C = X·Wᵀ: row 0 = [1, 5, -1, 6], row 1 = [4, 11, 2, 15].
    let shape = blocks_shape(1, 1, 16, 1, 1);
    let mut cache = cache_from_table(DType::F32, shape, &[0], &[0], 1);
    let mut output = Tensor::zeros(DType::F32, &[1, 2, 2]).unwrap();
    let poisoned = poison_all(&mut output, &mut cache);
    fused_qkv_matmul(&hidden, &weight, &mut cache, &Tensor::scalar_u32(0), &u32s(&[2]), &mut output).unwrap();
    assert_eq!(output.to_f32_vec().unwrap(), vec![1., 5., 4., 11.]);
    let expected = HashMap::from([
        (block_index(&shape, [0, 0, 0, 0, 0, 0]), Expect::exact(-1.)),
        (block_index(&shape, [0, 0, 0, 1, 0, 0]), Expect::exact(2.)),
        (block_index(&shape, [0, 1, 0, 0, 0, 0]), Expect::exact(6.)),
        (block_index(&shape, [0, 1, 0, 1, 0, 0]), Expect::exact(15.)),
    ]);
    assert_cache(cache.blocks(), &poisoned, &expected, "explicit");
}

/// Three sequences with different cache and valid lengths: Q for every row,
/// K/V only for t < valid_lengths[b], at position cache_lengths[b] + t.
fn mixed_lengths_case() -> Case {
    Case {
        num_pages: 6,
        max_pages: 2,
        cache_lengths: vec![0, 5, 2],
        valid: vec![2, 0, 3],
        table: vec![3, U, 1, 4, 5, 2],
        ..Case::f32(3, 3, 2, 1, 2)
    }
}

/// Hand-computed destinations of [`mixed_lengths_case`] (page size 4):
/// seq 0 positions 0, 1 → page 3; seq 1 writes nothing; seq 2 positions 2, 3
/// → page 5 slots 2, 3 and position 4 → logical page 1 = page 2, slot 0.
const MIXED_WRITES: &[(usize, usize, usize, usize)] =
    &[(0, 0, 3, 0), (0, 1, 3, 1), (2, 0, 5, 2), (2, 1, 5, 3), (2, 2, 2, 0)];

#[test]
fn q_for_every_row_kv_only_for_valid_tokens_at_cache_length_plus_t() {
    let case = mixed_lengths_case();
    let ran = case.run();
    case.check(&ran, MIXED_WRITES);
    assert_eq!(ran.shape, CallShape { batch: 3, seq: 3, k: 6, n: 6, q_dim: 2, kv_dim: 2, layer: 0, cache_tokens: 5 });
}

#[test]
fn check_call_agrees_with_the_run() {
    let case = mixed_lengths_case();
    let shape = check_call(
        &case.hidden(),
        &case.weight(),
        StepArgs { kv_collection: &case.cache(), layer_idx: &Tensor::scalar_u32(0), valid_lengths: &u32s(&case.valid) },
    )
    .unwrap()
    .shape;
    assert_eq!(shape, case.run().shape);
    assert_eq!(shape.output_shape(), vec![3, 3, 2]);
}

#[test]
fn a_write_crossing_page_boundaries_follows_the_page_table() {
    // Page size 2, 3 tokens cached, 5 new: positions 3..8 span logical pages
    // 1, 2 and 3 of the (non-monotonic) table [7, 2, 5, 0].
    let case = Case {
        page_size: 2,
        num_pages: 8,
        max_pages: 4,
        cache_lengths: vec![3],
        table: vec![7, 2, 5, 0],
        ..Case::f32(1, 5, 2, 2, 1)
    };
    let ran = case.run();
    case.check(&ran, &[(0, 0, 2, 1), (0, 1, 5, 0), (0, 2, 5, 1), (0, 3, 0, 0), (0, 4, 0, 1)]);
}

#[test]
fn gqa_one_kv_head_for_four_q_heads() {
    // D = 3, four q heads (q_dim = 12) share Hkv = 1: N = 12 + 2·3 = 18.
    let case = Case {
        num_pages: 3,
        max_pages: 1,
        cache_lengths: vec![0, 1],
        valid: vec![2, 1],
        table: vec![2, 0],
        ..Case::f32(2, 2, 12, 1, 3)
    };
    let ran = case.run();
    assert_eq!((ran.shape.q_dim, ran.shape.kv_dim, ran.shape.n), (12, 3, 18));
    case.check(&ran, &[(0, 0, 2, 0), (0, 1, 2, 1), (1, 0, 0, 1)]);
}

#[test]
fn gqa_two_kv_heads_for_eight_q_heads() {
    // D = 2, eight q heads (q_dim = 16), Hkv = 2: kv column j goes to head
    // j / 2, lane j % 2. 6 tokens cached; positions 6, 7 → logical page 1
    // (page 1) slots 2, 3; position 8 → logical page 2 (page 3) slot 0.
    let case =
        Case { num_pages: 5, max_pages: 3, cache_lengths: vec![6], table: vec![4, 1, 3], ..Case::f32(1, 3, 16, 2, 2) };
    let ran = case.run();
    case.check(&ran, &[(0, 0, 1, 2), (0, 1, 1, 3), (0, 2, 3, 0)]);
}

#[test]
fn layer_idx_writes_only_its_layer() {
    for layer in 0..3 {
        let case = Case { layers: 3, layer, ..mixed_lengths_case() };
        let ran = case.run();
        // `check` compares every byte outside the listed slots of `layer`,
        // including the same slots in the other layers.
        case.check(&ran, MIXED_WRITES);
        assert_eq!(ran.shape.layer, layer as usize);
    }
}

#[test]
fn page_sizes_1_16_and_128() {
    // Two sequences, 3 and 126 tokens cached, 4 and 3 valid of S = 4.
    let base = Case { cache_lengths: vec![3, 126], valid: vec![4, 3], ..Case::f32(2, 4, 2, 1, 2) };

    // 128: seq 0 positions 3..=6 → page 2; seq 1 positions 126, 127 → page 3,
    // position 128 → logical page 1 = page 0 slot 0.
    let case = Case { page_size: 128, num_pages: 4, max_pages: 2, table: vec![2, U, 3, 0], ..base.clone() };
    case.check(
        &case.run(),
        &[(0, 0, 2, 3), (0, 1, 2, 4), (0, 2, 2, 5), (0, 3, 2, 6), (1, 0, 3, 126), (1, 1, 3, 127), (1, 2, 0, 0)],
    );

    // 16: seq 0 → logical page 0 = page 5 slots 3..=6; seq 1 position 126,
    // 127 → logical page 7 (page 11) slots 14, 15; 128 → logical 8 (page 2).
    let mut table = vec![U; 18];
    table[0] = 5;
    table[9..].copy_from_slice(&[0, 1, 3, 4, 6, 7, 8, 11, 2]);
    let case = Case { page_size: 16, num_pages: 12, max_pages: 9, table, ..base.clone() };
    case.check(
        &case.run(),
        &[(0, 0, 5, 3), (0, 1, 5, 4), (0, 2, 5, 5), (0, 3, 5, 6), (1, 0, 11, 14), (1, 1, 11, 15), (1, 2, 2, 0)],
    );

    // 1: one page per position. Seq 0's logical page p is page 139 - p, seq
    // 1's is page p.
    let mut table = vec![U; 2 * 130];
    for (p, page) in table[..7].iter_mut().enumerate() {
        *page = 139 - p as u32;
    }
    for (p, page) in table[130..].iter_mut().enumerate() {
        *page = p as u32;
    }
    let case = Case { page_size: 1, num_pages: 140, max_pages: 130, table, ..base };
    case.check(
        &case.run(),
        &[
            (0, 0, 136, 0),
            (0, 1, 135, 0),
            (0, 2, 134, 0),
            (0, 3, 133, 0),
            (1, 0, 126, 0),
            (1, 1, 127, 0),
            (1, 2, 128, 0),
        ],
    );
}

#[test]
fn scattered_interleaved_page_tables() {
    // Page size 2; seq 0 holds pages [6, 1, 4], seq 1 [3, 0, 5]; pages 2 and
    // 7 belong to nobody. K = 5 differs from N = 3.
    let case = Case {
        k: 5,
        page_size: 2,
        num_pages: 8,
        max_pages: 3,
        cache_lengths: vec![1, 0],
        valid: vec![5, 6],
        table: vec![6, 1, 4, 3, 0, 5],
        ..Case::f32(2, 6, 1, 1, 1)
    };
    let ran = case.run();
    case.check(
        &ran,
        &[
            (0, 0, 6, 1),
            (0, 1, 1, 0),
            (0, 2, 1, 1),
            (0, 3, 4, 0),
            (0, 4, 4, 1),
            (1, 0, 3, 0),
            (1, 1, 3, 1),
            (1, 2, 0, 0),
            (1, 3, 0, 1),
            (1, 4, 5, 0),
            (1, 5, 5, 1),
        ],
    );
}

#[test]
fn padded_tokens_need_no_page() {
    // 2 valid of S = 4 at page size 2: the padded tokens would fall in logical
    // page 1 (unassigned here) and logical page 2 (beyond the table); neither
    // is looked at.
    let case = Case {
        page_size: 2,
        num_pages: 2,
        max_pages: 2,
        valid: vec![2],
        table: vec![1, U],
        ..Case::f32(1, 4, 2, 1, 1)
    };
    case.check(&case.run(), &[(0, 0, 1, 0), (0, 1, 1, 1)]);
    // The same with a table exactly one page wide.
    let case = Case { max_pages: 1, table: vec![1], ..case };
    case.check(&case.run(), &[(0, 0, 1, 0), (0, 1, 1, 1)]);
}

#[test]
fn no_valid_tokens_writes_q_only() {
    let case = Case { valid: vec![0, 0, 0], ..mixed_lengths_case() };
    let ran = case.run();
    case.check(&ran, &[]);
    assert_eq!(ran.shape.cache_tokens, 0);
}

#[test]
fn every_activation_and_cache_dtype_pair_places_values_exactly() {
    for dtype in DType::FLOATS {
        for cache_dtype in DType::FLOATS {
            let case = Case { dtype, cache_dtype, layers: 2, layer: 1, ..mixed_lengths_case() };
            let ran = case.run();
            assert_eq!(ran.output.dtype(), dtype);
            assert_eq!(ran.cache.blocks().dtype(), cache_dtype);
            case.check(&ran, MIXED_WRITES);
        }
    }
}

/// f32 activations, one token, K = 1 and x = [1]: `C` is the weight column,
/// exactly. Q gets it unrounded; K/V get it rounded to the cache dtype.
fn run_single_token(weight_column: &[f32], q_dim: usize, d: usize, cache_dtype: DType) -> Ran {
    let hidden = Tensor::from_f32(DType::F32, &[1, 1, 1], &[1.0]).unwrap();
    let weight = Tensor::from_f32(DType::F32, &[weight_column.len(), 1], weight_column).unwrap();
    let mut cache = cache_from_table(cache_dtype, blocks_shape(1, 1, 1, 1, d), &[0], &[0], 1);
    let mut output = Tensor::zeros(DType::F32, &[1, 1, q_dim]).unwrap();
    let poisoned = poison_all(&mut output, &mut cache);
    let shape =
        fused_qkv_matmul(&hidden, &weight, &mut cache, &Tensor::scalar_u32(0), &u32s(&[1]), &mut output).unwrap();
    Ran { shape, output, cache, poisoned }
}

#[test]
fn f32_activations_round_to_nearest_even_in_a_half_precision_cache() {
    const E8: f32 = 1.0 / 256.0; // 2^-8
    const E11: f32 = 1.0 / 2048.0; // 2^-11
    const E12: f32 = 1.0 / 4096.0; // 2^-12
    let q = [1.0 + E8, 257.0];
    let k = [1.0 + E8, 1.0 + 3.0 * E8, 257.0, 259.0];
    let v = [-(1.0 + E8), 1.0 + E11, 2051.0, 1.0 + E8 + E12];
    let column: Vec<f32> = q.iter().chain(&k).chain(&v).copied().collect();

    // bf16 keeps 8 significant bits: ties (1 + 2^-8, 1 + 3·2^-8, 257, 259)
    // go to the even neighbour, 2051 is within 16 of 2048.
    let bf16_k = [1.0, 1.0 + 4.0 * E8, 256.0, 260.0];
    let bf16_v = [-1.0, 1.0, 2048.0, 1.0 + 2.0 * E8];
    // f16 keeps 11: 2^-8 steps are exact, 1 + 2^-11 and 2051 are ties.
    let f16_k = [1.0 + E8, 1.0 + 3.0 * E8, 257.0, 259.0];
    let f16_v = [-(1.0 + E8), 1.0, 2052.0, 1.0 + E8];

    for (cache_dtype, want_k, want_v) in [(DType::F32, k, v), (DType::BF16, bf16_k, bf16_v), (DType::F16, f16_k, f16_v)]
    {
        // The hand-written numbers are what `half` gives (round to nearest even).
        let rounded = Tensor::from_f32(cache_dtype, &[8], &column[2..]).unwrap().to_f32_vec().unwrap();
        assert_eq!(rounded, [want_k, want_v].concat(), "{cache_dtype}");

        let ran = run_single_token(&column, 2, 4, cache_dtype);
        assert_eq!(ran.output.to_f32_vec().unwrap(), q, "Q is never rounded");
        let shape = blocks_shape(1, 1, 1, 1, 4);
        let mut expected = HashMap::new();
        for d in 0..4 {
            let at = |kv| block_index(&shape, [0, kv, 0, 0, 0, d]);
            expected.insert(at(0), Expect::exact(want_k[d] as f64));
            expected.insert(at(1), Expect::exact(want_v[d] as f64));
        }
        assert_cache(ran.cache.blocks(), &ran.poisoned, &expected, &cache_dtype.to_string());
    }
    // Sanity on the constants above.
    assert_eq!(bf16::from_f32(1.0 + E8).to_f32(), 1.0);
    assert_eq!(f16::from_f32(2051.0).to_f32(), 2052.0);
}

#[test]
fn half_precision_activations_accumulate_in_f32_and_round_once() {
    const E8: f32 = 1.0 / 256.0;
    // X = [1, 2^-8, 2^-8] (exact in bf16 and f16). Q = 1 + 2^-8 + 2^-8 =
    // 1 + 2^-7 (a bf16 accumulator would lose both small terms and give 1);
    // K = V = 1 + 2^-8, kept by an f32/f16 cache, a bf16 tie that goes to 1.
    #[rustfmt::skip]
    let w = [
        1., 1., 1.,
        1., 1., 0.,
        1., 0., 1.,
    ];
    for dtype in [DType::BF16, DType::F16] {
        for (cache_dtype, want_kv) in [(DType::F32, 1.0 + E8), (DType::BF16, 1.0), (DType::F16, 1.0 + E8)] {
            let hidden = Tensor::from_f32(dtype, &[1, 1, 3], &[1.0, E8, E8]).unwrap();
            let weight = Tensor::from_f32(dtype, &[3, 3], &w).unwrap();
            let shape = blocks_shape(2, 1, 2, 1, 1);
            let mut cache = cache_from_table(cache_dtype, shape, &[1], &[1], 1);
            let mut output = Tensor::zeros(dtype, &[1, 1, 1]).unwrap();
            let poisoned = poison_all(&mut output, &mut cache);
            fused_qkv_matmul(&hidden, &weight, &mut cache, &Tensor::scalar_u32(0), &u32s(&[1]), &mut output).unwrap();
            let ctx = format!("{dtype} activations, {cache_dtype} cache");
            assert_eq!(output.to_f32_vec().unwrap(), [1.0078125], "{ctx}");
            // One cached token: position 1 is page 1, slot 1.
            let expected = HashMap::from([
                (block_index(&shape, [1, 0, 0, 1, 0, 0]), Expect::exact(want_kv as f64)),
                (block_index(&shape, [1, 1, 0, 1, 0, 0]), Expect::exact(want_kv as f64)),
            ]);
            assert_cache(cache.blocks(), &poisoned, &expected, &ctx);
        }
    }
}

#[test]
fn the_op_leaves_cache_lengths_and_page_table_to_the_caller() {
    let case = mixed_lengths_case();
    let mut cache = case.cache();
    cache.max_seq_length = 3;
    cache.max_cache_length = 5;
    let before = cache.clone();
    let mut output = Tensor::zeros(DType::F32, &[3, 3, 2]).unwrap();
    fused_qkv_matmul(
        &case.hidden(),
        &case.weight(),
        &mut cache,
        &Tensor::scalar_u32(0),
        &u32s(&case.valid),
        &mut output,
    )
    .unwrap();
    assert_eq!(cache.cache_lengths(), &[0, 5, 2]);
    assert_eq!(cache.lookup_table(), before.lookup_table());
    assert_eq!((cache.max_seq_length, cache.max_cache_length), (3, 5));
    assert_ne!(cache.blocks(), before.blocks(), "K/V were written");
}

#[test]
fn prefill_then_decode_through_reserve_and_advance() {
    // Page size 2, allocation order [3, 0, 2, 1]: the caller reserves, runs
    // the op, advances; read_token then sees every written token.
    let params = kvjit_core::KvCacheParams {
        element: CacheElement::F32,
        num_layers: 2,
        page_size: 2,
        num_kv_heads: 1,
        head_size: 1,
    };
    let mut cache = PagedKVCacheCollection::new(params, 4, 2, 2).unwrap();
    cache.set_allocation_order(vec![3, 0, 2, 1]).unwrap();
    // Hkv = D = 1, q_dim = 1, K = 3: C = [x0, x1, x2] (identity weight).
    let weight = Tensor::from_f32(DType::F32, &[3, 3], &[1., 0., 0., 0., 1., 0., 0., 0., 1.]).unwrap();
    let layer = Tensor::scalar_u32(1);

    // Prefill: S = 3, valid [3, 2]. Token (b, t) carries q = 100b + 10t,
    // k = q + 1, v = q + 2.
    let mut x = Vec::new();
    for b in 0..2 {
        for t in 0..3 {
            let q = (100 * b + 10 * t) as f32;
            x.extend([q, q + 1.0, q + 2.0]);
        }
    }
    let hidden = Tensor::from_f32(DType::F32, &[2, 3, 3], &x).unwrap();
    cache.reserve(&[3, 2]).unwrap();
    // Seq 0 needs 2 pages (3, 0), seq 1 one (2).
    assert_eq!(cache.lookup_table(), &[3, 0, 2, U]);
    let mut output = Tensor::zeros(DType::F32, &[2, 3, 1]).unwrap();
    fused_qkv_matmul(&hidden, &weight, &mut cache, &layer, &u32s(&[3, 2]), &mut output).unwrap();
    assert_eq!(output.to_f32_vec().unwrap(), [0., 10., 20., 100., 110., 120.]);
    cache.advance(&[3, 2]).unwrap();

    // Decode: one new token each, q = 50 + 100b; seq 1's lands on a new page.
    let hidden = Tensor::from_f32(DType::F32, &[2, 1, 3], &[50., 51., 52., 150., 151., 152.]).unwrap();
    cache.reserve(&[1, 1]).unwrap();
    assert_eq!(cache.lookup_table(), &[3, 0, 2, 1]);
    let mut output = Tensor::zeros(DType::F32, &[2, 1, 1]).unwrap();
    fused_qkv_matmul(&hidden, &weight, &mut cache, &layer, &u32s(&[1, 1]), &mut output).unwrap();
    assert_eq!(output.to_f32_vec().unwrap(), [50., 150.]);
    cache.advance(&[1, 1]).unwrap();

    let read = |b, pos| cache.read_token(1, b, pos).unwrap();
    assert_eq!(read(0, 0), (vec![1.], vec![2.]));
    assert_eq!(read(0, 1), (vec![11.], vec![12.]));
    assert_eq!(read(0, 2), (vec![21.], vec![22.]));
    assert_eq!(read(0, 3), (vec![51.], vec![52.]));
    assert_eq!(read(1, 0), (vec![101.], vec![102.]));
    assert_eq!(read(1, 1), (vec![111.], vec![112.]));
    assert_eq!(read(1, 2), (vec![151.], vec![152.]));
    // Padded token (1, 2) of the prefill was never cached; layer 0 untouched.
    assert_eq!(cache.read_token(0, 1, 1).unwrap(), (vec![0.], vec![0.]));
}

#[test]
fn element_offset_is_row_major_over_the_contract_shape() {
    let case = Case { layers: 3, num_pages: 5, ..Case::f32(1, 1, 1, 2, 3) };
    let cache = case.cache();
    let shape = case.shape();
    for page in 0..5 {
        for kv in 0..2 {
            for layer in 0..3 {
                for slot in 0..4 {
                    for h in 0..2 {
                        for d in 0..3 {
                            assert_eq!(
                                cache.element_offset(page, kv, layer, slot, h, d),
                                block_index(&shape, [page, kv, layer, slot, h, d])
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_transposed_weight_is_rejected_until_made_contiguous() {
    let case = mixed_lengths_case();
    let weight = case.weight();
    let (n, k) = (case.n(), case.k);
    // The same matrix stored as [K, N] and seen transposed: strided.
    let stored_kt = weight.permuted(&[1, 0]).unwrap().to_contiguous();
    let strided = stored_kt.permuted(&[1, 0]).unwrap();
    assert_eq!(strided.shape(), &[n, k]);
    assert_eq!(strided.to_f32_vec().unwrap(), weight.to_f32_vec().unwrap());

    let mut cache = case.cache();
    let mut output = Tensor::zeros(DType::F32, &[3, 3, 2]).unwrap();
    let poisoned = poison_all(&mut output, &mut cache);
    let result =
        fused_qkv_matmul(&case.hidden(), &strided, &mut cache, &Tensor::scalar_u32(0), &u32s(&case.valid), &mut output);
    assert!(matches!(&result, Err(Error::NotContiguous { arg }) if arg == "weight"), "{result:?}");
    assert_eq!(cache.blocks().as_bytes(), poisoned, "nothing written");

    // Packed, the same weight gives the contract's result.
    let shape = fused_qkv_matmul(
        &case.hidden(),
        &strided.to_contiguous(),
        &mut cache,
        &Tensor::scalar_u32(0),
        &u32s(&case.valid),
        &mut output,
    )
    .unwrap();
    let ran = Ran { shape, output, cache, poisoned };
    case.check(&ran, MIXED_WRITES);
}
