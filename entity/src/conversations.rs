//! Conversations (and sub-agents, with `user_initiated = false` and a parent).
//!
//! The table also has `internal_key`, an integer the database assigns, by which messages and
//! rows of frames refer to their conversation (smaller rows and keys than the id). The
//! application never reads or sets it; the store finds it by id inside its statements.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
#[sea_orm(table_name = "conversations")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub tenant_id: String,
    pub slug: String,
    /// REQ-BED-010: fixed at creation.
    pub cwd: String,
    pub model: String,
    pub system_prompt: Option<String>,
    pub parent_conversation_id: Option<String>,
    pub user_initiated: bool,
    /// Tool names that need a client's approval before they run.
    pub require_approval: Json,
    /// Its tool processes asked for network access (granted per `sandbox.network`).
    pub network: bool,
    /// The state's kind (`idle`, `tool_executing`, ...), for queries.
    pub state: String,
    /// The whole state machine state, as JSON.
    pub state_data: Json,
    pub state_updated_at: DateTimeUtc,
    pub created_at: DateTimeUtc,
    pub updated_at: DateTimeUtc,
    pub archived: bool,
    pub input_tokens: i64,
    pub output_tokens: i64,
    pub context_tokens: i64,
    /// The sequence id the next message gets.
    pub next_sequence_id: i64,
    /// The event id the next durable frame gets.
    pub next_event_id: i64,
    /// The conversation this one was forked from, and the last message it copied.
    pub forked_from_id: Option<String>,
    pub forked_from_sequence: Option<i64>,
    pub budget_tokens: Option<i64>,
    pub continued_from_id: Option<String>,
    pub mcp_tools: Option<String>,
    /// The agent (name and version) it was created from.
    pub agent_name: Option<String>,
    pub agent_version: Option<i64>,
    /// The built-in tools it may use, as JSON (`None`: all of them).
    pub tools: Option<String>,
    /// Its agent's permission rules, as JSON (`None`: none).
    pub permissions: Option<String>,
    /// The tools its client runs, as JSON (`None`: none).
    pub client_tools: Option<String>,
    /// Its agent's pre-tool-use hook, as JSON (`None`: none).
    pub hooks: Option<String>,
    /// Its agent's limits, as JSON (`None`: the node's).
    pub limits: Option<String>,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
