//! The two unique keys that most rows leave empty (a message's client key, a frame's dedup
//! key) index only the rows that have one. Every commit inserts messages and frames, and a
//! full index gave each of them one more B-tree leaf to write for a NULL; uniqueness is the
//! same, since NULLs never collided.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden, Clone, Copy)]
enum Messages {
    Table,
    ConversationId,
    ClientMessageId,
}

#[derive(DeriveIden, Clone, Copy)]
enum ConversationEvents {
    Table,
    ConversationId,
    DedupKey,
}

/// A unique key on `(conversation_id, key)`, over the rows whose key is set when `partial`.
fn unique_key<T: Iden + Copy + 'static>(
    name: &str,
    table: T,
    conversation: T,
    key: T,
    partial: bool,
) -> IndexCreateStatement {
    let mut index = Index::create()
        .name(name)
        .table(table)
        .col(conversation)
        .col(key)
        .unique()
        .to_owned();
    if partial {
        index.and_where(Expr::col(key).is_not_null());
    }
    index
}

/// Drops and creates each key in one round trip, so one connection does both: another
/// SQLite connection of the pool, its schema cache not yet reloaded, would still see the old
/// index and refuse to create the new one.
async fn replace(manager: &SchemaManager<'_>, partial: bool) -> Result<(), DbErr> {
    let backend = manager.get_database_backend();
    let keys = [
        unique_key(
            "messages_client_message_id",
            Messages::Table,
            Messages::ConversationId,
            Messages::ClientMessageId,
            partial,
        ),
        unique_key(
            "conversation_events_dedup",
            ConversationEvents::Table,
            ConversationEvents::ConversationId,
            ConversationEvents::DedupKey,
            partial,
        ),
    ];
    for index in keys {
        let name = index
            .get_index_spec()
            .get_name()
            .unwrap_or_default()
            .to_owned();
        let drop = backend.build(&Index::drop().name(name).to_owned());
        let create = backend.build(&index);
        manager
            .get_connection()
            .execute_unprepared(&format!("{}; {}", drop.sql, create.sql))
            .await?;
    }
    Ok(())
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        replace(manager, true).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        replace(manager, false).await
    }
}
