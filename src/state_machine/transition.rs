//! The pure transition function: `(state, context, event) -> (new state, effects)`.
//!
//! No I/O, no clock, no fresh ids: the same inputs always give the same outputs (REQ-BED-001).

use serde_json::{Value, json};

use super::context::{ConvContext, TurnLimits};
use super::effect::{Effect, SubAgentTask};
use super::event::{
    Event, IfBusy, Interruption, LlmFailure, LlmReply, LlmRequestTag, ToolOutcome, Usage,
};
use super::message::{ImageRef, MessageContent};
use super::plan::plan_decided;
use super::state::{
    BackgroundResult, ConvState, ErrorKind, MAX_LLM_ATTEMPTS, Queued, SubAgentLimit,
    SubAgentOutcome, SubAgentSlot, ToolUse, Turn, TurnId,
};

pub use super::names::{SPAWN_SUB_AGENTS, SUBMIT_RESULT};

/// Output of the synthetic result for the tool that was running when the user cancelled.
pub const CANCELLED_BY_USER: &str = "cancelled by user";
/// Output of the synthetic results for queued tools that a cancel skipped.
pub const SKIPPED_BY_CANCEL: &str = "skipped due to cancellation";
/// The system message that reminds a sub-agent to call submit_result.
pub const SUBMIT_REMINDER: &str = "[[SYSTEM: you are a sub-agent: your task ends only when you call the submit_result tool with your result. Call it now.]]";

/// Output of the synthetic results for tool calls a sub-agent made in its grace turn, where
/// only submit_result runs.
pub const GRACE_SKIPPED: &str =
    "not run: in its grace turn a sub-agent may only call submit_result";

/// The first backoff delay; each retry doubles it, up to [`RETRY_DELAY_CAP_MS`].
pub const RETRY_BASE_DELAY_MS: u64 = 1_000;
/// The longest backoff delay computed from the attempt alone.
pub const RETRY_DELAY_CAP_MS: u64 = 8_000;
/// The longest a backend's Retry-After is honoured.
pub const RETRY_AFTER_CAP_MS: u64 = 30_000;

/// Context warning thresholds in permille of the window, highest first (REQ-BED-012).
const CONTEXT_WARNINGS_PERMILLE: [u64; 2] = [950, 800];

/// The next state and what to do about it.
#[derive(Clone, Debug, PartialEq)]
pub struct TransitionResult {
    pub new_state: ConvState,
    pub effects: Vec<Effect>,
    /// The turn this transition ended, and how (what a tenant's webhooks are told). Set by
    /// [`transition`] for every turn that ends: at rest, in an error, exhausted, cancelled,
    /// or replaced by another (an interrupting message, the next waiting one).
    pub ended: Option<TurnEnd>,
}

/// A turn that ended, and how.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TurnEnd {
    pub turn: TurnId,
    pub outcome: TurnOutcome,
}

/// How a turn ended.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnOutcome {
    /// It ran to its end: the conversation is at rest, or the next waiting message's turn
    /// took its place.
    Completed,
    /// It ended in the error state.
    Failed {
        error_kind: ErrorKind,
        message: String,
    },
    /// A cancel (or an interrupting message) stopped it.
    Cancelled,
    /// Its context filled up: the summary is stored and the conversation takes no more
    /// messages.
    ContextExhausted,
}

/// The turn `before` ran that `after` no longer runs, and how it ended. `stopped`: the event
/// was a cancel or an interrupting message.
fn turn_end(before: &ConvState, after: &ConvState, stopped: bool) -> Option<TurnEnd> {
    let ended = before.turn()?;
    if after.turn().is_some_and(|turn| turn.id == ended.id) {
        return None;
    }
    let outcome = if let ConvState::Error {
        message,
        error_kind,
    } = after
    {
        TurnOutcome::Failed {
            error_kind: *error_kind,
            message: message.clone(),
        }
    } else if matches!(after, ConvState::ContextExhausted { .. }) {
        TurnOutcome::ContextExhausted
    } else if stopped || matches!(before, ConvState::Cancelling { .. }) {
        TurnOutcome::Cancelled
    } else {
        TurnOutcome::Completed
    };
    Some(TurnEnd {
        turn: ended.id.clone(),
        outcome,
    })
}

/// Why a user message is refused; the API maps each to a 409.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error(
        "agent is busy: the current turn is still running; cancel it, or send with if_busy=interrupt"
    )]
    AgentBusy,
    #[error("cancellation in progress: wait for the conversation to become idle")]
    Cancelling,
    #[error("the sub-agent has completed and takes no more messages")]
    Completed,
    #[error(
        "the conversation's context is full and it has been summarised; continue it in a new conversation (POST /v1/conversations/{{id}}/continue)"
    )]
    ContextExhausted,
    /// As many messages wait as may (`turn.max_queued`).
    #[error("as many messages wait in this conversation as may (turn.max_queued)")]
    QueueFull,
}

/// An event that the state cannot take.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidTransition {
    /// A user message the conversation refuses (REQ-BED-002).
    #[error(transparent)]
    Rejected(#[from] Rejection),
    /// An event for work that is no longer current (cancelled, finished or never started):
    /// recognised and ignored, never applied.
    #[error("ignored {event} in state {state}: {reason}")]
    Ignored {
        state: &'static str,
        event: &'static str,
        reason: &'static str,
    },
}

/// The backoff before retrying after failed attempt `attempt` (1-based): 1 s, 2 s, 4 s, ...
/// capped at [`RETRY_DELAY_CAP_MS`].
pub fn retry_delay_ms(attempt: u32) -> u64 {
    let doublings = attempt.saturating_sub(1).min(16);
    (RETRY_BASE_DELAY_MS << doublings).min(RETRY_DELAY_CAP_MS)
}

/// Computes the conversation's next state and effects for `event` (REQ-BED-001).
pub fn transition(
    state: &ConvState,
    ctx: &ConvContext,
    event: Event,
) -> Result<TransitionResult, InvalidTransition> {
    let stopped = matches!(
        event,
        Event::UserCancel
            | Event::Interrupted(_)
            | Event::UserMessage {
                if_busy: IfBusy::Interrupt { .. },
                ..
            }
    );
    decide(state, ctx, event).map(|mut result| {
        result.ended = turn_end(state, &result.new_state, stopped);
        carry_waiting(state, result)
    })
}

