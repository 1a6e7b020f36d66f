//! Benchmarks of the fused QKV op: what shape specialization buys, against
//! the generic kernel, the reference and two GEMM libraries, on the roofs of
//! this machine; and how long compiling takes.
//!
//! This crate is shared by the criterion suite (`benches/`) and `kvjit
//! bench`, so both time exactly the same code:
//!
//! - [`problem`]: model shapes, call shapes ([`Point`]) and their inputs
//!   ([`Problem`]);
//! - [`impls`]: the implementations behind one [`Runner`] — specialized and
//!   generic JIT kernels, the reference, `gemm` + scatter and
//!   `matrixmultiply` + scatter;
//! - [`timing`]: interleaved sampling, medians and spreads;
//! - [`roofline`]: read-bandwidth and FMA-rate probes, the roofline bound;
//! - [`compile`]: compile latency (graph build → JIT, file → first output);
//! - [`report`]: the results, as Markdown, JSON and SVG;
//! - [`render`]: how every report writes times, rates and verdicts;
//! - [`cli`]: the `kvjit bench` subcommand (options, progress, output files);
//! - [`error`]: [`BenchError`], what a request or a run fails with (a kvjit
//!   error underneath is wrapped, not rewritten);
//! - [`attention`], [`fp8`]: the `--ops attention` and `--ops fp8` suites, on
//!   the heads, caches and step graph of [`workload`];
//! - [`layer`]: the `--ops layer` suite, one whole decoder layer compiled
//!   fused and unfused, timed side by side;
//! - [`model`]: the `--ops model` suite, a whole model from a GGUF file:
//!   prefill and decode tokens/s, the read roof, the executor's overhead;
//! - [`startup`]: `kvjit bench --startup`, fresh processes timed.
//!
//! [`run`] runs a whole [`BenchConfig`]: the roofs, then for every shape,
//! dtype, page size and M all implementations interleaved, then compile
//! latency, then the roofs again (both roof measurements are pooled, so
//! their spread shows how much the machine drifted during the run).

pub mod attention;
pub mod blocks;
pub mod cli;
pub mod compile;
pub mod error;
pub mod fp8;
pub mod impls;
pub mod layer;
pub mod model;
pub mod problem;
pub mod render;
pub mod report;
pub mod roofline;
pub mod startup;
pub mod timing;
pub mod workload;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvjit_core::DType;
use kvjit_runtime::DeviceContextPtr;

pub use compile::{CompileBench, CompileCase, CompileRun};
pub use impls::{Implementation, LayerKernels, Runner, generic_kernels};
pub use problem::{ModelShape, Point, Problem, Weights};
pub use report::{CompileReport, CompileResult, GroupResult, ImplResult, PointResult, Report};
pub use roofline::{Bound, Fma256Probe, FmaProbe, ReadProbe, Roof, RoofPlan, RoofSamples};
pub use timing::{Measurement, Plan, Stats, measure_interleaved};

pub use error::{BenchError, Result};

/// The M values of the suite.
pub const ALL_MS: [usize; 7] = [1, 4, 16, 64, 256, 1024, 2048];

/// Compile-latency settings.
#[derive(Clone, Debug, PartialEq)]
pub struct CompileConfig {
    /// Model shape of the graphs.
    pub shape: ModelShape,
    /// Their dtype.
    pub dtype: DType,
    /// Their cache's page size.
    pub page_size: usize,
    /// Layers of the many-layer graph.
    pub layers: usize,
    /// How long to measure each case.
    pub timing: Plan,
}

/// What a benchmark run covers and how long it measures.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchConfig {
    /// Name of the preset (shown in reports).
    pub mode: String,
    /// Model shapes.
    pub shapes: Vec<ModelShape>,
    /// Dtypes.
    pub dtypes: Vec<DType>,
    /// Page sizes.
    pub page_sizes: Vec<usize>,
    /// Rows M.
    pub ms: Vec<usize>,
    /// Implementations to time.
    pub implementations: Vec<Implementation>,
    /// The reference runs only for M up to this (it is ~100× slower).
    pub reference_max_m: usize,
    /// Worker threads (0: one per core).
    pub threads: usize,
    /// Seed of weights and inputs.
    pub seed: u64,
    /// Bytes of weights each point cycles through (copies of the weight, as
    /// a model's layers): several times the last-level cache, so every call
    /// streams its weight from DRAM.
    pub working_set: usize,
    /// Timing of each point.
    pub timing: Plan,
    /// Roofline probes.
    pub roof: RoofPlan,
    /// Compile latency, if measured.
    pub compile: Option<CompileConfig>,
}

