//! Calls to tenants' own MCP tool servers (docs/api.md, "MCP"): their tools are listed when a
//! conversation is created, and called when its LLM asks for one. The server process makes
//! the connections (the tools' sandbox is not involved), only to registered URLs, and only
//! under the egress policy (src/egress.rs): every request's URL is checked, names are
//! resolved by the policy's resolver, no redirect is followed. Each listing and each call is
//! a session of its own, over rmcp's streamable HTTP client.
//!
//! What goes wrong is told in Bedrock's words ([`why`]): never the text of rmcp's or
//! reqwest's errors, which can hold the body of the server's answer (rmcp keeps up to 64 KiB
//! of a failed one), and that body is not read at all.

use std::collections::HashMap;
use std::error::Error as StdError;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue};
use rmcp::ServiceExt as _;
use rmcp::model::{CallToolRequestParams, ClientJsonRpcMessage, ErrorData};
use rmcp::service::ClientInitializeError;
use rmcp::transport::DynamicTransportError;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::common::client_side_sse::{BoxedSseResponse, SseRetryPolicy};
use rmcp::transport::streamable_http_client::{
    StreamableHttpClient, StreamableHttpClientTransportConfig, StreamableHttpError,
    StreamableHttpPostResponse, StreamableHttpResponseLimits,
};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::egress::{self, EgressError};
use crate::model::McpTool;
use crate::state_machine::ToolOutcome;
use crate::store::McpServer;
use crate::tools::MCP_SEPARATOR;

/// The HTTP client of calls to MCP servers, under `egress`. rmcp's own client keeps no idle
/// connections (a reused one stalled on delayed ACKs); neither does this one.
pub fn http_client(egress: &egress::Egress) -> reqwest::Result<egress::Client> {
    egress.client(|builder| {
        builder
            .pool_max_idle_per_host(0)
            .connect_timeout(Duration::from_secs(10))
    })
}

type HttpResult<T> = Result<T, StreamableHttpError<reqwest::Error>>;

impl egress::Client {
    /// The policy's check of a URL rmcp is about to request, as rmcp's error.
    fn allow(&self, uri: &str) -> HttpResult<()> {
        let refused = match url::Url::parse(uri) {
            Ok(url) => self.check(&url),
            Err(_) => Err(EgressError::Invalid),
        };
        refused.map_err(|e| {
            StreamableHttpError::Io(std::io::Error::new(std::io::ErrorKind::PermissionDenied, e))
        })
    }
}

/// rmcp's reqwest client behind the policy's check of each URL; a failed answer's body is
/// never read (its diagnostic prefix is 0 bytes).
impl StreamableHttpClient for egress::Client {
    type Error = reqwest::Error;

    async fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> HttpResult<StreamableHttpPostResponse> {
        self.allow(&uri)?;
        let mut limits = StreamableHttpResponseLimits::default();
        limits.max_error_response_size = 0;
        self.http()
            .post_message_with_response_limits(
                uri,
                message,
                session_id,
                auth_header,
                custom_headers,
                limits,
            )
            .await
    }

    async fn post_message_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> HttpResult<StreamableHttpPostResponse> {
        self.allow(&uri)?;
        let mut limits = StreamableHttpResponseLimits::default();
        limits.max_sse_event_size = max_sse_event_size;
        limits.max_error_response_size = 0;
        self.http()
            .post_message_with_response_limits(
                uri,
                message,
                session_id,
                auth_header,
                custom_headers,
                limits,
            )
            .await
    }

    async fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        mut limits: StreamableHttpResponseLimits,
    ) -> HttpResult<StreamableHttpPostResponse> {
        self.allow(&uri)?;
        limits.max_error_response_size = 0;
        self.http()
            .post_message_with_response_limits(
                uri,
                message,
                session_id,
                auth_header,
                custom_headers,
                limits,
            )
            .await
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> HttpResult<()> {
        self.allow(&uri)?;
        self.http()
            .delete_session(uri, session_id, auth_header, custom_headers)
            .await
    }

    async fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> HttpResult<BoxedSseResponse> {
        self.allow(&uri)?;
        self.http()
            .get_stream(uri, session_id, last_event_id, auth_header, custom_headers)
            .await
    }

    async fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> HttpResult<BoxedSseResponse> {
        self.allow(&uri)?;
        self.http()
            .get_stream_with_max_sse_event_size(
                uri,
                session_id,
                last_event_id,
                auth_header,
                custom_headers,
                max_sse_event_size,
            )
            .await
    }
}

