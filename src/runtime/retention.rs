//! Retention of durable frames (`[events] retain`): a task that removes, through the
//! persistence actor, the rows of frames older than the window, a bounded number of rows
//! per write so the commits beside it wait little. Messages are never removed here: a
//! client that resumes from before the window is given them instead (api/stream.rs).

use std::time::Duration;

use chrono::Utc;

use super::Lifecycle;
use crate::config::Settings;
use crate::persistence::{Persistence, WriteJob, WriteOutcome};

/// Rows removed by one write.
const ROWS_PER_WRITE: u64 = 2_000;

/// Starts the task when frames have a retention window; it ends with the server.
pub fn start(settings: &Settings, persistence: &Persistence, lifecycle: &Lifecycle) {
    let Some(window) = settings.events.retention() else {
        return;
    };
    // A pass every quarter of the window, at most hourly, at least every 10 ms.
    let every = (window / 4).clamp(Duration::from_millis(10), Duration::from_secs(3600));
    let (persistence, lifecycle) = (persistence.clone(), lifecycle.clone());
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = lifecycle.shutting_down() => return,
            }
            let window = chrono::Duration::from_std(window).unwrap_or(chrono::Duration::MAX);
            let before = (Utc::now() - window).timestamp_millis();
            prune(&persistence, before).await;
        }
    });
}

/// Removes every row of frames stored before `before`, a bounded write at a time.
async fn prune(persistence: &Persistence, before: i64) {
    loop {
        let job = WriteJob::PruneFrames {
            before,
            limit: ROWS_PER_WRITE,
        };
        match persistence.write(job).await {
            Ok(WriteOutcome::Pruned(removed)) if removed == ROWS_PER_WRITE => {}
            Ok(WriteOutcome::Pruned(removed)) => {
                if removed > 0 {
                    tracing::debug!(removed, "old frames removed");
                }
                return;
            }
            Ok(other) => {
                tracing::warn!(?other, "an unexpected answer to pruning frames");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "old frames could not be removed; trying again later");
                return;
            }
        }
    }
}
