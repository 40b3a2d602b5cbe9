//! Waiting on observable state with a deadline, never on fixed sleeps.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

/// How long [`until`] gives a condition when the test has no better deadline.
pub const DEFAULT: Duration = Duration::from_secs(20);

/// How often [`until`] re-checks: short, as its conditions are local.
const POLL: Duration = Duration::from_millis(10);

/// How often [`until_some`] re-checks: its conditions ask an API server.
const POLL_ASYNC: Duration = Duration::from_millis(200);

/// Polls `done` until it holds; panics (failing the test) when [`DEFAULT`]
/// passes first.
pub fn until(what: &str, done: impl FnMut() -> bool) {
    until_within(what, DEFAULT, done)
}

/// [`until`] with a deadline of `timeout`.
pub fn until_within(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(POLL);
    }
}

/// Polls `check` until it yields `Some`, an error, or the deadline passes.
///
/// `check` returns `Ok(Some(v))` when the condition holds, `Ok(None)` to be
/// polled again, and `Err` to give up at once. A single check that does not
/// return before the deadline counts as the deadline passing.
pub async fn until_some<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, check()).await {
            Ok(Ok(Some(v))) => return Ok(v),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => return Err(e.context(format!("while waiting for {what}"))),
            Err(_) => bail!("timed out after {timeout:?} waiting for {what}"),
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(POLL_ASYNC.min(deadline.saturating_duration_since(Instant::now())))
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn until_returns_once_the_condition_holds() {
        let mut n = 0;
        until("the third poll", || {
            n += 1;
            n == 3
        });
        assert_eq!(n, 3);
    }

    #[test]
    #[should_panic(expected = "timed out waiting until never")]
    fn until_fails_at_the_deadline() {
        until_within("never", Duration::from_millis(50), || false);
    }

    #[tokio::test]
    async fn until_some_polls_until_deadline() {
        let mut n = 0;
        let v = until_some("third poll", Duration::from_secs(5), || {
            n += 1;
            let done = n >= 3;
            async move { Ok(done.then_some(n)) }
        })
        .await
        .unwrap();
        assert_eq!(v, 3);
        let err =
            until_some::<(), _, _>("never", Duration::from_millis(300), || async { Ok(None) })
                .await
                .unwrap_err();
        assert!(err.to_string().contains("timed out"), "{err}");
        let err =
            until_some::<(), _, _>("fails", Duration::from_secs(5), || async { bail!("boom") })
                .await
                .unwrap_err();
        assert!(format!("{err:#}").contains("boom"), "{err:#}");
    }
}
