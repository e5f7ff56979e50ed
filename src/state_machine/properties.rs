//! The core's invariants as properties over random event sequences (REQ-BED-001, -005, -006).

use proptest::prelude::*;

use super::sim::{CLIENT_TOOL, Op, World, op};
use super::*;

fn settle(world: &mut World) {
    world.settle();
}

fn events_for_every_kind(world: &mut World) -> Vec<Event> {
    let ops = [
        Op::UserMessage,
        Op::Interrupt { stale: false },
        Op::Interrupt { stale: true },
        Op::TimeLimit,
        Op::Cancel,
        Op::Continue,
        Op::LlmText {
            end_turn: true,
            tokens: 900,
        },
        Op::LlmTools {
            names: vec![0, 3, 5],
        },
        Op::LlmError {
            kind: 2,
            retry_after: None,
        },
        Op::AbortAck,
        Op::RetryFires,
        Op::ToolDone { ok: false },
        Op::SpawnAck,
        Op::SubAgentDone {
            pick: 0,
            success: true,
        },
        Op::Background { wake: true },
        Op::Restart,
        Op::Stale { pick: 7 },
    ];
    ops.iter().filter_map(|op| world.event_for(op)).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]

    /// REQ-BED-001 determinism, and every invariant after every step of a random run.
    #[test]
    fn invariants_hold_over_random_runs(is_sub_agent in any::<bool>(), ops in proptest::collection::vec(op(), 1..80)) {
        let mut world = World::new(is_sub_agent);
        for op in &ops {
            let Some(event) = world.event_for(op) else { continue };

            // Determinism: the same inputs give the same outputs.
            let first = transition(&world.state, &world.ctx, event.clone());
            let second = transition(&world.state, &world.ctx, event.clone());
            prop_assert_eq!(&first, &second);

            // A busy state rejects a user message and stays as it is.
            if world.state.is_busy() {
                let user = Event::UserMessage { turn: TurnId::new("x"), text: "x".into(), images: vec![], if_busy: IfBusy::Reject };
                let got = transition(&world.state, &world.ctx, user);
                prop_assert!(matches!(got, Err(InvalidTransition::Rejected(_))), "busy state accepted a message: {got:?}");
            }

            // Cancel from any state reaches Idle (a completed sub-agent stays completed, an
            // exhausted conversation exhausted).
            let mut probe = World::new(is_sub_agent);
            probe.state = world.state.clone();
            probe.ctx = world.ctx.clone();
            settle(&mut probe);
            prop_assert!(matches!(probe.state, ConvState::Idle | ConvState::Completed | ConvState::ContextExhausted { .. }), "cancel left {:?}", probe.state);

            let before = world.state.clone();
            let outcome = world.apply(event);
            if let Err(InvalidTransition::Rejected(_)) = outcome {
                prop_assert_eq!(&world.state, &before);
            }

            // Attempts never exceed 3.
            if let ConvState::LlmRequesting { attempt, .. } = world.state {
                prop_assert!((1..=MAX_LLM_ATTEMPTS).contains(&attempt));
            }
            // The chain is valid at every step, with the current turn's calls still open.
            prop_assert_eq!(validate_chain(&world.log, true), Ok(()));
        }
        // Every tool_use persisted gets exactly one tool_result once the conversation rests.
        settle(&mut world);
        prop_assert_eq!(validate_chain(&world.log, false), Ok(()));
    }

    /// No event of any kind panics in any reachable state.
    #[test]
    fn no_event_panics_in_any_reachable_state(is_sub_agent in any::<bool>(), ops in proptest::collection::vec(op(), 0..60)) {
        let mut world = World::new(is_sub_agent);
        for op in &ops {
            for event in events_for_every_kind(&mut world) {
                let _ = transition(&world.state, &world.ctx, event);
            }
            if let Some(event) = world.event_for(op) {
                let _ = world.apply(event);
            }
        }
    }

    /// A restart at any moment leaves an idle conversation whose chain is complete
    /// (REQ-BED-007), unless a client tool's call was in flight (issue 38) or a user turn had
    /// not begun (issue 39): then it goes on, untouched by the restart, and its answer or a
    /// cancel closes the chain.
    #[test]
    fn restart_at_any_moment_leaves_a_valid_chain(is_sub_agent in any::<bool>(), ops in proptest::collection::vec(op(), 1..60), answer in any::<bool>()) {
        let mut world = World::new(is_sub_agent);
        for op in &ops {
            if let Some(event) = world.event_for(op) {
                let _ = world.apply(event);
            }
        }
        let before = world.log.len();
        let _ = world.apply(Event::Interrupted(Interruption::Restart));
        if world.state.is_busy() {
            // Only a client tool's call in flight, or a user turn not yet begun, goes on.
            if let ConvState::ToolExecuting { current, .. } = &world.state {
                prop_assert_eq!(current.name.as_str(), CLIENT_TOOL);
            } else if let ConvState::AwaitingLlm { turn } = &world.state {
                prop_assert_eq!(turn.llm_steps, 0);
                prop_assert!(!is_sub_agent);
            } else {
                return Err(TestCaseError::fail(format!("busy after a restart in {}", world.state.kind())));
            }
            // The restart stored nothing for a client tool's call (a turn not yet begun may be
            // the next waiting message, whose message it stored).
            if matches!(world.state, ConvState::ToolExecuting { .. }) {
                prop_assert_eq!(world.log.len(), before);
            }
            if answer {
                let _ = world.event_for(&Op::ToolDone { ok: true }).map(|done| world.apply(done));
            }
            world.settle();
            prop_assert!(!world.state.is_busy());
        }
        prop_assert_eq!(validate_chain(&world.log, false), Ok(()));
    }
}

