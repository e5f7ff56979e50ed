//! The WebSocket's client frames, as the server reads them: JSON into `ClientFrame`, and a
//! `respond` frame's payload checked against every kind of request.
//!
//! Promise: no panic; a frame either parses or is refused, and a reply is accepted only
//! for a kind it fits.

#![no_main]

use bedrock::wire::{ClientFrame, RequestType, SelectOption};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let Ok(frame) = serde_json::from_slice::<ClientFrame>(input) else {
        return;
    };
    match frame {
        ClientFrame::Respond { payload, .. } => {
            let mut accepted = 0;
            for kind in kinds() {
                let kind = serde_json::to_value(kind).expect("a request type serialises");
                accepted += usize::from(bedrock::runtime::check_reply(&kind, &payload).is_ok());
            }
            // `cancelled` fits every kind; anything else fits at most one.
            let cancels = payload.get("cancelled").is_some();
            assert!(cancels || accepted <= 1, "{payload} fits {accepted} kinds");
            // A stored request type that is itself garbage is refused, never a panic.
            let _ = bedrock::runtime::check_reply(&payload, &payload);
        }
        ClientFrame::SystemEvent { event } => {
            let _ = bedrock::api::check_client_event(&event);
        }
        // A client tool's result: any string output parses; the runtime cuts it to the cap.
        ClientFrame::ClientToolResult {
            call_id, output, ..
        } => {
            let _ = (call_id.len(), output.len());
        }
        ClientFrame::UserMessage { .. } | ClientFrame::Cancel | ClientFrame::Ping => {}
    }
});

fn kinds() -> [RequestType; 4] {
    [
        RequestType::Confirm {
            message: "ok?".into(),
            default: None,
        },
        RequestType::Prompt {
            message: "name?".into(),
            default: None,
            placeholder: None,
        },
        RequestType::Select {
            message: "which?".into(),
            options: vec![SelectOption {
                value: "a".into(),
                label: "A".into(),
                description: None,
            }],
            multi_select: true,
        },
        RequestType::Custom {
            type_name: "form".into(),
            schema: serde_json::json!({"type": "object"}),
        },
    ]
}
