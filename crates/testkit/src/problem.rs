//! The [`Problem`] trait: one op's random valid call, run through the
//! reference and on a [`Target`], compared under a named [`Tolerance`].
//!
//! An op's tests implement it once (the fused QKV op's is
//! `fused_qkv::QkvProblem`) and get [`check_on`] /
//! [`check_random`]: every output and every cache the reference changed is
//! compared within the tolerance the problem names for that target, every
//! cache element the reference left alone must still hold its exact bytes
//! (poison included), cache metadata must match the reference's, and the
//! input tensors must come back byte-identical.
//!
//! Inputs are named tensors plus named KV caches ([`Args`]), so an op that
//! writes into a cache in place (RoPE on K), one that only reads it
//! (attention) and one that does both (the fused QKV op) fit alike.

use std::collections::BTreeMap;
use std::fmt;

use kvjit_core::{PagedKVCacheCollection, Tensor};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::layout::unravel;
use crate::snapshot::assert_tensors_identical;
use crate::tolerance::{Comparison, Tolerance, compare_tensors};
use crate::{Caches, OnTarget, Target, Tensors};

/// One call's arguments: tensors and KV caches, by name.
#[derive(Clone, Debug, Default)]
pub struct Args {
    /// Input tensors (only read by a call).
    pub tensors: Tensors,
    /// KV caches (read, and written in place where the op writes them).
    pub caches: Caches,
}

impl Args {
    /// The tensor named `name`.
    ///
    /// # Panics
    ///
    /// If there is none.
    pub fn tensor(&self, name: &str) -> &Tensor {
        self.tensors.get(name).unwrap_or_else(|| panic!("no tensor '{name}'"))
    }

    /// The cache named `name`.
    ///
    /// # Panics
    ///
    /// If there is none.
    pub fn cache(&self, name: &str) -> &PagedKVCacheCollection {
        self.caches.get(name).unwrap_or_else(|| panic!("no cache '{name}'"))
    }

    /// The cache named `name`, writable.
    ///
    /// # Panics
    ///
    /// If there is none.
    pub fn cache_mut(&mut self, name: &str) -> &mut PagedKVCacheCollection {
        self.caches.get_mut(name).unwrap_or_else(|| panic!("no cache '{name}'"))
    }
}

/// What a run returns: its output tensors by name (its caches are written in
/// place in the [`Args`]), or why it refused.
pub type RunResult = Result<Tensors, Box<dyn std::error::Error + Send + Sync>>;

/// One op's call, drawn at random, valid, checkable on every target.
pub trait Problem: fmt::Debug {
    /// Draw a valid problem (shapes, lengths, page tables, data seed) small
    /// enough for a test. Must be deterministic in `rng`.
    fn generate(rng: &mut StdRng) -> Self
    where
        Self: Sized;

    /// Its arguments, with random valid values; deterministic for a given
    /// problem. Poison (NaN) what the op must not read as data, such as
    /// cache slots it is about to write: an element left unwritten then
    /// stands out.
    fn inputs(&self) -> Args;

    /// The reference implementation on `args` (caches written in place).
    fn reference(&self, args: &mut Args) -> RunResult;

    /// The op built for `target` and run on its context (caches written in
    /// place). Outputs should start poisoned.
    fn run(&self, target: &OnTarget, args: &mut Args) -> RunResult;

    /// How close output or cache `name` must be to the reference's on
    /// `target`, for these inputs.
    fn tolerance(&self, target: Target, args: &Args, name: &str) -> Tolerance;
}

/// What [`check_on`] compared, per output and per cache (with each
/// comparison's worst element).
#[derive(Clone, Debug)]
pub struct Checked {
    /// Where it ran.
    pub target: Target,
    /// Per output name.
    pub outputs: Vec<(String, Comparison)>,
    /// Per cache name: the elements the reference changed.
    pub caches: Vec<(String, Comparison)>,
}

impl fmt::Display for Checked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:", self.target)?;
        for (name, c) in self.outputs.iter().chain(&self.caches) {
            write!(f, " {name} {c};")?;
        }
        Ok(())
    }
}

