//! The replay log's encoding and the replay itself (issue 40): random runs of the simulator
//! are recorded as the runtime records them, stored and read back as JSON, and replayed.

use std::collections::HashMap;

use chrono::TimeZone as _;
use proptest::prelude::*;

use super::*;
use crate::state_machine::sim::{Op, World, op};
use crate::state_machine::{
    Effect, IfBusy, LlmReply, LlmRequestTag, ToolOutcome, ToolUse, TurnId, Usage,
};

/// A run recorded as the runtime records it: steps (grouped into rows as commits group
/// them), the messages they persisted, and what the core decided at each step.
struct Recorded {
    rows: Vec<StepRow>,
    messages: HashMap<i64, Recalled>,
    states: Vec<ConvState>,
    effects: Vec<Vec<Effect>>,
}

fn record_run(is_sub_agent: bool, ops: &[Op], pairs: &[bool]) -> Recorded {
    let mut world = World::new(is_sub_agent);
    let mut recorder = Recorder::new(1);
    let mut next_seq = 1;
    let mut recorded = Recorded {
        rows: Vec::new(),
        messages: HashMap::new(),
        states: Vec::new(),
        effects: Vec::new(),
    };
    let mut pending_row: Vec<LoggedStep> = Vec::new();
    let at = chrono::Utc
        .with_ymd_and_hms(2026, 1, 1, 0, 0, 0)
        .single()
        .expect("a time");
    let flush = |row: &mut Vec<LoggedStep>, rows: &mut Vec<StepRow>| {
        if row.is_empty() {
            return;
        }
        // Stored and read back as the store does.
        let json = LoggedStep::array(row);
        rows.push(StepRow::parse(row[0].n, 0, &json).expect("steps read back"));
        row.clear();
    };
    for (i, op) in ops.iter().enumerate() {
        if matches!(op, Op::Restart) {
            // A restart: the next actor starts a segment of its own.
            flush(&mut pending_row, &mut recorded.rows);
            recorder = Recorder::new(recorder.next());
        }
        let before = world.state.clone();
        let ctx = world.ctx.clone();
        let Some(event) = world.event_for(op) else {
            continue;
        };
        let Ok(result) = world.apply(event.clone()) else {
            continue;
        };
        let Some(step) = recorder.record(&before, &ctx, event, &result) else {
            continue; // it changed nothing and asked for nothing
        };
        // Numbered as commit::plan numbers them: an LLM response's usage goes with the
        // agent message it produced.
        let mut messages = Vec::new();
        let mut usage = None;
        for effect in &result.effects {
            if let Effect::RecordUsage { usage: u } = effect {
                usage = Some(*u);
            }
            let Effect::PersistMessage(content) = effect else {
                continue;
            };
            let usage = matches!(content, MessageContent::Agent { .. })
                .then(|| usage.take())
                .flatten();
            messages.push(MessageRecord {
                id: format!("m{next_seq}"),
                conversation_id: "c".into(),
                sequence_id: next_seq,
                content: content.clone(),
                usage,
                client_message_id: None,
                created_at: at,
            });
            recorded.messages.insert(
                next_seq,
                Recalled {
                    content: content.clone(),
                    usage,
                },
            );
            next_seq += 1;
        }
        // What is stored, written straight from the event, is what the tree gives.
        assert_eq!(
            serde_json::to_string(&Compact::of(&step.event, step.turn.as_ref(), &messages))
                .expect("serialises"),
            compact(&step.event, step.turn.as_ref(), &messages).to_string(),
        );
        pending_row.push(step.finish(&messages));
        recorded.states.push(result.new_state.clone());
        recorded.effects.push(result.effects.clone());
        // Two transitions share a commit when the runtime plans the next step ahead.
        if !pairs.get(i).copied().unwrap_or(false) {
            flush(&mut pending_row, &mut recorded.rows);
        }
    }
    flush(&mut pending_row, &mut recorded.rows);
    recorded
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        ..ProptestConfig::default()
    })]

    /// Issue 40: replaying the recorded log of any random run (every event kind: restarts,
    /// interrupts, client tools, sub-agents, queued and steering messages, stale answers)
    /// reproduces every state and every effect exactly, from the compact JSON as stored.
    #[test]
    fn replaying_a_recorded_run_reproduces_every_decision(
        is_sub_agent in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..80),
        pairs in proptest::collection::vec(any::<bool>(), 80),
    ) {
        let recorded = record_run(is_sub_agent, &ops, &pairs);
        let messages = &recorded.messages;
        let lookup = |seq: i64| messages.get(&seq).cloned();
        let mut seen = 0usize;
        let checked = replay(&recorded.rows, &lookup, decide, |_, _, _, result, same| {
            assert!(same, "step {seen} differs");
            assert_eq!(result.new_state, recorded.states[seen], "the state after step {seen}");
            assert_eq!(result.effects, recorded.effects[seen], "the effects of step {seen}");
            seen += 1;
            Visit::Continue
        });
        prop_assert!(checked.divergence.is_none(), "{:?}", checked.divergence);
        prop_assert_eq!(checked.steps as usize, recorded.states.len());
        prop_assert_eq!(checked.skipped, 0);
        prop_assert_eq!(seen, recorded.states.len());
    }

    /// A changed decision is found at the first step it changes, and nothing before it is
    /// reported.
    #[test]
    fn a_changed_decision_is_found_at_its_first_step(
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let recorded = record_run(false, &ops, &[]);
        let first_changed = recorded.effects.iter().position(|effects| {
            effects.iter().any(|e| matches!(e, Effect::PersistMessage(MessageContent::Tool(_))))
        });
        let messages = &recorded.messages;
        let lookup = |seq: i64| messages.get(&seq).cloned();
        let checked = replay(&recorded.rows, &lookup, changed_decision, |_, _, _, _, _| Visit::Continue);
        match first_changed {
            None => prop_assert!(checked.divergence.is_none()),
            Some(index) => {
                let divergence = checked.divergence.expect("a divergence");
                prop_assert_eq!(divergence.step, index as i64 + 1);
                prop_assert_eq!(checked.steps as usize, index);
                prop_assert!(divergence.replayed.is_some());
            }
        }
    }
}

