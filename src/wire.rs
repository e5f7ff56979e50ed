//! The contract's JSON shapes (../shared/api.md) as Rust types: request bodies, responses,
//! states, messages, frames and the error body. Everything that leaves the process as JSON
//! is one of these, and the OpenAPI document (`/openapi.json`, docs/openapi.json) is derived
//! from them, so the two cannot drift apart. The store keeps message contents in its own
//! JSON (store/codec.rs), not in these.
//!
//! Responses borrow from the records they describe (`'a`); nothing here reads the store,
//! the clock or the network.

use std::borrow::Cow;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};

use crate::model::{
    AgentVersion, BackgroundTask, ClientRequest, ConversationRecord, MessageRecord,
};
use crate::notice::Notice;
pub use crate::notice::{RequestType, SelectOption, SystemEvent};
use crate::state_machine::{self as core, ConvState, MessageContent};

/// Timestamps leave as RFC 3339 with the offset spelled out (`+00:00`).
fn rfc3339<S: Serializer>(at: &DateTime<Utc>, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_str(&at.to_rfc3339())
}

fn rfc3339_opt<S: Serializer>(
    at: &Option<DateTime<Utc>>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match at {
        Some(at) => rfc3339(at, serializer),
        None => serializer.serialize_none(),
    }
}

// ---------------------------------------------------------------------------------------
// Errors.

/// Every non-2xx reply: `{"error": {"code", "message"}}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody<'a> {
    pub error: ErrorDetail<'a>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail<'a> {
    /// A snake_case code, e.g. `invalid_request`, `not_found`, `agent_busy`.
    #[schema(example = "invalid_request")]
    pub code: &'a str,
    /// A sentence meant for a developer.
    pub message: &'a str,
    /// *Extension.* With `quota_exceeded`: the quota and its limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quota: Option<QuotaDetail>,
}

/// A quota that a request was over (`quota_exceeded`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
pub struct QuotaDetail {
    /// e.g. `conversations`, `concurrent_turns`, `streams`, `mcp_servers`.
    pub name: &'static str,
    pub limit: u64,
}

// ---------------------------------------------------------------------------------------
// States and usage.

/// Why a turn failed (the state `error`'s `error_kind`, a `retrying` frame's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    Auth,
    RateLimit,
    Network,
    InvalidRequest,
    Limit,
    /// A token budget is spent. *Extension.*
    Budget,
    Unknown,
}

impl From<core::ErrorKind> for ErrorKind {
    fn from(kind: core::ErrorKind) -> Self {
        match kind {
            core::ErrorKind::Auth => ErrorKind::Auth,
            core::ErrorKind::RateLimit => ErrorKind::RateLimit,
            core::ErrorKind::Network => ErrorKind::Network,
            core::ErrorKind::InvalidRequest => ErrorKind::InvalidRequest,
            core::ErrorKind::Limit => ErrorKind::Limit,
            core::ErrorKind::Budget => ErrorKind::Budget,
            core::ErrorKind::Unknown => ErrorKind::Unknown,
        }
    }
}

/// The conversation's state: `kind` plus the fields of that kind.
#[derive(Clone, Debug, PartialEq, Serialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum State<'a> {
    Idle,
    AwaitingLlm,
    LlmRequesting {
        /// 1 to 3.
        #[schema(minimum = 1, maximum = 3)]
        attempt: u32,
    },
    ToolExecuting {
        current_tool_id: &'a str,
        /// *Extension.*
        current_tool_name: &'a str,
        remaining_tool_ids: Vec<&'a str>,
        completed: u32,
    },
    Cancelling,
    AwaitingSubAgents {
        pending_ids: Vec<&'a str>,
        completed: u32,
    },
    Error {
        message: &'a str,
        error_kind: ErrorKind,
    },
    /// Sub-agents only, after submit_result.
    Completed,
    /// The context filled up and was summarised; the conversation goes on in a new one
    /// (`POST .../continue`). *Extension.*
    ContextExhausted {
        summary: &'a str,
    },
}

/// The contract's `State` of a conversation's state.
pub fn state(state: &ConvState) -> State<'_> {
    match state {
        ConvState::Idle => State::Idle,
        ConvState::AwaitingLlm { .. } => State::AwaitingLlm,
        ConvState::LlmRequesting { attempt, .. } => State::LlmRequesting { attempt: *attempt },
        ConvState::ToolExecuting {
            current,
            remaining,
            completed,
            ..
        } => State::ToolExecuting {
            current_tool_id: &current.id,
            current_tool_name: &current.name,
            remaining_tool_ids: remaining.iter().map(|t| t.id.as_str()).collect(),
            completed: *completed,
        },
        ConvState::Cancelling { .. } => State::Cancelling,
        ConvState::AwaitingSubAgents { agents, .. } => State::AwaitingSubAgents {
            pending_ids: state.pending_agent_ids(),
            completed: u32::try_from(agents.iter().filter(|slot| slot.outcome.is_some()).count())
                .unwrap_or(u32::MAX),
        },
        ConvState::Error {
            message,
            error_kind,
        } => State::Error {
            message,
            error_kind: (*error_kind).into(),
        },
        ConvState::Completed => State::Completed,
        ConvState::ContextExhausted { summary } => State::ContextExhausted { summary },
    }
}

/// Token counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// What the conversation occupied of the context window after the LLM response.
    pub context_tokens: u64,
    /// The model's context window.
    pub context_window: u64,
}

// ---------------------------------------------------------------------------------------
// Conversations and messages.

/// Where a continued conversation came from.
#[derive(Debug, Serialize, ToSchema)]
pub struct ContinuedFrom<'a> {
    pub conversation_id: &'a str,
}

/// A conversation.
#[derive(Debug, Serialize, ToSchema)]
pub struct Conversation<'a> {
    pub id: &'a str,
    pub slug: &'a str,
    pub cwd: &'a str,
    pub model: &'a str,
    #[schema(required = true)]
    pub system_prompt: Option<&'a str>,
    /// The parent of a sub-agent.
    #[schema(required = true)]
    pub parent_id: Option<&'a str>,
    pub user_initiated: bool,
    /// Tools that ask the client before each run. *Extension.*
    pub require_approval: &'a [String],
    /// Whether its tool processes have network access. *Extension.*
    pub network: bool,
    pub archived: bool,
    pub state: State<'a>,
    /// What the turn in progress has used so far; absent at rest. *Extension.*
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turn: Option<TurnProgress>,
    pub usage: Usage,
    /// A fork's source and the last of its messages the fork copied; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<ForkedFrom<'a>>,
    /// Its own token budget, when it was given one. *Extension.*
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_tokens: Option<u64>,
    /// The conversation whose summary it started from (`POST .../continue`); absent
    /// otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub continued_from: Option<ContinuedFrom<'a>>,
    /// The tools of its tenant's MCP servers it was given at its creation
    /// (`server__tool`); absent when none. *Extension.*
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mcp_tools: Vec<&'a str>,
    /// The agent version it was created from (its sub-agents, forks and continuations keep
    /// it); absent otherwise. *Extension.*
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentPin<'a>>,
    /// The built-in tools it may use, when its agent bounds them. *Extension.*
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<&'a [String]>,
    /// Its agent's permission rules, in order; absent when it has none. *Extension.*
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    #[schema(value_type = Vec<PermissionRuleBody>)]
    pub permissions: &'a [core::PermissionRule],
    /// The tools its client runs; absent when it has none. *Extension.*
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub client_tools: Vec<ClientToolView<'a>>,
    #[serde(serialize_with = "rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: DateTime<Utc>,
    #[serde(serialize_with = "rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub updated_at: DateTime<Utc>,
}

/// An agent version, as a conversation names the one it was created from. *Extension.*
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
pub struct AgentPin<'a> {
    pub name: &'a str,
    pub version: u32,
}

