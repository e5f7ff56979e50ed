//! The gateway's HTTP layer under async-openai: it sees the status and Retry-After of every
//! response and enforces the byte and time limits on the raw body, so a limit is hit
//! mechanically and reported as what it is. async-openai's own retry layer is not used: the
//! state machine owns retries.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_openai::error::OpenAIError;
use async_openai::middleware::HttpRequestFactory;
use bytes::Bytes;
use futures::{Stream, StreamExt};

use super::Failure;
use crate::state_machine::ErrorKind;

/// Limits of one request.
#[derive(Clone, Copy, Debug)]
pub struct HttpLimits {
    pub first_byte: Duration,
    pub idle: Duration,
    pub max_response_bytes: usize,
}

/// What the HTTP layer learnt about one request.
#[derive(Debug, Default)]
pub struct Probe {
    /// The first failure the layer itself detected (a limit, a status).
    failure: Mutex<Option<Failure>>,
    /// Whether `data: [DONE]` was seen.
    done: AtomicBool,
    bytes: AtomicUsize,
}

impl Probe {
    fn fail(&self, failure: Failure) {
        let mut slot = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        slot.get_or_insert(failure);
    }

    pub fn failure(&self) -> Option<Failure> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn saw_done(&self) -> bool {
        self.done.load(Ordering::Relaxed)
    }
}

/// A non-success status, as the layer saw it.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct LayerError(String);

/// Executes `factory`'s request with the limits, recording what it learns in `probe`.
pub async fn execute(
    client: reqwest::Client,
    factory: HttpRequestFactory,
    limits: HttpLimits,
    probe: Arc<Probe>,
) -> Result<reqwest::Response, OpenAIError> {
    let request = factory.build().await?;
    let response = match tokio::time::timeout(limits.first_byte, client.execute(request)).await {
        Err(_) => {
            let failure = Failure::new(
                ErrorKind::Network,
                format!(
                    "no response within {} ms (time to first byte)",
                    limits.first_byte.as_millis()
                ),
            );
            probe.fail(failure.clone());
            return Err(OpenAIError::Boxed(Box::new(LayerError(failure.message))));
        }
        Ok(Err(error)) => return Err(OpenAIError::Reqwest(error)),
        Ok(Ok(response)) => response,
    };
    let status = response.status();
    if !status.is_success() {
        let (body, retry_after) = refused(response, limits.idle).await;
        let failure = status_failure(status.as_u16(), &body, retry_after);
        probe.fail(failure.clone());
        return Err(OpenAIError::Boxed(Box::new(LayerError(failure.message))));
    }
    // The request's URL, kept (a response built without one has reqwest parse a URL of its
    // own for it: issue 41).
    let mut builder = reqwest::ResponseBuilderExt::url(
        http::Response::builder().status(status),
        response.url().clone(),
    );
    if let Some(headers) = builder.headers_mut() {
        *headers = response.headers().clone();
    }
    // A server that ignored `stream: true` answers with one JSON completion: it is read as
    // a stream of that one event.
    let whole = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("application/json"));
    let body = limited(response.bytes_stream(), limits, probe.clone());
    let body = if whole {
        reqwest::Body::wrap_stream(one_event(body, probe))
    } else {
        // async-openai's event-stream parser copies what it has not parsed at every line:
        // it gets one event at a time (events.rs).
        reqwest::Body::wrap_stream(super::events::one_event_each(body))
    };
    builder
        .body(body)
        .map(reqwest::Response::from)
        .map_err(|e| OpenAIError::Boxed(Box::new(e)))
}