/// Run `problem` through the reference and on `target`, and compare.
///
/// # Panics
///
/// Naming the problem, the target and the first thing wrong: either side
/// refusing the call; an input tensor changed; output names, dtypes or
/// shapes differing; an output or a changed cache element outside the
/// tolerance; a cache element the reference left alone not byte-identical;
/// cache lengths, page table or MAX scalars differing from the reference's.
pub fn check_on<P: Problem>(problem: &P, target: &OnTarget) -> Checked {
    let args = problem.inputs();
    let mut want_args = args.clone();
    let want = problem
        .reference(&mut want_args)
        .unwrap_or_else(|e| panic!("{problem:?}: the reference refused a generated problem: {e}"));
    let mut got_args = args.clone();
    let what = |part: &str| format!("{problem:?} on {}: {part}", target.name());
    let got = problem.run(target, &mut got_args).unwrap_or_else(|e| panic!("{}", what(&format!("refused: {e}"))));

    assert_eq!(
        got_args.tensors.keys().collect::<Vec<_>>(),
        args.tensors.keys().collect::<Vec<_>>(),
        "{}",
        what("inputs")
    );
    for (name, before) in &args.tensors {
        assert_tensors_identical(&what(&format!("input '{name}'")), &got_args.tensors[name], before);
    }

    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{}", what("output names"));
    let mut outputs = Vec::new();
    for (name, want) in &want {
        let got = &got[name];
        assert_eq!((got.dtype(), got.shape()), (want.dtype(), want.shape()), "{}", what(&format!("output '{name}'")));
        let comparison = compare_tensors(problem.tolerance(target.target, &args, name), got, want);
        if let Some(first) = comparison.first_failure {
            panic!("{}: {comparison}", what(&format!("output '{name}'{:?}", unravel(want.shape(), first.index))));
        }
        outputs.push((name.clone(), comparison));
    }

    let mut caches = Vec::new();
    for (name, before) in &args.caches {
        let (got, want) = (got_args.cache(name), want_args.cache(name));
        let part = |p: &str| what(&format!("cache '{name}' {p}"));
        assert_eq!(got.params(), want.params(), "{}", part("layout"));
        assert_eq!(got.cache_lengths(), want.cache_lengths(), "{}", part("cache_lengths"));
        assert_eq!(got.lookup_table(), want.lookup_table(), "{}", part("lookup_table"));
        assert_eq!(
            (got.max_seq_length, got.max_cache_length),
            (want.max_seq_length, want.max_cache_length),
            "{}",
            part("MAX scalars")
        );
        if let (Some(was), Some(now), Some(expected)) = (before.scales(), got.scales(), want.scales()) {
            for (i, ((&w, &n), &e)) in was.as_bytes().iter().zip(now.as_bytes()).zip(expected.as_bytes()).enumerate() {
                // A scale byte the reference left alone must stay; the
                // values it scales are compared below.
                assert!(
                    e != w || n == w,
                    "{}: the reference leaves it alone",
                    part(&format!("scales byte {i} was written"))
                );
            }
        }
        let shape = before.blocks().shape();
        let size = before.blocks().dtype().size_bytes();
        let (was, now, expected) = (before.blocks().as_bytes(), got.blocks().as_bytes(), want.blocks().as_bytes());
        let (got_values, want_values) = (cache_values(got), cache_values(want));
        let mut comparison = Comparison::new(problem.tolerance(target.target, &args, name));
        for i in 0..got_values.len() {
            let bytes = i * size..(i + 1) * size;
            let scale_changed = scale_of(want, i) != scale_of(before, i);
            if expected[bytes.clone()] == was[bytes.clone()] && !scale_changed {
                assert!(
                    now[bytes.clone()] == was[bytes] && scale_of(got, i) == scale_of(before, i),
                    "{}: the reference leaves it alone",
                    part(&format!("blocks{:?} = {} was written", unravel(shape, i), got_values[i]))
                );
            } else if !comparison.push(i, got_values[i], want_values[i]) && comparison.failures == 1 {
                panic!("{}: {comparison}", part(&format!("blocks{:?}", unravel(shape, i))));
            }
        }
        caches.push((name.clone(), comparison));
    }
    Checked { target: target.target, outputs, caches }
}

/// The value each element of `cache`'s blocks stands for: the element
/// itself, or for an FP8 cache its code times its g-block's scale (scales
/// `[…, Hkv, D/g]` follow the blocks `[…, Hkv, D]`, so element `i` has
/// scale `i / g`).
pub fn cache_values(cache: &PagedKVCacheCollection) -> Vec<f64> {
    let values = cache.blocks().to_f32_vec().expect("a float cache");
    values.iter().enumerate().map(|(i, &v)| f64::from(v) * f64::from(scale_of(cache, i).unwrap_or(1.0))).collect()
}

/// The scale of blocks element `i` of an FP8 cache (`None` without scales).
fn scale_of(cache: &PagedKVCacheCollection, i: usize) -> Option<f32> {
    let g = cache.params().scale_granularity()?;
    cache.scales().map(|s| s.as_slice::<f32>().expect("f32 scales")[i / g])
}

/// Draw `cases` problems from `seed` and [`check_on`] each on every one of
/// `targets`; returns what each check compared, in order.
pub fn check_random<P: Problem>(seed: u64, cases: usize, targets: &[OnTarget]) -> Vec<(P, Vec<Checked>)> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..cases)
        .map(|_| {
            let problem = P::generate(&mut rng);
            let checked = targets.iter().map(|t| check_on(&problem, t)).collect();
            (problem, checked)
        })
        .collect()
}

/// Tensors by name, built from `(name, tensor)` pairs.
pub fn named<const N: usize>(pairs: [(&str, Tensor); N]) -> Tensors {
    pairs.into_iter().map(|(n, t)| (n.to_string(), t)).collect::<BTreeMap<_, _>>()
}
