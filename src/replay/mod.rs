//! Replay (issue 40): every event a conversation's core receives is kept, with the context it
//! saw, in the commit of the transition it caused; [`replay`] runs the kept events through
//! [`transition`] again and checks every step against what was stored; [`trace`] shows each
//! step's event, the states before and after and the effects.
//!
//! A step is stored compactly (an item of a commit's row of steps, packed by the store):
//! the event as JSON with the fields a message of the same transition holds replaced by that
//! message's sequence id (`"msg"`), the context only where a segment starts (an actor's first
//! step: at a start, a restart, a takeover) or where it changed, the context's token count
//! where it changed, the state before only where a segment starts, and the kind of the state
//! after and a digest of the state after, the effects and the turn it ended. Nothing here
//! does I/O: the store reads the rows and the messages they refer to.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub use crate::model::LoggedStep;
use crate::model::MessageRecord;
use crate::state_machine::{
    ConvContext, ConvState, Event, InvalidTransition, MessageContent, TransitionResult, transition,
};

#[cfg(test)]
mod tests;

/// One step as stored: an item of a row's array of steps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredStep {
    /// The step's number in its conversation, from 1, without gaps (not stored: its row's
    /// `first_step` and its place in the row give it).
    #[serde(default, skip_serializing)]
    pub n: i64,
    /// The event, compact (see [`compact`]).
    pub e: Value,
    /// `context_tokens` as the core saw it, where it differs from the step before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub t: Option<u64>,
    /// The whole context, where a segment starts or the context changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub c: Option<ConvContext>,
    /// The state before the step, where a segment starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub b: Option<ConvState>,
    /// [`digest`] of the transition's result.
    pub d: String,
}

/// A message a step refers to, as stored: its content and an agent message's usage.
#[derive(Clone, Debug, PartialEq)]
pub struct Recalled {
    pub content: MessageContent,
    pub usage: Option<crate::state_machine::Usage>,
}

/// How a replay finds the messages steps refer to, by sequence id.
pub type Messages<'a> = &'a dyn Fn(i64) -> Option<Recalled>;

/// What a conversation's log has been given so far: the number of its next step and the
/// context its last step carried. Advanced only once a commit holding steps is stored, so a
/// failed commit leaves no gap.
#[derive(Clone, Debug)]
pub struct Recorder {
    next: i64,
    ctx: Option<Arc<ConvContext>>,
    tokens: u64,
}

impl Recorder {
    /// A segment starting at step `next` (one after the last stored step): its first step
    /// carries the state before it and the whole context.
    pub fn new(next: i64) -> Self {
        Self {
            next: next.max(1),
            ctx: None,
            tokens: 0,
        }
    }

    /// Records one accepted transition of `before` under `ctx` by `event`: numbers it and
    /// digests its result, before the result is planned into a commit (`None`: it changed
    /// nothing and asked for nothing, and is not kept). `self` moves on; keep a copy to go
    /// back to if the commit fails.
    pub fn record(
        &mut self,
        before: &ConvState,
        ctx: &ConvContext,
        event: Event,
        result: &TransitionResult,
    ) -> Option<PendingStep> {
        // A transition that changes nothing and asks for nothing (a cancel at rest, say)
        // decides nothing a replay could check: it is not kept, and costs no write.
        if result.new_state == *before && result.effects.is_empty() && result.ended.is_none() {
            return None;
        }
        let n = self.next;
        self.next += 1;
        let starts = self.ctx.is_none();
        let changed = self
            .ctx
            .as_deref()
            .is_none_or(|last| !same_settings(last, ctx));
        let c = changed.then(|| {
            let ctx = Arc::new(ctx.clone());
            self.ctx = Some(Arc::clone(&ctx));
            ctx
        });
        let t = (!changed && self.tokens != ctx.context_tokens).then_some(ctx.context_tokens);
        self.tokens = ctx.context_tokens;
        Some(PendingStep {
            n,
            event,
            turn: before.turn().map(|turn| turn.id.clone()),
            t,
            c,
            b: starts.then(|| before.clone()),
            d: digest(result),
        })
    }

