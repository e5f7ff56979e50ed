//! One test per row of the seeds' transition matrix (bedrock-design.md) and per extension of
//! the foundation issue, each comparing the whole `(state, effects)`.

use std::path::PathBuf;

use pretty_assertions::assert_eq;
use serde_json::json;

use super::*;

fn ctx() -> ConvContext {
    ConvContext {
        conversation_id: "c1".into(),
        working_dir: PathBuf::from("/work/c1"),
        model_id: "m".into(),
        is_sub_agent: false,
        limits: TurnLimits {
            max_llm_steps: 5,
            max_tool_calls: 4,
            max_sub_agents: 3,
            sub_agent_max_steps: 4,
            sub_agent_timeout_ms: 60_000,
            max_queued: 100,
            max_queued_bytes: 262_144,
        },
        context_window: 1000,
        context_tokens: 0,
        continuation_permille: 0,
        require_approval: Vec::new(),
        mcp_tools: Vec::new(),
        tools: None,
        permissions: Vec::new(),
        client_tools: Vec::new(),
    }
}

fn sub_ctx() -> ConvContext {
    ConvContext {
        is_sub_agent: true,
        ..ctx()
    }
}

fn tid(id: &str) -> TurnId {
    TurnId::new(id)
}

/// A turn `t1` that has made `steps` LLM steps and `tools` tool calls.
fn turn(steps: u32, tools: u32) -> Turn {
    Turn {
        llm_steps: steps,
        tool_calls: tools,
        ..Turn::new(tid("t1"))
    }
}

fn tag(steps: u32, attempt: u32) -> LlmRequestTag {
    LlmRequestTag {
        turn: tid("t1"),
        step: steps,
        attempt,
    }
}

fn tool(id: &str, name: &str) -> ToolUse {
    ToolUse {
        id: id.into(),
        name: name.into(),
        input: json!({"command": format!("echo {id}")}),
        extra: None,
    }
}

fn bash(id: &str) -> ToolUse {
    tool(id, "bash")
}

/// The plan of a workspace tool that needs no approval (bash, patch, keyword_search).
fn workspace() -> ToolPlan {
    ToolPlan {
        approval: false,
        action: ToolAction::Workspace,
    }
}

/// `tool` runs after `bash("a")` completes; the effects of that step.
#[track_caller]
fn after_a(ctx: &ConvContext, tool: ToolUse, plan: ToolPlan) {
    check(
        executing(bash("a"), vec![tool.clone()], 0),
        ctx,
        complete("a", true, "ok"),
        ConvState::ToolExecuting {
            turn: turn(1, 2),
            current: tool.clone(),
            remaining: vec![],
            completed: 1,
        },
        vec![
            result(&bash("a"), true, "ok", false),
            Effect::ExecuteTool {
                turn: tid("t1"),
                tool,
                plan,
            },
        ],
    );
}

/// `tool` is refused by its plan after `bash("a")` completes: its result is `why`, and the
/// next tool starts.
#[track_caller]
fn refused_after_a(ctx: &ConvContext, tool: ToolUse, why: &str) {
    let b = bash("b");
    check(
        executing(bash("a"), vec![tool.clone(), b.clone()], 0),
        ctx,
        complete("a", true, "ok"),
        ConvState::ToolExecuting {
            turn: turn(1, 3),
            current: b.clone(),
            remaining: vec![],
            completed: 2,
        },
        vec![
            result(&bash("a"), true, "ok", false),
            result(&tool, false, why, false),
            Effect::ExecuteTool {
                turn: tid("t1"),
                tool: b,
                plan: workspace(),
            },
        ],
    );
}

fn usage(input: u64, output: u64) -> Usage {
    Usage {
        input_tokens: input,
        output_tokens: output,
    }
}

fn reply(text: Option<&str>, tools: Vec<ToolUse>, end_turn: bool) -> LlmReply {
    LlmReply {
        text: text.map(str::to_owned),
        tool_uses: tools,
        end_turn,
        usage: usage(10, 5),
        reasoning: None,
    }
}

fn requesting(steps: u32, tools: u32, attempt: u32) -> ConvState {
    ConvState::LlmRequesting {
        turn: turn(steps, tools),
        attempt,
    }
}

fn executing(current: ToolUse, remaining: Vec<ToolUse>, completed: u32) -> ConvState {
    ConvState::ToolExecuting {
        turn: turn(1, 1 + remaining.len() as u32 + completed),
        current,
        remaining,
        completed,
    }
}

fn result(tool: &ToolUse, ok: bool, output: &str, cancelled: bool) -> Effect {
    Effect::PersistMessage(MessageContent::tool_result(tool, ok, output, cancelled))
}

fn user_message(text: &str) -> Event {
    Event::UserMessage {
        turn: tid("t1"),
        text: text.into(),
        images: vec![],
        if_busy: IfBusy::Reject,
    }
}

fn done(ok: bool, output: &str) -> ToolOutcome {
    ToolOutcome {
        ok,
        output: output.into(),
    }
}

fn complete(id: &str, ok: bool, output: &str) -> Event {
    Event::ToolComplete {
        turn: tid("t1"),
        tool_use_id: id.into(),
        outcome: done(ok, output),
    }
}

fn failure(kind: ErrorKind) -> LlmFailure {
    LlmFailure {
        kind,
        message: "boom".into(),
        retry_after_ms: None,
    }
}

fn recorded() -> Effect {
    Effect::RecordUsage {
        usage: usage(10, 5),
    }
}

fn agent(text: Option<&str>, tools: Vec<ToolUse>) -> Effect {
    Effect::PersistMessage(MessageContent::Agent {
        text: text.map(str::to_owned),
        tool_uses: tools,
        reasoning: None,
    })
}

fn error_message(text: &str) -> Effect {
    Effect::PersistMessage(MessageContent::Error { text: text.into() })
}

fn system(text: &str) -> Effect {
    Effect::PersistMessage(MessageContent::System { text: text.into() })
}

fn continue_t1() -> Effect {
    Effect::Continue { turn: tid("t1") }
}

/// Runs one transition and compares the whole outcome.
#[track_caller]
fn check(
    state: ConvState,
    ctx: &ConvContext,
    event: Event,
    new_state: ConvState,
    effects: Vec<Effect>,
) {
    let got = transition(&state, ctx, event).expect("the transition is valid");
    assert_eq!((got.new_state, got.effects), (new_state, effects));
}

#[track_caller]
fn check_rejected(state: ConvState, event: Event, rejection: Rejection) {
    assert_eq!(
        transition(&state, &ctx(), event),
        Err(InvalidTransition::Rejected(rejection))
    );
}

#[track_caller]
fn check_ignored(state: ConvState, ctx: &ConvContext, event: Event) {
    let got = transition(&state, ctx, event);
    assert!(
        matches!(got, Err(InvalidTransition::Ignored { .. })),
        "expected the event to be ignored, got {got:?}"
    );
}

// ---- The seeds' transition matrix, row by row ----

#[test]
fn matrix_idle_user_message_awaits_llm() {
    let image = ImageRef {
        id: "img1".into(),
        media_type: "image/png".into(),
    };
    check(
        ConvState::Idle,
        &ctx(),
        Event::UserMessage {
            turn: tid("t1"),
            text: "hi".into(),
            images: vec![image.clone()],
            if_busy: IfBusy::Reject,
        },
        ConvState::AwaitingLlm { turn: turn(0, 0) },
        vec![
            Effect::PersistMessage(MessageContent::User {
                text: "hi".into(),
                images: vec![image],
            }),
            continue_t1(),
        ],
    );
}

#[test]
fn matrix_awaiting_llm_internal_step_requests_llm() {
    check(
        ConvState::AwaitingLlm { turn: turn(0, 0) },
        &ctx(),
        Event::Continue { turn: tid("t1") },
        requesting(1, 0, 1),
        vec![Effect::RequestLlm {
            request: tag(1, 1),
            model: "m".into(),
            only_submit: false,
            summary: false,
        }],
    );
}

#[test]
fn matrix_llm_text_with_end_turn_goes_idle() {
    check(
        requesting(1, 0, 1),
        &ctx(),
        Event::LlmResponse {
            request: tag(1, 1),
            reply: reply(Some("hello"), vec![], true),
        },
        ConvState::Idle,
        vec![recorded(), agent(Some("hello"), vec![])],
    );
}

#[test]
fn matrix_llm_tools_start_the_first_tool_only() {
    let (a, b) = (bash("a"), bash("b"));
    check(
        requesting(1, 0, 1),
        &ctx(),
        Event::LlmResponse {
            request: tag(1, 1),
            reply: reply(Some("running"), vec![a.clone(), b.clone()], true),
        },
        ConvState::ToolExecuting {
            turn: turn(1, 2),
            current: a.clone(),
            remaining: vec![b.clone()],
            completed: 0,
        },
        vec![
            recorded(),
            agent(Some("running"), vec![a.clone(), b]),
            Effect::ExecuteTool {
                turn: tid("t1"),
                tool: a,
                plan: workspace(),
            },
        ],
    );
}

#[test]
fn matrix_retryable_error_schedules_a_retry_with_backoff() {
    for (attempt, delay_ms) in [(1, 1_000), (2, 2_000)] {
        check(
            requesting(1, 0, attempt),
            &ctx(),
            Event::LlmError {
                request: tag(1, attempt),
                error: failure(ErrorKind::Network),
            },
            requesting(1, 0, attempt + 1),
            vec![
                Effect::NotifyRetrying {
                    attempt: attempt + 1,
                    delay_ms,
                    error_kind: ErrorKind::Network,
                },
                Effect::ScheduleRetry {
                    request: tag(1, attempt + 1),
                    delay_ms,
                },
            ],
        );
    }
}

#[test]
fn matrix_retry_timeout_sends_the_request_again() {
    check(
        requesting(1, 0, 2),
        &ctx(),
        Event::RetryTimeout { request: tag(1, 2) },
        requesting(1, 0, 2),
        vec![Effect::RequestLlm {
            request: tag(1, 2),
            model: "m".into(),
            only_submit: false,
            summary: false,
        }],
    );
}

#[test]
fn matrix_retryable_error_on_the_last_attempt_is_an_error() {
    let message =
        "The LLM request failed after 3 attempts (rate_limit): boom. Send a message to try again.";
    check(
        requesting(1, 0, 3),
        &ctx(),
        Event::LlmError {
            request: tag(1, 3),
            error: failure(ErrorKind::RateLimit),
        },
        ConvState::Error {
            message: message.into(),
            error_kind: ErrorKind::RateLimit,
        },
        vec![error_message(message)],
    );
}

#[test]
fn matrix_non_retryable_error_is_an_error_at_once() {
    let cases = [
        (
            ErrorKind::Auth,
            "The LLM backend refused the credentials; check the configured API key: boom",
        ),
        (
            ErrorKind::InvalidRequest,
            "The LLM backend rejected the request as invalid: boom",
        ),
        (
            ErrorKind::Limit,
            "The LLM request hit a limit of the gateway: boom",
        ),
        // Issue 25: a spent budget ends the turn before any request is sent.
        (
            ErrorKind::Budget,
            "The token budget is spent; no LLM request was sent: boom",
        ),
        (ErrorKind::Unknown, "The LLM request failed: boom"),
    ];
    for (kind, message) in cases {
        check(
            requesting(1, 0, 1),
            &ctx(),
            Event::LlmError {
                request: tag(1, 1),
                error: failure(kind),
            },
            ConvState::Error {
                message: message.into(),
                error_kind: kind,
            },
            vec![error_message(message)],
        );
    }
}

