//! Tools the conversation's client runs (docs/api.md, "Client tools"; issue 38).
//!
//! The core plans a call of one like any tool call; its run asks the client (a durable
//! `client_tool_call` frame and a row in `client_tool_calls`) and waits for the answer, which
//! is the call's result. The row is the truth: it is resolved once, by a conditional update
//! from `pending`, by the answer, its timeout or a cancel. A restart resolves nothing: the
//! core takes the call up again (`Interrupted` keeps it running) and its new run finds the
//! row, answered meanwhile or still pending.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::Handles;
use super::requests::{Waiter, emit, expiry};
use crate::model::{ClientToolCall, RequestStatus};
use crate::notice::{Durable, Keyed};
use crate::persistence::{WriteJob, WriteOutcome};
use crate::state_machine::{ConvState, ToolOutcome};
use crate::tools::failed;

/// Why an answer to a client tool call was refused.
#[derive(Debug, thiserror::Error)]
pub enum ToolResultError {
    #[error("no such client tool call")]
    NotFound,
    /// The first answer's time.
    #[error("the client tool call was already answered at {}", .0.to_rfc3339())]
    AlreadyAnswered(DateTime<Utc>),
    #[error("the client tool call expired (or was cancelled) before this answer")]
    Expired,
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
}

/// What a client tool's call needs of its tool run.
pub(super) struct Asking<'a> {
    pub handles: &'a Arc<Handles>,
    pub tenant_id: &'a str,
    /// The conversation: its frames are stored through it.
    pub conversation: &'a ractor::ActorRef<super::messages::ConvMsg>,
    pub conversation_id: &'a str,
    pub tool: &'a crate::state_machine::ToolUse,
    /// The call's key: its turn, LLM step and tool_use id.
    pub key: String,
    /// The conversation's client tools (for the call's timeout).
    pub tools: &'a [crate::model::ClientTool],
    pub cancel: &'a tokio_util::sync::CancellationToken,
}

/// The call stored for this tool call: the client was asked already (before a restart),
/// and its approval and hook, if it needed them, were given then.
pub(super) async fn stored(run: &Asking<'_>) -> crate::store::Result<Option<ClientToolCall>> {
    run.handles
        .store
        .client_tool_call_for(run.conversation_id, &run.key)
        .await
}

/// Runs a call of a client tool: asks the client (once: a run after a restart finds the call
/// it made, `stored`) and waits for the answer, its timeout or a cancel.
pub(super) async fn run(
    run: &Asking<'_>,
    stored: crate::store::Result<Option<ClientToolCall>>,
) -> ToolOutcome {
    let handles = &run.handles;
    let stored = match stored {
        Ok(stored) => stored,
        Err(e) => return failed(format!("the client tool call could not be read: {e}")),
    };
    let (call, rx, _waiter) = match stored {
        Some(call) => {
            let (rx, waiter) = handles.requests.wait_for(&call.id);
            // An answer may have come between the read and the wait.
            let call = match handles
                .store
                .client_tool_call(run.conversation_id, &call.id)
                .await
            {
                Ok(Some(now)) => now,
                Ok(None) | Err(_) => call,
            };
            // Taken up again (after a restart): its frame again, in case it never went
            // out; clients know a call by its call_id.
            if call.status == RequestStatus::Pending {
                let _ = emit(run.conversation, vec![frame_of(&call)]).await;
            }
            (call, rx, waiter)
        }
        None => match ask(run).await {
            Ok(asked) => asked,
            Err(refused) => return refused,
        },
    };
    if call.status != RequestStatus::Pending {
        return settled(&call);
    }
    let wait = (call.expires_at - Utc::now())
        .to_std()
        .unwrap_or(Duration::ZERO);
    tokio::select! {
        answer = rx => match answer {
            Ok(payload) => outcome(&payload),
            Err(_) => failed("the client tool call was dropped"),
        },
        () = tokio::time::sleep(wait) => {
            // An answer may have won the race: only the first resolution counts.
            if resolve(handles, &call.id, RequestStatus::Expired, None).await {
                let _ = emit(run.conversation, vec![resolved(&call.id, RequestStatus::Expired)]).await;
                expired(&call)
            } else {
                match handles.store.client_tool_call(run.conversation_id, &call.id).await {
                    Ok(Some(now)) => settled(&now),
                    Ok(None) | Err(_) => expired(&call),
                }
            }
        }
        // The call is not resolved here: a cancel resolves it (`cancel_call`), and a
        // conversation that stops (a restart, a shutdown) leaves it pending.
        () = run.cancel.cancelled() => failed("the client tool call was cancelled"),
    }
}

