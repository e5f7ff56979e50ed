//! sea-orm entities of Bedrock's database, one module per table.
//!
//! Only the store (src/store) uses these types; everything above it works with the domain
//! records of src/model.rs.

pub mod api_keys;
pub mod attachment_shares;
pub mod attachments;
pub mod background_tasks;
pub mod client_requests;
pub mod client_tool_calls;
pub mod conversation_frames;
pub mod conversations;
pub mod messages;
pub mod tenants;
