//! The web console: a single page and its assets, embedded in the binary at compile time
//! (console/ at the top of the repository; hand-written, no build step). `GET /` serves the
//! page, `GET /console/{file}` its scripts and styles. Nothing is fetched from elsewhere:
//! the Content-Security-Policy allows only this origin, so a script or style from a CDN,
//! inline script, or a connection to another host is refused by the browser. The page talks
//! to the same REST and WebSocket API as any client (docs/console.md).

use std::sync::LazyLock;

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sha2::{Digest as _, Sha256};

use super::ApiError;
use super::error::Path;

/// One embedded file: its name under /console/, its media type and its bytes.
struct Asset {
    name: &'static str,
    media_type: &'static str,
    bytes: &'static [u8],
}

macro_rules! asset {
    ($name:literal, $media_type:literal) => {
        Asset {
            name: $name,
            media_type: $media_type,
            bytes: include_bytes!(concat!("../../console/", $name)),
        }
    };
}

const ASSETS: &[Asset] = &[
    asset!("index.html", "text/html; charset=utf-8"),
    asset!("app.js", "text/javascript; charset=utf-8"),
    asset!("app.css", "text/css; charset=utf-8"),
    asset!("favicon.svg", "image/svg+xml"),
    asset!("vendor/marked.umd.js", "text/javascript; charset=utf-8"),
    asset!("vendor/purify.min.js", "text/javascript; charset=utf-8"),
];

/// Strong validators, one per asset, made once: a reload revalidates and gets 304.
static ETAGS: LazyLock<Vec<String>> = LazyLock::new(|| {
    ASSETS
        .iter()
        .map(|a| format!("\"{}\"", hex::encode(&Sha256::digest(a.bytes)[..12])))
        .collect()
});

/// What the browser may load and connect to: this origin only (`connect-src 'self'` covers
/// the WebSocket of the same host), images also from blob: URLs (thumbnails fetched with
/// the key, and pasted images before they are sent), and no framing by other sites.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; \
                   connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// `GET /`: the console's page.
pub async fn index(headers: HeaderMap) -> Response {
    serve(0, &headers)
}

/// `GET /console/{*file}`: the page's assets; any other name is the contract's 404.
pub async fn asset(Path(file): Path<String>, headers: HeaderMap) -> Response {
    match ASSETS.iter().position(|a| a.name == file) {
        Some(i) => serve(i, &headers),
        None => ApiError::not_found("console file").into_response(),
    }
}

fn serve(i: usize, request: &HeaderMap) -> Response {
    let asset = &ASSETS[i];
    let etag = &ETAGS[i];
    let fresh = request
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag));
    let mut response = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(asset.media_type),
            )],
            asset.bytes,
        )
            .into_response()
    };
    let headers = response.headers_mut();
    if let Ok(value) = HeaderValue::from_str(etag) {
        headers.insert(header::ETAG, value);
    }
    // Revalidated on every load: a new binary's console is never mixed with an old one's.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_asset_is_embedded_and_the_page_names_only_embedded_ones() {
        let page = std::str::from_utf8(ASSETS[0].bytes).expect("index.html is UTF-8");
        for asset in ASSETS {
            assert!(!asset.bytes.is_empty(), "{} is empty", asset.name);
        }
        // Every script and stylesheet the page loads is served from /console/.
        for (at, _) in page.match_indices("/console/") {
            let rest = &page[at + "/console/".len()..];
            let name = &rest[..rest.find('"').expect("a quoted path")];
            assert!(
                ASSETS.iter().any(|a| a.name == name),
                "index.html loads /console/{name}, which is not embedded"
            );
        }
        assert!(!page.contains("http://") && !page.contains("https://"));
    }
}
