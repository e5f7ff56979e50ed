//! The two unique keys that most rows leave empty (a message's client key, a frame's dedup
//! key) index only the rows that have one. Every commit inserts messages and frames, and a
//! full index gave each of them one more B-tree leaf to write for a NULL; uniqueness is the
//! same, since NULLs never collided.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Messages {
    Table,
    ConversationId,
    ClientMessageId,
}

#[derive(DeriveIden)]
enum ConversationEvents {
    Table,
    ConversationId,
    DedupKey,
}

const MESSAGES_KEY: &str = "messages_client_message_id";
const EVENTS_KEY: &str = "conversation_events_dedup";

fn messages_key(partial: bool) -> IndexCreateStatement {
    let mut index = Index::create()
        .name(MESSAGES_KEY)
        .table(Messages::Table)
        .col(Messages::ConversationId)
        .col(Messages::ClientMessageId)
        .unique()
        .to_owned();
    if partial {
        index.and_where(Expr::col(Messages::ClientMessageId).is_not_null());
    }
    index
}

fn events_key(partial: bool) -> IndexCreateStatement {
    let mut index = Index::create()
        .name(EVENTS_KEY)
        .table(ConversationEvents::Table)
        .col(ConversationEvents::ConversationId)
        .col(ConversationEvents::DedupKey)
        .unique()
        .to_owned();
    if partial {
        index.and_where(Expr::col(ConversationEvents::DedupKey).is_not_null());
    }
    index
}

/// Drops and creates each key in one round trip, so one connection does both: another
/// SQLite connection of the pool, its schema cache not yet reloaded, would still see the old
/// index and refuse to create the new one.
async fn replace(manager: &SchemaManager<'_>, partial: bool) -> Result<(), DbErr> {
    let backend = manager.get_database_backend();
    for (name, index) in [
        (MESSAGES_KEY, messages_key(partial)),
        (EVENTS_KEY, events_key(partial)),
    ] {
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