    /// The number the next step gets.
    pub fn next(&self) -> i64 {
        self.next
    }
}

/// Whether two contexts are the same but for their token count.
fn same_settings(a: &ConvContext, b: &ConvContext) -> bool {
    let ConvContext {
        conversation_id,
        working_dir,
        model_id,
        is_sub_agent,
        limits,
        context_window,
        context_tokens: _,
        continuation_permille,
        require_approval,
        mcp_tools,
        tools,
        permissions,
        client_tools,
    } = a;
    *conversation_id == b.conversation_id
        && *working_dir == b.working_dir
        && *model_id == b.model_id
        && *is_sub_agent == b.is_sub_agent
        && *limits == b.limits
        && *context_window == b.context_window
        && *continuation_permille == b.continuation_permille
        && *require_approval == b.require_approval
        && *mcp_tools == b.mcp_tools
        && *tools == b.tools
        && *permissions == b.permissions
        && *client_tools == b.client_tools
}

/// A recorded step waiting for the messages of its commit (which its event may refer to).
#[derive(Clone, Debug)]
pub struct PendingStep {
    n: i64,
    event: Event,
    /// The turn running before the step (an event of that turn need not name it).
    turn: Option<crate::state_machine::TurnId>,
    t: Option<u64>,
    c: Option<Arc<ConvContext>>,
    b: Option<ConvState>,
    d: String,
}

impl PendingStep {
    /// The step as stored, its event made compact against `messages` (those its transition
    /// persisted).
    pub fn finish(self, messages: &[MessageRecord]) -> LoggedStep {
        #[derive(Serialize)]
        struct Out<'a> {
            e: Compact<'a>,
            #[serde(skip_serializing_if = "Option::is_none")]
            t: Option<u64>,
            #[serde(skip_serializing_if = "Option::is_none")]
            c: Option<&'a ConvContext>,
            #[serde(skip_serializing_if = "Option::is_none")]
            b: Option<&'a ConvState>,
            d: &'a str,
        }
        let out = Out {
            e: Compact::of(&self.event, self.turn.as_ref(), messages),
            t: self.t,
            c: self.c.as_deref(),
            b: self.b.as_ref(),
            d: &self.d,
        };
        LoggedStep {
            n: self.n,
            json: serde_json::to_string(&out).unwrap_or_default(),
        }
    }
}

/// An event made compact, as [`compact`] makes it, written straight from the event where
/// it has one of a turn's usual shapes (a user message, an LLM reply or a tool's result
/// that a message of the commit holds, a step on), without building the JSON tree
/// [`compact`] builds and cuts: the same bytes (serde_json's maps keep their keys sorted,
/// and so do these), checked by the replay property on every step of its random runs.
#[derive(Serialize)]
#[serde(untagged)]
enum Compact<'a> {
    Tree(Value),
    Direct(Direct<'a>),
}

/// The usual shapes, keys in sorted order.
#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum Direct<'a> {
    Continue {
        #[serde(skip_serializing_if = "Option::is_none")]
        turn: Option<&'a crate::state_machine::TurnId>,
    },
    LlmResponse {
        msg: i64,
        reply: EndTurn,
        request: Request<'a>,
    },
    ToolComplete {
        msg: i64,
        outcome: Empty,
        #[serde(skip_serializing_if = "Option::is_none")]
        turn: Option<&'a crate::state_machine::TurnId>,
    },
    UserMessage {
        #[serde(skip_serializing_if = "Option::is_none")]
        if_busy: Option<&'a crate::state_machine::IfBusy>,
        msg: i64,
        turn: &'a crate::state_machine::TurnId,
    },
}

/// What is left of an LLM reply a message holds.
#[derive(Serialize)]
struct EndTurn {
    end_turn: bool,
}