#[test]
fn matrix_cancel_during_llm_request_aborts_it() {
    check(
        requesting(1, 0, 1),
        &ctx(),
        Event::UserCancel,
        ConvState::Cancelling { turn: turn(1, 0) },
        vec![Effect::AbortLlm { request: tag(1, 1) }],
    );
}

#[test]
fn matrix_user_message_while_requesting_is_rejected_as_busy() {
    check_rejected(
        requesting(1, 0, 1),
        user_message("again"),
        Rejection::AgentBusy,
    );
    assert!(Rejection::AgentBusy.to_string().contains("cancel"));
}

#[test]
fn matrix_last_tool_complete_returns_to_the_llm() {
    let a = bash("a");
    check(
        executing(a.clone(), vec![], 0),
        &ctx(),
        complete("a", true, "out"),
        ConvState::AwaitingLlm { turn: turn(1, 1) },
        vec![result(&a, true, "out", false), continue_t1()],
    );
}

#[test]
fn matrix_tool_complete_starts_the_next_tool() {
    let (a, b, c) = (bash("a"), bash("b"), bash("c"));
    check(
        executing(a.clone(), vec![b.clone(), c.clone()], 0),
        &ctx(),
        complete("a", true, "out"),
        ConvState::ToolExecuting {
            turn: turn(1, 3),
            current: b.clone(),
            remaining: vec![c],
            completed: 1,
        },
        vec![
            result(&a, true, "out", false),
            Effect::ExecuteTool {
                turn: tid("t1"),
                tool: b,
                plan: workspace(),
            },
        ],
    );
}

#[test]
fn matrix_cancel_during_tools_gives_synthetic_results_and_idle() {
    let (a, b, c) = (bash("a"), bash("b"), bash("c"));
    check(
        executing(a.clone(), vec![b.clone(), c.clone()], 0),
        &ctx(),
        Event::UserCancel,
        ConvState::Idle,
        vec![
            Effect::CancelTool {
                turn: tid("t1"),
                tool_use_id: "a".into(),
            },
            result(&a, false, "cancelled by user", true),
            result(&b, false, "skipped due to cancellation", true),
            result(&c, false, "skipped due to cancellation", true),
        ],
    );
}

#[test]
fn matrix_user_message_while_tools_run_is_rejected_as_busy() {
    check_rejected(
        executing(bash("a"), vec![], 0),
        user_message("x"),
        Rejection::AgentBusy,
    );
}

#[test]
fn matrix_cancelling_llm_response_goes_idle_without_persisting_it() {
    check(
        ConvState::Cancelling { turn: turn(1, 0) },
        &ctx(),
        Event::LlmResponse {
            request: tag(1, 1),
            reply: reply(Some("partial"), vec![bash("a")], true),
        },
        ConvState::Idle,
        vec![],
    );
}

#[test]
fn matrix_user_message_while_cancelling_is_rejected() {
    check_rejected(
        ConvState::Cancelling { turn: turn(1, 0) },
        user_message("x"),
        Rejection::Cancelling,
    );
    assert_eq!(
        Rejection::Cancelling.to_string(),
        "cancellation in progress: wait for the conversation to become idle"
    );
}

#[test]
fn matrix_error_user_message_recovers() {
    check(
        ConvState::Error {
            message: "boom".into(),
            error_kind: ErrorKind::Network,
        },
        &ctx(),
        user_message("again"),
        ConvState::AwaitingLlm { turn: turn(0, 0) },
        vec![
            Effect::PersistMessage(MessageContent::User {
                text: "again".into(),
                images: vec![],
            }),
            continue_t1(),
        ],
    );
}

/// The seeds' row "Idle + SpawnSubAgents -> AwaitingSubAgents, SpawnSubAgent x N" comes, per
/// the foundation issue, from a spawn_sub_agents tool call: the core asks for the spawn, and
/// the runtime's answer with the new agents' ids moves it to AwaitingSubAgents.
#[test]
fn matrix_spawn_sub_agents_awaits_the_sub_agents() {
    let spawn = ToolUse {
        id: "s".into(),
        name: SPAWN_SUB_AGENTS.into(),
        input: json!({"tasks": [{"prompt": "one"}, {"prompt": "two", "model": "small"}]}),
        extra: None,
    };
    check(
        requesting(1, 0, 1),
        &ctx(),
        Event::LlmResponse {
            request: tag(1, 1),
            reply: reply(None, vec![spawn.clone()], true),
        },
        ConvState::ToolExecuting {
            turn: turn(1, 1),
            current: spawn.clone(),
            remaining: vec![],
            completed: 0,
        },
        vec![
            recorded(),
            agent(None, vec![spawn.clone()]),
            Effect::SpawnSubAgents {
                turn: tid("t1"),
                tool_use_id: "s".into(),
                tasks: vec![
                    SubAgentTask {
                        prompt: "one".into(),
                        model: None,
                        max_steps: 4,
                        timeout_ms: 60_000,
                    },
                    SubAgentTask {
                        prompt: "two".into(),
                        model: Some("small".into()),
                        max_steps: 4,
                        timeout_ms: 60_000,
                    },
                ],
            },
        ],
    );
    check(
        executing(spawn.clone(), vec![], 0),
        &ctx(),
        Event::SubAgentsSpawned {
            turn: tid("t1"),
            tool_use_id: "s".into(),
            agent_ids: vec!["x".into(), "y".into()],
        },
        awaiting_agents(&spawn, &[("x", None), ("y", None)], vec![]),
        vec![],
    );
}

fn spawn_tool() -> ToolUse {
    ToolUse {
        id: "s".into(),
        name: SPAWN_SUB_AGENTS.into(),
        input: json!({"tasks": [{"prompt": "one"}, {"prompt": "two"}, {"prompt": "three"}]}),
        extra: None,
    }
}

fn awaiting_agents(
    spawn: &ToolUse,
    agents: &[(&str, Option<(bool, &str)>)],
    remaining: Vec<ToolUse>,
) -> ConvState {
    ConvState::AwaitingSubAgents {
        turn: turn(1, 1 + remaining.len() as u32),
        spawn: spawn.clone(),
        agents: agents
            .iter()
            .map(|(id, outcome)| SubAgentSlot {
                agent_id: (*id).into(),
                outcome: outcome.map(|(success, result)| SubAgentOutcome {
                    success,
                    result: result.into(),
                }),
            })
            .collect(),
        remaining,
        completed: 0,
    }
}

fn agent_done(id: &str, success: bool, result: &str) -> Event {
    Event::SubAgentResult {
        agent_id: id.into(),
        outcome: SubAgentOutcome {
            success,
            result: result.into(),
        },
    }
}

#[test]
fn matrix_last_sub_agent_result_aggregates_in_task_order() {
    let spawn = spawn_tool();
    // Results arrive out of order; one failed, one timed out.
    let state = awaiting_agents(
        &spawn,
        &[
            ("x", None),
            ("y", Some((false, "timed out after 600 s"))),
            ("z", Some((true, "three done"))),
        ],
        vec![],
    );
    let aggregate = json!([
        {"agent_id": "x", "success": false, "result": "crashed"},
        {"agent_id": "y", "success": false, "result": "timed out after 600 s"},
        {"agent_id": "z", "success": true, "result": "three done"},
    ]);
    check(
        state,
        &ctx(),
        agent_done("x", false, "crashed"),
        ConvState::AwaitingLlm { turn: turn(1, 1) },
        vec![
            result(&spawn, true, &aggregate.to_string(), false),
            continue_t1(),
        ],
    );
}

#[test]
fn matrix_user_message_while_awaiting_sub_agents_is_rejected_as_busy() {
    check_rejected(
        awaiting_agents(&spawn_tool(), &[("x", None)], vec![]),
        user_message("x"),
        Rejection::AgentBusy,
    );
}

// ---- Extensions of the foundation issue ----

#[test]
fn sub_agent_result_before_the_last_only_records_it() {
    let spawn = spawn_tool();
    check(
        awaiting_agents(&spawn, &[("x", None), ("y", None)], vec![]),
        &ctx(),
        agent_done("y", true, "two"),
        awaiting_agents(&spawn, &[("x", None), ("y", Some((true, "two")))], vec![]),
        vec![],
    );
}

#[test]
fn req_bed_003_text_without_end_turn_keeps_awaiting_the_llm() {
    check(
        requesting(1, 0, 1),
        &ctx(),
        Event::LlmResponse {
            request: tag(1, 1),
            reply: reply(Some("part one"), vec![], false),
        },
        ConvState::AwaitingLlm { turn: turn(1, 0) },
        vec![recorded(), agent(Some("part one"), vec![]), continue_t1()],
    );
}

#[test]
fn req_bed_004_failed_tool_is_a_result_the_llm_sees() {
    let (a, b) = (bash("a"), bash("b"));
    check(
        executing(a.clone(), vec![b.clone()], 0),
        &ctx(),
        complete("a", false, "exit status 1"),
        ConvState::ToolExecuting {
            turn: turn(1, 2),
            current: b.clone(),
            remaining: vec![],
            completed: 1,
        },
        vec![
            result(&a, false, "exit status 1", false),
            Effect::ExecuteTool {
                turn: tid("t1"),
                tool: b,
                plan: workspace(),
            },
        ],
    );
}

#[test]
fn req_bed_005_cancel_before_the_llm_request_goes_idle() {
    check(
        ConvState::AwaitingLlm { turn: turn(0, 0) },
        &ctx(),
        Event::UserCancel,
        ConvState::Idle,
        vec![],
    );
}

#[test]
fn req_bed_005_abort_confirmation_ends_cancelling() {
    check(
        ConvState::Cancelling { turn: turn(1, 0) },
        &ctx(),
        Event::LlmAborted { request: tag(1, 1) },
        ConvState::Idle,
        vec![],
    );
    check(
        ConvState::Cancelling { turn: turn(1, 0) },
        &ctx(),
        Event::LlmError {
            request: tag(1, 2),
            error: failure(ErrorKind::Network),
        },
        ConvState::Idle,
        vec![],
    );
}

#[test]
fn req_bed_005_cancel_is_idempotent() {
    check(
        ConvState::Idle,
        &ctx(),
        Event::UserCancel,
        ConvState::Idle,
        vec![],
    );
    check(
        ConvState::Cancelling { turn: turn(1, 0) },
        &ctx(),
        Event::UserCancel,
        ConvState::Cancelling { turn: turn(1, 0) },
        vec![],
    );
    check(
        ConvState::Error {
            message: "m".into(),
            error_kind: ErrorKind::Auth,
        },
        &ctx(),
        Event::UserCancel,
        ConvState::Idle,
        vec![],
    );
    check(
        ConvState::Completed,
        &sub_ctx(),
        Event::UserCancel,
        ConvState::Completed,
        vec![],
    );
}

#[test]
fn req_bed_005_cancel_while_awaiting_sub_agents_stops_them() {
    let spawn = spawn_tool();
    let after = bash("after");
    let aggregate = json!([
        {"agent_id": "x", "success": true, "result": "one"},
        {"agent_id": "y", "success": false, "result": "cancelled by user"},
        {"agent_id": "z", "success": false, "result": "cancelled by user"},
    ]);
    check(
        awaiting_agents(
            &spawn,
            &[("x", Some((true, "one"))), ("y", None), ("z", None)],
            vec![after.clone()],
        ),
        &ctx(),
        Event::UserCancel,
        ConvState::Idle,
        vec![
            Effect::StopSubAgents {
                agent_ids: vec!["y".into(), "z".into()],
            },
            result(&spawn, false, &aggregate.to_string(), true),
            result(&after, false, "skipped due to cancellation", true),
        ],
    );
}

