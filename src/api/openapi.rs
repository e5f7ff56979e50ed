//! The OpenAPI document: its frame, and what every operation shares (the API key, the error
//! replies any route can give). The operations come from the handlers' `#[utoipa::path]`
//! and the schemas from the wire types (src/wire.rs); docs/openapi.json is this document as
//! `bedrock openapi` prints it, and a test fails when the file is stale.

use utoipa::openapi::path::Operation;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, OpenApi, Ref, RefOr, ResponseBuilder, SecurityRequirement};

use crate::wire;

#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "Bedrock",
        description = "Runs LLM agent conversations as supervised actors. The live stream's \
            frames are the schemas ServerFrame (server to client) and ClientFrame (client to \
            server); docs/api.md has the semantics.",
    ),
    components(schemas(
        wire::ServerFrame,
        wire::ClientFrame,
        wire::RequestType,
        wire::Reply,
        wire::SystemEvent,
        wire::ErrorBody,
    )),
    tags(
        (name = "conversations", description = "Conversations, their messages and their control"),
        (name = "live stream", description = "WebSocket and SSE"),
        (name = "operations", description = "Health, readiness, metrics and this document; no key"),
        (name = "usage", description = "Token usage and budgets"),
        (name = "mcp", description = "The tenant's own MCP tool servers"),
        (name = "agents", description = "The tenant's agents: versioned definitions that conversations are created from"),
        (name = "schedules", description = "The tenant's schedules: agents run, or messages sent, on a cron expression, an interval or once"),
        (name = "webhooks", description = "The tenant's webhook endpoints: signed events of its conversations, delivered at least once"),
    ),
)]
pub struct Document;

/// The error replies every operation can give, by status, for those under /v1 (with a key)
/// and the others.
/// The errors of every route that takes a body.
const BODY_ERRORS: [(&str, &str); 2] = [
    (
        "408",
        "`request_timeout`: the body did not arrive within server.body_read_timeout_ms",
    ),
    (
        "415",
        "`unsupported_media_type`: a body without a JSON content type (`application/json`)",
    ),
];

/// The errors of a WebSocket upgrade.
const WEBSOCKET_ERRORS: [(&str, &str); 1] = [(
    "403",
    "`origin_not_allowed`: a browser Origin that is neither the server's own nor in \
     server.allowed_origins",
)];

const V1_ERRORS: [(&str, &str); 5] = [
    (
        "400",
        "`invalid_request`: a malformed path, query or body (a missing or unknown field, a \
         wrong type)",
    ),
    ("401", "`unauthorized`: a missing or unknown API key"),
    (
        "404",
        "`not_found`: no such conversation (or another tenant's), request or task",
    ),
    (
        "413",
        "`payload_too_large`: the body, a text or a frame is over its limit",
    ),
    (
        "503",
        "`unavailable`: the database does not answer, or the server is shutting down; retry",
    ),
];

/// Adds the security scheme, the version, and the shared error replies.
pub fn finish(mut document: OpenApi) -> OpenApi {
    document.info.version = env!("CARGO_PKG_VERSION").to_owned();
    let components = document.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "api_key",
        SecurityScheme::Http(
            HttpBuilder::new()
                .scheme(HttpAuthScheme::Bearer)
                .description(Some(
                    "`Authorization: Bearer <api key>`; where a client cannot set headers, \
                     `?access_token=<api key>`. In dev mode a request without a key acts as \
                     tenant `default`.",
                ))
                .build(),
        ),
    );
    // What the derive cannot say: a message needs text (not blank) or an image.
    if let Some(schema) = components.schemas.get_mut("SendMessage") {
        use utoipa::openapi::schema::{
            AllOfBuilder, AnyOfBuilder, ArrayBuilder, ObjectBuilder, Schema, Type,
        };
        let text = ObjectBuilder::new().property(
            "text",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .pattern(Some("\\S")),
        );
        let images = ObjectBuilder::new()
            .property(
                "images",
                ArrayBuilder::new()
                    .items(Ref::from_schema_name("ImageIn"))
                    .min_items(Some(1)),
            )
            .required("images");
        let either = AnyOfBuilder::new().item(text).item(images);
        let whole = AllOfBuilder::new().item(schema.clone()).item(either);
        *schema = RefOr::T(Schema::AllOf(whole.build()));
    }
    for (path, item) in document.paths.paths.iter_mut() {
        let v1 = path.starts_with("/v1/");
        // Their bodies may be left out: every field has a default.
        if (path == "/v1/conversations" || path == "/v1/conversations/{id}/fork")
            && let Some(RefOr::T(body)) = item.post.as_mut().and_then(|op| op.request_body.as_mut())
        {
            body.required = Some(utoipa::openapi::Required::False);
        }
        for operation in operations(item) {
            if !v1 {
                continue;
            }
            operation.security = Some(vec![SecurityRequirement::new(
                "api_key",
                Vec::<String>::new(),
            )]);
            let body = operation.request_body.is_some();
            let websocket = path.ends_with("/ws");
            let errors = V1_ERRORS
                .iter()
                .filter(|(status, _)| body || *status != "413")
                .chain(BODY_ERRORS.iter().filter(|_| body))
                .chain(WEBSOCKET_ERRORS.iter().filter(|_| websocket));
            for (status, description) in errors {
                let status = *status;
                if !operation.responses.responses.contains_key(status) {
                    operation
                        .responses
                        .responses
                        .insert(status.to_owned(), error_reply(description));
                }
            }
        }
    }
    document
}

fn operations(item: &mut utoipa::openapi::PathItem) -> impl Iterator<Item = &mut Operation> {
    [
        item.get.as_mut(),
        item.put.as_mut(),
        item.post.as_mut(),
        item.delete.as_mut(),
        item.patch.as_mut(),
    ]
    .into_iter()
    .flatten()
}

fn error_reply(description: &str) -> RefOr<utoipa::openapi::Response> {
    RefOr::T(
        ResponseBuilder::new()
            .description(description)
            .content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("ErrorBody")))
                    .build(),
            )
            .build(),
    )
}

#[cfg(test)]
mod tests {
    /// docs/openapi.json is the document the code makes, as `bedrock openapi` prints it.
    #[test]
    fn docs_openapi_json_is_the_generated_document() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.json");
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == super::super::openapi_json(),
            "docs/openapi.json is stale: run `cargo run -- openapi > docs/openapi.json`"
        );
    }
}
