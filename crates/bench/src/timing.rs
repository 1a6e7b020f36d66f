//! Timing: interleaved samples, medians and spreads.
//!
//! [`measure_interleaved`] times several implementations of one problem in
//! rounds: each round takes one sample of every implementation, starting
//! with a different one each round, so slow drifts of a shared machine (a
//! build starting, the CPU clock changing) hit all of them alike and their
//! ratios stay meaningful. A sample is enough back-to-back calls to last at
//! least [`Plan::sample_time`]; its time per call is one data point. Report
//! medians; the spread (min/max, quartiles) says how noisy the run was.

use std::time::{Duration, Instant};

use crate::Result;

/// How long to measure.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Plan {
    /// Samples per implementation, at least.
    pub min_samples: usize,
    /// Samples per implementation, at most.
    pub max_samples: usize,
    /// A sample repeats calls until it lasts this long (one call if a call
    /// is longer).
    pub sample_time: Duration,
    /// Stop taking rounds once this much time went by (after `min_samples`).
    pub budget: Duration,
}

/// Order statistics of a set of samples (seconds per call, or any value).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stats {
    /// Median.
    pub median: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
    pub max: f64,
    /// First quartile.
    pub q1: f64,
    /// Third quartile.
    pub q3: f64,
    /// Number of samples.
    pub samples: usize,
}

impl Stats {
    /// Statistics of `values` (linear interpolation between order statistics).
    /// Panics on an empty slice.
    pub fn from_samples(values: &[f64]) -> Self {
        assert!(!values.is_empty(), "statistics of no samples");
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let quantile = |q: f64| {
            let at = q * (sorted.len() - 1) as f64;
            let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
            sorted[lo] + (sorted[hi] - sorted[lo]) * (at - lo as f64)
        };
        Self {
            median: quantile(0.5),
            min: sorted[0],
            max: sorted[sorted.len() - 1],
            q1: quantile(0.25),
            q3: quantile(0.75),
            samples: sorted.len(),
        }
    }

    /// Statistics of `a[r] / b[r]` over the rounds `r` of two measurements
    /// taken side by side ([`measure_interleaved`]'s samples): each round's
    /// pair saw the same spell of the machine, so a neighbour that slows
    /// both for a while moves their ratio less than it moves the ratio of
    /// their medians. Panics on no samples or on counts that differ.
    pub fn paired_ratio(a: &[f64], b: &[f64]) -> Self {
        assert_eq!(a.len(), b.len(), "paired samples come from the same rounds");
        Self::from_samples(&a.iter().zip(b).map(|(a, b)| a / b).collect::<Vec<_>>())
    }

    /// The share of the read roof a kernel reached that reads `bytes` a
    /// call, round by round ([`Stats::paired_ratio`]): per round, the time
    /// `bytes` take at that round's read-probe rate (`read_rates`, bytes/s)
    /// over the kernel's time in it (`times`, seconds per call).
    pub fn paired_roof_share(bytes: f64, times: &[f64], read_rates: &[f64]) -> Self {
        Self::paired_ratio(&read_rates.iter().map(|rate| bytes / rate).collect::<Vec<_>>(), times)
    }

    /// Every statistic multiplied by `factor` (> 0), e.g. to change units.
    pub fn scaled(&self, factor: f64) -> Stats {
        Stats {
            median: self.median * factor,
            min: self.min * factor,
            max: self.max * factor,
            q1: self.q1 * factor,
            q3: self.q3 * factor,
            samples: self.samples,
        }
    }

    /// The rate `work / time` for times in `self`: its median is
    /// `work / median`, and the fastest sample gives the largest rate.
    pub fn rate(&self, work: f64) -> Stats {
        Stats {
            median: work / self.median,
            min: work / self.max,
            max: work / self.min,
            q1: work / self.q3,
            q3: work / self.q1,
            samples: self.samples,
        }
    }

    /// Every statistic as JSON, as every report writes a spread.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "median": self.median, "min": self.min, "max": self.max, "q1": self.q1, "q3": self.q3,
            "samples": self.samples,
        })
    }
}