impl BenchConfig {
    /// About a minute on a 2-core machine: the Llama-3-8B shape, f32 and
    /// bf16, page 16, M up to 1024; the reference at M = 1 only.
    pub fn quick() -> Self {
        Self {
            mode: "quick".into(),
            shapes: vec![ModelShape::llama3_8b()],
            dtypes: vec![DType::F32, DType::BF16],
            page_sizes: vec![16],
            ms: vec![1, 4, 16, 64, 256, 1024],
            implementations: Implementation::ALL.to_vec(),
            reference_max_m: 1,
            threads: 2,
            seed: 7,
            working_set: 128 << 20,
            timing: Plan {
                min_samples: 3,
                max_samples: 15,
                sample_time: Duration::from_millis(20),
                budget: Duration::from_millis(800),
            },
            roof: RoofPlan {
                read_bytes: 256 << 20,
                fma_iterations: 1 << 20,
                timing: Plan {
                    min_samples: 5,
                    max_samples: 10,
                    sample_time: Duration::ZERO,
                    budget: Duration::from_millis(400),
                },
            },
            compile: Some(CompileConfig {
                shape: ModelShape::llama_1b(),
                dtype: DType::BF16,
                page_size: 16,
                layers: 32,
                timing: Plan {
                    min_samples: 3,
                    max_samples: 5,
                    sample_time: Duration::ZERO,
                    budget: Duration::from_millis(1500),
                },
            }),
        }
    }

    /// The whole suite: three shapes, f32 and bf16, pages 16 and 128, M from
    /// 1 to 2048, the reference up to M = 16. Tens of minutes.
    pub fn full() -> Self {
        let quick = Self::quick();
        Self {
            mode: "full".into(),
            shapes: ModelShape::standard(),
            page_sizes: vec![16, 128],
            ms: ALL_MS.to_vec(),
            reference_max_m: 16,
            timing: Plan {
                min_samples: 5,
                max_samples: 30,
                sample_time: Duration::from_millis(50),
                budget: Duration::from_secs(3),
            },
            roof: RoofPlan {
                timing: Plan { min_samples: 10, max_samples: 20, budget: Duration::from_secs(2), ..quick.roof.timing },
                ..quick.roof
            },
            compile: quick.compile.map(|c| CompileConfig {
                timing: Plan { min_samples: 5, max_samples: 20, budget: Duration::from_secs(5), ..c.timing },
                ..c
            }),
            ..quick
        }
    }

    /// A run of well under a second on toy sizes, for tests of the plumbing
    /// (the numbers mean nothing).
    pub fn tiny() -> Self {
        let tiny = ModelShape::parse("64/4/2/16").expect("a valid custom shape");
        let short = Plan { min_samples: 2, max_samples: 3, sample_time: Duration::ZERO, budget: Duration::ZERO };
        Self {
            mode: "tiny".into(),
            shapes: vec![tiny.clone()],
            dtypes: vec![DType::F32],
            page_sizes: vec![4],
            ms: vec![1, 8],
            implementations: Implementation::ALL.to_vec(),
            reference_max_m: 16,
            threads: 2,
            seed: 7,
            working_set: 0,
            timing: short,
            roof: RoofPlan { read_bytes: 1 << 20, fma_iterations: 1 << 10, timing: short },
            compile: Some(CompileConfig { shape: tiny, dtype: DType::F32, page_size: 4, layers: 4, timing: short }),
        }
    }

    /// Refuse configurations that cannot run.
    pub fn check(&self) -> Result<()> {
        for (option, empty) in [
            ("--shapes", self.shapes.is_empty()),
            ("--dtypes", self.dtypes.is_empty()),
            ("--pages", self.page_sizes.is_empty()),
            ("--ms", self.ms.is_empty()),
            ("--impls", self.implementations.is_empty()),
        ] {
            if empty {
                return Err(BenchError::NoValues { option });
            }
        }
        if let Some(&dtype) = self.dtypes.iter().find(|d| !d.is_compute_float()) {
            return Err(BenchError::NotComputeFloat { dtype });
        }
        if self.page_sizes.contains(&0) {
            return Err(BenchError::Zero { what: "page sizes" });
        }
        if self.ms.contains(&0) {
            return Err(BenchError::Zero { what: "M" });
        }
        // M tokens follow each sequence's history in the cache, whose
        // positions are u32 (a larger M wrapped to a small one).
        let most = (u32::MAX - problem::HISTORY) as usize;
        if let Some(&m) = self.ms.iter().find(|&&m| m > most) {
            return Err(BenchError::TooLarge(format!(
                "M {m} is more tokens than a cache's u32 positions hold (at most {most})"
            )));
        }
        Ok(())
    }