/// When a turn ends (or another takes its place), what waited in it goes on: its steering
/// messages, then its queued ones, in arrival order. At rest, the first starts the next turn
/// and the others wait in it; an interrupting message's turn takes them all. A conversation
/// that is exhausted or completed takes none.
fn carry_waiting(before: &ConvState, mut result: TransitionResult) -> TransitionResult {
    let Some(ended) = before.turn().filter(|turn| turn.waiting() > 0) else {
        return result;
    };
    if result
        .new_state
        .turn()
        .is_some_and(|turn| turn.id == ended.id)
    {
        return result;
    }
    let mut waiting: Vec<Queued> = ended
        .steering
        .iter()
        .chain(&ended.queued)
        .cloned()
        .collect();
    if let Some(turn) = turn_mut(&mut result.new_state) {
        waiting.append(&mut turn.queued);
        turn.queued = waiting;
        return result;
    }
    match result.new_state {
        ConvState::Idle | ConvState::Error { .. } => {
            let next = waiting.remove(0);
            let mut turn = Turn::new(next.id);
            turn.queued = waiting;
            result
                .effects
                .push(Effect::PersistMessage(MessageContent::User {
                    text: next.text,
                    images: next.images,
                }));
            result.effects.push(Effect::Continue {
                turn: turn.id.clone(),
            });
            result.new_state = ConvState::AwaitingLlm { turn };
        }
        // It takes no more messages: what waited is not run, and the history says so.
        ConvState::ContextExhausted { .. } => {
            result.effects.push(Effect::PersistMessage(MessageContent::System {
                text: format!(
                    "[[SYSTEM: {} waiting message(s) were not run: the conversation's context is full; continue it in a new conversation]]",
                    waiting.len()
                ),
            }));
        }
        ConvState::AwaitingLlm { .. }
        | ConvState::LlmRequesting { .. }
        | ConvState::ToolExecuting { .. }
        | ConvState::Cancelling { .. }
        | ConvState::AwaitingSubAgents { .. }
        | ConvState::Completed => {}
    }
    result
}

fn decide(
    state: &ConvState,
    ctx: &ConvContext,
    event: Event,
) -> Result<TransitionResult, InvalidTransition> {
    let name = event.name();
    let ignored = |reason| InvalidTransition::Ignored {
        state: state.kind(),
        event: name,
        reason,
    };
    match event {
        Event::UserMessage {
            turn,
            text,
            images,
            if_busy,
        } => user_message(state, ctx, turn, text, images, if_busy),
        Event::UserCancel => Ok(cancel(state)),
        Event::SummaryRequested { turn } => summary_requested(state, turn),
        Event::Continue { turn } => continue_turn(state, ctx, &turn)
            .ok_or_else(|| ignored("no LLM step of that turn is due")),
        Event::LlmResponse { request, reply } => llm_response(state, ctx, &request, reply)
            .ok_or_else(|| ignored("no such LLM request is in flight")),
        Event::LlmError { request, error } => llm_error(state, ctx, &request, &error)
            .ok_or_else(|| ignored("no such LLM request is in flight")),
        Event::LlmAborted { request } => {
            finish_cancel(state, &request).ok_or_else(|| ignored("no cancellation of that request"))
        }
        Event::RetryTimeout { request } => retry_timeout(state, ctx, &request)
            .ok_or_else(|| ignored("no retry of that request is pending")),
        Event::ToolComplete {
            turn,
            tool_use_id,
            outcome,
        } => tool_complete(state, ctx, &turn, &tool_use_id, outcome)
            .ok_or_else(|| ignored("that tool is not running")),
        Event::SubAgentsSpawned {
            turn,
            tool_use_id,
            agent_ids,
        } => sub_agents_spawned(state, &turn, &tool_use_id, agent_ids)
            .ok_or_else(|| ignored("no spawn_sub_agents call of that turn is starting")),
        Event::SubAgentResult { agent_id, outcome } => {
            sub_agent_result(state, ctx, &agent_id, outcome)
                .ok_or_else(|| ignored("no such sub-agent is pending"))
        }
        Event::BackgroundResult { result, wake } => Ok(background_result(state, result, wake)),
        Event::Interrupted(why) => {
            interrupted(state, ctx, why).ok_or_else(|| ignored("nothing in flight"))
        }
        Event::TimeLimit { timeout_ms } => time_limit(state, ctx, timeout_ms)
            .ok_or_else(|| ignored("no sub-agent turn is running")),
        Event::Dequeue { id } => {
            dequeue(state, id.as_ref()).ok_or_else(|| ignored("no such message waits"))
        }
    }
}

/// The user takes back a waiting message (or all of them).
fn dequeue(state: &ConvState, id: Option<&TurnId>) -> Option<TransitionResult> {
    let mut new_state = state.clone();
    let turn = turn_mut(&mut new_state)?;
    let before = turn.waiting();
    let keep = |queued: &Queued| id.is_some_and(|id| &queued.id != id);
    turn.queued.retain(keep);
    turn.steering.retain(keep);
    (turn.waiting() < before).then(|| Effects::default().into_result(new_state))
}

/// A message to a busy conversation that waits (`enqueue`) or joins the turn (`steer`; while
/// the turn is being cancelled it waits instead). A sub-agent's one turn is its task: it
/// takes neither.
fn wait_in_turn(
    state: &ConvState,
    ctx: &ConvContext,
    id: TurnId,
    text: String,
    images: Vec<ImageRef>,
    steer: bool,
) -> Result<TransitionResult, InvalidTransition> {
    if ctx.is_sub_agent {
        return Err(Rejection::AgentBusy.into());
    }
    let mut new_state = state.clone();
    let cancelling = matches!(state, ConvState::Cancelling { .. });
    let Some(turn) = turn_mut(&mut new_state) else {
        return Err(Rejection::AgentBusy.into());
    };
    if turn.waiting() >= ctx.limits.max_queued as usize
        || turn.waiting_bytes().saturating_add(text.len() as u64) > ctx.limits.max_queued_bytes
    {
        return Err(Rejection::QueueFull.into());
    }
    let message = Queued { id, text, images };
    if steer && !cancelling {
        turn.steering.push(message);
    } else {
        turn.queued.push(message);
    }
    Ok(Effects::default().into_result(new_state))
}

