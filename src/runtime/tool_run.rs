//! The tool run actor: one per tool run, supervised by its conversation.
//!
//! It runs the tool in a task of its own and reports a `ToolComplete` to the conversation
//! exactly once: the tool's outcome, or a failure if the run crashed. It carries out the plan
//! the core made for the call (state_machine/plan.rs) and decides nothing itself: it asks the
//! client to confirm first when the plan says so, asks the user a question, starts a
//! background task, calls the tenant's MCP server, or runs the tool.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::Handles;
use super::admission::admit;
use super::background::TaskSpec;
use super::messages::ConvMsg;
use super::requests::{Asked, emit};
use crate::notice::{Keyed, RequestType, SelectOption, SystemEvent};
use crate::state_machine::{
    Event, Question, QuestionKind, ToolAction, ToolOutcome, ToolPlan, ToolUse, TurnId,
};
use crate::tools::{self, ToolLimits, failed, preview};

#[derive(Debug)]
pub struct ToolRun;

/// A tool run: the turn it answers in, its trace span, and the run its task owns.
pub struct ToolRunArgs {
    pub turn: TurnId,
    pub span: tracing::Span,
    pub run: Run,
}

impl std::fmt::Debug for ToolRunArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolRunArgs")
            .field("tool", &self.run.tool.name)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
pub enum ToolRunMsg {
    Done(ToolOutcome),
}

/// What the actor keeps to report the outcome; the run itself went to its task.
pub struct ToolRunState {
    turn: TurnId,
    span: tracing::Span,
    tool: ToolUse,
    conversation: ActorRef<ConvMsg>,
    handles: Arc<Handles>,
    run: Option<Run>,
    started: Instant,
}

impl std::fmt::Debug for ToolRunState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolRunState")
            .field("tool", &self.tool.name)
            .finish_non_exhaustive()
    }
}

/// What a run needs, owned by its task.
pub struct Run {
    pub tool: ToolUse,
    pub cwd: PathBuf,
    pub limits: ToolLimits,
    pub cancel: CancellationToken,
    /// The conversation it runs for: it answers there, and emits its requests' frames there.
    pub conversation: ActorRef<ConvMsg>,
    pub handles: Arc<Handles>,
    pub conversation_id: String,
    /// How it runs, as the core decided.
    pub plan: ToolPlan,
    pub tenant_id: String,
    /// The conversation's tools of its tenant's MCP servers.
    pub mcp_tools: Arc<Vec<crate::model::McpTool>>,
    /// The tools its client runs.
    pub client_tools: Arc<Vec<crate::model::ClientTool>>,
    /// Its agent's pre-tool-use hook, asked before the call runs.
    pub hook: Option<Arc<super::hooks::HookRun>>,
    /// The call's key (`turn:step:tool_use_id`): what a client tool's call is stored under.
    pub key: String,
}

/// What a client tool's call needs of a run.
fn asking(run: &Run) -> super::client_tools::Asking<'_> {
    super::client_tools::Asking {
        handles: &run.handles,
        tenant_id: &run.tenant_id,
        conversation: &run.conversation,
        conversation_id: &run.conversation_id,
        tool: &run.tool,
        key: run.key.clone(),
        tools: &run.client_tools,
        cancel: &run.cancel,
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
            turn: args.turn,
            span: args.span,
            tool: args.run.tool.clone(),
            conversation: args.run.conversation.clone(),
            handles: args.run.handles.clone(),
            run: Some(args.run),
            started: Instant::now(),
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let Some(run) = state.run.take() else {
            return Ok(());
        };
        let span = state.span.clone();
        // Boxed: a task's future is copied as the task is made and again as it ends, and a
        // run's is some 8 KB (issue 41). A panic of the run is caught in the same task.
        tokio::spawn(Box::pin(async move {
            let outcome = crate::crash::caught(Box::pin(execute(run).instrument(span)))
                .await
                .unwrap_or_else(|error| failed(format!("the tool run crashed: {error}")));
            let _ = myself.cast(ToolRunMsg::Done(outcome));
        }));
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
                // One record for both: each makes the log's layer write the span's fields
                // again.
                let duration_ms = state.started.elapsed().as_millis() as u64;
                tracing::record_all!(state.span, ok = outcome.ok, duration_ms = duration_ms);
                state.handles.metrics.tool_run(&state.tool.name, outcome.ok);
                let _ = state.conversation.cast(ConvMsg::event(Event::ToolComplete {
                    turn: state.turn.clone(),
                    tool_use_id: state.tool.id.clone(),
                    outcome,
                }));
                myself.stop(None);
            }
        }
        Ok(())
    }
}

