//! Per-op profiles of runs, like PyTorch's `key_averages().table()`: every plan step timed over
//! several runs, grouped by op (or by op and source location), with calls, total time, share,
//! and the achieved memory bandwidth and arithmetic rate against the device's limits.
//!
//! ```text
//! rustytorch profile model.rtg --input x=x.npy --runs 20
//! ```

use crate::trace::StepInfo;
use crate::{Executable, HostTensor, Result};
use rustytorch_runtime::device::COST_MODEL;
use rustytorch_runtime::{Device, StepClock};
use serde::Serialize;
use std::collections::HashMap;
use std::fmt;
use std::time::Instant;

/// How rows are grouped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GroupBy {
    /// By op name (`matmul_epilogue`, `fused`, `conv`).
    #[default]
    Op,
    /// By op name and the source location where the builder made the step.
    Source,
}

/// Profile options.
#[derive(Clone, Debug)]
pub struct ProfileOptions {
    /// Timed runs.
    pub runs: usize,
    /// Untimed runs first (caches, allocator, lazy initialization).
    pub warmup: usize,
    /// Row grouping.
    pub group_by: GroupBy,
    /// The device's limits, when not the defaults of [`Limits::of`].
    pub limits: Option<Limits>,
}

impl Default for ProfileOptions {
    fn default() -> Self {
        ProfileOptions {
            runs: 10,
            warmup: 1,
            group_by: GroupBy::Op,
            limits: None,
        }
    }
}

/// A device's peak rates, against which achieved rates are shown.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Limits {
    /// Arithmetic (FLOP/s).
    pub flops_per_s: f64,
    /// Memory bandwidth (bytes/s).
    pub bytes_per_s: f64,
    /// Where the figures come from.
    pub source: String,
}

impl Limits {
    /// The limits of `device`. A GPU: the sustained f32 GEMM rate and copy bandwidth measured on
    /// an H200 (the placement cost model's figures). The CPU: the cost model's GEMM rate per two
    /// cores times this machine's cores, and a copy bandwidth measured now (a 32 MiB copy, best
    /// of three; a few milliseconds).
    pub fn of(device: Device) -> Limits {
        match device {
            Device::Cuda(_) | Device::Auto => Limits {
                flops_per_s: COST_MODEL.gpu_flops_per_s,
                bytes_per_s: COST_MODEL.gpu_bytes_per_s,
                source: "sustained f32 GEMM and copy rates measured on an H200".into(),
            },
            Device::Cpu => {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                Limits {
                    flops_per_s: COST_MODEL.cpu_flops_per_s * cores as f64 / 2.0,
                    bytes_per_s: copy_bandwidth(),
                    source: format!(
                        "GEMM rate of the cost model scaled to {cores} cores; copy bandwidth \
                         measured now"
                    ),
                }
            }
        }
    }
}

/// Bytes per second (read + written) of the best of three 32 MiB copies.
fn copy_bandwidth() -> f64 {
    let n = 4 << 20; // 4 Mi f64 = 32 MiB
    let src = vec![1.0f64; n];
    let mut dst = vec![0.0f64; n];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (2 * n * 8) as f64 / best.max(1e-9)
}

/// One row: the steps of one op (or op and source).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    /// The op name (and `@ location` when grouped by source).
    pub name: String,
    /// Calls over the timed runs.
    pub calls: u64,
    /// Total time over the timed runs, in milliseconds.
    pub total_ms: f64,
    /// Share of all steps' time, in percent.
    pub share: f64,
    /// Mean time per call, in microseconds.
    pub mean_us: f64,
    /// Bytes moved per run.
    pub bytes: u64,
    /// FLOPs per run.
    pub flops: u64,
    /// Achieved bandwidth in GB/s.
    pub gb_per_s: f64,
    /// Achieved bandwidth as a percentage of the device's.
    pub bandwidth_pct: f64,
    /// Achieved arithmetic rate in TFLOP/s.
    pub tflop_per_s: f64,
    /// Achieved arithmetic rate as a percentage of the device's.
    pub flops_pct: f64,
}

