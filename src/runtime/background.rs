//! Background (long-running) tools (system-bus-plan.md): `bash` with `background: true`.
//!
//! The tool call returns at once with a task id; the output goes to clients as tool_progress
//! frames; the final result is stored on the task, sent as a durable tool_result system
//! event, and handed to the conversation as a `BackgroundResult` (a system message now if it
//! is idle, or before its next LLM request). Tasks end by themselves, by an explicit cancel,
//! or with their conversation's deletion; a restart marks them failed.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::Handles;
use super::requests::emit;
use crate::model::{BackgroundTask, TaskStatus};
use crate::notice::{Keyed, Notice, SystemEvent};
use crate::persistence::WriteJob;
use crate::state_machine::{BackgroundResult, Event, TurnId};
use crate::tools::{BashOutcome, OnLine, ToolLimits, run_bash};

/// What starts a background task.
#[derive(Clone, Debug)]
pub struct TaskSpec {
    pub conversation_id: String,
    pub tenant_id: String,
    pub tool_use_id: String,
    pub command: String,
    pub cwd: PathBuf,
    pub timeout: Duration,
    pub wake: bool,
    /// The conversation's limits and confinement.
    pub limits: ToolLimits,
}

#[derive(Debug, Default)]
pub struct BackgroundTasks {
    running: Mutex<HashMap<String, (String, CancellationToken)>>,
}

impl BackgroundTasks {
    fn running(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, CancellationToken)>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a task; returns its id once its row is stored.
    pub(crate) async fn start(
        &self,
        handles: &Arc<Handles>,
        spec: TaskSpec,
    ) -> Result<String, String> {
        // Counted against the tenant's quota from now until the task ends.
        let held = handles
            .quotas
            .background_task(&spec.tenant_id)
            .await
            .map_err(|e| format!("no background task was started: the {e}"))?;
        let id = uuid::Uuid::now_v7().to_string();
        let task = BackgroundTask {
            id: id.clone(),
            conversation_id: spec.conversation_id.clone(),
            tool_use_id: spec.tool_use_id.clone(),
            tool_name: "bash".into(),
            command: spec.command.clone(),
            status: TaskStatus::Running,
            output: None,
            exit_code: None,
            wake: spec.wake,
            created_at: Utc::now(),
            finished_at: None,
        };
        handles
            .persistence
            .write(WriteJob::CreateBackgroundTask(task))
            .await
            .map_err(|e| format!("the task could not be stored: {e}"))?;
        let cancel = CancellationToken::new();
        self.running()
            .insert(id.clone(), (spec.conversation_id.clone(), cancel.clone()));
        tokio::spawn(run(handles.clone(), id.clone(), spec, cancel, held));
        Ok(id)
    }

    /// Kills a running task of the conversation; false if it is not running.
    pub fn cancel(&self, conversation_id: &str, task_id: &str) -> bool {
        match self.running().get(task_id) {
            Some((owner, cancel)) if owner == conversation_id => {
                cancel.cancel();
                true
            }
            Some(_) | None => false,
        }
    }

    /// Kills every running task of the conversation (it is being deleted).
    pub fn cancel_all(&self, conversation_id: &str) {
        for (owner, cancel) in self.running().values() {
            if owner == conversation_id {
                cancel.cancel();
            }
        }
    }

    /// Kills every running task (the server is shutting down; a restart marks them failed).
    pub fn cancel_everything(&self) {
        for (_, cancel) in self.running().values() {
            cancel.cancel();
        }
    }

    /// How many tasks run for the conversation.
    pub fn count(&self, conversation_id: &str) -> usize {
        self.running()
            .values()
            .filter(|(owner, _)| owner == conversation_id)
            .count()
    }
}

async fn run(
    handles: Arc<Handles>,
    id: String,
    spec: TaskSpec,
    cancel: CancellationToken,
    _held: crate::quotas::Held,
) {
    let progress: OnLine = {
        let (live, conversation, task, tool_use_id) = (
            handles.clone(),
            spec.conversation_id.clone(),
            id.clone(),
            spec.tool_use_id.clone(),
        );
        Arc::new(move |line: &str| {
            let notice = Notice::ToolProgress {
                tool_use_id: &tool_use_id,
                tool_name: "bash",
                task_id: Some(&task),
                stage: "running",
                progress: None,
                message: line,
            };
            live.hub.publish(&conversation, live.live(notice));
        })
    };
    // A process slot of the tenant's (waiting at most the task's own time limit), then
    // the directory, opened as the task starts: one replaced by a link is refused.
    let admitted =
        super::admission::admit(&handles.quotas, &spec.tenant_id, spec.timeout, &cancel).await;
    let outcome = match (admitted, spec.limits.workspaces.pin(&spec.cwd)) {
        (Err(refused), _) => BashOutcome::failed(refused.output),
        (Ok(_slot), Ok(cwd)) => {
            run_bash(
                &spec.command,
                &cwd,
                &spec.limits.bash(spec.timeout),
                cancel,
                Some(progress),
            )
            .await
        }
        (Ok(_), Err(e)) => BashOutcome::failed(e.to_string()),
    };
    handles.background.running().remove(&id);
    // Killed by a shutdown is an interruption, not a cancel anyone asked for.
    let interrupted = outcome.cancelled && handles.lifecycle.is_shutting_down();
    let status = if interrupted {
        TaskStatus::Failed
    } else if outcome.cancelled {
        TaskStatus::Cancelled
    } else if outcome.ok() {
        TaskStatus::Completed
    } else {
        TaskStatus::Failed
    };
    let exit_code = outcome.exit_code;
    let mut result = outcome.into_outcome();
    if interrupted {
        result.output.push_str("\n[interrupted by server shutdown]");
    }
    let finished = handles
        .persistence
        .write(WriteJob::FinishBackgroundTask {
            id: id.clone(),
            status,
            output: result.output.clone(),
            exit_code,
            at: Utc::now(),
        })
        .await;
    if finished.is_err() {
        tracing::warn!(task = %id, "the background task's end could not be stored");
    }
    // A deleted conversation takes no more results.
    let Ok(live) = handles
        .registry
        .get_or_start(&handles, &spec.conversation_id)
        .await
    else {
        return;
    };
    let event = SystemEvent::new(
        "tool_result",
        json!({
            "task_id": id,
            "tool_name": "bash",
            "tool_use_id": spec.tool_use_id,
            "status": status.as_str(),
            "result": {"ok": result.ok, "output": result.output},
            "error": if result.ok { serde_json::Value::Null } else { json!(result.output) },
        }),
    );
    let _ = emit(&live.actor, vec![Keyed::system_event(event, None)]).await;
    let wake = spec
        .wake
        .then(|| TurnId::new(uuid::Uuid::now_v7().to_string()));
    let _ = live
        .actor
        .cast(super::messages::ConvMsg::event(Event::BackgroundResult {
            result: BackgroundResult {
                task_id: id,
                tool_name: "bash".into(),
                ok: result.ok,
                output: result.output,
            },
            wake,
        }));
}
