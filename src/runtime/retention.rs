//! Retention of durable frames (`[events] retain`): a task that removes, through the
//! persistence actor, the rows of frames older than the window, a bounded number of rows
//! per write so the commits beside it wait little. Messages are never removed here: a
//! client that resumes from before the window is given them instead (api/stream.rs).
//!
//! Also webhooks' finished deliveries (`[webhooks] keep_ms`) and schedules' finished runs
//! (`[schedules] keep_runs_ms`): a schedule every second makes 86,400 runs a day.

use std::time::Duration;

use chrono::Utc;

use super::Lifecycle;
use crate::config::Settings;
use crate::persistence::{Persistence, WriteJob, WriteOutcome};

/// Rows removed by one write.
const ROWS_PER_WRITE: u64 = 2_000;

/// Starts the tasks: deliveries' and runs' always, frames' when they have a retention
/// window; they end with the server.
pub fn start(settings: &Settings, persistence: &Persistence, lifecycle: &Lifecycle) {
    start_deliveries_and_runs(settings, persistence, lifecycle);
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

/// Removes finished webhook deliveries and schedule runs past their keeping, every quarter
/// of the shorter keeping (at most every minute). A pass that finds nothing writes nothing
/// but the one statement.
fn start_deliveries_and_runs(
    settings: &Settings,
    persistence: &Persistence,
    lifecycle: &Lifecycle,
) {
    let deliveries = settings.webhooks.keep_ms;
    let runs = settings.schedules.keep_runs_ms;
    let every = Duration::from_millis(deliveries.min(runs) / 4)
        .clamp(Duration::from_millis(100), Duration::from_secs(60));
    let (persistence, lifecycle) = (persistence.clone(), lifecycle.clone());
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = lifecycle.shutting_down() => return,
            }
            let now = Utc::now().timestamp_millis();
            let before = |keep: u64| now.saturating_sub(i64::try_from(keep).unwrap_or(i64::MAX));
            loop {
                let job = WriteJob::PruneWebhooksAndRuns {
                    deliveries_before: before(deliveries),
                    runs_before: before(runs),
                    limit: ROWS_PER_WRITE,
                };
                match persistence.write(job).await {
                    Ok(WriteOutcome::Count(removed)) if removed >= ROWS_PER_WRITE => {}
                    Ok(_) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "old deliveries and runs could not be removed; trying again later");
                        break;
                    }
                }
            }
        }
    });
}
