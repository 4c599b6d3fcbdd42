//! A fork-join pool for the CPU kernels' hot loops (GEMM panels, attention heads, norm rows):
//! `for_each(n, f)` runs `f(0..n)` on the calling thread and the pool's workers and returns when
//! every call has finished.
//!
//! Why not rayon alone: a model runs one short parallel kernel after another (a MiniLM encoder
//! step is ~100 of them in 18 ms), and rayon's idle workers go to sleep within tens of
//! microseconds; waking one costs a futex call and, on a virtual machine, up to ~100 µs before it
//! works (measured: ~225 futex calls per encoder run). These workers keep spinning for
//! [`SPIN`] after their last task — yielding the core to any other runnable thread while they
//! wait — so back-to-back kernels find them awake, then park until the next call.
//!
//! The pool has `rayon::current_num_threads() − 1` workers (so `RAYON_NUM_THREADS` sets both),
//! started on first use. A call made from a worker, or while another call is running (a nested
//! or concurrent kernel), runs its tasks serially on the calling thread. A panic in a task is
//! caught and resumed on the calling thread after the other tasks finish.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle worker stays awake for the next call.
const SPIN: Duration = Duration::from_millis(2);
/// How long it busy-waits before yielding its core on each check.
const BUSY: Duration = Duration::from_micros(20);

/// One call's tasks.
struct Job {
    /// The task body, valid while `finished < n` (the caller waits for that before returning).
    f: *const (dyn Fn(usize) + Sync),
    n: usize,
    next: AtomicUsize,
    finished: AtomicUsize,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

// SAFETY: `f` points to a `Sync` closure that outlives every call made through it (the caller
// blocks until all `n` calls have finished); the other fields are thread-safe.
unsafe impl Send for Job {}
// SAFETY: as above.
unsafe impl Sync for Job {}

impl Job {
    /// Claims and runs tasks until none is left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return;
            }
            // SAFETY: `i < n`, so this task has not finished and the caller is still waiting:
            // the closure is alive.
            let f = unsafe { &*self.f };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(i))) {
                self.panic
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(p);
            }
            self.finished.fetch_add(1, Ordering::Release);
        }
    }
}

/// The pool's shared state.
struct Pool {
    workers: usize,
    /// The current call, and a count bumped at each new call.
    current: Mutex<(usize, Option<Arc<Job>>)>,
    epoch: AtomicUsize,
    /// Workers parked on `wake`.
    sleeping: AtomicUsize,
    wake: Condvar,
    /// Set while a call runs (a second call then runs serially).
    busy: AtomicBool,
}

thread_local! {
    static IS_WORKER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn pool() -> &'static Arc<Pool> {
    static POOL: OnceLock<Arc<Pool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let p = Arc::new(Pool {
            workers: rayon::current_num_threads().saturating_sub(1),
            current: Mutex::new((0, None)),
            epoch: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            wake: Condvar::new(),
            busy: AtomicBool::new(false),
        });
        for k in 0..p.workers {
            let p = p.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("rustytorch-cpu-{k}"))
                .spawn(move || worker(&p));
            // Without the thread the calls still complete: the caller runs every task.
            drop(spawned);
        }
        p
    })
}

