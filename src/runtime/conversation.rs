//! The conversation actor: one per active conversation (and per sub-agent).
//!
//! Its handler turns a message into an `Event`, calls `transition`, hands the result to the
//! persistence actor and waits for the commit (REQ-BED-007), publishes the durable frames,
//! then dispatches the effects to the actors and tasks that perform them. It never awaits an
//! LLM call or a tool: those answer later as messages tagged with their work. Before every
//! message it drains the cancel slot, so a cancel wins over queued completions.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};

use super::Handles;
use super::cancel::{CancelOutcome, CancelSlot};
use super::commit;
use super::context::context;
use super::conversation_state::{Child, ConversationState, starting_blocked};
use super::messages::{Accepted, ConvMsg, EmitRequest, ParentLink, SendError, SendRequest};
use super::turn::Turn;
use tracing::Instrument;

use crate::model::ConversationRecord;
use crate::notice::{Keyed, Notice};
use crate::state_machine::{
    Effect, Event, IfBusy, ImageRef, Interruption, InvalidTransition, Rejection, ToolOutcome,
    TurnId, transition,
};
use crate::store::StoreError;

#[derive(Debug)]
pub struct ConversationActor;

/// Starts a conversation's actor under `supervisor` (the registry's [`Spawn`](super::registry::Spawn)).
pub fn spawn(
    handles: Arc<Handles>,
    record: ConversationRecord,
    cancel: Arc<CancelSlot>,
    parent: Option<ParentLink>,
    supervisor: ractor::ActorCell,
    next_step: Option<i64>,
) -> std::pin::Pin<Box<dyn Future<Output = Result<ActorRef<ConvMsg>, String>> + Send>> {
    Box::pin(async move {
        let args = ConversationArgs {
            record,
            handles,
            cancel,
            parent,
            next_step,
        };
        Actor::spawn_linked(None, ConversationActor, args, supervisor)
            .await
            .map(|(actor, _)| actor)
            .map_err(|e| e.to_string())
    })
}

pub struct ConversationArgs {
    pub record: ConversationRecord,
    pub handles: Arc<Handles>,
    pub cancel: Arc<CancelSlot>,
    pub parent: Option<ParentLink>,
    /// The replay log's next step when the starter knows it (1 for a conversation just
    /// written); read from the store otherwise.
    pub next_step: Option<i64>,
}

impl std::fmt::Debug for ConversationArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConversationArgs")
            .field("id", &self.record.id)
            .finish_non_exhaustive()
    }
}

/// What applying an event came to.
enum Applied {
    Done { stopped: Stopped },
    Ignored,
}

/// The work a transition stopped (what a cancel reports).
#[derive(Debug, Default)]
struct Stopped {
    tools: Vec<String>,
    sub_agents: Vec<String>,
    llm: bool,
}

impl Stopped {
    fn of(effects: &[Effect]) -> Stopped {
        let mut stopped = Stopped::default();
        for effect in effects {
            match effect {
                Effect::CancelTool { tool_use_id, .. } => stopped.tools.push(tool_use_id.clone()),
                Effect::StopSubAgents { agent_ids } => {
                    stopped.sub_agents.extend(agent_ids.iter().cloned());
                }
                Effect::AbortLlm { .. } => stopped.llm = true,
                Effect::Continue { .. }
                | Effect::RequestLlm { .. }
                | Effect::ScheduleRetry { .. }
                | Effect::ExecuteTool { .. }
                | Effect::SpawnSubAgents { .. }
                | Effect::ReportToParent { .. }
                | Effect::GraceTurnStarted
                | Effect::PersistMessage(_)
                | Effect::RecordUsage { .. }
                | Effect::NotifyRetrying { .. }
                | Effect::WarnContext { .. } => {}
            }
        }
        stopped
    }
}

