//! The worker pool kernel launches split their work over.
//!
//! A decode step of a small model runs a few hundred kernels of tens of
//! microseconds each, back to back. Handing each one to a general-purpose
//! pool (rayon's `scope`) from the executor's thread costs two sleeps and
//! wake-ups per kernel — the caller parks while the workers run, a parked
//! worker is woken by the kernel — which on a virtual machine measured more
//! than the second core gave back (SmolLM2-135M on its Q4_1 blocks: 87
//! tokens/s on one thread, 73 on two). This pool avoids both:
//!
//! - **the caller works**: [`WorkerPool::run`] runs parts on the calling
//!   thread too, so a pool of `n` threads has `n − 1` workers of its own;
//! - **workers spin between jobs**: after a job a worker polls for the next
//!   one for [`SPIN`] before it parks, so kernels issued back to back find it
//!   awake;
//! - **parts are claimed, not assigned**: the caller and the workers take
//!   parts from one counter, so a part no awake worker took is run by the
//!   caller rather than waited for.
//!
//! Which thread runs a part never changes what the part computes; callers
//! that need results independent of the thread count choose their parts
//! without regard to it (see `kvjit_jit::launch`).
//!
//! One job runs at a time. A `run` from another thread while a job is in
//! flight — or from inside a part — runs all its parts on its own thread
//! instead of waiting, so the pool never deadlocks and never serializes
//! independent callers behind each other.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker polls for the next job before it parks.
pub const SPIN: Duration = Duration::from_millis(2);

/// The most threads a pool takes: more than any CPU has cores (a pool
/// that size only shares them), and few enough that spawning them cannot
/// run the process out of memory (100 000 aborted it).
pub const MAX_WORKER_THREADS: usize = 1024;

/// Parse a command line's thread count: 0 (one per core) up to
/// [`MAX_WORKER_THREADS`].
pub fn parse_threads(text: &str) -> std::result::Result<usize, String> {
    let threads: usize = text.parse().map_err(|e| format!("{e}"))?;
    if threads > MAX_WORKER_THREADS {
        return Err(format!("at most {MAX_WORKER_THREADS} threads (0: one per core), got {threads}"));
    }
    Ok(threads)
}

/// A job's parts: the closure, how many parts, and who has claimed and
/// finished what.
struct Job {
    part: Box<dyn Fn(usize) + Send + Sync>,
    parts: usize,
    /// The next unclaimed part.
    next: AtomicUsize,
    /// Parts not yet finished.
    unfinished: AtomicUsize,
    /// A part panicked (on a worker; the caller re-raises it).
    panicked: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

impl Job {
    /// Claim and run parts until none is left.
    fn work(&self) {
        loop {
            let part = self.next.fetch_add(1, Ordering::Relaxed);
            if part >= self.parts {
                return;
            }
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| (self.part)(part))) {
                self.panicked.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert(payload);
            }
            self.unfinished.fetch_sub(1, Ordering::Release);
        }
    }
}

/// What the workers watch: the latest job, numbered.
struct Shared {
    posted: Mutex<Posted>,
    wake: Condvar,
    /// The number of the latest job, also readable without the lock.
    generation: AtomicU64,
    /// Workers parked on `wake`.
    parked: AtomicUsize,
    /// Set by [`WorkerPool::park_idle`] to the latest job's number: a worker
    /// that has seen that job and spins for the next parks at once.
    park_after: AtomicU64,
    shutdown: AtomicBool,
}

struct Posted {
    generation: u64,
    job: Option<Arc<Job>>,
}

/// A pool of `threads − 1` worker threads plus the calling thread.
pub struct WorkerPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Held by the thread whose job is in flight.
    dispatch: Mutex<()>,
    threads: usize,
}

impl std::fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerPool").field("threads", &self.threads).finish()
    }
}

