//! Turns one transition into one commit: the new state, the messages with their sequence
//! ids, and the durable frames with their event ids, all numbered from the conversation's
//! counters with no gaps. Used by the conversation actor and by restart recovery.

use std::sync::Arc;

use chrono::{DateTime, SubsecRound as _, Utc};
use uuid::Uuid;

use crate::hub::Frame;
use crate::model::{
    ConversationCommit, ConversationRecord, EventRecord, MessageRecord, StoredFrame, UsageTotals,
};
use crate::notice::{Encode, Keyed, Notice};
use crate::state_machine::{ConvState, Effect, MessageContent, TransitionResult, TurnEnd, Usage};

/// What a transition writes, and what is done after the commit.
#[derive(Debug)]
pub struct Plan {
    /// `None` when the transition changed nothing that is stored. Shared: the persistence
    /// actor writes it while the conversation keeps it to apply once it is stored.
    pub commit: Option<Arc<ConversationCommit>>,
    /// Durable frames to publish once committed, in event-id order.
    pub frames: Vec<Arc<Frame>>,
    /// Effects to carry out after the commit.
    pub dispatch: Vec<Effect>,
    /// The turns the transitions ended (what the tenant's webhooks are told).
    pub ended: Vec<TurnEnd>,
}

/// What a plan numbers from: a conversation as stored, or as it will be once the commits
/// before it are stored.
#[derive(Clone, Copy, Debug)]
pub struct Base<'a> {
    pub id: &'a str,
    pub state: &'a ConvState,
    pub usage: UsageTotals,
    pub next_sequence_id: i64,
    pub next_event_id: i64,
    pub lease: Option<i64>,
}

impl<'a> From<&'a ConversationRecord> for Base<'a> {
    fn from(conv: &'a ConversationRecord) -> Self {
        Base {
            id: &conv.id,
            state: &conv.state,
            usage: conv.usage,
            next_sequence_id: conv.next_sequence_id,
            next_event_id: conv.next_event_id,
            lease: conv.lease,
        }
    }
}

