//! Domain records shared by the store, the runtime and the API: what a conversation, a
//! message and a durable frame are, independent of how they are stored or sent.

use chrono::{DateTime, Utc};

use crate::state_machine::{ConvState, MessageContent, PermissionRule, Usage};

/// A tenant: the owner of keys, conversations and everything below them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tenant {
    pub id: String,
    pub name: String,
}

/// Token totals of a conversation (REQ-BED-012).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UsageTotals {
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// What the conversation occupied of the context window after its last LLM response.
    pub context_tokens: u64,
}

impl UsageTotals {
    /// The totals after one more LLM response.
    pub fn plus(self, usage: Usage) -> Self {
        Self {
            input_tokens: self.input_tokens.saturating_add(usage.input_tokens),
            output_tokens: self.output_tokens.saturating_add(usage.output_tokens),
            context_tokens: usage.context_tokens(),
        }
    }
}

/// A tool of a tenant's MCP server, as a conversation was given it at its creation.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct McpTool {
    /// The registered server's name.
    pub server: String,
    /// The name the LLM sees: `server__tool`.
    pub name: String,
    /// The server's own name for it.
    pub tool: String,
    pub description: String,
    pub input_schema: serde_json::Value,
}

/// A conversation as stored: its settings, its state and its counters.
#[derive(Clone, Debug, PartialEq)]
pub struct ConversationRecord {
    pub id: String,
    pub tenant_id: String,
    pub slug: String,
    pub cwd: String,
    pub model: String,
    pub system_prompt: Option<String>,
    pub parent_id: Option<String>,
    pub user_initiated: bool,
    pub require_approval: Vec<String>,
    /// Its tool processes have network access (settled at creation from sandbox.network).
    pub network: bool,
    pub state: ConvState,
    pub archived: bool,
    pub usage: UsageTotals,
    /// The sequence id the next message gets.
    pub next_sequence_id: i64,
    /// The event id the next durable frame gets.
    pub next_event_id: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// The epoch of this node's lease on the conversation (Postgres; `None` on SQLite, or
    /// read without taking the lease). Every commit carries it: the database refuses one
    /// whose lease has moved on.
    pub lease: Option<i64>,
    /// Where a fork came from.
    pub forked_from: Option<ForkPoint>,
    /// Its own token budget (input and output together), given at creation.
    pub budget_tokens: Option<u64>,
    /// The conversation whose summary it started from (context continuation).
    pub continued_from: Option<String>,
    /// Its tenant's MCP tools, as listed at its creation.
    pub mcp_tools: std::sync::Arc<Vec<McpTool>>,
    /// The agent version it was created from (its sub-agents, forks and continuations keep it).
    pub agent: Option<AgentRef>,
    /// The built-in tools it may use (`None`: all of them); its agent's `tools`.
    pub tools: Option<Vec<String>>,
    /// Its agent's permission rules, in order.
    pub permissions: Vec<PermissionRule>,
    /// The tools its client runs.
    pub client_tools: std::sync::Arc<Vec<ClientTool>>,
    /// Its agent's pre-tool-use hook.
    pub pre_tool_use: Option<std::sync::Arc<PreToolUseHook>>,
    /// Its agent's bounds (within the node's).
    pub bounds: Bounds,
}

/// An agent version, as a conversation names the one it was created from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentRef {
    pub name: String,
    pub version: u32,
}

/// One version of an agent: what a conversation created from it is given. Immutable once
/// stored; the store keeps it as this type's JSON.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AgentDefinition {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    /// The built-in tools it gets (`None`: all of them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<String>>,
    /// The tenant's MCP servers whose tools it gets, by name (`None`: all of them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp_servers: Option<Vec<String>>,
    #[serde(default)]
    pub require_approval: Vec<String>,
    #[serde(default)]
    pub network: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
    /// What its conversations' tool calls may do, first match first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub permissions: Vec<PermissionRule>,
    /// The tools its conversations' client runs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub client_tools: Vec<ClientTool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hooks: Option<Hooks>,
    /// Its conversations' turn bounds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<TurnBounds>,
    /// Its conversations' sub-agent bounds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sub_agents: Option<SubAgentBounds>,
}

