//! A model of the runtime for the property tests: it applies transitions, carries out the
//! effects as a log of persisted messages and a set of outstanding work, and turns random
//! choices into events (well-timed, late, or plain wrong).

use std::path::PathBuf;

use serde_json::json;

use super::*;

/// The client tool of the world's user conversation.
pub const CLIENT_TOOL: &str = "lookup";

/// A random choice of what happens next. Indices pick among outstanding work, modulo its size.
#[derive(Clone, Debug)]
pub enum Op {
    UserMessage,
    /// A user message with `if_busy=interrupt`, sent having seen the running turn (or, when
    /// `stale`, one that has ended since).
    Interrupt {
        stale: bool,
    },
    /// A sub-agent's wall time runs out.
    TimeLimit,
    Cancel,
    Continue,
    LlmText {
        end_turn: bool,
        tokens: u16,
    },
    LlmTools {
        names: Vec<u8>,
    },
    LlmError {
        kind: u8,
        retry_after: Option<u16>,
    },
    AbortAck,
    RetryFires,
    ToolDone {
        ok: bool,
    },
    SpawnAck,
    SubAgentDone {
        pick: u8,
        success: bool,
    },
    Background {
        wake: bool,
    },
    Restart,
    /// The user asks to continue in a new conversation (`POST .../continue`).
    Summarize,
    /// Replays an event of earlier work (a late answer).
    Stale {
        pick: u16,
    },
    /// A message that waits for the turn (`enqueue`) or joins it (`steer`); each one's text
    /// is its own (`m1`, `m2`, ...).
    Wait {
        steer: bool,
    },
    /// The user takes back a waiting message (or, with no waiting one picked, all).
    Dequeue {
        pick: u8,
        all: bool,
    },
}

/// The world the core lives in.
#[derive(Debug)]
pub struct World {
    pub state: ConvState,
    pub ctx: ConvContext,
    /// Every message persisted, in order.
    pub log: Vec<MessageContent>,
    /// Every event delivered so far, for late replays.
    pub delivered: Vec<Event>,
    pending_continue: Option<TurnId>,
    llm_request: Option<LlmRequestTag>,
    retry: Option<LlmRequestTag>,
    abort: Option<LlmRequestTag>,
    tool: Option<(TurnId, String)>,
    spawn: Option<(TurnId, String, usize)>,
    agents: Vec<String>,
    next_id: u64,
}

const KINDS: [ErrorKind; 7] = [
    ErrorKind::Auth,
    ErrorKind::RateLimit,
    ErrorKind::Network,
    ErrorKind::InvalidRequest,
    ErrorKind::Limit,
    ErrorKind::Budget,
    ErrorKind::Unknown,
];

impl World {
    pub fn new(is_sub_agent: bool) -> Self {
        Self {
            state: ConvState::Idle,
            ctx: ConvContext {
                conversation_id: "c".into(),
                working_dir: PathBuf::from("/w"),
                model_id: "m".into(),
                is_sub_agent,
                limits: TurnLimits {
                    max_llm_steps: 4,
                    max_tool_calls: 5,
                    max_sub_agents: 3,
                    sub_agent_max_steps: 4,
                    sub_agent_timeout_ms: 1000,
                    max_queued: 3,
                    max_queued_bytes: 262_144,
                },
                context_window: 1000,
                context_tokens: 0,
                continuation_permille: 900,
                require_approval: Vec::new(),
                mcp_tools: Vec::new(),
                tools: None,
                permissions: Vec::new(),
                // A user conversation's client runs `lookup` (sub-agents have no client
                // tools).
                client_tools: if is_sub_agent {
                    Vec::new()
                } else {
                    vec![CLIENT_TOOL.to_owned()]
                },
            },
            log: Vec::new(),
            delivered: Vec::new(),
            pending_continue: None,
            llm_request: None,
            retry: None,
            abort: None,
            tool: None,
            spawn: None,
            agents: Vec::new(),
            next_id: 0,
        }
    }

    fn fresh(&mut self, prefix: &str) -> String {
        self.next_id += 1;
        format!("{prefix}{}", self.next_id)
    }

