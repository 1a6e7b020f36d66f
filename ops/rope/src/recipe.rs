//! The RoPE op's constant recipe: its `freqs_cis` table, made from the base
//! θ, Llama-3.1 scaling and per-frequency divisors instead of stored
//! (`"init": {"rope_theta": 500000.0, "llama3_scaling": {…}}` in a graph
//! file). [`RopeOp`](crate::RopeOp)
//! registers it, so a registry without the op does not know it.

use kvjit_core::Tensor;
use kvjit_graph::{GraphError, Recipe, TensorType};
use serde::{Deserialize, Serialize};

/// The standard rotary-embedding table `freqs_cis [max_positions, D]` of
/// a RoPE op, as a constant recipe: row `pos` holds `cos(pos·θ_j)` at `2j`
/// and `sin(pos·θ_j)` at `2j + 1` for `j < D/2`, with `θ_j = theta^(−2j/D)`
/// (optionally rescaled the Llama-3 way, then divided by `freq_factors[j]`).
/// The constant's shape gives `max_positions` and `D`. Computed in f64,
/// rounded once to the dtype.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeInit {
    /// The base θ (Llama 3: 500000).
    pub rope_theta: f64,
    /// Llama-3.1 frequency scaling, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llama3_scaling: Option<Llama3Scaling>,
    /// A divisor per frequency (`D/2` of them), if any: what GGUF files
    /// store as `rope_freqs.weight` (llama.cpp's converter writes Llama-3.1
    /// scaling so) and what linear RoPE scaling by `f` is (`f` for every j).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freq_factors: Option<Vec<f64>>,
}

impl RopeInit {
    /// The plain table of base `rope_theta`: no scaling, no divisors.
    pub fn plain(rope_theta: f64) -> Self {
        Self { rope_theta, llama3_scaling: None, freq_factors: None }
    }
}

/// Llama 3.1's RoPE frequency scaling (`rope_type: "llama3"` in Hugging Face
/// configs): wavelengths longer than `original_max_positions /
/// low_freq_factor` are divided by `factor`, those shorter than
/// `original_max_positions / high_freq_factor` kept, and the band between
/// blended linearly.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Llama3Scaling {
    /// Divisor of low frequencies (Llama 3.1: 8).
    pub factor: f64,
    /// Llama 3.1: 1.
    pub low_freq_factor: f64,
    /// Llama 3.1: 4.
    pub high_freq_factor: f64,
    /// Context length the model was trained at (Llama 3.1: 8192).
    pub original_max_positions: f64,
}

impl Llama3Scaling {
    /// Llama 3.1's values.
    pub const LLAMA_3_1: Self =
        Self { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_positions: 8192.0 };

    fn scale(&self, freq: f64) -> f64 {
        let wavelength = 2.0 * std::f64::consts::PI / freq;
        let low_freq_wavelength = self.original_max_positions / self.low_freq_factor;
        let high_freq_wavelength = self.original_max_positions / self.high_freq_factor;
        if wavelength < high_freq_wavelength {
            freq
        } else if wavelength > low_freq_wavelength {
            freq / self.factor
        } else {
            let smooth = (self.original_max_positions / wavelength - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * freq / self.factor + smooth * freq
        }
    }
}

impl Recipe for RopeInit {
    const NAME: &'static str = "rope";
    const MARKER: &'static str = "rope_theta";

