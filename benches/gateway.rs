//! The LLM gateway's cost per stream chunk (issue 29): reading a chunk into the gateway's
//! tolerant type and adding it to the reply, next to reading it into async-openai's strict
//! type (what the gateway did before), for the chunks a turn streams: text deltas,
//! tool-call fragments, a finish chunk and a usage chunk. Then the cost of one LLM step's
//! request body for a 1,000-message history (issue 30): written from the wire pieces the
//! conversation's history keeps, next to converting and serialising every message again
//! (what a step cost when the history was not held).
//!
//! The same for Anthropic's Messages API (issue 25): the events of the same turn as
//! Anthropic streams them, translated and assembled into the reply, and the request body of
//! the same history in Anthropic's form.
//!
//!     cargo bench --bench gateway

#![allow(clippy::print_stdout, clippy::unwrap_used)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use async_openai::types::chat::CreateChatCompletionStreamResponse;
use bedrock::llm::Accumulator;
use bedrock::llm::anthropic::{self, Translator};
use bedrock::llm::chunk::Chunk;
use bedrock::llm::request::{RequestContext, Wire, body, wire};
use bedrock::state_machine::{MessageContent, ToolUse};

/// A turn's worth of chunks, as OpenAI streams them.
fn turn() -> Vec<String> {
    let head = r#""id":"chatcmpl-9x1","object":"chat.completion.chunk","created":1732000000,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_1""#;
    let mut chunks = Vec::new();
    chunks.push(format!(
        r#"{{{head},"choices":[{{"index":0,"delta":{{"role":"assistant","content":"","refusal":null}},"logprobs":null,"finish_reason":null}}],"usage":null}}"#
    ));
    for word in [
        "Let", " me", " look", " at", " the", " files", " first", ".",
    ] {
        chunks.push(format!(
            r#"{{{head},"choices":[{{"index":0,"delta":{{"content":"{word}"}},"logprobs":null,"finish_reason":null}}],"usage":null}}"#
        ));
    }
    chunks.push(format!(
        r#"{{{head},"choices":[{{"index":0,"delta":{{"tool_calls":[{{"index":0,"id":"call_abc123","type":"function","function":{{"name":"think","arguments":""}}}}]}},"logprobs":null,"finish_reason":null}}],"usage":null}}"#
    ));
    for fragment in [r#"{\"thou"#, r#"ghts\": \"list"#, r#" the files\"}"#] {
        chunks.push(format!(
            r#"{{{head},"choices":[{{"index":0,"delta":{{"tool_calls":[{{"index":0,"function":{{"arguments":"{fragment}"}}}}]}},"logprobs":null,"finish_reason":null}}],"usage":null}}"#
        ));
    }
    chunks.push(format!(
        r#"{{{head},"choices":[{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":"tool_calls"}}],"usage":null}}"#
    ));
    chunks.push(format!(
        r#"{{{head},"choices":[],"usage":{{"prompt_tokens":81,"completion_tokens":12,"total_tokens":93,"prompt_tokens_details":{{"cached_tokens":0}},"completion_tokens_details":{{"reasoning_tokens":0}}}}}}"#
    ));
    chunks
}

