//! A user message's image: base64 (or a data URL) decoded, checked and resized.
//!
//! Promise: no panic; an image is refused, or comes out at most `max_px` on its longer side,
//! in one of the accepted formats, and decodes again.

#![no_main]

use base64::Engine as _;
use libfuzzer_sys::fuzz_target;

const TYPES: [&str; 5] = [
    "image/png",
    "image/jpeg",
    "image/gif",
    "image/webp",
    "image/bmp",
];

fuzz_target!(|input: &[u8]| {
    let Some((&pick, bytes)) = input.split_first() else {
        return;
    };
    let media_type = TYPES[usize::from(pick) % TYPES.len()];
    let max_px = 16 + u32::from(pick % 8) * 64;
    // Raw bytes as base64 most of the time; the input as text (a data URL, bad base64) else.
    let data = if pick & 0x80 == 0 {
        base64::engine::general_purpose::STANDARD.encode(bytes)
    } else {
        String::from_utf8_lossy(bytes).into_owned()
    };
    if let Ok(prepared) = bedrock::api::prepare_image(0, media_type, &data, max_px) {
        assert!(
            prepared.width <= max_px && prepared.height <= max_px,
            "{}x{} over {max_px}",
            prepared.width,
            prepared.height
        );
        assert!(!prepared.data.is_empty());
        assert!(
            TYPES[..4].contains(&prepared.media_type.as_str()),
            "{}",
            prepared.media_type
        );
    }
});
