//! Tenants and API keys: keys are random, shown once, and stored as SHA-256 hashes. A request
//! carries its key as `Authorization: Bearer <key>`; a browser's WebSocket, which cannot set
//! headers, as the subprotocol `bearer.<key>` beside `bedrock` (a header proxies do not log),
//! or as `?access_token=` (kept for existing clients; proxies may log URLs). In `dev` mode a
//! request without a key acts as tenant `default`.

use std::time::{Duration, Instant};

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;
use base64::Engine;
use rand::RngCore;
use sha2::{Digest, Sha256};

use super::AppState;
use super::error::ApiError;
use crate::model::Tenant;

/// A new API key: `bk_` and 256 random bits.
pub fn new_key() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!(
        "bk_{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    )
}

/// What is stored of a key.
pub fn hash_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// The first characters of a key, to tell keys apart in listings.
pub fn key_prefix(key: &str) -> String {
    key.chars().take(10).collect()
}

/// The tenant a request acts for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller(pub Tenant);

/// The key a request carries, if any. An `Authorization` header that is not
/// `Bearer <key>` is refused rather than taken for no key.
fn bearer(parts: &Parts) -> Result<Option<String>, ApiError> {
    if let Some(value) = parts.headers.get(header::AUTHORIZATION) {
        return value
            .to_str()
            .ok()
            .and_then(|value| value.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, key)| key.trim().to_owned())
            .filter(|key| !key.is_empty())
            .map(Some)
            .ok_or_else(|| {
                ApiError::unauthorized("the Authorization header must be `Bearer <api key>`")
            });
    }
    if let Some(key) = subprotocol_key(parts) {
        return Ok(Some(key));
    }
    Ok(parts
        .uri
        .query()
        .and_then(|query| url_param(query, "access_token"))
        .filter(|key| !key.is_empty()))
}

/// The subprotocol a WebSocket's key travels in, beside [`SUBPROTOCOL`].
pub const KEY_SUBPROTOCOL: &str = "bearer.";
/// The subprotocol the server answers a WebSocket with.
pub const SUBPROTOCOL: &str = "bedrock";

/// A key offered as the WebSocket subprotocol `bearer.<key>`.
fn subprotocol_key(parts: &Parts) -> Option<String> {
    parts
        .headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .find_map(|protocol| protocol.trim().strip_prefix(KEY_SUBPROTOCOL))
        .filter(|key| !key.is_empty())
        .map(str::to_owned)
}

/// One decoded query parameter.
pub fn url_param(query: &str, name: &str) -> Option<String> {
    url::form_urlencoded::parse(query.as_bytes())
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.into_owned())
}

/// The tenant a request made in process acts for (src/api/schedules.rs).
#[derive(Clone, Debug)]
pub struct InProcess(pub Tenant);

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        app: &AppState,
    ) -> Result<Self, Self::Rejection> {
        // A request the server makes itself for a tenant (a schedule's firing): an extension,
        // which nothing from the network can set.
        if let Some(InProcess(tenant)) = parts.extensions.get::<InProcess>() {
            return Ok(Caller(tenant.clone()));
        }
        let Some(key) = bearer(parts)? else {
            return match &app.dev_tenant {
                Some(tenant) => {
                    app.admit(DEV_KEY, &tenant.id).await?;
                    Ok(Caller(tenant.clone()))
                }
                None => Err(ApiError::unauthorized(
                    "an API key is required: send Authorization: Bearer <key>",
                )),
            };
        };
        let hash = hash_key(&key);
        let tenant = match app.cached_key(&hash) {
            Some(tenant) => tenant,
            None => match app.store.tenant_by_key_hash(&hash).await? {
                Some(tenant) => {
                    app.cache_key(hash.clone(), tenant.clone());
                    tenant
                }
                None => return Err(ApiError::unauthorized("the API key is not valid")),
            },
        };
        app.admit(&hash, &tenant.id).await?;
        Ok(Caller(tenant))
    }
}

/// The API key a request carries, unchecked. A WebSocket keeps it to carry its client's
/// commands to the node that owns the conversation, which checks it again.
#[derive(Clone, Debug, Default)]
pub struct Credential(pub Option<String>);

impl FromRequestParts<AppState> for Credential {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &AppState) -> Result<Self, Self::Rejection> {
        bearer(parts).map(Credential)
    }
}

/// The bucket of requests without a key, in dev mode.
const DEV_KEY: &str = "dev";

/// The bucket a WebSocket's frames count against: its key's, or dev mode's.
pub fn key_id(credential: &Credential) -> String {
    credential
        .0
        .as_deref()
        .map_or_else(|| DEV_KEY.to_owned(), hash_key)
}

impl AppState {
    /// Counts one request against the key's rate.
    async fn admit(&self, key_id: &str, tenant_id: &str) -> Result<(), ApiError> {
        self.rate
            .admit(&self.store, &self.metrics, key_id, tenant_id)
            .await
    }

    /// How long a verified key is trusted without asking the database again
    /// (`server.key_cache_ms`): the bound on a revocation's reach.
    /// Whether an open stream's key still stands (a revoked key's stream is closed within
    /// `server.key_cache_ms`). No key (dev mode): yes; a database that does not answer: yes
    /// (checked again at the next tick).
    pub(super) async fn key_still_valid(&self, credential: &Credential) -> bool {
        let Some(key) = &credential.0 else {
            return true;
        };
        let hash = hash_key(key);
        if self.cached_key(&hash).is_some() {
            return true;
        }
        match self.store.tenant_by_key_hash(&hash).await {
            Ok(Some(tenant)) => {
                self.cache_key(hash, tenant);
                true
            }
            Ok(None) => false,
            Err(_) => true,
        }
    }

    /// How often an open stream's key is checked again.
    pub(super) fn key_recheck(&self) -> Duration {
        self.key_cache_ttl().max(Duration::from_secs(1))
    }

    fn key_cache_ttl(&self) -> Duration {
        Duration::from_millis(self.settings.server.key_cache_ms)
    }

    fn cached_key(&self, hash: &str) -> Option<Tenant> {
        let ttl = self.key_cache_ttl();
        let cache = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        cache
            .get(hash)
            .filter(|(_, at)| at.elapsed() < ttl)
            .map(|(tenant, _)| tenant.clone())
    }

    fn cache_key(&self, hash: String, tenant: Tenant) {
        let ttl = self.key_cache_ttl();
        if ttl.is_zero() {
            return;
        }
        let mut cache = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() > 10_000 {
            cache.retain(|_, (_, at)| at.elapsed() < ttl);
        }
        cache.insert(hash, (tenant, Instant::now()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_random_and_hashed() {
        let (a, b) = (new_key(), new_key());
        assert_ne!(a, b);
        assert!(a.starts_with("bk_") && a.len() == 46, "{a}");
        assert_eq!(hash_key(&a).len(), 64);
        assert_ne!(hash_key(&a), a);
        assert_eq!(key_prefix(&a).len(), 10);
    }

    #[test]
    fn query_parameters_decode() {
        assert_eq!(
            url_param("a=1&access_token=bk%5Fx%2By", "access_token").as_deref(),
            Some("bk_x+y")
        );
        assert_eq!(
            url_param("access_token=a+b", "access_token").as_deref(),
            Some("a b")
        );
        assert_eq!(url_param("x=1", "access_token"), None);
        assert_eq!(
            url_param("access_token=%zz%", "access_token").as_deref(),
            Some("%zz%")
        );
        assert_eq!(
            url_param("access_token=%ff", "access_token").as_deref(),
            Some("\u{fffd}")
        );
    }
}
