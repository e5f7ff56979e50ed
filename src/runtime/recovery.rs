//! Restart recovery (REQ-BED-007): every conversation that was busy when the process died
//! becomes idle, with a synthetic result for every tool call that never finished, so the
//! next LLM request of every conversation is valid; pending client requests expire and
//! running background tasks are marked failed. A conversation whose client tool's call was
//! pending stays on it (the client may answer after the restart): it is started again so
//! that the call's timeout holds.

use std::sync::Arc;

use chrono::Utc;

use super::Handles;
use super::commit;
use super::context::context;
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

/// Start-up recovery of a single node (SQLite, or Postgres without a cluster). A cluster node
/// repairs each conversation as it takes its lease instead (see `registry::claim`), and
/// touches no conversation another live node holds.
pub(crate) async fn recover(handles: &Arc<Handles>) -> Result<RecoveryReport, StoreError> {
    let now = Utc::now();
    let mut report = RecoveryReport::default();
    if handles.cluster.is_some() {
        return Ok(report);
    }
    // The only node is starting: no LLM request is in flight, so no budget is held.
    handles.store.clear_reservations().await?;
    let mut waiting = Vec::new();
    for mut record in handles.store.busy_conversations().await? {
        if let Some(synthetic) = repair(handles, &mut record).await? {
            report.synthetic_results += synthetic;
            report.conversations += 1;
        }
        if record.state.is_busy() {
            waiting.push(record.id);
        }
    }
    if let WriteOutcome::Expired(requests, tasks) = handles
        .persistence
        .write(WriteJob::ExpirePendingWork {
            at: now,
            conversation: None,
        })
        .await?
    {
        report.expired_requests = requests;
        report.failed_tasks = tasks;
    }
    // Started once the requests of the process that died are expired: a call taken up
    // again may ask anew (its approval, its hook's `ask`).
    if !waiting.is_empty() {
        let handles = Arc::clone(handles);
        tokio::spawn(async move {
            for id in waiting {
                if let Err(error) = handles.registry.get_or_start(&handles, &id).await {
                    tracing::warn!(conversation = %id, %error, "a conversation waiting for its client tool did not start again");
                }
            }
        });
    }
    Ok(report)
}

/// Closes a turn that was in flight when its process died (or its node lost the lease): a
/// synthetic result for every tool call that never finished, the conversation idle. Returns
/// the number of synthetic results, `None` when the conversation was at rest.
pub(super) async fn repair(
    handles: &Handles,
    record: &mut crate::model::ConversationRecord,
) -> Result<Option<u64>, StoreError> {
    let ctx = context(&handles.settings, record);
    let event = Event::Interrupted(Interruption::Restart);
    let Ok(result) = transition(&record.state, &ctx, event.clone()) else {
        return Ok(None);
    };
    // A segment of the replay log of its own: the state it found, and the whole context.
    let mut recorder = crate::replay::Recorder::new(handles.store.next_step(&record.id).await?);
    let step = recorder.record(&record.state, &ctx, event, &result);
    let at = Utc::now();
    let mut plan = commit::plan(
        &*handles.format,
        &*record,
        result,
        ctx.context_window,
        at,
        None,
    );
    let steps = step
        .map(|step| step.finish(commit::messages_of(&plan)))
        .into_iter()
        .collect();
    commit::log_steps(&mut plan, record, steps, at);
    let told = commit::tell_webhooks(&handles.webhooks, record, &mut plan, at);
    let Some(commit) = plan.commit else {
        return Ok(None);
    };
    let synthetic = commit
        .messages
        .iter()
        .filter(|m| matches!(m.content, MessageContent::Tool(_)))
        .count() as u64;
    if let Err(e) = handles.persistence.commit(commit.clone()).await {
        if told {
            handles.webhooks.not_stored(&commit.deliveries);
        }
        return Err(e);
    }
    if told {
        handles.webhooks.stored(&commit.deliveries);
    }
    commit::apply(record, &commit);
    // Clients may be watching already (a conversation taken over from a dead node).
    for frame in &plan.frames {
        handles.hub.publish(&record.id, frame.clone());
    }
    Ok(Some(synthetic))
}