async fn execute(mut run: Run) -> ToolOutcome {
    // A client tool's call made before a restart was asked about (hook, approval) then.
    // A client tool's call is read once: whether it was asked already, and where it stands.
    let stored = if run.plan.action == ToolAction::Client {
        Some(Box::pin(super::client_tools::stored(&asking(&run))).await)
    } else {
        None
    };
    let asked = matches!(stored, Some(Ok(Some(_))));
    if !asked
        && let Some(hook) = run.hook.clone()
        && let Err(refused) = Box::pin(ask_hook(&mut run, &hook)).await
    {
        return refused;
    }
    let asking = asking(&run);
    if run.plan.approval
        && !asked
        && let Err(refused) = approve(&run).await
    {
        return refused;
    }
    match &run.plan.action {
        // Boxed, as the rarer arms below: a turn's future stays the size of its usual work.
        ToolAction::Client => {
            Box::pin(super::client_tools::run(
                &asking,
                stored.unwrap_or(Ok(None)),
            ))
            .await
        }
        ToolAction::Mcp => match run.mcp_tools.iter().find(|t| t.name == run.tool.name) {
            Some(tool) => mcp_tool(&run, tool).await,
            None => failed(format!("unknown tool `{}`", run.tool.name)),
        },
        ToolAction::Ask(question) => ask_user(&run, question).await,
        ToolAction::Background {
            command,
            timeout_ms,
            wake,
        } => background(&run, command, *timeout_ms, *wake).await,
        // Tools that work in the workspace (bash's process, patch and keyword_search on the
        // server's blocking threads) take one of the tenant's slots.
        ToolAction::Workspace => {
            // A slot of the tenant's, waiting behind its own tools only, at most the run's
            // own default time limit.
            let _slot = match admit(
                &run.handles.quotas,
                &run.tenant_id,
                run.limits.bash_timeout,
                &run.cancel,
            )
            .await
            {
                Ok(slot) => slot,
                Err(refused) => return refused,
            };
            tools::run(&run.tool, run.cwd.clone(), &run.limits, run.cancel.clone()).await
        }
        ToolAction::Direct => {
            tools::run(&run.tool, run.cwd.clone(), &run.limits, run.cancel.clone()).await
        }
    }
}

/// A tool of the tenant's MCP server: called on the server registered under its name now
/// (a server removed since is a failed result), under the same time limit and output cap as
/// bash, cancelled with the turn.
async fn mcp_tool(run: &Run, tool: &crate::model::McpTool) -> ToolOutcome {
    let server = match run
        .handles
        .store
        .mcp_server(&run.tenant_id, &tool.server)
        .await
    {
        Ok(Some(server)) => server,
        Ok(None) => {
            return failed(format!(
                "the MCP server {} is no longer registered; {} cannot run",
                tool.server, tool.name
            ));
        }
        Err(e) => return failed(format!("cannot read the MCP server {}: {e}", tool.server)),
    };
    crate::mcp_client::call(
        &server,
        &run.handles.mcp_http,
        tool,
        &run.tool.input,
        run.limits.bash_timeout,
        &run.cancel,
        run.limits.output_cap_bytes,
    )
    .await
}

/// Asks the agent's pre-tool-use hook about the call, stores its decision with the call
/// (a durable system event), and applies it: a denied call does not run; an allowed one
/// needs no approval, one to ask about does; a replaced input is planned again by the core,
/// whose rules still hold.
async fn ask_hook(run: &mut Run, hook: &super::hooks::HookRun) -> Result<(), ToolOutcome> {
    let asked = super::hooks::ask(&run.handles.mcp_http, hook, &run.conversation_id, &run.tool);
    let (verdict, stored) = tokio::select! {
        answer = asked => answer,
        () = run.cancel.cancelled() => return Err(failed("cancelled before the hook answered")),
    };
    let event = Keyed::system_event(SystemEvent::new("pre_tool_use_decision", stored), None);
    let _ = emit(&run.conversation, vec![event]).await;
    match verdict {
        super::hooks::Verdict::Deny(why) => Err(failed(why)),
        super::hooks::Verdict::Run { approval, input } => {
            if let Some(input) = input {
                let replaced = ToolUse {
                    input,
                    ..run.tool.clone()
                };
                let plan =
                    crate::state_machine::plan_tool(&hook.ctx, &replaced).map_err(|why| {
                        failed(format!(
                            "the input the pre-tool-use hook gave is refused: {why}"
                        ))
                    })?;
                run.tool = replaced;
                run.plan.action = plan.action;
            }
            if let Some(approval) = approval {
                run.plan.approval = approval;
            }
            Ok(())
        }
    }
}

