//! Exponential backoff with a cap, for failed reconciles.

use std::time::Duration;

/// Doubles from `initial` up to `max`; [`Backoff::reset`] after a success.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
    failures: u32,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        let initial = initial.max(Duration::from_millis(1));
        let max = max.max(initial);
        Backoff {
            initial,
            max,
            next: initial,
            failures: 0,
        }
    }

    /// The delay before the next attempt; each call doubles the following
    /// one, up to the cap. A little jitter (up to 1/8, from the clock)
    /// keeps many nodes from retrying in lockstep after an API outage.
    pub fn next_delay(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(self.max);
        self.failures = self.failures.saturating_add(1);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let jitter = base / 8 * (nanos % 1000) / 1000;
        (base + jitter).min(self.max)
    }

    /// Consecutive failures since the last reset.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    pub fn reset(&mut self) {
        self.next = self.initial;
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let d: Vec<Duration> = (0..6).map(|_| b.next_delay()).collect();
        for (got, base) in d.iter().zip([100u64, 200, 400, 800, 1000, 1000]) {
            let base = Duration::from_millis(base);
            assert!(
                *got >= base && *got <= (base + base / 8).min(Duration::from_secs(1)),
                "{got:?} vs {base:?}"
            );
        }
        assert_eq!(b.failures(), 6);
        b.reset();
        assert!(b.next_delay() < Duration::from_millis(113));
    }
}