#[test]
fn req_bed_005_cancel_while_the_spawn_starts_stops_the_spawn() {
    let spawn = spawn_tool();
    check(
        executing(spawn.clone(), vec![], 0),
        &ctx(),
        Event::UserCancel,
        ConvState::Idle,
        vec![
            Effect::CancelTool {
                turn: tid("t1"),
                tool_use_id: "s".into(),
            },
            result(&spawn, false, "cancelled by user", true),
        ],
    );
}

#[test]
fn req_bed_005_late_answers_for_cancelled_work_are_ignored() {
    // A new turn t2 runs after t1 was cancelled; t1's answers arrive late.
    let t2 = Turn {
        llm_steps: 1,
        ..Turn::new(tid("t2"))
    };
    let state = ConvState::LlmRequesting {
        turn: t2.clone(),
        attempt: 1,
    };
    check_ignored(
        state.clone(),
        &ctx(),
        Event::LlmResponse {
            request: tag(1, 1),
            reply: reply(Some("late"), vec![], true),
        },
    );
    check_ignored(
        state.clone(),
        &ctx(),
        Event::LlmError {
            request: tag(1, 1),
            error: failure(ErrorKind::Network),
        },
    );
    check_ignored(
        state.clone(),
        &ctx(),
        Event::RetryTimeout { request: tag(1, 2) },
    );
    check_ignored(ConvState::Idle, &ctx(), complete("a", true, "late"));
    check_ignored(
        ConvState::ToolExecuting {
            turn: t2,
            current: bash("a"),
            remaining: vec![],
            completed: 0,
        },
        &ctx(),
        complete("a", true, "late, from turn t1"),
    );
    check_ignored(ConvState::Idle, &ctx(), agent_done("x", true, "late"));
    check_ignored(ConvState::Idle, &ctx(), Event::Continue { turn: tid("t1") });
    check_ignored(
        ConvState::Idle,
        &ctx(),
        Event::SubAgentsSpawned {
            turn: tid("t1"),
            tool_use_id: "s".into(),
            agent_ids: vec!["x".into()],
        },
    );
    // An earlier attempt of the current request answers after its retry was scheduled.
    check_ignored(
        requesting(1, 0, 2),
        &ctx(),
        Event::LlmResponse {
            request: tag(1, 1),
            reply: reply(Some("late"), vec![], true),
        },
    );
}

#[test]
fn req_bed_006_backoff_is_computed_from_the_attempt_and_capped() {
    let delays: Vec<u64> = (1..=6).map(retry_delay_ms).collect();
    assert_eq!(delays, vec![1_000, 2_000, 4_000, 8_000, 8_000, 8_000]);
    assert_eq!(retry_delay_ms(u32::MAX), RETRY_DELAY_CAP_MS);
}

#[test]
fn req_bed_006_retry_after_is_honoured_up_to_a_cap() {
    for (retry_after, expected) in [
        (Some(5_000), 5_000),
        (Some(10), 1_000),
        (Some(600_000), 30_000),
    ] {
        check(
            requesting(1, 0, 1),
            &ctx(),
            Event::LlmError {
                request: tag(1, 1),
                error: LlmFailure {
                    retry_after_ms: retry_after,
                    ..failure(ErrorKind::RateLimit)
                },
            },
            requesting(1, 0, 2),
            vec![
                Effect::NotifyRetrying {
                    attempt: 2,
                    delay_ms: expected,
                    error_kind: ErrorKind::RateLimit,
                },
                Effect::ScheduleRetry {
                    request: tag(1, 2),
                    delay_ms: expected,
                },
            ],
        );
    }
}

#[test]
fn req_bed_006_only_rate_limit_and_network_are_retryable() {
    let kinds = [
        ErrorKind::Auth,
        ErrorKind::RateLimit,
        ErrorKind::Network,
        ErrorKind::InvalidRequest,
        ErrorKind::Limit,
        ErrorKind::Budget,
        ErrorKind::Unknown,
    ];
    let retryable: Vec<&str> = kinds
        .iter()
        .filter(|k| k.is_retryable())
        .map(|k| k.as_str())
        .collect();
    assert_eq!(retryable, vec!["rate_limit", "network"]);
}

#[test]
fn req_bed_009_submit_result_completes_the_sub_agent() {
    let submit = ToolUse {
        id: "r".into(),
        name: SUBMIT_RESULT.into(),
        input: json!({"result": "the answer", "success": true}),
        extra: None,
    };
    let after = bash("after");
    check(
        requesting(1, 0, 1),
        &sub_ctx(),
        Event::LlmResponse {
            request: tag(1, 1),
            reply: reply(None, vec![submit.clone(), after.clone()], true),
        },
        ConvState::Completed,
        vec![
            recorded(),
            agent(None, vec![submit.clone(), after.clone()]),
            result(&submit, true, "result submitted", false),
            result(
                &after,
                false,
                "not run: the sub-agent ended with submit_result",
                true,
            ),
            Effect::ReportToParent {
                outcome: SubAgentOutcome {
                    success: true,
                    result: "the answer".into(),
                },
            },
        ],
    );
}

#[test]
fn req_bed_009_a_sub_agent_never_gets_spawn_sub_agents() {
    let spawn = spawn_tool();
    check(
        requesting(1, 0, 1),
        &sub_ctx(),
        Event::LlmResponse {
            request: tag(1, 1),
            reply: reply(None, vec![spawn.clone()], true),
        },
        ConvState::AwaitingLlm { turn: turn(1, 1) },
        vec![
            recorded(),
            agent(None, vec![spawn.clone()]),
            result(
                &spawn,
                false,
                "sub-agents cannot spawn sub-agents; do the work yourself",
                false,
            ),
            continue_t1(),
        ],
    );
}

#[test]
fn req_bed_009_submit_result_is_refused_outside_sub_agents() {
    let submit = ToolUse {
        id: "r".into(),
        name: SUBMIT_RESULT.into(),
        input: json!({"result": "x"}),
        extra: None,
    };
    refused_after_a(
        &ctx(),
        submit,
        "submit_result is only available to sub-agents",
    );
}

#[test]
fn req_bed_008_malformed_spawn_calls_fail_as_tool_results() {
    let cases = [
        (
            json!({}),
            "invalid input: `tasks` must be an array of {\"prompt\", \"model\"?}",
        ),
        (json!({"tasks": []}), "invalid input: `tasks` is empty"),
        (
            json!({"tasks": [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}, {"prompt": "d"}]}),
            "invalid input: 4 tasks given, at most 3 sub-agents per call",
        ),
        (
            json!({"tasks": [{"prompt": " "}]}),
            "invalid input: tasks[0].prompt must be a non-empty string",
        ),
        (
            json!({"tasks": [{"prompt": "a", "model": 3}]}),
            "invalid input: tasks[0].model must be a string",
        ),
    ];
    for (input, why) in cases {
        let spawn = ToolUse {
            id: "s".into(),
            name: SPAWN_SUB_AGENTS.into(),
            input,
            extra: None,
        };
        check(
            requesting(1, 0, 1),
            &ctx(),
            Event::LlmResponse {
                request: tag(1, 1),
                reply: reply(None, vec![spawn.clone()], true),
            },
            ConvState::AwaitingLlm { turn: turn(1, 1) },
            vec![
                recorded(),
                agent(None, vec![spawn.clone()]),
                result(&spawn, false, why, false),
                continue_t1(),
            ],
        );
    }
}

#[test]
fn req_bed_008_sub_agent_that_ends_without_submitting_is_reminded_once_then_fails() {
    let reminded = Turn {
        reminded: true,
        ..turn(1, 0)
    };
    check(
        requesting(1, 0, 1),
        &sub_ctx(),
        Event::LlmResponse {
            request: tag(1, 1),
            reply: reply(Some("done?"), vec![], true),
        },
        ConvState::AwaitingLlm {
            turn: reminded.clone(),
        },
        vec![
            recorded(),
            agent(Some("done?"), vec![]),
            system(SUBMIT_REMINDER),
            continue_t1(),
        ],
    );
    let message = "The sub-agent ended its turn without calling submit_result.";
    check(
        ConvState::LlmRequesting {
            turn: Turn {
                llm_steps: 2,
                ..reminded
            },
            attempt: 1,
        },
        &sub_ctx(),
        Event::LlmResponse {
            request: tag(2, 1),
            reply: reply(Some("still no"), vec![], true),
        },
        ConvState::Error {
            message: message.into(),
            error_kind: ErrorKind::Unknown,
        },
        vec![
            recorded(),
            agent(Some("still no"), vec![]),
            error_message(message),
            Effect::ReportToParent {
                outcome: SubAgentOutcome {
                    success: false,
                    result: message.into(),
                },
            },
        ],
    );
}

#[test]
fn req_bed_008_a_failing_sub_agent_reports_to_its_parent() {
    let message = "The LLM backend refused the credentials; check the configured API key: boom";
    check(
        requesting(1, 0, 1),
        &sub_ctx(),
        Event::LlmError {
            request: tag(1, 1),
            error: failure(ErrorKind::Auth),
        },
        ConvState::Error {
            message: message.into(),
            error_kind: ErrorKind::Auth,
        },
        vec![
            error_message(message),
            Effect::ReportToParent {
                outcome: SubAgentOutcome {
                    success: false,
                    result: message.into(),
                },
            },
        ],
    );
}

#[test]
fn bounded_turn_llm_step_limit_ends_in_a_limit_error() {
    let message = "The turn was stopped: it reached the limit of 5 LLM steps per turn.";
    check(
        ConvState::AwaitingLlm { turn: turn(5, 2) },
        &ctx(),
        Event::Continue { turn: tid("t1") },
        ConvState::Error {
            message: message.into(),
            error_kind: ErrorKind::Limit,
        },
        vec![error_message(message)],
    );
}

#[test]
fn bounded_turn_tool_call_limit_answers_every_call_and_ends_in_a_limit_error() {
    let (a, b) = (bash("a"), bash("b"));
    let skipped = "not run: the turn reached its limit of 4 tool calls";
    let message = "The turn was stopped: the LLM asked for more than 4 tool calls in one turn.";
    check(
        requesting(2, 3, 1),
        &ctx(),
        Event::LlmResponse {
            request: tag(2, 1),
            reply: reply(None, vec![a.clone(), b.clone()], true),
        },
        ConvState::Error {
            message: message.into(),
            error_kind: ErrorKind::Limit,
        },
        vec![
            recorded(),
            agent(None, vec![a.clone(), b.clone()]),
            result(&a, false, skipped, true),
            result(&b, false, skipped, true),
            error_message(message),
        ],
    );
}

fn with_tokens(context_tokens: u64) -> ConvContext {
    ConvContext {
        context_tokens,
        ..ctx()
    }
}

fn response_with_usage(input: u64, output: u64) -> Event {
    Event::LlmResponse {
        request: tag(1, 1),
        reply: LlmReply {
            usage: usage(input, output),
            ..reply(Some("ok"), vec![], true)
        },
    }
}