/// The turn in progress of a conversation (a sub-agent's steps, for a client's tree).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
pub struct TurnProgress {
    pub llm_steps: u32,
    pub tool_calls: u32,
}

/// Where a fork came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
pub struct ForkedFrom<'a> {
    pub conversation_id: &'a str,
    pub sequence_id: i64,
}

/// The contract's `Conversation` object.
pub fn conversation(conv: &ConversationRecord, context_window: u64) -> Conversation<'_> {
    Conversation {
        id: &conv.id,
        slug: &conv.slug,
        cwd: &conv.cwd,
        model: &conv.model,
        system_prompt: conv.system_prompt.as_deref(),
        parent_id: conv.parent_id.as_deref(),
        user_initiated: conv.user_initiated,
        require_approval: &conv.require_approval,
        network: conv.network,
        archived: conv.archived,
        state: state(&conv.state),
        turn: conv.state.turn().map(|turn| TurnProgress {
            llm_steps: turn.llm_steps,
            tool_calls: turn.tool_calls,
        }),
        forked_from: conv.forked_from.as_ref().map(|from| ForkedFrom {
            conversation_id: &from.conversation_id,
            sequence_id: from.sequence_id,
        }),
        budget_tokens: conv.budget_tokens,
        continued_from: conv
            .continued_from
            .as_deref()
            .map(|conversation_id| ContinuedFrom { conversation_id }),
        mcp_tools: conv.mcp_tools.iter().map(|t| t.name.as_str()).collect(),
        agent: conv.agent.as_ref().map(|agent| AgentPin {
            name: &agent.name,
            version: agent.version,
        }),
        tools: conv.tools.as_deref(),
        permissions: &conv.permissions,
        client_tools: client_tools(&conv.client_tools),
        usage: Usage {
            input_tokens: conv.usage.input_tokens,
            output_tokens: conv.usage.output_tokens,
            context_tokens: conv.usage.context_tokens,
            context_window,
        },
        created_at: conv.created_at,
        updated_at: conv.updated_at,
    }
}

/// A message of a conversation.
#[derive(Debug, Serialize, ToSchema)]
pub struct Message<'a> {
    pub id: &'a str,
    pub conversation_id: &'a str,
    /// 1, 2, 3, ... per conversation, with no gaps.
    #[schema(minimum = 1)]
    pub sequence_id: i64,
    /// `message_type` and its `content`.
    #[serde(flatten)]
    pub body: MessageBody<'a>,
    /// The tokens of the LLM response an agent message came from.
    #[schema(required = true)]
    pub usage: Option<Usage>,
    #[serde(serialize_with = "rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: DateTime<Utc>,
    /// The client's idempotency key, when it gave one. *Extension.*
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message_id: Option<&'a str>,
}

/// A message's `message_type` and its `content`.
#[derive(Debug, Serialize, ToSchema)]
#[serde(tag = "message_type", content = "content", rename_all = "snake_case")]
pub enum MessageBody<'a> {
    User(UserContent<'a>),
    Agent(AgentContent<'a>),
    Tool(ToolContent<'a>),
    System(TextContent<'a>),
    Error(TextContent<'a>),
}

#[derive(Debug, Serialize, ToSchema)]
pub struct UserContent<'a> {
    pub text: &'a str,
    pub images: Vec<ImageRef<'a>>,
}

/// An image stored with a user message.
#[derive(Debug, Serialize, ToSchema)]
pub struct ImageRef<'a> {
    pub id: &'a str,
    pub media_type: &'a str,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AgentContent<'a> {
    #[schema(required = true)]
    pub text: Option<&'a str>,
    /// Each is answered by exactly one tool message, whatever happens.
    pub tool_uses: Vec<ToolUse<'a>>,
    /// The model's thinking, for backends that stream it. *Extension.*
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<&'a str>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ToolUse<'a> {
    pub id: &'a str,
    pub name: &'a str,
    /// The tool's input, as the LLM gave it.
    pub input: &'a Value,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ToolContent<'a> {
    pub tool_use_id: &'a str,
    pub name: &'a str,
    pub ok: bool,
    pub output: &'a str,
    /// A synthetic result of work that never finished (cancel, limit, restart).
    pub cancelled: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TextContent<'a> {
    pub text: &'a str,
}

/// A message's `message_type` and `content`.
pub fn message_body(content: &MessageContent) -> MessageBody<'_> {
    match content {
        MessageContent::User { text, images } => MessageBody::User(UserContent {
            text,
            images: images
                .iter()
                .map(|image| ImageRef {
                    id: &image.id,
                    media_type: &image.media_type,
                })
                .collect(),
        }),
        MessageContent::Agent {
            text,
            tool_uses,
            reasoning,
        } => MessageBody::Agent(AgentContent {
            text: text.as_deref(),
            reasoning: reasoning.as_ref().map(|r| r.text.as_str()),
            tool_uses: tool_uses
                .iter()
                .map(|tool| ToolUse {
                    id: &tool.id,
                    name: &tool.name,
                    input: &tool.input,
                })
                .collect(),
        }),
        MessageContent::Tool(result) => MessageBody::Tool(ToolContent {
            tool_use_id: &result.tool_use_id,
            name: &result.name,
            ok: result.ok,
            output: &result.output,
            cancelled: result.cancelled,
        }),
        MessageContent::System { text } => MessageBody::System(TextContent { text }),
        MessageContent::Error { text } => MessageBody::Error(TextContent { text }),
    }
}

/// The contract's `Message` object.
pub fn message(message: &MessageRecord, context_window: u64) -> Message<'_> {
    Message {
        id: &message.id,
        conversation_id: &message.conversation_id,
        sequence_id: message.sequence_id,
        body: message_body(&message.content),
        usage: message.usage.map(|u| Usage {
            input_tokens: u.input_tokens,
            output_tokens: u.output_tokens,
            context_tokens: u.context_tokens(),
            context_window,
        }),
        created_at: message.created_at,
        message_id: message.client_message_id.as_deref(),
    }
}

// ---------------------------------------------------------------------------------------
// Request bodies and queries.

/// `POST /v1/conversations/{id}/fork`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkConversation {
    /// The last message copied (default: the last one stored where no tool call is open;
    /// 0: none).
    #[schema(minimum = 0)]
    pub at_sequence_id: Option<i64>,
    /// `copy` (default): the fork works in a copy of the source's workspace; `share`: in
    /// the same directory.
    pub cwd: Option<ForkCwd>,
}

/// A fork's working directory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ForkCwd {
    #[default]
    Copy,
    Share,
}

/// `POST /v1/conversations`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateConversation {
    /// Relative to `<workspace root>/<tenant id>`, or absolute inside it. Default: a
    /// directory of its own.
    pub cwd: Option<String>,
    #[schema(min_length = 1, max_length = 200, pattern = "\\S")]
    pub model: Option<String>,
    pub system_prompt: Option<String>,
    /// 1 to 64 characters of a-z, 0-9, `-` and `_`; unique per tenant.
    #[schema(pattern = "^[a-z0-9_-]{1,64}$")]
    pub slug: Option<String>,
    /// Tools that ask the client (a `confirm` request) before each run. *Extension.*
    #[schema(max_items = 32)]
    pub require_approval: Option<Vec<String>>,
    /// Network access for the tool processes, where the operator allows it. *Extension.*
    pub network: Option<bool>,
    /// A token budget of its own (input and output together, its sub-agents each the
    /// same): past it, its turns end in error kind `budget`. *Extension.*
    #[schema(minimum = 1, maximum = 9_223_372_036_854_775_807_u64)]
    pub budget_tokens: Option<u64>,
    /// The agent to create it from: `name` (its latest version) or `name@N` (version N).
    /// The conversation gets the agent's model, system prompt, tools, MCP servers,
    /// approvals, network and budget; only `cwd` and `slug` may be given with it.
    /// *Extension.*
    #[schema(max_length = 80)]
    pub agent: Option<String>,
    /// Tools the client runs (docs/api.md, "Client tools"): the LLM sees them beside the
    /// built-in ones, and a call of one waits for the client's answer. *Extension.*
    #[schema(max_items = 32)]
    #[serde(default, deserialize_with = "objects")]
    pub client_tools: Option<Vec<ClientToolBody>>,
}