/// Asks the client to approve the tool (the wallet flow, generalised).
async fn approve(run: &Run) -> Result<(), ToolOutcome> {
    let handles = &run.handles;
    let timeout = Duration::from_millis(handles.settings.requests.approval_timeout_ms);
    let tool = &run.tool;
    let request_type = RequestType::Confirm {
        message: format!(
            "Allow the agent to run {}?\n{}",
            tool.name,
            preview(&tool.input.to_string(), 2000)
        ),
        default: Some(false),
    };
    let (request_id, asked) = handles
        .requests
        .ask(
            handles,
            &run.tenant_id,
            &run.conversation_id,
            &run.conversation,
            Some(tool.id.clone()),
            request_type,
            timeout,
            &run.cancel,
            |id| {
                vec![Keyed::system_event(
                    SystemEvent::new(
                        "approval_request",
                        json!({
                            "request_id": id,
                            "tool_use_id": tool.id,
                            "tool_name": tool.name,
                            "input": tool.input,
                        }),
                    ),
                    None,
                )]
            },
        )
        .await;
    let (approved, reason) = match asked {
        Asked::Answered(payload) if payload["confirmed"] == Value::Bool(true) => {
            (true, "approved".to_owned())
        }
        Asked::Answered(_) => (
            false,
            format!(
                "the user denied permission to run {}; it did not run",
                tool.name
            ),
        ),
        Asked::TimedOut => (
            false,
            format!(
                "no approval came within {} s; {} did not run",
                timeout.as_secs(),
                tool.name
            ),
        ),
        Asked::Cancelled => (
            false,
            "the approval was cancelled; the tool did not run".to_owned(),
        ),
        Asked::Failed(why) => (
            false,
            format!("approval could not be requested ({why}); the tool did not run"),
        ),
    };
    let frame = Keyed::system_event(
        SystemEvent::new(
            "approval_response",
            json!({
                "request_id": request_id,
                "tool_use_id": tool.id,
                "tool_name": tool.name,
                "approved": approved,
                "reason": reason,
            }),
        ),
        None,
    );
    let _ = emit(&run.conversation, vec![frame]).await;
    if approved {
        Ok(())
    } else {
        Err(failed(reason))
    }
}

/// The ask_user tool: one question to the client; its answer is the tool's result.
async fn ask_user(run: &Run, question: &Question) -> ToolOutcome {
    let message = question.message.clone();
    let request_type = match &question.kind {
        QuestionKind::Confirm => RequestType::Confirm {
            message,
            default: None,
        },
        QuestionKind::Prompt => RequestType::Prompt {
            message,
            default: None,
            placeholder: None,
        },
        QuestionKind::Select { options } => RequestType::Select {
            message,
            options: options
                .iter()
                .map(|o| SelectOption {
                    value: o.clone(),
                    label: o.clone(),
                    description: None,
                })
                .collect(),
            multi_select: false,
        },
        QuestionKind::Custom { type_name, schema } => RequestType::Custom {
            type_name: type_name.clone(),
            schema: schema.clone(),
        },
    };
    let handles = &run.handles;
    // The model chooses its timeout (the broker keeps it within `requests.max_timeout_ms`).
    let timeout = match question.timeout_ms {
        Some(ms) => Duration::from_millis(ms),
        None => handles.settings.requests.timeout(question.kind.name()),
    };
    let (_, asked) = handles
        .requests
        .ask(
            handles,
            &run.tenant_id,
            &run.conversation_id,
            &run.conversation,
            Some(run.tool.id.clone()),
            request_type,
            timeout,
            &run.cancel,
            |_| Vec::new(),
        )
        .await;
    match asked {
        Asked::Answered(payload) => {
            if payload.get("cancelled") == Some(&Value::Bool(true)) {
                return failed("the user dismissed the question without answering");
            }
            let answer = if let Some(confirmed) = payload.get("confirmed").and_then(Value::as_bool)
            {
                if confirmed {
                    "yes".to_owned()
                } else {
                    "no".to_owned()
                }
            } else if let Some(text) = payload.get("text").and_then(Value::as_str) {
                text.to_owned()
            } else if let Some(selected) = payload.get("selected").and_then(Value::as_array) {
                selected
                    .iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(", ")
            } else if let Some(custom) = payload.get("custom") {
                custom.to_string()
            } else {
                payload.to_string()
            };
            ToolOutcome {
                ok: true,
                output: format!("the user answered: {answer}"),
            }
        }
        Asked::TimedOut => failed(format!(
            "the user did not answer within {} s",
            timeout.as_secs()
        )),
        Asked::Cancelled => failed("the question was cancelled"),
        Asked::Failed(why) => failed(format!("the question could not be asked: {why}")),
    }
}

/// bash with `background: true`: a task that outlives the call.
async fn background(run: &Run, command: &str, timeout_ms: Option<u64>, wake: bool) -> ToolOutcome {
    let timeout = timeout_ms.map_or(run.limits.bash_max_timeout, |ms| {
        Duration::from_millis(ms).min(run.limits.bash_max_timeout)
    });
    let spec = TaskSpec {
        conversation_id: run.conversation_id.clone(),
        tenant_id: run.tenant_id.clone(),
        tool_use_id: run.tool.id.clone(),
        command: command.to_owned(),
        cwd: run.cwd.clone(),
        timeout,
        limits: run.limits.clone(),
        wake,
    };
    match run.handles.background.start(&run.handles, spec).await {
        Ok(id) => ToolOutcome {
            ok: true,
            output: format!(
                "started background task {id}; its output streams to the user and its result will arrive later as a system message"
            ),
        },
        Err(why) => failed(why),
    }
}