/// Accumulates the effects of one transition.
#[derive(Default)]
struct Effects(Vec<Effect>);

impl Effects {
    fn push(&mut self, effect: Effect) {
        self.0.push(effect);
    }

    fn persist(&mut self, content: MessageContent) {
        self.0.push(Effect::PersistMessage(content));
    }

    /// Stores the background results a turn held back, in arrival order.
    fn flush_held(&mut self, held: Vec<BackgroundResult>) {
        for result in held {
            self.persist(MessageContent::System {
                text: result.system_text(),
            });
        }
    }

    fn into_result(self, new_state: ConvState) -> TransitionResult {
        TransitionResult {
            new_state,
            effects: self.0,
            ended: None,
        }
    }
}

fn user_message(
    state: &ConvState,
    ctx: &ConvContext,
    turn: TurnId,
    text: String,
    images: Vec<ImageRef>,
    if_busy: IfBusy,
) -> Result<TransitionResult, InvalidTransition> {
    let mut fx = Effects::default();
    match (state, if_busy) {
        (ConvState::Idle | ConvState::Error { .. }, _) => {}
        (ConvState::Completed, _) => return Err(Rejection::Completed.into()),
        (ConvState::ContextExhausted { .. }, _) => {
            return Err(Rejection::ContextExhausted.into());
        }
        (ConvState::Cancelling { .. }, IfBusy::Reject) => {
            return Err(Rejection::Cancelling.into());
        }
        (
            ConvState::AwaitingLlm { .. }
            | ConvState::LlmRequesting { .. }
            | ConvState::ToolExecuting { .. }
            | ConvState::AwaitingSubAgents { .. },
            IfBusy::Reject,
        ) => return Err(Rejection::AgentBusy.into()),
        (busy, IfBusy::Enqueue) => return wait_in_turn(busy, ctx, turn, text, images, false),
        (busy, IfBusy::Steer) => return wait_in_turn(busy, ctx, turn, text, images, true),
        (busy, IfBusy::Interrupt { running }) => {
            // Only the turn the sender saw is interrupted: a later one started by another
            // send is not the sender's to cut off. A sub-agent's one turn is its task,
            // bounded by its limits: a new turn would start them over.
            if ctx.is_sub_agent || busy.turn().map(|turn| &turn.id) != running.as_ref() {
                return Err(Rejection::AgentBusy.into());
            }
            // Exactly what a cancel does, without waiting for an aborted request's answer:
            // its tag is not the new turn's, so it is ignored when it comes.
            if let Some(stopped) = stop_turn(&mut fx, busy, CANCELLED_BY_USER, SKIPPED_BY_CANCEL) {
                fx.flush_held(stopped.held);
            }
        }
    }
    fx.persist(MessageContent::User { text, images });
    fx.push(Effect::Continue { turn: turn.clone() });
    Ok(fx.into_result(ConvState::AwaitingLlm {
        turn: Turn::new(turn),
    }))
}

/// Stops the work of a busy state the way a cancel does: the LLM request is aborted, the
/// running tool stopped and answered with `current`, the queued tools with `skipped`, the
/// sub-agents stopped and the spawn answered with their aggregate. Returns the stopped turn
/// (its held results not yet stored); `None` when nothing was running.
fn stop_turn(fx: &mut Effects, state: &ConvState, current: &str, skipped: &str) -> Option<Turn> {
    Some(match state.clone() {
        ConvState::Idle
        | ConvState::Error { .. }
        | ConvState::Completed
        | ConvState::ContextExhausted { .. } => return None,
        ConvState::AwaitingLlm { turn } | ConvState::Cancelling { turn } => turn,
        ConvState::LlmRequesting { turn, attempt } => {
            fx.push(Effect::AbortLlm {
                request: request_tag(&turn, attempt),
            });
            turn
        }
        ConvState::ToolExecuting {
            turn,
            current: tool,
            remaining,
            ..
        } => {
            fx.push(Effect::CancelTool {
                turn: turn.id.clone(),
                tool_use_id: tool.id.clone(),
            });
            fx.persist(MessageContent::tool_result(&tool, false, current, true));
            skip_tools(fx, &remaining, skipped);
            turn
        }
        ConvState::AwaitingSubAgents {
            turn,
            spawn,
            agents,
            remaining,
            ..
        } => {
            let pending = state
                .pending_agent_ids()
                .into_iter()
                .map(str::to_owned)
                .collect();
            fx.push(Effect::StopSubAgents { agent_ids: pending });
            fx.persist(MessageContent::tool_result(
                &spawn,
                false,
                aggregate(&agents, current),
                true,
            ));
            skip_tools(fx, &remaining, skipped);
            turn
        }
    })
}

/// REQ-BED-005: cancel is accepted in every state and never fails.
fn cancel(state: &ConvState) -> TransitionResult {
    let mut fx = Effects::default();
    let new_state = match state {
        ConvState::Idle | ConvState::Error { .. } => ConvState::Idle,
        ConvState::Completed | ConvState::ContextExhausted { .. } => state.clone(),
        // Waits for the gateway to confirm the abort (`LlmAborted`).
        ConvState::Cancelling { .. } => state.clone(),
        ConvState::LlmRequesting { turn, .. } => {
            stop_turn(&mut fx, state, CANCELLED_BY_USER, SKIPPED_BY_CANCEL);
            ConvState::Cancelling { turn: turn.clone() }
        }
        ConvState::AwaitingLlm { .. }
        | ConvState::ToolExecuting { .. }
        | ConvState::AwaitingSubAgents { .. } => {
            if let Some(turn) = stop_turn(&mut fx, state, CANCELLED_BY_USER, SKIPPED_BY_CANCEL) {
                fx.flush_held(turn.held);
            }
            ConvState::Idle
        }
    };
    fx.into_result(new_state)
}