#[test]
fn req_bed_012_context_warnings_once_at_80_and_95_percent() {
    let warn = |tokens: u64| Effect::WarnContext {
        context_tokens: tokens,
        context_window: 1000,
        ratio: tokens as f64 / 1000.0,
    };
    let record = |input, output| Effect::RecordUsage {
        usage: usage(input, output),
    };
    let ok = agent(Some("ok"), vec![]);
    // Below 80%: no warning.
    check(
        requesting(1, 0, 1),
        &with_tokens(0),
        response_with_usage(700, 99),
        ConvState::Idle,
        vec![record(700, 99), ok.clone()],
    );
    // Crossing 80%: one warning.
    check(
        requesting(1, 0, 1),
        &with_tokens(799),
        response_with_usage(790, 10),
        ConvState::Idle,
        vec![record(790, 10), warn(800), ok.clone()],
    );
    // Still above 80%, not yet 95%: no second warning.
    check(
        requesting(1, 0, 1),
        &with_tokens(800),
        response_with_usage(900, 10),
        ConvState::Idle,
        vec![record(900, 10), ok.clone()],
    );
    // Crossing 95%: one more.
    check(
        requesting(1, 0, 1),
        &with_tokens(910),
        response_with_usage(950, 1),
        ConvState::Idle,
        vec![record(950, 1), warn(951), ok.clone()],
    );
    // Crossing both at once warns once.
    check(
        requesting(1, 0, 1),
        &with_tokens(100),
        response_with_usage(990, 0),
        ConvState::Idle,
        vec![record(990, 0), warn(990), ok.clone()],
    );
    // No window known: no warning.
    check(
        requesting(1, 0, 1),
        &ConvContext {
            context_window: 0,
            ..ctx()
        },
        response_with_usage(990, 0),
        ConvState::Idle,
        vec![record(990, 0), ok],
    );
}

fn background(task: &str) -> BackgroundResult {
    BackgroundResult {
        task_id: task.into(),
        tool_name: "bash".into(),
        ok: true,
        output: format!("{task} out"),
    }
}

#[test]
fn background_result_in_idle_is_a_system_message() {
    let result = background("k1");
    check(
        ConvState::Idle,
        &ctx(),
        Event::BackgroundResult {
            result: result.clone(),
            wake: None,
        },
        ConvState::Idle,
        vec![system(&result.system_text())],
    );
    assert_eq!(
        result.system_text(),
        "[[SYSTEM: background task k1 (bash) completed]]\nk1 out"
    );
}

#[test]
fn background_result_that_asks_for_it_wakes_an_idle_conversation() {
    let result = background("k1");
    check(
        ConvState::Idle,
        &ctx(),
        Event::BackgroundResult {
            result: result.clone(),
            wake: Some(tid("t1")),
        },
        ConvState::AwaitingLlm { turn: turn(0, 0) },
        vec![system(&result.system_text()), continue_t1()],
    );
}

#[test]
fn background_results_in_a_busy_state_are_held_and_sent_with_the_next_request_in_order() {
    let (k1, k2) = (background("k1"), background("k2"));
    let a = bash("a");
    let held = |results: Vec<BackgroundResult>| Turn {
        held: results,
        ..turn(1, 1)
    };
    check(
        executing(a.clone(), vec![], 0),
        &ctx(),
        Event::BackgroundResult {
            result: k1.clone(),
            wake: Some(tid("ignored-while-busy")),
        },
        ConvState::ToolExecuting {
            turn: held(vec![k1.clone()]),
            current: a.clone(),
            remaining: vec![],
            completed: 0,
        },
        vec![],
    );
    let state = ConvState::AwaitingLlm {
        turn: held(vec![k1.clone(), k2.clone()]),
    };
    check(
        state,
        &ctx(),
        Event::Continue { turn: tid("t1") },
        ConvState::LlmRequesting {
            turn: turn(2, 1),
            attempt: 1,
        },
        vec![
            system(&k1.system_text()),
            system(&k2.system_text()),
            Effect::RequestLlm {
                request: tag(2, 1),
                model: "m".into(),
                only_submit: false,
                summary: false,
            },
        ],
    );
}

#[test]
fn held_background_results_survive_a_cancel() {
    let k1 = background("k1");
    let a = bash("a");
    check(
        ConvState::ToolExecuting {
            turn: Turn {
                held: vec![k1.clone()],
                ..turn(1, 1)
            },
            current: a.clone(),
            remaining: vec![],
            completed: 0,
        },
        &ctx(),
        Event::UserCancel,
        ConvState::Idle,
        vec![
            Effect::CancelTool {
                turn: tid("t1"),
                tool_use_id: "a".into(),
            },
            result(&a, false, CANCELLED_BY_USER, true),
            system(&k1.system_text()),
        ],
    );
}

#[test]
fn restart_interrupts_tools_with_synthetic_results() {
    let (a, b) = (bash("a"), bash("b"));
    check(
        executing(a.clone(), vec![b.clone()], 0),
        &ctx(),
        Event::Interrupted(Interruption::Restart),
        ConvState::Idle,
        vec![
            Effect::CancelTool {
                turn: tid("t1"),
                tool_use_id: "a".into(),
            },
            result(&a, false, "interrupted by server restart", true),
            result(&b, false, "interrupted by server restart", true),
        ],
    );
    check_ignored(
        ConvState::Idle,
        &ctx(),
        Event::Interrupted(Interruption::Restart),
    );
}

#[test]
fn shutdown_interrupts_sub_agents_with_a_synthetic_spawn_result() {
    let spawn = spawn_tool();
    let aggregate = json!([
        {"agent_id": "x", "success": false, "result": "interrupted by server shutdown"},
    ]);
    check(
        awaiting_agents(&spawn, &[("x", None)], vec![]),
        &ctx(),
        Event::Interrupted(Interruption::Shutdown),
        ConvState::Idle,
        vec![
            Effect::StopSubAgents {
                agent_ids: vec!["x".into()],
            },
            result(&spawn, false, &aggregate.to_string(), true),
        ],
    );
}

#[test]
fn a_completed_sub_agent_takes_no_more_messages() {
    check_rejected(
        ConvState::Completed,
        user_message("more"),
        Rejection::Completed,
    );
}

#[test]
fn state_serialises_with_the_contract_kind() {
    let state = requesting(1, 0, 2);
    let value = serde_json::to_value(&state).expect("states serialise");
    assert_eq!(value["kind"], "llm_requesting");
    assert_eq!(value["attempt"], 2);
    let back: ConvState = serde_json::from_value(value).expect("and deserialise");
    assert_eq!(back, state);
}

#[test]
fn chain_validation_catches_every_kind_of_break() {
    let a = bash("a");
    let ask = MessageContent::Agent {
        text: None,
        tool_uses: vec![a.clone()],
        reasoning: None,
    };
    let answer = MessageContent::tool_result(&a, true, "ok", false);
    let user = MessageContent::User {
        text: "u".into(),
        images: vec![],
    };
    assert_eq!(validate_chain([&user, &ask, &answer], false), Ok(()));
    assert_eq!(validate_chain([&user, &ask], true), Ok(()));
    assert_eq!(
        validate_chain([&user, &ask], false),
        Err(ChainError::Dangling {
            tool_use_id: "a".into()
        })
    );
    assert_eq!(
        validate_chain([&ask, &user], true),
        Err(ChainError::Unanswered {
            index: 1,
            tool_use_id: "a".into(),
            found: "user"
        })
    );
    assert_eq!(
        validate_chain([&ask, &answer, &answer], false),
        Err(ChainError::UnexpectedResult {
            index: 2,
            tool_use_id: "a".into()
        })
    );
}

// ---- Conversation control (issue 24): interrupt-and-send ----

fn interrupt(running: Option<&str>) -> Event {
    Event::UserMessage {
        turn: tid("t2"),
        text: "instead".into(),
        images: vec![],
        if_busy: IfBusy::Interrupt {
            running: running.map(tid),
        },
    }
}

/// What every accepted interrupt ends with: the new message and the new turn's first step.
fn new_turn_effects() -> Vec<Effect> {
    vec![
        Effect::PersistMessage(MessageContent::User {
            text: "instead".into(),
            images: vec![],
        }),
        Effect::Continue { turn: tid("t2") },
    ]
}

fn awaiting_t2() -> ConvState {
    ConvState::AwaitingLlm {
        turn: Turn::new(tid("t2")),
    }
}

#[test]
fn interrupt_from_awaiting_llm_starts_the_new_turn() {
    check(
        ConvState::AwaitingLlm { turn: turn(1, 0) },
        &ctx(),
        interrupt(Some("t1")),
        awaiting_t2(),
        new_turn_effects(),
    );
}

#[test]
fn interrupt_from_llm_requesting_aborts_it_without_waiting() {
    let mut effects = vec![Effect::AbortLlm { request: tag(2, 1) }];
    effects.extend(new_turn_effects());
    check(
        requesting(2, 0, 1),
        &ctx(),
        interrupt(Some("t1")),
        awaiting_t2(),
        effects,
    );
}

#[test]
fn interrupt_from_tool_executing_stops_the_tool_like_a_cancel() {
    let (running, queued) = (bash("a"), bash("b"));
    let mut effects = vec![
        Effect::CancelTool {
            turn: tid("t1"),
            tool_use_id: "a".into(),
        },
        result(&running, false, CANCELLED_BY_USER, true),
        result(&queued, false, SKIPPED_BY_CANCEL, true),
    ];
    effects.extend(new_turn_effects());
    check(
        executing(running.clone(), vec![queued.clone()], 0),
        &ctx(),
        interrupt(Some("t1")),
        awaiting_t2(),
        effects,
    );
}

#[test]
fn interrupt_from_awaiting_sub_agents_stops_them_like_a_cancel() {
    let spawn = spawn_tool();
    let aggregate = json!([
        {"agent_id": "x", "success": true, "result": "one"},
        {"agent_id": "y", "success": false, "result": "cancelled by user"},
    ]);
    let mut effects = vec![
        Effect::StopSubAgents {
            agent_ids: vec!["y".into()],
        },
        result(&spawn, false, &aggregate.to_string(), true),
    ];
    effects.extend(new_turn_effects());
    check(
        awaiting_agents(&spawn, &[("x", Some((true, "one"))), ("y", None)], vec![]),
        &ctx(),
        interrupt(Some("t1")),
        awaiting_t2(),
        effects,
    );
}

#[test]
fn interrupt_from_cancelling_does_not_wait_for_the_abort() {
    check(
        ConvState::Cancelling { turn: turn(1, 0) },
        &ctx(),
        interrupt(Some("t1")),
        awaiting_t2(),
        new_turn_effects(),
    );
}

#[test]
fn interrupt_stores_what_the_stopped_turn_held_before_the_new_message() {
    let held = BackgroundResult {
        task_id: "k".into(),
        tool_name: "bash".into(),
        ok: true,
        output: "done".into(),
    };
    let mut busy = turn(1, 0);
    busy.held.push(held.clone());
    let mut effects = vec![system(&held.system_text())];
    effects.extend(new_turn_effects());
    check(
        ConvState::AwaitingLlm { turn: busy },
        &ctx(),
        interrupt(Some("t1")),
        awaiting_t2(),
        effects,
    );
}

#[test]
fn interrupt_when_idle_or_in_error_is_an_ordinary_message() {
    for state in [
        ConvState::Idle,
        ConvState::Error {
            message: "x".into(),
            error_kind: ErrorKind::Network,
        },
    ] {
        // Whatever turn the sender saw has ended by now.
        check(
            state.clone(),
            &ctx(),
            interrupt(Some("t1")),
            awaiting_t2(),
            new_turn_effects(),
        );
        check(
            state,
            &ctx(),
            interrupt(None),
            awaiting_t2(),
            new_turn_effects(),
        );
    }
}