/// A session's transport to `server`, or why there is none (the policy refuses its URL).
fn transport(
    server: &McpServer,
    http: &egress::Client,
) -> Result<StreamableHttpClientTransport<egress::Client>, String> {
    let url = url::Url::parse(&server.url).map_err(|_| EgressError::Invalid.to_string())?;
    http.check(&url).map_err(|e| e.to_string())?;
    let headers: HashMap<_, _> = server
        .headers
        .iter()
        .filter_map(|(name, value)| {
            Some((
                HeaderName::from_bytes(name.as_bytes()).ok()?,
                HeaderValue::from_str(value).ok()?,
            ))
        })
        .collect();
    let mut config = StreamableHttpClientTransportConfig::with_uri(server.url.clone())
        .custom_headers(headers)
        .max_error_response_size(0);
    config.retry_config = Arc::new(BoundedReconnect::default());
    Ok(StreamableHttpClientTransport::with_client(
        http.clone(),
        config,
    ))
}

/// How often a broken stream of an MCP server is reconnected: after 250 ms, 500 ms, 1 s and
/// 2 s, then the call fails (rmcp's default tries for ever, so a server killed mid-call held
/// its conversation until the tool time limit). A server that asks for longer waits (SSE
/// `retry`) gets them, within the tool time limit. rmcp counts failed reconnects from 0
/// again after every stream that ends cleanly, so a server that keeps ending its streams
/// would be reconnected for ever: the reconnects of the whole call (one transport) are
/// counted too, [`BoundedReconnect::IN_ALL`] at most.
#[derive(Debug, Default)]
struct BoundedReconnect {
    started: std::sync::atomic::AtomicUsize,
}

impl BoundedReconnect {
    const TRIES: usize = 4;
    const IN_ALL: usize = 32;
    const FIRST: Duration = Duration::from_millis(250);
}

impl SseRetryPolicy for BoundedReconnect {
    fn retry(&self, done: usize) -> Option<Duration> {
        let in_all = self
            .started
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        (done < Self::TRIES && in_all < Self::IN_ALL)
            .then(|| Self::FIRST * 2u32.pow(done.min(8) as u32))
    }
}