/// Whether an event answers work a turn started (and so must never apply to a later turn).
fn answers_work(event: &Event) -> bool {
    match event {
        Event::Continue { .. }
        | Event::LlmResponse { .. }
        | Event::LlmError { .. }
        | Event::LlmAborted { .. }
        | Event::RetryTimeout { .. }
        | Event::ToolComplete { .. }
        | Event::SubAgentsSpawned { .. }
        | Event::SubAgentResult { .. } => true,
        Event::UserMessage { .. }
        | Event::UserCancel
        | Event::SummaryRequested { .. }
        | Event::BackgroundResult { .. }
        | Event::Interrupted(_)
        | Event::TimeLimit { .. }
        | Event::Dequeue { .. } => false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Interrupt-and-send at any moment (issue 24): from any state but a completed or a
    /// working sub-agent it is accepted; it stores exactly one user message; the chain stays valid; the new
    /// turn is the one waiting for the LLM; and no answer to earlier work applies after it.
    #[test]
    fn interrupt_at_any_moment(is_sub_agent in any::<bool>(), ops in proptest::collection::vec(op(), 0..60)) {
        let mut world = World::new(is_sub_agent);
        for op in &ops {
            if let Some(event) = world.event_for(op) {
                let _ = world.apply(event);
            }
        }
        let earlier = world.delivered.clone();
        let users = |log: &[MessageContent]| log.iter().filter(|m| matches!(m, MessageContent::User { .. })).count();
        let before = users(&world.log);
        let was_completed = world.state == ConvState::Completed;
        let was_exhausted = matches!(world.state, ConvState::ContextExhausted { .. });
        let working_sub_agent = is_sub_agent && world.state.is_busy();
        let event = world.event_for(&Op::Interrupt { stale: false }).expect("always an event");
        let Event::UserMessage { turn: new_turn, .. } = event.clone() else { unreachable!() };
        let outcome = world.apply(event);
        if was_completed {
            prop_assert_eq!(outcome, Err(InvalidTransition::Rejected(Rejection::Completed)));
            return Ok(());
        }
        if was_exhausted {
            prop_assert_eq!(outcome, Err(InvalidTransition::Rejected(Rejection::ContextExhausted)));
            return Ok(());
        }
        if working_sub_agent {
            prop_assert_eq!(outcome, Err(InvalidTransition::Rejected(Rejection::AgentBusy)));
            return Ok(());
        }
        prop_assert!(outcome.is_ok(), "interrupt refused: {outcome:?}");
        prop_assert_eq!(users(&world.log), before + 1);
        // The new turn begins; what waited in the old one waits in it.
        let ConvState::AwaitingLlm { turn } = &world.state else {
            return Err(TestCaseError::fail(format!("not awaiting the LLM: {}", world.state.kind())));
        };
        prop_assert_eq!(&turn.id, &new_turn);
        prop_assert_eq!(turn.llm_steps, 0);
        prop_assert_eq!(validate_chain(&world.log, true), Ok(()));
        // A second interrupt that saw the same (now replaced) turn is busy.
        let twin = Event::UserMessage {
            turn: TurnId::new("twin"),
            text: "twin".into(),
            images: vec![],
            if_busy: IfBusy::Interrupt { running: None },
        };
        prop_assert_eq!(
            transition(&world.state, &world.ctx, twin),
            Err(InvalidTransition::Rejected(Rejection::AgentBusy))
        );
        for late in earlier.into_iter().filter(answers_work) {
            let got = transition(&world.state, &world.ctx, late.clone());
            prop_assert!(matches!(got, Err(InvalidTransition::Ignored { .. })), "{late:?} applied after the interrupt: {got:?}");
        }
        settle(&mut world);
        prop_assert_eq!(validate_chain(&world.log, false), Ok(()));
    }
}

/// The random runs above are not vacuous: with a fixed seed they reach every state, and
/// every kind of event is applied somewhere.
#[test]
fn random_runs_reach_every_state() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    use std::collections::BTreeSet;

    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]);
    let mut runner = TestRunner::new_with_rng(Config::default(), rng);
    let strategy = (any::<bool>(), proptest::collection::vec(op(), 1..80));
    let mut states = BTreeSet::new();
    let mut applied = BTreeSet::new();
    let mut client_calls_kept = 0;
    for _ in 0..1200 {
        let (is_sub_agent, ops) = strategy.new_tree(&mut runner).expect("a sample").current();
        let mut world = World::new(is_sub_agent);
        for op in &ops {
            if let Some(event) = world.event_for(op) {
                let name = event.name();
                let restart = matches!(event, Event::Interrupted(_));
                if world.apply(event).is_ok() {
                    applied.insert(name);
                    client_calls_kept += usize::from(restart && world.state.is_busy());
                }
                states.insert(world.state.kind());
            }
        }
    }
    // Restarts met client tools' calls in flight, which went on.
    assert!(client_calls_kept > 0);
    let all_states = [
        "idle",
        "awaiting_llm",
        "llm_requesting",
        "tool_executing",
        "cancelling",
        "awaiting_sub_agents",
        "error",
        "completed",
        "context_exhausted",
    ];
    assert_eq!(states, all_states.into_iter().collect());
    let all_events = [
        "user_message",
        "user_cancel",
        "continue",
        "llm_response",
        "llm_error",
        "llm_aborted",
        "retry_timeout",
        "tool_complete",
        "sub_agents_spawned",
        "sub_agent_result",
        "background_result",
        "interrupted",
        "time_limit",
        "summary_requested",
        "dequeue",
    ];
    assert_eq!(applied, all_events.into_iter().collect());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// The fork points of every history the core stores are exactly the prefixes that are
    /// valid chains with nothing open (issue 24).
    #[test]
    fn fork_points_are_the_closed_valid_prefixes(is_sub_agent in any::<bool>(), ops in proptest::collection::vec(op(), 0..60)) {
        let mut world = World::new(is_sub_agent);
        for op in &ops {
            if let Some(event) = world.event_for(op) {
                let _ = world.apply(event);
            }
        }
        let expected: Vec<usize> = (0..=world.log.len())
            .filter(|&n| validate_chain(&world.log[..n], false).is_ok())
            .collect();
        prop_assert_eq!(fork_points(&world.log), expected);
    }
}