/// An agent's pre-tool-use hook (docs/api.md, "Agents"): Bedrock asks it about each tool
/// call the rules did not deny, before the call runs.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PreToolUseHook {
    pub url: String,
    /// The key its requests are signed with (Standard Webhooks). Stored with the agent's
    /// version and its conversations; never shown, never exported.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub secret: String,
    pub timeout_ms: u64,
    pub on_failure: HookFailure,
}

/// What a hook that cannot answer (timeout, refused, an answer that is not one) decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HookFailure {
    Deny,
    Allow,
    Ask,
}

/// An agent's hooks.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Hooks {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pre_tool_use: Option<PreToolUseHook>,
}

/// An agent's bounds of one turn, each within the node's (`[limits]`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TurnBounds {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_llm_steps: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tool_calls: Option<u32>,
}

/// An agent's bounds of its sub-agents, each within the node's (`[sub_agents]`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SubAgentBounds {
    /// Tasks in one spawn_sub_agents call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tasks: Option<u32>,
    /// A sub-agent's LLM steps: its default and the most a task may ask for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_steps: Option<u32>,
    /// A sub-agent's wall time: its default and the most a task may ask for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// The bounds a conversation keeps from its agent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Bounds {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<TurnBounds>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sub_agents: Option<SubAgentBounds>,
}

impl Bounds {
    pub fn is_empty(&self) -> bool {
        self.limits.is_none() && self.sub_agents.is_none()
    }
}

/// A stored agent version.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentVersion {
    pub name: String,
    pub version: u32,
    pub definition: AgentDefinition,
    /// When this version was made (RFC 3339).
    pub created_at: String,
}

/// A fork's source and the last of its messages the fork copied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForkPoint {
    pub conversation_id: String,
    pub sequence_id: i64,
}

impl ConversationRecord {
    /// The event id of the latest durable frame (0 when there is none).
    pub fn last_event_id(&self) -> i64 {
        self.next_event_id - 1
    }
}

/// What a new conversation starts from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewConversation {
    pub id: String,
    pub tenant_id: String,
    pub slug: String,
    pub cwd: String,
    pub model: String,
    pub system_prompt: Option<String>,
    pub parent_id: Option<String>,
    pub user_initiated: bool,
    pub require_approval: Vec<String>,
    pub network: bool,
    pub budget_tokens: Option<u64>,
    pub mcp_tools: Vec<McpTool>,
    pub agent: Option<AgentRef>,
    pub tools: Option<Vec<String>>,
    pub permissions: Vec<PermissionRule>,
    pub client_tools: Vec<ClientTool>,
    pub pre_tool_use: Option<PreToolUseHook>,
    pub bounds: Bounds,
    pub created_at: DateTime<Utc>,
}

impl NewConversation {
    /// A user-initiated conversation with the defaults of an empty create request: the id
    /// as slug, no system prompt, no approvals, network off.
    pub fn user(
        id: &str,
        tenant_id: &str,
        cwd: impl Into<String>,
        model: &str,
        created_at: DateTime<Utc>,
    ) -> Self {
        NewConversation {
            id: id.to_owned(),
            tenant_id: tenant_id.to_owned(),
            slug: id.to_owned(),
            cwd: cwd.into(),
            model: model.to_owned(),
            system_prompt: None,
            budget_tokens: None,
            mcp_tools: Vec::new(),
            agent: None,
            tools: None,
            permissions: Vec::new(),
            client_tools: Vec::new(),
            pre_tool_use: None,
            bounds: Bounds::default(),
            parent_id: None,
            user_initiated: true,
            require_approval: Vec::new(),
            network: false,
            created_at,
        }
    }
}

impl NewConversation {
    /// The conversation as it is stored once created: idle, nothing used, nothing numbered.
    pub fn record(&self) -> ConversationRecord {
        ConversationRecord {
            id: self.id.clone(),
            tenant_id: self.tenant_id.clone(),
            slug: self.slug.clone(),
            cwd: self.cwd.clone(),
            model: self.model.clone(),
            system_prompt: self.system_prompt.clone(),
            parent_id: self.parent_id.clone(),
            user_initiated: self.user_initiated,
            require_approval: self.require_approval.clone(),
            network: self.network,
            state: ConvState::Idle,
            archived: false,
            usage: UsageTotals::default(),
            next_sequence_id: 1,
            next_event_id: 1,
            created_at: self.created_at,
            updated_at: self.created_at,
            lease: None,
            forked_from: None,
            budget_tokens: self.budget_tokens,
            continued_from: None,
            mcp_tools: std::sync::Arc::new(self.mcp_tools.clone()),
            agent: self.agent.clone(),
            tools: self.tools.clone(),
            permissions: self.permissions.clone(),
            client_tools: std::sync::Arc::new(self.client_tools.clone()),
            pre_tool_use: self.pre_tool_use.clone().map(std::sync::Arc::new),
            bounds: self.bounds,
        }
    }
}