/// One implementation's measurement.
#[derive(Clone, Debug)]
pub struct Measurement {
    /// Seconds per call.
    pub time: Stats,
    /// Calls per sample.
    pub calls_per_sample: usize,
    /// Every sample, seconds per call, in the order taken.
    pub samples: Vec<f64>,
}

/// Time `count` implementations; `call(i)` makes one call of implementation
/// `i`. Every implementation is called once first (warm-up, and to choose its
/// calls per sample).
pub fn measure_interleaved(
    count: usize,
    plan: &Plan,
    mut call: impl FnMut(usize) -> Result<()>,
) -> Result<Vec<Measurement>> {
    let started = Instant::now();
    let mut calls = Vec::with_capacity(count);
    for i in 0..count {
        let t = Instant::now();
        call(i)?;
        let once = t.elapsed().as_secs_f64().max(1e-9);
        calls.push(((plan.sample_time.as_secs_f64() / once).ceil() as usize).clamp(1, 1_000_000));
    }
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); count];
    let max_samples = plan.max_samples.max(plan.min_samples).max(1);
    for round in 0..max_samples {
        for j in 0..count {
            let i = (j + round) % count;
            let t = Instant::now();
            for _ in 0..calls[i] {
                call(i)?;
            }
            samples[i].push(t.elapsed().as_secs_f64() / calls[i] as f64);
        }
        if round + 1 >= plan.min_samples && started.elapsed() >= plan.budget {
            break;
        }
    }
    Ok(samples
        .into_iter()
        .zip(calls)
        .map(|(samples, calls_per_sample)| Measurement {
            time: Stats::from_samples(&samples),
            calls_per_sample,
            samples,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quartiles_interpolate() {
        let s = Stats::from_samples(&[4.0, 1.0, 3.0, 2.0, 5.0]);
        assert_eq!((s.min, s.q1, s.median, s.q3, s.max, s.samples), (1.0, 2.0, 3.0, 4.0, 5.0, 5));
        let even = Stats::from_samples(&[1.0, 2.0]);
        assert_eq!(even.median, 1.5);
        let rate = s.rate(10.0);
        assert_eq!((rate.min, rate.median, rate.max), (2.0, 10.0 / 3.0, 10.0));
    }

    #[test]
    fn paired_ratios_divide_round_by_round() {
        // A slow second round slows both: its pair's ratio is the first's.
        let s = Stats::paired_ratio(&[2.0, 6.0, 2.5], &[1.0, 3.0, 1.0]);
        assert_eq!((s.min, s.median, s.max, s.samples), (2.0, 2.0, 2.5, 3));
        // The ratio of the medians would be 2.5 / 1.0.
        let medians = Stats::from_samples(&[2.0, 6.0, 2.5]).median / Stats::from_samples(&[1.0, 3.0, 1.0]).median;
        assert_eq!(medians, 2.5);
    }

    #[test]
    fn a_roof_share_pairs_each_round_with_its_probe() {
        // 10 bytes: 2 s at 5 B/s against a 1 s call, then 4 s at 2.5 B/s
        // against a 2 s call: a share of 2 in each round, though the
        // probe's rate halved.
        let s = Stats::paired_roof_share(10.0, &[1.0, 2.0], &[5.0, 2.5]);
        assert_eq!((s.min, s.max, s.samples), (2.0, 2.0, 2));
    }

    #[test]
    fn every_implementation_gets_samples_in_rounds() {
        let plan = Plan {
            min_samples: 3,
            max_samples: 5,
            sample_time: Duration::from_micros(50),
            budget: Duration::from_millis(1),
        };
        let mut counts = [0usize; 3];
        let measured = measure_interleaved(3, &plan, |i| {
            counts[i] += 1;
            std::hint::black_box((0..100).sum::<u64>());
            Ok(())
        })
        .unwrap();
        assert_eq!(measured.len(), 3);
        for m in &measured {
            assert!((3..=5).contains(&m.time.samples), "{m:?}");
            assert!(m.time.min <= m.time.median && m.time.median <= m.time.max);
        }
        assert!(counts.iter().all(|&c| c > 3));
    }
}
