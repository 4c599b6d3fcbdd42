//! Chrome traces of compiles and runs, in the Trace Event Format that Perfetto
//! (ui.perfetto.dev) and chrome://tracing open.
//!
//! [`crate::Executable::trace_to`] (or `RUSTYTORCH_TRACE=FILE.json` for every executable a
//! program compiles, or the runner's `--trace FILE`) writes:
//!
//! - one process per executable, named by its device and outputs;
//! - on its `compile` thread, the compile passes with their times (verify, optimize, fuse,
//!   plan), lowering and preparing the session, with what each pass did as arguments;
//! - on its `run` thread, every run, and inside it every plan step, named by its op and the
//!   source location where the builder made it (`matmul_epilogue @ src/model.rs:20:15`), with
//!   the op's text, output type, bytes moved and FLOPs as arguments. On the CPU a step's time is
//!   its host wall time; a session that times steps on its device (CUDA events) puts them on a
//!   `device` thread instead, aligned to the run's start.
//!
//! Executables that trace to the same file in one process share it (one timeline). The file is
//! valid JSON after every run: events are appended before a fixed closing tail, which is
//! rewritten after them.
//!
//! Why not `tracing-chrome`: that subscriber stamps events with host clocks as spans open and
//! close, so it cannot place device-side times measured by CUDA events, and it must be installed
//! as the process's (or thread's) subscriber, which a library should not take over from its
//! user. The events here carry explicit timestamps and typed arguments; `serde_json` writes them.

use crate::{Error, Result};
use rustytorch_codegen::{Plan, Storage};
use rustytorch_compiler::passes::Report;
use rustytorch_compiler::{Graph, MemoryPlan, NodeId};
use rustytorch_ops::Op;
use rustytorch_runtime::{StepClock, StepTimes};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// The process-wide origin of trace timestamps.
pub(crate) fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Microseconds from the trace origin to `t`.
fn us(t: Instant) -> f64 {
    t.saturating_duration_since(epoch()).as_secs_f64() * 1e6
}

/// What one plan step does: its op, where it was built, what it moves and computes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepInfo {
    /// The step's index in the plan.
    pub step: usize,
    /// The op's name (`matmul_epilogue`, `fused`, `reduce_sum`).
    pub op: &'static str,
    /// The op's text with attributes (for a fused kernel, the ops it holds).
    pub op_text: String,
    /// Where the builder made the step's node (`file:line:col`), when known.
    pub location: Option<String>,
    /// The result's type.
    pub output: String,
    /// Bytes the step reads and writes (0 for a reshape that aliases its operand).
    pub bytes: u64,
    /// FLOPs (the estimate of [`crate::stats::node_flops`]).
    pub flops: u64,
}

impl StepInfo {
    /// The step's name in traces: the op and, when known, its source location.
    pub fn name(&self) -> String {
        match &self.location {
            Some(l) => format!("{} @ {l}", self.op),
            None => self.op.to_string(),
        }
    }
}

/// The node of each plan step: the memory plan's schedule without its leaves, as `lower` makes
/// the steps; None when the two do not line up.
fn step_nodes(graph: &Graph, memory: &MemoryPlan, plan: &Plan) -> Option<Vec<NodeId>> {
    let nodes: Vec<NodeId> = memory
        .schedule
        .iter()
        .copied()
        .filter(|&n| graph.node(n).is_ok_and(|x| !x.op.is_leaf()))
        .collect();
    let same = nodes.len() == plan.steps.len()
        && nodes
            .iter()
            .zip(&plan.steps)
            .all(|(&n, s)| graph.node(n).is_ok_and(|x| x.op == s.op));
    same.then_some(nodes)
}

/// What each step of `plan` (lowered from `graph` with `memory`) does.
pub fn step_infos(graph: &Graph, memory: Option<&MemoryPlan>, plan: &Plan) -> Vec<StepInfo> {
    let nodes = memory.and_then(|m| step_nodes(graph, m, plan));
    let size = |v: usize| plan.types.get(v).map_or(0, |t| t.size_bytes() as u64);
    plan.steps
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let node = nodes.as_ref().map(|ns| ns[i]);
            let alias = matches!(plan.storage.get(s.output), Some(Storage::Alias(_)));
            let bytes = if alias {
                0
            } else {
                s.inputs
                    .iter()
                    .map(|&v| size(v))
                    .fold(size(s.output), u64::saturating_add)
            };
            StepInfo {
                step: i,
                op: s.op.name(),
                op_text: match &s.op {
                    Op::Fused(_) | Op::FusedRow(_) => {
                        rustytorch_compiler::inspect::op_summary(&s.op)
                    }
                    op => op.to_string(),
                },
                location: node.and_then(|n| graph.location(n)).map(|l| l.to_string()),
                output: plan
                    .types
                    .get(s.output)
                    .map(|t| t.to_string())
                    .unwrap_or_default(),
                bytes,
                flops: node.map_or(0, |n| crate::stats::node_flops(graph, n)),
            }
        })
        .collect()
}