/// A whole JSON body as one `data:` event and `[DONE]`.
fn one_event(
    body: impl Stream<Item = std::io::Result<Bytes>> + Send + 'static,
    probe: Arc<Probe>,
) -> impl Stream<Item = std::io::Result<Bytes>> + Send + 'static {
    futures::stream::once(async move {
        let mut whole = Vec::new();
        let mut body = std::pin::pin!(body);
        while let Some(bytes) = body.next().await {
            whole.extend_from_slice(&bytes?);
        }
        // Compact, so the event is one line whatever the server's formatting.
        let value: serde_json::Value = serde_json::from_slice(&whole).map_err(|e| {
            let message = format!(
                "the backend answered with JSON that cannot be read ({e}): {}",
                crate::tools::preview(String::from_utf8_lossy(&whole).trim(), 200)
            );
            probe.fail(Failure::new(ErrorKind::Unknown, message.clone()));
            std::io::Error::other(message)
        })?;
        probe.done.store(true, Ordering::Relaxed);
        Ok(Bytes::from(format!("data: {value}\n\ndata: [DONE]\n\n")))
    })
}

/// Finds `error:` fields in an event stream (llama.cpp's server reports failures there, not
/// in a `data:` line, and event-stream parsers drop fields they do not know), across chunk
/// boundaries, keeping only lines that may be one.
#[derive(Debug, Default)]
pub struct ErrorLines {
    line: Vec<u8>,
    /// The current line is not an `error:` field: skip to its end.
    skipping: bool,
}

impl ErrorLines {
    /// The longest `error:` line kept.
    const MAX: usize = 64 * 1024;

    /// Feeds bytes of the stream; each complete `error:` field's value goes to `found`.
    pub fn feed(&mut self, mut bytes: &[u8], mut found: impl FnMut(&[u8])) {
        while !bytes.is_empty() {
            let end = memchr::memchr(b'\n', bytes);
            let part = &bytes[..end.unwrap_or(bytes.len())];
            if !self.skipping {
                self.line.extend_from_slice(part);
                let prefix = self.line.len().min(6);
                if self.line[..prefix] != b"error:"[..prefix] || self.line.len() > Self::MAX {
                    self.skipping = true;
                    self.line.clear();
                }
            }
            match end {
                Some(at) => {
                    if !self.skipping && self.line.len() >= 6 {
                        let value = &self.line[6..];
                        found(value.strip_suffix(b"\r").unwrap_or(value));
                    }
                    self.line.clear();
                    self.skipping = false;
                    bytes = &bytes[at + 1..];
                }
                None => break,
            }
        }
    }
}

/// The end marker of an OpenAI stream.
const DONE: &[u8] = b"[DONE]";

/// The body with the idle and size limits applied, watching for `[DONE]` (and for the
/// `error:` lines some OpenAI-compatible servers send; Anthropic's stream has neither).
pub(super) fn limited(
    inner: impl Stream<Item = reqwest::Result<Bytes>> + Send + 'static,
    limits: HttpLimits,
    probe: Arc<Probe>,
) -> impl Stream<Item = std::io::Result<Bytes>> + Send + 'static {
    let state = (
        Box::pin(inner),
        probe,
        Vec::<u8>::new(),
        false,
        ErrorLines::default(),
    );
    futures::stream::unfold(
        state,
        move |(mut inner, probe, mut tail, stopped, mut errors)| async move {
            if stopped {
                return None;
            }
            let item = match tokio::time::timeout(limits.idle, inner.next()).await {
                Err(_) => {
                    let message = format!(
                        "no data for {} ms (idle limit between chunks)",
                        limits.idle.as_millis()
                    );
                    probe.fail(Failure::new(ErrorKind::Network, message.clone()));
                    Err(std::io::Error::other(message))
                }
                Ok(None) => return None,
                Ok(Some(Err(error))) => Err(std::io::Error::other(error)),
                Ok(Some(Ok(bytes))) => {
                    let total = probe.bytes.fetch_add(bytes.len(), Ordering::Relaxed) + bytes.len();
                    if total > limits.max_response_bytes {
                        let message = format!(
                            "the response exceeds the limit of {} bytes",
                            limits.max_response_bytes
                        );
                        probe.fail(Failure::new(ErrorKind::Limit, message.clone()));
                        Err(std::io::Error::other(message))
                    } else {
                        errors.feed(&bytes, |value| {
                            let text = String::from_utf8_lossy(value);
                            let error = serde_json::from_str(text.trim()).unwrap_or_else(|_| {
                                serde_json::Value::String(text.trim().to_owned())
                            });
                            probe.fail(super::stream::stream_error(&error));
                        });
                        // Look for the end marker in the chunk, and across its start: in
                        // the last bytes before it (`tail`, fewer than the marker's) with its
                        // first ones. The chunk is not copied.
                        let short = DONE.len() - 1;
                        tail.extend_from_slice(&bytes[..bytes.len().min(short)]);
                        if memchr::memmem::find(&tail, DONE).is_some()
                            || memchr::memmem::find(&bytes, DONE).is_some()
                        {
                            probe.done.store(true, Ordering::Relaxed);
                        }
                        if bytes.len() >= short {
                            tail.clear();
                            tail.extend_from_slice(&bytes[bytes.len() - short..]);
                        } else {
                            // A chunk shorter than that is all in `tail` now.
                            let excess = tail.len().saturating_sub(short);
                            tail.drain(..excess);
                        }
                        Ok(bytes)
                    }
                }
            };
            let stop = item.is_err();
            Some((item, (inner, probe, tail, stop, errors)))
        },
    )
}