/// `POST /v1/agents` and `PUT /v1/agents/{name}`: an agent's definition, which makes its
/// next version. *Extension.*
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentBody {
    /// 1 to 64 characters of a-z, 0-9, `-` and `_`; unique per tenant. Required to create;
    /// to change one, absent or the name in the path.
    #[schema(pattern = "^[a-z0-9_-]{1,64}$")]
    pub name: Option<String>,
    #[schema(max_length = 2000)]
    pub description: Option<String>,
    #[schema(min_length = 1, max_length = 200, pattern = "\\S")]
    pub model: String,
    pub system_prompt: Option<String>,
    /// The built-in tools its conversations get (default: all). A sub-agent always has
    /// `submit_result`.
    #[schema(max_items = 32)]
    pub tools: Option<Vec<String>>,
    /// The tenant's MCP servers whose tools its conversations get, by name (default: all).
    #[schema(max_items = 32)]
    pub mcp_servers: Option<Vec<String>>,
    /// Tools that ask the client (a `confirm` request) before each run.
    #[schema(max_items = 32)]
    pub require_approval: Option<Vec<String>>,
    /// Network access for its conversations' tool processes, where the operator allows it.
    pub network: Option<bool>,
    /// Each conversation's own token budget.
    #[schema(minimum = 1, maximum = 9_223_372_036_854_775_807_u64)]
    pub budget_tokens: Option<u64>,
    /// Anything the client keeps with the agent (a JSON object of at most 16 KiB).
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Map<String, Value>>,
    /// What its conversations' tool calls may do: the first rule that matches a call
    /// decides it; no rule matching, `require_approval` does.
    #[schema(max_items = 64)]
    #[serde(default, deserialize_with = "objects")]
    pub permissions: Option<Vec<PermissionRuleBody>>,
    /// Tools its conversations' client runs (docs/api.md, "Client tools").
    #[schema(max_items = 32)]
    #[serde(default, deserialize_with = "objects")]
    pub client_tools: Option<Vec<ClientToolBody>>,
    /// Its hooks: `pre_tool_use`, asked about each tool call the rules do not deny.
    #[serde(default, deserialize_with = "object")]
    pub hooks: Option<HooksBody>,
    /// Its conversations' turn bounds, within the node's.
    #[serde(default, deserialize_with = "object")]
    pub limits: Option<TurnBoundsBody>,
    /// Its conversations' sub-agent bounds, within the node's.
    #[serde(default, deserialize_with = "object")]
    pub sub_agents: Option<SubAgentBoundsBody>,
}

/// An agent's hooks. *Extension.*
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HooksBody {
    #[serde(default, deserialize_with = "object")]
    pub pre_tool_use: Option<PreToolUseBody>,
}

/// An agent's pre-tool-use hook. *Extension.*
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PreToolUseBody {
    /// `http` or `https`; reached under the node's egress policy, like tenants' MCP servers.
    #[schema(max_length = 2048)]
    pub url: String,
    /// The key its requests are signed with (Standard Webhooks: `whsec_` and base64, or
    /// any 16 to 512 bytes). Never shown, never exported.
    #[schema(min_length = 16, max_length = 512)]
    pub secret: Option<String>,
    /// How long Bedrock waits for its answer (default 5000, at most 30000).
    #[schema(minimum = 1, maximum = 30000)]
    pub timeout_ms: Option<u64>,
    /// What a hook that does not answer decides: `deny` (default), `allow` or `ask`.
    #[schema(value_type = Option<String>, pattern = "^(deny|allow|ask)$")]
    pub on_failure: Option<crate::model::HookFailure>,
}

/// An agent's turn bounds. *Extension.*
#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TurnBoundsBody {
    /// LLM steps of one turn (at most the node's `turn.max_llm_steps`).
    #[schema(minimum = 1)]
    pub max_llm_steps: Option<u32>,
    /// Tool calls of one turn (at most the node's `turn.max_tool_calls`).
    #[schema(minimum = 1)]
    pub max_tool_calls: Option<u32>,
}

/// An agent's sub-agent bounds. *Extension.*
#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubAgentBoundsBody {
    /// Tasks of one spawn_sub_agents call (at most the node's `turn.max_sub_agents`).
    #[schema(minimum = 1)]
    pub max_tasks: Option<u32>,
    /// A sub-agent's LLM steps (at most the node's `sub_agents.max_steps`).
    #[schema(minimum = 1)]
    pub max_steps: Option<u32>,
    /// A sub-agent's wall time in ms (at most the node's `sub_agents.timeout_ms`).
    #[schema(minimum = 1)]
    pub timeout_ms: Option<u64>,
}

/// An agent's pre-tool-use hook as the API shows it: without its secret. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct PreToolUseView<'a> {
    pub url: &'a str,
    pub timeout_ms: u64,
    /// `deny`, `allow` or `ask`.
    #[schema(value_type = String)]
    pub on_failure: crate::model::HookFailure,
}

/// An agent's hooks as the API shows them. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct HooksView<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pre_tool_use: Option<PreToolUseView<'a>>,
}

/// A permission rule of an agent. *Extension.*
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PermissionRuleBody {
    /// A pattern of tool names (`*`: any run of characters, `?`: one): built-in, MCP
    /// (`server__*`) and client tools alike. At most 256 bytes.
    #[schema(min_length = 1, max_length = 256)]
    pub tool: String,
    /// String fields of the call's input, each with a pattern its whole value must match.
    pub input: Option<std::collections::BTreeMap<String, String>>,
    /// `allow` (run it, no approval), `deny` (refuse it; the LLM gets `message`) or `ask`
    /// (a `confirm` request first).
    #[schema(value_type = String, pattern = "^(allow|deny|ask)$")]
    pub action: core::PermissionAction,
    /// With `deny`: what the LLM is told.
    #[schema(max_length = 1000)]
    pub message: Option<String>,
}

/// One version of an agent. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct AgentView<'a> {
    pub name: &'a str,
    pub version: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<&'a str>,
    pub model: &'a str,
    #[schema(required = true)]
    pub system_prompt: Option<&'a str>,
    /// Absent: every built-in tool.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<&'a [String]>,
    /// Absent: every MCP server of the tenant.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mcp_servers: Option<&'a [String]>,
    pub require_approval: &'a [String],
    pub network: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Object)]
    pub metadata: Option<&'a serde_json::Map<String, Value>>,
    /// Its permission rules, in order; absent when it has none.
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    #[schema(value_type = Vec<PermissionRuleBody>)]
    pub permissions: &'a [core::PermissionRule],
    /// The tools its conversations' client runs; absent when it has none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub client_tools: Vec<ClientToolView<'a>>,
    /// Its hooks (a hook's secret is never shown); absent when it has none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hooks: Option<HooksView<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<TurnBoundsBody>)]
    pub limits: Option<crate::model::TurnBounds>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<SubAgentBoundsBody>)]
    pub sub_agents: Option<crate::model::SubAgentBounds>,
    /// When this version was made.
    pub created_at: &'a str,
}

