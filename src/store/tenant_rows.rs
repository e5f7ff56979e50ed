//! Tenants and their API keys.

use chrono::{DateTime, Utc};
use entity::{api_keys, tenants};
use sea_orm::sea_query::Expr;
use sea_orm::{
    ActiveValue::Set, ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder,
    TransactionTrait,
};

use super::{Result, Store, StoreError};
use crate::model::Tenant;

impl Store {
    pub async fn tenant_by_key_hash(&self, key_hash: &str) -> Result<Option<Tenant>> {
        let Some(key) = api_keys::Entity::find()
            .filter(api_keys::Column::KeyHash.eq(key_hash))
            .filter(api_keys::Column::RevokedAt.is_null())
            .one(&self.db)
            .await?
        else {
            return Ok(None);
        };
        Ok(tenants::Entity::find_by_id(key.tenant_id)
            .one(&self.db)
            .await?
            .map(tenant))
    }

    pub async fn tenant_by_name(&self, name: &str) -> Result<Option<Tenant>> {
        Ok(tenants::Entity::find()
            .filter(tenants::Column::Name.eq(name))
            .one(&self.db)
            .await?
            .map(tenant))
    }

    pub(crate) async fn insert_tenant(
        &self,
        tenant: &Tenant,
        key_id: &str,
        key_hash: &str,
        key_prefix: &str,
        at: DateTime<Utc>,
    ) -> Result<()> {
        let txn = self.writer().begin().await?;
        tenants::Entity::insert(tenants::ActiveModel {
            id: Set(tenant.id.clone()),
            name: Set(tenant.name.clone()),
            created_at: Set(at),
        })
        .exec(&txn)
        .await?;
        insert_key(&txn, &tenant.id, key_id, key_hash, key_prefix, at).await?;
        txn.commit().await?;
        Ok(())
    }

    pub(crate) async fn insert_api_key(
        &self,
        tenant_id: &str,
        key_id: &str,
        key_hash: &str,
        key_prefix: &str,
        at: DateTime<Utc>,
    ) -> Result<()> {
        insert_key(self.writer(), tenant_id, key_id, key_hash, key_prefix, at).await
    }

    /// A tenant's API keys, oldest first (hashes and prefixes; the keys are never stored).
    pub async fn api_keys(&self, tenant_id: &str) -> Result<Vec<api_keys::Model>> {
        Ok(api_keys::Entity::find()
            .filter(api_keys::Column::TenantId.eq(tenant_id))
            .order_by_asc(api_keys::Column::CreatedAt)
            .order_by_asc(api_keys::Column::Id)
            .all(&self.db)
            .await?)
    }

    /// Revokes a tenant's key named by its id or its prefix (which must name one key);
    /// returns the key as it now is. Revoking a revoked key keeps its first revocation time.
    pub async fn revoke_api_key(
        &self,
        tenant_id: &str,
        key: &str,
        at: DateTime<Utc>,
    ) -> Result<api_keys::Model> {
        let keys = self.api_keys(tenant_id).await?;
        let found: Vec<&api_keys::Model> = keys
            .iter()
            .filter(|k| k.id == key || k.prefix == key)
            .collect();
        let found = match found.as_slice() {
            [one] => (*one).clone(),
            [] => return Err(StoreError::NotFound),
            _ => {
                return Err(StoreError::Conflict(format!(
                    "{key:?} names {} keys; give the key's id",
                    found.len()
                )));
            }
        };
        api_keys::Entity::update_many()
            .col_expr(api_keys::Column::RevokedAt, Expr::value(at))
            .filter(api_keys::Column::Id.eq(&found.id))
            .filter(api_keys::Column::RevokedAt.is_null())
            .exec(self.writer())
            .await?;
        Ok(api_keys::Entity::find_by_id(found.id.clone())
            .one(self.writer())
            .await?
            .unwrap_or(found))
    }

    /// Ensures a tenant with this id and name exists (the `dev` auth mode's tenant).
    pub(crate) async fn ensure_tenant(&self, tenant: &Tenant, at: DateTime<Utc>) -> Result<()> {
        tenants::Entity::insert(tenants::ActiveModel {
            id: Set(tenant.id.clone()),
            name: Set(tenant.name.clone()),
            created_at: Set(at),
        })
        .on_conflict_do_nothing()
        .exec(self.writer())
        .await?;
        Ok(())
    }
}

pub(super) async fn insert_key<C: ConnectionTrait>(
    db: &C,
    tenant_id: &str,
    key_id: &str,
    key_hash: &str,
    key_prefix: &str,
    at: DateTime<Utc>,
) -> Result<()> {
    api_keys::Entity::insert(api_keys::ActiveModel {
        id: Set(key_id.to_owned()),
        tenant_id: Set(tenant_id.to_owned()),
        key_hash: Set(key_hash.to_owned()),
        prefix: Set(key_prefix.to_owned()),
        created_at: Set(at),
        revoked_at: Set(None),
    })
    .exec(db)
    .await?;
    Ok(())
}

pub(super) fn tenant(row: tenants::Model) -> Tenant {
    Tenant {
        id: row.id,
        name: row.name,
    }
}
