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
use super::render::{format_rate, format_time};
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
    /// The transparent-huge-page mode (`always`, `madvise`, `never`, or
    /// `unknown`): see [`crate::roofline::thp_mode`].
    pub thp: String,
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

    /// Which roof binds here and the FLOP/s it allows (128-bit FMA).
    pub fn roof(&self, roof: &Roof) -> (Bound, f64) {
        roof.attainable(self.point.flops(), self.point.min_traffic_bytes())
    }

    /// The same on the 256-bit FMA rate, where it was measured.
    pub fn roof_256(&self, roof: &Roof) -> Option<(Bound, f64)> {
        roof.attainable_256(self.point.flops(), self.point.min_traffic_bytes())
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

/// Implementations that a ratio column is shown against, if they ran: the
/// generic and unspecialized kernels (what specialization buys), the Cranelift tier's
/// specialized kernel (what the 256-bit tier buys) and the peers.
const BASELINES: [Implementation; 5 + cfg!(feature = "openblas") as usize] = [
    Implementation::Generic,
    Implementation::Unspecialized,
    Implementation::SpecializedCranelift,
    Implementation::GemmScatter,
    Implementation::MatrixMultiplyScatter,
    #[cfg(feature = "openblas")]
    Implementation::OpenBlasScatter,
];

/// `madvise (read-probe buffer 100% in huge pages)`, or the mode alone.
fn huge_pages_line(thp: &str, roof: &Roof) -> String {
    match roof.read_huge_page_fraction {
        Some(f) => format!("{thp} (read-probe buffer {:.0}% in huge pages)", f * 100.0),
        None => thp.to_string(),
    }
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
            "CPU: {}; transparent huge pages: {}; kvjit {}; run took {:.0} s.\n",
            self.cpu,
            huge_pages_line(&self.thp, roof),
            env!("CARGO_PKG_VERSION"),
            self.duration.as_secs_f64()
        );
        let fma256 = match &roof.fma256_flops_per_s {
            Some(f) => format!(
                "; 256-bit FMA **{:.1} GFLOP/s** ({:.1}–{:.1}), AVX2 (the width of kvjit's avx2 tier and of the GEMM-library peers)",
                f.median / 1e9,
                f.min / 1e9,
                f.max / 1e9
            ),
            None => "; no 256-bit FMA (no AVX2 + FMA)".into(),
        };
        let _ = writeln!(
            s,
            "Roofs, {} threads, measured at the start and end of this run (median, min–max): read bandwidth \
             **{:.1} GB/s** ({:.1}–{:.1}); 128-bit FMA **{:.1} GFLOP/s** ({:.1}–{:.1}){fma256}. The *roof* column \
             uses the 256-bit rate where it was measured (else the 128-bit one); the plot draws both FMA roofs.\n",
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
                let (bound, attainable) = p.roof_256(roof).unwrap_or_else(|| p.roof(roof));
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
                                    "time_s": r.time.to_json(),
                                    "calls_per_sample": r.calls_per_sample,
                                    "gflops": r.time.rate(p.point.flops() / 1e9).to_json(),
                                    "weight_gbs": r.time.rate(p.point.weight_bytes() / 1e9).to_json(),
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
                            "roof_256": p.roof_256(roof).map(|(bound, attainable)| {
                                json!({ "bound": bound.id(), "gflops": attainable / 1e9 })
                            }),
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
                        "time_s": r.time.to_json(),
                        "jit_compiles": r.jit_compiles,
                        "jit_time_s": r.jit_time.to_json(),
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
            "thp": self.thp,
            "duration_s": self.duration.as_secs_f64(),
            "statistics": "time_s: seconds per call over samples (median, min, max, quartiles); rates are work / time \
                           of the same statistic; speedup_vs.X = X median time / this median time; roof uses the \
                           128-bit FMA rate, roof_256 the 256-bit (AVX2) one",
            "roof": {
                "threads": roof.threads,
                "read_gbs": roof.read_bytes_per_s.scaled(1e-9).to_json(),
                "fma_gflops": roof.fma_flops_per_s.scaled(1e-9).to_json(),
                "fma256_gflops": roof.fma256_flops_per_s.map(|f| f.scaled(1e-9).to_json()),
                "read_huge_page_fraction": roof.read_huge_page_fraction,
            },
            "groups": groups,
            "compile_latency": compile,
        })
    }

    /// An SVG plot (drawn with `plotters`): one panel per group, GFLOP/s
    /// against M (both log scale), one line per implementation, the roofline
    /// on the 128-bit FMA rate dashed black, the one on the 256-bit rate
    /// (where measured) dashed brown.
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
    use plotters::coord::Shift;
    use plotters::prelude::*;
    use plotters::style::text_anchor::{HPos, Pos, VPos};

    use super::{GroupResult, Implementation, Report};

    /// What a legend entry shows.
    #[derive(Clone, Copy)]
    enum Key {
        Implementation(Implementation),
        /// The roofline on the 128-bit FMA rate.
        Roof,
        /// The roofline on the 256-bit FMA rate.
        Roof256,
    }

    /// The 256-bit roof's colour.
    const ROOF_256: RGBColor = RGBColor(0x8c, 0x56, 0x4b);

    const PANEL_W: u32 = 460;
    const PANEL_H: u32 = 300;
    const LEFT: u32 = 62;
    const RIGHT: u32 = 16;
    const TOP: u32 = 34;
    const BOTTOM: u32 = 44;
    /// Font sizes in px as the SVG shows them (plotters writes size / 1.24).
    const SMALL: f64 = 11.0 * 1.24;
    const PANEL_TITLE: f64 = 11.5 * 1.24;
    const TITLE: f64 = 13.0 * 1.24;

    type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
    type DrawResult<T> = Result<T, DrawingAreaErrorKind<std::io::Error>>;

    fn color(i: Implementation) -> RGBColor {
        match i {
            Implementation::Specialized => RGBColor(0xd6, 0x27, 0x28),
            Implementation::Generic => RGBColor(0xff, 0x7f, 0x0e),
            Implementation::Unspecialized => RGBColor(0x17, 0xbe, 0xcf),
            Implementation::SpecializedCranelift => RGBColor(0xe3, 0x77, 0xc2),
            Implementation::GenericCranelift => RGBColor(0xbc, 0xbd, 0x22),
            Implementation::Reference => RGBColor(0x7f, 0x7f, 0x7f),
            Implementation::GemmScatter => RGBColor(0x1f, 0x77, 0xb4),
            Implementation::MatrixMultiplyScatter => RGBColor(0x2c, 0xa0, 0x2c),
            #[cfg(feature = "openblas")]
            Implementation::OpenBlasScatter => RGBColor(0x94, 0x67, 0xbd),
        }
    }

    fn font(size: f64, bold: bool) -> TextStyle<'static> {
        let font = ("sans-serif", size).into_font();
        if bold { font.style(FontStyle::Bold).into() } else { font.into() }
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

    /// A dashed horizontal legend sample from `x` to `x + 24` at `y`.
    fn dashes(x: i32, y: i32, color: RGBColor) -> impl Iterator<Item = PathElement<(i32, i32)>> {
        (0..3).map(move |i| PathElement::new(vec![(x + 8 * i, y), (x + 8 * i + 5, y)], color.stroke_width(2)))
    }

    /// # Panics
    ///
    /// Never in practice: drawing into a `String` cannot fail.
    pub(super) fn plot(report: &Report) -> String {
        let groups = &report.groups;
        let cols = groups.len().clamp(1, 2) as u32;
        let rows = (groups.len() as u32).div_ceil(cols).max(1);
        let width = cols * PANEL_W;
        // Legend entries (implementations, then the roofs), flowed into rows.
        let mut entries: Vec<(Key, String)> = Implementation::ALL
            .into_iter()
            .filter(|i| groups.iter().flat_map(|g| &g.points).any(|p| p.median(*i).is_some()))
            .map(|i| (Key::Implementation(i), i.label().to_string()))
            .collect();
        entries.push((Key::Roof, "128-bit FMA roof: min(FMA, bandwidth × FLOP/byte)".into()));
        if report.roof.fma256_flops_per_s.is_some() {
            entries.push((Key::Roof256, "256-bit FMA roof: min(FMA256, bandwidth × FLOP/byte)".into()));
        }
        let mut placed = Vec::new();
        let (mut x, mut y) = (10.0, 40.0);
        for (key, label) in entries {
            let w = 44.0 + 6.6 * label.chars().count() as f64;
            if x + w > f64::from(width) - 10.0 && x > 10.0 {
                x = 10.0;
                y += 18.0;
            }
            placed.push((x as i32, y as i32, key, label));
            x += w;
        }
        let header = y as u32 + 16;
        let height = header + rows * PANEL_H;
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
            draw(&root, report, header, (rows, cols), &placed).expect("drawing into a String cannot fail");
            root.present().expect("drawing into a String cannot fail");
        }
        svg
    }

    fn draw(
        root: &Area,
        report: &Report,
        header: u32,
        (rows, cols): (u32, u32),
        legend: &[(i32, i32, Key, String)],
    ) -> DrawResult<()> {
        root.fill(&WHITE)?;
        let title = format!("kvjit bench ({}, {} threads): GFLOP/s vs M (medians)", report.mode, report.threads);
        root.draw(&Text::new(title, (10, 20), font(TITLE, true).pos(Pos::new(HPos::Left, VPos::Bottom))))?;
        let label_style = font(SMALL, false).pos(Pos::new(HPos::Left, VPos::Center));
        for (x, y, key, label) in legend {
            let (x, y) = (*x, *y);
            match *key {
                Key::Implementation(i) => {
                    root.draw(&PathElement::new(vec![(x, y), (x + 24, y)], color(i).stroke_width(2)))?;
                    root.draw(&Circle::new((x + 12, y), 3, color(i).filled()))?;
                }
                Key::Roof | Key::Roof256 => {
                    let roof_color = if matches!(key, Key::Roof) { BLACK } else { ROOF_256 };
                    for dash in dashes(x, y, roof_color) {
                        root.draw(&dash)?;
                    }
                }
            }
            root.draw(&Text::new(label.as_str(), (x + 30, y), label_style.clone()))?;
        }
        let (_, body) = root.split_vertically(header);
        for (g, area) in report.groups.iter().zip(body.split_evenly((rows as usize, cols as usize))) {
            panel(&area, report, g)?;
        }
        Ok(())
    }

    fn panel(area: &Area, report: &Report, g: &GroupResult) -> DrawResult<()> {
        let title = format!("{} · {} · page {}", g.shape.description, g.dtype, g.page_size);
        area.draw(&Text::new(title, (12, 20), font(PANEL_TITLE, true).pos(Pos::new(HPos::Left, VPos::Bottom))))?;
        if g.points.is_empty() {
            return Ok(());
        }
        let ms: Vec<f64> = g.points.iter().map(|p| p.point.m as f64).collect();
        let (m_lo, m_hi) = (ms.iter().cloned().fold(f64::MAX, f64::min), ms.iter().cloned().fold(0.0, f64::max));
        // One M: a decade around it, so the axis has a width.
        let (x_lo, x_hi) = if m_hi > m_lo { (m_lo, m_hi) } else { (m_lo / 3.0, m_hi * 3.0) };
        // FLOPs and least traffic are linear in M: draw the roof for real M.
        let first = &g.points[0].point;
        let flops_per_row = first.flops() / first.m as f64;
        let bytes_per_row = (first.min_traffic_bytes() - first.weight_bytes()) / first.m as f64;
        let bytes_at = |m: f64| first.weight_bytes() + m * bytes_per_row;
        let curve = |roof_at: &dyn Fn(f64) -> Option<f64>| -> Vec<(f64, f64)> {
            (0..=48)
                .map(|i| x_lo * (x_hi / x_lo).powf(f64::from(i) / 48.0))
                .filter_map(|m| Some((m, roof_at(m)? / 1e9)))
                .filter(|(_, v)| v.is_finite() && *v > 0.0)
                .collect()
        };
        let roof = curve(&|m| Some(report.roof.attainable(m * flops_per_row, bytes_at(m)).1));
        let roof_256 = curve(&|m| Some(report.roof.attainable_256(m * flops_per_row, bytes_at(m))?.1));
        let values: Vec<f64> = g
            .points
            .iter()
            .flat_map(|p| p.impls.iter().map(|r| r.gflops(&p.point)))
            .chain(roof.iter().chain(&roof_256).map(|(_, v)| *v))
            .filter(|v| v.is_finite() && *v > 0.0)
            .collect();
        if values.is_empty() {
            return Ok(());
        }
        let v_lo = 10f64.powf(values.iter().cloned().fold(f64::MAX, f64::min).log10().floor());
        let v_hi = 10f64.powf(values.iter().cloned().fold(0.0, f64::max).log10().ceil()).max(v_lo * 10.0);

        let mut chart = ChartBuilder::on(area)
            .margin_top(TOP)
            .margin_right(RIGHT)
            .margin_left(0)
            .margin_bottom(0)
            .x_label_area_size(BOTTOM)
            .y_label_area_size(LEFT)
            .build_cartesian_2d(
                (x_lo..x_hi).log_scale().with_key_points(ms),
                (v_lo..v_hi).log_scale().with_key_points(log_ticks(v_lo, v_hi)),
            )?;
        chart
            .configure_mesh()
            .bold_line_style(RGBColor(0xe4, 0xe4, 0xe4))
            .axis_style(RGBColor(0x44, 0x44, 0x44))
            .label_style(font(SMALL, false))
            .axis_desc_style(font(SMALL, false))
            .x_desc("M = batch × tokens (log scale)")
            .y_desc("GFLOP/s (log scale)")
            .x_label_formatter(&|m| format!("{m:.0}"))
            .y_label_formatter(&|v| tick_label(*v))
            .draw()?;
        // Frame.
        chart
            .plotting_area()
            .draw(&Rectangle::new([(x_lo, v_lo), (x_hi, v_hi)], RGBColor(0x44, 0x44, 0x44).stroke_width(1)))?;
        // Rooflines, dashed: 128-bit FMA black, 256-bit FMA brown.
        chart.draw_series(DashedLineSeries::new(roof, 5, 3, BLACK.stroke_width(1)))?;
        if !roof_256.is_empty() {
            chart.draw_series(DashedLineSeries::new(roof_256, 8, 4, ROOF_256.stroke_width(1)))?;
        }
        // One line per implementation, a dot per point.
        for i in Implementation::ALL {
            let pts: Vec<(f64, f64)> = g
                .points
                .iter()
                .filter_map(|p| p.impls.iter().find(|r| r.implementation == i).map(|r| (p, r)))
                .map(|(p, r)| (p.point.m as f64, r.gflops(&p.point)))
                .filter(|(_, v)| v.is_finite() && *v > 0.0)
                .collect();
            if pts.is_empty() {
                continue;
            }
            chart.draw_series(LineSeries::new(pts.iter().copied(), color(i).stroke_width(2)))?;
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color(i).filled())))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(fma256: bool) -> Report {
        let stats = |v: f64| Stats::from_samples(&[v]);
        let shape = ModelShape::parse("64/4/2/16").unwrap();
        let points = [1, 8]
            .into_iter()
            .map(|m| {
                let point = Point { shape: shape.clone(), dtype: DType::F32, page_size: 4, m };
                let impls = [Implementation::Specialized, Implementation::GemmScatter]
                    .into_iter()
                    .map(|implementation| ImplResult {
                        implementation,
                        kernel_key: None,
                        time: stats(1e-6 * m as f64),
                        calls_per_sample: 1,
                    })
                    .collect();
                PointResult { point, batch: 1, seq: m, impls }
            })
            .collect();
        Report {
            mode: "test".into(),
            threads: 2,
            cpu: "a CPU".into(),
            thp: "madvise".into(),
            duration: Duration::from_secs(1),
            roof: Roof {
                threads: 2,
                read_bytes_per_s: stats(150e9),
                fma_flops_per_s: stats(90e9),
                fma256_flops_per_s: fma256.then(|| stats(180e9)),
                read_huge_page_fraction: Some(1.0),
            },
            groups: vec![GroupResult { shape, dtype: DType::F32, page_size: 4, generic_key: "g".into(), points }],
            compile: None,
        }
    }

    #[test]
    fn header_and_roofs_render_in_every_format() {
        let with = report(true);
        let markdown = with.to_markdown();
        assert!(
            markdown.contains("transparent huge pages: madvise (read-probe buffer 100% in huge pages)"),
            "{markdown}"
        );
        assert!(
            markdown.contains("128-bit FMA **90.0 GFLOP/s**") && markdown.contains("256-bit FMA **180.0 GFLOP/s**")
        );
        let json = with.to_json();
        assert_eq!(json["thp"], "madvise");
        let gflops = |what: &str| json["roof"][what]["median"].as_f64().unwrap();
        assert!((gflops("fma_gflops") - 90.0).abs() < 1e-9 && (gflops("fma256_gflops") - 180.0).abs() < 1e-9);
        assert_eq!(json["roof"]["read_huge_page_fraction"], 1.0);
        let point = &json["groups"][0]["points"][1];
        // At M = 8 both roofs are FMA-bound (over 3 FLOP/byte × 150 GB/s > 180 GFLOP/s).
        assert_eq!((&point["roof"]["bound"], &point["roof_256"]["bound"]), (&json!("fma"), &json!("fma")));
        assert_eq!((point["roof"]["gflops"].as_f64(), point["roof_256"]["gflops"].as_f64()), (Some(90.0), Some(180.0)));
        let svg = with.to_svg().to_lowercase();
        assert!(svg.contains("128-bit fma roof: min(fma, bandwidth × flop/byte)"), "{svg}");
        assert!(svg.contains("256-bit fma roof"), "{svg}");
        assert!(svg.lines().any(|l| l.starts_with("<polyline") && l.contains(r##"stroke="#8c564b""##)), "{svg}");

        let without = report(false);
        assert!(without.to_markdown().contains("no 256-bit FMA"));
        let json = without.to_json();
        assert!(json["roof"]["fma256_gflops"].is_null() && json["groups"][0]["points"][0]["roof_256"].is_null());
        let svg = without.to_svg().to_lowercase();
        assert!(!svg.contains("256-bit fma roof") && !svg.contains(r##"stroke="#8c564b""##), "{svg}");
    }
}
