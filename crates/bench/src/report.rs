//! A benchmark run's results and their three renderings: a Markdown table
//! for people, JSON with every figure for tools, an SVG plot.
//!
//! Every derived figure (GFLOP/s, weight GB/s, ratios, fraction of the roof)
//! is computed from medians of the same run, by the methods here, so the
//! three renderings always agree.

use std::fmt::Write as _;
use std::time::Duration;

use kvjit_core::DType;
use serde_json::{Value, json};

use super::compile::CompileCase;
use super::impls::Implementation;
use super::problem::{ModelShape, Point};
use super::roofline::{Bound, Roof};
use super::timing::Stats;

/// Everything one `kvjit bench` run measured.
#[derive(Clone, Debug)]
pub struct Report {
    /// `quick`, `full`, ... (what the preset was).
    pub mode: String,
    /// Worker threads of every implementation (the reference uses one).
    pub threads: usize,
    /// The CPU, as the OS names it.
    pub cpu: String,
    /// Wall time of the whole run.
    pub duration: Duration,
    /// The roofs, measured at the start and at the end of the run.
    pub roof: Roof,
    /// One group per (shape, dtype, page size).
    pub groups: Vec<GroupResult>,
    /// Compile latency, if measured.
    pub compile: Option<CompileReport>,
}

/// The results of one shape, dtype and page size.
#[derive(Clone, Debug)]
pub struct GroupResult {
    /// Model shape.
    pub shape: ModelShape,
    /// Dtype of everything.
    pub dtype: DType,
    /// Tokens per page.
    pub page_size: usize,
    /// Kernel key of the generic (symbolic B, S) kernel: the group's id.
    pub generic_key: String,
    /// One entry per M.
    pub points: Vec<PointResult>,
}

/// The results at one M.
#[derive(Clone, Debug)]
pub struct PointResult {
    /// The call shape.
    pub point: Point,
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Every implementation measured, in [`Implementation::ALL`] order.
    pub impls: Vec<ImplResult>,
}

/// One implementation at one point.
#[derive(Clone, Debug)]
pub struct ImplResult {
    /// Which.
    pub implementation: Implementation,
    /// Its kernel key (JIT implementations).
    pub kernel_key: Option<String>,
    /// Seconds per call.
    pub time: Stats,
    /// Calls per sample.
    pub calls_per_sample: usize,
}

/// Compile latency of one model shape.
#[derive(Clone, Debug)]
pub struct CompileReport {
    /// Model shape.
    pub shape: ModelShape,
    /// Dtype.
    pub dtype: DType,
    /// Tokens per page.
    pub page_size: usize,
    /// One entry per case.
    pub cases: Vec<CompileResult>,
}

/// One compile-latency case.
#[derive(Clone, Debug)]
pub struct CompileResult {
    /// Which.
    pub case: CompileCase,
    /// Seconds per run.
    pub time: Stats,
    /// Kernels JIT-compiled per run.
    pub jit_compiles: usize,
    /// Seconds of JIT compiling per run.
    pub jit_time: Stats,
}

impl PointResult {
    /// The median time of `implementation`, if it ran here.
    pub fn median(&self, implementation: Implementation) -> Option<f64> {
        self.impls.iter().find(|r| r.implementation == implementation).map(|r| r.time.median)
    }

    /// Which roof binds here and the FLOP/s it allows.
    pub fn roof(&self, roof: &Roof) -> (Bound, f64) {
        roof.attainable(self.point.flops(), self.point.min_traffic_bytes())
    }
}

impl ImplResult {
    /// GFLOP/s at the median time.
    pub fn gflops(&self, point: &Point) -> f64 {
        point.flops() / self.time.median / 1e9
    }

    /// Weight GB/s at the median time (weight bytes in the benchmark dtype).
    pub fn weight_gbs(&self, point: &Point) -> f64 {
        point.weight_bytes() / self.time.median / 1e9
    }
}

/// Implementations that a ratio column is shown against, if they ran.
const BASELINES: [Implementation; 3] =
    [Implementation::Generic, Implementation::GemmScatter, Implementation::MatrixMultiplyScatter];