fn worker(p: &Pool) {
    IS_WORKER.with(|w| w.set(true));
    let mut seen = 0usize;
    loop {
        // Awake: watch for a new call for SPIN after the last one.
        let idle = Instant::now();
        while p.epoch.load(Ordering::Acquire) == seen {
            let waited = idle.elapsed();
            if waited > SPIN {
                break;
            }
            if waited > BUSY {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        let mut cur = p.current.lock().unwrap_or_else(|e| e.into_inner());
        // Asleep until the next call.
        while cur.0 == seen {
            p.sleeping.fetch_add(1, Ordering::Relaxed);
            cur = p.wake.wait(cur).unwrap_or_else(|e| e.into_inner());
            p.sleeping.fetch_sub(1, Ordering::Relaxed);
        }
        seen = cur.0;
        let job = cur.1.clone();
        drop(cur);
        if let Some(job) = job {
            job.work();
        }
    }
}

/// Runs `f(i)` for every `i` in `0..n`, spread over the calling thread and the pool's workers;
/// returns when all have finished (see the module docs).
pub fn for_each(n: usize, f: impl Fn(usize) + Sync) {
    // Serially: every task still runs, and the first panic is resumed after the last.
    let serial = |f: &dyn Fn(usize)| {
        let mut first = None;
        for i in 0..n {
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(i))) {
                first.get_or_insert(p);
            }
        }
        if let Some(p) = first {
            resume_unwind(p);
        }
    };
    if n <= 1 || IS_WORKER.with(|w| w.get()) {
        return serial(&f);
    }
    let p = pool();
    if p.workers == 0 || p.busy.swap(true, Ordering::Acquire) {
        return serial(&f);
    }
    let body: &(dyn Fn(usize) + Sync) = &f;
    // SAFETY: only the lifetime is erased; `Job::work` calls through the pointer only for tasks
    // that have not finished, and this function returns only after all `n` have.
    let body: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(body) };
    let job = Arc::new(Job {
        f: body,
        n,
        next: AtomicUsize::new(0),
        finished: AtomicUsize::new(0),
        panic: Mutex::new(None),
    });
    let sleeping = {
        let mut cur = p.current.lock().unwrap_or_else(|e| e.into_inner());
        cur.0 += 1;
        cur.1 = Some(job.clone());
        p.epoch.store(cur.0, Ordering::Release);
        // Parked workers registered under this lock, so none is missed.
        p.sleeping.load(Ordering::Relaxed)
    };
    if sleeping > 0 {
        p.wake.notify_all();
    }
    job.work();
    let start = Instant::now();
    while job.finished.load(Ordering::Acquire) < n {
        if start.elapsed() > BUSY {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    p.current.lock().unwrap_or_else(|e| e.into_inner()).1 = None;
    p.busy.store(false, Ordering::Release);
    let panic = job.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(panic) = panic {
        resume_unwind(panic);
    }
}

/// A mutable slice whose disjoint ranges the tasks of one [`for_each`] call fill, each its own.
pub struct Disjoint<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: the tasks reach the elements only through `range`, whose contract gives each range to
// one task; `T: Send` lets a task write them.
unsafe impl<T: Send> Sync for Disjoint<'_, T> {}

impl<'a, T> Disjoint<'a, T> {
    /// Borrows `s` for the tasks.
    pub fn new(s: &'a mut [T]) -> Self {
        Disjoint {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            _borrow: std::marker::PhantomData,
        }
    }

    /// Elements `lo..hi` (checked against the length).
    ///
    /// # Safety
    /// No other live slice from this `Disjoint` overlaps `lo..hi`.
    #[allow(clippy::mut_from_ref)] // exclusive by the contract above
    pub unsafe fn range(&self, lo: usize, hi: usize) -> &mut [T] {
        assert!(
            lo <= hi && hi <= self.len,
            "range {lo}..{hi} out of {}",
            self.len
        );
        // SAFETY: inside the borrowed slice (checked above), exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(lo), hi - lo) }
    }
}

/// The number of threads [`for_each`] spreads over (the caller included).
pub fn threads() -> usize {
    rayon::current_num_threads().max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once() {
        for n in [0, 1, 2, 7, 100, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            for_each(n, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "n = {n}"
            );
        }
    }

    #[test]
    fn nested_and_concurrent_calls_complete() {
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for _ in 0..50 {
                        for_each(8, |_| {
                            for_each(4, |_| {
                                total.fetch_add(1, Ordering::Relaxed);
                            });
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 3 * 50 * 8 * 4);
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_after_the_others() {
        let done = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            for_each(16, |i| {
                if i == 3 {
                    panic!("task 3");
                }
                done.fetch_add(1, Ordering::Relaxed);
            })
        }));
        assert!(r.is_err());
        assert_eq!(done.load(Ordering::Relaxed), 15);
        // The pool still works.
        let n = AtomicUsize::new(0);
        for_each(10, |_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 10);
    }
}