/// An agent version as the API shows it.
pub fn agent(version: &AgentVersion) -> AgentView<'_> {
    let definition = &version.definition;
    AgentView {
        name: &version.name,
        version: version.version,
        description: definition.description.as_deref(),
        model: &definition.model,
        system_prompt: definition.system_prompt.as_deref(),
        tools: definition.tools.as_deref(),
        mcp_servers: definition.mcp_servers.as_deref(),
        require_approval: &definition.require_approval,
        network: definition.network,
        budget_tokens: definition.budget_tokens,
        metadata: definition.metadata.as_ref(),
        permissions: &definition.permissions,
        client_tools: client_tools(&definition.client_tools),
        hooks: definition.hooks.as_ref().map(|hooks| HooksView {
            pre_tool_use: hooks.pre_tool_use.as_ref().map(|hook| PreToolUseView {
                url: &hook.url,
                timeout_ms: hook.timeout_ms,
                on_failure: hook.on_failure,
            }),
        }),
        limits: definition.limits,
        sub_agents: definition.sub_agents,
        created_at: &version.created_at,
    }
}

/// An agent as one document (`GET /v1/agents/{name}/export`, `POST /v1/agents/import`,
/// `bedrock agent export|import`). *Extension.*
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentDocument {
    /// `bedrock.agent/1`.
    pub format: String,
    pub name: String,
    /// Oldest first; an import makes them in this order.
    #[schema(min_items = 1, max_items = 1000)]
    pub versions: Vec<AgentDocumentVersion>,
}

/// One version in an agent's document. *Extension.*
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentDocumentVersion {
    /// Its number where it was exported (an import numbers its own).
    pub version: u32,
    pub created_at: String,
    /// As `POST /v1/agents` takes it, without `name`.
    #[schema(value_type = Object)]
    pub definition: Value,
}

/// `GET /v1/agents/{name}/export`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ExportQuery {
    /// The latest version alone (default: every version).
    pub latest: Option<bool>,
}

/// `POST /v1/agents/import`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ImportQuery {
    /// The name to import it as (default: the document's).
    #[serde(rename = "as")]
    #[param(rename = "as")]
    pub as_name: Option<String>,
}

/// `GET /v1/agents` (each agent's latest version) and `GET /v1/agents/{name}/versions`
/// (every version, oldest first). *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct AgentList<'a> {
    pub agents: Vec<AgentView<'a>>,
}

/// `GET /v1/conversations`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// 1 to 200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<u64>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
    /// Archived conversations instead of the others (default false).
    pub archived: Option<bool>,
}

/// `POST /v1/mcp_servers`. *Extension.*
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewMcpServer {
    /// 1 to 32 characters of a-z, 0-9, `-` and `_`, without `__`: its tools are
    /// `name__tool`.
    #[schema(pattern = "^[a-z0-9_-]{1,32}$")]
    pub name: String,
    /// Its streamable-HTTP endpoint, http:// or https://.
    #[schema(max_length = 2048)]
    pub url: String,
    /// Sent with every request to it (credentials, say); never shown again.
    pub headers: Option<std::collections::BTreeMap<String, String>>,
}

/// An MCP server as listed: its headers' names only. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct McpServerView<'a> {
    pub name: &'a str,
    pub url: &'a str,
    pub header_names: Vec<&'a str>,
    pub created_at: &'a str,
}

/// `GET /v1/mcp_servers`. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct McpServerList<'a> {
    pub servers: Vec<McpServerView<'a>>,
}

/// `POST /v1/webhooks`. *Extension.*
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewWebhook {
    /// Where events are POSTed: http:// or https://, no user name or password, under the
    /// node's egress policy (no internal address unless the operator allows it).
    #[schema(max_length = 2048)]
    pub url: String,
    /// The events it is sent: `turn.completed`, `turn.failed`, `turn.cancelled`,
    /// `request.created`, `conversation.context_exhausted`, `budget.exhausted`.
    #[schema(min_items = 1, max_items = 6)]
    pub events: Vec<String>,
    #[schema(max_length = 256)]
    pub description: Option<String>,
    /// Default true.
    pub enabled: Option<bool>,
}

/// `PATCH /v1/webhooks/{id}`: the fields given change. *Extension.*
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WebhookPatch {
    #[schema(max_length = 2048)]
    pub url: Option<String>,
    #[schema(min_items = 1, max_items = 6)]
    pub events: Option<Vec<String>>,
    /// `""` removes it.
    #[schema(max_length = 256)]
    pub description: Option<String>,
    /// `true` enables it again (a disabled endpoint's failures are forgotten).
    pub enabled: Option<bool>,
}

/// A webhook endpoint as shown: never its secret but when it is made or rotated.
/// *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct WebhookView {
    pub id: String,
    pub url: String,
    pub events: Vec<String>,
    pub description: Option<String>,
    pub enabled: bool,
    /// Why it was disabled (by its owner, or after failing for too long).
    pub disabled_reason: Option<String>,
    /// Since when every attempt has failed (RFC 3339), while it does.
    pub failing_since: Option<String>,
    pub created_at: String,
    pub updated_at: String,
    /// The signing secret (`whsec_...`): only in the answers to its creation and to
    /// `rotate_secret`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
}

/// `GET /v1/webhooks`. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct WebhookList {
    pub webhooks: Vec<WebhookView>,
}

/// `GET /v1/webhooks/{id}/deliveries`. *Extension.*
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DeliveriesQuery {
    /// `pending`, `succeeded` or `failed`.
    #[param(pattern = "^(pending|succeeded|failed)$")]
    pub status: Option<String>,
    /// 1 to 200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<u64>,
    /// `next_cursor` of the previous page.
    #[param(max_length = 64)]
    pub cursor: Option<String>,
}

/// One attempt of a delivery.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct DeliveryAttempt {
    pub at: String,
    /// The endpoint's HTTP status, when it answered.
    pub status: Option<u16>,
    /// Why it failed, when it did not answer (a timeout, a connection error, a refusal
    /// of the egress policy).
    pub error: Option<String>,
    pub latency_ms: i64,
    /// The first 256 bytes of its answer.
    pub excerpt: Option<String>,
}

/// One event's delivery to an endpoint. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct DeliveryView {
    /// The `webhook-id` header: the same on every attempt.
    pub id: String,
    pub webhook_id: String,
    pub event_type: String,
    pub conversation_id: String,
    /// `pending`, `succeeded` or `failed`.
    pub status: String,
    pub attempts: u32,
    /// When the next attempt is due (pending ones).
    pub next_attempt_at: Option<String>,
    /// Retried until then.
    pub expires_at: String,
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
    pub last_latency_ms: Option<i64>,
    /// The last attempts, oldest first (at most 10).
    pub attempt_log: Vec<DeliveryAttempt>,
    /// The event as sent (`data` of the body).
    #[schema(value_type = Object)]
    pub data: Value,
    pub created_at: String,
    pub updated_at: String,
}

/// `GET /v1/webhooks/{id}/deliveries`, newest first. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct DeliveryList {
    pub deliveries: Vec<DeliveryView>,
    pub next_cursor: Option<String>,
}

/// `POST /v1/schedules`: one of `agent` and `conversation_id`, one of `cron`, `every` and
/// `at`. *Extension.*
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewSchedule {
    /// Each firing creates a conversation of this agent (`name` or `name@N`)...
    #[schema(max_length = 80)]
    pub agent: Option<String>,
    /// ... or sends the message to this conversation of the tenant.
    #[schema(max_length = 64)]
    pub conversation_id: Option<String>,
    /// The user message each firing sends.
    #[schema(min_length = 1)]
    pub message: String,
    /// A cron expression (five fields, or six with seconds; `@hourly`...), in `timezone`.
    #[schema(max_length = 128)]
    pub cron: Option<String>,
    /// A fixed interval: `15m`, `1h`, down to `1s`.
    #[schema(max_length = 32)]
    pub every: Option<String>,
    /// Once, at this time (RFC 3339).
    #[schema(max_length = 64)]
    pub at: Option<String>,
    /// An IANA time zone for `cron` (default `UTC`).
    #[schema(max_length = 64)]
    pub timezone: Option<String>,
    /// With `conversation_id`, when the conversation is busy: `skip` (default), `enqueue`
    /// or `interrupt`.
    pub if_busy: Option<String>,
    /// Firings missed while no node ran: `none` (default: skipped) or `one` (the latest
    /// runs once).
    pub catch_up: Option<String>,
    /// Default true.
    pub enabled: Option<bool>,
}