#[test]
fn interrupt_of_a_turn_the_sender_did_not_see_is_busy() {
    // Concurrent interrupting sends all saw t0 running; the first replaced it with t1.
    for state in [
        ConvState::AwaitingLlm { turn: turn(0, 0) },
        requesting(1, 0, 1),
        executing(bash("a"), vec![], 0),
        ConvState::Cancelling { turn: turn(1, 0) },
    ] {
        check_rejected(state.clone(), interrupt(Some("t0")), Rejection::AgentBusy);
        check_rejected(state, interrupt(None), Rejection::AgentBusy);
    }
}

#[test]
fn a_working_sub_agent_is_not_interrupted() {
    // Its one turn is its task under its limits; a new turn would start them over.
    let got = transition(&requesting(3, 0, 1), &sub_ctx(), interrupt(Some("t1")));
    assert_eq!(got, Err(InvalidTransition::Rejected(Rejection::AgentBusy)));
}

#[test]
fn interrupt_of_a_completed_sub_agent_is_refused() {
    check_rejected(ConvState::Completed, interrupt(None), Rejection::Completed);
}

#[test]
fn late_answers_of_an_interrupted_turn_are_ignored() {
    let interrupted = transition(&requesting(2, 0, 1), &ctx(), interrupt(Some("t1")))
        .expect("accepted")
        .new_state;
    check_ignored(
        interrupted.clone(),
        &ctx(),
        Event::LlmAborted { request: tag(2, 1) },
    );
    check_ignored(
        interrupted.clone(),
        &ctx(),
        Event::LlmResponse {
            request: tag(2, 1),
            reply: reply(Some("late"), vec![], true),
        },
    );
    check_ignored(interrupted, &ctx(), complete("a", true, "late"));
}

// ---- Sub-agent limits and the grace turn (issue 24) ----

fn submit_tool(id: &str) -> ToolUse {
    ToolUse {
        id: id.into(),
        name: SUBMIT_RESULT.into(),
        input: json!({"result": "partial", "success": false}),
        extra: None,
    }
}

fn grace_turn(steps: u32, limit: SubAgentLimit) -> Turn {
    Turn {
        grace: Some(limit),
        ..turn(steps, 0)
    }
}

fn notice(limit: SubAgentLimit) -> Effect {
    system(&format!(
        "[[SYSTEM: you have reached your {limit}. Call submit_result now with what you have \
         (success false if the task is not done); no other tool is available.]]"
    ))
}

const STEPS: SubAgentLimit = SubAgentLimit::Steps { max_steps: 5 };
const TIME: SubAgentLimit = SubAgentLimit::Time { timeout_ms: 90_000 };

#[test]
fn a_sub_agent_at_its_step_limit_gets_a_grace_step_with_only_submit_result() {
    check(
        ConvState::AwaitingLlm { turn: turn(5, 2) },
        &sub_ctx(),
        Event::Continue { turn: tid("t1") },
        ConvState::LlmRequesting {
            turn: Turn {
                tool_calls: 2,
                ..grace_turn(6, STEPS)
            },
            attempt: 1,
        },
        vec![
            notice(STEPS),
            Effect::GraceTurnStarted,
            Effect::RequestLlm {
                request: tag(6, 1),
                model: "m".into(),
                only_submit: true,
                summary: false,
            },
        ],
    );
}

#[test]
fn a_user_turn_at_its_step_limit_still_fails() {
    let got = transition(
        &ConvState::AwaitingLlm { turn: turn(5, 0) },
        &ctx(),
        Event::Continue { turn: tid("t1") },
    )
    .expect("valid");
    assert!(matches!(
        got.new_state,
        ConvState::Error {
            error_kind: ErrorKind::Limit,
            ..
        }
    ));
}

#[test]
fn a_retry_in_the_grace_turn_still_offers_only_submit_result() {
    let state = ConvState::LlmRequesting {
        turn: grace_turn(6, STEPS),
        attempt: 2,
    };
    check(
        state.clone(),
        &sub_ctx(),
        Event::RetryTimeout { request: tag(6, 2) },
        state,
        vec![Effect::RequestLlm {
            request: tag(6, 2),
            model: "m".into(),
            only_submit: true,
            summary: false,
        }],
    );
}

#[test]
fn submit_result_in_the_grace_turn_completes_and_nothing_else_runs() {
    let (other, submit) = (bash("x"), submit_tool("r"));
    check(
        ConvState::LlmRequesting {
            turn: grace_turn(6, STEPS),
            attempt: 1,
        },
        &sub_ctx(),
        Event::LlmResponse {
            request: tag(6, 1),
            reply: reply(None, vec![other.clone(), submit.clone()], true),
        },
        ConvState::Completed,
        vec![
            recorded(),
            agent(None, vec![other.clone(), submit.clone()]),
            result(&other, false, GRACE_SKIPPED, true),
            result(&submit, true, "result submitted", false),
            Effect::ReportToParent {
                outcome: SubAgentOutcome {
                    success: false,
                    result: "partial".into(),
                },
            },
        ],
    );
}

#[test]
fn no_submit_in_the_grace_turn_fails_saying_which_limit() {
    let other = bash("x");
    let message = "The sub-agent reached its limit of 5 LLM steps and did not call \
                   submit_result in its grace turn.";
    check(
        ConvState::LlmRequesting {
            turn: grace_turn(6, STEPS),
            attempt: 1,
        },
        &sub_ctx(),
        Event::LlmResponse {
            request: tag(6, 1),
            reply: reply(Some("more work"), vec![other.clone()], true),
        },
        ConvState::Error {
            message: message.into(),
            error_kind: ErrorKind::Limit,
        },
        vec![
            recorded(),
            agent(Some("more work"), vec![other.clone()]),
            result(&other, false, GRACE_SKIPPED, true),
            error_message(message),
            Effect::ReportToParent {
                outcome: SubAgentOutcome {
                    success: false,
                    result: message.into(),
                },
            },
        ],
    );
}

#[test]
fn a_sub_agent_past_its_time_stops_its_tool_and_gets_its_grace_turn() {
    let running = bash("a");
    let output = "stopped: the sub-agent reached its time limit";
    check(
        executing(running.clone(), vec![], 0),
        &sub_ctx(),
        Event::TimeLimit { timeout_ms: 90_000 },
        ConvState::AwaitingLlm {
            turn: Turn {
                tool_calls: 1,
                ..grace_turn(1, TIME)
            },
        },
        vec![
            Effect::CancelTool {
                turn: tid("t1"),
                tool_use_id: "a".into(),
            },
            result(&running, false, output, true),
            notice(TIME),
            Effect::GraceTurnStarted,
            continue_t1(),
        ],
    );
}

#[test]
fn a_sub_agent_past_its_time_aborts_its_llm_request_for_the_grace_step() {
    check(
        requesting(2, 0, 1),
        &sub_ctx(),
        Event::TimeLimit { timeout_ms: 90_000 },
        ConvState::AwaitingLlm {
            turn: grace_turn(2, TIME),
        },
        vec![
            Effect::AbortLlm { request: tag(2, 1) },
            notice(TIME),
            Effect::GraceTurnStarted,
            continue_t1(),
        ],
    );
}

#[test]
fn the_time_limit_in_the_grace_turn_fails_the_sub_agent() {
    let message = "The sub-agent reached its time limit of 90 s and did not call \
                   submit_result in its grace turn.";
    check(
        ConvState::LlmRequesting {
            turn: grace_turn(3, TIME),
            attempt: 1,
        },
        &sub_ctx(),
        Event::TimeLimit { timeout_ms: 90_000 },
        ConvState::Error {
            message: message.into(),
            error_kind: ErrorKind::Limit,
        },
        vec![
            Effect::AbortLlm { request: tag(3, 1) },
            error_message(message),
            Effect::ReportToParent {
                outcome: SubAgentOutcome {
                    success: false,
                    result: message.into(),
                },
            },
        ],
    );
}

#[test]
fn the_time_limit_is_ignored_where_nothing_of_a_sub_agent_runs() {
    let event = Event::TimeLimit { timeout_ms: 1 };
    check_ignored(requesting(1, 0, 1), &ctx(), event.clone());
    for state in [
        ConvState::Idle,
        ConvState::Completed,
        ConvState::Cancelling { turn: turn(1, 0) },
        ConvState::Error {
            message: "x".into(),
            error_kind: ErrorKind::Unknown,
        },
    ] {
        check_ignored(state, &sub_ctx(), event.clone());
    }
}

#[test]
fn spawn_tasks_may_lower_their_limits_but_not_raise_them() {
    let spawn = ToolUse {
        id: "s".into(),
        name: SPAWN_SUB_AGENTS.into(),
        input: json!({"tasks": [
            {"prompt": "a", "max_steps": 2, "timeout_ms": 500},
            {"prompt": "b", "max_steps": 400, "timeout_ms": 9_000_000},
            {"prompt": "c"},
        ]}),
        extra: None,
    };
    let got = transition(
        &requesting(1, 0, 1),
        &ctx(),
        Event::LlmResponse {
            request: tag(1, 1),
            reply: reply(None, vec![spawn], true),
        },
    )
    .expect("valid");
    let tasks = got
        .effects
        .iter()
        .find_map(|effect| {
            if let Effect::SpawnSubAgents { tasks, .. } = effect {
                Some(tasks.clone())
            } else {
                None
            }
        })
        .expect("the sub-agents are spawned");
    let limits: Vec<(u32, u64)> = tasks.iter().map(|t| (t.max_steps, t.timeout_ms)).collect();
    assert_eq!(limits, vec![(2, 500), (4, 60_000), (4, 60_000)]);
}

#[test]
fn spawn_tasks_with_bad_limits_are_refused_as_a_tool_result() {
    for bad in [json!(0), json!(-3), json!("ten"), json!(1.5)] {
        let spawn = ToolUse {
            id: "s".into(),
            name: SPAWN_SUB_AGENTS.into(),
            input: json!({"tasks": [{"prompt": "a", "max_steps": bad}]}),
            extra: None,
        };
        let got = transition(
            &requesting(1, 0, 1),
            &ctx(),
            Event::LlmResponse {
                request: tag(1, 1),
                reply: reply(None, vec![spawn.clone()], true),
            },
        )
        .expect("valid");
        assert!(
            got.effects.contains(&result(
                &spawn,
                false,
                "invalid input: tasks[0].max_steps must be a positive integer",
                false
            )),
            "{bad}: {:?}",
            got.effects
        );
    }
}

// ---- Fork points (issue 24) ----

#[test]
fn a_history_may_be_forked_only_where_no_tool_call_is_open() {
    let (a, b) = (bash("a"), bash("b"));
    let history = vec![
        MessageContent::User {
            text: "go".into(),
            images: vec![],
        },
        MessageContent::Agent {
            text: None,
            tool_uses: vec![a.clone(), b.clone()],
            reasoning: None,
        },
        MessageContent::tool_result(&a, true, "ok", false),
        MessageContent::tool_result(&b, true, "ok", false),
        MessageContent::Agent {
            text: Some("done".into()),
            tool_uses: vec![],
            reasoning: None,
        },
    ];
    let points: Vec<bool> = (0..=history.len())
        .map(|n| is_fork_point(&history, n))
        .collect();
    assert_eq!(points, [true, true, false, false, true, true]);
    assert!(!is_fork_point(&history, 6), "past the end");
    assert_eq!(last_fork_point(&history), 5);
    // A turn in progress: the fork ends before its open calls.
    assert_eq!(last_fork_point(&history[..3]), 1);
}

