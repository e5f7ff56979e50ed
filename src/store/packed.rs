//! Rows' JSON packed (issue 40, migration 21): a commit's frames and its steps of the replay
//! log are stored as zstd compressed with a dictionary shared by every row, not as JSON
//! text. A row's JSON is 30 – 300 B, too small for a compressor to find much in it alone
//! (Postgres's TOAST compresses nothing under 2 KB), but most of it is the same field
//! names, state kinds and event kinds from row to row: against the dictionary a row of
//! frames keeps about a quarter of its bytes and a row of steps about a third.
//!
//! A packed value is its format's byte, then the format's data:
//! - `0`: the JSON text as it is (a value the dictionary does not make smaller);
//! - `1`: a zstd frame compressed with dictionary 1 (`packed-1.dict`), without the frame's
//!   4-byte magic number, checksum or dictionary id (the format's byte says which).
//!
//! A dictionary never changes once rows were packed with it: a better one is format `2`,
//! and dictionary 1 stays to read the rows of format 1. Dictionary 1 was trained by `zstd
//! --train --maxdict=16384` (zstd 1.5.4) on 20,000 rows of frames and steps of an e2e
//! bench database (Postgres, 50 clients, one-tool turns) and 1,579 rows of steps of the
//! replay property's random runs (every event kind); docs/benchmarks.md has the figures.
//!
//! Rows stored before migration 21 keep their JSON in the text columns; the readers take
//! the packed column where a row has it and the text where it does not.

use std::cell::RefCell;
use std::sync::LazyLock;

use zstd::bulk::{Compressor, Decompressor};
use zstd::dict::{DecoderDictionary, EncoderDictionary};
use zstd::zstd_safe::CParameter;

/// The dictionary of format 1. Never edited: rows were packed with it.
static DICTIONARY_1: &[u8] = include_bytes!("packed-1.dict");

/// zstd's level: past 3 the rows grow no smaller (measured on the training rows).
const LEVEL: i32 = 3;

/// The magic number a zstd frame starts with, which a packed value leaves out.
const MAGIC: [u8; 4] = 0xFD2F_B528_u32.to_le_bytes();

/// The JSON as it is.
const RAW: u8 = 0;
/// zstd with dictionary 1.
const ZSTD_1: u8 = 1;

/// The largest JSON that is compressed, and so the most a packed value may unpack to:
/// a frame's size is in its header, read before anything is allocated, so a damaged row
/// cannot ask for more. (Larger JSON, if any, is kept as it is.)
const MAX_UNPACKED: usize = 256 << 20;

static ENCODER_1: LazyLock<std::io::Result<EncoderDictionary<'static>>> =
    LazyLock::new(|| EncoderDictionary::try_copy(DICTIONARY_1, LEVEL));
static DECODER_1: LazyLock<std::io::Result<DecoderDictionary<'static>>> =
    LazyLock::new(|| DecoderDictionary::try_copy(DICTIONARY_1));

thread_local! {
    /// A compression context per thread, with dictionary 1 attached (made once).
    static COMPRESSOR: RefCell<Option<Compressor<'static>>> = const { RefCell::new(None) };
    static DECOMPRESSOR: RefCell<Option<Decompressor<'static>>> = const { RefCell::new(None) };
}

fn compressor() -> std::io::Result<Compressor<'static>> {
    let dictionary = ENCODER_1
        .as_ref()
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let mut compressor = Compressor::with_prepared_dictionary(dictionary)?;
    compressor.set_parameter(CParameter::ChecksumFlag(false))?;
    compressor.set_parameter(CParameter::DictIdFlag(false))?;
    compressor.set_parameter(CParameter::ContentSizeFlag(true))?;
    Ok(compressor)
}

/// `json` packed: format 1, or format 0 where compressing does not make it smaller.
pub(super) fn pack(json: &str) -> Vec<u8> {
    let compressed = (json.len() <= MAX_UNPACKED)
        .then(|| {
            COMPRESSOR.with(|slot| {
                let mut slot = slot.borrow_mut();
                if slot.is_none() {
                    *slot = compressor().ok();
                }
                slot.as_mut()?.compress(json.as_bytes()).ok()
            })
        })
        .flatten();
    match compressed {
        Some(frame) if frame.starts_with(&MAGIC) && frame.len() - MAGIC.len() < json.len() => {
            let mut packed = Vec::with_capacity(frame.len() - MAGIC.len() + 1);
            packed.push(ZSTD_1);
            packed.extend_from_slice(&frame[MAGIC.len()..]);
            packed
        }
        _ => {
            let mut packed = Vec::with_capacity(json.len() + 1);
            packed.push(RAW);
            packed.extend_from_slice(json.as_bytes());
            packed
        }
    }
}