/// What a non-success response says: its body (read within `idle`) and its Retry-After in
/// milliseconds.
pub(super) async fn refused(response: reqwest::Response, idle: Duration) -> (Bytes, Option<u64>) {
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|seconds| seconds.saturating_mul(1000));
    let body = tokio::time::timeout(idle, response.bytes())
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    (body, retry_after)
}

/// Whether a server error's message says the request itself is malformed, in the words of the
/// servers known to answer so with a 500: llama-server (its template and parsing errors) and
/// Ollama (its JSON decoding errors).
fn malformed_request(detail: &str) -> bool {
    const SAID: [&str; 5] = [
        "Failed to parse",
        "Cannot have 2 or more assistant messages",
        "Conversation roles must alternate",
        "json: cannot unmarshal",
        "invalid character",
    ];
    SAID.iter().any(|said| detail.contains(said))
}

/// The failure a non-success status means (OpenAI's error body or plain text).
pub fn status_failure(status: u16, body: &[u8], retry_after_ms: Option<u64>) -> Failure {
    let detail = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .and_then(|m| m.as_str())
                .map(str::to_owned)
        })
        .unwrap_or_else(|| {
            crate::tools::preview(String::from_utf8_lossy(body).trim(), 300).to_owned()
        });
    let kind = match status {
        401 | 403 => ErrorKind::Auth,
        429 => ErrorKind::RateLimit,
        400 | 404 | 413 | 422 => ErrorKind::InvalidRequest,
        // A server error that says the request itself is malformed is not worth another try.
        500 if malformed_request(&detail) => ErrorKind::InvalidRequest,
        408 | 500..=599 => ErrorKind::Network,
        _ => ErrorKind::Unknown,
    };
    let mut failure = Failure::new(kind, format!("HTTP {status}: {detail}"));
    failure.retry_after_ms = retry_after_ms;
    failure
}