/// A stored message.
#[derive(Clone, Debug, PartialEq)]
pub struct MessageRecord {
    pub id: String,
    pub conversation_id: String,
    pub sequence_id: i64,
    pub content: MessageContent,
    /// Token counts of the LLM response an agent message came from.
    pub usage: Option<Usage>,
    /// The client's idempotency key of a user message.
    pub client_message_id: Option<String>,
    pub created_at: DateTime<Utc>,
}

/// A durable frame: what clients receive live and replay after `after_event_id`.
#[derive(Clone, Debug, PartialEq)]
pub struct EventRecord {
    pub conversation_id: String,
    pub event_id: i64,
    /// The frame's `type`.
    pub event_type: String,
    /// The whole frame as sent to clients, `event_id` included: JSON text.
    pub payload: std::sync::Arc<str>,
    /// What the store keeps of it.
    pub stored: StoredFrame,
    /// One frame per key and conversation (idempotent client events).
    pub dedup_key: Option<String>,
    pub created_at: DateTime<Utc>,
}

/// What the store keeps of a durable frame: only what it cannot make again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoredFrame {
    /// A message's frame: the message itself is stored; this is its sequence id.
    Message { sequence_id: i64 },
    /// A state frame: the state's JSON.
    State(std::sync::Arc<str>),
    /// Any other frame: the payload as it is.
    Whole,
}

/// The durable frames of one stored row: `frames[i]` has event id `first_event_id + i`.
#[derive(Clone, Debug, PartialEq)]
pub struct FrameRow {
    pub first_event_id: i64,
    pub last_event_id: i64,
    /// The frames' items as stored, JSON text (`{"m": seq}`, `{"s": state}`, `{"f": frame}`).
    pub frames: String,
}

