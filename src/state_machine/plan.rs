//! How a tool call the core does not settle itself is run: whether the client approves it
//! first, whether it is a question to the user, a background task, a tool of the tenant's
//! MCP server, or a tool that works in the workspace. The runtime carries the plan out
//! (src/runtime/tool_run.rs) and decides none of it.

use serde::Serialize;
use serde_json::Value;

use super::context::ConvContext;
use super::permissions::{Permission, decide};
use super::state::ToolUse;

/// The tool that asks the user a question; only user conversations have it.
pub const ASK_USER: &str = "ask_user";

/// The tools that work in the conversation's working directory. Each run takes one of the
/// tenant's tool slots (`[quotas] tool_runs`).
pub const WORKSPACE_TOOLS: [&str; 3] = ["bash", "patch", "keyword_search"];

/// How the runtime runs one tool call.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToolPlan {
    /// The client confirms before it runs (the tool is named in the conversation's
    /// `require_approval`); a refusal, a timeout or a cancel is the tool's result.
    pub approval: bool,
    pub action: ToolAction,
}

/// What the tool run does, once approved.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolAction {
    /// A tool of the tenant's MCP server, called on the server registered under its name.
    Mcp,
    /// A tool the conversation's client runs: the call waits for the client's answer, which
    /// is its result. A restart keeps it waiting.
    Client,
    /// One question to the user; the answer is the tool's result.
    Ask(Question),
    /// `bash` with `background: true`: a task that outlives the call; its result arrives
    /// later as a system message.
    Background {
        command: String,
        /// The model's time limit, if it gave one (the runtime bounds it).
        timeout_ms: Option<u64>,
        /// Start a turn when the result arrives.
        wake: bool,
    },
    /// A tool that works in the workspace ([`WORKSPACE_TOOLS`]): it takes a tool slot of the
    /// tenant's first.
    Workspace,
    /// Any other tool: run at once (an unknown name fails there).
    Direct,
}

/// A question of `ask_user`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Question {
    pub message: String,
    pub kind: QuestionKind,
    /// The model's time limit, if it gave one (the runtime bounds it).
    pub timeout_ms: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QuestionKind {
    Confirm,
    Prompt,
    Select { options: Vec<String> },
    Custom { type_name: String, schema: Value },
}

impl QuestionKind {
    /// Its name in `ask_user`'s input and in the configuration's timeouts.
    pub fn name(&self) -> &'static str {
        match self {
            QuestionKind::Confirm => "confirm",
            QuestionKind::Prompt => "prompt",
            QuestionKind::Select { .. } => "select",
            QuestionKind::Custom { .. } => "custom",
        }
    }
}

/// The plan for `tool`, or why it is refused without running (that reason is its result).
/// The agent's permission rules decide first: a denied call is refused, an allowed one
/// needs no approval, one to ask about does; no rule matching, `require_approval` decides.
pub fn plan(ctx: &ConvContext, tool: &ToolUse) -> Result<ToolPlan, String> {
    plan_decided(ctx, tool, decide(&ctx.permissions, &tool.name, &tool.input))
}

/// [`plan`] with the rules' decision already made (the transition makes it once per call).
pub(super) fn plan_decided(
    ctx: &ConvContext,
    tool: &ToolUse,
    permission: Permission,
) -> Result<ToolPlan, String> {
    let approval = match permission {
        Permission::Denied(why) => return Err(why),
        Permission::Allowed => false,
        Permission::Ask => true,
        Permission::Unruled => ctx.require_approval.contains(&tool.name),
    };
    let action = if ctx.is_client_tool(&tool.name) {
        ToolAction::Client
    } else if ctx.mcp_tools.contains(&tool.name) {
        ToolAction::Mcp
    } else {
        match tool.name.as_str() {
            ASK_USER if ctx.is_sub_agent => {
                return Err("ask_user is only available in user conversations".to_owned());
            }
            ASK_USER => ToolAction::Ask(question(&tool.input)?),
            "bash" if tool.input.get("background").and_then(Value::as_bool) == Some(true) => {
                background(&tool.input)?
            }
            name if WORKSPACE_TOOLS.contains(&name) => ToolAction::Workspace,
            _ => ToolAction::Direct,
        }
    };
    Ok(ToolPlan { approval, action })
}

fn positive_ms(input: &Value) -> Option<u64> {
    input
        .get("timeout_ms")
        .and_then(Value::as_u64)
        .filter(|ms| *ms > 0)
}

fn background(input: &Value) -> Result<ToolAction, String> {
    let Some(command) = input.get("command").and_then(Value::as_str) else {
        return Err("invalid arguments: `command` must be a string".to_owned());
    };
    Ok(ToolAction::Background {
        command: command.to_owned(),
        timeout_ms: positive_ms(input),
        wake: input
            .get("wake_on_result")
            .and_then(Value::as_bool)
            .unwrap_or(false),
    })
}

fn question(input: &Value) -> Result<Question, String> {
    let Some(message) = input.get("question").and_then(Value::as_str) else {
        return Err("invalid arguments: `question` must be a string".to_owned());
    };
    let kind = match input
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or("prompt")
    {
        "confirm" => QuestionKind::Confirm,
        "prompt" => QuestionKind::Prompt,
        "select" => {
            let options: Vec<String> = input
                .get("options")
                .and_then(Value::as_array)
                .map(|o| {
                    o.iter()
                        .filter_map(Value::as_str)
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default();
            if options.is_empty() {
                return Err(
                    "invalid arguments: select needs `options`, a list of strings".to_owned(),
                );
            }
            QuestionKind::Select { options }
        }
        "custom" => QuestionKind::Custom {
            type_name: input
                .get("type_name")
                .and_then(Value::as_str)
                .unwrap_or("custom")
                .to_owned(),
            schema: input.get("schema").cloned().unwrap_or(Value::Null),
        },
        other => {
            return Err(format!(
                "invalid arguments: kind must be confirm, prompt, select or custom, not {other:?}"
            ));
        }
    };
    Ok(Question {
        message: message.to_owned(),
        kind,
        timeout_ms: positive_ms(input),
    })
}
