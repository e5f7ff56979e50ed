//! The sub-agent supervisor: one per spawn_sub_agents call (REQ-BED-008/009).
//!
//! It creates one sub-agent conversation per task (user_initiated = false, with the parent's
//! id), starts them in parallel under itself, and forwards each outcome to the parent. A
//! sub-agent that crashes or stops without a result becomes a failure entry; the core
//! aggregates the entries in task order.
//!
//! Each sub-agent has its own time limit (its task's `timeout_ms` within the configured
//! one). When it passes, the sub-agent's core gets `TimeLimit` and starts its grace turn;
//! when `grace_ms` more pass, `TimeLimit` again ends it as failed. Should the sub-agent not
//! answer even that (it cannot commit), a last deadline reports it failed from here.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio_util::sync::CancellationToken;

use super::Handles;
use super::messages::{ConvMsg, Deadline, ParentLink, SupervisorMsg};
use super::registry::Live;
use crate::model::{ConversationRecord, NewConversation};
use crate::persistence::WriteJob;
use crate::state_machine::{Event, IfBusy, SubAgentOutcome, SubAgentTask, ToolOutcome, TurnId};

#[derive(Debug)]
pub struct SubAgentSupervisor;

pub struct SupervisorArgs {
    pub handles: Arc<Handles>,
    pub parent: ActorRef<ConvMsg>,
    pub parent_record: ConversationRecord,
    pub turn: TurnId,
    pub tool_use_id: String,
    pub tasks: Vec<SubAgentTask>,
    pub cancel: CancellationToken,
}

impl std::fmt::Debug for SupervisorArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SupervisorArgs")
            .field("tasks", &self.tasks.len())
            .finish_non_exhaustive()
    }
}

/// How long a sub-agent's conversation may take to store its task before it is failed.
const HAND_OVER: Duration = Duration::from_secs(60);

struct Agent {
    id: String,
    live: Option<Live>,
    done: bool,
    timeout_ms: u64,
    in_grace: bool,
}

pub struct SupervisorState {
    args: SupervisorArgs,
    /// Its timers and the task that waits for the parent's cancel: ended when it stops, so
    /// a finished spawn leaves no task behind for the length of its deadlines (found by
    /// the soak: live tasks grew by thousands a minute).
    timers: Vec<tokio::task::AbortHandle>,
    agents: Vec<Agent>,
    by_actor: HashMap<ActorId, usize>,
}

impl std::fmt::Debug for SupervisorState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SupervisorState")
            .field("agents", &self.agents.len())
            .finish_non_exhaustive()
    }
}