// ---------------------------------------------------------------------------------------
// Context continuation (issue 25).

/// A user conversation whose window is 1000 tokens, summarised at 90%.
fn continuing() -> ConvContext {
    ConvContext {
        continuation_permille: 900,
        require_approval: Vec::new(),
        mcp_tools: Vec::new(),
        tools: None,
        permissions: Vec::new(),
        client_tools: Vec::new(),
        ..ctx()
    }
}

fn summary_due(steps: u32, tools: u32) -> Turn {
    Turn {
        summary_due: true,
        ..turn(steps, tools)
    }
}

fn summarizing(steps: u32) -> ConvState {
    ConvState::LlmRequesting {
        turn: Turn {
            summarizing: true,
            ..summary_due(steps, 0)
        },
        attempt: 1,
    }
}

#[test]
fn matrix_an_answer_past_the_threshold_asks_for_the_summary_next() {
    let reply_at = |input: u64, tools: Vec<ToolUse>| Event::LlmResponse {
        request: tag(1, 1),
        reply: LlmReply {
            usage: usage(input, 0),
            ..reply(Some("answer"), tools, true)
        },
    };
    // Below it: the turn ends as always.
    check(
        requesting(1, 0, 1),
        &continuing(),
        reply_at(899, vec![]),
        ConvState::Idle,
        vec![
            Effect::RecordUsage {
                usage: usage(899, 0),
            },
            Effect::WarnContext {
                context_tokens: 899,
                context_window: 1000,
                ratio: 0.899,
            },
            agent(Some("answer"), vec![]),
        ],
    );
    // At it, a finished answer does not end the turn: the summary step comes next.
    check(
        requesting(1, 0, 1),
        &continuing(),
        reply_at(900, vec![]),
        ConvState::AwaitingLlm {
            turn: summary_due(1, 0),
        },
        vec![
            Effect::RecordUsage {
                usage: usage(900, 0),
            },
            Effect::WarnContext {
                context_tokens: 900,
                context_window: 1000,
                ratio: 0.9,
            },
            agent(Some("answer"), vec![]),
            continue_t1(),
        ],
    );
    // Tools asked for in that answer run first; the summary comes after them.
    check(
        requesting(1, 0, 1),
        &continuing(),
        reply_at(950, vec![bash("a")]),
        ConvState::ToolExecuting {
            turn: summary_due(1, 1),
            current: bash("a"),
            remaining: vec![],
            completed: 0,
        },
        vec![
            Effect::RecordUsage {
                usage: usage(950, 0),
            },
            Effect::WarnContext {
                context_tokens: 950,
                context_window: 1000,
                ratio: 0.95,
            },
            agent(Some("answer"), vec![bash("a")]),
            Effect::ExecuteTool {
                turn: tid("t1"),
                tool: bash("a"),
                plan: workspace(),
            },
        ],
    );
    // Sub-agents are not continued.
    check(
        requesting(1, 0, 1),
        &ConvContext {
            is_sub_agent: true,
            ..continuing()
        },
        reply_at(10, vec![bash("a")]),
        ConvState::ToolExecuting {
            turn: turn(1, 1),
            current: bash("a"),
            remaining: vec![],
            completed: 0,
        },
        vec![
            Effect::RecordUsage {
                usage: usage(10, 0),
            },
            agent(Some("answer"), vec![bash("a")]),
            Effect::ExecuteTool {
                turn: tid("t1"),
                tool: bash("a"),
                plan: workspace(),
            },
        ],
    );
}

#[test]
fn matrix_the_summary_step_offers_no_tools_and_may_pass_the_step_limit() {
    // At the step limit (5) a due summary is still asked for.
    check(
        ConvState::AwaitingLlm {
            turn: summary_due(5, 0),
        },
        &continuing(),
        Event::Continue { turn: tid("t1") },
        summarizing(6),
        vec![
            system(SUMMARY_REQUEST),
            Effect::RequestLlm {
                request: tag(6, 1),
                model: "m".into(),
                only_submit: false,
                summary: true,
            },
        ],
    );
}

#[test]
fn matrix_the_summary_ends_the_conversation_and_its_tool_calls_are_not_run() {
    check(
        summarizing(2),
        &continuing(),
        Event::LlmResponse {
            request: tag(2, 1),
            reply: reply(Some("We fixed the parser."), vec![bash("x")], true),
        },
        ConvState::ContextExhausted {
            summary: "We fixed the parser.".into(),
        },
        vec![
            recorded(),
            agent(Some("We fixed the parser."), vec![bash("x")]),
            result(
                &bash("x"),
                false,
                "not run: this was the request for the conversation's summary, which runs no tools",
                true,
            ),
        ],
    );
    // A failed summary request fails the turn as any request does (retries included).
    let got = transition(
        &summarizing(2),
        &continuing(),
        Event::LlmError {
            request: tag(2, 1),
            error: failure(ErrorKind::Auth),
        },
    )
    .expect("valid");
    assert!(matches!(got.new_state, ConvState::Error { .. }));
}

#[test]
fn matrix_an_exhausted_conversation_takes_no_messages() {
    let exhausted = ConvState::ContextExhausted {
        summary: "s".into(),
    };
    check_rejected(
        exhausted.clone(),
        user_message("more"),
        Rejection::ContextExhausted,
    );
    check_rejected(
        exhausted.clone(),
        Event::UserMessage {
            turn: tid("t2"),
            text: "instead".into(),
            images: vec![],
            if_busy: IfBusy::Interrupt { running: None },
        },
        Rejection::ContextExhausted,
    );
    // A cancel leaves it as it is; a background result is stored.
    check(
        exhausted.clone(),
        &ctx(),
        Event::UserCancel,
        exhausted.clone(),
        vec![],
    );
    check_ignored(
        exhausted.clone(),
        &ctx(),
        Event::SummaryRequested { turn: tid("t2") },
    );
}

#[test]
fn matrix_a_summary_asked_for_from_rest() {
    for rest in [
        ConvState::Idle,
        ConvState::Error {
            message: "m".into(),
            error_kind: ErrorKind::Network,
        },
    ] {
        check(
            rest,
            &ctx(),
            Event::SummaryRequested { turn: tid("t1") },
            ConvState::AwaitingLlm {
                turn: summary_due(0, 0),
            },
            vec![continue_t1()],
        );
    }
    check_rejected(
        requesting(1, 0, 1),
        Event::SummaryRequested { turn: tid("t2") },
        Rejection::AgentBusy,
    );
    check_rejected(
        ConvState::Cancelling { turn: turn(1, 0) },
        Event::SummaryRequested { turn: tid("t2") },
        Rejection::Cancelling,
    );
    check_rejected(
        ConvState::Completed,
        Event::SummaryRequested { turn: tid("t2") },
        Rejection::Completed,
    );
}

// How a tool call runs is the core's decision (issue 37): the runtime carries out the plan.

fn call(id: &str, name: &str, input: serde_json::Value) -> ToolUse {
    ToolUse {
        id: id.into(),
        name: name.into(),
        input,
        extra: None,
    }
}

#[test]
fn plan_a_tool_in_require_approval_is_approved_first() {
    let ctx = ConvContext {
        require_approval: vec!["bash".into()],
        ..ctx()
    };
    after_a(
        &ctx,
        bash("b"),
        ToolPlan {
            approval: true,
            action: ToolAction::Workspace,
        },
    );
    // Other tools are not.
    after_a(
        &ctx,
        call("b", "think", json!({"thoughts": "x"})),
        ToolPlan {
            approval: false,
            action: ToolAction::Direct,
        },
    );
}

#[test]
fn plan_workspace_tools_take_a_slot_and_others_run_directly() {
    for name in WORKSPACE_TOOLS {
        after_a(&ctx(), call("b", name, json!({})), workspace());
    }
    after_a(
        &ctx(),
        call("b", "no_such_tool", json!({})),
        ToolPlan {
            approval: false,
            action: ToolAction::Direct,
        },
    );
}

#[test]
fn plan_a_tool_of_an_mcp_server_is_called_there() {
    let ctx = ConvContext {
        mcp_tools: vec!["files__read".into()],
        require_approval: vec!["files__read".into()],
        ..ctx()
    };
    after_a(
        &ctx,
        call("b", "files__read", json!({"path": "x"})),
        ToolPlan {
            approval: true,
            action: ToolAction::Mcp,
        },
    );
}

#[test]
fn plan_bash_in_the_background() {
    after_a(
        &ctx(),
        call(
            "b",
            "bash",
            json!({"command": "make", "background": true, "timeout_ms": 5000, "wake_on_result": true}),
        ),
        ToolPlan {
            approval: false,
            action: ToolAction::Background {
                command: "make".into(),
                timeout_ms: Some(5000),
                wake: true,
            },
        },
    );
    // A zero time limit is no limit of the model's.
    after_a(
        &ctx(),
        call(
            "b",
            "bash",
            json!({"command": "make", "background": true, "timeout_ms": 0}),
        ),
        ToolPlan {
            approval: false,
            action: ToolAction::Background {
                command: "make".into(),
                timeout_ms: None,
                wake: false,
            },
        },
    );
    refused_after_a(
        &ctx(),
        call("q", "bash", json!({"background": true})),
        "invalid arguments: `command` must be a string",
    );
}

#[test]
fn plan_ask_user_is_a_question() {
    let question = |kind: QuestionKind, timeout_ms: Option<u64>| ToolPlan {
        approval: false,
        action: ToolAction::Ask(Question {
            message: "Which?".into(),
            kind,
            timeout_ms,
        }),
    };
    after_a(
        &ctx(),
        call("b", ASK_USER, json!({"question": "Which?"})),
        question(QuestionKind::Prompt, None),
    );
    after_a(
        &ctx(),
        call(
            "b",
            ASK_USER,
            json!({"question": "Which?", "kind": "confirm", "timeout_ms": 9}),
        ),
        question(QuestionKind::Confirm, Some(9)),
    );
    after_a(
        &ctx(),
        call(
            "b",
            ASK_USER,
            json!({"question": "Which?", "kind": "select", "options": ["x", 3, "y"]}),
        ),
        question(
            QuestionKind::Select {
                options: vec!["x".into(), "y".into()],
            },
            None,
        ),
    );
    after_a(
        &ctx(),
        call(
            "b",
            ASK_USER,
            json!({"question": "Which?", "kind": "custom", "schema": {"type": "object"}}),
        ),
        question(
            QuestionKind::Custom {
                type_name: "custom".into(),
                schema: json!({"type": "object"}),
            },
            None,
        ),
    );
}

#[test]
fn plan_a_malformed_question_is_refused_without_asking() {
    refused_after_a(
        &ctx(),
        call("q", ASK_USER, json!({"kind": "prompt"})),
        "invalid arguments: `question` must be a string",
    );
    refused_after_a(
        &ctx(),
        call(
            "q",
            ASK_USER,
            json!({"question": "?", "kind": "select", "options": [1]}),
        ),
        "invalid arguments: select needs `options`, a list of strings",
    );
    refused_after_a(
        &ctx(),
        call("q", ASK_USER, json!({"question": "?", "kind": "essay"})),
        "invalid arguments: kind must be confirm, prompt, select or custom, not \"essay\"",
    );
}

