//! Calls to tenants' own MCP tool servers (docs/api.md, "MCP"): their tools are listed when a
//! conversation is created, and called when its LLM asks for one. The server process makes
//! the connections (the tools' sandbox is not involved), and only registered URLs are
//! reached. Each listing and each call is a session of its own, over rmcp's streamable HTTP
//! client.

use std::collections::HashMap;
use std::time::Duration;

use rmcp::ServiceExt as _;
use rmcp::model::CallToolRequestParams;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::model::McpTool;
use crate::state_machine::ToolOutcome;
use crate::store::McpServer;

/// The separator of `server__tool`, the names the LLM sees.
pub const SEPARATOR: &str = "__";

fn transport(server: &McpServer) -> StreamableHttpClientTransport<reqwest::Client> {
    let headers: HashMap<_, _> = server
        .headers
        .iter()
        .filter_map(|(name, value)| {
            Some((
                http::HeaderName::from_bytes(name.as_bytes()).ok()?,
                http::HeaderValue::from_str(value).ok()?,
            ))
        })
        .collect();
    StreamableHttpClientTransport::from_config(
        StreamableHttpClientTransportConfig::with_uri(server.url.clone()).custom_headers(headers),
    )
}

/// The server's tools, as a conversation gets them, within `timeout`.
pub async fn list_tools(server: &McpServer, timeout: Duration) -> Result<Vec<McpTool>, String> {
    let listing = async {
        let client = ().serve(transport(server)).await.map_err(|e| e.to_string())?;
        let tools = client.list_all_tools().await.map_err(|e| e.to_string());
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
            name: format!("{}{SEPARATOR}{}", server.name, tool.name),
            tool: tool.name.to_string(),
            description: tool.description.map(|d| d.to_string()).unwrap_or_default(),
            input_schema: Value::Object(tool.input_schema.as_ref().clone()),
        })
        .collect())
}

fn failed(output: String) -> ToolOutcome {
    ToolOutcome { ok: false, output }
}

/// Calls `tool` with `input`: its text (or structured) content as the tool's output, capped
/// at `cap` bytes; `isError` makes it a failed result. A cancel or the timeout cancels the
/// MCP call (`notifications/cancelled`) and ends the session.
pub async fn call(
    server: &McpServer,
    tool: &McpTool,
    input: &Value,
    timeout: Duration,
    cancel: &CancellationToken,
    cap: usize,
) -> ToolOutcome {
    let Some(arguments) = input.as_object() else {
        return failed(format!(
            "invalid arguments: expected a JSON object, got {}",
            crate::tools::preview(&input.to_string(), 200)
        ));
    };
    let client = match tokio::time::timeout(timeout, ().serve(transport(server))).await {
        Ok(Ok(client)) => client,
        Ok(Err(e)) => {
            return failed(format!(
                "cannot reach the MCP server {} ({}): {e}",
                server.name, server.url
            ));
        }
        Err(_) => {
            return failed(format!(
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
        None => failed("cancelled by user".into()),
        Some(Err(rmcp::ServiceError::Timeout { .. })) => failed(format!(
            "{} did not answer within {} s; the call was cancelled",
            tool.name,
            timeout.as_secs()
        )),
        Some(Err(e)) => failed(format!(
            "the MCP server {} failed the call: {e}",
            server.name
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
            let mut output = output.join("\n");
            if output.len() > cap {
                let mut end = cap;
                while !output.is_char_boundary(end) {
                    end -= 1;
                }
                let total = output.len();
                output.truncate(end);
                output.push_str(&format!("\n[output truncated: {total} bytes, {cap} kept]"));
            }
            ToolOutcome {
                ok: result.is_error != Some(true),
                output,
            }
        }
    };
    let _ = client.cancel().await;
    outcome
}