/// A profile of several runs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Profile {
    /// The device.
    pub device: String,
    /// The clock that timed the steps (`host wall` or `device events`).
    pub clock: String,
    /// Timed runs.
    pub runs: usize,
    /// Steps per run.
    pub steps: usize,
    /// All steps' time per run, in milliseconds.
    pub step_ms_per_run: f64,
    /// Wall time of `Executable::run` per run (inputs and outputs included), in milliseconds.
    pub wall_ms_per_run: f64,
    /// The limits the rates are compared with.
    pub limits: Limits,
    /// Rows, longest total time first.
    pub rows: Vec<Row>,
    /// What the profile could not measure, when anything.
    pub note: Option<String>,
}

/// Runs `exe` `opts.warmup + opts.runs` times on `inputs` with step timing on and aggregates the
/// timed runs' steps.
pub fn profile(
    exe: &mut Executable,
    inputs: &[(&str, HostTensor)],
    opts: &ProfileOptions,
) -> Result<Profile> {
    let runs = opts.runs.max(1);
    let timed = exe.set_step_timing(true);
    let infos = exe.step_infos();
    let limits = opts
        .limits
        .clone()
        .unwrap_or_else(|| Limits::of(exe.device()));
    for _ in 0..opts.warmup {
        exe.run(inputs)?;
    }
    // Per step: total microseconds over the timed runs, and calls.
    let mut per_step = vec![(0.0f64, 0u64); infos.len()];
    let mut wall = 0.0;
    let mut clock = None;
    for _ in 0..runs {
        let t = Instant::now();
        exe.run(inputs)?;
        wall += t.elapsed().as_secs_f64();
        if let Some(times) = exe.step_times() {
            clock = Some(times.clock);
            for s in &times.steps {
                if let Some(e) = per_step.get_mut(s.step) {
                    e.0 += s.dur_us;
                    e.1 += 1;
                }
            }
        }
    }
    exe.set_step_timing(false);
    let rows = aggregate(&infos, &per_step, runs, &limits, opts.group_by);
    let total_us: f64 = per_step.iter().map(|e| e.0).sum();
    let note = (!timed || clock.is_none()).then(|| {
        format!(
            "the {} session does not time steps yet: only the wall time per run is measured",
            exe.device()
        )
    });
    Ok(Profile {
        device: exe.device().to_string(),
        clock: match clock {
            Some(StepClock::Host) => "host wall".into(),
            Some(StepClock::Device) => "device events".into(),
            None => "none".into(),
        },
        runs,
        steps: infos.len(),
        step_ms_per_run: total_us / 1e3 / runs as f64,
        wall_ms_per_run: wall * 1e3 / runs as f64,
        limits,
        rows,
        note,
    })
}

fn aggregate(
    infos: &[StepInfo],
    per_step: &[(f64, u64)],
    runs: usize,
    limits: &Limits,
    by: GroupBy,
) -> Vec<Row> {
    let total_us: f64 = per_step.iter().map(|e| e.0).sum();
    let mut order: Vec<String> = Vec::new();
    let mut acc: HashMap<String, (f64, u64, u64, u64)> = HashMap::new();
    for (info, &(us, calls)) in infos.iter().zip(per_step) {
        let key = match by {
            GroupBy::Op => info.op.to_string(),
            GroupBy::Source => info.name(),
        };
        let e = acc.entry(key.clone()).or_insert_with(|| {
            order.push(key);
            (0.0, 0, 0, 0)
        });
        e.0 += us;
        e.1 += calls;
        e.2 = e.2.saturating_add(info.bytes);
        e.3 = e.3.saturating_add(info.flops);
    }
    let mut rows: Vec<Row> = order
        .into_iter()
        .map(|name| {
            let (us, calls, bytes, flops) = acc[&name];
            // Per run: bytes and FLOPs of one run over the time of one run.
            let secs = us / 1e6 / runs as f64;
            let rate = |x: u64| if secs > 0.0 { x as f64 / secs } else { 0.0 };
            Row {
                calls,
                total_ms: us / 1e3,
                share: if total_us > 0.0 {
                    100.0 * us / total_us
                } else {
                    0.0
                },
                mean_us: if calls > 0 { us / calls as f64 } else { 0.0 },
                bytes,
                flops,
                gb_per_s: rate(bytes) / 1e9,
                bandwidth_pct: 100.0 * rate(bytes) / limits.bytes_per_s,
                tflop_per_s: rate(flops) / 1e12,
                flops_pct: 100.0 * rate(flops) / limits.flops_per_s,
                name,
            }
        })
        .collect();
    rows.sort_by(|a, b| {
        b.total_ms
            .total_cmp(&a.total_ms)
            .then_with(|| a.name.cmp(&b.name))
    });
    rows
}

