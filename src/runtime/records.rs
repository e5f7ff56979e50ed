//! What the LLM gateway reads of a conversation beyond the history it holds (llm::Records):
//! the store's messages and images, handed to each LLM job.

use futures::future::BoxFuture;

use crate::model::MessageRecord;
use crate::store::Store;

/// The store, as the gateway's records.
#[derive(Clone, Debug)]
pub(crate) struct Stored(pub(crate) Store);

impl crate::llm::Records for Stored {
    fn messages_after<'a>(
        &'a self,
        conversation_id: &'a str,
        after: i64,
    ) -> BoxFuture<'a, Result<Vec<MessageRecord>, String>> {
        Box::pin(async move {
            self.0
                .messages_after(conversation_id, after, u64::MAX >> 1)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn image<'a>(
        &'a self,
        conversation_id: &'a str,
        image_id: &'a str,
    ) -> BoxFuture<'a, Option<(String, Vec<u8>)>> {
        Box::pin(async move {
            match self.0.attachment(conversation_id, image_id).await {
                Ok(Some(found)) => Some((found.media_type, found.data)),
                Ok(None) => None,
                Err(error) => {
                    tracing::warn!(%conversation_id, %image_id, %error, "an image of the history could not be read");
                    None
                }
            }
        })
    }
}