impl<'a> Base<'a> {
    /// The conversation as it is once `commit` (planned from `self`) is stored.
    pub fn after(self, commit: &'a ConversationCommit) -> Base<'a> {
        Base {
            id: self.id,
            state: commit.state.as_ref().unwrap_or(self.state),
            usage: commit.usage.unwrap_or(self.usage),
            next_sequence_id: commit.next_sequence_id,
            next_event_id: commit.next_event_id,
            lease: commit.lease,
        }
    }
}

impl Plan {
    /// This plan followed by `next`, planned from [`Base::after`] this one's commit: one
    /// commit holding both transitions (each whole, in order), their frames in order, then
    /// the effects of both.
    pub fn then(self, next: Plan) -> Plan {
        let commit = match (self.commit, next.commit) {
            (Some(first), Some(second)) => {
                let first = Arc::unwrap_or_clone(first);
                let second = Arc::unwrap_or_clone(second);
                let mut messages = first.messages;
                messages.extend(second.messages);
                let mut events = first.events;
                events.extend(second.events);
                Some(Arc::new(ConversationCommit {
                    conversation_id: first.conversation_id,
                    state: second.state.or(first.state),
                    messages,
                    events,
                    usage: second.usage.or(first.usage),
                    expected_next_sequence_id: first.expected_next_sequence_id,
                    expected_next_event_id: first.expected_next_event_id,
                    next_sequence_id: second.next_sequence_id,
                    next_event_id: second.next_event_id,
                    at: second.at,
                    lease: first.lease,
                    deliveries: [first.deliveries, second.deliveries].concat(),
                    steps: [first.steps, second.steps].concat(),
                }))
            }
            (first, second) => first.or(second),
        };
        let mut frames = self.frames;
        frames.extend(next.frames);
        let mut dispatch = self.dispatch;
        dispatch.extend(next.dispatch);
        let mut ended = self.ended;
        ended.extend(next.ended);
        Plan {
            commit,
            frames,
            dispatch,
            ended,
        }
    }
}

/// The messages `plan` stores (those its steps' events may refer to).
pub fn messages_of(plan: &Plan) -> &[MessageRecord] {
    plan.commit
        .as_deref()
        .map_or(&[][..], |commit| commit.messages.as_slice())
}

/// Puts the steps of `plan`'s transitions (the replay log) into its commit; a transition that
/// changed nothing else is committed for its step alone.
pub fn log_steps(
    plan: &mut Plan,
    record: &ConversationRecord,
    steps: Vec<crate::replay::LoggedStep>,
    at: DateTime<Utc>,
) {
    if steps.is_empty() {
        return;
    }
    let commit = plan.commit.get_or_insert_with(|| {
        Arc::new(ConversationCommit {
            conversation_id: record.id.clone(),
            state: None,
            messages: Vec::new(),
            events: Vec::new(),
            usage: None,
            expected_next_sequence_id: record.next_sequence_id,
            expected_next_event_id: record.next_event_id,
            next_sequence_id: record.next_sequence_id,
            next_event_id: record.next_event_id,
            at: at.trunc_subsecs(6),
            lease: record.lease,
            deliveries: Vec::new(),
            steps: Vec::new(),
        })
    });
    Arc::make_mut(commit).steps = steps;
}

/// The deliveries of the events of the turns `plan` ends, written with its commit, for a
/// top-level conversation of a tenant with webhooks. Whether there were any: once the commit
/// is stored (or not), `webhooks` is told ([`Subscribers::stored`]).
///
/// [`Subscribers::stored`]: crate::webhooks::Subscribers::stored
pub fn tell_webhooks(
    webhooks: &crate::webhooks::Subscribers,
    record: &ConversationRecord,
    plan: &mut Plan,
    at: DateTime<Utc>,
) -> bool {
    if plan.ended.is_empty() || record.parent_id.is_some() || !webhooks.has(&record.tenant_id) {
        return false;
    }
    let Some(commit) = plan.commit.as_mut() else {
        return false;
    };
    let commit = Arc::make_mut(commit);
    let event_id = commit.next_event_id - 1;
    let events = plan
        .ended
        .iter()
        .flat_map(|end| {
            crate::webhooks::turn_events(&record.tenant_id, &record.id, end, event_id, at)
        })
        .collect();
    commit.deliveries.extend(webhooks.deliveries(events));
    !commit.deliveries.is_empty()
}

/// Numbers the effects of `result` from `base`'s counters.
pub fn plan<'a>(
    format: &dyn Encode,
    base: impl Into<Base<'a>>,
    result: TransitionResult,
    context_window: u64,
    at: DateTime<Utc>,
    client_message_id: Option<String>,
) -> Plan {
    // As the databases keep it: a message sent live and the same message read back are the
    // same JSON.
    let at = at.trunc_subsecs(6);
    let conv = base.into();
    let mut next_seq = conv.next_sequence_id;
    let next_event = conv.next_event_id;
    let mut messages = Vec::new();
    let mut events = Vec::new();
    let mut dispatch = Vec::new();
    let mut usage_totals = None;
    let mut pending_usage: Option<Usage> = None;
    let mut client_key = client_message_id;

    let mut frames = Numbered {
        format,
        conversation_id: conv.id,
        next: next_event,
        events: &mut events,
        at,
    };
    for effect in result.effects {
        match effect {
            Effect::PersistMessage(content) => {
                // An LLM response's usage belongs to the agent message it produced; a client's
                // idempotency key to the user message it sent.
                let usage = matches!(content, MessageContent::Agent { .. })
                    .then(|| pending_usage.take())
                    .flatten();
                let client_message_id = matches!(content, MessageContent::User { .. })
                    .then(|| client_key.take())
                    .flatten();
                let message = MessageRecord {
                    id: Uuid::now_v7().to_string(),
                    conversation_id: conv.id.to_owned(),
                    sequence_id: next_seq,
                    content,
                    usage,
                    client_message_id,
                    created_at: at,
                };
                next_seq += 1;
                frames.push(Notice::Message {
                    message: &message,
                    context_window,
                });
                messages.push(message);
            }
            Effect::RecordUsage { usage } => {
                pending_usage = Some(usage);
                usage_totals = Some(usage_totals.unwrap_or(conv.usage).plus(usage));
            }
            Effect::NotifyRetrying {
                attempt,
                delay_ms,
                error_kind,
            } => frames.push(Notice::Retrying {
                attempt,
                delay_ms,
                error_kind,
            }),
            Effect::WarnContext {
                context_tokens,
                context_window,
                ratio,
            } => frames.push(Notice::ContextWarning {
                context_tokens,
                context_window,
                ratio,
            }),
            other @ (Effect::Continue { .. }
            | Effect::RequestLlm { .. }
            | Effect::AbortLlm { .. }
            | Effect::ScheduleRetry { .. }
            | Effect::ExecuteTool { .. }
            | Effect::CancelTool { .. }
            | Effect::SpawnSubAgents { .. }
            | Effect::StopSubAgents { .. }
            | Effect::ReportToParent { .. }
            | Effect::GraceTurnStarted) => dispatch.push(other),
        }
    }
    let state_changed = result.new_state != *conv.state;
    if !format.same_state(conv.state, &result.new_state) {
        frames.push(Notice::State(&result.new_state));
    }
    let next_event = frames.next;
    let frames = events.iter().map(frame_of).collect();
    let commit =
        (state_changed || !messages.is_empty() || !events.is_empty() || usage_totals.is_some())
            .then(|| {
                Arc::new(ConversationCommit {
                    conversation_id: conv.id.to_owned(),
                    state: state_changed.then(|| result.new_state.clone()),
                    messages,
                    events,
                    usage: usage_totals,
                    expected_next_sequence_id: conv.next_sequence_id,
                    expected_next_event_id: conv.next_event_id,
                    next_sequence_id: next_seq,
                    next_event_id: next_event,
                    at,
                    lease: conv.lease,
                    deliveries: Vec::new(),
                    steps: Vec::new(),
                })
            });
    Plan {
        commit,
        frames,
        dispatch,
        ended: result.ended.into_iter().collect(),
    }
}

