//! A conversation actor's state, shared by its message loop (conversation.rs) and the
//! carrying out of its effects (effects.rs).

use std::collections::HashMap;
use std::sync::Arc;

use ractor::ActorId;

use super::Handles;
use super::cancel::CancelSlot;
use super::messages::ParentLink;
use super::turn::Turn;
use crate::model::ConversationRecord;
use crate::state_machine::{ConvContext, TurnId};

/// What a child actor of this conversation is doing.
#[derive(Debug)]
pub(super) enum Child {
    Tool { turn: TurnId, tool_use_id: String },
    Spawn { turn: TurnId, tool_use_id: String },
}

pub struct ConversationState {
    pub(super) record: ConversationRecord,
    pub(super) ctx: ConvContext,
    /// Where the conversation's replay log stands (src/replay).
    pub(super) recorder: crate::replay::Recorder,
    pub(super) handles: Arc<Handles>,
    pub(super) cancel: Arc<CancelSlot>,
    pub(super) parent: Option<ParentLink>,
    /// Children that report back as events, so a crash becomes a result.
    pub(super) children: HashMap<ActorId, Child>,
    /// The turn in progress.
    pub(super) turn: Option<Turn>,
    /// A sub-agent's progress as last shown to its parent's clients (state, steps).
    pub(super) shown: Option<(&'static str, u32)>,
    /// Commits with messages stored since the last LLM request, handed to the next one.
    pub(super) unsent: Vec<Arc<crate::model::ConversationCommit>>,
    /// The history as the LLM gets it, kept between requests while the actor lives.
    pub(super) history: crate::llm::HistoryHandle,
    pub(super) idle_generation: u64,
    pub(super) idle_timer: bool,
    pub(super) stopping: bool,
}

impl std::fmt::Debug for ConversationState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConversationState")
            .field("id", &self.record.id)
            .field("state", &self.record.state.kind())
            .finish_non_exhaustive()
    }
}

/// Whether new work must not start: this conversation or the server is stopping.
pub(super) fn starting_blocked(state: &ConversationState) -> bool {
    state.stopping || state.handles.lifecycle.is_shutting_down()
}
