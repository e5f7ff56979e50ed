//! The initial schema: tenants, keys, conversations, messages, durable events, attachments,
//! client requests and background tasks, with the indexes of the real queries.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Tenants {
    Table,
    Id,
    Name,
    CreatedAt,
}

#[derive(DeriveIden)]
enum ApiKeys {
    Table,
    Id,
    TenantId,
    KeyHash,
    Prefix,
    CreatedAt,
    RevokedAt,
}

#[derive(DeriveIden)]
enum Conversations {
    Table,
    Id,
    TenantId,
    Slug,
    Cwd,
    Model,
    SystemPrompt,
    ParentConversationId,
    UserInitiated,
    RequireApproval,
    State,
    StateData,
    StateUpdatedAt,
    CreatedAt,
    UpdatedAt,
    Archived,
    InputTokens,
    OutputTokens,
    ContextTokens,
    NextSequenceId,
    NextEventId,
}

#[derive(DeriveIden)]
enum Messages {
    Table,
    Id,
    ConversationId,
    SequenceId,
    MessageType,
    Content,
    UsageData,
    ClientMessageId,
    CreatedAt,
}

#[derive(DeriveIden)]
enum ConversationEvents {
    Table,
    ConversationId,
    EventId,
    EventType,
    Payload,
    DedupKey,
    CreatedAt,
}

#[derive(DeriveIden)]
enum Attachments {
    Table,
    Id,
    TenantId,
    ConversationId,
    MediaType,
    Data,
    Width,
    Height,
    CreatedAt,
}

#[derive(DeriveIden)]
enum ClientRequests {
    Table,
    Id,
    ConversationId,
    ToolUseId,
    RequestType,
    Status,
    Response,
    TimeoutMs,
    ExpiresAt,
    CreatedAt,
    ResolvedAt,
}

#[derive(DeriveIden)]
enum BackgroundTasks {
    Table,
    Id,
    ConversationId,
    ToolUseId,
    ToolName,
    Command,
    Status,
    Output,
    ExitCode,
    Wake,
    CreatedAt,
    FinishedAt,
}

/// A foreign key to `conversations.id` that deletes the row with its conversation.
fn conversation_fk<T: IntoIden + 'static>(table: T, column: T) -> ForeignKeyCreateStatement {
    ForeignKey::create()
        .from(table, column)
        .to(Conversations::Table, Conversations::Id)
        .on_delete(ForeignKeyAction::Cascade)
        .to_owned()
}

