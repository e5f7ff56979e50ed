//! The conversation registry: starts a conversation actor on first use, and finds it while it
//! runs. A stopped conversation costs nothing here beyond a missing entry.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ractor::{ActorCell, ActorId, ActorRef, ActorStatus};
use tokio::sync::OnceCell;

use super::Handles;
use super::cancel::CancelOutcome;
use super::cancel::CancelSlot;
use super::messages::{Accepted, ConvMsg, ParentLink, SendError};
use crate::model::ConversationRecord;
use crate::state_machine::{IfBusy, ImageRef};
use crate::store::{Lease, Owner, StoreError};

/// A running conversation: its mailbox, its cancel path, and what never changes of it.
///
/// This is the one door into a conversation for the layers above the runtime (REST, the
/// WebSocket, SSE, MCP): they act on it through its methods, which answer in the runtime's
/// own errors, and never see the actor's mailbox or its messages.
#[derive(Clone, Debug)]
pub struct Live {
    pub(in crate::runtime) actor: ActorRef<ConvMsg>,
    pub cancel: Arc<CancelSlot>,
    pub fixed: Arc<Fixed>,
}

/// What a conversation keeps from its creation on: enough to act on it from the API
/// without reading its row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fixed {
    pub tenant_id: String,
    pub model: String,
    /// A user's conversation, not a sub-agent.
    pub top_level: bool,
}

impl From<&ConversationRecord> for Fixed {
    fn from(record: &ConversationRecord) -> Self {
        Fixed {
            tenant_id: record.tenant_id.clone(),
            model: record.model.clone(),
            top_level: record.parent_id.is_none(),
        }
    }
}

/// Why a conversation's actor gave no answer to a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unanswered {
    /// It did not answer within the call's time.
    #[error("the conversation did not answer in time")]
    Timeout,
    /// It stopped (idle, deleted, or on an error) before answering.
    #[error("the conversation stopped")]
    Stopped,
}

/// A user message for [`Live::send`].
#[derive(Clone, Debug)]
pub struct UserMessage {
    pub text: String,
    pub images: Vec<ImageRef>,
    pub client_message_id: Option<String>,
    pub if_busy: IfBusy,
}

impl Live {
    /// Sends a user message (REQ-BED-002): answered once it is stored, or refused.
    pub async fn send(
        &self,
        message: UserMessage,
        timeout: Duration,
    ) -> Result<Result<Accepted, SendError>, Unanswered> {
        let UserMessage {
            text,
            images,
            client_message_id,
            if_busy,
        } = message;
        self.call(
            |reply| ConvMsg::send(text, images, client_message_id, if_busy, reply),
            timeout,
        )
        .await
    }

    /// Takes back a message that waits in the running turn (`None`: every one); whether one
    /// did.
    pub async fn dequeue(&self, id: Option<String>, timeout: Duration) -> Result<bool, Unanswered> {
        self.call(|reply| ConvMsg::Dequeue(id, reply), timeout)
            .await
    }

    /// Asks for the summary a continuation starts from (issue 25): answered once the
    /// request for it is stored, or refused.
    pub async fn summarize(&self, timeout: Duration) -> Result<Result<(), SendError>, Unanswered> {
        self.call(ConvMsg::Summarize, timeout).await
    }

    /// Cancels the running turn through the cancel path, which wins over queued work
    /// (REQ-BED-004); the receiver gets what the cancel stopped.
    pub fn cancel_turn(&self) -> tokio::sync::oneshot::Receiver<CancelOutcome> {
        let answer = self.cancel.request();
        let _ = self.actor.cast(ConvMsg::Cancel);
        answer
    }

    /// Stops the conversation's work and its actor, waiting at most `timeout` (a deleted
    /// conversation).
    pub async fn stop(&self, reason: &str, timeout: Duration) {
        self.cancel.stop_work();
        let _ = self
            .actor
            .stop_and_wait(Some(reason.to_owned()), Some(timeout))
            .await;
    }

    /// Graceful stop: the turn is interrupted and stored (its running tools are killed and
    /// recorded as interrupted), then the actor stops.
    pub async fn shutdown(&self, grace: Duration) -> Result<(), Unanswered> {
        self.call(ConvMsg::shutdown, grace).await
    }

    /// The conversation as its actor holds it: as stored, every commit applied. `None` when
    /// the actor stopped or did not answer in time.
    pub async fn record(&self) -> Option<ConversationRecord> {
        self.call(ConvMsg::Record, Duration::from_secs(30))
            .await
            .ok()
    }