fn message(seq: i64, content: MessageContent) -> MessageRecord {
    MessageRecord {
        id: format!("m{seq}"),
        conversation_id: "c".into(),
        sequence_id: seq,
        content,
        usage: None,
        client_message_id: None,
        created_at: chrono::Utc
            .with_ymd_and_hms(2026, 1, 1, 0, 0, 0)
            .single()
            .expect("a time"),
    }
}

/// An event whose text a message of its transition holds refers to the message instead of
/// copying it, and reads back whole.
#[test]
fn events_refer_to_their_messages_and_read_back_whole() {
    let turn = TurnId::new("t1");
    let tool = ToolUse::new("u1", "bash", serde_json::json!({"command": "ls"}));
    let cases = [
        (
            Event::UserMessage {
                turn: turn.clone(),
                text: "a long question".repeat(20),
                images: vec![],
                if_busy: IfBusy::Enqueue,
            },
            MessageContent::User {
                text: "a long question".repeat(20),
                images: vec![],
            },
        ),
        (
            Event::LlmResponse {
                request: LlmRequestTag {
                    turn: turn.clone(),
                    step: 1,
                    attempt: 2,
                },
                reply: LlmReply {
                    text: Some("let me look".repeat(20)),
                    tool_uses: vec![tool.clone()],
                    end_turn: true,
                    usage: Usage {
                        input_tokens: 10,
                        output_tokens: 3,
                    },
                    reasoning: None,
                },
            },
            MessageContent::Agent {
                text: Some("let me look".repeat(20)),
                tool_uses: vec![tool],
                reasoning: None,
            },
        ),
        (
            Event::ToolComplete {
                turn: turn.clone(),
                tool_use_id: "u1".into(),
                outcome: ToolOutcome {
                    ok: true,
                    output: "file\n".repeat(100),
                },
            },
            MessageContent::Tool(crate::state_machine::ToolResult {
                tool_use_id: "u1".into(),
                name: "bash".into(),
                ok: true,
                output: "file\n".repeat(100),
                cancelled: false,
            }),
        ),
    ];
    let usage = Usage {
        input_tokens: 10,
        output_tokens: 3,
    };
    for (event, content) in cases {
        let mut stored_message = message(7, content.clone());
        if matches!(content, MessageContent::Agent { .. }) {
            stored_message.usage = Some(usage);
        }
        let recalled = Recalled {
            content: content.clone(),
            usage: stored_message.usage,
        };
        let lookup = |seq: i64| (seq == 7).then(|| recalled.clone());
        // Of the running turn: the turn is left out, and read back from the state before.
        for running in [None, Some(&turn)] {
            let stored = compact(&event, running, std::slice::from_ref(&stored_message));
            let text = stored.to_string();
            assert_eq!(
                serde_json::to_string(&Compact::of(
                    &event,
                    running,
                    std::slice::from_ref(&stored_message)
                ))
                .expect("serialises"),
                text
            );
            assert!(text.contains("\"msg\":7"), "{text}");
            assert_eq!(
                text.contains("\"t1\""),
                running.is_none() || matches!(event, Event::UserMessage { .. }),
                "{text}"
            );
            assert!(text.len() < 120, "{} bytes: {text}", text.len());
            assert_eq!(expand(stored, running, &lookup).expect("reads back"), event);
            // Without its message, the event is kept whole.
            let whole = compact(&event, running, &[]);
            assert!(!whole.to_string().contains("\"msg\""));
            assert_eq!(
                expand(whole, running, &|_| None).expect("reads back"),
                event
            );
        }
    }
    // A message that is gone is a clear error, not a panic.
    let stored = compact(
        &Event::UserMessage {
            turn,
            text: "x".into(),
            images: vec![],
            if_busy: IfBusy::Reject,
        },
        None,
        &[message(
            3,
            MessageContent::User {
                text: "x".into(),
                images: vec![],
            },
        )],
    );
    assert!(
        expand(stored, None, &|_| None)
            .expect_err("gone")
            .contains("message 3")
    );
}

