//! `kvjit bench --ops blocks`: `mo.matmul` on weights kept in their GGUF
//! block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, q8_min, Q4_K, Q5_K, Q6_K) against the same matrix in
//! bf16 and f32, side by side in one run, at Llama-3-8B shapes: a decode
//! GEMV (M = 1, the weights streamed from DRAM: enough copies of each
//! matrix are rotated that none is cached) on the read roof, in the bytes
//! each format stores, and a prefill GEMM (M = 64) against the bf16 weights
//! (what dequantizing to bf16 would give).
//!
//! The read roof a GEMV's share is taken against is the read probe timed
//! interleaved with that matrix's GEMVs, as one more contender: the probes
//! before and after the suite ran minutes away from them, and on a shared
//! host read 22.6–32.2 GB/s within one run.

use std::fmt::Write as _;
use std::sync::Arc;

use kvjit_core::{Backend, CodeTier, DType, Tensor};
use kvjit_jit::CaptureText;
use kvjit_op::gemm::WeightOrientation;
use kvjit_op::rows::Rows;
use kvjit_op_matmul::{Epilogue, JitKernel, MatmulSpec};
use kvjit_runtime::DeviceContextPtr;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde_json::{Value, json};

use crate::roofline::{ReadProbe, RoofPlan, RoofSamples};
use crate::timing::{Measurement, Plan, Stats, measure_interleaved};
use crate::{Progress, Result, Steps};

/// What the suite runs.
#[derive(Clone, Debug, PartialEq)]
pub struct BlocksBenchConfig {
    /// Name of the preset.
    pub mode: String,
    /// Worker threads.
    pub threads: usize,
    /// Matrices: name, N, K.
    pub shapes: Vec<(String, usize, usize)>,
    /// Weight formats, in report order (the first float one is the
    /// baseline of the ratios).
    pub formats: Vec<DType>,
    /// Rows of the prefill GEMM.
    pub prefill_rows: usize,
    /// Bytes of weight copies rotated through per format and shape (more
    /// than the last-level cache, so every call reads DRAM).
    pub rotate_bytes: usize,
    /// Timing of each side-by-side group.
    pub timing: Plan,
    /// Roofline probes.
    pub roof: RoofPlan,
}

impl BlocksBenchConfig {
    /// The Llama-3-8B QKV (N 6144, K 4096), FFN up/gate (14336 × 4096) and
    /// down (4096 × 14336) matrices, every block format, bf16 and f32.
    pub fn full() -> Self {
        Self {
            mode: "full".into(),
            threads: 2,
            shapes: vec![
                ("llama3-8b qkv".into(), 6144, 4096),
                ("llama3-8b ffn up".into(), 14336, 4096),
                ("llama3-8b ffn down".into(), 4096, 14336),
            ],
            formats: [DType::BF16, DType::F32].into_iter().chain(DType::BLOCK_FORMATS).collect(),
            prefill_rows: 64,
            rotate_bytes: 768 << 20,
            timing: Plan {
                min_samples: 10,
                max_samples: 30,
                sample_time: std::time::Duration::from_millis(20),
                budget: std::time::Duration::from_secs(3),
            },
            roof: RoofPlan::full(),
        }
    }

    /// The QKV and FFN-up shapes only, shorter timing.
    pub fn quick() -> Self {
        let full = Self::full();
        Self {
            mode: "quick".into(),
            shapes: full.shapes[..2].to_vec(),
            timing: Plan {
                min_samples: 5,
                max_samples: 12,
                budget: std::time::Duration::from_millis(1200),
                ..full.timing
            },
            ..full
        }
    }

    /// Toy sizes for tests of the plumbing (the numbers mean nothing).
    pub fn tiny() -> Self {
        let short = Plan {
            min_samples: 2,
            max_samples: 3,
            sample_time: std::time::Duration::ZERO,
            budget: std::time::Duration::ZERO,
        };
        Self {
            mode: "tiny".into(),
            shapes: vec![("toy".into(), 40, 512)],
            prefill_rows: 8,
            rotate_bytes: 1 << 20,
            timing: short,
            roof: RoofPlan { read_bytes: 1 << 20, fma_iterations: 1 << 10, timing: short },
            ..Self::full()
        }
    }

    /// Refuse formats the suite cannot time and empty lists.
    pub fn check(&self) -> Result<()> {
        if self.formats.is_empty() {
            return Err(crate::BenchError::NoValues { option: "--dtypes" });
        }
        match self.formats.iter().find(|f| !f.is_compute_float() && !f.is_block_format()) {
            Some(&dtype) => Err(crate::BenchError::NotWeightFormat { dtype }),
            None => Ok(()),
        }
    }

