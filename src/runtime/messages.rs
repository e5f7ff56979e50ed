//! The mailboxes of the runtime's actors: what a conversation and a sub-agent supervisor
//! are sent, and the errors they answer with. Every file of the runtime that talks to a
//! conversation names these, not the actor that handles them.

use ractor::{ActorRef, RpcReplyPort};

use crate::model::{ConversationRecord, MessageRecord};
use crate::notice::Keyed;
use crate::state_machine::{Event, IfBusy, ImageRef, Rejection, SubAgentOutcome};

/// Why a user message was not accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    #[error(transparent)]
    Rejected(#[from] Rejection),
    #[error("the database is unavailable: {0}")]
    Unavailable(String),
    #[error("the server is shutting down")]
    ShuttingDown,
    /// A message with the same client message_id is already stored.
    #[error("duplicate message_id")]
    Duplicate,
}

/// A user message the conversation took: stored (its turn began), or waiting in the running
/// turn (`if_busy=enqueue` or `steer`).
#[derive(Clone, Debug, PartialEq)]
pub enum Accepted {
    Stored(MessageRecord),
    Waiting {
        /// Its id while it waits (the id of the turn it starts).
        id: String,
        /// Its place among the messages that wait, from 1 (steering ones first).
        position: usize,
        /// It joins the running turn at its next LLM step.
        steering: bool,
    },
}

/// A conversation's messages. Payloads are boxed so the enum, and with it every idle
/// actor's mailbox, stays small.
pub enum ConvMsg {
    /// A user message (REQ-BED-002). Answered once it is stored, or refused.
    Send(Box<SendRequest>),
    /// Wake up: the cancel slot has a request.
    Cancel,
    /// An answer from work this conversation started (LLM, tools, timers, sub-agents).
    Event(Box<Event>),
    /// The idle timer of the given generation fired.
    IdleCheck(u64),
    /// Store durable frames that no transition makes (client requests, system events).
    Emit(Box<EmitRequest>),
    /// The conversation as stored now (its actor holds every commit it made).
    Record(RpcReplyPort<ConversationRecord>),
    /// Graceful shutdown: interrupt the turn, store it, and stop.
    Shutdown(Box<RpcReplyPort<()>>),
    /// The user asks to continue in a new conversation: from rest, ask for the summary.
    /// Answered once the request for it is stored, or refused (issue 25).
    Summarize(RpcReplyPort<Result<(), SendError>>),
    /// The user takes back a waiting message (`None`: every one); answers whether one was
    /// (once stored).
    Dequeue(Option<String>, RpcReplyPort<bool>),
}

/// A user message for [`ConvMsg::Send`].
pub struct SendRequest {
    pub text: String,
    pub images: Vec<ImageRef>,
    pub client_message_id: Option<String>,
    pub if_busy: IfBusy,
    pub reply: RpcReplyPort<Result<Accepted, SendError>>,
}

/// Frames for [`ConvMsg::Emit`]. Answers false when a dedup key was already stored. Sent
/// by `cast` from work the conversation started (a tool run's task, a background task),
/// which waits on `reply`: nothing calls an ancestor.
pub struct EmitRequest {
    pub frames: Vec<Keyed>,
    pub reply: tokio::sync::oneshot::Sender<Result<bool, String>>,
}

impl std::fmt::Debug for SendRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendRequest")
            .field("images", &self.images.len())
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for EmitRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmitRequest")
            .field("frames", &self.frames.len())
            .finish_non_exhaustive()
    }
}

impl ConvMsg {
    pub fn send(
        text: String,
        images: Vec<ImageRef>,
        client_message_id: Option<String>,
        if_busy: IfBusy,
        reply: RpcReplyPort<Result<Accepted, SendError>>,
    ) -> ConvMsg {
        ConvMsg::Send(Box::new(SendRequest {
            text,
            images,
            client_message_id,
            if_busy,
            reply,
        }))
    }

    pub fn event(event: Event) -> ConvMsg {
        ConvMsg::Event(Box::new(event))
    }

    pub fn emit(
        frames: Vec<Keyed>,
        reply: tokio::sync::oneshot::Sender<Result<bool, String>>,
    ) -> ConvMsg {
        ConvMsg::Emit(Box::new(EmitRequest { frames, reply }))
    }

    pub fn shutdown(reply: RpcReplyPort<()>) -> ConvMsg {
        ConvMsg::Shutdown(Box::new(reply))
    }
}

impl std::fmt::Debug for ConvMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConvMsg::Send(_) => f.write_str("Send"),
            ConvMsg::Cancel => f.write_str("Cancel"),
            ConvMsg::Event(event) => write!(f, "Event({})", event.name()),
            ConvMsg::IdleCheck(generation) => write!(f, "IdleCheck({generation})"),
            ConvMsg::Emit(emit) => write!(f, "Emit({})", emit.frames.len()),
            ConvMsg::Record(_) => f.write_str("Record"),
            ConvMsg::Shutdown(_) => f.write_str("Shutdown"),
            ConvMsg::Summarize(_) => f.write_str("Summarize"),
            ConvMsg::Dequeue(..) => f.write_str("Dequeue"),
        }
    }
}

/// Who started a sub-agent, and which of its tasks the sub-agent is.
#[derive(Clone, Debug)]
pub struct ParentLink {
    pub supervisor: ActorRef<SupervisorMsg>,
    pub agent_id: String,
    /// The sub-agent's LLM steps before its grace turn.
    pub max_steps: u32,
}

/// A sub-agent supervisor's messages.
#[derive(Debug)]
pub enum SupervisorMsg {
    /// A sub-agent's outcome (its submit_result, or its failure).
    Report {
        agent_id: String,
        outcome: SubAgentOutcome,
    },
    /// A deadline of sub-agent `index`.
    Deadline { index: usize, kind: Deadline },
    /// A sub-agent's grace turn began (at its step or its time limit).
    GraceStarted { agent_id: String },
    /// The parent was cancelled.
    Cancelled,
}

/// The deadlines of a sub-agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deadline {
    /// Its time limit: its grace turn starts.
    Limit,
    /// The end of its grace turn: it fails.
    GraceOver,
    /// It did not answer the others: it is reported failed from here.
    LastResort,
}