fn tenant_fk<T: IntoIden + 'static>(table: T, column: T) -> ForeignKeyCreateStatement {
    ForeignKey::create()
        .from(table, column)
        .to(Tenants::Table, Tenants::Id)
        .on_delete(ForeignKeyAction::Cascade)
        .to_owned()
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Tenants::Table)
                    .col(string(Tenants::Id).primary_key())
                    .col(string_uniq(Tenants::Name))
                    .col(timestamp_with_time_zone(Tenants::CreatedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(ApiKeys::Table)
                    .col(string(ApiKeys::Id).primary_key())
                    .col(string(ApiKeys::TenantId))
                    .col(string_uniq(ApiKeys::KeyHash))
                    .col(string(ApiKeys::Prefix))
                    .col(timestamp_with_time_zone(ApiKeys::CreatedAt))
                    .col(timestamp_with_time_zone_null(ApiKeys::RevokedAt))
                    .foreign_key(&mut tenant_fk(ApiKeys::Table, ApiKeys::TenantId))
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(Conversations::Table)
                    .col(string(Conversations::Id).primary_key())
                    .col(string(Conversations::TenantId))
                    .col(string(Conversations::Slug))
                    .col(text(Conversations::Cwd))
                    .col(string(Conversations::Model))
                    .col(text_null(Conversations::SystemPrompt))
                    .col(string_null(Conversations::ParentConversationId))
                    .col(boolean(Conversations::UserInitiated))
                    .col(json(Conversations::RequireApproval))
                    .col(string(Conversations::State))
                    .col(json(Conversations::StateData))
                    .col(timestamp_with_time_zone(Conversations::StateUpdatedAt))
                    .col(timestamp_with_time_zone(Conversations::CreatedAt))
                    .col(timestamp_with_time_zone(Conversations::UpdatedAt))
                    .col(boolean(Conversations::Archived).default(false))
                    .col(big_integer(Conversations::InputTokens).default(0))
                    .col(big_integer(Conversations::OutputTokens).default(0))
                    .col(big_integer(Conversations::ContextTokens).default(0))
                    .col(big_integer(Conversations::NextSequenceId).default(1))
                    .col(big_integer(Conversations::NextEventId).default(1))
                    .foreign_key(&mut tenant_fk(
                        Conversations::Table,
                        Conversations::TenantId,
                    ))
                    .foreign_key(&mut conversation_fk(
                        Conversations::Table,
                        Conversations::ParentConversationId,
                    ))
                    .to_owned(),
            )
            .await?;
        // Listing a tenant's user-initiated conversations, newest first (ids are UUIDv7, so
        // they sort by creation time and make a stable cursor).
        manager
            .create_index(
                Index::create()
                    .name("conversations_tenant_listing")
                    .table(Conversations::Table)
                    .col(Conversations::TenantId)
                    .col(Conversations::UserInitiated)
                    .col(Conversations::Archived)
                    .col((Conversations::Id, IndexOrder::Desc))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("conversations_tenant_slug")
                    .table(Conversations::Table)
                    .col(Conversations::TenantId)
                    .col(Conversations::Slug)
                    .unique()
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("conversations_parent")
                    .table(Conversations::Table)
                    .col(Conversations::ParentConversationId)
                    .to_owned(),
            )
            .await?;
        // Every transition updates its conversation's row. No index covers the columns it
        // changes (restart recovery scans once at start instead of indexing `state`), and on
        // Postgres the pages keep room for the new version, so those updates stay on-page
        // (HOT) instead of bloating the table and its indexes.
        if manager.get_database_backend() == sea_orm::DbBackend::Postgres {
            manager
                .get_connection()
                .execute_unprepared("ALTER TABLE conversations SET (fillfactor = 70)")
                .await?;
        }

        manager
            .create_table(
                Table::create()
                    .table(Messages::Table)
                    .col(string(Messages::Id).primary_key())
                    .col(string(Messages::ConversationId))
                    .col(big_integer(Messages::SequenceId))
                    .col(string(Messages::MessageType))
                    .col(json(Messages::Content))
                    .col(json_null(Messages::UsageData))
                    .col(string_null(Messages::ClientMessageId))
                    .col(timestamp_with_time_zone(Messages::CreatedAt))
                    .foreign_key(&mut conversation_fk(
                        Messages::Table,
                        Messages::ConversationId,
                    ))
                    .to_owned(),
            )
            .await?;
        // Messages after a sequence id; also guarantees no sequence id is used twice.
        manager
            .create_index(
                Index::create()
                    .name("messages_conversation_sequence")
                    .table(Messages::Table)
                    .col(Messages::ConversationId)
                    .col(Messages::SequenceId)
                    .unique()
                    .to_owned(),
            )
            .await?;
        // Idempotent sends: one message per client key (NULLs do not collide).
        manager
            .create_index(
                Index::create()
                    .name("messages_client_message_id")
                    .table(Messages::Table)
                    .col(Messages::ConversationId)
                    .col(Messages::ClientMessageId)
                    .unique()
                    .to_owned(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(ConversationEvents::Table)
                    .col(string(ConversationEvents::ConversationId))
                    .col(big_integer(ConversationEvents::EventId))
                    .col(string(ConversationEvents::EventType))
                    .col(json(ConversationEvents::Payload))
                    .col(string_null(ConversationEvents::DedupKey))
                    .col(timestamp_with_time_zone(ConversationEvents::CreatedAt))
                    // Events after an event id: the primary key's order.
                    .primary_key(
                        Index::create()
                            .col(ConversationEvents::ConversationId)
                            .col(ConversationEvents::EventId),
                    )
                    .foreign_key(&mut conversation_fk(
                        ConversationEvents::Table,
                        ConversationEvents::ConversationId,
                    ))
                    .to_owned(),
            )
            .await?;

        manager
            .create_index(
                Index::create()
                    .name("conversation_events_dedup")
                    .table(ConversationEvents::Table)
                    .col(ConversationEvents::ConversationId)
                    .col(ConversationEvents::DedupKey)
                    .unique()
                    .to_owned(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Attachments::Table)
                    .col(string(Attachments::Id).primary_key())
                    .col(string(Attachments::TenantId))
                    .col(string(Attachments::ConversationId))
                    .col(string(Attachments::MediaType))
                    .col(blob(Attachments::Data))
                    .col(integer(Attachments::Width))
                    .col(integer(Attachments::Height))
                    .col(timestamp_with_time_zone(Attachments::CreatedAt))
                    .foreign_key(&mut conversation_fk(
                        Attachments::Table,
                        Attachments::ConversationId,
                    ))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("attachments_conversation")
                    .table(Attachments::Table)
                    .col(Attachments::ConversationId)
                    .to_owned(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(ClientRequests::Table)
                    .col(string(ClientRequests::Id).primary_key())
                    .col(string(ClientRequests::ConversationId))
                    .col(string_null(ClientRequests::ToolUseId))
                    .col(json(ClientRequests::RequestType))
                    .col(string(ClientRequests::Status))
                    .col(json_null(ClientRequests::Response))
                    .col(big_integer(ClientRequests::TimeoutMs))
                    .col(timestamp_with_time_zone(ClientRequests::ExpiresAt))
                    .col(timestamp_with_time_zone(ClientRequests::CreatedAt))
                    .col(timestamp_with_time_zone_null(ClientRequests::ResolvedAt))
                    .foreign_key(&mut conversation_fk(
                        ClientRequests::Table,
                        ClientRequests::ConversationId,
                    ))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("client_requests_conversation_status")
                    .table(ClientRequests::Table)
                    .col(ClientRequests::ConversationId)
                    .col(ClientRequests::Status)
                    .to_owned(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(BackgroundTasks::Table)
                    .col(string(BackgroundTasks::Id).primary_key())
                    .col(string(BackgroundTasks::ConversationId))
                    .col(string(BackgroundTasks::ToolUseId))
                    .col(string(BackgroundTasks::ToolName))
                    .col(text(BackgroundTasks::Command))
                    .col(string(BackgroundTasks::Status))
                    .col(text_null(BackgroundTasks::Output))
                    .col(integer_null(BackgroundTasks::ExitCode))
                    .col(boolean(BackgroundTasks::Wake).default(false))
                    .col(timestamp_with_time_zone(BackgroundTasks::CreatedAt))
                    .col(timestamp_with_time_zone_null(BackgroundTasks::FinishedAt))
                    .foreign_key(&mut conversation_fk(
                        BackgroundTasks::Table,
                        BackgroundTasks::ConversationId,
                    ))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("background_tasks_conversation_status")
                    .table(BackgroundTasks::Table)
                    .col(BackgroundTasks::ConversationId)
                    .col(BackgroundTasks::Status)
                    .to_owned(),
            )
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in [
            BackgroundTasks::Table.into_iden(),
            ClientRequests::Table.into_iden(),
            Attachments::Table.into_iden(),
            ConversationEvents::Table.into_iden(),
            Messages::Table.into_iden(),
            Conversations::Table.into_iden(),
            ApiKeys::Table.into_iden(),
            Tenants::Table.into_iden(),
        ] {
            manager
                .drop_table(Table::drop().table(table).to_owned())
                .await?;
        }
        Ok(())
    }
}
