//! Random valid calls ([`QkvProblem`]) on every target the kit lists — the
//! CPU JIT, the CPU reference kernel, and CUDA when a device exists (else
//! `skipped: no CUDA device (<reason>)`) — against the reference, through
//! the kit's [`Problem`] driver: outputs and written K/V within the
//! problem's named tolerance, every other (poisoned) cache byte untouched,
//! inputs and cache metadata unchanged.

use kvjit_testkit::fused_qkv::QkvProblem;
use kvjit_testkit::{Problem, Target, Tolerance, check_random, targets};

/// Random problems (each run on every target).
const CASES: usize = 48;

#[test]
fn random_problems_match_the_reference_on_every_target() {
    let targets = targets();
    let checked = check_random::<QkvProblem>(0x7a26_0e75, CASES, &targets);
    assert_eq!(checked.len(), CASES);
    // The JIT's worst element over all cases, relative to what it may be.
    let worst = checked
        .iter()
        .flat_map(|(_, per_target)| per_target)
        .filter(|c| c.target == Target::CpuJit)
        .flat_map(|c| c.outputs.iter().chain(&c.caches))
        .filter_map(|(_, comparison)| comparison.worst)
        .map(|e| e.ratio())
        .fold(0.0, f64::max);
    eprintln!("{CASES} problems on {} targets; the JIT's worst error is {worst:.3} of its tolerance", targets.len());
    // The generator covers what it claims: every dtype pair shows up, and
    // both const and runtime weights.
    let problems: Vec<&QkvProblem> = checked.iter().map(|(p, _)| p).collect();
    assert!(problems.iter().any(|p| p.const_weight) && problems.iter().any(|p| !p.const_weight));
    assert!(problems.iter().any(|p| p.dtype != p.cache_dtype));
}

#[test]
fn the_reference_target_is_held_to_exact_bits() {
    let mut rng = rand::SeedableRng::seed_from_u64(1);
    let p = QkvProblem::generate(&mut rng);
    let args = p.inputs();
    assert_eq!(p.tolerance(Target::CpuReference, &args, "output"), Tolerance::Exact);
    assert!(
        matches!(p.tolerance(Target::CpuJit, &args, "kv_cache"), Tolerance::RelativeToScale { dtype, .. } if dtype == p.cache_dtype)
    );
}
