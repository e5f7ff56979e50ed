//! The LLM gateway's cost per stream chunk (issue 29): reading a chunk into the gateway's
//! tolerant type and adding it to the reply, next to reading it into async-openai's strict
//! type (what the gateway did before), for the chunks a turn streams: text deltas,
//! tool-call fragments, a finish chunk and a usage chunk.
//!
//!     cargo bench --bench gateway

#![allow(clippy::print_stdout, clippy::unwrap_used)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use async_openai::types::chat::CreateChatCompletionStreamResponse;
use bedrock::llm::Accumulator;
use bedrock::llm::chunk::Chunk;

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
    println!(
        "{}",
        serde_json::json!({"bench": "gateway", "strict_ns": strict, "tolerant_ns": tolerant, "tolerant_assembled_ns": assembled})
    );
}
