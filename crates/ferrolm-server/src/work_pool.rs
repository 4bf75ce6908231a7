//! A few threads of their own for the CPU work of requests (tokenizing prompts, rendering chat
//! templates, decoding echoed or detokenized ids), so that the async threads, which answer
//! `/health` and stream every client's tokens, never wait behind one client's megabytes of text.
//!
//! Invariants:
//! - At most `threads` jobs run at once; the others wait asynchronously for a permit, so a
//!   handler that is dropped while it waits (its client gone) never runs its job.
//! - A job that panics answers an internal error to its request; the pool and the server go on.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use tokio::sync::{oneshot, Semaphore};

use crate::error::ApiError;

pub struct WorkPool {
    pool: rayon::ThreadPool,
    permits: Arc<Semaphore>,
}

impl WorkPool {
    pub fn new(threads: usize) -> Result<WorkPool, rayon::ThreadPoolBuildError> {
        let threads = threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("ferrolm-tokenize-{i}"))
            .build()?;
        Ok(WorkPool { pool, permits: Arc::new(Semaphore::new(threads)) })
    }

    /// Half the machine's cores, 1 to 8: tokenizing runs beside the engine, never in its place.
    pub fn default_threads() -> usize {
        std::thread::available_parallelism().map_or(1, |n| n.get() / 2).clamp(1, 8)
    }

    /// Runs `job` on the pool once a thread is free and answers what it returns.
    pub async fn run<T: Send + 'static>(
        &self,
        job: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let permit = Arc::clone(&self.permits)
            .acquire_owned()
            .await
            .map_err(|_| ApiError::Internal("the tokenizer pool has stopped".into()))?;
        let (tx, rx) = oneshot::channel();
        self.pool.spawn(move || {
            let result = catch_unwind(AssertUnwindSafe(job));
            drop(permit);
            let _ = tx.send(result);
        });
        match rx.await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(ApiError::Internal("a tokenizing job panicked".into())),
            Err(_) => Err(ApiError::Internal("the tokenizer pool has stopped".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn jobs_run_off_the_async_threads_at_most_threads_at_once() -> Result<(), Box<dyn std::error::Error>> {
        let pool = Arc::new(WorkPool::new(2)?);
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let jobs: Vec<_> = (0..8)
            .map(|i| {
                let (pool, running, most) = (Arc::clone(&pool), Arc::clone(&running), Arc::clone(&most));
                tokio::spawn(async move {
                    pool.run(move || {
                        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(20));
                        running.fetch_sub(1, Ordering::SeqCst);
                        let name = std::thread::current().name().map(str::to_string).unwrap_or_default();
                        Ok((i, name))
                    })
                    .await
                })
            })
            .collect();
        for (i, job) in jobs.into_iter().enumerate() {
            let (got, thread) = job.await??;
            assert_eq!(got, i);
            assert!(thread.starts_with("ferrolm-tokenize-"), "{thread}");
        }
        let most = most.load(Ordering::SeqCst);
        assert!((1..=2).contains(&most), "{most} jobs ran at once");
        Ok(())
    }

    #[tokio::test]
    async fn a_panicking_job_is_an_internal_error_and_the_pool_goes_on() -> Result<(), Box<dyn std::error::Error>> {
        let pool = WorkPool::new(1)?;
        let failed = pool.run::<()>(|| panic!("boom")).await;
        assert!(matches!(failed, Err(ApiError::Internal(_))), "{failed:?}");
        assert_eq!(pool.run(|| Ok(7)).await?, 7);
        Ok(())
    }
}