/// The gateway confirmed the abort of a cancelled request: the turn is over.
fn finish_cancel(state: &ConvState, request: &LlmRequestTag) -> Option<TransitionResult> {
    match state {
        ConvState::Cancelling { turn } if turn.id == request.turn => {
            let mut fx = Effects::default();
            fx.flush_held(turn.held.clone());
            Some(fx.into_result(ConvState::Idle))
        }
        ConvState::Idle
        | ConvState::AwaitingLlm { .. }
        | ConvState::LlmRequesting { .. }
        | ConvState::ToolExecuting { .. }
        | ConvState::Cancelling { .. }
        | ConvState::AwaitingSubAgents { .. }
        | ConvState::Error { .. }
        | ConvState::Completed
        | ConvState::ContextExhausted { .. } => None,
    }
}

fn continue_turn(state: &ConvState, ctx: &ConvContext, id: &TurnId) -> Option<TransitionResult> {
    let ConvState::AwaitingLlm { turn } = state else {
        return None;
    };
    if &turn.id != id {
        return None;
    }
    let mut turn = turn.clone();
    let mut fx = Effects::default();
    if turn.summary_due && !turn.summarizing {
        // The summary step: one request without tools, past the step limit if need be.
        turn.summarizing = true;
        turn.llm_steps += 1;
        fx.flush_held(std::mem::take(&mut turn.held));
        flush_steering(&mut fx, &mut turn);
        fx.persist(MessageContent::System {
            text: SUMMARY_REQUEST.to_owned(),
        });
        fx.push(request_llm(ctx, &turn, 1));
        return Some(fx.into_result(ConvState::LlmRequesting { turn, attempt: 1 }));
    }
    // The grace turn's one step may go past the limit that started it.
    if turn.llm_steps >= ctx.limits.max_llm_steps && turn.grace.is_none() {
        let max_steps = ctx.limits.max_llm_steps;
        if ctx.is_sub_agent {
            let limit = SubAgentLimit::Steps { max_steps };
            turn.grace = Some(limit);
            fx.persist(grace_notice(limit));
            fx.push(Effect::GraceTurnStarted);
        } else {
            let message = format!(
                "The turn was stopped: it reached the limit of {max_steps} LLM steps per turn."
            );
            return Some(fail_turn(fx, ctx, turn, message, ErrorKind::Limit));
        }
    }
    turn.llm_steps += 1;
    fx.flush_held(std::mem::take(&mut turn.held));
    flush_steering(&mut fx, &mut turn);
    fx.push(request_llm(ctx, &turn, 1));
    Some(fx.into_result(ConvState::LlmRequesting { turn, attempt: 1 }))
}

/// Steering messages join the turn at its next LLM step, after the tool results that were
/// due (and before the summary request, which they are part of).
fn flush_steering(fx: &mut Effects, turn: &mut Turn) {
    for message in std::mem::take(&mut turn.steering) {
        fx.persist(MessageContent::User {
            text: message.text,
            images: message.images,
        });
    }
}

/// The LLM request of the turn's current step.
fn request_llm(ctx: &ConvContext, turn: &Turn, attempt: u32) -> Effect {
    Effect::RequestLlm {
        request: request_tag(turn, attempt),
        model: ctx.model_id.clone(),
        only_submit: turn.grace.is_some(),
        summary: turn.summarizing,
    }
}

/// What the summary request asks of the LLM (stored as a system message before it).
pub const SUMMARY_REQUEST: &str = "[[SYSTEM: This conversation is about to continue in a new one, which will start from your summary alone: its context is nearly full, or the user asked for it. Write that summary now: the user's goals, what has been done and found, the state of the files and of the work, decisions made and why, and what remains to do, with the names, paths and values the next conversation needs. Answer with the summary only; no tools are available.]]";

/// Issue 25: the user asked to continue in a new conversation; from rest, the summary is
/// asked for first.
fn summary_requested(
    state: &ConvState,
    turn: TurnId,
) -> Result<TransitionResult, InvalidTransition> {
    match state {
        ConvState::Idle | ConvState::Error { .. } => {
            let mut turn = Turn::new(turn);
            turn.summary_due = true;
            let mut fx = Effects::default();
            fx.push(Effect::Continue {
                turn: turn.id.clone(),
            });
            Ok(fx.into_result(ConvState::AwaitingLlm { turn }))
        }
        ConvState::Completed => Err(Rejection::Completed.into()),
        ConvState::ContextExhausted { .. } => Err(InvalidTransition::Ignored {
            state: state.kind(),
            event: "summary_requested",
            reason: "the summary is made already",
        }),
        ConvState::Cancelling { .. } => Err(Rejection::Cancelling.into()),
        ConvState::AwaitingLlm { .. }
        | ConvState::LlmRequesting { .. }
        | ConvState::ToolExecuting { .. }
        | ConvState::AwaitingSubAgents { .. } => Err(Rejection::AgentBusy.into()),
    }
}

/// The summary came: stored as the agent's message; tool calls in it are not run (each is
/// answered, so the chain stays valid), and the conversation is exhausted.
fn summary_answer(
    mut fx: Effects,
    turn: Turn,
    text: Option<String>,
    tools: &[ToolUse],
) -> TransitionResult {
    skip_tools(
        &mut fx,
        tools,
        "not run: this was the request for the conversation's summary, which runs no tools",
    );
    fx.flush_held(turn.held);
    fx.into_result(ConvState::ContextExhausted {
        summary: text.unwrap_or_default(),
    })
}

/// Whether `usage` fills the context to the continuation threshold.
fn past_threshold(ctx: &ConvContext, usage: Usage) -> bool {
    ctx.continuation_permille > 0
        && ctx.context_window > 0
        && u128::from(usage.context_tokens()) * 1000
            >= u128::from(ctx.context_window) * u128::from(ctx.continuation_permille)
}

fn retry_timeout(
    state: &ConvState,
    ctx: &ConvContext,
    request: &LlmRequestTag,
) -> Option<TransitionResult> {
    let ConvState::LlmRequesting { turn, attempt } = state else {
        return None;
    };
    if request_tag(turn, *attempt) != *request || *attempt < 2 {
        return None;
    }
    let mut turn = turn.clone();
    let mut fx = Effects::default();
    fx.flush_held(std::mem::take(&mut turn.held));
    fx.push(request_llm(ctx, &turn, *attempt));
    Some(fx.into_result(ConvState::LlmRequesting {
        turn,
        attempt: *attempt,
    }))
}