/// A schedule. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct ScheduleView {
    pub id: String,
    pub agent: Option<String>,
    pub conversation_id: Option<String>,
    pub message: String,
    pub cron: Option<String>,
    /// The interval in milliseconds.
    pub every_ms: Option<u64>,
    pub at: Option<String>,
    pub timezone: String,
    pub if_busy: String,
    pub catch_up: String,
    pub enabled: bool,
    /// Its next firing (RFC 3339); null when paused or done.
    pub next_fire_at: Option<String>,
    pub last_fire_at: Option<String>,
    pub created_at: String,
    pub updated_at: String,
}

/// `GET /v1/schedules`. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct ScheduleList {
    pub schedules: Vec<ScheduleView>,
}

/// One firing of a schedule. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct ScheduleRunView {
    pub fire_at: String,
    /// `claimed` (running now), `started`, `queued`, `skipped` or `failed`.
    pub status: String,
    pub conversation_id: Option<String>,
    pub outcome: Option<String>,
    pub started_at: Option<String>,
}

/// `GET /v1/schedules/{id}/runs`, newest first. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct ScheduleRunList {
    pub runs: Vec<ScheduleRunView>,
}

/// `GET /v1/schedules/{id}/runs`. *Extension.*
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RunsQuery {
    /// 1 to 500 (default 100).
    #[param(minimum = 1, maximum = 500)]
    pub limit: Option<u64>,
}

/// `GET /v1/usage`. *Extension.*
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct UsageQuery {
    /// The first day, `YYYY-MM-DD` (UTC; default: the first of this month).
    #[param(pattern = "^[0-9]{4}-[0-9]{2}-[0-9]{2}$")]
    pub from: Option<String>,
    /// The last day, `YYYY-MM-DD` (UTC; default: today).
    #[param(pattern = "^[0-9]{4}-[0-9]{2}-[0-9]{2}$")]
    pub to: Option<String>,
}

/// Tokens of one model.
#[derive(Debug, Serialize, ToSchema)]
pub struct ModelTokens {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// A budget where it stands in its period.
#[derive(Debug, Serialize, ToSchema)]
pub struct Budget {
    pub limit: u64,
    pub used: u64,
    /// `day` or `month`.
    pub period: &'static str,
    #[serde(serialize_with = "rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub resets_at: DateTime<Utc>,
}

/// `GET /v1/usage`: the tenant's tokens over the days asked for, and its budget.
#[derive(Debug, Serialize, ToSchema)]
pub struct UsageReport {
    pub tenant_id: String,
    pub from: String,
    pub to: String,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub by_model: std::collections::BTreeMap<String, ModelTokens>,
    #[schema(required = true)]
    pub budget: Option<Budget>,
    /// *Extension.* Each quota of the tenant (docs/security.md, "Quotas"): its limit and
    /// what the tenant holds now (counts marked per node are this node's; the workspace's
    /// bytes as last measured, absent before the first measurement).
    pub quotas: std::collections::BTreeMap<&'static str, QuotaUse>,
}

/// A quota's limit and use.
#[derive(Clone, Copy, Debug, Serialize, ToSchema)]
pub struct QuotaUse {
    pub limit: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub used: Option<u64>,
}

/// `GET /v1/conversations/{id}/messages`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct MessagesQuery {
    /// Messages with a sequence id above this (default 0).
    pub after: Option<i64>,
    /// 1 to 1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<u64>,
}

/// An image sent with a user message.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ImageIn {
    /// `image/png`, `image/jpeg`, `image/gif` or `image/webp`.
    pub media_type: String,
    /// Base64 (a data URL is accepted too).
    pub data: String,
}

/// `POST /v1/conversations/{id}/messages`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SendMessage {
    pub text: String,
    #[serde(default, deserialize_with = "objects")]
    pub images: Option<Vec<ImageIn>>,
    /// The client's idempotency key: a repeat returns the original message.
    pub message_id: Option<String>,
}

/// What a message does when a turn is running.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum IfBusy {
    /// 409 `agent_busy` (the default).
    #[default]
    Reject,
    /// The running turn is cancelled as by `/cancel` and this message accepted, in one step.
    Interrupt,
    /// The message waits for the running turn to end and starts the next one, in arrival
    /// order. *Extension.*
    Enqueue,
    /// The message joins the running turn at its next LLM step, after the tool results that
    /// are due, without stopping what runs. *Extension.*
    Steer,
}

/// A message that waits in a busy conversation. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct WaitingMessage<'a> {
    /// Its id while it waits (`DELETE .../queue/{queued_id}` takes it back).
    pub queued_id: &'a str,
    /// Its place among the messages that wait, from 1 (steering ones first).
    #[schema(minimum = 1)]
    pub position: usize,
    /// `enqueue` or `steer`.
    pub kind: &'static str,
}

/// The answer to a message that waits (`if_busy=enqueue` or `steer` while a turn runs).
/// *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct Waiting<'a> {
    pub queued: WaitingMessage<'a>,
}

/// The 202 of a send: the stored message, or (for a message that waits) where it waits.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum SendReply<'a> {
    Sent(Sent<'a>),
    Waiting(Waiting<'a>),
}

/// A message that waits, as `GET .../queue` lists it. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct QueuedView<'a> {
    pub queued_id: &'a str,
    /// `enqueue` or `steer`.
    pub kind: &'static str,
    pub text: &'a str,
    /// How many images it carries.
    pub images: usize,
}

/// `GET /v1/conversations/{id}/queue`. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct QueueList<'a> {
    /// In the order they go in: steering messages (at the running turn's next LLM step),
    /// then queued ones (each starts a turn).
    pub queued: Vec<QueuedView<'a>>,
}

/// The query of `POST /v1/conversations/{id}/cancel`.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct CancelQuery {
    /// Also take back every message that waits (`if_busy=enqueue`, `steer`); by default
    /// they go on, the first starting the next turn. *Extension.*
    pub clear_queue: Option<bool>,
}

/// The query of `POST /v1/conversations/{id}/messages`.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct SendQuery {
    /// `reject` (default), `interrupt`, `enqueue` or `steer`.
    pub if_busy: Option<IfBusy>,
}

/// `POST /v1/conversations/{id}/events`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PostEvent {
    #[schema(value_type = ClientEvent)]
    pub event: SystemEvent,
}

/// A system event a client may post: `type` plus the fields of that type (kept and passed
/// on). The schema of `PostEvent.event`; the server's own types are refused.
#[derive(Debug, ToSchema)]
#[allow(dead_code)]
pub struct ClientEvent {
    #[schema(rename = "type")]
    event_type: ClientEventType,
}

/// The system event types a client may post.
#[derive(Debug, ToSchema)]
#[schema(rename_all = "snake_case")]
#[allow(dead_code)]
pub enum ClientEventType {
    UserRequest,
    UserResponse,
    ApprovalResponse,
}

/// An SSE event of `GET /v1/conversations/{id}/stream`: `event` is the frame's type, `id`
/// its event id (durable frames), `data` its JSON (a `ServerFrame`).
#[derive(Debug, ToSchema)]
#[allow(dead_code)]
pub struct SseEvent {
    event: String,
    id: Option<String>,
    /// A `ServerFrame` as JSON.
    data: String,
}

/// A field that holds an object (or null): serde's derive would take a struct from an
/// array too (`[1, 2]` for `{a, b}`), which the contract does not allow.
fn object<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::de::DeserializeOwned,
{
    use serde::de::Error as _;
    match Option::<Value>::deserialize(deserializer)? {
        None | Some(Value::Null) => Ok(None),
        Some(value) if value.is_object() => serde_json::from_value(value)
            .map(Some)
            .map_err(D::Error::custom),
        Some(_) => Err(D::Error::custom("expected an object")),
    }
}

