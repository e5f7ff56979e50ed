//! Bedrock's database migrations, applied by `bedrock migrate` and at `bedrock serve` start.

pub use sea_orm_migration::prelude::*;

/// A migration that runs SQL statements per database, up and down, in one transaction on
/// SQLite too: all or nothing, and every statement on the same connection.
macro_rules! statements_migration {
    (up: ($sqlite_up:expr, $postgres_up:expr), down: ($sqlite_down:expr, $postgres_down:expr) $(,)?) => {
        #[async_trait::async_trait]
        impl MigrationTrait for Migration {
            fn use_transaction(&self) -> Option<bool> {
                Some(true)
            }

            async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
                crate::run_statements(manager, $sqlite_up, $postgres_up).await
            }

            async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
                crate::run_statements(manager, $sqlite_down, $postgres_down).await
            }
        }
    };
}

mod m20261121_000001_initial;
mod m20261121_000002_conversation_network;
mod m20261122_000003_partial_unique_keys;
mod m20261122_000004_commit_function;
mod m20261125_000005_compact_frames;
mod m20261125_000006_conversation_keys;
mod m20261125_000007_cluster;
mod m20261125_000008_forks;
mod m20261125_000009_budgets;
mod m20261125_000010_continuations;
mod m20261125_000011_mcp_servers;
mod m20261126_000012_tenant_quotas;
mod m20261127_000013_conversation_counts;
mod m20261127_000014_agents;
mod m20261127_000015_client_tools;
mod m20261127_000016_agent_hooks_limits;
mod m20261127_000017_webhooks;
mod m20261127_000018_schedules;
mod m20261128_000019_conversation_steps;
mod m20261128_000020_prune_indexes;
mod m20261128_000021_packed_rows;
mod m20261128_000022_delivery_listing;

/// Runs a migration's statements for the database at hand, in order, each error naming its
/// statement. SQLite and Postgres only.
pub(crate) async fn run_statements(
    manager: &SchemaManager<'_>,
    sqlite: &[&str],
    postgres: &[&str],
) -> Result<(), DbErr> {
    let backend = manager.get_database_backend();
    let statements = if backend == sea_orm::DbBackend::Sqlite {
        sqlite
    } else if backend == sea_orm::DbBackend::Postgres {
        postgres
    } else {
        return Err(DbErr::Migration(format!(
            "Bedrock runs on SQLite or Postgres, not {backend:?}"
        )));
    };
    let connection = manager.get_connection();
    for statement in statements {
        connection
            .execute_unprepared(statement)
            .await
            .map_err(|e| DbErr::Migration(format!("{statement}: {e}")))?;
    }
    Ok(())
}

/// Every migration, in order.
#[derive(Debug)]
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(m20261121_000001_initial::Migration),
            Box::new(m20261121_000002_conversation_network::Migration),
            Box::new(m20261122_000003_partial_unique_keys::Migration),
            Box::new(m20261122_000004_commit_function::Migration),
            Box::new(m20261125_000005_compact_frames::Migration),
            Box::new(m20261125_000006_conversation_keys::Migration),
            Box::new(m20261125_000007_cluster::Migration),
            Box::new(m20261125_000008_forks::Migration),
            Box::new(m20261125_000009_budgets::Migration),
            Box::new(m20261125_000010_continuations::Migration),
            Box::new(m20261125_000011_mcp_servers::Migration),
            Box::new(m20261126_000012_tenant_quotas::Migration),
            Box::new(m20261127_000013_conversation_counts::Migration),
            Box::new(m20261127_000014_agents::Migration),
            Box::new(m20261127_000015_client_tools::Migration),
            Box::new(m20261127_000016_agent_hooks_limits::Migration),
            Box::new(m20261127_000017_webhooks::Migration),
            Box::new(m20261127_000018_schedules::Migration),
            Box::new(m20261128_000019_conversation_steps::Migration),
            Box::new(m20261128_000020_prune_indexes::Migration),
            Box::new(m20261128_000021_packed_rows::Migration),
            Box::new(m20261128_000022_delivery_listing::Migration),
        ]
    }
}