impl Actor for ConversationActor {
    type Msg = ConvMsg;
    type State = ConversationState;
    type Arguments = ConversationArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: ConversationArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let mut ctx = context(&args.handles.settings, &args.record);
        if let Some(parent) = &args.parent {
            ctx.limits.max_llm_steps = parent.max_steps;
        }
        args.cancel
            .set_running_turn(args.record.state.turn().map(|turn| &turn.id));
        // The replay log goes on from the last stored step; this actor's first step starts a
        // segment (it carries the state it starts from and the whole context).
        let next_step = match args.next_step {
            Some(next) => next,
            None => args.handles.store.next_step(&args.record.id).await?,
        };
        Ok(ConversationState {
            record: args.record,
            ctx,
            recorder: crate::replay::Recorder::new(next_step),
            handles: args.handles,
            cancel: args.cancel,
            parent: args.parent,
            children: HashMap::new(),
            turn: None,
            shown: None,
            unsent: Vec::new(),
            history: crate::llm::new_history(),
            idle_generation: 0,
            idle_timer: false,
            stopping: false,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // A fresh actor runs none of the work its stored state waits for (the process or the
        // previous actor died): close the turn like a restart would.
        if state.record.state.is_busy() {
            Box::pin(apply_internal(
                &myself,
                state,
                Event::Interrupted(Interruption::Restart),
            ))
            .await?;
        }
        state
            .handles
            .metrics
            .conversation_state(None, Some(state.record.state.kind()));
        arm_idle_timer(&myself, state);
        Ok(())
    }

    // ractor keeps one future per actor for its message loop, sized for the largest handler
    // future; boxed here, an idle conversation holds a pointer instead of a turn's worth of
    // suspended state (7.8 KB of its ~16 KB when measured).
    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let result = Box::pin(handle(myself.clone(), message, state)).await;
        match result {
            // A sub-agent's failure is its parent's to handle (as a failed sub-agent).
            Err(error) if state.parent.is_none() => {
                restart_later(&myself, state, &error.to_string());
                Ok(())
            }
            other => other,
        }
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        Box::pin(supervise(myself, event, state)).await
    }

    async fn post_stop(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state
            .handles
            .registry
            .forget(&state.record.id, myself.get_id());
        state
            .handles
            .metrics
            .conversation_state(Some(state.record.state.kind()), None);
        state.cancel.stop_work();
        Ok(())
    }
}

/// A conversation whose actor cannot go on (its database refused a commit for good): the
/// actor stops, so that its work is stopped too, and a new one starts from the stored state,
/// which closes the interrupted turn as a restart does (`post_start`). The start is retried
/// with a back-off while the database refuses it; the conversation comes to rest without a
/// client having to touch it.
fn restart_later(myself: &ActorRef<ConvMsg>, state: &mut ConversationState, error: &str) {
    let id = state.record.id.clone();
    tracing::error!(conversation = %id, %error, "the conversation's actor stops on an error; a new one starts from the stored state");
    state.stopping = true;
    myself.stop(Some(error.to_owned()));
    let handles = state.handles.clone();
    let stopped = myself.clone();
    tokio::spawn(async move {
        let mut delay = Duration::from_millis(500);
        loop {
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = handles.lifecycle.shutting_down() => return,
            }
            // Started again only once this actor is gone.
            if stopped.get_status() != ractor::ActorStatus::Stopped {
                continue;
            }
            match handles.registry.get_or_start(&handles, &id).await {
                Ok(_) | Err(super::StartError::NotFound | super::StartError::Elsewhere(_)) => {
                    return;
                }
                Err(error) => {
                    tracing::warn!(conversation = %id, %error, retry_in_ms = delay.as_millis() as u64, "the conversation could not start again; retrying");
                    delay = (delay * 2).min(Duration::from_secs(30));
                }
            }
        }
    });
}