    /// Points (shape × dtype × page × M) the run measures.
    pub fn point_count(&self) -> usize {
        self.shapes.len() * self.dtypes.len() * self.page_sizes.len() * self.ms.len()
    }

    /// Steps the progress callback counts: roofs twice, points, compile cases.
    pub fn step_count(&self) -> usize {
        2 + self.point_count() + if self.compile.is_some() { 3 } else { 0 }
    }
}

/// Where a run is, for progress displays.
#[derive(Clone, Debug)]
pub struct Progress {
    /// Steps finished.
    pub done: usize,
    /// Steps in all.
    pub total: usize,
    /// The step starting now.
    pub what: String,
    /// Time since the run started.
    pub elapsed: Duration,
}

/// A run's steps, counted for its progress callback.
pub(crate) struct Steps<'a> {
    progress: &'a mut dyn FnMut(&Progress),
    started: Instant,
    done: usize,
    total: usize,
}

impl<'a> Steps<'a> {
    /// A run of `total` steps starting now, reporting to `progress`.
    pub(crate) fn new(total: usize, progress: &'a mut dyn FnMut(&Progress)) -> Self {
        Self { progress, started: Instant::now(), done: 0, total }
    }

    /// Announce the step starting now.
    pub(crate) fn start(&mut self, what: impl Into<String>) {
        let (done, total) = (self.done, self.total);
        (self.progress)(&Progress { done, total, what: what.into(), elapsed: self.started.elapsed() });
        self.done += 1;
    }

