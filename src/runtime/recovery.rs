//! Restart recovery (REQ-BED-007): every conversation that was busy when the process died
//! becomes idle, with a synthetic result for every tool call that never finished, so the
//! next LLM request of every conversation is valid; pending client requests expire and
//! running background tasks are marked failed.

use chrono::Utc;

use super::Services;
use super::commit;
use super::conversation::context;
use crate::persistence::{WriteJob, WriteOutcome};
use crate::state_machine::{Event, Interruption, MessageContent, transition};
use crate::store::StoreError;

/// What recovery did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    pub conversations: u64,
    pub synthetic_results: u64,
    pub expired_requests: u64,
    pub failed_tasks: u64,
}

pub async fn recover(services: &Services) -> Result<RecoveryReport, StoreError> {
    let now = Utc::now();
    let mut report = RecoveryReport::default();
    for record in services.store.busy_conversations().await? {
        let ctx = context(services, &record);
        let Ok(result) = transition(
            &record.state,
            &ctx,
            Event::Interrupted(Interruption::Restart),
        ) else {
            continue;
        };
        let plan = commit::plan(&record, result, ctx.context_window, now, None);
        if let Some(commit) = plan.commit {
            report.synthetic_results += commit
                .messages
                .iter()
                .filter(|m| matches!(m.content, MessageContent::Tool(_)))
                .count() as u64;
            services.persistence.commit(commit).await?;
            report.conversations += 1;
        }
    }
    if let WriteOutcome::Expired(requests, tasks) = services
        .persistence
        .write(WriteJob::ExpirePendingWork { at: now })
        .await?
    {
        report.expired_requests = requests;
        report.failed_tasks = tasks;
    }
    Ok(report)
}
