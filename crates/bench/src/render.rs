//! How the reports write a figure in Markdown: times with their unit,
//! rates, whether a target was met.

/// Seconds with a unit (s, ms or µs) and three significant digits.
pub fn format_time(seconds: f64) -> String {
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

/// A rate (GFLOP/s, GB/s) to one decimal, none from 100 on.
pub fn format_rate(value: f64) -> String {
    if value >= 100.0 { format!("{value:.0}") } else { format!("{value:.1}") }
}

/// A target's result: `pass`, or `**miss**` in bold.
pub fn pass_or_miss(met: bool) -> &'static str {
    if met { "pass" } else { "**miss**" }
}