    /// Time since the run started.
    pub(crate) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

/// The CPU model and its logical cores, from /proc/cpuinfo where there is
/// one (else the architecture): every report's header names it.
pub(crate) fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split_once(':')).map(|(_, v)| {
                let cores = text.lines().filter(|l| l.starts_with("processor")).count();
                format!("{} ({} logical cores)", v.trim(), cores)
            })
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// Run `config`, calling `progress` before every step.
pub fn run(config: &BenchConfig, progress: &mut dyn FnMut(&Progress)) -> Result<Report> {
    config.check()?;
    let ctx = DeviceContextPtr::cpu(config.threads)?;
    let threads = ctx.cpu_context().map_or(1, |c| c.threads());
    let mut steps = Steps::new(config.step_count(), progress);

    let mut roof_samples = RoofSamples::default();
    steps.start("roofline probes");
    roof_samples.measure(&ctx, &config.roof)?;

    let mut groups = Vec::new();
    for shape in &config.shapes {
        for &dtype in &config.dtypes {
            let weights = Arc::new(Weights::new(shape, dtype, config.seed, config.working_set)?);
            for &page_size in &config.page_sizes {
                let generic = generic_kernels(shape, dtype, page_size, &weights)?;
                let mut points = Vec::new();
                for &m in &config.ms {
                    steps.start(format!("{} {dtype} page {page_size} M={m}", shape.label));
                    let point = Point { shape: shape.clone(), dtype, page_size, m };
                    let mut problem = Problem::new(point, weights.clone(), config.seed)?;
                    let mut runners = config
                        .implementations
                        .iter()
                        .filter(|&&i| i != Implementation::Reference || m <= config.reference_max_m)
                        .filter(|i| i.available())
                        .map(|&i| Runner::new(i, &problem, Some(&generic)))
                        .collect::<Result<Vec<_>>>()?;
                    runners.sort_by_key(|r| r.implementation());
                    let measured =
                        measure_interleaved(runners.len(), &config.timing, |i| runners[i].run(&mut problem, &ctx))?;
                    let impls = runners
                        .iter()
                        .zip(measured)
                        .map(|(r, m)| ImplResult {
                            implementation: r.implementation(),
                            kernel_key: r.kernel_key(),
                            time: m.time,
                            calls_per_sample: m.calls_per_sample,
                        })
                        .collect();
                    points.push(PointResult { batch: problem.batch, seq: problem.seq, point: problem.point, impls });
                }
                groups.push(GroupResult {
                    shape: shape.clone(),
                    dtype,
                    page_size,
                    generic_key: kvjit_runtime::Kernel::key(&generic[0]).to_string(),
                    points,
                });
            }
        }
    }

    let compile = match &config.compile {
        Some(c) => {
            let bench = CompileBench::new(&c.shape, c.dtype, c.page_size, &ctx, config.seed)?;
            let mut cases = Vec::new();
            for case in CompileCase::all(c.layers) {
                steps.start(format!("compile latency: {}", case.describe()));
                let mut runs = Vec::new();
                let measured = measure_interleaved(1, &c.timing, |_| {
                    runs.push(bench.run(case)?);
                    Ok(())
                })?;
                // The first run is the warm-up; the samples are the rest.
                let jit: Vec<f64> = runs.iter().skip(1).map(|r| r.jit_time.as_secs_f64()).collect();
                cases.push(CompileResult {
                    case,
                    time: measured[0].time,
                    jit_compiles: runs.last().map_or(0, |r| r.jit_compiles),
                    jit_time: Stats::from_samples(if jit.is_empty() { &[0.0] } else { &jit }),
                });
            }
            Some(CompileReport { shape: c.shape.clone(), dtype: c.dtype, page_size: c.page_size, cases })
        }
        None => None,
    };

    steps.start("roofline probes (again)");
    roof_samples.measure(&ctx, &config.roof)?;

    Ok(Report {
        mode: config.mode.clone(),
        threads,
        cpu: cpu_name(),
        thp: roofline::thp_mode(),
        duration: steps.elapsed(),
        roof: roof_samples.roof(threads),
        groups,
        compile,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every peer writes what the reference writes, for every dtype.
    #[test]
    fn implementations_agree_with_the_reference() {
        let shape = ModelShape::parse("40/3/2/8").unwrap();
        let ctx = DeviceContextPtr::cpu(2).unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            // Two layers, so the runners' layer rotation is exercised too.
            let bytes = shape.n() * shape.k * dtype.size_bytes();
            let weights = Arc::new(Weights::new(&shape, dtype, 3, 2 * bytes).unwrap());
            assert_eq!(weights.count(), 2);
            for m in [1, 5, 24] {
                let point = Point { shape: shape.clone(), dtype, page_size: 4, m };
                let run = |i: Implementation| {
                    let mut p = Problem::new(point.clone(), weights.clone(), 11).unwrap();
                    let mut runner = Runner::new(i, &p, None).unwrap();
                    runner.run(&mut p, &ctx).unwrap();
                    runner.run(&mut p, &ctx).unwrap();
                    (p.output.to_f32_vec().unwrap(), p.cache.blocks().to_f32_vec().unwrap())
                };
                let (out, blocks) = run(Implementation::Reference);
                assert!(blocks.iter().any(|&v| v != 0.0), "the reference wrote K/V");
                let tolerance = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
                for i in Implementation::ALL.into_iter().filter(|i| i.available()) {
                    let (o, b) = run(i);
                    for (what, got, want) in [("output", &o, &out), ("cache", &b, &blocks)] {
                        let worst = got.iter().zip(want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
                        assert!(worst <= tolerance, "{} {dtype} M={m} {what}: off by {worst}", i.id());
                    }
                }
            }
        }
    }

    /// Requests that cannot run are refused with typed errors, whose
    /// messages name what to change.
    #[test]
    fn refusals_are_typed() {
        let config = BenchConfig { ms: vec![], ..BenchConfig::tiny() };
        assert!(matches!(config.check(), Err(BenchError::NoValues { option: "--ms" })));
        let config = BenchConfig { ms: vec![1, 0], ..BenchConfig::tiny() };
        let err = config.check().unwrap_err();
        assert!(matches!(err, BenchError::Zero { what: "M" }), "{err:?}");
        assert_eq!(err.to_string(), "M must be at least 1");
        // An M past the cache's u32 positions (it wrapped to a small one).
        let config = BenchConfig { ms: vec![1, 1 << 32], ..BenchConfig::tiny() };
        let err = config.check().unwrap_err();
        assert!(matches!(&err, BenchError::TooLarge(m) if m.starts_with("M 4294967296 is more tokens")), "{err:?}");
        let config = BenchConfig { dtypes: vec![DType::F32, DType::U32], ..BenchConfig::tiny() };
        let err = config.check().unwrap_err();
        assert!(matches!(err, BenchError::NotComputeFloat { dtype: DType::U32 }), "{err:?}");
        assert_eq!(err.to_string(), "dtype u32 is not a float type: use f32, bf16 or f16");

        let formats = blocks::BlocksBenchConfig {
            formats: vec![DType::Q4_1, DType::F8E4M3],
            ..blocks::BlocksBenchConfig::tiny()
        };
        let err = formats.check().unwrap_err();
        assert!(matches!(err, BenchError::NotWeightFormat { dtype: DType::F8E4M3 }), "{err:?}");
        assert!(err.to_string().contains("q5_k"), "{err}");
        let formats = blocks::BlocksBenchConfig { formats: vec![], ..blocks::BlocksBenchConfig::tiny() };
        assert!(matches!(formats.check(), Err(BenchError::NoValues { option: "--dtypes" })));

        let mut attention = attention::AttentionBenchConfig::tiny();
        attention.heads.num_kv_heads = 3;
        assert!(matches!(attention.check(), Err(BenchError::InvalidHeads { heads }) if heads.num_kv_heads == 3));

        let startup = startup::StartupConfig { runs: 0, ..startup::StartupConfig::new("kvjit".into()) };
        let err = startup.check().unwrap_err();
        assert_eq!(err.to_string(), "--startup-runs must be at least 1");

        let shape = ModelShape::parse("64/4/2/16").unwrap();
        let weights = Arc::new(Weights::new(&shape, DType::BF16, 1, 0).unwrap());
        let point = Point { shape: shape.clone(), dtype: DType::F32, page_size: 4, m: 1 };
        let err = Problem::new(point, weights, 1).err().expect("bf16 weights for an f32 call are refused");
        assert!(
            matches!(&err, BenchError::WeightsMismatch { weights_dtype: DType::BF16, dtype: DType::F32, .. }),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "benchmark weights are bf16[128, 64], but custom (K=64, 4 q / 2 kv heads of 16) in f32 needs [128, 64]"
        );

        // A kvjit error underneath passes through as it is.
        let err = BenchError::from(kvjit_core::Tensor::zeros(DType::F32, &[2]).unwrap().reshaped(&[3]).unwrap_err());
        assert!(matches!(err, BenchError::Kvjit(kvjit::Error::Tensor(_))), "{err:?}");
    }

    #[test]
    fn presets_are_valid_and_shapes_parse() {
        for config in [BenchConfig::quick(), BenchConfig::full(), BenchConfig::tiny()] {
            config.check().unwrap();
        }
        assert_eq!(ModelShape::parse("8b").unwrap().n(), 6144);
        assert_eq!(ModelShape::parse("mha").unwrap().n(), 12288);
        assert_eq!(ModelShape::parse("1b").unwrap().n(), 3072);
        assert!(ModelShape::parse("7b").is_err());
        assert!(ModelShape::parse("64/0/2/16").is_err());
        let point = Point { shape: ModelShape::llama3_8b(), dtype: DType::BF16, page_size: 16, m: 64 };
        assert_eq!(point.batch_and_seq(), (4, 16));
        assert_eq!(point.flops(), 2.0 * 64.0 * 6144.0 * 4096.0);
    }

    #[test]
    fn tiny_run_reports_every_figure() {
        let report = run(&BenchConfig::tiny(), &mut |_| {}).unwrap();
        assert_eq!(report.groups.len(), 1);
        let points = &report.groups[0].points;
        assert_eq!(points.iter().map(|p| p.point.m).collect::<Vec<_>>(), vec![1, 8]);
        assert!(points.iter().all(|p| p.impls.len() == Implementation::ALL.len()));
        let compile = report.compile.as_ref().unwrap();
        assert_eq!(compile.cases.len(), 3);
        assert!(compile.cases.iter().all(|c| c.jit_compiles == 1), "{compile:?}");
        assert!(report.roof.read_bytes_per_s.median > 0.0 && report.roof.fma_flops_per_s.median > 0.0);
        let markdown = report.to_markdown();
        assert!(markdown.contains("| M | implementation | median |"), "{markdown}");
        let svg = report.to_svg();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    }
}