/// A field that holds a list of objects (or null), as [`object`] takes one.
fn objects<'de, D, T>(deserializer: D) -> Result<Option<Vec<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::de::DeserializeOwned,
{
    use serde::de::Error as _;
    match Option::<Value>::deserialize(deserializer)? {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => items
            .into_iter()
            .map(|item| {
                if item.is_object() {
                    serde_json::from_value(item).map_err(D::Error::custom)
                } else {
                    Err(D::Error::custom("expected a list of objects"))
                }
            })
            .collect::<Result<Vec<T>, _>>()
            .map(Some),
        Some(_) => Err(D::Error::custom("expected a list of objects")),
    }
}

/// A tool the conversation's client runs, as an agent or a create request declares it.
/// *Extension.*
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClientToolBody {
    /// Its name, as the LLM calls it: 1 to 64 of `A-Za-z0-9_-`, without `__` (the MCP
    /// tools' separator), and not a built-in tool's.
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    pub name: String,
    /// What the LLM is told it does (at most 2000 bytes).
    #[schema(max_length = 2000)]
    pub description: Option<String>,
    /// A JSON Schema of its input: an object whose `type` is `"object"` (at most 16 KiB as
    /// JSON).
    #[schema(value_type = Object)]
    pub input_schema: Value,
    /// How long a call waits for the client's answer (default:
    /// `[requests] client_tool_timeout_ms`; at most `max_timeout_ms`).
    #[schema(minimum = 1)]
    pub timeout_ms: Option<u64>,
}

/// A client tool as a conversation or an agent version shows it. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct ClientToolView<'a> {
    pub name: &'a str,
    pub description: &'a str,
    #[schema(value_type = Object)]
    pub input_schema: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// The client tools as the API shows them.
pub fn client_tools(tools: &[crate::model::ClientTool]) -> Vec<ClientToolView<'_>> {
    tools
        .iter()
        .map(|tool| ClientToolView {
            name: &tool.name,
            description: &tool.description,
            input_schema: &tool.input_schema,
            timeout_ms: tool.timeout_ms,
        })
        .collect()
}

/// `POST /v1/conversations/{id}/tool_results/{call_id}`. *Extension.*
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolResultBody {
    /// What the tool gave: the call's result as the LLM sees it (cut to the tools' output
    /// cap).
    pub output: String,
    /// The tool failed: the LLM sees a failed result.
    #[serde(default)]
    pub is_error: bool,
}

/// The answer to `POST /v1/conversations/{id}/tool_results/{call_id}`. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct ToolResultTaken<'a> {
    pub answered: bool,
    pub call_id: &'a str,
}

/// A call of a client tool. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct ClientToolCallView<'a> {
    pub call_id: &'a str,
    pub tool_use_id: &'a str,
    pub name: &'a str,
    #[schema(value_type = Object)]
    pub input: &'a Value,
    /// `pending`, `answered`, `expired` or `cancelled`.
    pub status: &'a str,
    /// The answer's output, once answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<&'a str>,
    /// With an answer: whether the client said the tool failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub is_error: Option<bool>,
    #[serde(serialize_with = "rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub expires_at: DateTime<Utc>,
    #[serde(serialize_with = "rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: DateTime<Utc>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub resolved_at: Option<String>,
}

/// A client tool call as the API shows it.
pub fn client_tool_call(call: &crate::model::ClientToolCall) -> ClientToolCallView<'_> {
    let answered = call.status == crate::model::RequestStatus::Answered;
    ClientToolCallView {
        call_id: &call.id,
        tool_use_id: &call.tool_use_id,
        name: &call.name,
        input: &call.input,
        status: call.status.as_str(),
        output: call.output.as_deref(),
        is_error: answered.then_some(call.is_error),
        expires_at: call.expires_at,
        created_at: call.created_at,
        resolved_at: call.resolved_at.map(|at| at.to_rfc3339()),
    }
}

/// `GET /v1/conversations/{id}/client_tool_calls`. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct ClientToolCallList<'a> {
    /// Newest first, at most 100.
    pub calls: Vec<ClientToolCallView<'a>>,
}

/// `GET /v1/conversations/{id}/client_tool_calls` queries.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ClientToolCallQuery {
    /// Only the calls that wait for an answer.
    pub pending: Option<bool>,
}

/// `POST /v1/conversations/{id}/requests/{request_id}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Respond {
    /// Checked against the request's kind once the request is found.
    #[schema(value_type = Reply)]
    pub payload: Value,
}

/// Live-stream queries.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct StreamQuery {
    /// Replay the durable frames after this event id, then go on live.
    pub after_event_id: Option<i64>,
    /// The API key, for clients that cannot set headers (browsers).
    #[allow(dead_code)]
    pub access_token: Option<String>,
}

// ---------------------------------------------------------------------------------------
// Server-to-client requests, replies and system events.

/// A client's answer to a request; it must fit the request's kind (or cancel it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    Confirmed(bool),
    Text(String),
    Selected(Vec<String>),
    Custom(Value),
    /// Always `true`.
    Cancelled(bool),
}

/// A pending server-to-client request, in a snapshot.
#[derive(Debug, Serialize, ToSchema)]
pub struct PendingRequest<'a> {
    pub request_id: &'a str,
    #[schema(value_type = RequestType)]
    pub request_type: &'a Value,
    pub timeout_ms: i64,
    #[serde(serialize_with = "rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub expires_at: DateTime<Utc>,
    #[schema(required = true)]
    pub tool_use_id: Option<&'a str>,
}

pub fn pending_request(request: &ClientRequest) -> PendingRequest<'_> {
    PendingRequest {
        request_id: &request.id,
        request_type: &request.request_type,
        timeout_ms: request.timeout_ms,
        expires_at: request.expires_at,
        tool_use_id: request.tool_use_id.as_deref(),
    }
}

// ---------------------------------------------------------------------------------------
// Response bodies.

/// `GET /v1/conversations`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ConversationPage<'a> {
    pub conversations: Vec<Conversation<'a>>,
    /// Pass as `cursor` for the next page; null on the last.
    #[schema(required = true)]
    pub next_cursor: Option<&'a str>,
}

/// `GET /v1/conversations/{id}/children`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ConversationList<'a> {
    pub conversations: Vec<Conversation<'a>>,
}

/// `GET /v1/conversations/{id}/messages`.
#[derive(Debug, Serialize, ToSchema)]
pub struct MessageList<'a> {
    pub messages: Vec<Message<'a>>,
}

/// A message sent: 202 when new, 200 for a repeat of its `message_id`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Sent<'a> {
    pub message: Message<'a>,
}

/// `POST /v1/conversations/{id}/cancel`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Cancelled<'a> {
    pub state: State<'a>,
    /// What the cancel stopped. *Extension.*
    pub stopped: Stopped<'a>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Stopped<'a> {
    /// Tool calls whose runs were stopped.
    pub tools: &'a [String],
    /// Sub-agents stopped.
    pub sub_agents: &'a [String],
    /// Whether an LLM request was aborted.
    pub llm_request: bool,
}

/// `POST /v1/conversations/{id}/events`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Queued<'a> {
    pub queued: bool,
    pub event_type: &'a str,
}

/// `POST /v1/conversations/{id}/requests/{request_id}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Answered<'a> {
    pub answered: bool,
    pub request_id: &'a str,
}

/// A background task. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct Task<'a> {
    pub task_id: &'a str,
    pub tool_use_id: &'a str,
    pub tool_name: &'a str,
    pub command: &'a str,
    /// `running`, `completed`, `failed` or `cancelled`.
    pub status: &'a str,
    #[schema(required = true)]
    pub exit_code: Option<i32>,
    #[schema(required = true)]
    pub output: Option<&'a str>,
    #[serde(serialize_with = "rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: DateTime<Utc>,
    #[serde(serialize_with = "rfc3339_opt")]
    #[schema(value_type = Option<String>, format = DateTime, required = true)]
    pub finished_at: Option<DateTime<Utc>>,
}