/// What is left of a tool's outcome a message holds.
#[derive(Serialize)]
struct Empty {}

#[derive(Serialize)]
struct Request<'a> {
    attempt: u32,
    step: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    turn: Option<&'a crate::state_machine::TurnId>,
}

impl<'a> Compact<'a> {
    fn of(
        event: &'a Event,
        running: Option<&crate::state_machine::TurnId>,
        messages: &[MessageRecord],
    ) -> Self {
        // A turn an event names is left out where it is the running one.
        let unless_running =
            |turn: &'a crate::state_machine::TurnId| (running != Some(turn)).then_some(turn);
        // Any other shape goes through the tree, which is right for every event (a new
        // kind of event included).
        let direct = if let Event::Continue { turn } = event {
            Some(Direct::Continue {
                turn: unless_running(turn),
            })
        } else if let Event::UserMessage {
            turn,
            text,
            images,
            if_busy,
        } = event
        {
            find_user(messages, text, images).map(|msg| Direct::UserMessage {
                if_busy: (*if_busy != crate::state_machine::IfBusy::Reject).then_some(if_busy),
                msg,
                turn,
            })
        } else if let Event::LlmResponse { request, reply } = event {
            find_reply(messages, reply).map(|msg| Direct::LlmResponse {
                msg,
                reply: EndTurn {
                    end_turn: reply.end_turn,
                },
                request: Request {
                    attempt: request.attempt,
                    step: request.step,
                    turn: unless_running(&request.turn),
                },
            })
        } else if let Event::ToolComplete {
            turn,
            tool_use_id,
            outcome,
        } = event
        {
            find_result(messages, tool_use_id, outcome).map(|msg| Direct::ToolComplete {
                msg,
                outcome: Empty {},
                turn: unless_running(turn),
            })
        } else {
            None
        };
        match direct {
            Some(direct) => Compact::Direct(direct),
            None => Compact::Tree(compact(event, running, messages)),
        }
    }
}

/// The message of `messages` a user message's event is, by its sequence id.
fn find_user(
    messages: &[MessageRecord],
    text: &str,
    images: &[crate::state_machine::ImageRef],
) -> Option<i64> {
    messages
        .iter()
        .find(|m| {
            matches!(&m.content, MessageContent::User { text: t, images: i } if t == text && i == images)
        })
        .map(|m| m.sequence_id)
}

/// The message of `messages` an LLM reply is, with its usage.
fn find_reply(messages: &[MessageRecord], reply: &crate::state_machine::LlmReply) -> Option<i64> {
    messages
        .iter()
        .find(|m| {
            m.usage == Some(reply.usage)
                && matches!(&m.content, MessageContent::Agent { text, tool_uses, reasoning }
                    if *text == reply.text && *tool_uses == reply.tool_uses && *reasoning == reply.reasoning)
        })
        .map(|m| m.sequence_id)
}

/// The message of `messages` a tool's outcome is.
fn find_result(
    messages: &[MessageRecord],
    tool_use_id: &str,
    outcome: &crate::state_machine::ToolOutcome,
) -> Option<i64> {
    messages
        .iter()
        .find(|m| {
            matches!(&m.content, MessageContent::Tool(r)
                if r.tool_use_id == tool_use_id && r.output == outcome.output && r.ok == outcome.ok)
        })
        .map(|m| m.sequence_id)
}

