//! Postgres: the function a group commit calls to check its guarded updates inside the
//! statement that writes them (see the store's `postgres` module). A check that fails raises
//! SQLSTATE `BR409`, and the whole statement, its inserts included, is undone. SQLite checks
//! its guards another way and gets nothing here.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const CREATE: &str = r#"
CREATE OR REPLACE FUNCTION bedrock_commit_guard(changed bigint, expected bigint)
RETURNS bigint LANGUAGE plpgsql AS $$
BEGIN
    IF changed <> expected THEN
        RAISE EXCEPTION '% of % conversations were deleted or changed by another writer',
            expected - changed, expected
            USING ERRCODE = 'BR409';
    END IF;
    RETURN changed;
END
$$
"#;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if manager.get_database_backend() == sea_orm::DbBackend::Postgres {
            manager.get_connection().execute_unprepared(CREATE).await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if manager.get_database_backend() == sea_orm::DbBackend::Postgres {
            manager
                .get_connection()
                .execute_unprepared("DROP FUNCTION IF EXISTS bedrock_commit_guard(bigint, bigint)")
                .await?;
        }
        Ok(())
    }
}
