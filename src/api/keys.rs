//! A tenant's API keys: made, listed and revoked, for the command line (`bedrock tenant
//! key`) and the admin API on the operator listener, both on a store they are given.

use chrono::Utc;

use crate::model::Tenant;
use crate::store::Store;

/// A key as `bedrock tenant key list` shows it: never the key itself.
fn key_json(key: &entity::api_keys::Model) -> serde_json::Value {
    serde_json::json!({
        "key_id": key.id,
        "prefix": key.prefix,
        "created_at": key.created_at.to_rfc3339(),
        "revoked_at": key.revoked_at.map(|at| at.to_rfc3339()),
    })
}

/// Why a command on a tenant's keys was refused: a tenant or key that does not exist (404
/// on the admin API), or the database.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("{0}")]
    NotFound(String),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
}

async fn key_tenant(store: &Store, name: &str) -> Result<Tenant, KeyError> {
    store
        .tenant_by_name(name)
        .await?
        .ok_or_else(|| KeyError::NotFound(format!("no tenant is named {name:?}")))
}

/// A new API key for the tenant named `name`, shown once (`bedrock tenant key create`, and
/// the admin API on the server's own store).
pub async fn create_key_in(store: &Store, name: &str) -> Result<serde_json::Value, KeyError> {
    let tenant = key_tenant(store, name).await?;
    let key = super::new_key();
    let id = uuid::Uuid::now_v7().to_string();
    store
        .insert_api_key(
            &tenant.id,
            &id,
            &super::hash_key(&key),
            &super::key_prefix(&key),
            Utc::now(),
        )
        .await?;
    Ok(serde_json::json!({"tenant_id": tenant.id, "key_id": id, "api_key": key}))
}

/// The tenant's keys (ids, prefixes, times; never the keys).
pub async fn list_keys_in(store: &Store, name: &str) -> Result<serde_json::Value, KeyError> {
    let tenant = key_tenant(store, name).await?;
    let keys = store.api_keys(&tenant.id).await?;
    Ok(serde_json::json!({
        "tenant_id": tenant.id,
        "keys": keys.iter().map(key_json).collect::<Vec<_>>(),
    }))
}

/// Revokes a key (by id or prefix): refused from now on, by every node within
/// `server.key_cache_ms`.
pub async fn revoke_key_in(
    store: &Store,
    name: &str,
    key: &str,
) -> Result<serde_json::Value, KeyError> {
    let tenant = key_tenant(store, name).await?;
    let revoked = match store.revoke_api_key(&tenant.id, key, Utc::now()).await {
        Ok(revoked) => revoked,
        Err(crate::store::StoreError::NotFound) => {
            return Err(KeyError::NotFound(format!(
                "tenant {name:?} has no key with the id or prefix {key:?}"
            )));
        }
        Err(error) => return Err(error.into()),
    };
    Ok(serde_json::json!({"tenant_id": tenant.id, "key": key_json(&revoked)}))
}
