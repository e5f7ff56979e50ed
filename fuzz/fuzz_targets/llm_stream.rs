//! The LLM gateway's reading of a streamed answer: SSE framing (the parser async-openai
//! uses), the tolerant chunk type, assembly of text and tool arguments, and the `error:`
//! field scanner, with the body split at arbitrary points.
//!
//! Promise: no panic; the stream ends in a well-formed reply (every tool call named, with a
//! unique id) or in a classified failure.

#![no_main]

use bedrock::llm::chunk::Chunk;
use bedrock::llm::{Accumulator, ErrorLines};
use eventsource_stream::Eventsource as _;
use futures::StreamExt as _;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    // The first byte says where to cut the body (every `n`th byte, n >= 1).
    let Some((&step, body)) = input.split_first() else {
        return;
    };
    let step = usize::from(step % 64) + 1;
    let parts: Vec<bytes::Bytes> = body
        .chunks(step)
        .map(bytes::Bytes::copy_from_slice)
        .collect();

    // The error-field scanner sees the same cuts.
    let mut lines = ErrorLines::default();
    for part in &parts {
        lines.feed(part, |value| {
            let _ = serde_json::from_slice::<serde_json::Value>(value)
                .map(|v| bedrock::llm::stream_error(&v));
        });
    }

    let events = futures::executor::block_on(
        futures::stream::iter(parts.into_iter().map(Ok::<_, std::convert::Infallible>))
            .eventsource()
            .collect::<Vec<_>>(),
    );
    let mut accumulator = Accumulator::new(4096, "call".to_owned());
    let mut saw_done = false;
    for event in events {
        let Ok(event) = event else { return };
        if event.data == "[DONE]" {
            saw_done = true;
            break;
        }
        let Ok(chunk) = serde_json::from_str::<Chunk>(&event.data) else {
            return; // the gateway's "not a chat completion chunk": a classified failure
        };
        if accumulator.push(chunk).is_err() {
            return;
        }
    }
    if let Ok(reply) = accumulator.finish(saw_done) {
        let mut ids = std::collections::HashSet::new();
        for tool in &reply.tool_uses {
            assert!(
                !tool.name.is_empty(),
                "a tool call without a name: {reply:?}"
            );
            assert!(!tool.id.is_empty(), "a tool call without an id: {reply:?}");
            assert!(
                ids.insert(tool.id.clone()),
                "two tool calls share an id: {reply:?}"
            );
        }
    }
});