/// Defines a status: its variants and the one name each has in the store and on the wire.
macro_rules! status {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vdoc])* $variant),+
        }

        impl $name {
            /// Its name in the store and on the wire.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }

            /// The status of a stored name; `None` for a name no version ever wrote.
            pub fn parse(text: &str) -> Option<$name> {
                match text {
                    $($text => Some($name::$variant),)+
                    _ => None,
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

status! {
    /// Where a request to a client stands (bidirectional-streaming.md).
    RequestStatus {
        /// Waiting for the client's answer.
        Pending = "pending",
        Answered = "answered",
        /// Its time ran out, or the server restarted before an answer.
        Expired = "expired",
        /// Its turn was cancelled.
        Cancelled = "cancelled",
    }
}

status! {
    /// Where a background task stands.
    TaskStatus {
        Running = "running",
        Completed = "completed",
        Failed = "failed",
        Cancelled = "cancelled",
    }
}

/// A request from the server to a client (bidirectional-streaming.md).
#[derive(Clone, Debug, PartialEq)]
pub struct ClientRequest {
    pub id: String,
    pub conversation_id: String,
    pub tool_use_id: Option<String>,
    /// The contract's `request_type` object.
    pub request_type: serde_json::Value,
    pub status: RequestStatus,
    pub response: Option<serde_json::Value>,
    pub timeout_ms: i64,
    pub expires_at: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
}

/// A tool the conversation's client runs (docs/api.md, "Client tools"): the LLM sees it
/// beside the built-in ones; a call of it waits for the client's answer.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClientTool {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// A JSON Schema object of its input.
    pub input_schema: serde_json::Value,
    /// How long a call waits for its answer (`None`: `[requests] client_tool_timeout_ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// A call of a client tool, from the moment the client is asked until it is answered (or
/// expires, or is cancelled). A pending call outlives a restart.
#[derive(Clone, Debug, PartialEq)]
pub struct ClientToolCall {
    pub id: String,
    pub conversation_id: String,
    pub tool_use_id: String,
    /// Its turn, LLM step and tool_use id (`turn:step:tool_use_id`): a tool_use id alone may
    /// come again in a later step.
    pub key: String,
    pub name: String,
    pub input: serde_json::Value,
    pub status: RequestStatus,
    pub output: Option<String>,
    pub is_error: bool,
    pub timeout_ms: i64,
    pub expires_at: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub resolved_at: Option<DateTime<Utc>>,
}

/// A long-running tool run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackgroundTask {
    pub id: String,
    pub conversation_id: String,
    pub tool_use_id: String,
    pub tool_name: String,
    pub command: String,
    pub status: TaskStatus,
    pub output: Option<String>,
    pub exit_code: Option<i32>,
    pub wake: bool,
    pub created_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
}

/// Everything one transition writes, in one transaction (REQ-BED-007).
#[derive(Clone, Debug, PartialEq)]
pub struct ConversationCommit {
    pub conversation_id: String,
    /// The new state; `None` when it did not change.
    pub state: Option<ConvState>,
    pub messages: Vec<MessageRecord>,
    pub events: Vec<EventRecord>,
    /// New usage totals, when an LLM response came in.
    pub usage: Option<UsageTotals>,
    /// The counters before this commit: a guard against a second writer.
    pub expected_next_sequence_id: i64,
    pub expected_next_event_id: i64,
    pub next_sequence_id: i64,
    pub next_event_id: i64,
    pub at: DateTime<Utc>,
    /// The lease epoch the commit is made under (see [`ConversationRecord::lease`]).
    pub lease: Option<i64>,
    /// Deliveries to the tenant's webhooks, written in the same transaction (usually none:
    /// a turn's end, for a tenant with webhooks).
    pub deliveries: Vec<NewDelivery>,
    /// The transitions' steps for the replay log (src/replay), in order: on the commit's
    /// last row of frames, or a row of `conversation_steps` for a commit without frames
    /// (packed, src/store/packed.rs).
    pub steps: Vec<LoggedStep>,
}

/// A transition's step for the replay log (src/replay), ready to be written with its
/// commit: its number in the conversation and its JSON.
#[derive(Clone, Debug, PartialEq)]
pub struct LoggedStep {
    pub n: i64,
    pub json: String,
}

impl LoggedStep {
    /// A commit's steps as the JSON array a row of steps holds (packed when stored).
    pub fn array(steps: &[LoggedStep]) -> String {
        let mut json =
            String::with_capacity(steps.iter().map(|s| s.json.len() + 1).sum::<usize>() + 2);
        json.push('[');
        for (i, step) in steps.iter().enumerate() {
            if i > 0 {
                json.push(',');
            }
            json.push_str(&step.json);
        }
        json.push(']');
        json
    }
}

/// An event a tenant's webhooks are told of (docs/api.md, "Webhooks"): a turn's end, a
/// request to the client. Made into a [`NewDelivery`] per subscribed endpoint
/// (`webhooks::Subscribers::deliveries`), written in the transaction of the change that
/// caused it.
#[derive(Clone, Debug, PartialEq)]
pub struct WebhookEvent {
    pub tenant_id: String,
    pub conversation_id: String,
    /// `turn.completed`, `request.created`, ...
    pub event_type: &'static str,
    /// The event's JSON (the body's `data`), small: ids and states, never secrets.
    pub payload: String,
    pub at: DateTime<Utc>,
}

/// An event's delivery to one endpoint, written with the change that caused the event, so a
/// crash between the two loses nothing and sends nothing for a change that was not stored.
#[derive(Clone, Debug, PartialEq)]
pub struct NewDelivery {
    /// The `webhook-id` header (`msg_...`).
    pub id: String,
    pub webhook_id: String,
    pub tenant_id: String,
    pub conversation_id: String,
    /// Orders a conversation's deliveries to an endpoint: microseconds when the event was
    /// made, increasing on the node.
    pub event_seq: i64,
    pub event_type: &'static str,
    pub payload: String,
    /// Milliseconds since the Unix epoch.
    pub created_at: i64,
    /// Retried until then.
    pub expires_at: i64,
    /// Claimed by this node's dispatcher (the claimer, until when): it is sent as soon as it
    /// is stored, without a claim. `None`: an earlier delivery of the conversation to the
    /// endpoint is not done yet, and the dispatcher claims this one after it.
    pub claimed: Option<(String, i64)>,
}

/// A tenant's webhook endpoint (its secrets never printed).
#[derive(Clone, Debug)]
pub struct Webhook {
    pub id: String,
    pub tenant_id: String,
    pub url: String,
    pub events: Vec<String>,
    pub description: Option<String>,
    pub enabled: bool,
    pub disabled_reason: Option<String>,
    /// The signing secret (`whsec_...`), never shown but at creation and rotation.
    pub secret: secrecy::SecretString,
    /// The secret before the last rotation, still signing beside the new one until
    /// `previous_secret_until` (milliseconds since the Unix epoch).
    pub previous_secret: Option<secrecy::SecretString>,
    pub previous_secret_until: Option<i64>,
    /// Since when every attempt has failed (milliseconds), `None` while it answers.
    pub failing_since: Option<i64>,
    pub created_at: i64,
    pub updated_at: i64,
}

/// One event's delivery to one endpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct WebhookDelivery {
    /// The `webhook-id` header: the same on every attempt.
    pub id: String,
    pub webhook_id: String,
    pub tenant_id: String,
    pub conversation_id: String,
    /// The event's place among the conversation's: its deliveries go out in this order.
    pub event_seq: i64,
    pub event_type: String,
    pub payload: String,
    /// `pending`, `succeeded` or `failed`.
    pub status: String,
    pub attempts: u32,
    pub next_attempt_at: i64,
    pub expires_at: i64,
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
    pub last_latency_ms: Option<i64>,
    /// The last attempts, JSON: `[{"at", "status"?, "error"?, "latency_ms", "excerpt"?}]`.
    pub attempts_log: String,
    pub created_at: i64,
    pub updated_at: i64,
}

/// One page of a listing.
#[derive(Clone, Debug, PartialEq)]
pub struct Page<T> {
    pub items: Vec<T>,
    /// Pass back to get the next page; `None` on the last one.
    pub next_cursor: Option<String>,
}

#[cfg(test)]
mod status_tests {
    use super::{RequestStatus, TaskStatus};

    #[test]
    fn every_status_reads_back_as_written_and_nothing_else_reads() {
        for status in [
            RequestStatus::Pending,
            RequestStatus::Answered,
            RequestStatus::Expired,
            RequestStatus::Cancelled,
        ] {
            assert_eq!(RequestStatus::parse(status.as_str()), Some(status));
            assert_eq!(status.to_string(), status.as_str());
        }
        for status in [
            TaskStatus::Running,
            TaskStatus::Completed,
            TaskStatus::Failed,
            TaskStatus::Cancelled,
        ] {
            assert_eq!(TaskStatus::parse(status.as_str()), Some(status));
        }
        assert_eq!(RequestStatus::parse("running"), None);
        assert_eq!(TaskStatus::parse("Pending"), None);
        assert_eq!(TaskStatus::parse(""), None);
    }
}

/// A tenant's schedule (docs/api.md, "Schedules").
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    pub id: String,
    pub tenant_id: String,
    /// Each firing creates a conversation of this agent (`name` or `name@N`)...
    pub agent: Option<String>,
    /// ... or sends the message to this conversation.
    pub conversation_id: Option<String>,
    pub message: String,
    pub cron: Option<String>,
    pub every_ms: Option<u64>,
    pub at_ms: Option<i64>,
    pub timezone: String,
    /// `skip`, `enqueue` or `interrupt`.
    pub if_busy: String,
    /// `none` or `one`.
    pub catch_up: String,
    pub enabled: bool,
    pub next_fire_at: Option<i64>,
    pub last_fire_at: Option<i64>,
    pub created_at: i64,
    pub updated_at: i64,
}

impl Schedule {
    /// When it fires, as the schedules module computes it.
    pub fn when(&self) -> Option<crate::schedules::When> {
        if let Some(expr) = &self.cron {
            let tz = crate::schedules::time_zone(&self.timezone).ok()?;
            return Some(crate::schedules::When::Cron {
                expr: expr.clone(),
                tz,
            });
        }
        if let Some(ms) = self.every_ms {
            return Some(crate::schedules::When::Every {
                ms,
                from: self.created_at,
            });
        }
        self.at_ms.map(crate::schedules::When::At)
    }
}

/// One firing of a schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct ScheduleRun {
    pub schedule_id: String,
    pub fire_at: i64,
    pub tenant_id: String,
    /// `claimed` (being run), `started`, `queued`, `skipped`, `failed`.
    pub status: String,
    pub conversation_id: Option<String>,
    pub outcome: Option<String>,
    pub started_at: Option<i64>,
    pub created_at: i64,
}