    /// The table for a `[max_positions, D]` constant of `ty`.
    fn generate(&self, ty: &TensorType) -> Result<Tensor, GraphError> {
        let bad = |problem: String| GraphError::Param { param: "init".into(), problem };
        let shape = ty.static_shape().filter(|s| s.len() == 2 && s[1] % 2 == 0 && s[1] > 0).ok_or_else(|| {
            bad(format!("a RoPE table needs a static shape [max_positions, D] with D even and > 0, got {ty}"))
        })?;
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(bad(format!("rope_theta must be finite and > 1, got {}", self.rope_theta)));
        }
        if let Some(s) = &self.llama3_scaling {
            let ok = [s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_positions]
                .iter()
                .all(|v| v.is_finite() && *v > 0.0)
                && s.high_freq_factor > s.low_freq_factor;
            if !ok {
                return Err(bad(format!(
                    "llama3_scaling needs positive finite values with high_freq_factor > low_freq_factor, got {s:?}"
                )));
            }
        }
        let (positions, d) = (shape[0], shape[1]);
        if let Some(factors) = &self.freq_factors
            && (factors.len() != d / 2 || !factors.iter().all(|f| f.is_finite() && *f > 0.0))
        {
            return Err(bad(format!(
                "freq_factors needs D/2 = {} positive finite values, got {} ({:?}…)",
                d / 2,
                factors.len(),
                &factors[..factors.len().min(4)]
            )));
        }
        let freqs: Vec<f64> = (0..d / 2)
            .map(|j| {
                let freq = self.rope_theta.powf(-((2 * j) as f64) / d as f64);
                let freq = self.llama3_scaling.map_or(freq, |s| s.scale(freq));
                self.freq_factors.as_ref().map_or(freq, |f| freq / f[j])
            })
            .collect();
        let mut values = Vec::new();
        values.try_reserve_exact(positions.saturating_mul(d)).map_err(|_| {
            GraphError::Tensor(kvjit_core::Error::OutOfMemory { bytes: positions.saturating_mul(d * 4) })
        })?;
        for pos in 0..positions {
            for &freq in &freqs {
                let angle = pos as f64 * freq;
                values.push(angle.cos() as f32);
                values.push(angle.sin() as f32);
            }
        }
        Ok(Tensor::from_f32(ty.dtype, &shape, &values)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvjit_core::DType;

    fn table(init: RopeInit, positions: usize, d: usize) -> Vec<f32> {
        let ty = TensorType::new(DType::F32, [positions.into(), d.into()]);
        init.generate(&ty).unwrap().to_f32_vec().unwrap()
    }

    #[test]
    fn the_rope_table_holds_cos_and_sin_of_position_times_frequency() {
        let init = RopeInit::plain(10000.0);
        let (positions, d) = (5, 8);
        let t = table(init, positions, d);
        // Position 0: the identity rotation.
        assert_eq!(&t[..d], &[1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]);
        for pos in 0..positions {
            for j in 0..d / 2 {
                let freq = 10000f64.powf(-2.0 * j as f64 / d as f64);
                let angle = pos as f64 * freq;
                assert_eq!(t[pos * d + 2 * j], angle.cos() as f32, "cos at pos {pos}, j {j}");
                assert_eq!(t[pos * d + 2 * j + 1], angle.sin() as f32, "sin at pos {pos}, j {j}");
            }
        }
        // j = 0 has frequency 1 whatever θ: position 3 is cos 3, sin 3.
        assert_eq!((t[3 * d], t[3 * d + 1]), (3f64.cos() as f32, 3f64.sin() as f32));
    }

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let plain = RopeInit::plain(500000.0);
        let scaled = RopeInit { llama3_scaling: Some(Llama3Scaling::LLAMA_3_1), ..plain.clone() };
        let s = Llama3Scaling::LLAMA_3_1;
        // Wavelength 2π < 8192 / 4: unchanged.
        assert_eq!(s.scale(1.0), 1.0);
        // Wavelength 2π·10⁵ > 8192: divided by 8.
        assert_eq!(s.scale(1e-5), 1e-5 / 8.0);
        // In the band, between the two.
        let freq = 2.0 * std::f64::consts::PI / 4096.0;
        assert!(s.scale(freq) < freq && s.scale(freq) > freq / 8.0);
        let (a, b) = (table(plain, 3, 128), table(scaled, 3, 128));
        assert_eq!(a[128..132], b[128..132], "the highest frequencies are not scaled");
        assert_ne!(a[128 + 126..], b[128 + 126..], "the lowest are");
    }