fn format_time(seconds: f64) -> String {
    let (value, unit) = match seconds {
        s if s >= 1.0 => (s, "s"),
        s if s >= 1e-3 => (s * 1e3, "ms"),
        s => (s * 1e6, "µs"),
    };
    let digits = if value >= 100.0 {
        0
    } else if value >= 10.0 {
        1
    } else {
        2
    };
    format!("{value:.digits$} {unit}")
}

fn format_rate(value: f64) -> String {
    if value >= 100.0 { format!("{value:.0}") } else { format!("{value:.1}") }
}

fn stats_json(s: &Stats) -> Value {
    json!({ "median": s.median, "min": s.min, "max": s.max, "q1": s.q1, "q3": s.q3, "samples": s.samples })
}

impl Report {
    fn baselines(&self) -> Vec<Implementation> {
        BASELINES
            .into_iter()
            .filter(|b| self.groups.iter().flat_map(|g| &g.points).any(|p| p.median(*b).is_some()))
            .collect()
    }

    /// The Markdown report: roofs, one table per group, compile latency.
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        let roof = &self.roof;
        let _ = writeln!(s, "# kvjit bench ({}, {} threads)\n", self.mode, self.threads);
        let _ = writeln!(
            s,
            "CPU: {}; kvjit {}; run took {:.0} s.\n",
            self.cpu,
            env!("CARGO_PKG_VERSION"),
            self.duration.as_secs_f64()
        );
        let _ = writeln!(
            s,
            "Roofs, {} threads, measured at the start and end of this run (median, min–max): read bandwidth \
             **{:.1} GB/s** ({:.1}–{:.1}); 128-bit FMA **{:.1} GFLOP/s** ({:.1}–{:.1}).\n",
            roof.threads,
            roof.read_bytes_per_s.median / 1e9,
            roof.read_bytes_per_s.min / 1e9,
            roof.read_bytes_per_s.max / 1e9,
            roof.fma_flops_per_s.median / 1e9,
            roof.fma_flops_per_s.min / 1e9,
            roof.fma_flops_per_s.max / 1e9,
        );
        s.push_str(
            "Times are medians of interleaved samples (spread: fastest–slowest sample). GFLOP/s = 2·M·N·K / time; \
             weight GB/s = weight bytes / time. *vs X* = X's median time / this one's (above 1: faster than X). \
             *roof* = min(FMA rate, bandwidth × FLOPs per byte of least traffic), named by which one binds; \
             *of roof* = GFLOP/s / roof.\n",
        );
        let baselines = self.baselines();
        for g in &self.groups {
            let _ = writeln!(s, "\n## {} · {} · page {}\n", g.shape, g.dtype, g.page_size);
            let _ = writeln!(s, "Generic kernel: `{}`\n", g.generic_key);
            s.push_str("| M | implementation | median | spread | GFLOP/s | weight GB/s |");
            for b in &baselines {
                let _ = write!(s, " vs {} |", b.label());
            }
            s.push_str(" roof | of roof |\n|---:|---|---:|---:|---:|---:|");
            s.push_str(&"---:|".repeat(baselines.len()));
            s.push_str("---|---:|\n");
            for p in &g.points {
                let (bound, attainable) = p.roof(roof);
                for r in &p.impls {
                    let gflops = r.gflops(&p.point);
                    let _ = write!(
                        s,
                        "| {} | {} | {} | {}–{} | {} | {} |",
                        p.point.m,
                        r.implementation.label(),
                        format_time(r.time.median),
                        format_time(r.time.min),
                        format_time(r.time.max),
                        format_rate(gflops),
                        format_rate(r.weight_gbs(&p.point)),
                    );
                    for b in &baselines {
                        match p.median(*b) {
                            Some(t) => {
                                let _ = write!(s, " {:.2}× |", t / r.time.median);
                            }
                            None => s.push_str(" – |"),
                        }
                    }
                    let _ = writeln!(
                        s,
                        " {} {} | {:.2} |",
                        bound.id(),
                        format_rate(attainable / 1e9),
                        gflops * 1e9 / attainable
                    );
                }
            }
        }
        if let Some(c) = &self.compile {
            let _ = writeln!(s, "\n## Compile latency · {} · {} · page {}\n", c.shape, c.dtype, c.page_size);
            s.push_str(
                "| case | median | spread | JIT compiles | of which JIT (median) |\n|---|---:|---:|---:|---:|\n",
            );
            for r in &c.cases {
                let _ = writeln!(
                    s,
                    "| {} | {} | {}–{} | {} | {} |",
                    r.case.describe(),
                    format_time(r.time.median),
                    format_time(r.time.min),
                    format_time(r.time.max),
                    r.jit_compiles,
                    format_time(r.jit_time.median),
                );
            }
        }
        s
    }

    /// Every figure as JSON: times as median, min, max, quartiles and sample
    /// count (seconds per call), plus the derived rates, ratios and roofs.
    pub fn to_json(&self) -> Value {
        let roof = &self.roof;
        let groups: Vec<Value> = self
            .groups
            .iter()
            .map(|g| {
                let points: Vec<Value> = g
                    .points
                    .iter()
                    .map(|p| {
                        let (bound, attainable) = p.roof(roof);
                        let impls: Vec<Value> = p
                            .impls
                            .iter()
                            .map(|r| {
                                let ratios: serde_json::Map<String, Value> = BASELINES
                                    .iter()
                                    .filter_map(|b| Some((b.id().to_string(), json!(p.median(*b)? / r.time.median))))
                                    .collect();
                                json!({
                                    "implementation": r.implementation.id(),
                                    "label": r.implementation.label(),
                                    "kernel_key": r.kernel_key,
                                    "time_s": stats_json(&r.time),
                                    "calls_per_sample": r.calls_per_sample,
                                    "gflops": stats_json(&r.time.rate(p.point.flops() / 1e9)),
                                    "weight_gbs": stats_json(&r.time.rate(p.point.weight_bytes() / 1e9)),
                                    "speedup_vs": ratios,
                                    "fraction_of_roof": r.gflops(&p.point) * 1e9 / attainable,
                                })
                            })
                            .collect();
                        json!({
                            "m": p.point.m,
                            "batch": p.batch,
                            "seq": p.seq,
                            "flops": p.point.flops(),
                            "weight_bytes": p.point.weight_bytes(),
                            "min_traffic_bytes": p.point.min_traffic_bytes(),
                            "roof": { "bound": bound.id(), "gflops": attainable / 1e9 },
                            "implementations": impls,
                        })
                    })
                    .collect();
                json!({
                    "shape": shape_json(&g.shape),
                    "dtype": g.dtype.name(),
                    "page_size": g.page_size,
                    "generic_kernel_key": g.generic_key,
                    "points": points,
                })
            })
            .collect();
        let compile = self.compile.as_ref().map(|c| {
            let cases: Vec<Value> = c
                .cases
                .iter()
                .map(|r| {
                    json!({
                        "case": r.case.id(),
                        "description": r.case.describe(),
                        "time_s": stats_json(&r.time),
                        "jit_compiles": r.jit_compiles,
                        "jit_time_s": stats_json(&r.jit_time),
                    })
                })
                .collect();
            json!({ "shape": shape_json(&c.shape), "dtype": c.dtype.name(), "page_size": c.page_size, "cases": cases })
        });
        json!({
            "format": "kvjit-bench",
            "version": 1,
            "kvjit_version": env!("CARGO_PKG_VERSION"),
            "mode": self.mode,
            "threads": self.threads,
            "cpu": self.cpu,
            "duration_s": self.duration.as_secs_f64(),
            "statistics": "time_s: seconds per call over samples (median, min, max, quartiles); rates are work / time \
                           of the same statistic; speedup_vs.X = X median time / this median time",
            "roof": {
                "threads": roof.threads,
                "read_gbs": stats_json(&roof.read_bytes_per_s.scaled(1e-9)),
                "fma_gflops": stats_json(&roof.fma_flops_per_s.scaled(1e-9)),
            },
            "groups": groups,
            "compile_latency": compile,
        })
    }

    /// An SVG plot: one panel per group, GFLOP/s against M (both log scale),
    /// one line per implementation, the roofline dashed.
    pub fn to_svg(&self) -> String {
        svg::plot(self)
    }
}