impl Profile {
    /// The profile as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a profile serializes")
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self
            .rows
            .iter()
            .map(|r| r.name.chars().count())
            .max()
            .unwrap_or(4)
            .clamp(4, 60);
        let rule = format!("{}\n", "-".repeat(width + 78));
        f.write_str(&rule)?;
        writeln!(
            f,
            "{:<width$}  {:>6}  {:>10}  {:>6}  {:>10}  {:>9}  {:>6}  {:>9}  {:>6}",
            "Name", "Calls", "Total ms", "Share", "Mean µs", "GB/s", "% BW", "TFLOP/s", "% FLOP"
        )?;
        f.write_str(&rule)?;
        for r in &self.rows {
            let name: String = if r.name.chars().count() > width {
                let mut s: String = r.name.chars().take(width - 1).collect();
                s.push('…');
                s
            } else {
                r.name.clone()
            };
            writeln!(
                f,
                "{name:<width$}  {:>6}  {:>10.3}  {:>5.1}%  {:>10.2}  {:>9.3}  {:>5.1}%  {:>9.5}  {:>5.1}%",
                r.calls,
                r.total_ms,
                r.share,
                r.mean_us,
                r.gb_per_s,
                r.bandwidth_pct,
                r.tflop_per_s,
                r.flops_pct
            )?;
        }
        f.write_str(&rule)?;
        writeln!(
            f,
            "{} steps per run on {} ({} clock), {} timed runs: steps {:.3} ms per run, run wall \
             time {:.3} ms",
            self.steps,
            self.device,
            self.clock,
            self.runs,
            self.step_ms_per_run,
            self.wall_ms_per_run
        )?;
        writeln!(
            f,
            "limits: {:.1} GB/s, {:.3} TFLOP/s ({})",
            self.limits.bytes_per_s / 1e9,
            self.limits.flops_per_s / 1e12,
            self.limits.source
        )?;
        if let Some(n) = &self.note {
            writeln!(f, "note: {n}")?;
        }
        Ok(())
    }
}

/// Seeded random values for the graph inputs not in `given`: floats uniform in [-1, 1),
/// integers 0 or 1 (valid class targets and indices for any size of at least 2), bools random.
/// Returns every input in the graph's order and the names of those generated.
pub fn fill_inputs(
    graph: &rustytorch_compiler::Graph,
    mut given: Vec<(String, HostTensor)>,
    seed: u64,
) -> (Vec<(String, HostTensor)>, Vec<String>) {
    let mut out = Vec::with_capacity(graph.inputs.len());
    let mut made = Vec::new();
    for (k, d) in graph.inputs.iter().enumerate() {
        match given.iter().position(|(n, _)| *n == d.name) {
            Some(i) => out.push(given.swap_remove(i)),
            None => {
                let t = rustytorch_ops::testing::rand_tensor(
                    &d.ty,
                    seed.wrapping_add(k as u64),
                    if d.ty.dtype.is_float() { -1.0 } else { 0.0 },
                    if d.ty.dtype.is_float() { 1.0 } else { 2.0 },
                );
                made.push(d.name.clone());
                out.push((d.name.clone(), t));
            }
        }
    }
    (out, made)
}