/// When the parts of a compile finished.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CompileTimes {
    pub(crate) start: Instant,
    pub(crate) passes_done: Instant,
    pub(crate) lowered: Instant,
    pub(crate) prepared: Instant,
}

/// A trace file: the header, the events so far, and a closing tail after them.
struct TraceFile {
    file: File,
    path: PathBuf,
    /// Where the closing tail starts.
    end: u64,
    events: u64,
}

const HEAD: &str = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
const TAIL: &str = "\n]}\n";

impl TraceFile {
    fn create(path: &Path) -> std::io::Result<TraceFile> {
        let mut file = File::create(path)?;
        file.write_all(HEAD.as_bytes())?;
        file.write_all(TAIL.as_bytes())?;
        file.flush()?;
        Ok(TraceFile {
            file,
            path: path.to_path_buf(),
            end: HEAD.len() as u64,
            events: 0,
        })
    }

    /// Appends events; the file stays valid JSON.
    fn append(&mut self, events: &[Value]) -> std::io::Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        let mut buf = Vec::new();
        for e in events {
            if self.events > 0 || !buf.is_empty() {
                buf.extend_from_slice(b",\n");
            }
            serde_json::to_writer(&mut buf, e)?;
        }
        self.file.seek(SeekFrom::Start(self.end))?;
        self.file.write_all(&buf)?;
        self.end += buf.len() as u64;
        self.file.write_all(TAIL.as_bytes())?;
        self.file.flush()?;
        self.events += events.len() as u64;
        Ok(())
    }
}

/// The open trace files of this process, by absolute path.
fn sink(path: &Path) -> Result<Arc<Mutex<TraceFile>>> {
    static SINKS: OnceLock<Mutex<HashMap<PathBuf, Arc<Mutex<TraceFile>>>>> = OnceLock::new();
    let file_err = |e: std::io::Error| Error::File {
        path: path.display().to_string(),
        reason: format!("cannot write the trace: {e}"),
    };
    let key = std::path::absolute(path).map_err(file_err)?;
    let mut sinks = SINKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(s) = sinks.get(&key) {
        return Ok(s.clone());
    }
    let s = Arc::new(Mutex::new(TraceFile::create(&key).map_err(file_err)?));
    sinks.insert(key, s.clone());
    Ok(s)
}

/// One executable's trace: its process in the file and its steps.
pub(crate) struct Tracer {
    sink: Arc<Mutex<TraceFile>>,
    pid: u64,
    steps: Vec<StepInfo>,
    runs: u64,
}

const TID_COMPILE: u64 = 1;
const TID_RUN: u64 = 2;
const TID_DEVICE: u64 = 3;

fn complete(name: &str, cat: &str, pid: u64, tid: u64, ts: f64, dur: f64, args: Value) -> Value {
    json!({"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": ts,
           "dur": dur.max(0.0), "args": args})
}

fn meta(what: &str, pid: u64, tid: Option<u64>, name: &str) -> Value {
    let mut v = json!({"name": what, "ph": "M", "pid": pid, "args": {"name": name}});
    if let Some(t) = tid {
        v["tid"] = json!(t);
    }
    v
}

impl Tracer {
    /// Replaces the steps that runs are described by (the executable switched to the plan
    /// compiled for another shape).
    pub(crate) fn set_steps(&mut self, steps: Vec<StepInfo>) {
        self.steps = steps;
    }