fn llm_response(
    state: &ConvState,
    ctx: &ConvContext,
    request: &LlmRequestTag,
    reply: LlmReply,
) -> Option<TransitionResult> {
    let turn = match state {
        ConvState::LlmRequesting { turn, attempt } if request_tag(turn, *attempt) == *request => {
            turn.clone()
        }
        // REQ-BED-005: the response of a cancelled request is dropped, never persisted.
        ConvState::Cancelling { .. } => return finish_cancel(state, request),
        ConvState::Idle
        | ConvState::AwaitingLlm { .. }
        | ConvState::LlmRequesting { .. }
        | ConvState::ToolExecuting { .. }
        | ConvState::AwaitingSubAgents { .. }
        | ConvState::Error { .. }
        | ConvState::Completed
        | ConvState::ContextExhausted { .. } => return None,
    };
    let mut fx = Effects::default();
    usage_effects(&mut fx, ctx, reply.usage);
    let mut turn = turn;
    // Issue 25: past the threshold, the turn's next step is the summary request.
    if !ctx.is_sub_agent && !turn.summarizing && past_threshold(ctx, reply.usage) {
        turn.summary_due = true;
    }
    let LlmReply {
        text,
        tool_uses,
        end_turn,
        reasoning,
        ..
    } = reply;
    fx.persist(MessageContent::Agent {
        text: text.clone(),
        tool_uses: tool_uses.clone(),
        reasoning,
    });
    if turn.summarizing {
        return Some(summary_answer(fx, turn, text, &tool_uses));
    }
    if let Some(limit) = turn.grace {
        return Some(grace_answer(fx, ctx, turn, limit, &tool_uses));
    }

    let mut tools = tool_uses.into_iter();
    let Some(first) = tools.next() else {
        return Some(if !end_turn || turn.summary_due {
            // REQ-BED-003: text only, not done: ask the LLM for more (or for the summary).
            continue_with_llm(fx, turn)
        } else if ctx.is_sub_agent {
            sub_agent_ended_without_submit(fx, ctx, turn)
        } else {
            fx.flush_held(turn.held);
            fx.into_result(ConvState::Idle)
        });
    };
    let rest: Vec<ToolUse> = tools.collect();
    let requested = 1 + rest.len() as u32;
    if turn.tool_calls.saturating_add(requested) > ctx.limits.max_tool_calls {
        let output = format!(
            "not run: the turn reached its limit of {} tool calls",
            ctx.limits.max_tool_calls
        );
        skip_tools(&mut fx, std::slice::from_ref(&first), &output);
        skip_tools(&mut fx, &rest, &output);
        let message = format!(
            "The turn was stopped: the LLM asked for more than {} tool calls in one turn.",
            ctx.limits.max_tool_calls
        );
        return Some(fail_turn(fx, ctx, turn, message, ErrorKind::Limit));
    }
    turn.tool_calls += requested;
    Some(start_tool(fx, ctx, turn, first, rest, 0))
}

fn llm_error(
    state: &ConvState,
    ctx: &ConvContext,
    request: &LlmRequestTag,
    error: &LlmFailure,
) -> Option<TransitionResult> {
    let (turn, attempt) = match state {
        ConvState::LlmRequesting { turn, attempt } if request_tag(turn, *attempt) == *request => {
            (turn.clone(), *attempt)
        }
        ConvState::Cancelling { .. } => return finish_cancel(state, request),
        ConvState::Idle
        | ConvState::AwaitingLlm { .. }
        | ConvState::LlmRequesting { .. }
        | ConvState::ToolExecuting { .. }
        | ConvState::AwaitingSubAgents { .. }
        | ConvState::Error { .. }
        | ConvState::Completed
        | ConvState::ContextExhausted { .. } => return None,
    };
    let fx = Effects::default();
    if error.kind.is_retryable() && attempt < MAX_LLM_ATTEMPTS {
        let mut fx = fx;
        let next = attempt + 1;
        let backoff = retry_delay_ms(attempt);
        let delay_ms = error
            .retry_after_ms
            .map_or(backoff, |after| backoff.max(after.min(RETRY_AFTER_CAP_MS)));
        fx.push(Effect::NotifyRetrying {
            attempt: next,
            delay_ms,
            error_kind: error.kind,
        });
        fx.push(Effect::ScheduleRetry {
            request: request_tag(&turn, next),
            delay_ms,
        });
        return Some(fx.into_result(ConvState::LlmRequesting {
            turn,
            attempt: next,
        }));
    }
    let message = if error.kind.is_retryable() {
        format!(
            "The LLM request failed after {attempt} attempts ({}): {}. Send a message to try again.",
            error.kind.as_str(),
            error.message
        )
    } else {
        let what = match error.kind {
            ErrorKind::Auth => {
                "The LLM backend refused the credentials; check the configured API key"
            }
            ErrorKind::InvalidRequest => "The LLM backend rejected the request as invalid",
            ErrorKind::Limit => "The LLM request hit a limit of the gateway",
            ErrorKind::Budget => "The token budget is spent; no LLM request was sent",
            ErrorKind::RateLimit | ErrorKind::Network | ErrorKind::Unknown => {
                "The LLM request failed"
            }
        };
        format!("{what}: {}", error.message)
    };
    Some(fail_turn(fx, ctx, turn, message, error.kind))
}

fn tool_complete(
    state: &ConvState,
    ctx: &ConvContext,
    turn_id: &TurnId,
    tool_use_id: &str,
    outcome: ToolOutcome,
) -> Option<TransitionResult> {
    let ConvState::ToolExecuting {
        turn,
        current,
        remaining,
        completed,
    } = state
    else {
        return None;
    };
    if &turn.id != turn_id || current.id != tool_use_id {
        return None;
    }
    let mut fx = Effects::default();
    // REQ-BED-004: a failed tool is a result the LLM sees, not an error state.
    fx.persist(MessageContent::tool_result(
        current,
        outcome.ok,
        outcome.output,
        false,
    ));
    Some(next_tool(
        fx,
        ctx,
        turn.clone(),
        remaining.clone(),
        completed + 1,
    ))
}

