//! Per-step timing of a run, for traces and profiles. A session with step timing on
//! ([`crate::Session::set_step_timing`]) measures every step of each following run and hands the
//! times of the last run out through [`crate::Session::take_step_times`].
//!
//! The CPU session measures host wall time around each kernel. A device session fills the same
//! form from device timestamps (CUDA: an event recorded on the stream before and after each
//! step's launches, read back after the run's synchronize), marking them [`StepClock::Device`].

use std::time::Instant;

/// Which clock measured the steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepClock {
    /// Host wall time around each step (the CPU backend: the step's kernel runs inside).
    Host,
    /// Device timestamps (events on the device's stream): the time each step's kernels ran on
    /// the device, excluding host launch overhead.
    Device,
}

/// The time of one plan step within a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepTime {
    /// The plan step.
    pub step: usize,
    /// Start, in microseconds after [`StepTimes::origin`].
    pub start_us: f64,
    /// Duration in microseconds.
    pub dur_us: f64,
}

/// The step times of one run.
#[derive(Clone, Debug, PartialEq)]
pub struct StepTimes {
    /// The clock that measured them.
    pub clock: StepClock,
    /// The host instant the offsets count from: the run's start on the host (for device clocks,
    /// the host instant at which the first timestamp was enqueued, so device times line up with
    /// host events up to the launch latency).
    pub origin: Instant,
    /// Each executed step, in execution order.
    pub steps: Vec<StepTime>,
}

impl StepTimes {
    /// The sum of the steps' durations, in microseconds.
    pub fn total_us(&self) -> f64 {
        self.steps.iter().map(|s| s.dur_us).sum()
    }
}