    async fn call<T: Send + 'static>(
        &self,
        message: impl FnOnce(ractor::RpcReplyPort<T>) -> ConvMsg,
        timeout: Duration,
    ) -> Result<T, Unanswered> {
        match self.actor.call(message, Some(timeout)).await {
            Ok(ractor::rpc::CallResult::Success(answer)) => Ok(answer),
            Ok(ractor::rpc::CallResult::Timeout) => Err(Unanswered::Timeout),
            Ok(ractor::rpc::CallResult::SenderError) | Err(_) => Err(Unanswered::Stopped),
        }
    }

    fn is_running(&self) -> bool {
        self.actor.get_status() <= ActorStatus::Running
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("no such conversation")]
    NotFound,
    /// Another live node holds its lease: the command goes there.
    #[error("the conversation runs on node {}", .0.node)]
    Elsewhere(Owner),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the conversation could not start: {0}")]
    Spawn(String),
}

type Slot = Arc<OnceCell<Live>>;

/// Starts a conversation's actor under `supervisor` (the runtime's root, or a sub-agent's
/// supervisor). The runtime gives it to the registry, which owns every start (sub-agents
/// included) without naming the actor it starts.
pub(crate) type Spawn =
    fn(
        Arc<Handles>,
        ConversationRecord,
        Arc<CancelSlot>,
        Option<ParentLink>,
        ActorCell,
        Option<i64>,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<ActorRef<ConvMsg>, String>> + Send>>;

#[derive(Debug)]
pub struct Registry {
    live: Mutex<HashMap<String, Slot>>,
    spawn: Spawn,
}

impl Registry {
    pub(crate) fn new(spawn: Spawn) -> Registry {
        Registry {
            live: Mutex::default(),
            spawn,
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The running actor of a conversation, started from its row if needed.
    pub(crate) async fn get_or_start(
        &self,
        handles: &Arc<Handles>,
        id: &str,
    ) -> Result<Live, StartError> {
        self.start(handles, id, None, None).await
    }

    /// [`get_or_start`](Self::get_or_start) with the row when it was just read or written:
    /// a conversation that runs no actor changes only through one, so its row is current.
    pub(crate) async fn start_from(
        &self,
        handles: &Arc<Handles>,
        record: ConversationRecord,
    ) -> Result<Live, StartError> {
        let id = record.id.clone();
        self.start(handles, &id, Some(record), None).await
    }

    /// [`start_from`](Self::start_from) for a conversation just written (created, forked or
    /// continued): nothing of it was committed yet, so its replay log starts at step 1
    /// without a read of its last stored step (a read that can find nothing, and on SQLite
    /// a round trip to a reader whose pages the writer has just changed).
    pub(crate) async fn start_created(
        &self,
        handles: &Arc<Handles>,
        record: ConversationRecord,
    ) -> Result<Live, StartError> {
        let id = record.id.clone();
        self.start(handles, &id, Some(record), Some(1)).await
    }

    async fn start(
        &self,
        handles: &Arc<Handles>,
        id: &str,
        known: Option<ConversationRecord>,
        next_step: Option<i64>,
    ) -> Result<Live, StartError> {
        // The row and the first step as the caller knows them hold only for the first try:
        // an actor found stopped ran meanwhile (it committed steps and changed the row), so
        // a start after it reads both.
        let mut given = Some((known, next_step));
        loop {
            let (known, next_step) = given.take().unwrap_or((None, None));
            let slot = self.map().entry(id.to_owned()).or_default().clone();
            let started = slot
                .get_or_try_init(|| async {
                    let record = claim(handles, id, known).await?;
                    self.spawned(handles, record, None, handles.lifecycle.root(), next_step)
                        .await
                })
                .await;
            match started {
                Ok(live) if live.is_running() => return Ok(live.clone()),
                // It stopped (idle, or killed with its supervisor): start it again.
                Ok(_) => self.remove_slot(id, &slot),
                Err(error) => {
                    self.remove_slot(id, &slot);
                    return Err(error);
                }
            }
        }
    }

    /// Starts a sub-agent's conversation, whose row its supervisor has just written, under
    /// that supervisor, which it reports to through `link`, and registers it.
    pub(crate) async fn start_child(
        &self,
        handles: &Arc<Handles>,
        id: &str,
        link: ParentLink,
    ) -> Result<Live, StartError> {
        let supervisor = link.supervisor.get_cell();
        let record = claim(handles, id, None).await?;
        // Its supervisor wrote its row just before: nothing of it was committed yet, so
        // its replay log starts at step 1 (as `start_created` says).
        let live = self
            .spawned(handles, record, Some(link), supervisor, Some(1))
            .await?;
        self.insert(id, live.clone());
        Ok(live)
    }

    async fn spawned(
        &self,
        handles: &Arc<Handles>,
        record: ConversationRecord,
        parent: Option<ParentLink>,
        supervisor: ActorCell,
        next_step: Option<i64>,
    ) -> Result<Live, StartError> {
        let cancel = Arc::new(CancelSlot::default());
        let fixed = Arc::new(Fixed::from(&record));
        let actor = (self.spawn)(
            handles.clone(),
            record,
            cancel.clone(),
            parent,
            supervisor,
            next_step,
        )
        .await
        .map_err(StartError::Spawn)?;
        Ok(Live {
            actor,
            cancel,
            fixed,
        })
    }

    /// Whether a conversation runs or is starting here.
    pub fn contains(&self, id: &str) -> bool {
        self.map().contains_key(id)
    }

    /// The running actor of a conversation, if it runs.
    pub fn get(&self, id: &str) -> Option<Live> {
        let slot = self.map().get(id).cloned()?;
        slot.get().filter(|live| live.is_running()).cloned()
    }

    /// Registers an actor started elsewhere (a sub-agent).
    pub fn insert(&self, id: &str, live: Live) {
        self.map()
            .insert(id.to_owned(), Arc::new(OnceCell::new_with(Some(live))));
    }

    /// Forgets a conversation's actor, if it is still the one registered.
    pub fn forget(&self, id: &str, actor: ActorId) {
        let mut map = self.map();
        if map
            .get(id)
            .and_then(|slot| slot.get())
            .is_some_and(|live| live.actor.get_id() == actor)
        {
            map.remove(id);
        }
    }

    fn remove_slot(&self, id: &str, slot: &Slot) {
        let mut map = self.map();
        if map
            .get(id)
            .is_some_and(|current| Arc::ptr_eq(current, slot))
        {
            map.remove(id);
        }
    }

    /// How many of `tenant`'s top-level conversations other than `except` run a turn now.
    pub fn running_turns(&self, tenant: &str, except: Option<&str>) -> u64 {
        self.map()
            .iter()
            .filter(|(id, _)| except != Some(id.as_str()))
            .filter_map(|(_, slot)| slot.get().filter(|l| l.is_running()))
            .filter(|live| {
                live.fixed.top_level
                    && live.fixed.tenant_id == tenant
                    && live.cancel.running_turn().is_some()
            })
            .count() as u64
    }

    /// Every running conversation.
    pub fn running(&self) -> Vec<(String, Live)> {
        self.map()
            .iter()
            .filter_map(|(id, slot)| {
                slot.get()
                    .filter(|l| l.is_running())
                    .map(|l| (id.clone(), l.clone()))
            })
            .collect()
    }

    pub fn len(&self) -> usize {
        self.map().len()
    }
}

/// A conversation to run here: its row (`known` when just read or written), and on a
/// cluster its lease, taken first so that nobody else writes for it from then on (the row
/// comes with it, as the lease found it). A lease taken from another holder (another node,
/// or this one before a restart) finds the work it left: a turn in flight is closed as a
/// restart closes it, its pending requests expire and its background tasks fail.
pub(super) async fn claim(
    handles: &Handles,
    id: &str,
    known: Option<ConversationRecord>,
) -> Result<ConversationRecord, StartError> {
    let Some(cluster) = &handles.cluster else {
        return match known {
            Some(record) => Ok(record),
            None => handles
                .store
                .conversation_by_id(id)
                .await?
                .ok_or(StartError::NotFound),
        };
    };
    let (mut record, previous) = match handles.store.take_lease(id, cluster.node()).await? {
        Lease::Taken { record, previous } => (*record, previous),
        Lease::Elsewhere(owner) => return Err(StartError::Elsewhere(owner)),
        Lease::Missing => return Err(StartError::NotFound),
    };
    // Epoch 1: nobody held it before (just created).
    let inherited = record.lease > Some(1) && previous.as_deref() != Some(&*cluster.incarnation);
    if inherited {
        super::recovery::repair(handles, &mut record).await?;
        handles
            .persistence
            .write(crate::persistence::WriteJob::ExpirePendingWork {
                at: chrono::Utc::now(),
                conversation: Some(id.to_owned()),
            })
            .await?;
    }
    Ok(record)
}
