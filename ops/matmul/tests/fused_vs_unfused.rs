//! In f32 a fused form gives, bit for bit, what its unfused graph gives
//! where the arithmetic order is the same: `mo.matmul` (the JIT), then
//! `mo.silu` (its JIT, the same vector SiLU the epilogues use) and the f32
//! add or multiply of `mo.add` / `mo.mul`. For SwiGLU both tiers run each
//! sibling through the very tiles (and k loop) of a plain matmul, so it too
//! is bit for bit on both.

mod common;

use common::{Jit, ORIENTATIONS, inputs, run_jit, spec, tiers};
use kvjit_core::{DType, Target, Tensor};
use kvjit_jit::CaptureText;
use kvjit_op::Compiled;
use kvjit_op_matmul::Epilogue;
use kvjit_op_silu::SiluSpec;
use kvjit_testkit::calls::run_poisoned;
use rand::SeedableRng;
use rand::rngs::SmallRng;

/// `mo.silu`'s JIT on `x` (f32).
fn silu(x: &Tensor) -> Vec<f32> {
    let spec = SiluSpec { target: Target::Cpu, dtype: DType::F32, elements: None };
    let kernel = Compiled::new(kvjit_op_silu::JitKernel::new(spec, CaptureText::default()).unwrap());
    run_poisoned(&kernel, &[x], DType::F32, x.shape(), 2).to_f32_vec().unwrap()
}

fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}: [{i}] fused {g}, unfused {w}");
    }
}

#[test]
fn fused_epilogues_give_the_unfused_graphs_bits_in_f32() {
    let mut rng = SmallRng::seed_from_u64(81);
    for tier in tiers() {
        for orientation in ORIENTATIONS {
            for (m, k, n) in [(1, 19, 37), (7, 33, 20), (193, 24, 21), (5, 600, 17)] {
                let plain = spec(Epilogue::None, DType::F32, tier, orientation, (k, n), None);
                let matmul = Jit::new(plain, None);
                for epilogue in [Epilogue::Silu, Epilogue::Add, Epilogue::Mul, Epilogue::SiluMul, Epilogue::SwiGlu] {
                    let fused_spec = spec(epilogue, DType::F32, tier, orientation, (k, n), None);
                    let inputs = inputs(&mut rng, &fused_spec, &[m]);
                    let what = format!("{} on [{m}, {k}]", common::name(&fused_spec));
                    let fused = run_jit(&Jit::new(fused_spec, None), &inputs.tensors(), &[m, n], 3);
                    let c = run_jit(&matmul, &[&inputs.a, &inputs.weights[0]], &[m, n], 1);
                    let other = inputs.other.as_ref().map(|o| o.to_f32_vec().unwrap());
                    let c_values = c.to_f32_vec().unwrap();
                    let unfused: Vec<f32> = match epilogue {
                        Epilogue::Silu => silu(&c),
                        Epilogue::Add => c_values.iter().zip(other.unwrap()).map(|(c, o)| c + o).collect(),
                        Epilogue::Mul => c_values.iter().zip(other.unwrap()).map(|(c, o)| c * o).collect(),
                        Epilogue::SiluMul => silu(&c).iter().zip(other.unwrap()).map(|(s, o)| s * o).collect(),
                        _ => {
                            let up = run_jit(&matmul, &[&inputs.a, &inputs.weights[1]], &[m, n], 1);
                            silu(&c).iter().zip(up.to_f32_vec().unwrap()).map(|(s, u)| s * u).collect()
                        }
                    };
                    assert_bits(&fused.to_f32_vec().unwrap(), &unfused, &what);
                }
            }
        }
    }
}
