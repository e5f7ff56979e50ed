//! A conversation's cancel path, reachable without its mailbox (REQ-BED-005).
//!
//! The API trips the current work's token directly (the LLM request is dropped, the tool's
//! process group killed at once) and leaves a request here; the conversation actor drains
//! the requests before any ordinary message, so a cancel wins over a completion that is
//! already queued.

use std::sync::Mutex;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::state_machine::{ConvState, TurnId};

/// What a cancel stopped, and where the conversation ended up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CancelOutcome {
    pub state: ConvState,
    pub stopped_tools: Vec<String>,
    pub stopped_sub_agents: Vec<String>,
    /// Whether an LLM request was aborted.
    pub aborted_llm: bool,
}

#[derive(Debug, Default)]
struct Inner {
    pending: Vec<oneshot::Sender<CancelOutcome>>,
    work: Option<CancellationToken>,
    /// The turn running as of the conversation's last commit.
    turn: Option<TurnId>,
}

#[derive(Debug, Default)]
pub struct CancelSlot {
    inner: Mutex<Inner>,
}

impl CancelSlot {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Leaves a cancel request and stops the current work at once. The caller then wakes the
    /// actor; the answer comes once the cancel is stored.
    pub fn request(&self) -> oneshot::Receiver<CancelOutcome> {
        let (tx, rx) = oneshot::channel();
        let mut inner = self.lock();
        inner.pending.push(tx);
        if let Some(work) = &inner.work {
            work.cancel();
        }
        rx
    }

    /// Takes every pending request (the actor's side).
    pub fn take(&self) -> Vec<oneshot::Sender<CancelOutcome>> {
        std::mem::take(&mut self.lock().pending)
    }

    pub fn has_pending(&self) -> bool {
        !self.lock().pending.is_empty()
    }

    /// A fresh token for the next piece of work; the previous one is done with.
    pub fn new_work(&self) -> CancellationToken {
        let token = CancellationToken::new();
        self.lock().work = Some(token.clone());
        token
    }

    /// The turn that runs now, as an interrupting send saw it when it arrived.
    pub fn running_turn(&self) -> Option<TurnId> {
        self.lock().turn.clone()
    }

    /// The actor's side: the turn that runs after its latest commit.
    pub fn set_running_turn(&self, turn: Option<&TurnId>) {
        let mut inner = self.lock();
        if inner.turn.as_ref() != turn {
            inner.turn = turn.cloned();
        }
    }

    /// Stops the current work, if any.
    pub fn stop_work(&self) {
        if let Some(work) = &self.lock().work {
            work.cancel();
        }
    }
}