/// The same turn as Anthropic streams it: (event name, data).
fn anthropic_turn() -> Vec<(String, String)> {
    let mut events = vec![
        ("message_start".to_owned(), r#"{"type":"message_start","message":{"id":"msg_01","type":"message","role":"assistant","content":[],"model":"claude-sonnet-4-5","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":81,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":1}}}"#.to_owned()),
        ("content_block_start".to_owned(), r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#.to_owned()),
        ("ping".to_owned(), r#"{"type": "ping"}"#.to_owned()),
    ];
    for word in [
        "Let", " me", " look", " at", " the", " files", " first", ".",
    ] {
        events.push(("content_block_delta".to_owned(), format!(
            r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"text_delta","text":"{word}"}}}}"#
        )));
    }
    events.push((
        "content_block_stop".to_owned(),
        r#"{"type":"content_block_stop","index":0}"#.to_owned(),
    ));
    events.push(("content_block_start".to_owned(), r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_01","name":"think","input":{}}}"#.to_owned()));
    for fragment in [r#"{\"thou"#, r#"ghts\": \"list"#, r#" the files\"}"#] {
        events.push(("content_block_delta".to_owned(), format!(
            r#"{{"type":"content_block_delta","index":1,"delta":{{"type":"input_json_delta","partial_json":"{fragment}"}}}}"#
        )));
    }
    events.push((
        "content_block_stop".to_owned(),
        r#"{"type":"content_block_stop","index":1}"#.to_owned(),
    ));
    events.push(("message_delta".to_owned(), r#"{"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":12}}"#.to_owned()));
    events.push((
        "message_stop".to_owned(),
        r#"{"type":"message_stop"}"#.to_owned(),
    ));
    events
}

/// Runs `f` over the chunks until `duration` has passed; nanoseconds per chunk.
fn per_chunk(chunks: &[String], duration: Duration, mut f: impl FnMut(&[String])) -> f64 {
    let started = Instant::now();
    let mut rounds = 0u64;
    while started.elapsed() < duration {
        f(chunks);
        rounds += 1;
    }
    started.elapsed().as_nanos() as f64 / (rounds * chunks.len() as u64) as f64
}

/// A history of `turns` one-tool turns (four messages each: the user's, the agent's call,
/// the tool's result, the agent's answer), a few hundred bytes a message.
fn history(turns: usize) -> Vec<MessageContent> {
    let mut messages = Vec::with_capacity(turns * 4);
    for turn in 0..turns {
        let call = ToolUse::new(
            format!("call_{turn:06}"),
            "read_file",
            serde_json::json!({"path": format!("src/module_{turn}.rs")}),
        );
        messages.push(MessageContent::User {
            text: format!(
                "Turn {turn}: what does module {turn} do? Look at it and tell me in a few words."
            ),
            images: Vec::new(),
        });
        messages.push(MessageContent::Agent {
            text: Some("Let me read the file first.".into()),
            tool_uses: vec![call.clone()],
            reasoning: None,
        });
        messages.push(MessageContent::tool_result(
            &call,
            true,
            "pub fn run(input: &str) -> Result<Output, Error> {\n    let parsed = parse(input)?;\n    Ok(evaluate(parsed))\n}\n".repeat(2),
            false,
        ));
        messages.push(MessageContent::Agent {
            text: Some(format!("Module {turn} parses its input and evaluates it.")),
            tool_uses: Vec::new(),
            reasoning: None,
        });
    }
    messages
}

/// Microseconds per call of `f`, run until `duration` has passed.
fn per_call(duration: Duration, mut f: impl FnMut()) -> f64 {
    let started = Instant::now();
    let mut rounds = 0u64;
    while started.elapsed() < duration {
        f();
        rounds += 1;
    }
    started.elapsed().as_secs_f64() * 1e6 / rounds as f64
}

/// The request body's cost per step for a 1,000-message history: (µs from kept pieces,
/// µs converting every message again, body bytes).
fn history_step(duration: Duration) -> (f64, f64, usize) {
    history_step_on(duration, false)
}

/// [`history_step`] for OpenAI's form or (`anthropic`) Anthropic's.
fn history_step_on(duration: Duration, anthropic: bool) -> (f64, f64, usize) {
    let messages = history(250);
    let ctx = RequestContext {
        model: "gpt-4o",
        cwd: "/srv/work",
        system_prompt: None,
        is_sub_agent: false,
        only_submit: false,
        no_tools: false,
        mcp_tools: &[],
        client_tools: &[],
        tools: None,
        max_output_tokens: 4096,
        echo_reasoning: true,
    };
    let to_wire = if anthropic { anthropic::wire } else { wire };
    let kept: Vec<Wire> = messages.iter().map(to_wire).collect();
    let mut buffer = Vec::new();
    let send = |pieces: &[Wire], buffer: &mut Vec<u8>| {
        buffer.clear();
        if anthropic {
            let made = anthropic::body(&ctx, pieces, &[]).unwrap();
            serde_json::to_writer(&mut *buffer, &made).unwrap();
        } else {
            let made = body(&ctx, pieces, pieces.len(), &[]).unwrap();
            serde_json::to_writer(&mut *buffer, &made).unwrap();
        }
        black_box(buffer.len());
    };
    send(&kept, &mut buffer);
    let size = buffer.len();
    let from_kept = per_call(duration, || send(&kept, &mut buffer));
    let again = per_call(duration, || {
        let pieces: Vec<Wire> = messages.iter().map(to_wire).collect();
        send(&pieces, &mut buffer);
    });
    (from_kept, again, size)
}

/// A response of `events` OpenAI text deltas read in pieces of `read` bytes, parsed by the
/// event-stream parser as read (`cut` false) or one event at a time
/// (`bedrock::llm::events`): nanoseconds per event.
fn parse_reads(events: usize, read: usize, cut: bool, duration: Duration) -> f64 {
    use futures::StreamExt;
    let chunks = turn();
    let mut body = Vec::new();
    for chunk in chunks.iter().cycle().take(events) {
        body.extend_from_slice(format!("data: {chunk}\n\n").as_bytes());
    }
    let body = bytes::Bytes::from(body);
    let reads: Vec<bytes::Bytes> = (0..body.len())
        .step_by(read)
        .map(|at| body.slice(at..(at + read).min(body.len())))
        .collect();
    let run = || {
        let stream = futures::stream::iter(reads.clone().into_iter().map(Ok::<_, std::io::Error>));
        let stream = if cut {
            bedrock::llm::events::one_event_each(stream).boxed()
        } else {
            stream.boxed()
        };
        let parsed = futures::executor::block_on(
            eventsource_stream::EventStream::new(stream).fold(0usize, |n, event| async move {
                black_box(event.unwrap());
                n + 1
            }),
        );
        assert_eq!(parsed, events);
    };
    let started = Instant::now();
    let mut runs = 0u32;
    while started.elapsed() < duration || runs == 0 {
        run();
        runs += 1;
    }
    started.elapsed().as_nanos() as f64 / f64::from(runs) / events as f64
}

fn main() {
    let chunks = turn();
    let duration = Duration::from_secs(
        std::env::var("BENCH_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(3),
    );
    // Warm up both.
    per_chunk(&chunks, Duration::from_millis(300), |chunks| {
        for chunk in chunks {
            black_box(serde_json::from_str::<CreateChatCompletionStreamResponse>(chunk).ok());
            black_box(serde_json::from_str::<Chunk>(chunk).ok());
        }
    });
    let strict = per_chunk(&chunks, duration, |chunks| {
        for chunk in chunks {
            black_box(serde_json::from_str::<CreateChatCompletionStreamResponse>(chunk).unwrap());
        }
    });
    let tolerant = per_chunk(&chunks, duration, |chunks| {
        for chunk in chunks {
            black_box(serde_json::from_str::<Chunk>(chunk).unwrap());
        }
    });
    let assembled = per_chunk(&chunks, duration, |chunks| {
        let mut accumulator = Accumulator::new(1 << 20, "call_x".into());
        for chunk in chunks {
            black_box(
                accumulator
                    .push(serde_json::from_str::<Chunk>(chunk).unwrap())
                    .unwrap(),
            );
        }
        black_box(accumulator.finish(true).unwrap());
    });
    println!(
        "{} chunks a turn (8 text deltas, a tool call in 4 fragments, finish, usage)",
        chunks.len()
    );
    println!("| read into | ns per chunk |");
    println!("|---|---|");
    println!("| async-openai's CreateChatCompletionStreamResponse (before) | {strict:.0} |");
    println!("| the gateway's tolerant Chunk | {tolerant:.0} |");
    println!("| the tolerant Chunk, assembled into the reply | {assembled:.0} |");
    let events = anthropic_turn();
    let anthropic_assembled = {
        let started = Instant::now();
        let mut rounds = 0u64;
        while started.elapsed() < duration {
            let mut translator = Translator::default();
            let mut accumulator = Accumulator::new(1 << 20, "call_x".into());
            for (name, data) in &events {
                if let Some(chunk) = translator.event(name, data).unwrap() {
                    black_box(accumulator.push(chunk).unwrap());
                }
            }
            black_box(accumulator.finish(translator.done).unwrap());
            rounds += 1;
        }
        started.elapsed().as_nanos() as f64 / rounds as f64
    };
    let openai_turn = assembled * chunks.len() as f64;
    println!();
    println!("the same turn, read and assembled into the reply");
    println!("| API | events | ns per turn |");
    println!("|---|---|---|");
    println!(
        "| OpenAI chat completions | {} | {openai_turn:.0} |",
        chunks.len()
    );
    println!(
        "| Anthropic Messages | {} | {anthropic_assembled:.0} |",
        events.len()
    );
    let (a_kept, a_again, a_size) = history_step_on(duration, true);
    let (from_kept, again, size) = history_step(duration);
    println!();
    println!("one LLM step's request body, 1,000-message history ({size} bytes)");
    println!("| made from | µs per step |");
    println!("|---|---|");
    println!("| every message converted and serialised again (before) | {again:.0} |");
    println!("| the pieces the conversation's history keeps | {from_kept:.0} |");
    println!();
    println!("the same step in Anthropic's form ({a_size} bytes)");
    println!("| made from | µs per step |");
    println!("|---|---|");
    println!("| every message converted and serialised again | {a_again:.0} |");
    println!("| the pieces the conversation's history keeps | {a_kept:.0} |");
    println!();
    println!("a response of 2,000 text deltas (about 480 KB), parsed by the event-stream parser");
    println!("| read in pieces of | ns per event, as read | one event at a time |");
    println!("|---|---|---|");
    let mut reads = serde_json::Map::new();
    for read in [256usize, 4 << 10, 64 << 10, 512 << 10] {
        let as_read = parse_reads(2_000, read, false, duration / 3);
        let cut = parse_reads(2_000, read, true, duration / 3);
        println!("| {} KiB | {as_read:.0} | {cut:.0} |", read as f64 / 1024.0);
        reads.insert(format!("parse_{read}_ns"), as_read.into());
        reads.insert(format!("parse_{read}_cut_ns"), cut.into());
    }
    println!("{}", serde_json::Value::Object(reads));
    println!(
        "{}",
        serde_json::json!({"bench": "gateway", "strict_ns": strict, "tolerant_ns": tolerant, "tolerant_assembled_ns": assembled,
            "history_1000_body_bytes": size, "history_1000_step_us": from_kept, "history_1000_reconverted_step_us": again,
            "anthropic_turn_ns": anthropic_assembled, "openai_turn_ns": openai_turn,
            "anthropic_history_1000_body_bytes": a_size, "anthropic_history_1000_step_us": a_kept, "anthropic_history_1000_reconverted_step_us": a_again})
    );
}
