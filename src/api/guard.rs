//! Where a request comes from, for requests a web page could make on a user's behalf
//! (docs/security.md, "Web pages"):
//! - in dev mode (no key needed), the `Host` must be a loopback name or the configured public
//!   host, so that a page cannot reach the server through DNS rebinding;
//! - a WebSocket upgrade or a call to `/mcp` that carries an `Origin` must come from the
//!   server's own origin (as the request addressed it) or a configured one. A request without
//!   `Origin` is not a browser's and is not concerned.
//!
//! JSON bodies need a JSON content type (`error::Body`), so that a page cannot post one as a
//! "simple" cross-site request.

use std::net::IpAddr;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::AppState;
use super::error::ApiError;
use crate::config::Settings;
use crate::origin::{HostPort, Origin, parse_host, parse_origin};

fn default_port(scheme: &str) -> u16 {
    if scheme == "https" { 443 } else { 80 }
}

/// Whether `origin` is the origin of a request addressed to `host`: the same name, and the
/// same port (a `Host` without a port means the default port of the origin's scheme).
fn same_origin(origin: &Origin, host: &HostPort) -> bool {
    origin.host == host.host && host.port.unwrap_or(default_port(&origin.scheme)) == origin.port
}

/// Whether a host name is a loopback name: `localhost` or a loopback address.
fn is_loopback(host: &str) -> bool {
    host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The checks, made once from the settings.
#[derive(Debug)]
pub struct Guard {
    /// Dev mode: requests without a key are served, so the `Host` is checked.
    dev: bool,
    /// Hosts served in dev mode besides loopback names: `public_host` and the host of
    /// `cluster.advertise`.
    public_hosts: Vec<HostPort>,
    allowed_origins: Vec<Origin>,
}

impl Guard {
    pub fn new(settings: &Settings, dev: bool) -> Guard {
        let mut public_hosts: Vec<HostPort> = [settings.server.public_host.trim()]
            .into_iter()
            .filter(|h| !h.is_empty())
            .filter_map(parse_host)
            .collect();
        if let Ok(url) = url::Url::parse(&settings.cluster.advertise)
            && let Some(host) = url.host_str()
            && let Some(mut host) = parse_host(host)
        {
            host.port = url.port_or_known_default();
            public_hosts.push(host);
        }
        Guard {
            dev,
            public_hosts,
            allowed_origins: settings
                .server
                .allowed_origins
                .iter()
                .filter_map(|o| parse_origin(o))
                .collect(),
        }
    }

    /// The host a request addressed: its `Host` header, or its URI's authority (HTTP/2).
    fn host(headers: &HeaderMap, uri: &Uri) -> Option<Result<HostPort, ()>> {
        match headers.get(header::HOST) {
            Some(value) => Some(value.to_str().ok().and_then(parse_host).ok_or(())),
            None => uri.authority().map(|a| parse_host(a.as_str()).ok_or(())),
        }
    }

    /// Dev mode's check of the `Host` (DNS rebinding). A request without one is not a
    /// browser's.
    fn check_host(&self, host: Option<&Result<HostPort, ()>>) -> Result<(), ApiError> {
        if !self.dev {
            return Ok(());
        }
        let allowed = match host {
            None => true,
            Some(Err(())) => false,
            Some(Ok(host)) => {
                is_loopback(&host.host)
                    || self.public_hosts.iter().any(|public| {
                        public.host == host.host && public.port.is_none_or(|p| host.port == Some(p))
                    })
            }
        };
        if allowed {
            Ok(())
        } else {
            Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "host_not_allowed",
                "in dev mode the server answers only requests addressed to a loopback name (localhost, 127.0.0.1, [::1]) or server.public_host",
            ))
        }
    }

    /// The `Origin` check of WebSocket upgrades and `/mcp`.
    fn check_origin(
        &self,
        headers: &HeaderMap,
        host: Option<&Result<HostPort, ()>>,
    ) -> Result<(), ApiError> {
        let Some(origin) = headers.get(header::ORIGIN) else {
            return Ok(());
        };
        let allowed = origin
            .to_str()
            .ok()
            .and_then(parse_origin)
            .is_some_and(|origin| {
                matches!(host, Some(Ok(host)) if same_origin(&origin, host))
                    || self.allowed_origins.contains(&origin)
            });
        if allowed {
            Ok(())
        } else {
            Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "origin_not_allowed",
                "this Origin may not open WebSockets, call /mcp or, in dev mode, change anything: only the server's own origin and server.allowed_origins may",
            ))
        }
    }

    /// Both checks, as they apply to a request. In dev mode (no key needed) every request
    /// that changes something is checked for its Origin too: a page elsewhere could post
    /// a body-less request (a new conversation, a cancel) as a "simple" request.
    pub fn admit(&self, method: &Method, headers: &HeaderMap, uri: &Uri) -> Result<(), ApiError> {
        let host = Self::host(headers, uri);
        self.check_host(host.as_ref())?;
        let changes = !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS);
        if is_websocket(headers) || is_mcp(uri.path()) || (self.dev && changes) {
            self.check_origin(headers, host.as_ref())?;
        }
        Ok(())
    }
}

