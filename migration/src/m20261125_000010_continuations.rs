//! Context continuation (docs/api.md, "Context continuation"): a conversation started from
//! another's summary records where it came from.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const SQLITE_UP: &[&str] = &["ALTER TABLE conversations ADD COLUMN continued_from_id TEXT NULL"];
const POSTGRES_UP: &[&str] = &["ALTER TABLE conversations ADD COLUMN continued_from_id text NULL"];
const DOWN: &[&str] = &["ALTER TABLE conversations DROP COLUMN continued_from_id"];

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    fn use_transaction(&self) -> Option<bool> {
        Some(true)
    }

    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        crate::run_statements(manager, SQLITE_UP, POSTGRES_UP).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        crate::run_statements(manager, DOWN, DOWN).await
    }
}