/// Durable frames numbered on from a conversation's counter, each made into JSON once, for
/// the store and the clients alike.
struct Numbered<'e> {
    format: &'e dyn Encode,
    conversation_id: &'e str,
    next: i64,
    events: &'e mut Vec<EventRecord>,
    at: DateTime<Utc>,
}

impl Numbered<'_> {
    fn push(&mut self, notice: Notice<'_>) {
        self.push_keyed(notice, None);
    }

    fn push_keyed(&mut self, notice: Notice<'_>, dedup_key: Option<String>) {
        let event_id = self.next;
        self.next += 1;
        let stored = match notice {
            Notice::Message { message, .. } => StoredFrame::Message {
                sequence_id: message.sequence_id,
            },
            Notice::State(state) => StoredFrame::State(self.format.state(state).into()),
            Notice::Retrying { .. }
            | Notice::ContextWarning { .. }
            | Notice::SystemEvent(_)
            | Notice::ClientRequest { .. }
            | Notice::ClientRequestResolved { .. }
            | Notice::ClientToolCall { .. }
            | Notice::ClientToolResolved { .. }
            | Notice::SubAgent { .. }
            | Notice::ToolProgress { .. }
            | Notice::Delta { .. } => StoredFrame::Whole,
        };
        let frame = self.format.frame(notice, Some(event_id));
        self.events.push(EventRecord {
            conversation_id: self.conversation_id.to_owned(),
            event_id,
            event_type: frame.kind.to_owned(),
            payload: frame.json.into(),
            stored,
            dedup_key,
            created_at: self.at,
        });
    }
}

/// The frame clients get for a stored event.
fn frame_of(event: &EventRecord) -> Arc<Frame> {
    Arc::new(Frame::new(
        event.event_type.clone(),
        Some(event.event_id),
        event.payload.clone(),
    ))
}

/// A commit of durable frames alone (client requests, system events), numbered from `conv`'s
/// counters.
pub fn plan_frames(
    format: &dyn Encode,
    conv: &ConversationRecord,
    notices: Vec<Keyed>,
    at: DateTime<Utc>,
) -> Plan {
    let at = at.trunc_subsecs(6);
    let mut events = Vec::with_capacity(notices.len());
    let mut numbered = Numbered {
        format,
        conversation_id: &conv.id,
        next: conv.next_event_id,
        events: &mut events,
        at,
    };
    for keyed in notices {
        numbered.push_keyed(keyed.notice.notice(), keyed.dedup_key);
    }
    let next_event = numbered.next;
    let frames = events.iter().map(frame_of).collect();
    Plan {
        commit: (!events.is_empty()).then(|| {
            Arc::new(ConversationCommit {
                conversation_id: conv.id.clone(),
                state: None,
                messages: Vec::new(),
                events,
                usage: None,
                expected_next_sequence_id: conv.next_sequence_id,
                expected_next_event_id: conv.next_event_id,
                next_sequence_id: conv.next_sequence_id,
                next_event_id: next_event,
                at,
                lease: conv.lease,
                deliveries: Vec::new(),
                steps: Vec::new(),
            })
        }),
        frames,
        dispatch: Vec::new(),
        ended: Vec::new(),
    }
}

