//! Hosts and web origins as clients and operators write them (`Host` and `Origin` headers,
//! `public_host` and `allowed_origins` settings): parsed once, here, for the configuration's
//! checks and the HTTP layer's guard alike.

use axum::http::uri::Authority;

/// A host as a client addressed it: the name in lowercase (an IPv6 address without its
/// brackets) and the port, if it said one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPort {
    pub host: String,
    pub port: Option<u16>,
}

/// A `Host` header's value (or a `public_host` setting): `name[:port]`.
pub fn parse_host(text: &str) -> Option<HostPort> {
    let authority: Authority = text.trim().parse().ok()?;
    if authority.as_str().contains('@') {
        return None;
    }
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .trim_end_matches('.')
        .to_ascii_lowercase();
    (!host.is_empty()).then(|| HostPort {
        host,
        port: authority.port_u16(),
    })
}

/// A web origin: scheme, host and port (the scheme's default when it names none).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    pub scheme: String,
    pub host: String,
    pub port: u16,
}

/// An `Origin` header's value (or an `allowed_origins` entry): `http(s)://host[:port]`.
pub fn parse_origin(text: &str) -> Option<Origin> {
    let url = url::Url::parse(text.trim()).ok()?;
    if !matches!(url.scheme(), "http" | "https")
        || !url.username().is_empty()
        || url.password().is_some()
        || url.path() != "/"
        || url.query().is_some()
        || url.fragment().is_some()
    {
        return None;
    }
    let host = url
        .host_str()?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .trim_end_matches('.')
        .to_ascii_lowercase();
    Some(Origin {
        scheme: url.scheme().to_owned(),
        host,
        port: url.port_or_known_default()?,
    })
}
