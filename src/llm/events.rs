//! A streamed response cut into pieces of one event each before its event-stream parser sees
//! it.
//!
//! The parser (`eventsource-stream`, the one async-openai runs on the OpenAI path and the
//! Anthropic path runs itself) keeps what it has not parsed in a string and, after each line
//! it parses, copies the rest of that string into a new one. A piece of many events, which
//! is what a read returns whenever the response arrives faster than it is read (a fast
//! backend, a busy node, a proxy that buffers), costs it the square of the piece's size: a
//! 256 KiB read of short events copied gigabytes. Cut after each event's blank line (no
//! byte is copied: the pieces share the read's buffer), the parser's string never holds
//! more than one event, and each line copies only what is left of it.
//!
//! Nothing else changes: the parser gets the same bytes in the same order, and a piece that
//! ends inside an event is passed on as it is (the parser keeps it until the rest comes).
//! Lines may end with LF or CRLF; a stream whose lines end with a lone CR is passed on in
//! the pieces it came in.

use bytes::Bytes;
use futures::{Stream, StreamExt};

/// Where the line being read stands, across the pieces of a response.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Line {
    /// Nothing of the current line has come yet.
    #[default]
    Empty,
    /// Only a carriage return has come.
    Cr,
    /// The current line has content: it is not the blank line that ends an event.
    Content,
}

/// Cuts `bytes` after the first blank line in it, given where the line being read stood
/// before it: the piece up to and including that line's LF, or `None` when `bytes` holds no
/// blank line. `line` is left as it stands after what was looked at.
fn first_event(bytes: &[u8], line: &mut Line) -> Option<usize> {
    let mut start = 0;
    for end in memchr::memchr_iter(b'\n', bytes) {
        let before = match &bytes[start..end] {
            [] => *line,
            [b'\r'] if *line == Line::Empty => Line::Cr,
            _ => Line::Content,
        };
        *line = Line::Empty;
        start = end + 1;
        if before != Line::Content {
            return Some(start);
        }
    }
    *line = match &bytes[start..] {
        [] => *line,
        [b'\r'] if *line == Line::Empty => Line::Cr,
        _ => Line::Content,
    };
    None
}

/// `body` in pieces that each hold at most one complete event (see the module's doc).
pub fn one_event_each<E>(
    body: impl Stream<Item = Result<Bytes, E>> + Send + 'static,
) -> impl Stream<Item = Result<Bytes, E>> + Send + 'static
where
    E: Send + 'static,
{
    futures::stream::unfold(
        (Box::pin(body), Bytes::new(), Line::Empty),
        |(mut body, mut rest, mut line)| async move {
            while rest.is_empty() {
                match body.next().await? {
                    Ok(bytes) => rest = bytes,
                    Err(error) => return Some((Err(error), (body, rest, line))),
                }
            }
            let piece = match first_event(&rest, &mut line) {
                Some(end) if end < rest.len() => rest.split_to(end),
                _ => std::mem::take(&mut rest),
            };
            Some((Ok(piece), (body, rest, line)))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pieces(chunks: &[&[u8]]) -> Vec<Vec<u8>> {
        let chunks: Vec<Result<Bytes, ()>> = chunks
            .iter()
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        futures::executor::block_on(
            one_event_each(futures::stream::iter(chunks))
                .map(|piece| piece.expect("no error").to_vec())
                .collect(),
        )
    }

    #[test]
    fn a_read_of_several_events_is_cut_after_each() {
        assert_eq!(
            pieces(&[b"data: a\n\ndata: b\nid: 2\n\ndata: c\n\ndata: d"]),
            [
                b"data: a\n\n".to_vec(),
                b"data: b\nid: 2\n\n".to_vec(),
                b"data: c\n\n".to_vec(),
                b"data: d".to_vec(),
            ]
        );
        // CRLF, and blank lines that straddle reads.
        assert_eq!(
            pieces(&[
                b"data: a\r\n\r\ndata: b\r\n\r",
                b"\ndata: c\n",
                b"\ndata: d\n\n"
            ]),
            [
                b"data: a\r\n\r\n".to_vec(),
                b"data: b\r\n\r".to_vec(),
                b"\n".to_vec(),
                b"data: c\n".to_vec(),
                b"\n".to_vec(),
                b"data: d\n\n".to_vec(),
            ]
        );
        // A lone CR is content of its line when more follows it on the line.
        assert_eq!(
            pieces(&[b"data: a\n\rx\ndata: b\n\n"]),
            [b"data: a\n\rx\ndata: b\n\n".to_vec()]
        );
    }

    /// The events of a stream of events, parsed as read.
    fn events(chunks: Vec<Vec<u8>>, cut: bool) -> Vec<(String, String, String)> {
        let body = futures::stream::iter(
            chunks
                .into_iter()
                .map(|c| Ok::<_, std::io::Error>(Bytes::from(c))),
        );
        let parse = |body| {
            eventsource_stream::EventStream::new(body)
                .map(|event| {
                    let event = event.expect("parses");
                    (event.event, event.data, event.id)
                })
                .collect::<Vec<_>>()
        };
        futures::executor::block_on(if cut {
            parse(one_event_each(body).boxed())
        } else {
            parse(body.boxed())
        })
    }

    proptest! {
        /// Whatever the events and however the reads fall, the parser makes the same events
        /// of the pieces as of the reads, and no piece holds more than one event.
        #[test]
        fn the_parser_sees_the_same_events(
            lines in prop::collection::vec(
                prop_oneof![
                    "data: [a-z \r]{0,12}".prop_map(|s| s),
                    "event: [a-z]{1,6}".prop_map(|s| s),
                    "id: [0-9]{1,3}".prop_map(|s| s),
                    ": [a-z]{0,5}".prop_map(|s| s),
                    Just(String::new()),
                ],
                0..40,
            ),
            crlf in any::<bool>(),
            cuts in prop::collection::vec(0usize..400, 0..12),
        ) {
            let end = if crlf { "\r\n" } else { "\n" };
            let text: String = lines.iter().map(|l| format!("{l}{end}")).collect();
            let bytes = text.into_bytes();
            let mut at: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
            at.sort_unstable();
            let mut chunks = Vec::new();
            let mut from = 0;
            for to in at.into_iter().chain([bytes.len()]) {
                chunks.push(bytes[from..to].to_vec());
                from = to;
            }
            let borrowed: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
            for piece in pieces(&borrowed) {
                let blank = piece
                    .windows(end.len() * 2)
                    .filter(|w| *w == format!("{end}{end}").as_bytes())
                    .count();
                prop_assert!(blank <= 1, "{:?}", String::from_utf8_lossy(&piece));
            }
            prop_assert_eq!(events(chunks.clone(), true), events(chunks, false));
        }
    }
}