fn sub_agents_spawned(
    state: &ConvState,
    turn_id: &TurnId,
    tool_use_id: &str,
    agent_ids: Vec<String>,
) -> Option<TransitionResult> {
    let ConvState::ToolExecuting {
        turn,
        current,
        remaining,
        completed,
    } = state
    else {
        return None;
    };
    if &turn.id != turn_id || current.id != tool_use_id || current.name != SPAWN_SUB_AGENTS {
        return None;
    }
    let agents = agent_ids
        .into_iter()
        .map(|agent_id| SubAgentSlot {
            agent_id,
            outcome: None,
        })
        .collect();
    Some(
        Effects::default().into_result(ConvState::AwaitingSubAgents {
            turn: turn.clone(),
            spawn: current.clone(),
            agents,
            remaining: remaining.clone(),
            completed: *completed,
        }),
    )
}

fn sub_agent_result(
    state: &ConvState,
    ctx: &ConvContext,
    agent_id: &str,
    outcome: SubAgentOutcome,
) -> Option<TransitionResult> {
    let ConvState::AwaitingSubAgents {
        turn,
        spawn,
        agents,
        remaining,
        completed,
    } = state
    else {
        return None;
    };
    let mut agents = agents.clone();
    let slot = agents
        .iter_mut()
        .find(|slot| slot.agent_id == agent_id && slot.outcome.is_none())?;
    slot.outcome = Some(outcome);
    let fx = Effects::default();
    if agents.iter().any(|slot| slot.outcome.is_none()) {
        return Some(fx.into_result(ConvState::AwaitingSubAgents {
            turn: turn.clone(),
            spawn: spawn.clone(),
            agents,
            remaining: remaining.clone(),
            completed: *completed,
        }));
    }
    // REQ-BED-008: every sub-agent answered; the aggregate in task order is the spawn's result.
    let mut fx = fx;
    fx.persist(MessageContent::tool_result(
        spawn,
        true,
        aggregate(&agents, ""),
        false,
    ));
    Some(next_tool(
        fx,
        ctx,
        turn.clone(),
        remaining.clone(),
        completed + 1,
    ))
}

fn background_result(
    state: &ConvState,
    result: BackgroundResult,
    wake: Option<TurnId>,
) -> TransitionResult {
    let mut fx = Effects::default();
    let new_state = match state.clone() {
        ConvState::Idle => {
            fx.persist(MessageContent::System {
                text: result.system_text(),
            });
            match wake {
                Some(turn) => {
                    fx.push(Effect::Continue { turn: turn.clone() });
                    ConvState::AwaitingLlm {
                        turn: Turn::new(turn),
                    }
                }
                None => ConvState::Idle,
            }
        }
        state @ (ConvState::Error { .. }
        | ConvState::Completed
        | ConvState::ContextExhausted { .. }) => {
            fx.persist(MessageContent::System {
                text: result.system_text(),
            });
            state
        }
        mut busy @ (ConvState::AwaitingLlm { .. }
        | ConvState::LlmRequesting { .. }
        | ConvState::ToolExecuting { .. }
        | ConvState::Cancelling { .. }
        | ConvState::AwaitingSubAgents { .. }) => {
            if let Some(turn) = turn_mut(&mut busy) {
                turn.held.push(result);
            }
            busy
        }
    };
    fx.into_result(new_state)
}

/// A restart or shutdown cut the turn off: every open tool call gets its synthetic result.
fn interrupted(
    state: &ConvState,
    ctx: &ConvContext,
    why: Interruption,
) -> Option<TransitionResult> {
    // A call of a client tool outlives the process: its client (a backend that may take
    // minutes) answers it after the restart. The call is taken up again where it stands;
    // the tools after it wait, as before.
    if let ConvState::ToolExecuting { turn, current, .. } = state
        && ctx.is_client_tool(&current.name)
        && let Ok(plan) = super::plan::plan(ctx, current)
    {
        return Some(TransitionResult {
            new_state: state.clone(),
            effects: vec![Effect::ExecuteTool {
                turn: turn.id.clone(),
                tool: current.clone(),
                plan,
            }],
            ended: None,
        });
    }
    // A user turn that has not begun (its message stored, no LLM step yet: the next of a
    // queue, say) loses nothing to the restart: it begins after it. (A sub-agent's turn
    // belongs to its parent's spawn, which the restart ends.)
    if let ConvState::AwaitingLlm { turn } = state
        && turn.llm_steps == 0
        && !ctx.is_sub_agent
    {
        return Some(TransitionResult {
            new_state: state.clone(),
            effects: vec![Effect::Continue {
                turn: turn.id.clone(),
            }],
            ended: None,
        });
    }
    let output = why.tool_output();
    let mut fx = Effects::default();
    let turn = stop_turn(&mut fx, state, output, output)?;
    fx.flush_held(turn.held);
    Some(fx.into_result(ConvState::Idle))
}

/// A sub-agent's wall time ran out: the first time its work is stopped and its grace turn
/// starts; in the grace turn the sub-agent fails.
fn time_limit(state: &ConvState, ctx: &ConvContext, timeout_ms: u64) -> Option<TransitionResult> {
    if !ctx.is_sub_agent || matches!(state, ConvState::Cancelling { .. }) {
        return None;
    }
    let limit = SubAgentLimit::Time { timeout_ms };
    let output = "stopped: the sub-agent reached its time limit";
    let mut fx = Effects::default();
    let mut turn = stop_turn(&mut fx, state, output, output)?;
    if let Some(reached) = turn.grace {
        let message = grace_failure(reached);
        return Some(fail_turn(fx, ctx, turn, message, ErrorKind::Limit));
    }
    turn.grace = Some(limit);
    fx.persist(grace_notice(limit));
    fx.push(Effect::GraceTurnStarted);
    Some(continue_with_llm(fx, turn))
}