async fn handle(
    myself: ActorRef<ConvMsg>,
    message: ConvMsg,
    state: &mut ConversationState,
) -> Result<(), ActorProcessingErr> {
    state.idle_generation += 1;
    Box::pin(drain_cancels(&myself, state)).await?;
    match message {
        ConvMsg::Send(request) => {
            let SendRequest {
                text,
                images,
                client_message_id,
                if_busy,
                reply,
            } = *request;
            let outcome = Box::pin(send(
                &myself,
                state,
                text,
                images,
                client_message_id,
                if_busy,
            ))
            .await;
            let _ = reply.send(outcome);
        }
        ConvMsg::Cancel => {}
        ConvMsg::Event(event) => {
            if !(state.stopping && matches!(*event, Event::Continue { .. })) {
                Box::pin(apply_internal(&myself, state, *event)).await?;
            }
        }
        ConvMsg::IdleCheck(generation) => {
            state.idle_timer = false;
            // `handle` bumped the generation for this message itself.
            if generation + 1 == state.idle_generation && can_rest(state) {
                myself.stop(Some("idle".into()));
                return Ok(());
            }
        }
        ConvMsg::Emit(emit) => {
            let EmitRequest { frames, reply } = *emit;
            let _ = reply.send(Box::pin(emit_frames(state, frames)).await);
        }
        ConvMsg::Record(reply) => {
            let _ = reply.send(state.record.clone());
        }
        ConvMsg::Dequeue(id, reply) => {
            let event = Event::Dequeue {
                id: id.map(TurnId::new),
            };
            let taken = matches!(
                Box::pin(apply_internal(&myself, state, event)).await?,
                Applied::Done { .. }
            );
            let _ = reply.send(taken);
        }
        ConvMsg::Summarize(reply) => {
            let outcome = Box::pin(summarize(&myself, state)).await;
            let _ = reply.send(outcome);
        }
        ConvMsg::Shutdown(reply) => {
            state.stopping = true;
            if state.record.state.is_busy() {
                apply_internal(&myself, state, Event::Interrupted(Interruption::Shutdown)).await?;
            }
            let _ = reply.send(());
            myself.stop(Some("shutdown".into()));
            return Ok(());
        }
    }
    arm_idle_timer(&myself, state);
    Ok(())
}

/// Never ractor's default (which would stop this conversation when a child ends).
async fn supervise(
    myself: ActorRef<ConvMsg>,
    event: SupervisionEvent,
    state: &mut ConversationState,
) -> Result<(), ActorProcessingErr> {
    match event {
        SupervisionEvent::ActorFailed(cell, error) => {
            let Some(child) = state.children.remove(&cell.get_id()) else {
                return Ok(());
            };
            tracing::warn!(conversation = %state.record.id, %error, "a child of the conversation crashed");
            let event = match child {
                Child::Tool { turn, tool_use_id } | Child::Spawn { turn, tool_use_id } => {
                    Event::ToolComplete {
                        turn,
                        tool_use_id,
                        outcome: ToolOutcome::failed(format!("the tool run crashed: {error}")),
                    }
                }
            };
            Box::pin(drain_cancels(&myself, state)).await?;
            Box::pin(apply_internal(&myself, state, event)).await?;
        }
        SupervisionEvent::ActorTerminated(cell, _, _) => {
            state.children.remove(&cell.get_id());
        }
        SupervisionEvent::ActorStarted(_) | SupervisionEvent::ProcessGroupChanged(_) => {}
    }
    Ok(())
}

fn can_rest(state: &ConversationState) -> bool {
    !state.record.state.is_busy()
        && state.children.is_empty()
        && !state.cancel.has_pending()
        && state.handles.hub.subscribers(&state.record.id) == 0
}

fn arm_idle_timer(myself: &ActorRef<ConvMsg>, state: &mut ConversationState) {
    if state.idle_timer || state.stopping || state.record.state.is_busy() {
        return;
    }
    state.idle_timer = true;
    let generation = state.idle_generation;
    myself.send_after(state.handles.settings.idle_timeout(), move || {
        ConvMsg::IdleCheck(generation)
    });
}