fn frame_of(call: &ClientToolCall) -> Keyed {
    Keyed::from(Durable::ClientToolCall {
        call_id: call.id.clone(),
        tool_use_id: call.tool_use_id.clone(),
        name: call.name.clone(),
        input: call.input.clone(),
        expires_at: call.expires_at.to_rfc3339(),
    })
}

/// Makes the call and its frame.
async fn ask<'a>(
    run: &Asking<'a>,
) -> Result<(ClientToolCall, oneshot::Receiver<Value>, Waiter<'a>), ToolOutcome> {
    let handles = &run.handles;
    let settings = &handles.settings.requests;
    let timeout = run
        .tools
        .iter()
        .find(|tool| tool.name == run.tool.name)
        .and_then(|tool| tool.timeout_ms)
        .map_or(
            Duration::from_millis(settings.client_tool_timeout_ms),
            Duration::from_millis,
        )
        .min(settings.max_timeout());
    let now = Utc::now();
    let (timeout_ms, expires_at) = expiry(now, timeout);
    let call = ClientToolCall {
        id: uuid::Uuid::now_v7().to_string(),
        conversation_id: run.conversation_id.to_owned(),
        tool_use_id: run.tool.id.clone(),
        key: run.key.clone(),
        name: run.tool.name.clone(),
        input: run.tool.input.clone(),
        status: RequestStatus::Pending,
        output: None,
        is_error: false,
        timeout_ms,
        expires_at,
        created_at: now,
        resolved_at: None,
    };
    if run.cancel.is_cancelled() {
        return Err(failed("the client tool call was cancelled"));
    }
    // The tenant's webhooks are told in the call's own transaction.
    let deliveries = if handles.webhooks.has(run.tenant_id) {
        handles
            .webhooks
            .deliveries(vec![crate::webhooks::request_created(
                run.tenant_id,
                run.conversation_id,
                &call.id,
                "client_tool",
                &call.tool_use_id,
                now,
            )])
    } else {
        Vec::new()
    };
    let (rx, waiter) = handles.requests.wait_for(&call.id);
    if let Err(e) = handles
        .persistence
        .write(WriteJob::CreateClientToolCall(
            Box::new(call.clone()),
            deliveries.clone(),
        ))
        .await
    {
        handles.webhooks.not_stored(&deliveries);
        return Err(failed(format!(
            "the client tool call could not be stored: {e}"
        )));
    }
    handles.webhooks.stored(&deliveries);
    // A cancel that came while the call was stored found no call to cancel: it is
    // cancelled here (a conversation that stops for a shutdown leaves it for the restart).
    if run.cancel.is_cancelled() && !handles.lifecycle.is_shutting_down() {
        resolve(handles, &call.id, RequestStatus::Cancelled, None).await;
        return Err(failed("the client tool call was cancelled"));
    }
    // A frame that cannot go out (the conversation is stopping) goes out when the call
    // is taken up again; the call stays pending.
    if let Err(e) = emit(run.conversation, vec![frame_of(&call)]).await {
        return Err(failed(format!("the client could not be asked: {e}")));
    }
    Ok((call, rx, waiter))
}

/// The result of a call resolved before its run waited (answered before a restart ended, or
/// expired, or cancelled).
fn settled(call: &ClientToolCall) -> ToolOutcome {
    match call.status {
        RequestStatus::Answered => outcome(&json!({
            "output": call.output.as_deref().unwrap_or_default(),
            "is_error": call.is_error,
        })),
        RequestStatus::Expired => expired(call),
        RequestStatus::Pending | RequestStatus::Cancelled => {
            failed("the client tool call was cancelled")
        }
    }
}

fn expired(call: &ClientToolCall) -> ToolOutcome {
    failed(format!(
        "the client did not answer the call of {} within {} s",
        call.name,
        call.timeout_ms / 1000
    ))
}

/// The client's answer as the call's result (cut to the tools' output cap when it was
/// taken, see [`answer`]).
fn outcome(payload: &Value) -> ToolOutcome {
    ToolOutcome {
        ok: payload["is_error"] != Value::Bool(true),
        output: payload["output"].as_str().unwrap_or_default().to_owned(),
    }
}