    fn step_count(&self) -> usize {
        1 + self.shapes.len() * 2 + 1
    }
}

/// One format's figures on one matrix.
#[derive(Clone, Debug)]
pub struct FormatResult {
    /// The weights' dtype.
    pub format: DType,
    /// Bytes of the weight as the kernel reads it (packed panels).
    pub weight_bytes: usize,
    /// Seconds per decode GEMV (M = 1): its samples are one per round of
    /// the interleaved measurement, paired with the read probe's and the
    /// other formats'.
    pub decode: Measurement,
    /// Seconds per prefill GEMM.
    pub prefill: Stats,
}

/// One matrix's results.
#[derive(Clone, Debug)]
pub struct ShapeResult {
    /// Its name.
    pub name: String,
    /// N and K.
    pub n: usize,
    /// K.
    pub k: usize,
    /// Every format.
    pub formats: Vec<FormatResult>,
    /// Read bandwidth, bytes per second, one sample per round: the read
    /// probe timed interleaved with this matrix's decode GEMVs (the roof of
    /// their shares).
    pub read_rates: Vec<f64>,
}

impl ShapeResult {
    /// The read probe's bandwidth beside the GEMVs, bytes per second.
    pub fn read_beside(&self) -> Stats {
        Stats::from_samples(&self.read_rates)
    }

    /// A format's share of the read roof, round by round: the bytes it
    /// read per second over the probe's in the same round.
    pub fn share(&self, f: &FormatResult) -> Stats {
        Stats::paired_roof_share(f.weight_bytes as f64, &f.decode.samples, &self.read_rates)
    }
}

/// The suite's report.
#[derive(Clone, Debug)]
pub struct BlocksReport {
    /// What ran.
    pub config: BlocksBenchConfig,
    /// Read roof, bytes per second.
    pub read_roof: Stats,
    /// The 256-bit FMA roof, FLOP per second (where the CPU has it).
    pub fma256_roof: Option<Stats>,
    /// Per matrix.
    pub shapes: Vec<ShapeResult>,
}

/// The weight of `format`, `[n, k]`, random (block formats: random blocks).
fn weight(format: DType, n: usize, k: usize, rng: &mut SmallRng) -> Result<Tensor> {
    Ok(match format.is_block_format() {
        true => kvjit_core::quant::random_blocks(format, n, k, rng)?,
        false => Tensor::random(format, &[n, k], rng, -0.05, 0.05)?,
    })
}

/// The decode (M = 1) and prefill kernels of one format: as many weight
/// copies as fill `rotate_bytes` for the decode one.
struct Kernels {
    decode: Vec<(JitKernel<MatmulSpec>, Tensor)>,
    prefill: JitKernel<MatmulSpec>,
    prefill_weight: Tensor,
    weight_bytes: usize,
}

fn kernels(format: DType, n: usize, k: usize, config: &BlocksBenchConfig, rng: &mut SmallRng) -> Result<Kernels> {
    // Activations are f32 for the block formats and f32, bf16 for bf16.
    let dtype = if format.is_block_format() { DType::F32 } else { format };
    let spec = |rows: usize| MatmulSpec {
        backend: Backend::Cpu(CodeTier::Avx2),
        dtype,
        weights: format,
        rows: Rows { width: k, rows: Some(rows) },
        n,
        orientation: WeightOrientation::NK,
        epilogue: Epilogue::None,
    };
    let compile = |spec: MatmulSpec, w: &Tensor| {
        JitKernel::new(spec, Some(vec![Arc::new(w.clone())]), CaptureText::default()).map_err(|source| {
            crate::BenchError::Compile { key: kvjit_core::KernelSpec::key(&spec).to_string(), source }
        })
    };
    let one = weight(format, n, k, rng)?;
    let stored = Tensor::storage_bytes(format, &[n, k])?;
    let copies = config.rotate_bytes.div_ceil(stored).clamp(1, 64);
    let mut decode = Vec::with_capacity(copies);
    for c in 0..copies {
        let w = if c == 0 { one.clone() } else { weight(format, n, k, rng)? };
        decode.push((compile(spec(1), &w)?, w));
    }
    let weight_bytes = kvjit_op::OpKernel::prepared_constants(&decode[0].0)[0].1.data.as_bytes().len();
    let prefill = compile(spec(config.prefill_rows), &one)?;
    Ok(Kernels { decode, prefill, prefill_weight: one, weight_bytes })
}