/// The digest of a transition's result: XXH3-64 of the JSON of its new state, its effects
/// and the turn it ended, in hex. The same decision gives the same digest on any build whose
/// types keep their shape (XXH3 is a fixed algorithm; the digest only tells decisions apart,
/// it guards nothing).
pub fn digest(result: &TransitionResult) -> String {
    thread_local! {
        static BUFFER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let whole = (&result.new_state, &result.effects, &result.ended);
    let hash = BUFFER.with(|buffer| {
        let mut buffer = buffer.borrow_mut();
        buffer.clear();
        // These types always serialise.
        let _ = serde_json::to_writer(&mut *buffer, &whole);
        let hash = xxhash_rust::xxh3::xxh3_64(&buffer);
        // A large result's buffer is not kept.
        if buffer.capacity() > 1 << 20 {
            *buffer = Vec::new();
        }
        hash
    });
    format!("{hash:016x}")
}

/// The event as JSON, compact:
/// - the fields that a message of `messages` holds word for word are replaced by `"msg": <its
///   sequence id>`: a user message's text and images, an LLM reply's text, tool calls,
///   reasoning and usage, a tool's call id, success and output;
/// - the turn of an answer to the running turn's work (`turn` of the state before) and a
///   user message's default `if_busy` (`reject`) are left out.
pub fn compact(
    event: &Event,
    running: Option<&crate::state_machine::TurnId>,
    messages: &[MessageRecord],
) -> Value {
    let mut value = serde_json::to_value(event).unwrap_or(Value::Null);
    let (key, message, fields): (&str, Option<i64>, &[&str]) = match event {
        Event::UserMessage { text, images, .. } => (
            "user_message",
            find_user(messages, text, images),
            &["text", "images"],
        ),
        Event::LlmResponse { reply, .. } => (
            "llm_response",
            find_reply(messages, reply),
            &["text", "tool_uses", "reasoning", "usage"],
        ),
        Event::ToolComplete {
            tool_use_id,
            outcome,
            ..
        } => (
            "tool_complete",
            find_result(messages, tool_use_id, outcome),
            &["tool_use_id", "ok", "output"],
        ),
        Event::UserCancel
        | Event::SummaryRequested { .. }
        | Event::Continue { .. }
        | Event::LlmError { .. }
        | Event::LlmAborted { .. }
        | Event::RetryTimeout { .. }
        | Event::SubAgentsSpawned { .. }
        | Event::SubAgentResult { .. }
        | Event::BackgroundResult { .. }
        | Event::Interrupted(_)
        | Event::TimeLimit { .. }
        | Event::Dequeue { .. } => ("", None, &[]),
    };
    let Some((name, body)) = value
        .as_object_mut()
        .and_then(|object| object.iter_mut().next())
    else {
        return value;
    };
    let Some(body) = body.as_object_mut() else {
        return value;
    };
    // The running turn, where the event names it.
    if let Some(running) = running {
        let tagged = match name.as_str() {
            "continue" | "tool_complete" | "sub_agents_spawned" => Some(&mut *body),
            "llm_response" | "llm_error" | "llm_aborted" | "retry_timeout" => {
                body.get_mut("request").and_then(Value::as_object_mut)
            }
            _ => None,
        };
        if let Some(tagged) = tagged
            && tagged.get("turn").and_then(Value::as_str) == Some(running.0.as_str())
        {
            tagged.remove("turn");
        }
    }
    if name == "user_message" && body.get("if_busy").and_then(Value::as_str) == Some("reject") {
        body.remove("if_busy");
    }
    let Some(message) = message else {
        return value;
    };
    let nested = match key {
        "llm_response" => Some("reply"),
        "tool_complete" => Some("outcome"),
        _ => None,
    };
    for field in fields {
        let inner = match (nested, *field) {
            // The call's id is the event's own; the rest are the outcome's or the reply's.
            (_, "tool_use_id") | (None, _) => Some(&mut *body),
            (Some(name), _) => body.get_mut(name).and_then(Value::as_object_mut),
        };
        if let Some(inner) = inner {
            inner.remove(*field);
        }
    }
    body.insert("msg".into(), Value::from(message));
    value
}

/// The event a compact one stands for: its message fields read back from `message`, the
/// running turn (`running`, the state before's) where it was left out.
pub fn expand(
    mut value: Value,
    running: Option<&crate::state_machine::TurnId>,
    message: Messages<'_>,
) -> Result<Event, String> {
    let Some((key, body)) = value
        .as_object_mut()
        .and_then(|object| object.iter_mut().next())
    else {
        // A unit event (`"user_cancel"`).
        return serde_json::from_value(value).map_err(|e| format!("an event does not read: {e}"));
    };
    if let Some(body) = body.as_object_mut() {
        let turn = || running.map(|turn| Value::String(turn.0.clone()));
        match key.as_str() {
            "continue" | "tool_complete" | "sub_agents_spawned" => {
                if !body.contains_key("turn")
                    && let Some(turn) = turn()
                {
                    body.insert("turn".into(), turn);
                }
            }
            "llm_response" | "llm_error" | "llm_aborted" | "retry_timeout" => {
                if let Some(request) = body.get_mut("request").and_then(Value::as_object_mut)
                    && !request.contains_key("turn")
                    && let Some(turn) = turn()
                {
                    request.insert("turn".into(), turn);
                }
            }
            "user_message" => {
                body.entry("if_busy")
                    .or_insert_with(|| Value::String("reject".into()));
            }
            _ => {}
        }
        if let Some(seq) = body.remove("msg") {
            let seq = seq.as_i64().ok_or("a message reference is not a number")?;
            let recalled = message(seq).ok_or_else(|| format!("message {seq} is gone"))?;
            fill(key, body, recalled)?;
        }
    }
    serde_json::from_value(value).map_err(|e| format!("an event does not read: {e}"))
}

/// Puts a message's fields back into the body of a compact event.
fn fill(key: &str, body: &mut Map<String, Value>, recalled: Recalled) -> Result<(), String> {
    match (key, recalled.content) {
        ("user_message", MessageContent::User { text, images }) => {
            body.insert("text".into(), Value::String(text));
            body.insert("images".into(), to(&images));
        }
        (
            "llm_response",
            MessageContent::Agent {
                text,
                tool_uses,
                reasoning,
            },
        ) => {
            let reply = body
                .get_mut("reply")
                .and_then(Value::as_object_mut)
                .ok_or("an LLM reply without its body")?;
            reply.insert("text".into(), to(&text));
            reply.insert("tool_uses".into(), to(&tool_uses));
            reply.insert("reasoning".into(), to(&reasoning));
            reply.insert("usage".into(), to(&recalled.usage.unwrap_or_default()));
        }
        ("tool_complete", MessageContent::Tool(result)) => {
            body.insert("tool_use_id".into(), Value::String(result.tool_use_id));
            let outcome = body
                .get_mut("outcome")
                .and_then(Value::as_object_mut)
                .ok_or("a tool outcome without its body")?;
            outcome.insert("ok".into(), Value::Bool(result.ok));
            outcome.insert("output".into(), Value::String(result.output));
        }
        (key, content) => {
            return Err(format!(
                "a {key} event refers to a {} message",
                content.message_type().as_str()
            ));
        }
    }
    Ok(())
}

/// A value as JSON (the types here always serialise).
fn to<T: Serialize>(value: &T) -> Value {
    serde_json::to_value(value).unwrap_or(Value::Null)
}

/// How a replay decides: [`transition`], or (a test's switch) a changed decision.
pub type Decide =
    fn(&ConvState, &ConvContext, Event) -> Result<TransitionResult, InvalidTransition>;

/// The core's decisions, as they are.
pub fn decide(
    state: &ConvState,
    ctx: &ConvContext,
    event: Event,
) -> Result<TransitionResult, InvalidTransition> {
    transition(state, ctx, event)
}

/// A deliberately changed decision, for the test that replay finds one (the hidden
/// `bedrock replay --test-changed-decision`): every tool result is stored as the opposite of
/// what it was.
pub fn changed_decision(
    state: &ConvState,
    ctx: &ConvContext,
    event: Event,
) -> Result<TransitionResult, InvalidTransition> {
    let mut result = transition(state, ctx, event)?;
    for effect in &mut result.effects {
        if let crate::state_machine::Effect::PersistMessage(MessageContent::Tool(tool)) = effect {
            tool.ok = !tool.ok;
        }
    }
    Ok(result)
}

/// Where a replay found a step that does not decide as it did.
#[derive(Clone, Debug, Serialize)]
pub struct Divergence {
    pub step: i64,
    /// The event as stored (compact).
    pub event: Value,
    pub reason: String,
    /// The stored decision's digest.
    pub stored: Side,
    /// The replayed one, with the state and the effects themselves.
    pub replayed: Option<Replayed>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Side {
    pub digest: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Replayed {
    pub state: String,
    pub digest: String,
    pub new_state: Value,
    pub effects: Value,
}

/// What a replay of one conversation found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Checked {
    /// Steps re-run and found the same.
    pub steps: u64,
    /// Steps before the first retained segment start (retention removed where they began).
    pub skipped: u64,
    pub divergence: Option<Divergence>,
}

/// One step of a trace: what the core was given, what it held before and after, and what it
/// asked for.
#[derive(Clone, Debug, Serialize)]
pub struct TraceStep {
    pub step: i64,
    pub at: i64,
    pub event: Value,
    pub state_before: Value,
    pub state_after: Value,
    pub effects: Value,
    /// Whether the replayed decision matches the stored digest.
    pub matches: bool,
}

/// A stored row of steps: their time (ms) and the steps.
#[derive(Clone, Debug)]
pub struct StepRow {
    pub at: i64,
    pub steps: Vec<StoredStep>,
}

impl StepRow {
    /// A row as stored: its steps' JSON array, the first numbered `first_step`.
    pub fn parse(first_step: i64, at: i64, json: &str) -> Result<StepRow, String> {
        let mut steps: Vec<StoredStep> =
            serde_json::from_str(json).map_err(|e| format!("steps do not read: {e}"))?;
        for (step, n) in steps.iter_mut().zip(first_step..) {
            step.n = n;
        }
        Ok(StepRow { at, steps })
    }
}

/// Whether a replay goes on after a step its visitor saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Visit {
    Continue,
    Stop,
}

/// Re-runs a conversation's steps (rows in order) through `decide`, comparing each with what
/// was stored; stops at the first divergence. `visit` sees each step re-run (for a trace).
pub fn replay(
    rows: &[StepRow],
    message: Messages<'_>,
    decide: Decide,
    mut visit: impl FnMut(&StoredStep, i64, &ConvState, &TransitionResult, bool) -> Visit,
) -> Checked {
    let mut checked = Checked::default();
    let mut state: Option<ConvState> = None;
    let mut ctx: Option<ConvContext> = None;
    let mut expected = None::<i64>;
    for row in rows {
        for step in &row.steps {
            if let Some(b) = &step.b {
                state = Some(b.clone());
            }
            if let Some(c) = &step.c {
                ctx = Some(c.clone());
            }
            let (Some(before), Some(context)) = (state.as_mut(), ctx.as_mut()) else {
                checked.skipped += 1;
                continue;
            };
            let diverged = |reason: String, replayed: Option<Replayed>| Divergence {
                step: step.n,
                event: step.e.clone(),
                reason,
                stored: Side {
                    digest: step.d.clone(),
                },
                replayed,
            };
            // A gap (retention removed a row between two kept ones): what follows it is re-run
            // from the next segment's start.
            if expected.is_some_and(|n| n != step.n) && step.b.is_none() {
                state = None;
                expected = None;
                checked.skipped += 1;
                continue;
            }
            expected = Some(step.n + 1);
            if let Some(t) = step.t {
                context.context_tokens = t;
            }
            let running = before.turn().map(|turn| turn.id.clone());
            let event = match expand(step.e.clone(), running.as_ref(), message) {
                Ok(event) => event,
                Err(reason) => {
                    checked.divergence = Some(diverged(reason, None));
                    return checked;
                }
            };
            let result = match decide(before, context, event) {
                Ok(result) => result,
                Err(error) => {
                    checked.divergence = Some(diverged(
                        format!("the event is not accepted now: {error}"),
                        None,
                    ));
                    return checked;
                }
            };
            let d = digest(&result);
            let same = d == step.d;
            let next = visit(step, row.at, before, &result, same);
            if !same {
                checked.divergence = Some(diverged(
                    "the decision differs".into(),
                    Some(Replayed {
                        state: result.new_state.kind().to_owned(),
                        digest: d,
                        new_state: serde_json::to_value(&result.new_state).unwrap_or_default(),
                        effects: serde_json::to_value(&result.effects).unwrap_or_default(),
                    }),
                ));
                return checked;
            }
            checked.steps += 1;
            *before = result.new_state;
            if next == Visit::Stop {
                return checked;
            }
        }
    }
    checked
}

/// A page of a trace.
#[derive(Clone, Debug)]
pub struct TracePage {
    pub steps: Vec<TraceStep>,
    /// More steps follow.
    pub more: bool,
    /// Steps that could not be re-run (retention cut off the start of their segment).
    pub skipped: u64,
    /// Where this build decides differently (or cannot read a step): the trace ends there.
    pub divergence: Option<Divergence>,
}

/// The JSON of a page's steps stops growing past this many bytes (the page ends early, with
/// more to follow): large states (a full queue) make large steps.
pub const TRACE_PAGE_BYTES: usize = 4 << 20;

/// The trace of a conversation from step `after` (exclusive), at most `limit` steps and
/// about [`TRACE_PAGE_BYTES`] of JSON.
pub fn trace(rows: &[StepRow], message: Messages<'_>, after: i64, limit: usize) -> TracePage {
    let mut page = Vec::new();
    let mut more = false;
    let mut bytes = 0usize;
    // Nothing after the page is re-run: a page costs the steps up to its end.
    let checked = replay(rows, message, decide, |step, at, before, result, same| {
        if step.n <= after {
            return Visit::Continue;
        }
        if page.len() == limit || bytes > TRACE_PAGE_BYTES {
            more = true;
            return Visit::Stop;
        }
        let traced = TraceStep {
            step: step.n,
            at,
            event: step.e.clone(),
            state_before: serde_json::to_value(before).unwrap_or_default(),
            state_after: serde_json::to_value(&result.new_state).unwrap_or_default(),
            effects: serde_json::to_value(&result.effects).unwrap_or_default(),
            matches: same,
        };
        bytes = bytes.saturating_add(
            [&traced.state_before, &traced.state_after, &traced.effects]
                .iter()
                .map(|value| serde_json::to_vec(value).map_or(0, |v| v.len()))
                .sum::<usize>(),
        );
        page.push(traced);
        Visit::Continue
    });
    TracePage {
        steps: page,
        more,
        skipped: checked.skipped,
        divergence: checked.divergence,
    }
}

/// A stored event's kind and the sequence id of the message it refers to, if any.
pub fn event_kind(event: &Value) -> (String, Option<i64>) {
    match event {
        Value::String(kind) => (kind.clone(), None),
        Value::Object(object) => object.iter().next().map_or_else(
            || (String::new(), None),
            |(kind, body)| (kind.clone(), body.get("msg").and_then(Value::as_i64)),
        ),
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::Array(_) => (String::new(), None),
    }
}

/// The sequence ids of the messages a row's steps refer to.
pub fn referenced(rows: &[StepRow]) -> Vec<i64> {
    let mut seqs: Vec<i64> = rows
        .iter()
        .flat_map(|row| &row.steps)
        .filter_map(|step| {
            step.e
                .as_object()
                .and_then(|o| o.values().next())
                .and_then(|body| body.get("msg"))
                .and_then(Value::as_i64)
        })
        .collect();
    seqs.sort_unstable();
    seqs.dedup();
    seqs
}
