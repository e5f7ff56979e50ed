//! What a conversation actor does with a transition's effects once it is stored: one small
//! function per family (the LLM, tools, sub-agents, the turn's own control). Nothing here
//! waits for the work itself; at most for a child actor to be spawned. The work answers
//! later as messages tagged with it.

use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorRef};

use super::Handles;
use super::conversation_state::{Child, ConversationState, starting_blocked};
use super::messages::{ConvMsg, SupervisorMsg};
use super::subagents::{SubAgentSupervisor, SupervisorArgs};
use super::tool_run::{Run, ToolRun, ToolRunArgs};
use crate::llm::LlmJob;
use crate::state_machine::{
    Effect, Event, LlmRequestTag, SubAgentOutcome, SubAgentTask, ToolOutcome, ToolPlan, ToolUse,
    TurnId,
};

/// Carries out one effect after the commit. Work that starts something (an LLM request, a
/// tool, sub-agents, the next step) does not start while the conversation is stopping or
/// the node shutting down.
pub(super) async fn dispatch(
    myself: &ActorRef<ConvMsg>,
    state: &mut ConversationState,
    effect: Effect,
) {
    let blocked = starting_blocked(state);
    match effect {
        Effect::Continue { turn } if !blocked => {
            let _ = myself.cast(ConvMsg::event(Event::Continue { turn }));
        }
        Effect::RequestLlm {
            request,
            model,
            only_submit,
            summary,
        } if !blocked => request_llm(myself, state, request, model, only_submit, summary),
        Effect::ScheduleRetry { request, delay_ms } => {
            schedule_retry(myself, state, request, delay_ms)
        }
        Effect::CancelTool { tool_use_id, .. } => {
            state.cancel.stop_work();
            // A client tool's call is resolved as cancelled (an actor that merely stops
            // leaves it pending for the restart).
            if !state.record.client_tools.is_empty() {
                tokio::spawn(super::client_tools::cancel_call(
                    state.handles.clone(),
                    myself.clone(),
                    state.record.id.clone(),
                    tool_use_id,
                ));
            }
        }
        Effect::AbortLlm { .. } | Effect::StopSubAgents { .. } => {
            state.cancel.stop_work();
        }
        Effect::ExecuteTool { turn, tool, plan } if !blocked => {
            execute_tool(myself, state, turn, tool, plan).await;
        }
        Effect::SpawnSubAgents {
            turn,
            tool_use_id,
            tasks,
        } if !blocked => spawn_sub_agents(myself, state, turn, tool_use_id, tasks).await,
        Effect::ReportToParent { outcome } => report_to_parent(state, outcome),
        Effect::GraceTurnStarted => grace_started(state),
        // Blocked starts; and the durable effects, which were the commit itself.
        Effect::Continue { .. }
        | Effect::RequestLlm { .. }
        | Effect::ExecuteTool { .. }
        | Effect::SpawnSubAgents { .. }
        | Effect::PersistMessage(_)
        | Effect::RecordUsage { .. }
        | Effect::NotifyRetrying { .. }
        | Effect::WarnContext { .. } => {}
    }
}

fn reply_to(myself: &ActorRef<ConvMsg>) -> crate::llm::ReplyTo {
    let me = myself.clone();
    Arc::new(move |event| {
        let _ = me.cast(ConvMsg::event(event));
    })
}

/// Where a request's deltas go: to the conversation's clients, live.
fn deltas_to(handles: &Arc<Handles>, conversation_id: &str) -> crate::llm::Deltas {
    let (handles, conversation_id) = (Arc::clone(handles), conversation_id.to_owned());
    Arc::new(move |notice| handles.hub.publish(&conversation_id, handles.live(notice)))
}

/// Sends the history to the gateway; the answer comes back tagged with `request`.
fn request_llm(
    myself: &ActorRef<ConvMsg>,
    state: &mut ConversationState,
    request: LlmRequestTag,
    model: String,
    only_submit: bool,
    summary: bool,
) {
    let handles = state.handles.clone();
    let cancel = state.cancel.new_work();
    handles.gateway.request(LlmJob {
        request,
        tenant_id: state.record.tenant_id.clone(),
        conversation_id: state.record.id.clone(),
        cwd: state.record.cwd.clone(),
        model,
        system_prompt: state.record.system_prompt.clone(),
        is_sub_agent: state.ctx.is_sub_agent,
        only_submit,
        summary,
        reply: reply_to(myself),
        deltas: deltas_to(&handles, &state.record.id),
        records: Arc::clone(&handles.records),
        cancel,
        span: state
            .turn
            .as_ref()
            .map_or_else(tracing::Span::none, |turn| turn.span.clone()),
        recent: std::mem::take(&mut state.unsent),
        through: state.record.next_sequence_id - 1,
        history: Arc::clone(&state.history),
        mcp_tools: state.record.mcp_tools.clone(),
        tools: state.record.tools.clone(),
        client_tools: state.record.client_tools.clone(),
        budget: state.record.budget_tokens.map(|limit| {
            let usage = &state.record.usage;
            (limit, usage.input_tokens + usage.output_tokens)
        }),
    });
}