    /// Turns a random choice into an event, or `None` when it makes no sense right now.
    pub fn event_for(&mut self, op: &Op) -> Option<Event> {
        Some(match op {
            Op::UserMessage => Event::UserMessage {
                turn: TurnId::new(self.fresh("turn")),
                text: "hello".into(),
                images: vec![],
                if_busy: IfBusy::Reject,
            },
            Op::Interrupt { stale } => Event::UserMessage {
                turn: TurnId::new(self.fresh("turn")),
                text: "instead".into(),
                images: vec![],
                if_busy: IfBusy::Interrupt {
                    running: if *stale {
                        Some(TurnId::new("an-earlier-turn"))
                    } else {
                        self.state.turn().map(|turn| turn.id.clone())
                    },
                },
            },
            Op::TimeLimit => Event::TimeLimit { timeout_ms: 1000 },
            Op::Cancel => Event::UserCancel,
            Op::Summarize => Event::SummaryRequested {
                turn: TurnId::new(self.fresh("turn")),
            },
            Op::Continue => Event::Continue {
                turn: self.pending_continue.clone()?,
            },
            Op::LlmText { end_turn, tokens } => Event::LlmResponse {
                request: self.llm_request.clone()?,
                reply: LlmReply {
                    text: Some("text".into()),
                    tool_uses: vec![],
                    end_turn: *end_turn,
                    usage: Usage {
                        input_tokens: u64::from(*tokens) % 1100,
                        output_tokens: 1,
                    },
                    reasoning: None,
                },
            },
            Op::LlmTools { names } => {
                let request = self.llm_request.clone()?;
                let tool_uses = names.iter().map(|n| self.tool_use(*n)).collect();
                Event::LlmResponse {
                    request,
                    reply: LlmReply {
                        text: None,
                        tool_uses,
                        end_turn: true,
                        usage: Usage::default(),
                        reasoning: None,
                    },
                }
            }
            Op::LlmError { kind, retry_after } => Event::LlmError {
                request: self.llm_request.clone()?,
                error: LlmFailure {
                    kind: KINDS[usize::from(*kind) % KINDS.len()],
                    message: "e".into(),
                    retry_after_ms: retry_after.map(u64::from),
                },
            },
            Op::AbortAck => Event::LlmAborted {
                request: self.abort.clone()?,
            },
            Op::RetryFires => Event::RetryTimeout {
                request: self.retry.clone()?,
            },
            Op::ToolDone { ok } => {
                let (turn, tool_use_id) = self.tool.clone()?;
                Event::ToolComplete {
                    turn,
                    tool_use_id,
                    outcome: ToolOutcome {
                        ok: *ok,
                        output: "out".into(),
                    },
                }
            }
            Op::SpawnAck => {
                let (turn, tool_use_id, count) = self.spawn.clone()?;
                let agent_ids = (0..count).map(|_| self.fresh("agent")).collect();
                Event::SubAgentsSpawned {
                    turn,
                    tool_use_id,
                    agent_ids,
                }
            }
            Op::SubAgentDone { pick, success } => {
                if self.agents.is_empty() {
                    return None;
                }
                let agent_id = self.agents[usize::from(*pick) % self.agents.len()].clone();
                Event::SubAgentResult {
                    agent_id,
                    outcome: SubAgentOutcome {
                        success: *success,
                        result: "r".into(),
                    },
                }
            }
            Op::Background { wake } => Event::BackgroundResult {
                result: BackgroundResult {
                    task_id: self.fresh("task"),
                    tool_name: "bash".into(),
                    ok: true,
                    output: "bg".into(),
                },
                wake: wake.then(|| TurnId::new(self.fresh("turn"))),
            },
            Op::Restart => Event::Interrupted(Interruption::Restart),
            Op::Wait { steer } => {
                let id = self.fresh("turn");
                Event::UserMessage {
                    turn: TurnId::new(id.clone()),
                    text: format!("m{}", self.next_id),
                    images: vec![],
                    if_busy: if *steer {
                        IfBusy::Steer
                    } else {
                        IfBusy::Enqueue
                    },
                }
            }
            Op::Dequeue { pick, all } => {
                let waiting: Vec<TurnId> = self
                    .state
                    .turn()
                    .map(|turn| {
                        turn.steering
                            .iter()
                            .chain(&turn.queued)
                            .map(|q| q.id.clone())
                            .collect()
                    })
                    .unwrap_or_default();
                if *all || waiting.is_empty() {
                    Event::Dequeue { id: None }
                } else {
                    Event::Dequeue {
                        id: Some(waiting[usize::from(*pick) % waiting.len()].clone()),
                    }
                }
            }
            Op::Stale { pick } => {
                if self.delivered.is_empty() {
                    return None;
                }
                self.delivered[usize::from(*pick) % self.delivered.len()].clone()
            }
        })
    }

    fn tool_use(&mut self, pick: u8) -> ToolUse {
        let id = self.fresh("tool");
        let (name, input) = match pick % 9 {
            0 | 1 => ("bash", json!({"command": "true"})),
            2 => ("think", json!({"thoughts": "hm"})),
            3 => (
                SPAWN_SUB_AGENTS,
                json!({"tasks": [{"prompt": "a"}, {"prompt": "b"}]}),
            ),
            4 => (SPAWN_SUB_AGENTS, json!({"tasks": "nope"})),
            5 => (SUBMIT_RESULT, json!({"result": "done"})),
            // A question (refused at once in a sub-agent), and a malformed one.
            6 => (ASK_USER, json!({"question": "which?"})),
            7 => (ASK_USER, json!({"kind": "essay"})),
            // A client tool (in a sub-agent, no tool of its own).
            _ => (CLIENT_TOOL, json!({"q": "x"})),
        };
        ToolUse::new(id, name, input)
    }

