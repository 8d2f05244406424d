//! Waiting for something a VMM or the kernel does on its own (a process exits, a socket appears, a migration
//! completes, a cgroup empties), for which there is nothing to block on.

use std::time::Duration;

/// The longest sleep between two looks.
const MAX_STEP: Duration = Duration::from_millis(20);

/// Sleeps between two looks: 1 ms first, then twice as long each time up to 20 ms. Most of these waits end
/// within a few milliseconds (a QEMU that got `quit`, ~100 KB of device state migrated to a file): a fixed 20 ms
/// step made each of them cost 10 ms on average for nothing, several times per pause and resume. A long wait
/// costs no more wake-ups than before once the step reaches 20 ms.
#[derive(Debug)]
pub(crate) struct Backoff {
    step: Duration,
}

impl Backoff {
    pub(crate) fn new() -> Self {
        Backoff {
            step: Duration::from_millis(1),
        }
    }

    /// Sleeps for the current step and lengthens the next one.
    pub(crate) async fn sleep(&mut self) {
        tokio::time::sleep(self.next_step()).await;
    }

    fn next_step(&mut self) -> Duration {
        let step = self.step;
        self.step = (step * 2).min(MAX_STEP);
        step
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_double_from_one_millisecond_up_to_twenty() {
        let mut b = Backoff::new();
        let steps: Vec<u128> = (0..8).map(|_| b.next_step().as_millis()).collect();
        assert_eq!(steps, vec![1, 2, 4, 8, 16, 20, 20, 20]);
    }
}