/// The failure an async-openai error means, preferring what the layer itself saw.
// OpenAIError grows with the crate; anything new is an unknown failure.
#[allow(clippy::wildcard_enum_match_arm)]
pub fn classify(error: &OpenAIError, probe: &Probe) -> Failure {
    if let Some(failure) = probe.failure() {
        return failure;
    }
    match error {
        OpenAIError::ApiError(api) => {
            let body = serde_json::json!({"error": {"message": api.api_error.message}}).to_string();
            status_failure(api.status_code.as_u16(), body.as_bytes(), None)
        }
        OpenAIError::Reqwest(e) => Failure::new(
            ErrorKind::Network,
            format!("connection to the LLM backend failed: {e}"),
        ),
        OpenAIError::StreamError(e) => {
            Failure::new(ErrorKind::Network, format!("the stream broke: {e}"))
        }
        OpenAIError::JSONDeserialize(e, content) => Failure::new(
            ErrorKind::Unknown,
            format!(
                "the backend sent something that is not a chat completion chunk ({e}): {}",
                crate::tools::preview(content, 200)
            ),
        ),
        OpenAIError::InvalidArgument(e) => Failure::new(ErrorKind::InvalidRequest, e.clone()),
        other => Failure::new(ErrorKind::Unknown, other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    /// A 500 whose message says the request is malformed (llama-server, Ollama) is not
    /// retried; another 500 is (issue 42).
    #[test]
    fn a_malformed_request_is_not_retried() {
        let llama = br#"{"error":{"code":500,"message":"Failed to parse tool call arguments as JSON: [json.exception.parse_error.101]","type":"server_error"}}"#;
        let failure = status_failure(500, llama, None);
        assert_eq!(failure.kind, ErrorKind::InvalidRequest);
        assert!(
            failure
                .message
                .contains("Failed to parse tool call arguments"),
            "{}",
            failure.message
        );
        let ollama = br#"{"error":"json: cannot unmarshal string into Go struct field"}"#;
        assert_eq!(
            status_failure(500, ollama, None).kind,
            ErrorKind::InvalidRequest
        );
        assert_eq!(
            status_failure(500, br#"{"error":{"message":"out of memory"}}"#, None).kind,
            ErrorKind::Network
        );
        assert_eq!(status_failure(503, b"busy", None).kind, ErrorKind::Network);
    }

    use super::*;

    /// `error:` fields are found whole, however the stream is cut; other lines are not kept.
    #[test]
    fn error_fields_are_found_across_chunks() {
        let stream = b"data: {\"choices\":[]}\n\nerror: {\"code\":400,\"message\":\"too long\"}\r\n\ndata: [DONE]\n\n";
        for cut in 1..stream.len() {
            let mut lines = ErrorLines::default();
            let mut found = Vec::new();
            for part in [&stream[..cut], &stream[cut..]] {
                lines.feed(part, |value| {
                    found.push(String::from_utf8_lossy(value).into_owned())
                });
            }
            assert_eq!(
                found,
                [" {\"code\":400,\"message\":\"too long\"}"],
                "cut at {cut}"
            );
        }
        let mut lines = ErrorLines::default();
        let mut found = 0;
        lines.feed(b"data: error: not a field\nerr", |_| found += 1);
        lines.feed(b"or-ish: no\n: error: comment\n", |_| found += 1);
        assert_eq!(found, 0);
        assert!(lines.line.is_empty());
    }

    /// Whether the body's limited stream saw `[DONE]`, read in `chunks`.
    fn saw_done(chunks: &[&[u8]]) -> bool {
        let probe = Arc::new(Probe::default());
        let limits = HttpLimits {
            first_byte: Duration::from_secs(5),
            idle: Duration::from_secs(5),
            max_response_bytes: 1 << 20,
        };
        let body = futures::stream::iter(
            chunks
                .iter()
                .map(|c| Ok::<_, reqwest::Error>(Bytes::copy_from_slice(c)))
                .collect::<Vec<_>>(),
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime");
        runtime.block_on(limited(body, limits, probe.clone()).for_each(|_| async {}));
        probe.saw_done()
    }

    /// The end marker is seen wherever the reads cut it, even into pieces of one byte, and
    /// not where it is not whole.
    #[test]
    fn the_end_marker_is_seen_however_the_reads_fall() {
        let stream: &[u8] = b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n";
        for cut in 1..stream.len() {
            assert!(saw_done(&[&stream[..cut], &stream[cut..]]), "cut at {cut}");
            for second in cut + 1..stream.len() {
                assert!(
                    saw_done(&[&stream[..cut], &stream[cut..second], &stream[second..]]),
                    "cut at {cut} and {second}"
                );
            }
        }
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert!(saw_done(&bytes), "a byte at a time");
        assert!(!saw_done(&[b"data: [DON", b"", b"x]\n\n"]));
        assert!(!saw_done(&[b"data: [DO", b"NE", b"\n\n"]));
    }
}