impl WorkerPool {
    /// A pool running jobs on `threads` threads (at least 1): the caller's
    /// and `threads − 1` workers named `{name}-{i}`.
    pub fn new(threads: usize, name: &str) -> std::io::Result<Self> {
        if threads > MAX_WORKER_THREADS {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{threads} threads asked for; a pool takes at most {MAX_WORKER_THREADS}"),
            ));
        }
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            posted: Mutex::new(Posted { generation: 0, job: None }),
            wake: Condvar::new(),
            generation: AtomicU64::new(0),
            parked: AtomicUsize::new(0),
            park_after: AtomicU64::new(u64::MAX),
            shutdown: AtomicBool::new(false),
        });
        let mut pool = Self { shared, workers: Vec::new(), dispatch: Mutex::new(()), threads };
        for i in 1..threads {
            let shared = pool.shared.clone();
            // On an error `pool` is dropped, which stops the workers started.
            let worker = std::thread::Builder::new().name(format!("{name}-{i}")).spawn(move || worker_loop(&shared))?;
            pool.workers.push(worker);
        }
        Ok(pool)
    }

    /// Threads a job runs on, the caller's included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Run `part(i)` for every `i` in `0..parts`, on the calling thread and
    /// the workers, and return when all are done. A panic in a part is
    /// re-raised here once every part has finished.
    pub fn run(&self, parts: usize, part: impl Fn(usize) + Send + Sync + 'static) {
        if parts == 0 {
            return;
        }
        let guard = match self.dispatch.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            // Busy: another job is in flight (maybe this thread's own).
            Err(TryLockError::WouldBlock) => return (0..parts).for_each(part),
        };
        if self.workers.is_empty() || parts == 1 {
            return (0..parts).for_each(part);
        }
        let job = Arc::new(Job {
            part: Box::new(part),
            parts,
            next: AtomicUsize::new(0),
            unfinished: AtomicUsize::new(parts),
            panicked: Mutex::new(None),
        });
        self.post(Some(job.clone()));
        job.work();
        let mut polls = 0u32;
        while job.unfinished.load(Ordering::Acquire) != 0 {
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(256) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        drop(guard);
        let panicked = job.panicked.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(payload) = panicked {
            resume_unwind(payload);
        }
    }

    /// Park the workers spinning for a next job now rather than after
    /// [`SPIN`], and wait (at most `SPIN`) until every worker is parked: so
    /// threads outside the pool (another library's pool, a bandwidth probe)
    /// get the cores the spinning workers would share with them. The next
    /// job wakes them as usual.
    pub fn park_idle(&self) {
        if self.workers.is_empty() {
            return;
        }
        let latest = self.shared.generation.load(Ordering::Acquire);
        self.shared.park_after.store(latest, Ordering::Release);
        let started = Instant::now();
        while self.shared.parked.load(Ordering::Acquire) < self.workers.len() && started.elapsed() < SPIN {
            std::thread::yield_now();
        }
    }

    /// Make `job` the latest and wake parked workers.
    fn post(&self, job: Option<Arc<Job>>) {
        let mut posted = self.shared.posted.lock().unwrap_or_else(PoisonError::into_inner);
        posted.generation += 1;
        posted.job = job;
        self.shared.generation.store(posted.generation, Ordering::Release);
        if self.shared.parked.load(Ordering::Relaxed) > 0 {
            self.shared.wake.notify_all();
        }
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.post(None);
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// A worker: wait for a job newer than the last one seen (spinning for
/// [`SPIN`], then parked), help with it, repeat until shut down.
fn worker_loop(shared: &Shared) {
    let mut seen = 0;
    loop {
        let started = Instant::now();
        let mut polls = 0u32;
        while shared.generation.load(Ordering::Acquire) == seen {
            polls = polls.wrapping_add(1);
            if !polls.is_multiple_of(1024) {
                std::hint::spin_loop();
            } else if started.elapsed() >= SPIN || shared.park_after.load(Ordering::Acquire) == seen {
                break;
            } else {
                // On a machine with more runnable threads than cores (a
                // test run), let the thread that will post the next job run.
                std::thread::yield_now();
            }
        }
        let job = {
            let mut posted = shared.posted.lock().unwrap_or_else(PoisonError::into_inner);
            while posted.generation == seen && !shared.shutdown.load(Ordering::Acquire) {
                // `parked` changes under the lock `post` reads it under.
                shared.parked.fetch_add(1, Ordering::Relaxed);
                posted = shared.wake.wait(posted).unwrap_or_else(PoisonError::into_inner);
                shared.parked.fetch_sub(1, Ordering::Relaxed);
            }
            seen = posted.generation;
            posted.job.clone()
        };
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        if let Some(job) = job {
            job.work();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_runs_exactly_once_on_any_pool() {
        for threads in [1, 2, 3, 5] {
            let pool = WorkerPool::new(threads, "test").unwrap();
            for parts in [0, 1, 2, 3, 7, 64] {
                for _ in 0..50 {
                    let counts: Arc<Vec<AtomicUsize>> = Arc::new((0..parts).map(|_| AtomicUsize::new(0)).collect());
                    let seen = counts.clone();
                    pool.run(parts, move |i| {
                        seen[i].fetch_add(1, Ordering::Relaxed);
                    });
                    let counts: Vec<usize> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
                    assert_eq!(counts, vec![1; parts], "{threads} threads, {parts} parts");
                }
            }
        }
    }

    #[test]
    fn thread_counts_past_the_limit_are_refused_before_spawning() {
        let err = WorkerPool::new(MAX_WORKER_THREADS + 1, "test").unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
        assert_eq!(parse_threads("0"), Ok(0));
        assert_eq!(parse_threads("1024"), Ok(MAX_WORKER_THREADS));
        assert!(parse_threads("1025").unwrap_err().contains("at most 1024"));
        assert!(parse_threads("-1").is_err() && parse_threads("many").is_err());
    }

    #[test]
    fn parked_workers_wake_for_the_next_job() {
        let pool = WorkerPool::new(3, "test").unwrap();
        std::thread::sleep(SPIN * 3);
        let threads = Arc::new(Mutex::new(std::collections::HashSet::new()));
        let seen = threads.clone();
        // Each part waits for the others, so no thread can run them all.
        let arrived = Arc::new(AtomicUsize::new(0));
        pool.run(3, move |_| {
            seen.lock().unwrap().insert(std::thread::current().id());
            arrived.fetch_add(1, Ordering::SeqCst);
            while arrived.load(Ordering::SeqCst) < 3 {
                std::hint::spin_loop();
            }
        });
        assert_eq!(threads.lock().unwrap().len(), 3, "the parked workers took parts");
    }

    #[test]
    fn park_idle_parks_the_spinning_workers_and_the_next_job_wakes_them() {
        let pool = WorkerPool::new(3, "test").unwrap();
        for _ in 0..3 {
            // The workers are spinning after this job.
            pool.run(8, |_| std::hint::black_box(()));
            pool.park_idle();
            // park_idle waits at most SPIN; on a loaded test machine a
            // worker may not have run by then.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while pool.shared.parked.load(Ordering::SeqCst) < 2 && std::time::Instant::now() < deadline {
                std::thread::yield_now();
            }
            assert_eq!(pool.shared.parked.load(Ordering::SeqCst), 2, "both workers parked");
            let arrived = Arc::new(AtomicUsize::new(0));
            let all = arrived.clone();
            // Each part waits for the others: the parked workers must wake.
            pool.run(3, move |_| {
                all.fetch_add(1, Ordering::SeqCst);
                while all.load(Ordering::SeqCst) < 3 {
                    std::hint::spin_loop();
                }
            });
            assert_eq!(arrived.load(Ordering::SeqCst), 3);
        }
    }

    #[test]
    fn a_nested_or_concurrent_run_completes_on_its_own_thread() {
        let pool = Arc::new(WorkerPool::new(2, "test").unwrap());
        let total = Arc::new(AtomicUsize::new(0));
        let (inner_pool, inner_total) = (pool.clone(), total.clone());
        pool.run(2, move |_| {
            let t = inner_total.clone();
            inner_pool.run(4, move |i| {
                t.fetch_add(i + 1, Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 2 * 10);
        let callers: Vec<_> = (0..4)
            .map(|_| {
                let (pool, total) = (pool.clone(), total.clone());
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let t = total.clone();
                        pool.run(3, move |_| {
                            t.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                })
            })
            .collect();
        callers.into_iter().for_each(|c| c.join().unwrap());
        assert_eq!(total.load(Ordering::Relaxed), 20 + 4 * 200 * 3);
    }

    #[test]
    fn a_panicking_part_is_raised_to_the_caller_after_every_part_finished() {
        let pool = WorkerPool::new(2, "test").unwrap();
        let finished = Arc::new(AtomicUsize::new(0));
        let seen = finished.clone();
        let result = catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, move |i| {
                if i == 5 {
                    panic!("part 5");
                }
                seen.fetch_add(1, Ordering::SeqCst);
            })
        }));
        let payload = result.expect_err("the panic reaches the caller");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"part 5"));
        assert_eq!(finished.load(Ordering::SeqCst), 7);
        // The pool still works.
        let again = Arc::new(AtomicUsize::new(0));
        let seen = again.clone();
        pool.run(4, move |_| {
            seen.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(again.load(Ordering::SeqCst), 4);
    }
}