/// What went wrong with an MCP server, in Bedrock's words: a refusal of the egress policy, a
/// connection that failed, the HTTP status it answered, the MCP error it sent, and nothing
/// of what else it answered. The error itself goes to the log.
pub fn why(server: &McpServer, error: &(dyn StdError + 'static)) -> String {
    tracing::info!(server = %server.name, url = %server.url, error = %error, "an MCP server could not be used");
    words(error).unwrap_or_else(|| "its answer is not MCP".to_owned())
}

fn words(error: &(dyn StdError + 'static)) -> Option<String> {
    if let Some(found) = EgressError::find(error) {
        return Some(found.to_string());
    }
    if let Some(e) = error.downcast_ref::<ClientInitializeError>() {
        return initialize_words(e);
    }
    if let Some(e) = error.downcast_ref::<rmcp::ServiceError>() {
        return service_words(e);
    }
    if let Some(e) = error.downcast_ref::<DynamicTransportError>() {
        return words(&*e.error);
    }
    if let Some(e) = error.downcast_ref::<StreamableHttpError<reqwest::Error>>() {
        return http_words(e);
    }
    if let Some(e) = error.downcast_ref::<reqwest::Error>() {
        return Some(reqwest_words(e));
    }
    if let Some(e) = error.downcast_ref::<std::io::Error>() {
        return Some(io_words(e));
    }
    error.source().and_then(words)
}

/// A JSON-RPC error the server sent: MCP's own answer, like a tool's result (cut short).
fn mcp_error(data: &ErrorData) -> String {
    format!(
        "it answered with MCP error {}: {}",
        data.code.0,
        crate::tools::preview(&data.message, 300)
    )
}

// rmcp's errors (and io's kinds) are non-exhaustive and grow with the crate: anything not
// named here gets words that quote nothing of it.
#[allow(clippy::wildcard_enum_match_arm)]
fn initialize_words(error: &ClientInitializeError) -> Option<String> {
    Some(match error {
        ClientInitializeError::TransportError { error, .. } => return words(error),
        ClientInitializeError::JsonRpcError(data) => mcp_error(data),
        ClientInitializeError::LegacyFallbackFailed { discover, fallback } => {
            return initialize_words(fallback).or_else(|| initialize_words(discover));
        }
        ClientInitializeError::ConnectionClosed(_) => {
            "the connection closed during the MCP handshake".to_owned()
        }
        ClientInitializeError::Cancelled => "cancelled".to_owned(),
        ClientInitializeError::NoCompatibleProtocolVersion { .. } => {
            "it speaks no MCP version Bedrock does".to_owned()
        }
        _ => "it did not complete the MCP handshake".to_owned(),
    })
}

// rmcp's errors (and io's kinds) are non-exhaustive and grow with the crate: anything not
// named here gets words that quote nothing of it.
#[allow(clippy::wildcard_enum_match_arm)]
fn service_words(error: &rmcp::ServiceError) -> Option<String> {
    use rmcp::ServiceError;
    Some(match error {
        ServiceError::McpError(data) => mcp_error(data),
        ServiceError::TransportSend(error) => return words(&*error.error),
        ServiceError::TransportClosed => "the connection to it closed".to_owned(),
        ServiceError::Timeout { timeout } => format!("no answer within {} s", timeout.as_secs()),
        ServiceError::Cancelled { .. } => "cancelled".to_owned(),
        _ => "it answered with something other than MCP".to_owned(),
    })
}

// rmcp's errors (and io's kinds) are non-exhaustive and grow with the crate: anything not
// named here gets words that quote nothing of it.
#[allow(clippy::wildcard_enum_match_arm)]
fn http_words(error: &StreamableHttpError<reqwest::Error>) -> Option<String> {
    Some(match error {
        StreamableHttpError::Client(e) => reqwest_words(e),
        StreamableHttpError::Io(e) => io_words(e),
        StreamableHttpError::HttpStatus(status) => answered(status.status),
        // rmcp's "HTTP {status}: {diagnostic}": only the status is kept.
        StreamableHttpError::UnexpectedServerResponse(text) => {
            match text
                .strip_prefix("HTTP ")
                .and_then(|rest| rest.get(..3))
                .and_then(|code| code.parse::<u16>().ok())
            {
                Some(code) => answered(code),
                None => "its answer is not valid MCP".to_owned(),
            }
        }
        StreamableHttpError::AuthRequired(_) => {
            "it answered HTTP 401 (authentication required)".to_owned()
        }
        StreamableHttpError::InsufficientScope(_) => {
            "it answered HTTP 403 (insufficient scope)".to_owned()
        }
        StreamableHttpError::SessionExpired => {
            "it answered HTTP 404 (the MCP session expired)".to_owned()
        }
        StreamableHttpError::ResponseBodyTooLarge { max_size } => {
            format!("its answer was over {max_size} bytes")
        }
        StreamableHttpError::ReservedHeaderConflict(name) => {
            format!("the header {name} is Bedrock's to set")
        }
        _ => "its answer is not valid MCP".to_owned(),
    })
}

fn answered(status: u16) -> String {
    if (300..400).contains(&status) {
        format!("it answered HTTP {status}, a redirect, which is not followed")
    } else {
        format!("it answered HTTP {status}")
    }
}

fn reqwest_words(error: &reqwest::Error) -> String {
    if let Some(found) = EgressError::find(error) {
        return found.to_string();
    }
    if let Some(status) = error.status() {
        return answered(status.as_u16());
    }
    if error.is_timeout() {
        return "it did not answer in time".to_owned();
    }
    let mut source = error.source();
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return io_words(io);
        }
        source = e.source();
    }
    if error.is_connect() {
        "cannot connect to it".to_owned()
    } else if error.is_body() || error.is_decode() {
        "its answer broke off".to_owned()
    } else {
        "the request to it failed".to_owned()
    }
}

// rmcp's errors (and io's kinds) are non-exhaustive and grow with the crate: anything not
// named here gets words that quote nothing of it.
#[allow(clippy::wildcard_enum_match_arm)]
fn io_words(error: &std::io::Error) -> String {
    use std::io::ErrorKind;
    match error.kind() {
        ErrorKind::ConnectionRefused => "connection refused".to_owned(),
        ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted => {
            "the connection was reset".to_owned()
        }
        ErrorKind::TimedOut => "it did not answer in time".to_owned(),
        _ => "cannot connect to it".to_owned(),
    }
}