    /// Brings the world to rest the way a user would: cancel, then the gateway's abort
    /// answer; again while waiting messages start turns.
    pub fn settle(&mut self) {
        for _ in 0..=self.ctx.limits.max_queued.saturating_add(1) {
            let _ = self.apply(Event::UserCancel);
            if let ConvState::Cancelling { turn } = &self.state {
                let request = LlmRequestTag {
                    turn: turn.id.clone(),
                    step: turn.llm_steps,
                    attempt: 1,
                };
                let _ = self.apply(Event::LlmAborted { request });
            }
            if !self.state.is_busy() {
                return;
            }
        }
    }

    /// Applies `event`; on success carries out the effects. Returns the transition's outcome.
    pub fn apply(&mut self, event: Event) -> Result<TransitionResult, InvalidTransition> {
        let outcome = transition(&self.state, &self.ctx, event.clone());
        self.delivered.push(event);
        if let Ok(result) = &outcome {
            self.state = result.new_state.clone();
            for effect in &result.effects {
                self.carry_out(effect);
            }
            if let ConvState::AwaitingSubAgents { .. } = &self.state {
                self.spawn = None;
                self.agents = self
                    .state
                    .pending_agent_ids()
                    .into_iter()
                    .map(str::to_owned)
                    .collect();
            }
        }
        outcome
    }

    fn carry_out(&mut self, effect: &Effect) {
        match effect {
            Effect::PersistMessage(content) => self.log.push(content.clone()),
            Effect::RecordUsage { usage } => self.ctx.context_tokens = usage.context_tokens(),
            Effect::NotifyRetrying { .. }
            | Effect::WarnContext { .. }
            | Effect::ReportToParent { .. }
            | Effect::GraceTurnStarted => {}
            Effect::Continue { turn } => self.pending_continue = Some(turn.clone()),
            Effect::RequestLlm { request, .. } => {
                self.retry = None;
                self.llm_request = Some(request.clone());
            }
            Effect::AbortLlm { request } => {
                self.llm_request = None;
                self.retry = None;
                self.abort = Some(request.clone());
            }
            Effect::ScheduleRetry { request, .. } => {
                self.llm_request = None;
                self.retry = Some(request.clone());
            }
            Effect::ExecuteTool { turn, tool, .. } => {
                self.tool = Some((turn.clone(), tool.id.clone()))
            }
            Effect::CancelTool { .. } => {
                self.tool = None;
                self.spawn = None;
            }
            Effect::SpawnSubAgents {
                turn,
                tool_use_id,
                tasks,
            } => {
                self.tool = None;
                self.spawn = Some((turn.clone(), tool_use_id.clone(), tasks.len()));
            }
            Effect::StopSubAgents { .. } => self.agents.clear(),
        }
    }
}

/// A random step of a run (the properties', and the replay log's in src/replay).
#[cfg(test)]
pub fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        3 => Just(Op::UserMessage),
        1 => any::<bool>().prop_map(|stale| Op::Interrupt { stale }),
        1 => Just(Op::TimeLimit),
        2 => Just(Op::Cancel),
        4 => Just(Op::Continue),
        3 => (any::<bool>(), any::<u16>()).prop_map(|(end_turn, tokens)| Op::LlmText { end_turn, tokens }),
        4 => proptest::collection::vec(any::<u8>(), 1..4).prop_map(|names| Op::LlmTools { names }),
        2 => (any::<u8>(), proptest::option::of(0u16..40_000)).prop_map(|(kind, retry_after)| Op::LlmError { kind, retry_after }),
        2 => Just(Op::AbortAck),
        2 => Just(Op::RetryFires),
        5 => any::<bool>().prop_map(|ok| Op::ToolDone { ok }),
        2 => Just(Op::SpawnAck),
        3 => (any::<u8>(), any::<bool>()).prop_map(|(pick, success)| Op::SubAgentDone { pick, success }),
        1 => any::<bool>().prop_map(|wake| Op::Background { wake }),
        1 => Just(Op::Restart),
        1 => Just(Op::Summarize),
        2 => any::<u16>().prop_map(|pick| Op::Stale { pick }),
        2 => any::<bool>().prop_map(|steer| Op::Wait { steer }),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(pick, all)| Op::Dequeue { pick, all }),
    ]
}