    #[test]
    fn bad_rope_tables_are_refused() {
        let init = RopeInit::plain(10000.0);
        for shape in [vec![4usize, 7], vec![4], vec![4, 0]] {
            let ty = TensorType::new(DType::F32, shape.iter().map(|&d| d.into()));
            assert!(init.generate(&ty).is_err(), "{shape:?}");
        }
        let ty = TensorType::new(DType::F32, [4.into(), 8.into()]);
        assert!(RopeInit { rope_theta: f64::NAN, ..init.clone() }.generate(&ty).is_err());
        let bad_scaling = Llama3Scaling { high_freq_factor: 0.5, ..Llama3Scaling::LLAMA_3_1 };
        assert!(RopeInit { llama3_scaling: Some(bad_scaling), ..init.clone() }.generate(&ty).is_err());
        // D = 8 takes 4 factors, each positive and finite.
        for factors in [vec![1.0; 3], vec![1.0; 5], vec![1.0, 0.0, 1.0, 1.0], vec![1.0, f64::NAN, 1.0, 1.0]] {
            let err = RopeInit { freq_factors: Some(factors.clone()), ..init.clone() }.generate(&ty).unwrap_err();
            assert!(err.to_string().contains("freq_factors"), "{factors:?}: {err}");
        }
    }

    #[test]
    fn frequency_factors_divide_each_frequency() {
        let (positions, d) = (6, 8);
        let factors = vec![1.0, 2.5, 8.0, 0.5];
        let init = RopeInit { freq_factors: Some(factors.clone()), ..RopeInit::plain(10000.0) };
        let t = table(init.clone(), positions, d);
        for pos in 0..positions {
            for (j, factor) in factors.iter().enumerate() {
                let angle = pos as f64 * 10000f64.powf(-2.0 * j as f64 / d as f64) / factor;
                assert_eq!(t[pos * d + 2 * j], angle.cos() as f32, "cos at pos {pos}, j {j}");
                assert_eq!(t[pos * d + 2 * j + 1], angle.sin() as f32, "sin at pos {pos}, j {j}");
            }
        }
        // They survive a graph file: written and read back as they were.
        let text = serde_json::to_string(&init).unwrap();
        assert_eq!(text, r#"{"rope_theta":10000.0,"freq_factors":[1.0,2.5,8.0,0.5]}"#);
        assert_eq!(serde_json::from_str::<RopeInit>(&text).unwrap(), init);
    }

    #[test]
    fn the_rope_op_registers_its_table_and_the_graph_crate_alone_does_not_know_it() {
        let mut registry = kvjit_graph::OpRegistry::new();
        let fields = || serde_json::json!({"rope_theta": 500000.0});
        // Without the op, an init with rope_theta is no recipe at all.
        let err = registry.read_recipe(fields()).unwrap_err();
        assert!(err.to_string().contains("unknown field `rope_theta`"), "{err}");
        registry.register(std::sync::Arc::new(kvjit_op::Defined(crate::RopeOp))).unwrap();
        let rope = registry.read_recipe(fields()).unwrap();
        assert_eq!(rope.get::<RopeInit>(), Some(&RopeInit::plain(500000.0)));
        assert_eq!(serde_json::to_string(&rope).unwrap(), r#"{"rope_theta":500000.0}"#);
        // Written back field for field, in declared (not alphabetical) order.
        let text = r#"{"rope_theta":500000.0,"llama3_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_positions":8192.0}}"#;
        let scaled = registry.read_recipe(serde_json::from_str(text).unwrap()).unwrap();
        assert_eq!(scaled.get::<RopeInit>().unwrap().llama3_scaling, Some(Llama3Scaling::LLAMA_3_1));
        assert_eq!(serde_json::to_string(&scaled).unwrap(), text);
        // The markers of two recipes: refused.
        assert!(registry.read_recipe(serde_json::json!({"seed": 1, "rope_theta": 2.0})).is_err());
    }
}