async fn drain_cancels(
    myself: &ActorRef<ConvMsg>,
    state: &mut ConversationState,
) -> Result<(), ActorProcessingErr> {
    let waiting = state.cancel.take();
    if waiting.is_empty() {
        return Ok(());
    }
    let applied = apply_internal(myself, state, Event::UserCancel).await?;
    let stopped = match applied {
        Applied::Done { stopped } => stopped,
        Applied::Ignored => Stopped::default(),
    };
    let outcome = CancelOutcome {
        state: state.record.state.clone(),
        stopped_tools: stopped.tools,
        stopped_sub_agents: stopped.sub_agents,
        aborted_llm: stopped.llm,
    };
    for reply in waiting {
        let _ = reply.send(outcome.clone());
    }
    Ok(())
}

async fn send(
    myself: &ActorRef<ConvMsg>,
    state: &mut ConversationState,
    text: String,
    images: Vec<ImageRef>,
    client_message_id: Option<String>,
    if_busy: IfBusy,
) -> Result<Accepted, SendError> {
    if starting_blocked(state) {
        return Err(SendError::ShuttingDown);
    }
    let turn = TurnId::new(uuid::Uuid::now_v7().to_string());
    let event = Event::UserMessage {
        turn: turn.clone(),
        text,
        images,
        if_busy,
    };
    let result =
        transition(&state.record.state, &state.ctx, event.clone()).map_err(|e| match e {
            InvalidTransition::Rejected(rejection) => SendError::Rejected(rejection),
            InvalidTransition::Ignored { .. } => SendError::Rejected(Rejection::AgentBusy),
        })?;
    // The user is waiting: a database failure is theirs to retry, not ours.
    let has_client_key = client_message_id.is_some();
    let how = Commit {
        retry: false,
        urgent: false,
    };
    match store_and_dispatch(myself, state, event, result, client_message_id, how).await {
        Ok((commit, _)) => {
            if let Some(message) = commit
                .iter()
                .flat_map(|commit| &commit.messages)
                .find(|m| m.content.message_type() == crate::state_machine::MessageType::User)
            {
                return Ok(Accepted::Stored(message.clone()));
            }
            // It waits in the running turn (stored with its state).
            let waiting = state.record.state.turn().and_then(|running| {
                running
                    .steering
                    .iter()
                    .chain(&running.queued)
                    .position(|queued| queued.id == turn)
                    .map(|index| Accepted::Waiting {
                        id: turn.0.clone(),
                        position: index + 1,
                        steering: index < running.steering.len(),
                    })
            });
            waiting.ok_or_else(|| SendError::Unavailable("the message was not stored".into()))
        }
        Err(StoreError::Conflict(_)) if has_client_key => Err(SendError::Duplicate),
        Err(e) => Err(SendError::Unavailable(e.to_string())),
    }
}

/// Asks for the summary that a continuation starts from (`POST .../continue` at rest).
async fn summarize(
    myself: &ActorRef<ConvMsg>,
    state: &mut ConversationState,
) -> Result<(), SendError> {
    if starting_blocked(state) {
        return Err(SendError::ShuttingDown);
    }
    let turn = TurnId::new(uuid::Uuid::now_v7().to_string());
    let event = Event::SummaryRequested { turn };
    let result =
        transition(&state.record.state, &state.ctx, event.clone()).map_err(|e| match e {
            InvalidTransition::Rejected(rejection) => SendError::Rejected(rejection),
            // Summarised already: the caller reads it.
            InvalidTransition::Ignored { .. } => SendError::Rejected(Rejection::ContextExhausted),
        })?;
    let how = Commit {
        retry: false,
        urgent: false,
    };
    store_and_dispatch(myself, state, event, result, None, how)
        .await
        .map(|_| ())
        .map_err(|e| SendError::Unavailable(e.to_string()))
}

