//! An attachment shown by a conversation that does not own it (a fork's copied messages).

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "attachment_shares")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub attachment_id: String,
    #[sea_orm(primary_key, auto_increment = false)]
    pub conversation_id: String,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