fn shape_json(shape: &ModelShape) -> Value {
    json!({
        "label": shape.label,
        "description": shape.description,
        "k": shape.k,
        "q_heads": shape.q_heads,
        "kv_heads": shape.kv_heads,
        "head_size": shape.head_size,
        "n": shape.n(),
    })
}

mod svg {
    use std::fmt::Write as _;

    use super::{Implementation, Report};

    const PANEL_W: f64 = 460.0;
    const PANEL_H: f64 = 300.0;
    const LEFT: f64 = 62.0;
    const RIGHT: f64 = 16.0;
    const TOP: f64 = 34.0;
    const BOTTOM: f64 = 44.0;

    fn color(i: Implementation) -> &'static str {
        match i {
            Implementation::Specialized => "#d62728",
            Implementation::Generic => "#ff7f0e",
            Implementation::Reference => "#7f7f7f",
            Implementation::GemmScatter => "#1f77b4",
            Implementation::MatrixMultiplyScatter => "#2ca02c",
        }
    }

    pub(super) fn escape(text: &str) -> String {
        text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
    }

    /// Tick values for a log axis over `[lo, hi]` (positive): 1-2-5 steps
    /// when the range is under three decades, else powers of ten.
    fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
        let steps: &[f64] = if hi / lo < 1e3 { &[1.0, 2.0, 5.0] } else { &[1.0] };
        let mut ticks = Vec::new();
        let mut decade = 10f64.powf(lo.log10().floor());
        while decade <= hi {
            for s in steps {
                let v = decade * s;
                if v >= lo * 0.999 && v <= hi * 1.001 {
                    ticks.push(v);
                }
            }
            decade *= 10.0;
        }
        ticks
    }

    fn tick_label(v: f64) -> String {
        if v >= 1.0 { format!("{v:.0}") } else { format!("{v}") }
    }

    pub(super) fn plot(report: &Report) -> String {
        let groups = &report.groups;
        let cols = groups.len().clamp(1, 2);
        let rows = groups.len().div_ceil(cols).max(1);
        let width = cols as f64 * PANEL_W;
        // Legend entries: (colour, dashed, label), flowed into rows.
        let mut entries: Vec<(&str, bool, String)> = Implementation::ALL
            .into_iter()
            .filter(|i| groups.iter().flat_map(|g| &g.points).any(|p| p.median(*i).is_some()))
            .map(|i| (color(i), false, i.label().to_string()))
            .collect();
        entries.push(("black", true, "roof: min(FMA, bandwidth × FLOP/byte)".into()));
        let mut placed = Vec::new();
        let (mut x, mut y) = (10.0, 40.0);
        for (colour, dashed, label) in entries {
            let w = 44.0 + 6.6 * label.chars().count() as f64;
            if x + w > width - 10.0 && x > 10.0 {
                x = 10.0;
                y += 18.0;
            }
            placed.push((x, y, colour, dashed, label));
            x += w;
        }
        let header = y + 16.0;
        let height = header + rows as f64 * PANEL_H;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="sans-serif" font-size="11">"#
        );
        let _ = writeln!(s, "<title>kvjit bench: GFLOP/s against M</title>");
        let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="10" y="20" font-size="13" font-weight="bold">kvjit bench ({}, {} threads): GFLOP/s vs M (medians)</text>"#,
            escape(&report.mode),
            report.threads
        );
        for (x, y, colour, dashed, label) in placed {
            let dash = if dashed { r#" stroke-dasharray="5,3""# } else { "" };
            let _ = write!(
                s,
                r#"<line x1="{x:.0}" y1="{y:.0}" x2="{:.0}" y2="{y:.0}" stroke="{colour}" stroke-width="2"{dash}/>"#,
                x + 24.0
            );
            if !dashed {
                let _ = write!(s, r#"<circle cx="{:.0}" cy="{y:.0}" r="3" fill="{colour}"/>"#, x + 12.0);
            }
            let _ = writeln!(s, r#"<text x="{:.0}" y="{:.0}">{}</text>"#, x + 30.0, y + 4.0, escape(&label));
        }
        for (gi, g) in groups.iter().enumerate() {
            let ox = (gi % cols) as f64 * PANEL_W;
            let oy = header + (gi / cols) as f64 * PANEL_H;
            panel(&mut s, report, g, ox, oy);
        }
        s.push_str("</svg>\n");
        s
    }

    fn panel(s: &mut String, report: &Report, g: &super::GroupResult, ox: f64, oy: f64) {
        let (x0, x1) = (ox + LEFT, ox + PANEL_W - RIGHT);
        let (y0, y1) = (oy + PANEL_H - BOTTOM, oy + TOP);
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" font-size="11.5" font-weight="bold">{} · {} · page {}</text>"#,
            ox + 12.0,
            oy + 20.0,
            escape(&g.shape.description),
            g.dtype,
            g.page_size
        );
        if g.points.is_empty() {
            return;
        }
        let ms: Vec<f64> = g.points.iter().map(|p| p.point.m as f64).collect();
        let (m_lo, m_hi) = (ms.iter().cloned().fold(f64::MAX, f64::min), ms.iter().cloned().fold(0.0, f64::max));
        // FLOPs and least traffic are linear in M: draw the roof for real M.
        let first = &g.points[0].point;
        let flops_per_row = first.flops() / first.m as f64;
        let bytes_per_row = (first.min_traffic_bytes() - first.weight_bytes()) / first.m as f64;
        let roof_at =
            |m: f64| report.roof.attainable(m * flops_per_row, first.weight_bytes() + m * bytes_per_row).1 / 1e9;
        let roof_ms: Vec<f64> = if m_hi > m_lo {
            (0..=48).map(|i| m_lo * (m_hi / m_lo).powf(i as f64 / 48.0)).collect()
        } else {
            vec![m_lo]
        };
        let roof_values: Vec<f64> = roof_ms.iter().map(|&m| roof_at(m)).collect();
        let values: Vec<f64> = g
            .points
            .iter()
            .flat_map(|p| p.impls.iter().map(|r| r.gflops(&p.point)))
            .chain(roof_values.iter().copied())
            .filter(|v| v.is_finite() && *v > 0.0)
            .collect();
        let v_lo = 10f64.powf(values.iter().cloned().fold(f64::MAX, f64::min).log10().floor());
        let v_hi = 10f64.powf(values.iter().cloned().fold(0.0, f64::max).log10().ceil()).max(v_lo * 10.0);
        let px = |m: f64| {
            if m_hi > m_lo { x0 + (m / m_lo).ln() / (m_hi / m_lo).ln() * (x1 - x0) } else { (x0 + x1) / 2.0 }
        };
        let py = |v: f64| y0 - (v / v_lo).ln() / (v_hi / v_lo).ln() * (y0 - y1);
        // Frame, grid and ticks.
        let _ = writeln!(
            s,
            r##"<rect x="{x0:.1}" y="{y1:.1}" width="{:.1}" height="{:.1}" fill="none" stroke="#444"/>"##,
            x1 - x0,
            y0 - y1
        );
        for v in log_ticks(v_lo, v_hi) {
            let y = py(v);
            let _ = writeln!(
                s,
                r##"<line x1="{x0:.1}" y1="{y:.1}" x2="{x1:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                x0 - 4.0,
                y + 4.0,
                tick_label(v)
            );
        }
        for &m in &ms {
            let x = px(m);
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{y0:.1}" x2="{x:.1}" y2="{y1:.1}" stroke="#eee"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{m}</text>"##,
                y0 + 14.0
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">M = batch × tokens (log scale)</text>"#,
            (x0 + x1) / 2.0,
            y0 + 32.0
        );
        let _ = writeln!(
            s,
            r#"<text transform="translate({:.1},{:.1}) rotate(-90)" text-anchor="middle">GFLOP/s (log scale)</text>"#,
            ox + 16.0,
            (y0 + y1) / 2.0
        );
        // Roofline.
        let roof_points: Vec<String> =
            roof_ms.iter().zip(&roof_values).map(|(&m, &v)| format!("{:.1},{:.1}", px(m), py(v))).collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="black" stroke-width="1.5" stroke-dasharray="5,3"/>"#,
            roof_points.join(" ")
        );
        // One line per implementation.
        for i in Implementation::ALL {
            let pts: Vec<(f64, f64)> = g
                .points
                .iter()
                .filter_map(|p| p.impls.iter().find(|r| r.implementation == i).map(|r| (p, r)))
                .map(|(p, r)| (px(p.point.m as f64), py(r.gflops(&p.point))))
                .collect();
            if pts.is_empty() {
                continue;
            }
            let list: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
            let _ = writeln!(
                s,
                r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"/>"#,
                list.join(" "),
                color(i)
            );
            for (x, y) in pts {
                let _ = writeln!(s, r#"<circle cx="{x:.1}" cy="{y:.1}" r="3" fill="{}"/>"#, color(i));
            }
        }
    }
}