    /// Opens (or joins) the trace file at `path` and writes the executable's compile.
    pub(crate) fn start(
        path: &Path,
        title: &str,
        steps: Vec<StepInfo>,
        compile: &CompileTimes,
        report: &Report,
    ) -> Result<Tracer> {
        static NEXT_PID: AtomicU64 = AtomicU64::new(1);
        let sink = sink(path)?;
        let pid = NEXT_PID.fetch_add(1, Ordering::Relaxed);
        let mut ev = vec![
            meta("process_name", pid, None, title),
            json!({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}),
            meta("thread_name", pid, Some(TID_COMPILE), "compile"),
            meta("thread_name", pid, Some(TID_RUN), "run (host)"),
            meta("thread_name", pid, Some(TID_DEVICE), "device"),
        ];
        let (t0, total) = (
            us(compile.start),
            compile
                .prepared
                .saturating_duration_since(compile.start)
                .as_secs_f64()
                * 1e6,
        );
        ev.push(complete(
            "compile",
            "compile",
            pid,
            TID_COMPILE,
            t0,
            total,
            json!({"steps": steps.len()}),
        ));
        // The report holds each pass's duration; they ran one after another from the start.
        let mut t = t0;
        for p in &report.passes {
            let mut args = json!({"nodes": p.nodes});
            match p.name {
                "optimize" => {
                    if let Some(o) = &report.optimize {
                        args["stop_reason"] = json!(format!("{:?}", o.stop_reason));
                        args["iterations"] = json!(o.iterations);
                        args["egraph_nodes"] = json!(o.egraph_nodes);
                        args["cost_before"] = json!(o.cost_before);
                        args["cost_after"] = json!(o.cost_after);
                    }
                }
                "fuse" => {
                    if let Some(f) = &report.fuse {
                        args["kernels"] = json!(f.groups);
                        args["ops_absorbed"] = json!(f.ops_absorbed);
                    }
                }
                "plan" => {
                    if let Some(m) = &report.memory {
                        args["arena_bytes"] = json!(m.arena_bytes);
                        args["naive_bytes"] = json!(m.naive_bytes);
                    }
                }
                _ => {}
            }
            let dur = p.millis * 1e3;
            ev.push(complete(p.name, "pass", pid, TID_COMPILE, t, dur, args));
            t += dur;
        }
        let lowered = us(compile.lowered);
        let passes_done = us(compile.passes_done);
        ev.push(complete(
            "lower",
            "pass",
            pid,
            TID_COMPILE,
            passes_done,
            lowered - passes_done,
            json!({"steps": steps.len()}),
        ));
        ev.push(complete(
            "prepare",
            "pass",
            pid,
            TID_COMPILE,
            lowered,
            us(compile.prepared) - lowered,
            json!({}),
        ));
        let tracer = Tracer {
            sink,
            pid,
            steps,
            runs: 0,
        };
        tracer.write(&ev)?;
        Ok(tracer)
    }

    fn write(&self, ev: &[Value]) -> Result<()> {
        let mut f = self.sink.lock().unwrap_or_else(|e| e.into_inner());
        let path = f.path.display().to_string();
        f.append(ev).map_err(|e| Error::File {
            path,
            reason: format!("cannot write the trace: {e}"),
        })
    }

    /// Writes one run: its host span and its steps.
    pub(crate) fn run(
        &mut self,
        start: Instant,
        end: Instant,
        times: Option<&StepTimes>,
        ok: bool,
    ) -> Result<()> {
        self.runs += 1;
        let n = self.runs;
        let mut ev = Vec::with_capacity(1 + self.steps.len());
        let dur = end.saturating_duration_since(start).as_secs_f64() * 1e6;
        ev.push(complete(
            &format!("run {n}"),
            "run",
            self.pid,
            TID_RUN,
            us(start),
            dur,
            json!({"run": n, "ok": ok, "steps": self.steps.len()}),
        ));
        if let Some(t) = times {
            let (tid, clock) = match t.clock {
                StepClock::Host => (TID_RUN, "host wall"),
                StepClock::Device => (TID_DEVICE, "device events"),
            };
            let origin = us(t.origin);
            for s in &t.steps {
                let Some(info) = self.steps.get(s.step) else {
                    continue;
                };
                let mut args = json!({
                    "step": s.step,
                    "run": n,
                    "op": info.op_text,
                    "output": info.output,
                    "bytes": info.bytes,
                    "flops": info.flops,
                    "clock": clock,
                });
                if let Some(l) = &info.location {
                    args["source"] = json!(l);
                }
                ev.push(complete(
                    &info.name(),
                    "step",
                    self.pid,
                    tid,
                    origin + s.start_us,
                    s.dur_us,
                    args,
                ));
            }
        }
        self.write(&ev)
    }
}
