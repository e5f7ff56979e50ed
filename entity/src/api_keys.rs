//! API keys, stored as SHA-256 hashes only; the key itself is shown once at creation.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "api_keys")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub tenant_id: String,
    /// Hex SHA-256 of the whole key.
    #[sea_orm(unique)]
    pub key_hash: String,
    /// The key's first characters, to tell keys apart in listings.
    pub prefix: String,
    pub created_at: DateTimeUtc,
    pub revoked_at: Option<DateTimeUtc>,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
