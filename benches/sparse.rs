//! CPU SpGEMM (`C = A·B`, CSR × CSR → CSR, f32 values, i32 indices) on random square matrices,
//! against SciPy in the same run: each case writes its matrices as npy files and runs
//! `python3 benches/scipy_spgemm.py` on them (SciPy's `A @ B`, single-threaded), then criterion
//! times the Rust kernel; a summary table of medians and ratios is printed at the end.
//!
//! `cargo bench --bench sparse` (set `RUSTYTORCH_SPARSE_BENCH=small` to skip the n = 8192,
//! density 1e-2 case, whose product has about 37 M nonzeros, or `large` to run it alone).
//!
//! A second table gives, per case, what the load of a shared machine disturbs less than wall
//! time (`getrusage` of the process, Linux): the user CPU time of one product on one thread (best
//! of the runs; user and system apart, since page faults are system time) and the minor page
//! faults per product on one and on all threads.
//! `RUSTYTORCH_SPARSE_BENCH_PROFILE=only` prints that table alone (no criterion, no SciPy).

#![allow(missing_docs)] // criterion_group! generates undocumented public functions

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use rustytorch::npy::write_npy;
use rustytorch::ops::sparse::random_csr;
use rustytorch::ops::{spgemm, CsrMatrix};
use rustytorch::{DType, HostTensor};
use std::path::Path;
use std::time::Instant;

/// (n, density) of each case.
fn cases() -> Vec<(usize, f64)> {
    let which = std::env::var("RUSTYTORCH_SPARSE_BENCH").unwrap_or_default();
    let mut c = vec![];
    if which != "large" {
        c.extend([(16384, 1e-3), (65536, 1e-4)]);
    }
    if which != "small" {
        c.push((8192, 1e-2));
    }
    c
}

fn write(dir: &Path, name: &str, m: &CsrMatrix) {
    for (part, t) in [
        ("row_ptr", m.row_ptr()),
        ("col_idx", m.col_idx()),
        ("values", m.values()),
    ] {
        write_npy(&dir.join(format!("{name}.{part}.npy")), t).unwrap();
    }
}

/// SciPy's median time (ms) of `A @ B`, with `sort_indices()` added, and its result's nnz.
fn scipy(a: &CsrMatrix, b: &CsrMatrix, tag: &str) -> Option<(f64, f64, usize)> {
    let dir = std::env::temp_dir().join(format!("rustytorch_spgemm_{tag}_{}", std::process::id()));
    std::fs::create_dir_all(&dir).ok()?;
    write(&dir, "a", a);
    write(&dir, "b", b);
    let shape =
        HostTensor::from_vec(vec![a.rows() as i64, a.cols() as i64, b.cols() as i64], [3]).unwrap();
    write_npy(&dir.join("shape.npy"), &shape).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/scipy_spgemm.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .arg(&dir)
        .output();
    let _ = std::fs::remove_dir_all(&dir);
    let out = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).to_string(),
        Ok(o) => {
            eprintln!("scipy peer failed: {}", String::from_utf8_lossy(&o.stderr));
            return None;
        }
        Err(e) => {
            eprintln!("scipy peer did not run: {e}");
            return None;
        }
    };
    eprintln!("{}", out.trim());
    let field = |k: &str| -> Option<f64> {
        out.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .and_then(|v| v.parse().ok())
    };
    Some((field("ms")?, field("sorted_ms")?, field("nnz")? as usize))
}

/// Median wall time (ms) of `reps` products.
fn median_ms(a: &CsrMatrix, b: &CsrMatrix, reps: usize) -> f64 {
    let mut ts: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(spgemm(a, b).unwrap());
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ts.sort_by(f64::total_cmp);
    ts[reps / 2]
}

/// The process's user and system CPU time (ms) and minor page faults so far.
fn usage() -> (f64, f64, u64) {
    // SAFETY: getrusage writes one plain struct, zero-initialized here.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let ms = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 * 1e-3;
    (ms(ru.ru_utime), ms(ru.ru_stime), ru.ru_minflt as u64)
}

