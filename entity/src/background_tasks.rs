//! Long-running tool runs (bash with `background: true`).

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "background_tasks")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub conversation_id: String,
    pub tool_use_id: String,
    pub tool_name: String,
    pub command: String,
    /// `running`, `completed`, `failed` or `cancelled`.
    pub status: String,
    pub output: Option<String>,
    pub exit_code: Option<i32>,
    pub wake: bool,
    pub created_at: DateTimeUtc,
    pub finished_at: Option<DateTimeUtc>,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