/// Brings the in-memory record up to date after `commit` was stored.
pub fn apply(conv: &mut ConversationRecord, commit: &ConversationCommit) {
    if let Some(state) = &commit.state {
        conv.state = state.clone();
    }
    if let Some(usage) = commit.usage {
        conv.usage = usage;
    }
    conv.next_sequence_id = commit.next_sequence_id;
    conv.next_event_id = commit.next_event_id;
    conv.updated_at = commit.at;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state_machine::{ConvContext, Event, IfBusy, TurnId, transition};
    use chrono::TimeZone as _;

    fn record(state: ConvState) -> ConversationRecord {
        let at = Utc
            .with_ymd_and_hms(2026, 1, 1, 0, 0, 0)
            .single()
            .expect("a time");
        ConversationRecord {
            id: "c".into(),
            tenant_id: "t".into(),
            slug: "c".into(),
            cwd: "/w".into(),
            model: "m".into(),
            system_prompt: None,
            parent_id: None,
            user_initiated: true,
            require_approval: Vec::new(),
            network: false,
            state,
            archived: false,
            usage: UsageTotals::default(),
            next_sequence_id: 7,
            next_event_id: 20,
            created_at: at,
            updated_at: at,
            lease: None,
            forked_from: None,
            budget_tokens: None,
            continued_from: None,
            mcp_tools: Default::default(),
            agent: None,
            tools: None,
            permissions: Vec::new(),
            client_tools: Default::default(),
            pre_tool_use: None,
            bounds: Default::default(),
        }
    }

    fn ctx() -> ConvContext {
        ConvContext {
            conversation_id: "c".into(),
            working_dir: "/w".into(),
            model_id: "m".into(),
            is_sub_agent: false,
            limits: Default::default(),
            context_window: 0,
            context_tokens: 0,
            continuation_permille: 0,
            require_approval: Vec::new(),
            mcp_tools: Vec::new(),
            tools: None,
            permissions: Vec::new(),
            client_tools: Vec::new(),
        }
    }

    /// The runtime stores a transition and the `Continue` it asks for in one commit: both
    /// whole and in order, numbered on from the conversation's counters with no gap, as if
    /// committed one after the other (REQ-BED-007).
    #[test]
    fn a_transition_and_its_continue_make_one_commit() {
        let conv = record(ConvState::Idle);
        let at = conv.created_at;
        let turn = TurnId::new("t1");
        let event = Event::UserMessage {
            turn: turn.clone(),
            text: "hi".into(),
            images: Vec::new(),
            if_busy: IfBusy::Reject,
        };
        let first = transition(&conv.state, &ctx(), event).expect("accepted");
        let first = plan(&crate::wire::Frames, &conv, first, 0, at, None);
        assert!(
            matches!(first.dispatch.as_slice(), [Effect::Continue { .. }]),
            "{:?}",
            first.dispatch
        );
        let stored = first.commit.clone().expect("a commit");
        let base = Base::from(&conv).after(&stored);
        assert!(matches!(base.state, ConvState::AwaitingLlm { .. }));
        let second = transition(base.state, &ctx(), Event::Continue { turn }).expect("next");
        let second = plan(&crate::wire::Frames, base, second, 0, at, None);
        let (first_events, second_events) = (first.frames.len(), second.frames.len());

        let both = Plan {
            dispatch: Vec::new(),
            ..first
        }
        .then(second);
        let commit = both.commit.expect("one commit");
        assert_eq!(
            (
                commit.expected_next_sequence_id,
                commit.expected_next_event_id
            ),
            (7, 20)
        );
        let sequence: Vec<i64> = commit.messages.iter().map(|m| m.sequence_id).collect();
        assert_eq!(sequence, [7]);
        assert_eq!(commit.next_sequence_id, 8);
        let events: Vec<i64> = commit.events.iter().map(|e| e.event_id).collect();
        let expected: Vec<i64> = (20..20 + (first_events + second_events) as i64).collect();
        assert_eq!(events, expected);
        assert_eq!(commit.next_event_id, 20 + events.len() as i64);
        let states: Vec<String> = commit
            .events
            .iter()
            .filter(|e| e.event_type == "state")
            .map(|e| {
                let payload: serde_json::Value =
                    serde_json::from_str(&e.payload).expect("a frame is JSON");
                payload["state"]["kind"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect();
        assert_eq!(states, ["awaiting_llm", "llm_requesting"]);
        assert!(matches!(
            commit.state,
            Some(ConvState::LlmRequesting { .. })
        ));
        assert_eq!(both.frames.len(), events.len());
        assert!(
            matches!(both.dispatch.as_slice(), [Effect::RequestLlm { .. }]),
            "{:?}",
            both.dispatch
        );
    }
}