/// Stores and publishes durable frames outside a transition.
async fn emit_frames(state: &mut ConversationState, frames: Vec<Keyed>) -> Result<bool, String> {
    let plan = commit::plan_frames(&*state.handles.format, &state.record, frames, Utc::now());
    let Some(commit) = &plan.commit else {
        return Ok(true);
    };
    match state.handles.persistence.commit(Arc::clone(commit)).await {
        Ok(()) => {
            commit::apply(&mut state.record, commit);
            for frame in &plan.frames {
                state.handles.hub.publish(&state.record.id, frame.clone());
            }
            Ok(true)
        }
        // Our counters still match the row: the conflict is a repeated dedup key.
        Err(StoreError::Conflict(what)) => {
            match state
                .handles
                .store
                .conversation_by_id(&state.record.id)
                .await
            {
                Ok(Some(row)) if row.next_event_id == state.record.next_event_id => Ok(false),
                _ => Err(format!("conflict: {what}")),
            }
        }
        Err(e) => Err(e.to_string()),
    }
}

/// Applies an event that must not be lost: a database failure is retried until it clears.
async fn apply_internal(
    myself: &ActorRef<ConvMsg>,
    state: &mut ConversationState,
    event: Event,
) -> Result<Applied, ActorProcessingErr> {
    let name = event.name();
    // A cancel (and the abort answer that completes it) goes before other commits.
    let urgent = matches!(event, Event::UserCancel | Event::LlmAborted { .. });
    let result = match transition(&state.record.state, &state.ctx, event.clone()) {
        Ok(result) => result,
        Err(InvalidTransition::Ignored {
            state: kind,
            event,
            reason,
        }) => {
            tracing::debug!(conversation = %state.record.id, state = kind, event, reason, "event ignored");
            return Ok(Applied::Ignored);
        }
        Err(InvalidTransition::Rejected(rejection)) => {
            tracing::warn!(conversation = %state.record.id, event = name, %rejection, "internal event rejected");
            return Ok(Applied::Ignored);
        }
    };
    let (_, stopped) = store_and_dispatch(
        myself,
        state,
        event,
        result,
        None,
        Commit {
            retry: true,
            urgent,
        },
    )
    .await
    .map_err(|e| ActorProcessingErr::from(format!("cannot store the conversation: {e}")))?;
    Ok(Applied::Done { stopped })
}

/// Stores a transition, publishes its frames, then dispatches its effects.
async fn store_and_dispatch(
    myself: &ActorRef<ConvMsg>,
    state: &mut ConversationState,
    event: Event,
    result: crate::state_machine::TransitionResult,
    client_message_id: Option<String>,
    how: Commit,
) -> Result<(Option<Arc<crate::model::ConversationCommit>>, Stopped), StoreError> {
    let kind_before = state.record.state.kind();
    // A turn's span opens before the transition that starts it, so all of it is one trace.
    // An interrupting message starts a turn while another runs: that one ends here.
    let turn_before = state.record.state.turn().map(|turn| turn.id.clone());
    let starts_turn = result
        .new_state
        .turn()
        .is_some_and(|turn| Some(&turn.id) != turn_before.as_ref());
    let replaced = if starts_turn {
        state.turn.replace(Turn::start(&state.record))
    } else {
        None
    };
    // The turn a waiting message's turn follows ended as its messages say (an error, or at
    // rest); any other turn that a new one replaces was interrupted.
    let next_of_queue = result.new_state.turn().is_some_and(|next| {
        state.record.state.turn().is_some_and(|ended| {
            ended
                .queued
                .iter()
                .chain(&ended.steering)
                .any(|waiting| waiting.id == next.id)
        })
    });
    let replaced_as = if !next_of_queue {
        "interrupted"
    } else if result.effects.iter().any(|effect| {
        matches!(
            effect,
            Effect::PersistMessage(crate::state_machine::MessageContent::Error { .. })
        )
    }) {
        "error"
    } else {
        "idle"
    };
    let at = Utc::now();
    // The step goes on the replay log with the commit; the recorder moves on once it is in.
    let mut recorder = state.recorder.clone();
    let step = recorder.record(&state.record.state, &state.ctx, event, &result);
    let mut plan = commit::plan(
        &*state.handles.format,
        &state.record,
        result,
        state.ctx.context_window,
        at,
        client_message_id,
    );
    let mut steps: Vec<_> = step
        .map(|step| step.finish(commit::messages_of(&plan)))
        .into_iter()
        .collect();
    if !starting_blocked(state) {
        plan = continue_ahead(state, plan, at, &mut recorder, &mut steps);
    }
    commit::log_steps(&mut plan, &state.record, steps, at);
    let told = commit::tell_webhooks(&state.handles.webhooks, &state.record, &mut plan, at);
    if let Some(commit) = &plan.commit
        && let Err(error) = store(state, commit, how).await
    {
        if told {
            state.handles.webhooks.not_stored(&commit.deliveries);
        }
        if starts_turn {
            state.turn = replaced; // the turn did not start
        }
        return Err(error);
    }
    state.recorder = recorder;
    if told && let Some(commit) = &plan.commit {
        state.handles.webhooks.stored(&commit.deliveries);
    }
    for frame in &plan.frames {
        state.handles.hub.publish(&state.record.id, frame.clone());
    }
    show_progress(state);
    count(
        state,
        kind_before,
        starts_turn,
        replaced.map(|turn| (turn, replaced_as)),
        &plan.dispatch,
    );
    let stopped = Stopped::of(&plan.dispatch);
    for effect in plan.dispatch {
        super::effects::dispatch(myself, state, effect).await;
    }
    Ok((plan.commit, stopped))
}

