//! Any node answers any route. A command for a conversation whose lease another live node
//! holds is answered by that node: the handler here says so ([`ApiError::elsewhere`]), and
//! this layer sends the same request (method, path, query, headers, body) to the owner and
//! answers with the owner's answer, status and all. A request that was itself carried here
//! is not carried again: if this node does not own the conversation either (it moved in
//! between), the answer is 503 with `Retry-After`.

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::AppState;
use super::error::{ApiError, Forward};

/// Marks a request carried from another node (its value: that node's id).
pub const FORWARDED: HeaderName = HeaderName::from_static("x-bedrock-forwarded-by");

/// The layer: a no-op on a single node.
pub async fn forward(State(app): State<AppState>, request: Request, next: Next) -> Response {
    let Some(cluster) = app.cluster.clone() else {
        return next.run(request).await;
    };
    // Only commands move; reads and live streams are answered here. A request this node
    // makes in process (a schedule's firing) carries no key to send along: it is answered
    // here, and its maker hands the work to the owner (src/api/schedules.rs).
    if request.method() == Method::GET
        || request
            .extensions()
            .get::<super::auth::InProcess>()
            .is_some()
    {
        return next.run(request).await;
    }
    let carried = request.headers().contains_key(&FORWARDED);
    let (parts, body) = request.into_parts();
    let limit = app.settings.server.max_body_bytes;
    let body = match axum::body::to_bytes(body, limit).await {
        Ok(body) => body,
        Err(_) => {
            return ApiError::too_large(format!("the request body is over {limit} bytes"))
                .into_response();
        }
    };
    let (method, uri, headers) = (
        parts.method.clone(),
        parts.uri.clone(),
        parts.headers.clone(),
    );
    let response = next
        .run(Request::from_parts(parts, Body::from(body.clone())))
        .await;
    let Some(Forward(owner)) = response.extensions().get::<Forward>().cloned() else {
        return response;
    };
    if carried || owner.is_empty() {
        return retry_later(response);
    }
    match carry(&cluster, &owner, method, &uri, headers, body).await {
        Ok(answer) => answer,
        Err(error) => {
            tracing::warn!(%owner, %error, "the owner of a conversation did not answer a forwarded request");
            retry_later(response)
        }
    }
}

/// Sends the request to the owner and returns its answer.
pub(super) async fn carry(
    cluster: &crate::cluster::Cluster,
    owner: &str,
    method: Method,
    uri: &Uri,
    mut headers: HeaderMap,
    body: Bytes,
) -> Result<Response, reqwest::Error> {
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    for hop in [
        header::HOST,
        header::CONTENT_LENGTH,
        header::CONNECTION,
        header::TRANSFER_ENCODING,
    ] {
        headers.remove(hop);
    }
    if let Ok(me) = HeaderValue::from_str(&cluster.node_id) {
        headers.insert(FORWARDED, me);
    }
    let answer = cluster
        .http
        .request(method, format!("{owner}{path}"))
        .headers(headers)
        .body(body)
        .send()
        .await?;
    let status = answer.status();
    let mut kept = HeaderMap::new();
    for (name, value) in answer.headers() {
        if name != header::CONTENT_LENGTH
            && name != header::TRANSFER_ENCODING
            && name != header::CONNECTION
        {
            kept.append(name.clone(), value.clone());
        }
    }
    let body = answer.bytes().await?;
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    *response.headers_mut() = kept;
    Ok(response)
}

/// The handler's own 503, with a hint of when to try again.
fn retry_later(mut response: Response) -> Response {
    if response.status() == StatusCode::SERVICE_UNAVAILABLE {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}