/// Run the suite.
pub fn run_blocks(config: &BlocksBenchConfig, progress: &mut dyn FnMut(&Progress)) -> Result<BlocksReport> {
    if !kvjit_jit::microkernel::avx2_available() {
        return Err(crate::BenchError::NeedsAvx2 { suite: "blocks" });
    }
    let mut steps = Steps::new(config.step_count(), progress);
    let ctx = DeviceContextPtr::cpu(config.threads)?;
    let mut rng = SmallRng::seed_from_u64(24);
    let mut roof = RoofSamples::default();
    steps.start("roofline probes");
    roof.measure(&ctx, &config.roof)?;
    let read = ReadProbe::try_new(config.roof.read_bytes)?;
    let mut shapes = Vec::new();
    for (name, n, k) in &config.shapes {
        let (n, k) = (*n, *k);
        steps.start(format!("{name}: pack every format"));
        let all: Vec<Kernels> =
            config.formats.iter().map(|&f| kernels(f, n, k, config, &mut rng)).collect::<Result<_>>()?;
        steps.start(format!("{name}: decode and prefill side by side"));
        let decode_x: Vec<Tensor> = config
            .formats
            .iter()
            .map(|&f| Tensor::random(if f.is_block_format() { DType::F32 } else { f }, &[1, k], &mut rng, -1.0, 1.0))
            .collect::<kvjit_core::Result<_>>()?;
        let prefill_x: Vec<Tensor> = config
            .formats
            .iter()
            .map(|&f| {
                let dtype = if f.is_block_format() { DType::F32 } else { f };
                Tensor::random(dtype, &[config.prefill_rows, k], &mut rng, -1.0, 1.0)
            })
            .collect::<kvjit_core::Result<_>>()?;
        let mut out = vec![0u8; config.prefill_rows * n * 4];
        let mut turn = vec![0usize; all.len()];
        // The formats, then the read probe as one more contender.
        let mut decode = measure_interleaved(all.len() + 1, &config.timing, |i| {
            if i == all.len() {
                std::hint::black_box(read.run(&ctx)?);
                return Ok(());
            }
            let (kernel, w) = &all[i].decode[turn[i] % all[i].decode.len()];
            turn[i] += 1;
            let bytes = n * decode_x[i].dtype().size_bytes();
            kernel.run_into(&[&decode_x[i], w], &mut out[..bytes], &ctx).map_err(Into::into)
        })?;
        let probe = decode.pop().expect("the read probe's measurement");
        let read_rates = probe.samples.iter().map(|t| read.bytes() as f64 / t).collect();
        let prefill = measure_interleaved(all.len(), &config.timing, |i| {
            let bytes = config.prefill_rows * n * prefill_x[i].dtype().size_bytes();
            all[i]
                .prefill
                .run_into(&[&prefill_x[i], &all[i].prefill_weight], &mut out[..bytes], &ctx)
                .map_err(Into::into)
        })?;
        let formats = config
            .formats
            .iter()
            .zip(&all)
            .zip(decode.into_iter().zip(prefill))
            .map(|((&format, kernels), (decode, prefill))| FormatResult {
                format,
                weight_bytes: kernels.weight_bytes,
                decode,
                prefill: prefill.time,
            })
            .collect();
        shapes.push(ShapeResult { name: name.clone(), n, k, formats, read_rates });
    }
    steps.start("roofline probes again");
    roof.measure(&ctx, &config.roof)?;
    let roof = roof.roof(config.threads);
    Ok(BlocksReport {
        config: config.clone(),
        read_roof: roof.read_bytes_per_s,
        fma256_roof: roof.fma256_flops_per_s,
        shapes,
    })
}

impl BlocksReport {
    /// The baseline of a matrix's ratios: its bf16 result (else the first).
    fn baseline(shape: &ShapeResult) -> &FormatResult {
        shape.formats.iter().find(|f| f.format == DType::BF16).unwrap_or(&shape.formats[0])
    }