/// The system message that starts a grace turn.
fn grace_notice(limit: SubAgentLimit) -> MessageContent {
    MessageContent::System {
        text: format!(
            "[[SYSTEM: you have reached your {limit}. Call submit_result now with what you \
             have (success false if the task is not done); no other tool is available.]]"
        ),
    }
}

fn grace_failure(limit: SubAgentLimit) -> String {
    format!("The sub-agent reached its {limit} and did not call submit_result in its grace turn.")
}

/// The tag of the current step's LLM request at `attempt`.
fn request_tag(turn: &Turn, attempt: u32) -> LlmRequestTag {
    LlmRequestTag {
        turn: turn.id.clone(),
        step: turn.llm_steps,
        attempt,
    }
}

fn turn_mut(state: &mut ConvState) -> Option<&mut Turn> {
    match state {
        ConvState::AwaitingLlm { turn }
        | ConvState::LlmRequesting { turn, .. }
        | ConvState::ToolExecuting { turn, .. }
        | ConvState::Cancelling { turn }
        | ConvState::AwaitingSubAgents { turn, .. } => Some(turn),
        ConvState::Idle
        | ConvState::Error { .. }
        | ConvState::Completed
        | ConvState::ContextExhausted { .. } => None,
    }
}

/// Usage bookkeeping of one LLM response, with a warning when the context crosses 80% or 95%
/// of the window (REQ-BED-012). Crossing both at once warns once, at the higher level.
fn usage_effects(fx: &mut Effects, ctx: &ConvContext, usage: Usage) {
    fx.push(Effect::RecordUsage { usage });
    let window = ctx.context_window;
    if window == 0 {
        return;
    }
    let before = u128::from(ctx.context_tokens) * 1000;
    let after = u128::from(usage.context_tokens()) * 1000;
    let crossed = CONTEXT_WARNINGS_PERMILLE.iter().any(|&permille| {
        let threshold = u128::from(window) * u128::from(permille);
        before < threshold && after >= threshold
    });
    if crossed {
        fx.push(Effect::WarnContext {
            context_tokens: usage.context_tokens(),
            context_window: window,
            ratio: usage.context_tokens() as f64 / window as f64,
        });
    }
}

/// Asks the LLM for the next step of the same turn.
fn continue_with_llm(mut fx: Effects, turn: Turn) -> TransitionResult {
    fx.push(Effect::Continue {
        turn: turn.id.clone(),
    });
    fx.into_result(ConvState::AwaitingLlm { turn })
}

/// Ends the turn in `Error`, storing what the turn held back and a message the user sees.
fn fail_turn(
    mut fx: Effects,
    ctx: &ConvContext,
    turn: Turn,
    message: String,
    error_kind: ErrorKind,
) -> TransitionResult {
    fx.flush_held(turn.held);
    fx.persist(MessageContent::Error {
        text: message.clone(),
    });
    if ctx.is_sub_agent {
        fx.push(Effect::ReportToParent {
            outcome: SubAgentOutcome {
                success: false,
                result: message.clone(),
            },
        });
    }
    fx.into_result(ConvState::Error {
        message,
        error_kind,
    })
}

/// The LLM's answer in a sub-agent's grace turn: a valid submit_result ends it as usual;
/// every other call is answered without running; without one the sub-agent fails.
fn grace_answer(
    mut fx: Effects,
    ctx: &ConvContext,
    turn: Turn,
    limit: SubAgentLimit,
    tool_uses: &[ToolUse],
) -> TransitionResult {
    let submitted = tool_uses.iter().find_map(|tool| {
        (tool.name == SUBMIT_RESULT)
            .then(|| {
                parse_submit(&tool.input)
                    .ok()
                    .map(|outcome| (tool, outcome))
            })
            .flatten()
    });
    for tool in tool_uses {
        match &submitted {
            Some((submit, _)) if submit.id == tool.id => fx.persist(MessageContent::tool_result(
                tool,
                true,
                "result submitted",
                false,
            )),
            _ => fx.persist(MessageContent::tool_result(
                tool,
                false,
                GRACE_SKIPPED,
                true,
            )),
        }
    }
    match submitted {
        Some((_, outcome)) => {
            fx.flush_held(turn.held);
            fx.push(Effect::ReportToParent { outcome });
            fx.into_result(ConvState::Completed)
        }
        None => fail_turn(fx, ctx, turn, grace_failure(limit), ErrorKind::Limit),
    }
}

fn sub_agent_ended_without_submit(
    mut fx: Effects,
    ctx: &ConvContext,
    mut turn: Turn,
) -> TransitionResult {
    if !turn.reminded {
        turn.reminded = true;
        fx.persist(MessageContent::System {
            text: SUBMIT_REMINDER.to_owned(),
        });
        return continue_with_llm(fx, turn);
    }
    let message = "The sub-agent ended its turn without calling submit_result.".to_owned();
    fail_turn(fx, ctx, turn, message, ErrorKind::Unknown)
}

/// Moves past a finished tool: the next one, or back to the LLM when none is left.
fn next_tool(
    fx: Effects,
    ctx: &ConvContext,
    turn: Turn,
    remaining: Vec<ToolUse>,
    completed: u32,
) -> TransitionResult {
    let mut rest = remaining.into_iter();
    match rest.next() {
        Some(tool) => start_tool(fx, ctx, turn, tool, rest.collect(), completed),
        None => continue_with_llm(fx, turn),
    }
}