#[test]
fn req_bed_009_plan_a_sub_agent_cannot_ask_the_user() {
    // Not even when the tool needs approval: nothing is asked of anyone.
    let ctx = ConvContext {
        require_approval: vec![ASK_USER.into()],
        ..sub_ctx()
    };
    refused_after_a(
        &ctx,
        call("q", ASK_USER, json!({"question": "Which?"})),
        "ask_user is only available in user conversations",
    );
}

/// Issue 38: an agent's `tools` bound the built-in tools its conversations may call. A call
/// of any other is refused by the core without running (its one result says why) and the
/// next call starts; the conversation's MCP tools are its servers' (an agent chooses them
/// with `mcp_servers`), not bounded by `tools`.
#[test]
fn agent_tools_a_tool_the_agent_lacks_is_refused_without_running() {
    let bounded = ConvContext {
        tools: Some(vec!["bash".into()]),
        mcp_tools: vec!["files__read".into()],
        ..ctx()
    };
    for name in [
        "think",
        "patch",
        "keyword_search",
        "spawn_sub_agents",
        "ask_user",
        "submit_result",
        "no_such_tool",
    ] {
        refused_after_a(
            &bounded,
            call("x", name, json!({})),
            &format!("this agent has no tool named {name:?}; it did not run"),
        );
    }
    after_a(
        &bounded,
        call("b", "files__read", json!({"path": "x"})),
        ToolPlan {
            approval: false,
            action: ToolAction::Mcp,
        },
    );
    // No `tools`: every built-in tool, as before agents.
    after_a(&ctx(), call("b", "patch", json!({})), workspace());
}

/// A sub-agent always has submit_result, whatever its agent's tools: its task ends only
/// with it.
#[test]
fn agent_tools_a_sub_agent_always_has_submit_result() {
    let sub = ConvContext {
        tools: Some(Vec::new()),
        ..sub_ctx()
    };
    assert!(sub.offers(SUBMIT_RESULT));
    assert!(!sub.offers("bash"));
    let user = ConvContext {
        tools: Some(Vec::new()),
        ..ctx()
    };
    assert!(!user.offers(SUBMIT_RESULT));
}

fn rule(
    tool: &str,
    input: &[(&str, &str)],
    action: PermissionAction,
    message: Option<&str>,
) -> PermissionRule {
    PermissionRule {
        tool: tool.into(),
        input: input
            .iter()
            .map(|(field, pattern)| ((*field).to_owned(), (*pattern).to_owned()))
            .collect(),
        action,
        message: message.map(str::to_owned),
    }
}

/// Issue 38: an agent's permission rules, first match first. `deny` refuses a call without
/// running it (built-in, MCP or the core's own spawn_sub_agents) and the LLM gets the
/// rule's message; the next call starts.
#[test]
fn permissions_a_denied_call_never_runs() {
    let ctx = ConvContext {
        mcp_tools: vec!["files__read".into()],
        permissions: vec![
            rule(
                "bash",
                &[("command", "rm *")],
                PermissionAction::Deny,
                Some("no deleting"),
            ),
            rule("files__*", &[], PermissionAction::Deny, None),
            rule(
                "spawn_sub_agents",
                &[],
                PermissionAction::Deny,
                Some("work alone"),
            ),
        ],
        ..ctx()
    };
    refused_after_a(
        &ctx,
        call("x", "bash", json!({"command": "rm -rf /"})),
        "no deleting",
    );
    refused_after_a(
        &ctx,
        call("x", "files__read", json!({"path": "x"})),
        "the agent's permission rules deny this call of files__read; it did not run",
    );
    refused_after_a(
        &ctx,
        call("x", "spawn_sub_agents", json!({"tasks": [{"prompt": "p"}]})),
        "work alone",
    );
    // A field that is present and not a string matches a deny rule (the rules fail closed);
    // one that is absent matches none.
    refused_after_a(
        &ctx,
        call("x", "bash", json!({"command": ["rm", "-rf"]})),
        "no deleting",
    );
    after_a(
        &ctx,
        call("b", "bash", json!({"cmd": "rm -rf /"})),
        workspace(),
    );
}

/// `allow` runs a call without approval even where `require_approval` names its tool; `ask`
/// asks where it does not; no rule matching, `require_approval` decides as before.
#[test]
fn permissions_allow_and_ask_decide_approval() {
    let ctx = ConvContext {
        require_approval: vec!["bash".into()],
        permissions: vec![
            rule(
                "bash",
                &[("command", "git *")],
                PermissionAction::Allow,
                None,
            ),
            rule("th?nk", &[], PermissionAction::Ask, None),
        ],
        ..ctx()
    };
    after_a(
        &ctx,
        call("b", "bash", json!({"command": "git status"})),
        workspace(),
    );
    after_a(
        &ctx,
        call("b", "bash", json!({"command": "ls"})),
        ToolPlan {
            approval: true,
            action: ToolAction::Workspace,
        },
    );
    after_a(
        &ctx,
        call("b", "think", json!({"thoughts": "x"})),
        ToolPlan {
            approval: true,
            action: ToolAction::Direct,
        },
    );
    after_a(&ctx, call("b", "patch", json!({})), workspace());
}

/// A sub-agent's submit_result is never denied: its task ends only with it.
#[test]
fn permissions_never_deny_a_sub_agents_submit() {
    let ctx = ConvContext {
        permissions: vec![rule("*", &[], PermissionAction::Deny, None)],
        ..sub_ctx()
    };
    assert_eq!(
        decide_permission(&ctx.permissions, SUBMIT_RESULT, &json!({})),
        Permission::Denied(
            "the agent's permission rules deny this call of submit_result; it did not run".into()
        )
    );
    let result = transition(
        &executing(
            bash("a"),
            vec![call("s", SUBMIT_RESULT, json!({"result": "done"}))],
            0,
        ),
        &ctx,
        complete("a", true, "ok"),
    )
    .expect("accepted");
    assert!(
        !result.effects.iter().any(|e| matches!(
            e,
            Effect::PersistMessage(MessageContent::Tool(r)) if r.tool_use_id == "s" && !r.ok
        )),
        "{:?}",
        result.effects
    );
}

// ---------------------------------------------------------------------------------------
// Client tools (issue 38): tools the client runs.

/// A user conversation whose client runs `lookup` and whose agent allows only `bash` of the
/// built-in tools.
fn with_client_tool() -> ConvContext {
    ConvContext {
        client_tools: vec!["lookup".into()],
        tools: Some(vec!["bash".into()]),
        ..ctx()
    }
}

fn client_plan(approval: bool) -> ToolPlan {
    ToolPlan {
        approval,
        action: ToolAction::Client,
    }
}

#[test]
fn plan_a_client_tool_waits_for_the_client() {
    after_a(
        &with_client_tool(),
        call("b", "lookup", json!({"q": "x"})),
        client_plan(false),
    );
    // Rules and approvals apply to it like any tool.
    let asks = ConvContext {
        require_approval: vec!["lookup".into()],
        ..with_client_tool()
    };
    after_a(&asks, call("b", "lookup", json!({})), client_plan(true));
    let denied = ConvContext {
        permissions: vec![PermissionRule {
            tool: "look*".into(),
            input: Default::default(),
            action: PermissionAction::Deny,
            message: Some("not now".into()),
        }],
        ..with_client_tool()
    };
    refused_after_a(&denied, call("b", "lookup", json!({})), "not now");
    // Without it, the name is no tool of this agent's.
    refused_after_a(
        &ConvContext {
            client_tools: Vec::new(),
            ..with_client_tool()
        },
        call("b", "lookup", json!({})),
        "this agent has no tool named \"lookup\"; it did not run",
    );
}

/// A restart (or a shutdown) does not end a client tool's call: the state stays on it and
/// the call is taken up again; the tools after it still wait.
#[test]
fn restart_keeps_a_client_tool_call_waiting() {
    let (a, b) = (tool("a", "lookup"), bash("b"));
    for why in [Interruption::Restart, Interruption::Shutdown] {
        check(
            executing(a.clone(), vec![b.clone()], 0),
            &with_client_tool(),
            Event::Interrupted(why),
            executing(a.clone(), vec![b.clone()], 0),
            vec![Effect::ExecuteTool {
                turn: tid("t1"),
                tool: a.clone(),
                plan: client_plan(false),
            }],
        );
    }
    // Its answer, after the restart, is the call's result; the next tool starts.
    check(
        executing(a.clone(), vec![b.clone()], 0),
        &with_client_tool(),
        complete("a", true, "42"),
        executing(b.clone(), vec![], 1),
        vec![
            result(&a, true, "42", false),
            Effect::ExecuteTool {
                turn: tid("t1"),
                tool: b.clone(),
                plan: workspace(),
            },
        ],
    );
}

/// A cancel ends a client tool's call like any tool's: the synthetic result, the tool
/// stopped (the runtime resolves the call as cancelled).
#[test]
fn cancel_ends_a_client_tool_call() {
    let (a, b) = (tool("a", "lookup"), bash("b"));
    check(
        executing(a.clone(), vec![b.clone()], 0),
        &with_client_tool(),
        Event::UserCancel,
        ConvState::Idle,
        vec![
            Effect::CancelTool {
                turn: tid("t1"),
                tool_use_id: "a".into(),
            },
            result(&a, false, CANCELLED_BY_USER, true),
            result(&b, false, SKIPPED_BY_CANCEL, true),
        ],
    );
}

/// A restart while a built-in tool runs before a client tool's call still ends the turn:
/// only a client tool's call in flight survives.
#[test]
fn restart_while_a_built_in_tool_runs_ends_the_turn() {
    let (a, b) = (bash("a"), tool("b", "lookup"));
    check(
        executing(a.clone(), vec![b.clone()], 0),
        &with_client_tool(),
        Event::Interrupted(Interruption::Restart),
        ConvState::Idle,
        vec![
            Effect::CancelTool {
                turn: tid("t1"),
                tool_use_id: "a".into(),
            },
            result(&a, false, "interrupted by server restart", true),
            result(&b, false, "interrupted by server restart", true),
        ],
    );
}

// ---------------------------------------------------------------------------------------
// Queued and steering messages (issue 39): a message to a busy conversation waits for the
// turn to end (`enqueue`) or joins it at its next LLM step (`steer`).

fn waiting_message(id: &str, text: &str, if_busy: IfBusy) -> Event {
    Event::UserMessage {
        turn: tid(id),
        text: text.into(),
        images: vec![],
        if_busy,
    }
}

fn queued(id: &str, text: &str) -> Queued {
    Queued {
        id: tid(id),
        text: text.into(),
        images: vec![],
    }
}

fn user(text: &str) -> Effect {
    Effect::PersistMessage(MessageContent::User {
        text: text.into(),
        images: vec![],
    })
}

/// `requesting(1, 0, 1)` with these waiting in its turn.
fn requesting_with(queue: Vec<Queued>, steering: Vec<Queued>) -> ConvState {
    ConvState::LlmRequesting {
        turn: Turn {
            queued: queue,
            steering,
            ..turn(1, 0)
        },
        attempt: 1,
    }
}

#[test]
fn enqueue_while_busy_waits_in_the_turn_and_at_rest_is_a_send() {
    check(
        requesting(1, 0, 1),
        &ctx(),
        waiting_message("t2", "next", IfBusy::Enqueue),
        requesting_with(vec![queued("t2", "next")], vec![]),
        vec![],
    );
    check(
        requesting_with(vec![queued("t2", "next")], vec![]),
        &ctx(),
        waiting_message("t3", "steer it", IfBusy::Steer),
        requesting_with(vec![queued("t2", "next")], vec![queued("t3", "steer it")]),
        vec![],
    );
    for if_busy in [IfBusy::Enqueue, IfBusy::Steer] {
        check(
            ConvState::Idle,
            &ctx(),
            waiting_message("t1", "hi", if_busy),
            ConvState::AwaitingLlm {
                turn: Turn::new(tid("t1")),
            },
            vec![user("hi"), continue_t1()],
        );
    }
}