/// The digest is the decision's: the same result gives the same digest, another result
/// another.
#[test]
fn the_digest_follows_the_decision() {
    let world = World::new(false);
    let event = Event::UserMessage {
        turn: TurnId::new("t"),
        text: "hi".into(),
        images: vec![],
        if_busy: IfBusy::Reject,
    };
    let one = transition(&world.state, &world.ctx, event.clone()).expect("accepted");
    let two = transition(&world.state, &world.ctx, event).expect("accepted");
    assert_eq!(digest(&one), digest(&two));
    assert_eq!(digest(&one).len(), 16);
    let mut other = one.clone();
    other.effects.pop();
    assert_ne!(digest(&one), digest(&other));
}

/// A log whose first rows retention removed starts at the next segment; so does what
/// follows a gap in the numbering.
#[test]
fn a_log_cut_by_retention_starts_at_its_next_segment() {
    let ops = [
        Op::UserMessage,
        Op::Continue,
        Op::LlmText {
            end_turn: true,
            tokens: 10,
        },
        Op::Restart,
        Op::UserMessage,
        Op::Continue,
    ];
    let recorded = record_run(false, &ops, &[]);
    let messages = &recorded.messages;
    let lookup = |seq: i64| messages.get(&seq).cloned();
    // The run's restart found it idle: the Restart event was refused, but the next actor's
    // first step starts a segment all the same.
    let cut: Vec<StepRow> = recorded.rows[1..].to_vec();
    let checked = replay(&cut, &lookup, decide, |_, _, _, _, _| Visit::Continue);
    assert!(checked.divergence.is_none(), "{:?}", checked.divergence);
    // Steps 2 and 3 lost the start of their segment; 4 and 5 are a segment of their own.
    assert_eq!(checked.skipped, 2);
    assert_eq!(checked.steps, 2);
    assert_eq!(recorded.states.len(), 5);

    // A gap (rows pruned unevenly): what follows it waits for the next segment's start.
    let mut gap = recorded.rows.clone();
    gap.remove(1);
    let checked = replay(&gap, &lookup, decide, |_, _, _, _, _| Visit::Continue);
    assert!(checked.divergence.is_none(), "{:?}", checked.divergence);
    assert_eq!(checked.skipped, 1);
    assert_eq!(checked.steps, 3);
}