    /// The Markdown report.
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        let gb = |b: f64| b / 1e9;
        let _ = writeln!(
            s,
            "# Block-format weights ({}, {} threads)\n\nRead roof {:.1} GB/s (median of the probes before and after; range {:.1}–{:.1}). Each matrix's shares are of the read probe timed interleaved with its GEMVs.\n",
            self.config.mode,
            self.config.threads,
            gb(self.read_roof.median),
            gb(self.read_roof.min),
            gb(self.read_roof.max)
        );
        for shape in &self.shapes {
            let base = Self::baseline(shape);
            let beside = shape.read_beside();
            // Where a GEMV outreads the probe, the probe is not the roof:
            // said, not hidden.
            let fastest = shape.formats.iter().map(|f| (shape.share(f).median, f)).max_by(|a, b| a.0.total_cmp(&b.0));
            let fastest = fastest.map_or(String::new(), |(share, f)| {
                let rate = f.weight_bytes as f64 / f.decode.time.median;
                format!("; the fastest GEMV, {}, read {:.1} GB/s ({share:.2}× the probe)", f.format, gb(rate))
            });
            let _ = writeln!(
                s,
                "## {} (N {}, K {})\n\nRead probe beside its GEMVs: {:.1} GB/s (quartiles {:.1}–{:.1}){fastest}.\n",
                shape.name,
                shape.n,
                shape.k,
                gb(beside.median),
                gb(beside.q1),
                gb(beside.q3)
            );
            let _ = writeln!(
                s,
                "| weights | bytes/weight | decode µs | weight GB/s | of read roof (quartiles) | decode × bf16 | prefill M={} ms | prefill × bf16 |",
                self.config.prefill_rows
            );
            let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|");
            for f in &shape.formats {
                let rate = f.weight_bytes as f64 / f.decode.time.median;
                let share = shape.share(f);
                let _ = writeln!(
                    s,
                    "| {} | {:.4} | {:.0} | {:.1} | {:.0} % ({:.0}–{:.0}) | {:.2}× | {:.2} | {:.2}× |",
                    f.format,
                    f.weight_bytes as f64 / (shape.n * shape.k) as f64,
                    f.decode.time.median * 1e6,
                    gb(rate),
                    100.0 * share.median,
                    100.0 * share.q1,
                    100.0 * share.q3,
                    Stats::paired_ratio(&base.decode.samples, &f.decode.samples).median,
                    f.prefill.median * 1e3,
                    base.prefill.median / f.prefill.median,
                );
            }
            s.push('\n');
        }
        let _ = writeln!(
            s,
            "Decode: M = 1, each call on another copy of the matrix ({} MiB of copies per format), so every call reads DRAM; GB/s counts the bytes the kernel reads (packed panels: the format's bytes plus the last panel's padding). Prefill: M = {} rows against the same weights (bf16: what dequantizing to bf16 gives). Medians of interleaved samples; the share of the read roof and decode × bf16 are medians of round-by-round ratios (each round times every format and the probe once, so a slow spell of the machine slows both sides of a ratio).",
            self.config.rotate_bytes >> 20,
            self.config.prefill_rows
        );
        s
    }

    /// Every figure as JSON.
    pub fn to_json(&self) -> Value {
        json!({
            "suite": "blocks",
            "mode": self.config.mode,
            "threads": self.config.threads,
            "read_roof_bytes_per_s": self.read_roof.to_json(),
            "fma256_roof_flops_per_s": self.fma256_roof.as_ref().map(Stats::to_json),
            "shapes": self.shapes.iter().map(|shape| json!({
                "name": shape.name,
                "n": shape.n,
                "k": shape.k,
                "read_beside_bytes_per_s": shape.read_beside().to_json(),
                "formats": shape.formats.iter().map(|f| json!({
                    "format": f.format.to_string(),
                    "weight_bytes": f.weight_bytes,
                    "decode_seconds": f.decode.time.to_json(),
                    "share_of_read_roof": shape.share(f).to_json(),
                    "prefill_seconds": f.prefill.to_json(),
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plumbing on toy sizes: every format is timed, the packed bytes
    /// are the format's bytes for whole panels (N = 40: three panels of 16,
    /// the last half padding), and the reports name them.
    #[test]
    fn the_tiny_suite_times_every_format_on_its_own_bytes() {
        if !kvjit_jit::microkernel::avx2_available() {
            let err = run_blocks(&BlocksBenchConfig::tiny(), &mut |_| {}).unwrap_err().to_string();
            assert!(err.contains("avx2"), "{err}");
            return;
        }
        let config = BlocksBenchConfig::tiny();
        let report = run_blocks(&config, &mut |_| {}).unwrap();
        let [shape] = &report.shapes[..] else { panic!("one toy shape") };
        assert_eq!(shape.formats.len(), config.formats.len());
        for f in &shape.formats {
            let padded = Tensor::storage_bytes(f.format, &[48, 512]).unwrap();
            assert_eq!(f.weight_bytes, padded, "{}", f.format);
            assert!(f.decode.time.median > 0.0 && f.prefill.median > 0.0, "{}", f.format);
        }
        let markdown = report.to_markdown();
        assert!(markdown.contains("| q4_1 | 0.7500 |"), "{markdown}");
        assert_eq!(report.to_json()["shapes"][0]["formats"].as_array().unwrap().len(), config.formats.len());
        // The read probe was timed beside the GEMVs, and the shares are of it.
        assert!(shape.read_beside().median > 0.0);
        assert!(markdown.contains("Read probe beside its GEMVs"), "{markdown}");
    }
}