fn is_websocket(headers: &HeaderMap) -> bool {
    headers.get_all(header::UPGRADE).iter().any(|v| {
        v.to_str()
            .is_ok_and(|v| v.to_ascii_lowercase().contains("websocket"))
    })
}

fn is_mcp(path: &str) -> bool {
    path == "/mcp" || path.starts_with("/mcp/")
}

/// The layer over every route.
pub async fn check(State(app): State<AppState>, request: Request, next: Next) -> Response {
    match app
        .guard
        .admit(request.method(), request.headers(), request.uri())
    {
        Ok(()) => next.run(request).await,
        Err(error) => error.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_and_origins_parse() {
        assert_eq!(
            parse_host("LocalHost:8080"),
            Some(HostPort {
                host: "localhost".into(),
                port: Some(8080)
            })
        );
        assert_eq!(parse_host("[::1]:9").map(|h| h.host), Some("::1".into()));
        assert_eq!(parse_host("a@b"), None);
        assert_eq!(parse_host(""), None);
        let origin = parse_origin("https://App.Example.com").expect("an origin");
        assert_eq!(
            (origin.host.as_str(), origin.port),
            ("app.example.com", 443)
        );
        assert_eq!(
            parse_origin("http://[::1]:3000").map(|o| o.host),
            Some("::1".into())
        );
        assert_eq!(parse_origin("null"), None);
        assert_eq!(parse_origin("ftp://a.b"), None);
        assert_eq!(parse_origin("https://a.b/path"), None);
        assert!(is_loopback("127.0.0.2") && is_loopback("::1") && is_loopback("localhost"));
        assert!(!is_loopback("evil.example") && !is_loopback("localhost.evil.example"));
    }

    #[test]
    fn an_origin_is_the_same_as_the_host_it_addressed() {
        let host = |h: &str| parse_host(h).expect("a host");
        let origin = |o: &str| parse_origin(o).expect("an origin");
        assert!(same_origin(
            &origin("http://127.0.0.1:8080"),
            &host("127.0.0.1:8080")
        ));
        assert!(same_origin(
            &origin("https://b.example"),
            &host("b.example")
        ));
        assert!(same_origin(
            &origin("https://b.example"),
            &host("b.example:443")
        ));
        assert!(!same_origin(
            &origin("https://b.example:8443"),
            &host("b.example")
        ));
        assert!(!same_origin(
            &origin("http://evil.example:8080"),
            &host("127.0.0.1:8080")
        ));
        assert!(!same_origin(
            &origin("http://127.0.0.1:9999"),
            &host("127.0.0.1:8080")
        ));
    }
}