/// Any JSON value, a few levels deep.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        "[a-z ]{0,8}".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            proptest::collection::btree_map(
                prop_oneof![
                    Just("question".to_owned()),
                    Just("kind".to_owned()),
                    Just("options".to_owned()),
                    Just("command".to_owned()),
                    Just("background".to_owned()),
                    Just("timeout_ms".to_owned()),
                    "[a-z_]{1,8}",
                ],
                inner,
                0..5,
            )
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// The plan of any call is total, asks for approval exactly when the conversation names
    /// the tool, never lets a sub-agent ask the user, and sends a call to an MCP server only
    /// when the conversation has that tool (issue 37: the core decides how a tool runs).
    #[test]
    fn a_tool_plan_is_total_and_keeps_its_promises(
        is_sub_agent in any::<bool>(),
        name in prop_oneof![
            Just(ASK_USER.to_owned()),
            Just("bash".to_owned()),
            Just("patch".to_owned()),
            Just("think".to_owned()),
            Just("srv__tool".to_owned()),
            "[a-z_]{1,10}",
        ],
        input in json_value(),
        approve in any::<bool>(),
        mcp in any::<bool>(),
    ) {
        let ctx = ConvContext {
            require_approval: if approve { vec![name.clone()] } else { Vec::new() },
            mcp_tools: if mcp { vec!["srv__tool".into()] } else { Vec::new() },
            ..context_of(is_sub_agent)
        };
        let tool = ToolUse::new("t", name.clone(), input);
        match plan_tool(&ctx, &tool) {
            Ok(plan) => {
                prop_assert_eq!(plan.approval, approve);
                prop_assert_eq!(matches!(plan.action, ToolAction::Mcp), mcp && name == "srv__tool");
                prop_assert!(!(is_sub_agent && matches!(plan.action, ToolAction::Ask(_))));
                if let ToolAction::Ask(question) = &plan.action
                    && let QuestionKind::Select { options } = &question.kind
                {
                    prop_assert!(!options.is_empty());
                }
            }
            Err(why) => {
                prop_assert!(!why.is_empty());
                prop_assert!(name == ASK_USER || name == "bash");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Issue 38: whatever an agent's tools and whatever the LLM calls, a call of a tool the
    /// conversation does not offer is never carried out (no ExecuteTool, no SpawnSubAgents)
    /// and gets exactly one result, at once; every call gets exactly one result.
    #[test]
    fn a_tool_the_agent_lacks_never_runs(
        allowed in proptest::sample::subsequence(
            vec!["bash", "patch", "think", "keyword_search", "spawn_sub_agents", "ask_user"],
            0..=6,
        ),
        names in proptest::collection::vec(
            prop_oneof![
                Just("bash".to_owned()),
                Just("think".to_owned()),
                Just("spawn_sub_agents".to_owned()),
                Just("submit_result".to_owned()),
                Just("srv__tool".to_owned()),
                "[a-z_]{1,8}",
            ],
            1..6,
        ),
        is_sub_agent in any::<bool>(),
    ) {
        let ctx = ConvContext {
            mcp_tools: vec!["srv__tool".into()],
            tools: Some(allowed.iter().map(|name| (*name).to_owned()).collect()),
            ..context_of(is_sub_agent)
        };
        let first = ToolUse::new("first", "think", serde_json::json!({}));
        let calls: Vec<ToolUse> = names
            .iter()
            .enumerate()
            .map(|(i, name)| ToolUse::new(format!("c{i}"), name.clone(), serde_json::json!({})))
            .collect();
        let turn = TurnId::new("t1");
        let mut state = ConvState::ToolExecuting {
            turn: Turn {
                tool_calls: 1 + calls.len() as u32,
                ..Turn::new(turn.clone())
            },
            current: first.clone(),
            remaining: calls.clone(),
            completed: 0,
        };
        let mut done = first.id.clone();
        let mut results: Vec<String> = Vec::new();
        // Each call that is carried out completes at once; stop when the turn moves on.
        while let Ok(step) = transition(
            &state,
            &ctx,
            Event::ToolComplete {
                turn: turn.clone(),
                tool_use_id: done.clone(),
                outcome: ToolOutcome { ok: true, output: "ok".into() },
            },
        ) {
            let mut started = None;
            for effect in &step.effects {
                match effect {
                    Effect::PersistMessage(MessageContent::Tool(result)) => {
                        results.push(result.tool_use_id.clone());
                        if let Some(call) = calls.iter().find(|c| c.id == result.tool_use_id)
                            && !ctx.offers(&call.name)
                        {
                            prop_assert!(!result.ok);
                            prop_assert!(result.output.contains("has no tool named"));
                        }
                    }
                    Effect::ExecuteTool { tool, .. } => {
                        prop_assert!(ctx.offers(&tool.name), "{} ran", tool.name);
                        started = Some(tool.id.clone());
                    }
                    Effect::SpawnSubAgents { .. } => {
                        prop_assert!(ctx.offers("spawn_sub_agents"));
                        started = None;
                    }
                    Effect::PersistMessage(_)
                    | Effect::Continue { .. }
                    | Effect::RequestLlm { .. }
                    | Effect::AbortLlm { .. }
                    | Effect::ScheduleRetry { .. }
                    | Effect::CancelTool { .. }
                    | Effect::StopSubAgents { .. }
                    | Effect::ReportToParent { .. }
                    | Effect::GraceTurnStarted
                    | Effect::RecordUsage { .. }
                    | Effect::NotifyRetrying { .. }
                    | Effect::WarnContext { .. } => {}
                }
            }
            state = step.new_state;
            match started {
                Some(id) => done = id,
                None => break,
            }
        }
        // Calls after a spawn or a sub-agent's submit wait or are answered elsewhere; those
        // answered here were answered once each.
        let mut seen = results.clone();
        seen.sort();
        seen.dedup();
        prop_assert_eq!(seen.len(), results.len());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Issue 38: whatever the rules and the call, the plan is one of the rules' three
    /// decisions (or `require_approval`'s when none matches): a call the first matching rule
    /// denies is refused with its message, an allowed one needs no approval, one to ask
    /// about does.
    #[test]
    fn permission_rules_decide_every_call(
        rules in proptest::collection::vec(
            (
                prop_oneof![Just("*"), Just("bash"), Just("ba*"), Just("think"), Just("srv__*"), Just("?ash")],
                proptest::option::of(prop_oneof![Just("git *"), Just("rm *"), Just("*"), Just("ls")]),
                prop_oneof![Just(PermissionAction::Allow), Just(PermissionAction::Deny), Just(PermissionAction::Ask)],
            ),
            0..6,
        ),
        name in prop_oneof![Just("bash"), Just("think"), Just("srv__tool"), Just("patch")],
        command in prop_oneof![Just("git status"), Just("rm -rf x"), Just("ls"), Just("echo")],
        approve in any::<bool>(),
    ) {
        let rules: Vec<PermissionRule> = rules
            .into_iter()
            .map(|(tool, pattern, action)| PermissionRule {
                tool: tool.to_owned(),
                input: pattern
                    .map(|p| [("command".to_owned(), p.to_owned())].into())
                    .unwrap_or_default(),
                action,
                message: Some(format!("{tool} is denied")),
            })
            .collect();
        let ctx = ConvContext {
            require_approval: if approve { vec![name.to_owned()] } else { Vec::new() },
            mcp_tools: vec!["srv__tool".into()],
            permissions: rules.clone(),
            ..context_of(false)
        };
        let input = serde_json::json!({"command": command});
        let first = rules.iter().find(|rule| {
            wildmatch::WildMatch::new(&rule.tool).matches(name)
                && rule.input.values().all(|p| wildmatch::WildMatch::new(p).matches(command))
        });
        let tool = ToolUse::new("t", name, input);
        match (plan_tool(&ctx, &tool), first) {
            (Err(why), Some(rule)) => {
                prop_assert_eq!(rule.action, PermissionAction::Deny);
                prop_assert_eq!(Some(why), rule.message.clone());
            }
            (Err(why), None) => prop_assert!(false, "refused without a rule: {}", why),
            (Ok(plan), Some(rule)) => {
                prop_assert_ne!(rule.action, PermissionAction::Deny);
                prop_assert_eq!(plan.approval, rule.action == PermissionAction::Ask);
            }
            (Ok(plan), None) => prop_assert_eq!(plan.approval, approve),
        }
    }
}

/// A context with no approvals, rules or tools of its own.
fn context_of(is_sub_agent: bool) -> ConvContext {
    ConvContext {
        conversation_id: "c".into(),
        working_dir: "/w".into(),
        model_id: "m".into(),
        is_sub_agent,
        limits: TurnLimits::default(),
        context_window: 0,
        context_tokens: 0,
        continuation_permille: 0,
        require_approval: Vec::new(),
        mcp_tools: Vec::new(),
        tools: None,
        permissions: Vec::new(),
        client_tools: Vec::new(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Queued and steering messages (issue 39): every waiting message that is not taken back
    /// is stored exactly once, the queued ones in arrival order; none is stored twice or out
    /// of nowhere; the chain stays valid; a conversation at rest has nothing waiting.
    #[test]
    fn waiting_messages_are_stored_exactly_once_in_order(ops in proptest::collection::vec(op(), 1..80)) {
        let mut world = World::new(false);
        let mut accepted: Vec<(String, bool)> = Vec::new();
        let mut taken_back: std::collections::BTreeSet<String> = Default::default();
        let mut dropped = false;
        // Late replays of events are left out: a replayed send is another message.
        for op in ops.iter().filter(|op| !matches!(op, Op::Stale { .. })) {
            let Some(event) = world.event_for(op) else { continue };
            let waiting_before: Vec<(String, String)> = world
                .state
                .turn()
                .map(|turn| turn.steering.iter().chain(&turn.queued).map(|q| (q.id.0.clone(), q.text.clone())).collect())
                .unwrap_or_default();
            let wait = if let Event::UserMessage { text, if_busy: if_busy @ (IfBusy::Enqueue | IfBusy::Steer), .. } = &event {
                Some((text.clone(), *if_busy == IfBusy::Steer))
            } else {
                None
            };
            let dequeue = if let Event::Dequeue { id } = &event { Some(id.clone()) } else { None };
            if world.apply(event).is_ok() {
                if let Some(message) = wait {
                    accepted.push(message);
                }
                if let Some(id) = dequeue {
                    for (queued_id, text) in &waiting_before {
                        if id.as_ref().is_none_or(|id| &id.0 == queued_id) {
                            taken_back.insert(text.clone());
                        }
                    }
                }
                if matches!(world.state, ConvState::ContextExhausted { .. }) && !waiting_before.is_empty() {
                    dropped = true;
                }
            }
            if !world.state.is_busy() {
                prop_assert!(world.state.turn().is_none());
            }
        }
        world.settle();
        prop_assert!(!world.state.is_busy());
        prop_assert_eq!(validate_chain(&world.log, false), Ok(()));
        let stored: Vec<&str> = world
            .log
            .iter()
            .filter_map(|m| if let MessageContent::User { text, .. } = m { Some(text.as_str()) } else { None })
            .filter(|text| text.starts_with('m'))
            .collect();
        let unique: std::collections::BTreeSet<&str> = stored.iter().copied().collect();
        prop_assert_eq!(unique.len(), stored.len(), "a message stored twice: {:?}", stored);
        for text in &stored {
            prop_assert!(accepted.iter().any(|(a, _)| a == text), "{} was never sent", text);
            prop_assert!(!taken_back.contains(*text), "{} was taken back and stored", text);
        }
        if !dropped && !matches!(world.state, ConvState::ContextExhausted { .. }) {
            for (text, _) in &accepted {
                prop_assert!(taken_back.contains(text) || unique.contains(text.as_str()), "{} was lost", text);
            }
        }
        // Queued (not steering) messages are stored in the order they arrived.
        let queued_order: Vec<&str> = accepted
            .iter()
            .filter(|(text, steer)| !steer && unique.contains(text.as_str()))
            .map(|(text, _)| text.as_str())
            .collect();
        let stored_queued: Vec<&str> = stored
            .iter()
            .copied()
            .filter(|text| queued_order.contains(text))
            .collect();
        prop_assert_eq!(stored_queued, queued_order);
    }
}
