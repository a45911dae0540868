//! The pause between tries of something that failed (Redis, Postgres): 100 ms doubling to 5 s.

use std::time::Duration;

/// Waits out a failure: 100 ms doubling to 5 s, reset by a success (a new `Backoff`).
pub(crate) struct Backoff(Duration);

impl Backoff {
    pub(crate) fn new() -> Backoff {
        Backoff(Duration::from_millis(100))
    }

    pub(crate) async fn wait(&mut self) {
        tokio::time::sleep(self.0).await;
        self.0 = (self.0 * 2).min(Duration::from_secs(5));
    }
}