/// Stores `commit` and applies it to the actor's record; the messages it stored are kept
/// for the next LLM request, which would otherwise read them back.
async fn store(
    state: &mut ConversationState,
    commit: &Arc<crate::model::ConversationCommit>,
    how: Commit,
) -> Result<(), StoreError> {
    let span = super::turn::commit_span(state.turn.as_ref(), &state.record, commit);
    commit_with_retry(state, commit, how)
        .instrument(span)
        .await?;
    commit::apply(&mut state.record, commit);
    state
        .cancel
        .set_running_turn(state.record.state.turn().map(|turn| &turn.id));
    state.ctx.context_tokens = state.record.usage.context_tokens;
    if !commit.messages.is_empty() {
        if state.unsent.len() >= MAX_UNSENT {
            // Too many to hold: the gateway reads them from the database.
            state.unsent.clear();
        } else {
            // Kept at rest too: a turn's last commit holds the agent's answer, which the
            // next turn's first request would otherwise read back from the database.
            state.unsent.push(Arc::clone(commit));
        }
    }
    Ok(())
}

/// The metrics of a stored transition: turns started and finished, states, retries.
fn count(
    state: &mut ConversationState,
    kind_before: &'static str,
    starts_turn: bool,
    replaced: Option<(Turn, &'static str)>,
    dispatch: &[Effect],
) {
    let metrics = &state.handles.metrics;
    if let Some((turn, outcome)) = replaced {
        turn.finish(metrics, outcome);
    }
    if starts_turn {
        metrics.turn_started();
    } else if !state.record.state.is_busy()
        && let Some(turn) = state.turn.take()
    {
        turn.finish(metrics, state.record.state.kind());
    }
    if kind_before != state.record.state.kind() {
        metrics.conversation_state(Some(kind_before), Some(state.record.state.kind()));
    }
    if dispatch
        .iter()
        .any(|e| matches!(e, Effect::ScheduleRetry { .. }))
    {
        metrics.retry();
    }
}

/// Plans the `Continue` a transition asks for together with that transition, so the turn's
/// next step is stored by the same commit: two whole transitions in order, their frames in
/// order, one round trip to the database instead of a second message and a second commit.
/// The core's matrix is unchanged (`AwaitingLlm` is still stored and published on the way).
fn continue_ahead(
    state: &mut ConversationState,
    mut plan: commit::Plan,
    at: chrono::DateTime<Utc>,
    recorder: &mut crate::replay::Recorder,
    steps: &mut Vec<crate::replay::LoggedStep>,
) -> commit::Plan {
    let Some(index) = plan
        .dispatch
        .iter()
        .position(|effect| matches!(effect, Effect::Continue { .. }))
    else {
        return plan;
    };
    let Effect::Continue { turn } = plan.dispatch.remove(index) else {
        return plan;
    };
    let base = match &plan.commit {
        Some(commit) => commit::Base::from(&state.record).after(commit),
        None => commit::Base::from(&state.record),
    };
    // The core sees the context as it will be once the first transition is stored.
    let stored_tokens = state.ctx.context_tokens;
    state.ctx.context_tokens = base.usage.context_tokens;
    let event = Event::Continue { turn };
    let next = transition(base.state, &state.ctx, event.clone());
    let step = next
        .as_ref()
        .ok()
        .and_then(|next| recorder.record(base.state, &state.ctx, event, next));
    state.ctx.context_tokens = stored_tokens;
    match next {
        Ok(next) => {
            let next = commit::plan(
                &*state.handles.format,
                base,
                next,
                state.ctx.context_window,
                at,
                None,
            );
            if let Some(step) = step {
                steps.push(step.finish(commit::messages_of(&next)));
            }
            plan.then(next)
        }
        // Whatever the actor would have done with the `Continue` message: nothing.
        Err(_) => plan,
    }
}

/// Commits kept for the next LLM request at most (a resting conversation usually keeps one,
/// its last turn's answer, until its actor stops after the idle timeout).
const MAX_UNSENT: usize = 16;

/// How a transition is committed.
#[derive(Clone, Copy, Debug)]
struct Commit {
    /// Retry while the database is unavailable (events that must not be lost).
    retry: bool,
    /// Go before the commits of other conversations (a cancel).
    urgent: bool,
}

async fn commit_with_retry(
    state: &mut ConversationState,
    commit: &Arc<crate::model::ConversationCommit>,
    how: Commit,
) -> Result<(), StoreError> {
    let retry = how.retry;
    let mut delay = Duration::from_millis(100);
    let mut retried = false;
    loop {
        let persistence = &state.handles.persistence;
        let outcome = if how.urgent {
            persistence.commit_urgent(Arc::clone(commit)).await
        } else {
            persistence.commit(Arc::clone(commit)).await
        };
        match outcome {
            Ok(()) => return Ok(()),
            Err(StoreError::Conflict(what)) if retried => {
                // An earlier try may have committed without us hearing it: look.
                match state
                    .handles
                    .store
                    .conversation_by_id(&commit.conversation_id)
                    .await
                {
                    Ok(Some(row))
                        if row.next_sequence_id == commit.next_sequence_id
                            && row.next_event_id == commit.next_event_id =>
                    {
                        return Ok(());
                    }
                    _ => return Err(StoreError::Conflict(what)),
                }
            }
            Err(error) if retry && error.is_unavailable() && !state.stopping => {
                tracing::warn!(conversation = %state.record.id, %error, retry_in_ms = delay.as_millis() as u64, "commit failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
                retried = true;
            }
            Err(error) => return Err(error),
        }
    }
}

/// A sub-agent's state and steps, shown to its parent's clients as a `sub_agent` frame when
/// they change (not durable: `GET /children` has them after a reconnect).
fn show_progress(state: &mut ConversationState) {
    let Some(parent) = &state.record.parent_id else {
        return;
    };
    let kind = state.record.state.kind();
    let steps = state.record.state.turn().map_or_else(
        || state.shown.map_or(0, |(_, steps)| steps),
        |turn| turn.llm_steps,
    );
    if state.shown == Some((kind, steps)) {
        return;
    }
    state.shown = Some((kind, steps));
    let notice = Notice::SubAgent {
        agent_id: &state.record.id,
        state: &state.record.state,
        steps,
        max_steps: state.ctx.limits.max_llm_steps,
    };
    state
        .handles
        .hub
        .publish(parent, state.handles.live(notice));
}