/// One product's costs: user and system CPU time (ms), wall time (ms), minor page faults.
type Costs = (f64, f64, f64, u64);

/// Over `reps` products on a pool of `threads` threads: the best user and system CPU times, and
/// the median wall time and page faults of one product.
fn profile(a: &CsrMatrix, b: &CsrMatrix, threads: usize, reps: usize) -> Costs {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        std::hint::black_box(spgemm(a, b).unwrap());
        let (mut user, mut sys) = (f64::INFINITY, f64::INFINITY);
        let (mut wall, mut faults) = (vec![], vec![]);
        for _ in 0..reps {
            let (u0, s0, f0) = usage();
            let t = Instant::now();
            let c = std::hint::black_box(spgemm(a, b).unwrap());
            let w = t.elapsed().as_secs_f64() * 1e3;
            let (u1, s1, f1) = usage();
            drop(c);
            user = user.min(u1 - u0);
            sys = sys.min(s1 - s0);
            wall.push(w);
            faults.push(f1 - f0);
        }
        wall.sort_by(f64::total_cmp);
        faults.sort();
        (user, sys, wall[reps / 2], faults[reps / 2])
    })
}

fn profile_table() {
    let all = rayon::current_num_threads();
    println!(
        "\n| n | density | 1 thread: user ms | sys ms | wall ms | page faults | {all} threads: \
         wall ms | page faults |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for (n, density) in cases() {
        let a = random_csr(n, n, density, DType::F32, DType::I32, 1).unwrap();
        let b = random_csr(n, n, density, DType::F32, DType::I32, 2).unwrap();
        let (u1, s1, w1, f1) = profile(&a, &b, 1, 10);
        let (_, _, wn, fnn) = profile(&a, &b, all, 10);
        println!("| {n} | {density:e} | {u1:.2} | {s1:.2} | {w1:.2} | {f1} | {wn:.2} | {fnn} |");
    }
}

fn spgemm_vs_scipy(c: &mut Criterion) {
    if std::env::var("RUSTYTORCH_SPARSE_BENCH_PROFILE").as_deref() == Ok("only") {
        profile_table();
        return;
    }
    let mut group = c.benchmark_group("spgemm_f32");
    group.sample_size(10);
    let mut rows = vec![];
    for (n, density) in cases() {
        let a = random_csr(n, n, density, DType::F32, DType::I32, 1).unwrap();
        let b = random_csr(n, n, density, DType::F32, DType::I32, 2).unwrap();
        let tag = format!("n{n}_d{density:e}");
        let peer = scipy(&a, &b, &tag);
        let nnz = spgemm(&a, &b).unwrap().nnz();
        group.bench_with_input(BenchmarkId::from_parameter(&tag), &n, |bench, _| {
            bench.iter(|| spgemm(&a, &b).unwrap())
        });
        rows.push((n, density, a.nnz(), nnz, median_ms(&a, &b, 10), peer));
    }
    group.finish();
    println!(
        "\n| n | density | nnz(A) | nnz(C) | RustyTorch ms | SciPy ms | SciPy + sort ms | \
         speedup vs SciPy | vs SciPy + sort |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (n, d, annz, cnnz, ours, peer) in rows {
        match peer {
            Some((s, ss, snnz)) => {
                if snnz != cnnz {
                    eprintln!("note: SciPy drops exact zeros: its product has {snnz} nonzeros");
                }
                println!(
                    "| {n} | {d:e} | {annz} | {cnnz} | {ours:.2} | {s:.2} | {ss:.2} | {:.2}× | \
                     {:.2}× |",
                    s / ours,
                    ss / ours
                );
            }
            None => println!("| {n} | {d:e} | {annz} | {cnnz} | {ours:.2} | – | – | – | – |"),
        }
    }
    profile_table();
}

criterion_group!(benches, spgemm_vs_scipy);
criterion_main!(benches);