fn resolved(call_id: &str, status: RequestStatus) -> Keyed {
    Keyed::from(Durable::ClientToolResolved {
        call_id: call_id.to_owned(),
        status,
    })
}

async fn resolve(
    handles: &Handles,
    id: &str,
    status: RequestStatus,
    answer: Option<(String, bool)>,
) -> bool {
    matches!(
        handles
            .persistence
            .write(WriteJob::ResolveClientToolCall {
                id: id.to_owned(),
                status,
                answer,
                at: Utc::now(),
            })
            .await,
        Ok(WriteOutcome::Resolved(true))
    )
}

/// A cancel (or an interrupting message) stopped the call of `tool_use_id`: the call is
/// resolved as cancelled, and the clients told, unless it was answered first.
pub(super) async fn cancel_call(
    handles: Arc<Handles>,
    conversation: ractor::ActorRef<super::messages::ConvMsg>,
    conversation_id: String,
    tool_use_id: String,
) {
    // Tools run one at a time: the pending call of this tool_use id is the one stopped.
    let Ok(pending) = handles
        .store
        .client_tool_calls(&conversation_id, true)
        .await
    else {
        return;
    };
    for call in pending
        .iter()
        .filter(|call| call.tool_use_id == tool_use_id)
    {
        if resolve(&handles, &call.id, RequestStatus::Cancelled, None).await {
            let _ = emit(
                &conversation,
                vec![resolved(&call.id, RequestStatus::Cancelled)],
            )
            .await;
        }
    }
}

/// Answers a pending client tool call once, with its output and whether it is an error; a
/// second answer, or one after its timeout, is refused. A conversation that does not run
/// (the process restarted) is started: its call's new run finds the answer.
pub(crate) async fn answer(
    handles: &Arc<Handles>,
    conversation_id: &str,
    call_id: &str,
    output: String,
    is_error: bool,
) -> Result<(), ToolResultError> {
    let row = handles
        .store
        .client_tool_call(conversation_id, call_id)
        .await?
        .ok_or(ToolResultError::NotFound)?;
    let refused = |row: &ClientToolCall| match row.status {
        RequestStatus::Answered => {
            ToolResultError::AlreadyAnswered(row.resolved_at.unwrap_or(row.created_at))
        }
        RequestStatus::Pending | RequestStatus::Expired | RequestStatus::Cancelled => {
            ToolResultError::Expired
        }
    };
    if row.status != RequestStatus::Pending {
        return Err(refused(&row));
    }
    let live = match handles.registry.get(conversation_id) {
        Some(live) => Some(live),
        None => handles
            .registry
            .get_or_start(handles, conversation_id)
            .await
            .ok(),
    };
    // Only the call that runs now takes an answer: one its turn no longer waits for (a
    // cancel ended it, and is resolving it) is over.
    let current = match &live {
        Some(live) => live.record().await.map(|record| record.state),
        None => None,
    };
    let waiting = matches!(
        &current,
        Some(ConvState::ToolExecuting { current, .. }) if current.id == row.tool_use_id
    );
    let over = if row.expires_at <= Utc::now() {
        Some(RequestStatus::Expired)
    } else if current.is_some() && !waiting {
        Some(RequestStatus::Cancelled)
    } else {
        None
    };
    if let Some(status) = over {
        if resolve(handles, call_id, status, None).await
            && let Some(live) = &live
        {
            let _ = emit(&live.actor, vec![resolved(call_id, status)]).await;
        }
        return Err(ToolResultError::Expired);
    }
    // Stored as the LLM gets it: cut to the tools' output cap.
    let output = crate::tools::cap_output(output, handles.settings.tools.output_cap_bytes);
    let payload = json!({"output": output, "is_error": is_error});
    if !resolve(
        handles,
        call_id,
        RequestStatus::Answered,
        Some((output, is_error)),
    )
    .await
    {
        // Someone else resolved it first.
        return match handles
            .store
            .client_tool_call(conversation_id, call_id)
            .await?
        {
            Some(row) => Err(refused(&row)),
            None => Err(ToolResultError::NotFound),
        };
    }
    handles.requests.deliver(call_id, payload);
    if let Some(live) = live {
        let _ = emit(
            &live.actor,
            vec![resolved(call_id, RequestStatus::Answered)],
        )
        .await;
    }
    Ok(())
}
