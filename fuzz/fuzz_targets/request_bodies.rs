//! The REST request bodies, as the server reads them (each refuses unknown fields), and a
//! posted system event's check.
//!
//! Promise: no panic; a body parses or is refused.

#![no_main]

use bedrock::wire::{CreateConversation, ForkConversation, PostEvent, Respond, SendMessage};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let _ = serde_json::from_slice::<SendMessage>(input);
    let _ = serde_json::from_slice::<CreateConversation>(input);
    let _ = serde_json::from_slice::<ForkConversation>(input);
    let _ = serde_json::from_slice::<Respond>(input);
    if let Ok(body) = serde_json::from_slice::<PostEvent>(input) {
        let _ = bedrock::api::check_client_event(&body.event);
    }
});