/// A background task as listed on its conversation.
pub fn background_task(task: &BackgroundTask) -> Task<'_> {
    Task {
        task_id: &task.id,
        tool_use_id: &task.tool_use_id,
        tool_name: &task.tool_name,
        command: &task.command,
        status: task.status.as_str(),
        exit_code: task.exit_code,
        output: task.output.as_deref(),
        created_at: task.created_at,
        finished_at: task.finished_at,
    }
}

/// `GET /v1/conversations/{id}/tasks`.
#[derive(Debug, Serialize, ToSchema)]
pub struct TaskList<'a> {
    pub tasks: Vec<Task<'a>>,
}

/// `POST /v1/conversations/{id}/tasks/{task_id}/cancel`.
#[derive(Debug, Serialize, ToSchema)]
pub struct TaskReply<'a> {
    pub task: Task<'a>,
}

/// `GET /healthz`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// `ok`.
    pub status: &'static str,
}

/// `GET /readyz`: 200 when the database answers, 503 when not.
#[derive(Debug, Serialize, ToSchema)]
pub struct Ready {
    /// `ready` or `unavailable`.
    pub status: &'static str,
    /// `ok` or `unavailable` (why is in the log, and at the operator listener's `/status`).
    pub database: String,
    /// Whether tool processes are confined: `mode` (`enforce` or `off`), with a `warning`
    /// when off (docs/security.md). The details are at the operator listener's `/status`.
    #[schema(value_type = Object)]
    pub sandbox: Value,
    /// This node of a cluster (Postgres): its id and how many conversations' leases it holds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<NodeInfo>,
}

/// A node of a cluster, as `/readyz` shows it.
#[derive(Debug, Serialize, ToSchema)]
pub struct NodeInfo {
    pub id: String,
    pub conversations_owned: u64,
}

// ---------------------------------------------------------------------------------------
// Live-stream frames.

/// A frame the server sends on the WebSocket (and, as `event:`/`data:`, on SSE). Durable
/// frames carry `event_id`: per conversation, from 1, strictly increasing, stored.
#[derive(Debug, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerFrame<'a> {
    /// First on every connection.
    Snapshot {
        conversation: Conversation<'a>,
        /// The most recent, up to 50, ascending.
        messages: Vec<Message<'a>>,
        pending_requests: Vec<PendingRequest<'a>>,
        /// Client tool calls that wait for the client's answer; absent when none does.
        /// *Extension.*
        #[serde(skip_serializing_if = "Vec::is_empty")]
        pending_client_tool_calls: Vec<ClientToolCallView<'a>>,
        /// The latest durable frame's (0 when there is none).
        event_id: i64,
    },
    State {
        state: State<'a>,
        event_id: i64,
    },
    Message {
        message: Message<'a>,
        event_id: i64,
    },
    /// Streamed LLM text of the message being generated. Not durable.
    Delta {
        text: &'a str,
        /// Streamed thinking of the model, for backends that stream it (`text` is then
        /// empty). *Extension.*
        #[serde(skip_serializing_if = "Option::is_none")]
        reasoning: Option<&'a str>,
    },
    Retrying {
        attempt: u32,
        delay_ms: u64,
        error_kind: ErrorKind,
        event_id: i64,
    },
    /// A tool's progress (a background task's output lines). Not durable.
    ToolProgress {
        tool_use_id: &'a str,
        tool_name: &'a str,
        #[serde(skip_serializing_if = "Option::is_none")]
        task_id: Option<&'a str>,
        stage: &'a str,
        #[schema(required = true)]
        progress: Option<f64>,
        message: &'a str,
    },
    /// A sub-agent of this conversation changed state or took an LLM step: enough for a
    /// client to draw the tree live. Not durable (`GET /children` after a reconnect).
    /// *Extension.*
    SubAgent {
        agent_id: &'a str,
        state: State<'a>,
        /// LLM steps its turn has taken (the last count once it has ended).
        steps: u32,
        /// Its steps before the grace turn.
        max_steps: u32,
    },
    ClientRequest {
        request_id: &'a str,
        request_type: &'a RequestType,
        timeout_ms: i64,
        #[schema(required = true)]
        tool_use_id: Option<&'a str>,
        event_id: i64,
    },
    /// A request was answered (here or on another connection), expired or cancelled.
    /// *Extension.*
    ClientRequestResolved {
        request_id: &'a str,
        /// `answered`, `expired` or `cancelled`.
        status: &'a str,
        event_id: i64,
    },
    ContextWarning {
        context_tokens: u64,
        context_window: u64,
        ratio: f64,
        event_id: i64,
    },
    /// The LLM called one of the conversation's client tools: the client runs it and answers
    /// once (`client_tool_result`, or `POST .../tool_results/{call_id}`) before
    /// `expires_at`. *Extension.*
    ClientToolCall {
        call_id: &'a str,
        tool_use_id: &'a str,
        name: &'a str,
        #[schema(value_type = Object)]
        input: &'a Value,
        #[schema(value_type = String, format = DateTime)]
        expires_at: &'a str,
        event_id: i64,
    },
    /// A client tool call was answered (here or elsewhere), expired or cancelled.
    /// *Extension.*
    ClientToolResolved {
        call_id: &'a str,
        /// `answered`, `expired` or `cancelled`.
        status: &'a str,
        event_id: i64,
    },
    SystemEvent {
        event: Cow<'a, SystemEvent>,
        event_id: i64,
    },
    /// The answer to a client frame that was refused. Not durable.
    Rejected {
        code: &'a str,
        message: &'a str,
    },
    /// The answer to a `user_message` that waits for the running turn (`if_busy`
    /// `enqueue` or `steer`): where it waits. Sent to that client only; not durable.
    /// *Extension.*
    Queued {
        queued_id: &'a str,
        #[schema(minimum = 1)]
        position: usize,
        /// `enqueue` or `steer`.
        kind: &'a str,
    },
    Pong,
    /// Frames `from_event_id..=to_event_id` are no longer stored (`[events] retain`): the
    /// snapshot before it and the message frames after it stand for them. Not durable.
    /// *Extension.*
    Gap {
        from_event_id: i64,
        to_event_id: i64,
    },
    /// SSE only: the server closes the stream (`code` 4008: reconnect with your last event
    /// id; 1001: shutting down). Not durable.
    Closing {
        code: u16,
        reason: &'a str,
    },
}

impl ServerFrame<'_> {
    /// The frame's `type`.
    pub fn kind(&self) -> &'static str {
        match self {
            ServerFrame::Snapshot { .. } => "snapshot",
            ServerFrame::State { .. } => "state",
            ServerFrame::Message { .. } => "message",
            ServerFrame::Delta { .. } => "delta",
            ServerFrame::Retrying { .. } => "retrying",
            ServerFrame::ToolProgress { .. } => "tool_progress",
            ServerFrame::SubAgent { .. } => "sub_agent",
            ServerFrame::ClientRequest { .. } => "client_request",
            ServerFrame::ClientRequestResolved { .. } => "client_request_resolved",
            ServerFrame::ContextWarning { .. } => "context_warning",
            ServerFrame::ClientToolCall { .. } => "client_tool_call",
            ServerFrame::ClientToolResolved { .. } => "client_tool_resolved",
            ServerFrame::SystemEvent { .. } => "system_event",
            ServerFrame::Rejected { .. } => "rejected",
            ServerFrame::Queued { .. } => "queued",
            ServerFrame::Pong => "pong",
            ServerFrame::Closing { .. } => "closing",
            ServerFrame::Gap { .. } => "gap",
        }
    }

    /// The event id of a durable frame (a snapshot's is the latest's, and it is not one).
    pub fn event_id(&self) -> Option<i64> {
        match self {
            ServerFrame::State { event_id, .. }
            | ServerFrame::Message { event_id, .. }
            | ServerFrame::Retrying { event_id, .. }
            | ServerFrame::ClientRequest { event_id, .. }
            | ServerFrame::ClientRequestResolved { event_id, .. }
            | ServerFrame::ContextWarning { event_id, .. }
            | ServerFrame::ClientToolCall { event_id, .. }
            | ServerFrame::ClientToolResolved { event_id, .. }
            | ServerFrame::SystemEvent { event_id, .. } => Some(*event_id),
            ServerFrame::Snapshot { .. }
            | ServerFrame::Delta { .. }
            | ServerFrame::ToolProgress { .. }
            | ServerFrame::SubAgent { .. }
            | ServerFrame::Rejected { .. }
            | ServerFrame::Queued { .. }
            | ServerFrame::Pong
            | ServerFrame::Closing { .. }
            | ServerFrame::Gap { .. } => None,
        }
    }
}