/// The server's tools, as a conversation gets them, within `timeout`.
pub async fn list_tools(
    server: &McpServer,
    http: &egress::Client,
    timeout: Duration,
) -> Result<Vec<McpTool>, String> {
    let listing = async {
        let client = ().serve(transport(server, http)?).await.map_err(|e| why(server, &e))?;
        let tools = client.list_all_tools().await.map_err(|e| why(server, &e));
        let _ = client.cancel().await;
        tools
    };
    let tools = tokio::time::timeout(timeout, listing)
        .await
        .map_err(|_| format!("no answer within {} s", timeout.as_secs()))??;
    Ok(tools
        .into_iter()
        .map(|tool| McpTool {
            server: server.name.clone(),
            name: format!("{}{MCP_SEPARATOR}{}", server.name, tool.name),
            tool: tool.name.to_string(),
            description: tool.description.map(|d| d.to_string()).unwrap_or_default(),
            input_schema: Value::Object(tool.input_schema.as_ref().clone()),
        })
        .collect())
}

/// Calls `tool` with `input`: its text (or structured) content as the tool's output, capped
/// at `cap` bytes; `isError` makes it a failed result. A cancel or the timeout cancels the
/// MCP call (`notifications/cancelled`) and ends the session.
pub async fn call(
    server: &McpServer,
    http: &egress::Client,
    tool: &McpTool,
    input: &Value,
    timeout: Duration,
    cancel: &CancellationToken,
    cap: usize,
) -> ToolOutcome {
    let Some(arguments) = input.as_object() else {
        return ToolOutcome::failed(format!(
            "invalid arguments: expected a JSON object, got {}",
            crate::tools::preview(&input.to_string(), 200)
        ));
    };
    let transport = match transport(server, http) {
        Ok(transport) => transport,
        Err(e) => {
            return ToolOutcome::failed(format!(
                "cannot use the MCP server {} ({}): {e}",
                server.name, server.url
            ));
        }
    };
    let client = match tokio::time::timeout(timeout, ().serve(transport)).await {
        Ok(Ok(client)) => client,
        Ok(Err(e)) => {
            return ToolOutcome::failed(format!(
                "cannot use the MCP server {} ({}): {}",
                server.name,
                server.url,
                why(server, &e)
            ));
        }
        Err(_) => {
            return ToolOutcome::failed(format!(
                "the MCP server {} did not answer within {} s",
                server.name,
                timeout.as_secs()
            ));
        }
    };
    let params = CallToolRequestParams::new(tool.tool.clone()).with_arguments(arguments.clone());
    let mut calling = Box::pin(client.call_tool(params));
    let outcome = tokio::select! {
        result = &mut calling => Some(result),
        () = cancel.cancelled() => None,
        () = tokio::time::sleep(timeout) => Some(Err(rmcp::ServiceError::Timeout { timeout })),
    };
    // Dropping an unfinished call sends notifications/cancelled for it: the session is
    // given a moment to send it before it ends.
    drop(calling);
    if !matches!(outcome, Some(Ok(_))) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let outcome = match outcome {
        None => ToolOutcome::failed("cancelled by user"),
        Some(Err(rmcp::ServiceError::Timeout { .. })) => ToolOutcome::failed(format!(
            "{} did not answer within {} s; the call was cancelled",
            tool.name,
            timeout.as_secs()
        )),
        Some(Err(e)) => ToolOutcome::failed(format!(
            "the MCP server {} failed the call: {}",
            server.name,
            why(server, &e)
        )),
        Some(Ok(result)) => {
            let mut output: Vec<String> = result
                .content
                .iter()
                .filter_map(|c| c.as_text().map(|t| t.text.clone()))
                .collect();
            if output.is_empty()
                && let Some(structured) = &result.structured_content
            {
                output.push(structured.to_string());
            }
            let output = crate::tools::cap_output(output.join("\n"), cap);
            ToolOutcome {
                ok: result.is_error != Some(true),
                output,
            }
        }
    };
    let _ = client.cancel().await;
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that ends its streams cleanly again and again (rmcp then asks with 0 failed
    /// tries each time) is reconnected a bounded number of times in all; failed reconnects
    /// back off 250 ms, 500 ms, 1 s, 2 s, then give up.
    #[test]
    fn reconnects_are_bounded_in_all() {
        let policy = BoundedReconnect::default();
        let granted = (0..1000).filter(|_| policy.retry(0).is_some()).count();
        assert_eq!(granted, BoundedReconnect::IN_ALL);
        let fresh = BoundedReconnect::default();
        let waits: Vec<Option<Duration>> = (0..6).map(|done| fresh.retry(done)).collect();
        let expected: Vec<Option<Duration>> = [250, 500, 1000, 2000]
            .into_iter()
            .map(|ms| Some(Duration::from_millis(ms)))
            .chain([None, None])
            .collect();
        assert_eq!(waits, expected);
    }
}