/// The turn ends: its first waiting message starts the next turn (steering first, then
/// queued, in arrival order), the others wait in it.
#[test]
fn a_turn_that_ends_starts_the_next_waiting_message() {
    let mut next = Turn::new(tid("t3"));
    next.queued = vec![queued("t2", "queued")];
    check(
        requesting_with(vec![queued("t2", "queued")], vec![queued("t3", "steered")]),
        &ctx(),
        Event::LlmResponse {
            request: tag(1, 1),
            reply: reply(Some("done"), vec![], true),
        },
        ConvState::AwaitingLlm { turn: next },
        vec![
            recorded(),
            agent(Some("done"), vec![]),
            user("steered"),
            Effect::Continue { turn: tid("t3") },
        ],
    );
}

/// A steering message joins the running turn at its next LLM step, after the tool results
/// that were due, without stopping the tool.
#[test]
fn a_steering_message_joins_the_next_llm_step() {
    let a = bash("a");
    let mut running = executing(a.clone(), vec![], 0);
    check(
        running.clone(),
        &ctx(),
        waiting_message("s1", "use python", IfBusy::Steer),
        {
            if let ConvState::ToolExecuting { turn, .. } = &mut running {
                turn.steering.push(queued("s1", "use python"));
            }
            running.clone()
        },
        vec![],
    );
    let ConvState::ToolExecuting { turn: with, .. } = &running else {
        unreachable!("executing")
    };
    let awaiting = ConvState::AwaitingLlm { turn: with.clone() };
    check(
        running.clone(),
        &ctx(),
        complete("a", true, "ok"),
        awaiting.clone(),
        vec![result(&a, true, "ok", false), continue_t1()],
    );
    let mut after = with.clone();
    after.steering.clear();
    after.llm_steps += 1;
    check(
        awaiting,
        &ctx(),
        Event::Continue { turn: tid("t1") },
        ConvState::LlmRequesting {
            turn: after,
            attempt: 1,
        },
        vec![
            user("use python"),
            Effect::RequestLlm {
                request: tag(2, 1),
                model: "m".into(),
                only_submit: false,
                summary: false,
            },
        ],
    );
}

/// A cancel ends the turn, not the queue: the next waiting message starts; an interrupting
/// message's turn takes the queue; a full queue refuses; a sub-agent takes neither kind.
#[test]
fn cancels_interrupts_limits_and_sub_agents_with_a_queue() {
    let a = bash("a");
    let mut running = executing(a.clone(), vec![], 0);
    if let ConvState::ToolExecuting { turn, .. } = &mut running {
        turn.queued.push(queued("t2", "later"));
    }
    check(
        running.clone(),
        &ctx(),
        Event::UserCancel,
        ConvState::AwaitingLlm {
            turn: Turn::new(tid("t2")),
        },
        vec![
            Effect::CancelTool {
                turn: tid("t1"),
                tool_use_id: "a".into(),
            },
            result(&a, false, CANCELLED_BY_USER, true),
            user("later"),
            Effect::Continue { turn: tid("t2") },
        ],
    );
    let mut interrupting = Turn::new(tid("t9"));
    interrupting.queued = vec![queued("t2", "later")];
    check(
        running.clone(),
        &ctx(),
        waiting_message(
            "t9",
            "instead",
            IfBusy::Interrupt {
                running: Some(tid("t1")),
            },
        ),
        ConvState::AwaitingLlm { turn: interrupting },
        vec![
            Effect::CancelTool {
                turn: tid("t1"),
                tool_use_id: "a".into(),
            },
            result(&a, false, CANCELLED_BY_USER, true),
            user("instead"),
            Effect::Continue { turn: tid("t9") },
        ],
    );
    let small = ConvContext {
        limits: TurnLimits {
            max_queued: 1,
            ..TurnLimits::default()
        },
        ..ctx()
    };
    assert_eq!(
        transition(
            &running,
            &small,
            waiting_message("t3", "more", IfBusy::Steer)
        ),
        Err(InvalidTransition::Rejected(Rejection::QueueFull))
    );
    assert_eq!(
        transition(
            &requesting(1, 0, 1),
            &sub_ctx(),
            waiting_message("t3", "more", IfBusy::Enqueue)
        ),
        Err(InvalidTransition::Rejected(Rejection::AgentBusy))
    );
}

#[test]
fn a_waiting_message_is_taken_back() {
    let both = requesting_with(vec![queued("t2", "a"), queued("t3", "b")], vec![]);
    check(
        both.clone(),
        &ctx(),
        Event::Dequeue {
            id: Some(tid("t2")),
        },
        requesting_with(vec![queued("t3", "b")], vec![]),
        vec![],
    );
    check(
        both.clone(),
        &ctx(),
        Event::Dequeue { id: None },
        requesting(1, 0, 1),
        vec![],
    );
    check_ignored(
        both,
        &ctx(),
        Event::Dequeue {
            id: Some(tid("nope")),
        },
    );
    check_ignored(ConvState::Idle, &ctx(), Event::Dequeue { id: None });
}

/// A user turn that had not begun when the process stopped (its message stored, no LLM
/// step yet) begins after the restart; one that had begun ends as before.
#[test]
fn a_turn_not_yet_begun_survives_a_restart() {
    let waiting = ConvState::AwaitingLlm {
        turn: Turn::new(tid("t1")),
    };
    for why in [Interruption::Restart, Interruption::Shutdown] {
        check(
            waiting.clone(),
            &ctx(),
            Event::Interrupted(why),
            waiting.clone(),
            vec![continue_t1()],
        );
    }
    check(
        ConvState::AwaitingLlm { turn: turn(1, 0) },
        &ctx(),
        Event::Interrupted(Interruption::Restart),
        ConvState::Idle,
        vec![],
    );
    check(
        waiting,
        &sub_ctx(),
        Event::Interrupted(Interruption::Restart),
        ConvState::Idle,
        vec![],
    );
}

/// The waiting messages are bounded in bytes too (they are stored with the state, which
/// every step writes again): past it a send is refused.
#[test]
fn the_waiting_messages_are_bounded_in_bytes() {
    let small = ConvContext {
        limits: TurnLimits {
            max_queued_bytes: 10,
            ..TurnLimits::default()
        },
        ..ctx()
    };
    check(
        requesting(1, 0, 1),
        &small,
        waiting_message("t2", "0123456789", IfBusy::Enqueue),
        requesting_with(vec![queued("t2", "0123456789")], vec![]),
        vec![],
    );
    assert_eq!(
        transition(
            &requesting_with(vec![queued("t2", "0123456789")], vec![]),
            &small,
            waiting_message("t3", "x", IfBusy::Steer)
        ),
        Err(InvalidTransition::Rejected(Rejection::QueueFull))
    );
}

/// The turn's end, as a transition reports it (issue 39, webhooks): `None` while the turn
/// goes on.
#[track_caller]
fn ended(state: ConvState, ctx: &ConvContext, event: Event) -> Option<TurnOutcome> {
    let got = transition(&state, ctx, event).expect("the transition is valid");
    got.ended.map(|end| {
        assert_eq!(end.turn, tid("t1"));
        end.outcome
    })
}

#[test]
fn matrix_every_turn_end_is_reported_once_with_its_outcome() {
    // At rest after the answer: completed.
    assert_eq!(
        ended(
            requesting(1, 0, 1),
            &ctx(),
            Event::LlmResponse {
                request: tag(1, 1),
                reply: reply(Some("hello"), vec![], true),
            },
        ),
        Some(TurnOutcome::Completed)
    );
    // A step that goes on (tools, the next LLM step) ends nothing.
    assert_eq!(
        ended(
            requesting(1, 0, 1),
            &ctx(),
            Event::LlmResponse {
                request: tag(1, 1),
                reply: reply(None, vec![bash("a")], false),
            },
        ),
        None
    );
    assert_eq!(
        ended(
            executing(bash("a"), vec![], 0),
            &ctx(),
            complete("a", true, "ok")
        ),
        None
    );
    // An error: failed, with its kind and message (a spent budget among them).
    assert_eq!(
        ended(
            requesting(1, 0, 1),
            &ctx(),
            Event::LlmError {
                request: tag(1, 1),
                error: failure(ErrorKind::Budget),
            },
        ),
        Some(TurnOutcome::Failed {
            error_kind: ErrorKind::Budget,
            message: "The token budget is spent; no LLM request was sent: boom".into(),
        })
    );
    // A cancel while tools run: cancelled at once.
    assert_eq!(
        ended(executing(bash("a"), vec![], 0), &ctx(), Event::UserCancel),
        Some(TurnOutcome::Cancelled)
    );
    // A cancel of an LLM request ends the turn when the abort is confirmed, not before.
    assert_eq!(ended(requesting(1, 0, 1), &ctx(), Event::UserCancel), None);
    assert_eq!(
        ended(
            ConvState::Cancelling { turn: turn(1, 0) },
            &ctx(),
            Event::LlmAborted { request: tag(1, 1) },
        ),
        Some(TurnOutcome::Cancelled)
    );
    // An interrupting message replaces the running turn: that one was cancelled.
    assert_eq!(
        ended(
            executing(bash("a"), vec![], 0),
            &ctx(),
            Event::UserMessage {
                turn: tid("t2"),
                text: "instead".into(),
                images: vec![],
                if_busy: IfBusy::Interrupt {
                    running: Some(tid("t1")),
                },
            },
        ),
        Some(TurnOutcome::Cancelled)
    );
    // A restart that stops the turn: cancelled too.
    assert_eq!(
        ended(
            executing(bash("a"), vec![], 0),
            &ctx(),
            Event::Interrupted(Interruption::Restart),
        ),
        Some(TurnOutcome::Cancelled)
    );
    // The summary that exhausts the context.
    assert_eq!(
        ended(
            summarizing(2),
            &continuing(),
            Event::LlmResponse {
                request: tag(2, 1),
                reply: reply(Some("We fixed the parser."), vec![], true),
            },
        ),
        Some(TurnOutcome::ContextExhausted)
    );
    // At rest nothing ends; a message starts a turn and ends none.
    assert_eq!(ended(ConvState::Idle, &ctx(), Event::UserCancel), None);
    assert_eq!(ended(ConvState::Idle, &ctx(), user_message("hi")), None);
}

#[test]
fn matrix_a_turn_followed_by_a_waiting_message_is_reported_completed() {
    let mut running = turn(1, 0);
    running.queued.push(Queued {
        id: tid("t2"),
        text: "next".into(),
        images: vec![],
    });
    let got = transition(
        &ConvState::LlmRequesting {
            turn: running,
            attempt: 1,
        },
        &ctx(),
        Event::LlmResponse {
            request: tag(1, 1),
            reply: reply(Some("hello"), vec![], true),
        },
    )
    .expect("valid");
    assert_eq!(
        got.ended,
        Some(TurnEnd {
            turn: tid("t1"),
            outcome: TurnOutcome::Completed
        })
    );
    assert_eq!(got.new_state.turn().map(|t| t.id.clone()), Some(tid("t2")));
}