/// A frame as the hub carries it: its JSON, made once.
pub fn frame(frame: &ServerFrame<'_>) -> crate::hub::Frame {
    crate::hub::Frame::new(frame.kind(), frame.event_id(), to_json(frame).into())
}

/// The contract's frames for the runtime's notices (src/notice.rs): the encoder the
/// composition root hands to the runtime.
#[derive(Clone, Copy, Debug, Default)]
pub struct Frames;

impl crate::notice::Encode for Frames {
    fn frame(&self, notice: Notice<'_>, event_id: Option<i64>) -> crate::notice::Encoded {
        // Durable notices always come with their id; a lost id would be a bug upstream,
        // written as 0 rather than a panic.
        let id = event_id.unwrap_or_default();
        let frame = match notice {
            Notice::Message {
                message: record,
                context_window,
            } => ServerFrame::Message {
                message: message(record, context_window),
                event_id: id,
            },
            Notice::State(conv) => ServerFrame::State {
                state: state(conv),
                event_id: id,
            },
            Notice::Retrying {
                attempt,
                delay_ms,
                error_kind,
            } => ServerFrame::Retrying {
                attempt,
                delay_ms,
                error_kind: error_kind.into(),
                event_id: id,
            },
            Notice::ContextWarning {
                context_tokens,
                context_window,
                ratio,
            } => ServerFrame::ContextWarning {
                context_tokens,
                context_window,
                ratio,
                event_id: id,
            },
            Notice::SystemEvent(event) => ServerFrame::SystemEvent {
                event: Cow::Borrowed(event),
                event_id: id,
            },
            Notice::ClientRequest {
                request_id,
                request_type,
                timeout_ms,
                tool_use_id,
            } => ServerFrame::ClientRequest {
                request_id,
                request_type,
                timeout_ms,
                tool_use_id,
                event_id: id,
            },
            Notice::ClientRequestResolved { request_id, status } => {
                ServerFrame::ClientRequestResolved {
                    request_id,
                    status: status.as_str(),
                    event_id: id,
                }
            }
            Notice::ClientToolCall {
                call_id,
                tool_use_id,
                name,
                input,
                expires_at,
            } => ServerFrame::ClientToolCall {
                call_id,
                tool_use_id,
                name,
                input,
                expires_at,
                event_id: id,
            },
            Notice::ClientToolResolved { call_id, status } => ServerFrame::ClientToolResolved {
                call_id,
                status: status.as_str(),
                event_id: id,
            },
            Notice::SubAgent {
                agent_id,
                state: conv,
                steps,
                max_steps,
            } => ServerFrame::SubAgent {
                agent_id,
                state: state(conv),
                steps,
                max_steps,
            },
            Notice::ToolProgress {
                tool_use_id,
                tool_name,
                task_id,
                stage,
                progress,
                message,
            } => ServerFrame::ToolProgress {
                tool_use_id,
                tool_name,
                task_id,
                stage,
                progress,
                message,
            },
            Notice::Delta { text, reasoning } => ServerFrame::Delta { text, reasoning },
        };
        crate::notice::Encoded {
            kind: frame.kind(),
            json: to_json(&frame),
        }
    }

    fn state(&self, conv: &ConvState) -> String {
        to_json(&state(conv))
    }

    fn same_state(&self, before: &ConvState, after: &ConvState) -> bool {
        state(before) == state(after)
    }

    fn tasks(&self, tasks: &[BackgroundTask]) -> Value {
        serde_json::to_value(TaskList {
            tasks: tasks.iter().map(background_task).collect(),
        })
        .unwrap_or(Value::Null)
    }
}

/// A frame a client sends on the WebSocket. Any other frame gets `rejected`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ClientFrame {
    UserMessage {
        text: String,
        #[serde(default)]
        images: Vec<ImageIn>,
        message_id: Option<String>,
        /// `interrupt`: cancel a running turn and start this one, in one step.
        #[serde(default)]
        if_busy: IfBusy,
    },
    Cancel,
    Respond {
        request_id: String,
        #[schema(value_type = Reply)]
        payload: Value,
    },
    SystemEvent {
        event: SystemEvent,
    },
    Ping,
    /// The result of a client tool call (`client_tool_call`), once. *Extension.*
    ClientToolResult {
        call_id: String,
        output: String,
        #[serde(default)]
        is_error: bool,
    },
}

/// Serialises a frame (it always serialises: strings, numbers and JSON values only).
pub fn to_json(frame: &impl Serialize) -> String {
    serde_json::to_string(frame).unwrap_or_else(|e| {
        tracing::error!(%e, "a frame did not serialise");
        String::from("{}")
    })
}

/// `GET /v1/conversations/{id}/trace`. *Extension.*
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TraceQuery {
    /// Steps after this one (`next_cursor` of the previous page; default: from the first).
    #[param(minimum = 0)]
    pub after: Option<i64>,
    /// 1 to 500 (default 100).
    #[param(minimum = 1, maximum = 500)]
    pub limit: Option<u64>,
}

/// One step of a conversation's core (the replay log, issue 40): the event it was given,
/// the state before and after, and the effects it asked for, re-run from the stored log.
#[derive(Debug, Serialize, ToSchema)]
pub struct TraceStepView {
    /// The step's number in the conversation, from 1.
    pub step: i64,
    /// When it was stored (RFC 3339).
    pub at: String,
    /// The event's kind (`user_message`, `llm_response`, `tool_complete`, ...).
    pub kind: String,
    /// The event as stored: the ids it carries; a field a message holds is given as that
    /// message's `msg` (its `sequence_id`) instead.
    #[schema(value_type = serde_json::Value)]
    pub event: Value,
    /// The `sequence_id` of the message the event refers to, if any.
    pub message: Option<i64>,
    #[schema(value_type = Object)]
    pub state_before: Value,
    #[schema(value_type = Object)]
    pub state_after: Value,
    /// The effects, in order (`persist_message`, `request_llm`, `execute_tool`, ...).
    #[schema(value_type = Vec<serde_json::Value>)]
    pub effects: Value,
    /// Whether this build decides the step as it was decided when stored.
    pub same: bool,
}

/// A page of a conversation's trace. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct TraceList {
    pub steps: Vec<TraceStepView>,
    /// Steps stored before the first one shown that retention cut off from the start of
    /// their segment (they cannot be re-run).
    pub skipped: u64,
    /// `after` for the next page; `null` on the last.
    pub next_cursor: Option<i64>,
    /// Where this build decides differently from the stored decision (or cannot read a
    /// step): the trace ends at that step. Absent when every step is the same.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub divergence: Option<TraceDivergence>,
}

/// The step where a trace ends because this build decides it differently. *Extension.*
#[derive(Debug, Serialize, ToSchema)]
pub struct TraceDivergence {
    pub step: i64,
    pub reason: String,
}