/// The JSON text a packed value holds.
pub(super) fn unpack(packed: &[u8]) -> Result<String, String> {
    let (&format, data) = packed
        .split_first()
        .ok_or_else(|| "a packed value is empty".to_owned())?;
    let bytes = match format {
        RAW => data.to_vec(),
        ZSTD_1 => {
            let mut frame = Vec::with_capacity(data.len() + MAGIC.len());
            frame.extend_from_slice(&MAGIC);
            frame.extend_from_slice(data);
            // Every frame written records its size: one that does not, or records more
            // than was ever packed, is damaged, and nothing is allocated for it.
            let size = match zstd::zstd_safe::get_frame_content_size(&frame) {
                Ok(Some(size)) if size <= MAX_UNPACKED as u64 => size as usize,
                _ => return Err("a packed value's size does not read".to_owned()),
            };
            DECOMPRESSOR.with(|slot| {
                let mut slot = slot.borrow_mut();
                if slot.is_none() {
                    let dictionary = DECODER_1.as_ref().map_err(|e| format!("zstd: {e}"))?;
                    *slot = Some(
                        Decompressor::with_prepared_dictionary(dictionary)
                            .map_err(|e| format!("zstd: {e}"))?,
                    );
                }
                let decompressor = slot.as_mut().ok_or("zstd: no context")?;
                decompressor
                    .decompress(&frame, size)
                    .map_err(|e| format!("a packed value does not unpack: {e}"))
            })?
        }
        other => return Err(format!("a packed value has an unknown format ({other})")),
    };
    String::from_utf8(bytes).map_err(|_| "a packed value is not UTF-8".to_owned())
}

/// Where a row has a packed value, its JSON; else the JSON text it was stored with.
pub(super) fn json_of(packed: Option<&[u8]>, text: Option<String>) -> Result<String, String> {
    match (packed, text) {
        (Some(packed), _) => unpack(packed),
        (None, Some(text)) => Ok(text),
        (None, None) => Err("a row holds neither packed nor text JSON".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any text packs and unpacks to itself, never grows by more than the format's
        /// byte, and rows shaped like the stored ones (their keys and kinds around random
        /// ids and numbers) come out smaller.
        #[test]
        fn any_text_unpacks_to_itself(text in ".{0,600}", ids in proptest::collection::vec("[0-9a-f]{16}", 1..6), n in 0u32..1_000_000) {
            let packed = pack(&text);
            prop_assert_eq!(unpack(&packed), Ok(text.clone()));
            prop_assert!(packed.len() <= text.len() + 1);
            let steps: Vec<String> = ids
                .iter()
                .map(|d| format!(r#"{{"e":{{"tool_complete":{{"msg":{n},"outcome":{{}}}}}},"d":"{d}"}}"#))
                .collect();
            let row = format!("[{}]", steps.join(","));
            let packed = pack(&row);
            prop_assert_eq!(unpack(&packed), Ok(row.clone()));
            prop_assert!(packed.len() * 3 < row.len() * 2, "{} of {}", packed.len(), row.len());
        }
    }

    #[test]
    fn rows_read_back_as_they_were_written_and_smaller() {
        let frames = r#"[{"m":2},{"s":{"kind":"tool_executing","current_tool_id":"call_01a22102d5e2778a9af133311f716982","current_tool_name":"think","remaining_tool_ids":[],"completed":0}}]"#;
        let steps = r#"[{"e":{"llm_response":{"msg":2,"reply":{"end_turn":true},"request":{"attempt":1,"step":1}}},"d":"7964a2d9d0ecdcea"}]"#;
        for json in [frames, steps, "[]", r#"[{"m":4},{"s":{"kind":"idle"}}]"#] {
            let packed = pack(json);
            assert_eq!(unpack(&packed).as_deref(), Ok(json));
            assert!(packed.len() <= json.len() + 1, "{json}: {}", packed.len());
        }
        assert_eq!(pack(frames)[0], ZSTD_1);
        assert!(
            pack(frames).len() < frames.len() / 2,
            "{}",
            pack(frames).len()
        );
        assert!(pack(steps).len() < steps.len() / 2, "{}", pack(steps).len());
    }

    #[test]
    fn what_the_dictionary_does_not_know_is_kept_whole() {
        // Text unlike any row still reads back; where it does not shrink it is kept as it is.
        let odd = "x";
        assert_eq!(pack(odd), vec![RAW, b'x']);
        let big: String = (0..100_000)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        let packed = pack(&big);
        assert_eq!(packed[0], ZSTD_1);
        assert_eq!(unpack(&packed), Ok(big));
    }

    #[test]
    fn a_damaged_value_is_an_error_not_a_panic() {
        assert!(unpack(&[]).is_err());
        assert!(
            unpack(&[9, 1, 2])
                .expect_err("format 9")
                .contains("unknown format")
        );
        assert!(unpack(&[ZSTD_1, 0xff, 0xff, 0xff]).is_err());
        let mut packed =
            pack(r#"[{"s":{"kind":"awaiting_llm"}},{"s":{"kind":"llm_requesting","attempt":1}}]"#);
        packed.truncate(packed.len() - 2);
        assert!(unpack(&packed).is_err());
        assert!(
            unpack(&[RAW, 0xff])
                .expect_err("not UTF-8")
                .contains("UTF-8")
        );
        assert_eq!(json_of(None, Some("[]".into())).as_deref(), Ok("[]"));
        assert!(json_of(None, None).is_err());
    }
}