/// Starts `tool`. The core settles its own tools (submit_result, a refused or malformed
/// spawn_sub_agents), a call of a tool the conversation's agent does not offer, and the
/// calls its plan refuses (ask_user in a sub-agent, a malformed question or background
/// command) at once and moves on; every other tool becomes an
/// `ExecuteTool` with the plan the runtime carries out.
fn start_tool(
    mut fx: Effects,
    ctx: &ConvContext,
    turn: Turn,
    tool: ToolUse,
    remaining: Vec<ToolUse>,
    completed: u32,
) -> TransitionResult {
    // The rules, decided once for the call, deny any call but a sub-agent's submit_result
    // (its task ends only with it).
    let permission = super::permissions::decide(&ctx.permissions, &tool.name, &tool.input);
    let settled = match (tool.name.as_str(), permission) {
        (name, _) if !ctx.offers(name) => {
            format!("this agent has no tool named {name:?}; it did not run")
        }
        (name, super::permissions::Permission::Denied(why)) if name != SUBMIT_RESULT => why,
        (SUBMIT_RESULT, _) if ctx.is_sub_agent => match parse_submit(&tool.input) {
            Ok(outcome) => return submit(fx, turn, &tool, &remaining, outcome),
            Err(why) => why,
        },
        (SUBMIT_RESULT, _) => "submit_result is only available to sub-agents".to_owned(),
        (SPAWN_SUB_AGENTS, _) if ctx.is_sub_agent => {
            "sub-agents cannot spawn sub-agents; do the work yourself".to_owned()
        }
        (SPAWN_SUB_AGENTS, _) => match parse_spawn(&tool.input, &ctx.limits) {
            Ok(tasks) => {
                fx.push(Effect::SpawnSubAgents {
                    turn: turn.id.clone(),
                    tool_use_id: tool.id.clone(),
                    tasks,
                });
                return executing(fx, turn, tool, remaining, completed);
            }
            Err(why) => why,
        },
        (_, permission) => match plan_decided(ctx, &tool, permission) {
            Ok(plan) => {
                fx.push(Effect::ExecuteTool {
                    turn: turn.id.clone(),
                    tool: tool.clone(),
                    plan,
                });
                return executing(fx, turn, tool, remaining, completed);
            }
            Err(why) => why,
        },
    };
    fx.persist(MessageContent::tool_result(&tool, false, settled, false));
    next_tool(fx, ctx, turn, remaining, completed + 1)
}

fn executing(
    fx: Effects,
    turn: Turn,
    current: ToolUse,
    remaining: Vec<ToolUse>,
    completed: u32,
) -> TransitionResult {
    fx.into_result(ConvState::ToolExecuting {
        turn,
        current,
        remaining,
        completed,
    })
}

/// REQ-BED-008: submit_result ends the sub-agent and hands its result to the parent.
fn submit(
    mut fx: Effects,
    turn: Turn,
    tool: &ToolUse,
    remaining: &[ToolUse],
    outcome: SubAgentOutcome,
) -> TransitionResult {
    fx.persist(MessageContent::tool_result(
        tool,
        true,
        "result submitted",
        false,
    ));
    skip_tools(
        &mut fx,
        remaining,
        "not run: the sub-agent ended with submit_result",
    );
    fx.flush_held(turn.held);
    fx.push(Effect::ReportToParent { outcome });
    fx.into_result(ConvState::Completed)
}

fn parse_submit(input: &Value) -> Result<SubAgentOutcome, String> {
    let result = input
        .get("result")
        .and_then(Value::as_str)
        .ok_or("invalid input: `result` must be a string")?;
    let success = match input.get("success") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(success)) => *success,
        Some(_) => return Err("invalid input: `success` must be a boolean".to_owned()),
    };
    Ok(SubAgentOutcome {
        success,
        result: result.to_owned(),
    })
}

fn parse_spawn(input: &Value, limits: &TurnLimits) -> Result<Vec<SubAgentTask>, String> {
    let max = limits.max_sub_agents;
    let tasks = input
        .get("tasks")
        .and_then(Value::as_array)
        .ok_or("invalid input: `tasks` must be an array of {\"prompt\", \"model\"?}")?;
    if tasks.is_empty() {
        return Err("invalid input: `tasks` is empty".to_owned());
    }
    if tasks.len() > max as usize {
        return Err(format!(
            "invalid input: {} tasks given, at most {max} sub-agents per call",
            tasks.len()
        ));
    }
    tasks
        .iter()
        .enumerate()
        .map(|(i, task)| {
            let prompt = task
                .get("prompt")
                .and_then(Value::as_str)
                .filter(|prompt| !prompt.trim().is_empty())
                .ok_or_else(|| {
                    format!("invalid input: tasks[{i}].prompt must be a non-empty string")
                })?;
            let model = match task.get("model") {
                None | Some(Value::Null) => None,
                Some(Value::String(model)) => Some(model.clone()),
                Some(_) => return Err(format!("invalid input: tasks[{i}].model must be a string")),
            };
            // Bounded by the configuration: a task may ask for less, never for more.
            let max_steps = match task.get("max_steps") {
                None | Some(Value::Null) => limits.sub_agent_max_steps,
                Some(value) => match value.as_u64().filter(|&n| n > 0) {
                    Some(n) => u32::try_from(n).map_or(limits.sub_agent_max_steps, |n| {
                        n.min(limits.sub_agent_max_steps)
                    }),
                    None => {
                        return Err(format!(
                            "invalid input: tasks[{i}].max_steps must be a positive integer"
                        ));
                    }
                },
            };
            let timeout_ms = match task.get("timeout_ms") {
                None | Some(Value::Null) => limits.sub_agent_timeout_ms,
                Some(value) => match value.as_u64().filter(|&n| n > 0) {
                    Some(n) => n.min(limits.sub_agent_timeout_ms),
                    None => {
                        return Err(format!(
                            "invalid input: tasks[{i}].timeout_ms must be a positive integer"
                        ));
                    }
                },
            };
            Ok(SubAgentTask {
                prompt: prompt.to_owned(),
                model,
                max_steps,
                timeout_ms,
            })
        })
        .collect()
}

/// Synthetic failed results for tool calls that will not run.
fn skip_tools(fx: &mut Effects, tools: &[ToolUse], output: &str) {
    for tool in tools {
        fx.persist(MessageContent::tool_result(tool, false, output, true));
    }
}

/// The spawn_sub_agents result: `[{"agent_id", "success", "result"}]` in task order. Slots
/// without an outcome are reported as failures with `unfinished` as their result.
fn aggregate(agents: &[SubAgentSlot], unfinished: &str) -> String {
    let entries: Vec<Value> = agents
        .iter()
        .map(|slot| match &slot.outcome {
            Some(outcome) => json!({
                "agent_id": slot.agent_id,
                "success": outcome.success,
                "result": outcome.result,
            }),
            None => json!({
                "agent_id": slot.agent_id,
                "success": false,
                "result": unfinished,
            }),
        })
        .collect();
    Value::Array(entries).to_string()
}
