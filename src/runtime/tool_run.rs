//! The tool run actor: one per tool run, supervised by its conversation.
//!
//! It runs the tool in a task of its own and reports a `ToolComplete` to the conversation
//! exactly once: the tool's outcome, or a failure if the run crashed.

use std::path::PathBuf;
use std::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::conversation::ConvMsg;
use crate::state_machine::{Event, ToolOutcome, ToolUse, TurnId};
use crate::tools::{self, ToolLimits};

#[derive(Debug)]
pub struct ToolRun;

pub struct ToolRunArgs {
    pub tool: ToolUse,
    pub turn: TurnId,
    pub cwd: PathBuf,
    pub limits: ToolLimits,
    pub cancel: CancellationToken,
    pub reply: ActorRef<ConvMsg>,
    pub span: tracing::Span,
}

impl std::fmt::Debug for ToolRunArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolRunArgs")
            .field("tool", &self.tool.name)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
pub enum ToolRunMsg {
    Done(ToolOutcome),
}

pub struct ToolRunState {
    args: ToolRunArgs,
    started: Instant,
}

impl std::fmt::Debug for ToolRunState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolRunState")
            .field("tool", &self.args.tool.name)
            .finish_non_exhaustive()
    }
}

impl Actor for ToolRun {
    type Msg = ToolRunMsg;
    type State = ToolRunState;
    type Arguments = ToolRunArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: ToolRunArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(ToolRunState {
            args,
            started: Instant::now(),
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let tool = state.args.tool.clone();
        let cwd = state.args.cwd.clone();
        let limits = state.args.limits.clone();
        let cancel = state.args.cancel.clone();
        let span = state.args.span.clone();
        tokio::spawn(async move {
            let run = tokio::spawn(
                async move { tools::run(&tool, cwd, &limits, cancel).await }.instrument(span),
            );
            let outcome = run.await.unwrap_or_else(|error| ToolOutcome {
                ok: false,
                output: format!("the tool run crashed: {error}"),
            });
            let _ = myself.cast(ToolRunMsg::Done(outcome));
        });
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            ToolRunMsg::Done(outcome) => {
                state.args.span.record("ok", outcome.ok);
                state
                    .args
                    .span
                    .record("duration_ms", state.started.elapsed().as_millis() as u64);
                let _ = state.args.reply.cast(ConvMsg::Event(Event::ToolComplete {
                    turn: state.args.turn.clone(),
                    tool_use_id: state.args.tool.id.clone(),
                    outcome,
                }));
                myself.stop(None);
            }
        }
        Ok(())
    }
}