impl Actor for SubAgentSupervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: SupervisorArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(SupervisorState {
            args,
            timers: Vec::new(),
            agents: Vec::new(),
            by_actor: HashMap::new(),
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let args = &state.args;
        let handles = args.handles.clone();
        let parent = &args.parent_record;
        let now = Utc::now();
        // Create every sub-agent's row first; if that fails, the spawn fails as a tool result.
        let mut created = Vec::with_capacity(args.tasks.len());
        for (index, task) in args.tasks.iter().enumerate() {
            let id = uuid::Uuid::now_v7().to_string();
            let new = NewConversation {
                id: id.clone(),
                tenant_id: parent.tenant_id.clone(),
                slug: format!("{}-sub-{}-{}", parent.slug, index + 1, &id[id.len() - 8..]),
                cwd: parent.cwd.clone(),
                // An agent's conversation runs its agent's model, its sub-agents too (a
                // task's `model` would let the LLM leave it).
                model: match (&parent.agent, &task.model) {
                    (None, Some(model)) => model.clone(),
                    (Some(_), _) | (None, None) => parent.model.clone(),
                },
                system_prompt: None,
                parent_id: Some(parent.id.clone()),
                user_initiated: false,
                require_approval: parent.require_approval.clone(),
                network: parent.network,
                // Each sub-agent gets the parent's budget as its own.
                budget_tokens: parent.budget_tokens,
                // Sub-agents inherit their parent's MCP tools.
                mcp_tools: parent.mcp_tools.as_ref().clone(),
                agent: parent.agent.clone(),
                tools: parent.tools.clone(),
                permissions: parent.permissions.clone(),
                // The client watches the parent: its sub-agents get no client tools.
                client_tools: Vec::new(),
                // Its tool calls ask its parent's hook; it keeps its parent's bounds.
                pre_tool_use: parent.pre_tool_use.as_deref().cloned(),
                bounds: parent.bounds,
                created_at: now,
            };
            if let Err(error) = handles
                .persistence
                .write(WriteJob::CreateConversation(new))
                .await
            {
                let _ = args.parent.cast(ConvMsg::event(Event::ToolComplete {
                    turn: args.turn.clone(),
                    tool_use_id: args.tool_use_id.clone(),
                    outcome: ToolOutcome::failed(format!(
                        "the sub-agents could not be created: {error}"
                    )),
                }));
                myself.stop(None);
                return Ok(());
            }
            created.push(id);
        }
        let _ = args.parent.cast(ConvMsg::event(Event::SubAgentsSpawned {
            turn: args.turn.clone(),
            tool_use_id: args.tool_use_id.clone(),
            agent_ids: created.clone(),
        }));
        let tasks = args.tasks.clone();
        for (index, (id, task)) in created.into_iter().zip(tasks).enumerate() {
            let mut agent = Agent {
                id: id.clone(),
                live: None,
                done: false,
                timeout_ms: task.timeout_ms,
                in_grace: false,
            };
            let grace_ms = handles.settings.sub_agents.grace_ms;
            let last = task.timeout_ms.saturating_add(grace_ms.saturating_mul(2));
            for (after, kind) in [
                (task.timeout_ms, Deadline::Limit),
                (last, Deadline::LastResort),
            ] {
                let timer = myself.send_after(Duration::from_millis(after), move || {
                    SupervisorMsg::Deadline { index, kind }
                });
                state.timers.push(timer.abort_handle());
            }
            match start_agent(&myself, &handles, &id, task.max_steps).await {
                Ok(live) => {
                    state.by_actor.insert(live.actor.get_id(), index);
                    let reply_to = myself.clone();
                    let agent_id = id.clone();
                    let door = live.clone();
                    tokio::spawn(async move {
                        // The task is handed over like any user message, through the
                        // conversation's door, and answered once it is stored.
                        let message = super::registry::UserMessage {
                            text: task.prompt,
                            images: Vec::new(),
                            client_message_id: None,
                            if_busy: IfBusy::Reject,
                        };
                        let failure = match door.send(message, HAND_OVER).await {
                            Ok(Ok(_)) => None,
                            Ok(Err(e)) => Some(e.to_string()),
                            Err(unanswered) => Some(unanswered.to_string()),
                        };
                        if let Some(why) = failure {
                            let _ = reply_to.cast(SupervisorMsg::Report {
                                agent_id,
                                outcome: SubAgentOutcome {
                                    success: false,
                                    result: format!(
                                        "the sub-agent could not start its task: {why}"
                                    ),
                                },
                            });
                        }
                    });
                    agent.live = Some(live);
                }
                Err(why) => {
                    let _ = myself.cast(SupervisorMsg::Report {
                        agent_id: id,
                        outcome: SubAgentOutcome {
                            success: false,
                            result: format!("the sub-agent could not start: {why}"),
                        },
                    });
                }
            }
            state.agents.push(agent);
        }
        let cancel = state.args.cancel.clone();
        let me = myself.clone();
        let waiting = tokio::spawn(async move {
            cancel.cancelled().await;
            let _ = me.cast(SupervisorMsg::Cancelled);
        });
        state.timers.push(waiting.abort_handle());
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            SupervisorMsg::Report { agent_id, outcome } => report(state, &agent_id, outcome),
            SupervisorMsg::Deadline { index, kind } => deadline(state, index, kind),
            SupervisorMsg::GraceStarted { agent_id } => {
                let grace = state.args.handles.settings.sub_agents.grace_ms;
                if let Some(index) = state
                    .agents
                    .iter()
                    .position(|a| a.id == agent_id && !a.done && !a.in_grace)
                {
                    state.agents[index].in_grace = true;
                    let timer = myself.send_after(Duration::from_millis(grace), move || {
                        SupervisorMsg::Deadline {
                            index,
                            kind: Deadline::GraceOver,
                        }
                    });
                    state.timers.push(timer.abort_handle());
                }
            }
            SupervisorMsg::Cancelled => {
                // The parent has moved on; it takes no more reports.
                cancel_unfinished(state);
                for agent in &mut state.agents {
                    agent.done = true;
                }
            }
        }
        if state.agents.iter().all(|a| a.done) {
            myself.stop(None);
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, why) = match event {
            SupervisionEvent::ActorFailed(cell, error) => {
                (cell, format!("the sub-agent crashed: {error}"))
            }
            SupervisionEvent::ActorTerminated(cell, _, reason) => (
                cell,
                format!(
                    "the sub-agent stopped without a result ({})",
                    reason.unwrap_or_else(|| "no reason given".into())
                ),
            ),
            SupervisionEvent::ActorStarted(_) | SupervisionEvent::ProcessGroupChanged(_) => {
                return Ok(());
            }
        };
        if let Some(index) = state.by_actor.remove(&cell.get_id()) {
            let id = state.agents[index].id.clone();
            report(
                state,
                &id,
                SubAgentOutcome {
                    success: false,
                    result: why,
                },
            );
            if state.agents.iter().all(|a| a.done) {
                myself.stop(None);
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        for timer in state.timers.drain(..) {
            timer.abort();
        }
        // ractor kills a stopping actor's children after this returns. Sub-agents must not
        // die mid-turn (their rows would stay busy): unlink them, so that the unfinished ones
        // complete their cancel, and every one rests and idles out like any conversation.
        for agent in &state.agents {
            if let Some(live) = &agent.live {
                live.actor.get_cell().unlink(myself.get_cell());
            }
        }
        Ok(())
    }
}

/// A deadline of sub-agent `index`: at its time limit (unless its grace turn runs already)
/// and at the end of its grace turn its core decides; at the last one, this supervisor.
fn deadline(state: &mut SupervisorState, index: usize, kind: Deadline) {
    let Some(agent) = state.agents.get(index).filter(|agent| !agent.done) else {
        return;
    };
    let timeout_ms = agent.timeout_ms;
    let tell = match kind {
        Deadline::Limit => !agent.in_grace,
        Deadline::GraceOver => true,
        Deadline::LastResort => false,
    };
    if kind != Deadline::LastResort {
        if tell && let Some(live) = &agent.live {
            let _ = live
                .actor
                .cast(ConvMsg::event(Event::TimeLimit { timeout_ms }));
        }
        return;
    }
    if let Some(live) = &agent.live {
        drop(live.cancel_turn());
    }
    let id = agent.id.clone();
    report(
        state,
        &id,
        SubAgentOutcome {
            success: false,
            result: format!(
                "the sub-agent did not submit a result within its time limit of {} s and its grace",
                timeout_ms / 1000
            ),
        },
    );
}

/// Cancels the sub-agents that have not finished, through their cancel path: their running
/// work stops at once and their turns close with synthetic results.
fn cancel_unfinished(state: &SupervisorState) {
    for agent in state.agents.iter().filter(|a| !a.done) {
        if let Some(live) = &agent.live {
            drop(live.cancel_turn());
        }
    }
}

/// Forwards one outcome to the parent, once per sub-agent.
fn report(state: &mut SupervisorState, agent_id: &str, outcome: SubAgentOutcome) {
    let Some(agent) = state
        .agents
        .iter_mut()
        .find(|a| a.id == agent_id && !a.done)
    else {
        return;
    };
    agent.done = true;
    let _ = state
        .args
        .parent
        .cast(ConvMsg::event(Event::SubAgentResult {
            agent_id: agent_id.to_owned(),
            outcome,
        }));
}

async fn start_agent(
    myself: &ActorRef<SupervisorMsg>,
    handles: &Arc<Handles>,
    id: &str,
    max_steps: u32,
) -> Result<Live, String> {
    let link = ParentLink {
        supervisor: myself.clone(),
        agent_id: id.to_owned(),
        max_steps,
    };
    handles
        .registry
        .start_child(handles, id, link)
        .await
        .map_err(|e| e.to_string())
}