/// Delivers `RetryTimeout` after the delay, or `LlmAborted` at once on a cancel.
fn schedule_retry(
    myself: &ActorRef<ConvMsg>,
    state: &mut ConversationState,
    request: LlmRequestTag,
    delay_ms: u64,
) {
    let cancel = state.cancel.new_work();
    let me = myself.clone();
    tokio::spawn(async move {
        let event = tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(delay_ms)) => Event::RetryTimeout { request },
            () = cancel.cancelled() => Event::LlmAborted { request },
        };
        let _ = me.cast(ConvMsg::event(event));
    });
}

/// Starts a tool run actor that carries out the core's plan; it answers `ToolComplete`, and
/// a run that cannot start is a failed result at once.
async fn execute_tool(
    myself: &ActorRef<ConvMsg>,
    state: &mut ConversationState,
    turn: TurnId,
    tool: ToolUse,
    plan: ToolPlan,
) {
    let handles = state.handles.clone();
    let cancel = state.cancel.new_work();
    let tool_use_id = tool.id.clone();
    let args = ToolRunArgs {
        turn: turn.clone(),
        span: tracing::info_span!(
            target: crate::telemetry::STEP,
            parent: state.turn.as_ref().and_then(|turn| turn.span.id()),
            "tool.run",
            tenant = %state.record.tenant_id,
            conversation = %state.record.id,
            tool = %tool.name,
            tool_use_id = %tool.id,
            ok = tracing::field::Empty,
            duration_ms = tracing::field::Empty,
        ),
        run: Run {
            tool,
            cwd: state.record.cwd.clone().into(),
            limits: handles.tool_limits_for(state.record.network),
            cancel: cancel.clone(),
            conversation: myself.clone(),
            handles: handles.clone(),
            conversation_id: state.record.id.clone(),
            plan,
            tenant_id: state.record.tenant_id.clone(),
            mcp_tools: state.record.mcp_tools.clone(),
            client_tools: state.record.client_tools.clone(),
            key: format!(
                "{turn}:{}:{}",
                state.record.state.turn().map_or(0, |turn| turn.llm_steps),
                tool_use_id
            ),
            hook: state.record.pre_tool_use.as_ref().map(|hook| {
                Arc::new(super::hooks::HookRun {
                    hook: Arc::clone(hook),
                    ctx: state.ctx.clone(),
                    agent: state.record.agent.clone(),
                })
            }),
        },
    };
    match Actor::spawn_linked(None, ToolRun, args, myself.get_cell()).await {
        Ok((child, _)) => {
            state
                .children
                .insert(child.get_id(), Child::Tool { turn, tool_use_id });
        }
        Err(error) => {
            cancel.cancel();
            let _ = myself.cast(ConvMsg::event(Event::ToolComplete {
                turn,
                tool_use_id,
                outcome: ToolOutcome::failed(format!("the tool run could not start: {error}")),
            }));
        }
    }
}

/// Starts the sub-agent supervisor of one spawn_sub_agents call.
async fn spawn_sub_agents(
    myself: &ActorRef<ConvMsg>,
    state: &mut ConversationState,
    turn: TurnId,
    tool_use_id: String,
    tasks: Vec<SubAgentTask>,
) {
    let handles = state.handles.clone();
    let cancel = state.cancel.new_work();
    let args = SupervisorArgs {
        handles: handles.clone(),
        parent: myself.clone(),
        parent_record: state.record.clone(),
        turn: turn.clone(),
        tool_use_id: tool_use_id.clone(),
        tasks,
        cancel: cancel.clone(),
    };
    match Actor::spawn_linked(None, SubAgentSupervisor, args, myself.get_cell()).await {
        Ok((child, _)) => {
            state
                .children
                .insert(child.get_id(), Child::Spawn { turn, tool_use_id });
        }
        Err(error) => {
            cancel.cancel();
            let _ = myself.cast(ConvMsg::event(Event::ToolComplete {
                turn,
                tool_use_id,
                outcome: ToolOutcome::failed(format!("the sub-agents could not start: {error}")),
            }));
        }
    }
}

/// A sub-agent's grace turn began: its supervisor bounds it.
fn grace_started(state: &ConversationState) {
    if let Some(parent) = &state.parent {
        let _ = parent.supervisor.cast(SupervisorMsg::GraceStarted {
            agent_id: parent.agent_id.clone(),
        });
    }
}

/// A sub-agent hands its outcome to its parent.
fn report_to_parent(state: &ConversationState, outcome: SubAgentOutcome) {
    if let Some(parent) = &state.parent {
        let _ = parent.supervisor.cast(SupervisorMsg::Report {
            agent_id: parent.agent_id.clone(),
            outcome,
        });
    }
}
