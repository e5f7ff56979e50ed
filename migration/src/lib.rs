//! Bedrock's database migrations, applied by `bedrock migrate` and at `bedrock serve` start.

pub use sea_orm_migration::prelude::*;

mod m20261121_000001_initial;
mod m20261121_000002_conversation_network;
mod m20261122_000003_partial_unique_keys;
mod m20261122_000004_commit_function;
mod m20261125_000005_compact_frames;
mod m20261125_000006_conversation_keys;
mod m20261125_000007_cluster;

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
        ]
    }
}
