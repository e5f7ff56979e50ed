//! Tenants' webhooks (docs/api.md, "Webhooks"; issue 39): a backend with no open socket is
//! told when a turn ends, a request waits or a budget is spent.
//!
//! An event's deliveries, one per subscribed endpoint, are written in the transaction of
//! the change that caused it: a turn's end with the conversation's commit
//! (runtime/conversation.rs), a request to the client with its row. Only tenants with an
//! enabled endpoint write them ([`Subscribers`], read without I/O on the commit path). Most
//! are handed to this node's dispatcher (dispatch.rs) as soon as they are stored; the rest
//! (a conversation's delivery waiting behind an undone one, a retry, a dead node's) it
//! claims. It sends each signed as Standard Webhooks sign, under the egress policy, retrying
//! with backoff until it is answered with a 2xx or runs out.

mod dispatch;

pub use dispatch::{Dispatcher, retry_delay_ms};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use base64::Engine as _;
use chrono::{DateTime, Utc};
use hmac::{Hmac, Mac};
use serde_json::json;

use crate::model::{NewDelivery, Webhook, WebhookDelivery, WebhookEvent};
use crate::state_machine::{ErrorKind, TurnEnd, TurnOutcome};
use crate::store::Store;

/// The events an endpoint may subscribe to.
pub const EVENTS: [&str; 6] = [
    TURN_COMPLETED,
    TURN_FAILED,
    TURN_CANCELLED,
    REQUEST_CREATED,
    CONTEXT_EXHAUSTED,
    BUDGET_EXHAUSTED,
];
pub const TURN_COMPLETED: &str = "turn.completed";
pub const TURN_FAILED: &str = "turn.failed";
pub const TURN_CANCELLED: &str = "turn.cancelled";
pub const REQUEST_CREATED: &str = "request.created";
pub const CONTEXT_EXHAUSTED: &str = "conversation.context_exhausted";
pub const BUDGET_EXHAUSTED: &str = "budget.exhausted";

/// The most of an error's message an event carries.
const MAX_MESSAGE_BYTES: usize = 1000;

/// An endpoint and a conversation: a conversation's deliveries to an endpoint go out one
/// at a time, in the order of its events.
type Pair = (String, String);

/// What a node knows of its tenants' webhooks, read without I/O on the commit path: the
/// enabled endpoints (read again every second by the dispatcher, and at once when an
/// endpoint changes on this node), and which (endpoint, conversation) pairs have a delivery
/// not done.
///
/// An event's delivery is written with the change that caused it. When its pair has no
/// undone delivery but those handed to this node's dispatcher, it is written claimed by the
/// dispatcher and handed to it once stored: the dispatcher sends a pair's handed deliveries
/// one after another, in order, without a claim's transaction or read. Otherwise (a
/// delivery of the pair failed and waits for its retry, or is another node's, or was
/// written unclaimed) it is written unclaimed, and the dispatcher claims it when the ones
/// before it are done (the claim takes a pair's first undone delivery only). When a handed
/// delivery fails, those of its pair handed after it are released to the claim. A delivery
/// handed out but never sent (the process died) is claimed by any node when its claim runs
/// out.
#[derive(Debug)]
pub struct Subscribers {
    known: Mutex<Known>,
    /// Deliveries were stored or one is due: the dispatcher looks now.
    wake: tokio::sync::Notify,
    /// Deliveries were stored unclaimed (or one was retried by hand): the next cycle claims.
    claim: AtomicBool,
    /// The claim of deliveries handed to this node's dispatcher as they are stored.
    direct_claimer: String,
    claim_ms: i64,
    retry_for_ms: i64,
}

#[derive(Debug, Default)]
struct Known {
    /// Each tenant's enabled endpoints.
    hooks: HashMap<String, Vec<Arc<Webhook>>>,
    /// Pairs with unclaimed deliveries written in a transaction not yet done.
    unconfirmed: HashMap<Pair, u32>,
    /// Pairs with stored deliveries not done, as last read, and those marked since: the
    /// generation they were marked in ([`Subscribers::refresh`] keeps those marked while it
    /// read).
    pending: HashMap<Pair, u64>,
    generation: u64,
    /// Pairs with a delivery that may be stored under this node's direct claim but will not
    /// be sent by it (its write's outcome is not known, its endpoint went): until its claim
    /// runs out (the pending pairs as read leave out this node's direct claims).
    orphaned: HashMap<Pair, i64>,
    /// Tenants whose endpoints were read alone (after a change on this node), and the
    /// generation they were read in: a read of all of them begun before keeps theirs.
    read_alone: HashMap<String, u64>,
    /// Stored deliveries handed to the dispatcher, with their endpoints.
    handed: Vec<(WebhookDelivery, Arc<Webhook>)>,
}

impl Known {
    fn busy(&self, pair: &Pair) -> bool {
        self.unconfirmed.contains_key(pair)
            || self.pending.contains_key(pair)
            || self.orphaned.contains_key(pair)
    }

    /// The tenant's enabled endpoints are `hooks` (none: it is not known at all).
    fn set_hooks(&mut self, tenant_id: String, hooks: Vec<Arc<Webhook>>) {
        if hooks.is_empty() {
            self.hooks.remove(&tenant_id);
        } else {
            self.hooks.insert(tenant_id, hooks);
        }
    }

    fn mark_pending(&mut self, pair: Pair) {
        let generation = self.generation;
        self.pending.insert(pair, generation);
    }
}

/// Takes one from `counts[pair]`, removing it at zero.
fn release(counts: &mut HashMap<Pair, u32>, pair: &Pair) {
    if let Some(n) = counts.get_mut(pair) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            counts.remove(pair);
        }
    }
}

impl Subscribers {
    /// The endpoints and pending pairs as stored; `node` names this node's claims.
    pub async fn load(
        store: &Store,
        settings: &crate::config::WebhookSettings,
        node: &str,
    ) -> crate::store::Result<Subscribers> {
        let subscribers = Subscribers {
            known: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            claim: AtomicBool::new(true),
            direct_claimer: format!("{node}/{}/direct", uuid::Uuid::now_v7().simple()),
            claim_ms: i64::try_from(settings.claim_ms).unwrap_or(i64::MAX),
            retry_for_ms: i64::try_from(settings.retry_for_ms).unwrap_or(i64::MAX),
        };
        subscribers.refresh(store).await?;
        Ok(subscribers)
    }

    fn known(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Reads the enabled endpoints and the pending pairs again. A pair marked while it read
    /// stays marked (its delivery may have been stored after the read began).
    pub async fn refresh(&self, store: &Store) -> crate::store::Result<()> {
        let began = {
            let mut known = self.known();
            known.generation += 1;
            known.generation
        };
        let hooks = store.enabled_webhooks().await?;
        let pending = store.pending_pairs(&self.direct_claimer).await?;
        let mut by_tenant: HashMap<String, Vec<Arc<Webhook>>> = HashMap::new();
        for hook in hooks {
            by_tenant
                .entry(hook.tenant_id.clone())
                .or_default()
                .push(Arc::new(hook));
        }
        let mut known = self.known();
        let kept: Vec<(String, Option<Vec<Arc<Webhook>>>)> = known
            .read_alone
            .iter()
            .filter(|(_, read)| **read >= began)
            .map(|(tenant, _)| (tenant.clone(), known.hooks.get(tenant).cloned()))
            .collect();
        known.hooks = by_tenant;
        for (tenant, hooks) in kept {
            known.set_hooks(tenant, hooks.unwrap_or_default());
        }
        known.read_alone.retain(|_, read| *read >= began);
        known.pending.retain(|_, marked| *marked >= began);
        let now = Utc::now().timestamp_millis();
        known.orphaned.retain(|_, until| *until > now);
        for pair in pending {
            known.pending.entry(pair).or_insert(0);
        }
        Ok(())
    }

    /// Reads one tenant's endpoints again, after a change to them on this node: its next
    /// event goes by them at once. Only that tenant's rows are read, so a tenant's flood of
    /// changes reads nothing of any other's.
    pub async fn refresh_tenant(&self, store: &Store, tenant_id: &str) -> crate::store::Result<()> {
        let hooks: Vec<Arc<Webhook>> = store
            .webhooks(tenant_id)
            .await?
            .into_iter()
            .filter(|hook| hook.enabled)
            .map(Arc::new)
            .collect();
        let mut known = self.known();
        let generation = known.generation;
        known.read_alone.insert(tenant_id.to_owned(), generation);
        known.set_hooks(tenant_id.to_owned(), hooks);
        Ok(())
    }

    /// Whether the tenant has an enabled endpoint.
    pub fn has(&self, tenant_id: &str) -> bool {
        self.known().hooks.contains_key(tenant_id)
    }

    /// No tenant has an enabled endpoint.
    pub fn is_empty(&self) -> bool {
        self.known().hooks.is_empty()
    }

    /// The claim under which deliveries are handed to the dispatcher as they are stored.
    pub(crate) fn direct_claimer(&self) -> &str {
        &self.direct_claimer
    }

    /// The deliveries of `events`: one per enabled endpoint of the event's tenant subscribed
    /// to its type, to be written with the change that caused them; then [`stored`] or
    /// [`not_stored`].
    ///
    /// [`stored`]: Self::stored
    /// [`not_stored`]: Self::not_stored
    pub fn deliveries(&self, events: Vec<WebhookEvent>) -> Vec<NewDelivery> {
        let mut known = self.known();
        let mut deliveries = Vec::new();
        for event in events {
            let Some(hooks) = known.hooks.get(&event.tenant_id) else {
                continue;
            };
            let hooks: Vec<String> = hooks
                .iter()
                .filter(|hook| hook.events.iter().any(|e| e == event.event_type))
                .map(|hook| hook.id.clone())
                .collect();
            let created_at = event.at.timestamp_millis();
            for webhook_id in hooks {
                let pair = (webhook_id.clone(), event.conversation_id.clone());
                let claimed = if known.busy(&pair) {
                    *known.unconfirmed.entry(pair).or_default() += 1;
                    None
                } else {
                    Some((
                        self.direct_claimer.clone(),
                        created_at.saturating_add(self.claim_ms),
                    ))
                };
                deliveries.push(NewDelivery {
                    id: format!("msg_{}", uuid::Uuid::now_v7().simple()),
                    webhook_id,
                    tenant_id: event.tenant_id.clone(),
                    conversation_id: event.conversation_id.clone(),
                    event_seq: next_seq(),
                    event_type: event.event_type,
                    payload: event.payload.clone(),
                    created_at,
                    expires_at: created_at.saturating_add(self.retry_for_ms),
                    claimed,
                });
            }
        }
        deliveries
    }

    /// `deliveries` were stored: those claimed go to the dispatcher now, the others are
    /// claimed by its next cycle.
    pub fn stored(&self, deliveries: &[NewDelivery]) {
        if deliveries.is_empty() {
            return;
        }
        let mut known = self.known();
        let mut claim = false;
        for delivery in deliveries {
            let pair = (
                delivery.webhook_id.clone(),
                delivery.conversation_id.clone(),
            );
            if delivery.claimed.is_none() {
                release(&mut known.unconfirmed, &pair);
                known.mark_pending(pair);
                claim = true;
                continue;
            }
            let hook = known.hooks.get(&delivery.tenant_id).and_then(|hooks| {
                hooks
                    .iter()
                    .find(|hook| hook.id == delivery.webhook_id)
                    .cloned()
            });
            let Some(hook) = hook else {
                // Disabled or removed since: if it was written, its claim runs out and the
                // dispatcher's claim finds that its endpoint is not enabled.
                known
                    .orphaned
                    .insert(pair, delivery.claimed.as_ref().map_or(0, |c| c.1));
                continue;
            };
            known.handed.push((handed(delivery), hook));
        }
        drop(known);
        if claim {
            self.claim.store(true, Ordering::Release);
        }
        self.wake.notify_one();
    }

    /// `deliveries` were not stored, or it is not known whether they were: none is sent now;
    /// whatever was stored of them is claimed once its claim runs out.
    pub fn not_stored(&self, deliveries: &[NewDelivery]) {
        let mut known = self.known();
        for delivery in deliveries {
            let pair = (
                delivery.webhook_id.clone(),
                delivery.conversation_id.clone(),
            );
            match &delivery.claimed {
                Some((_, until)) => {
                    known.orphaned.insert(pair, *until);
                }
                None => {
                    release(&mut known.unconfirmed, &pair);
                    known.mark_pending(pair);
                }
            }
        }
    }

    /// The deliveries handed over since the last call.
    pub(crate) fn take_handed(&self) -> Vec<(WebhookDelivery, Arc<Webhook>)> {
        std::mem::take(&mut self.known().handed)
    }

    /// A handed delivery failed: its pair's next deliveries wait for the claim (behind its
    /// retry) until it is done.
    pub(crate) fn failed(&self, webhook_id: &str, conversation_id: &str) {
        let mut known = self.known();
        let pair = (webhook_id.to_owned(), conversation_id.to_owned());
        // Marked through the next read too: that read may come before the write of the
        // result (until then the row is under this node's direct claim, which the read
        // leaves out).
        let generation = known.generation.saturating_add(1);
        known.pending.insert(pair, generation);
    }

    /// Whether deliveries of the pair wait for the claim: those handed over for it are
    /// released to it (and a claim may find some behind one just attempted).
    pub(crate) fn waits_behind(&self, webhook_id: &str, conversation_id: &str) -> bool {
        let known = self.known();
        let pair = (webhook_id.to_owned(), conversation_id.to_owned());
        known.pending.contains_key(&pair) || known.unconfirmed.contains_key(&pair)
    }

    /// An endpoint was disabled by this node: nothing more is written for it.
    pub(crate) fn forget(&self, webhook_id: &str) {
        let mut known = self.known();
        for hooks in known.hooks.values_mut() {
            hooks.retain(|hook| hook.id != webhook_id);
        }
        known.hooks.retain(|_, hooks| !hooks.is_empty());
    }

    /// Deliveries are due (stored unclaimed, retried by hand): the dispatcher claims now.
    pub fn wake(&self) {
        self.claim.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// Whether a claim was asked for since the last call.
    pub(crate) fn take_claim(&self) -> bool {
        self.claim.swap(false, Ordering::AcqRel)
    }

    pub(crate) async fn woken(&self) {
        self.wake.notified().await;
    }
}

/// A stored delivery as the dispatcher sends it.
fn handed(delivery: &NewDelivery) -> WebhookDelivery {
    WebhookDelivery {
        id: delivery.id.clone(),
        webhook_id: delivery.webhook_id.clone(),
        tenant_id: delivery.tenant_id.clone(),
        conversation_id: delivery.conversation_id.clone(),
        event_seq: delivery.event_seq,
        event_type: delivery.event_type.to_owned(),
        payload: delivery.payload.clone(),
        status: "pending".to_owned(),
        attempts: 0,
        next_attempt_at: delivery.created_at,
        expires_at: delivery.expires_at,
        last_status: None,
        last_error: None,
        last_latency_ms: None,
        attempts_log: "[]".to_owned(),
        created_at: delivery.created_at,
        updated_at: delivery.created_at,
    }
}

/// The next event's place among a conversation's: microseconds since the Unix epoch, more
/// than the last one this process gave. A conversation moves to another node only after its
/// owner has been gone for longer than its lease (seconds), far more than the clocks of a
/// cluster's nodes differ by.
pub fn next_seq() -> i64 {
    static LAST: AtomicI64 = AtomicI64::new(0);
    let now = Utc::now().timestamp_micros();
    let mut last = LAST.load(Ordering::Relaxed);
    loop {
        let next = now.max(last.saturating_add(1));
        match LAST.compare_exchange_weak(last, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return next,
            Err(seen) => last = seen,
        }
    }
}

/// The events of a turn's end: its outcome, and a spent budget or an exhausted context
/// besides. `event_id` is the conversation's last durable frame once the end is stored (a
/// client resumes its stream after it).
pub fn turn_events(
    tenant_id: &str,
    conversation_id: &str,
    end: &TurnEnd,
    event_id: i64,
    at: DateTime<Utc>,
) -> Vec<WebhookEvent> {
    let mut data = json!({
        "conversation_id": conversation_id,
        "turn_id": end.turn.0,
        "event_id": event_id,
    });
    let event = |event_type: &'static str, data: &serde_json::Value| WebhookEvent {
        tenant_id: tenant_id.to_owned(),
        conversation_id: conversation_id.to_owned(),
        event_type,
        payload: data.to_string(),
        at,
    };
    match &end.outcome {
        TurnOutcome::Completed => {
            data["state"] = json!("idle");
            vec![event(TURN_COMPLETED, &data)]
        }
        TurnOutcome::Cancelled => {
            data["state"] = json!("idle");
            vec![event(TURN_CANCELLED, &data)]
        }
        TurnOutcome::ContextExhausted => {
            data["state"] = json!("context_exhausted");
            vec![
                event(TURN_COMPLETED, &data),
                event(CONTEXT_EXHAUSTED, &data),
            ]
        }
        TurnOutcome::Failed {
            error_kind,
            message,
        } => {
            data["state"] = json!("error");
            data["error_kind"] = serde_json::to_value(error_kind).unwrap_or_default();
            data["message"] = json!(crate::tools::preview(message, MAX_MESSAGE_BYTES));
            let mut events = vec![event(TURN_FAILED, &data)];
            if *error_kind == ErrorKind::Budget {
                events.push(event(BUDGET_EXHAUSTED, &data));
            }
            events
        }
    }
}

/// The event of a request to the client (an approval, a question, a client tool's call):
/// `kind` is its type (`confirm`, `prompt`, `select`, `custom`, `client_tool`).
pub fn request_created(
    tenant_id: &str,
    conversation_id: &str,
    request_id: &str,
    kind: &str,
    tool_use_id: &str,
    at: DateTime<Utc>,
) -> WebhookEvent {
    WebhookEvent {
        tenant_id: tenant_id.to_owned(),
        conversation_id: conversation_id.to_owned(),
        event_type: REQUEST_CREATED,
        payload: json!({
            "conversation_id": conversation_id,
            "request_id": request_id,
            "kind": kind,
            "tool_use_id": tool_use_id,
        })
        .to_string(),
        at,
    }
}

/// A new signing secret: `whsec_` and the base64 of 32 random bytes (Standard Webhooks'
/// form).
pub fn new_secret() -> String {
    let key: [u8; 32] = rand::random();
    format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(key)
    )
}

/// The HMAC key of a secret: a Standard Webhooks `whsec_` secret's base64 (at least 16
/// bytes of key), or the secret's bytes. `None` for a `whsec_` secret that is not base64
/// or holds less.
pub fn hook_key(secret: &str) -> Option<Vec<u8>> {
    match secret.strip_prefix("whsec_") {
        Some(encoded) => base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .ok()
            .filter(|key| key.len() >= 16),
        None => Some(secret.as_bytes().to_vec()),
    }
}

/// The `webhook-signature` of `body` sent as message `id` at `timestamp` (seconds).
pub fn signature(key: &[u8], id: &str, timestamp: i64, body: &[u8]) -> String {
    let Ok(mut mac) = Hmac::<sha2::Sha256>::new_from_slice(key) else {
        return String::new();
    };
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state_machine::TurnId;

    /// An enabled endpoint of `tenant` for `events` (also the dispatcher's tests').
    pub(super) fn hook(id: &str, tenant: &str, events: &[&str]) -> Webhook {
        Webhook {
            id: id.into(),
            tenant_id: tenant.into(),
            url: "http://127.0.0.1:9/".into(),
            events: events.iter().map(|e| (*e).to_owned()).collect(),
            description: None,
            enabled: true,
            disabled_reason: None,
            secret: new_secret().into(),
            previous_secret: None,
            previous_secret_until: None,
            failing_since: None,
            created_at: 1,
            updated_at: 1,
        }
    }

    fn subscribers(hooks: Vec<Webhook>) -> Subscribers {
        let subscribers = Subscribers {
            known: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            claim: AtomicBool::new(false),
            direct_claimer: "n/1/direct".into(),
            claim_ms: 60_000,
            retry_for_ms: 86_400_000,
        };
        for hook in hooks {
            subscribers
                .known()
                .hooks
                .entry(hook.tenant_id.clone())
                .or_default()
                .push(Arc::new(hook));
        }
        subscribers
    }

    fn completed(tenant: &str, conversation: &str) -> WebhookEvent {
        WebhookEvent {
            tenant_id: tenant.into(),
            conversation_id: conversation.into(),
            event_type: TURN_COMPLETED,
            payload: "{}".into(),
            at: DateTime::from_timestamp(1_800_000_000, 0).expect("a time"),
        }
    }

    /// A conversation's delivery to an endpoint is handed to the dispatcher as it is stored
    /// (which sends a pair's one at a time, in order) unless the pair has an undone delivery
    /// the dispatcher does not hold: a failed one waiting for its retry, one written
    /// unclaimed, one of unknown fate. Then it waits for the claim (which takes a pair's first
    /// undone one only), so the pair's deliveries keep the order of its events.
    #[test]
    fn a_delivery_is_handed_over_only_behind_nothing_undone_elsewhere() {
        let subs = subscribers(vec![
            hook("wh_a", "t", &[TURN_COMPLETED]),
            hook("wh_b", "t", &[TURN_FAILED]),
            hook("wh_x", "other", &[TURN_COMPLETED]),
        ]);
        let direct = |d: &NewDelivery| d.claimed.is_some();
        // Only the tenant's endpoints subscribed to the event: one delivery.
        let first = subs.deliveries(vec![completed("t", "c1")]);
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].webhook_id, "wh_a");
        assert!(direct(&first[0]));
        assert_eq!(
            first[0].claimed.as_ref().map(|c| c.0.as_str()),
            Some("n/1/direct")
        );
        // Handed too: the dispatcher sends it after the first.
        let second = subs.deliveries(vec![completed("t", "c1")]);
        assert!(direct(&second[0]));
        assert!(second[0].event_seq > first[0].event_seq);
        subs.stored(&first);
        subs.stored(&second);
        assert!(!subs.take_claim(), "nothing to claim");
        let handed = subs.take_handed();
        assert_eq!(
            handed
                .iter()
                .map(|(d, _)| d.id.as_str())
                .collect::<Vec<_>>(),
            [first[0].id.as_str(), second[0].id.as_str()]
        );
        assert!(!subs.waits_behind("wh_a", "c1"));
        // A handed one failed: the pair's next ones wait for the claim, behind its retry.
        subs.failed("wh_a", "c1");
        assert!(subs.waits_behind("wh_a", "c1"));
        let third = subs.deliveries(vec![completed("t", "c1")]);
        assert!(!direct(&third[0]));
        subs.stored(&third);
        assert!(
            subs.take_claim(),
            "an unclaimed one stored: the next cycle claims"
        );
        assert!(subs.take_handed().is_empty());
        // Another conversation's are handed over still.
        assert!(direct(&subs.deliveries(vec![completed("t", "c2")])[0]));
        // A write of unknown fate: its pair waits; no other tenant's endpoint is ever used.
        let fourth = subs.deliveries(vec![completed("t", "c3")]);
        assert!(direct(&fourth[0]));
        subs.not_stored(&fourth);
        assert!(subs.take_handed().is_empty());
        assert!(!direct(&subs.deliveries(vec![completed("t", "c3")])[0]));
        assert!(subs.deliveries(vec![completed("nobody", "c9")]).is_empty());
        // A forgotten (disabled) endpoint gets nothing more.
        subs.forget("wh_a");
        assert!(subs.deliveries(vec![completed("t", "c4")]).is_empty());
        assert!(subs.has("t"), "wh_b is still enabled");
    }

    /// A change on this node reads only the changing tenant's endpoints, and counts at once.
    #[tokio::test]
    async fn a_tenants_change_reads_that_tenants_endpoints_only() {
        use crate::persistence::{Persistence, PersistenceActor, WriteJob};
        let (store, dir) = crate::store::testing::sqlite_store("webhook-known", &[]).await;
        let (actor, _) = ractor::Actor::spawn(
            None,
            PersistenceActor,
            (store.clone(), Arc::new(crate::metrics::Metrics::default())),
        )
        .await
        .expect("the actor starts");
        let persistence = Persistence::new(actor.clone(), std::time::Duration::from_secs(30));
        let make = |id: &str, tenant: &str| {
            persistence.write(WriteJob::CreateWebhook(Box::new(hook(
                id,
                tenant,
                &[TURN_COMPLETED],
            ))))
        };
        make("wh_1", "t1").await.expect("an endpoint");
        make("wh_2", "t2").await.expect("an endpoint");
        let settings = crate::config::Settings::load_from(None, Vec::<(String, String)>::new())
            .expect("the defaults");
        let subs = Subscribers::load(&store, &settings.webhooks, "n")
            .await
            .expect("loads");
        assert!(subs.has("t1") && subs.has("t2"));
        let known_of = |tenant: &str| -> Vec<String> {
            subs.known()
                .hooks
                .get(tenant)
                .map(|hooks| hooks.iter().map(|h| h.id.clone()).collect())
                .unwrap_or_default()
        };
        // t2 gains an endpoint and t1 loses its own; t1's change is read alone.
        make("wh_3", "t2").await.expect("an endpoint");
        let changed = persistence
            .write(WriteJob::UpdateWebhook {
                tenant_id: "t1".into(),
                id: "wh_1".into(),
                change: crate::store::WebhookChange {
                    enabled: Some(false),
                    ..Default::default()
                },
                at: 2,
            })
            .await
            .expect("changes");
        assert_eq!(changed, crate::persistence::WriteOutcome::Resolved(true));
        subs.refresh_tenant(&store, "t1").await.expect("reads");
        assert!(!subs.has("t1"), "t1's change counts at once");
        assert_eq!(known_of("t2"), ["wh_2"], "t2's endpoints were not read");
        // The next read of them all finds t2's.
        subs.refresh(&store).await.expect("reads");
        assert_eq!(known_of("t2").len(), 2);
        assert!(!subs.has("t1"));
        actor.stop(None);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn event_places_increase() {
        let mut last = 0;
        for _ in 0..1000 {
            let next = next_seq();
            assert!(next > last);
            last = next;
        }
    }

    /// The signature of Standard Webhooks' own example (its specification's test vector).
    #[test]
    fn signatures_are_standard_webhooks() {
        let key = hook_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").expect("a key");
        let body = br#"{"test": 2432232314}"#;
        assert_eq!(
            signature(&key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
        assert_eq!(hook_key("whsec_!!"), None);
        assert_eq!(hook_key("whsec_c2hvcnQ="), None);
        assert_eq!(
            hook_key("plain-secret-16b"),
            Some(b"plain-secret-16b".to_vec())
        );
        let secret = new_secret();
        assert_eq!(hook_key(&secret).map(|k| k.len()), Some(32));
        assert_ne!(secret, new_secret());
    }

    #[test]
    fn a_turns_end_makes_its_events_small_and_without_secrets() {
        let at = DateTime::from_timestamp(1_800_000_000, 0).expect("a time");
        let end = |outcome| TurnEnd {
            turn: TurnId::new("t1"),
            outcome,
        };
        let types = |events: Vec<WebhookEvent>| -> Vec<&'static str> {
            events.iter().map(|e| e.event_type).collect()
        };
        assert_eq!(
            types(turn_events("t", "c", &end(TurnOutcome::Completed), 7, at)),
            [TURN_COMPLETED]
        );
        assert_eq!(
            types(turn_events("t", "c", &end(TurnOutcome::Cancelled), 7, at)),
            [TURN_CANCELLED]
        );
        assert_eq!(
            types(turn_events(
                "t",
                "c",
                &end(TurnOutcome::ContextExhausted),
                7,
                at
            )),
            [TURN_COMPLETED, CONTEXT_EXHAUSTED]
        );
        let failed = turn_events(
            "t",
            "c",
            &end(TurnOutcome::Failed {
                error_kind: ErrorKind::Budget,
                message: "x".repeat(5000),
            }),
            7,
            at,
        );
        assert_eq!(types(failed.clone()), [TURN_FAILED, BUDGET_EXHAUSTED]);
        let data: serde_json::Value = serde_json::from_str(&failed[0].payload).expect("JSON");
        assert_eq!(data["error_kind"], "budget");
        assert_eq!(data["state"], "error");
        assert_eq!(data["event_id"], 7);
        assert_eq!(data["turn_id"], "t1");
        assert!(
            failed[0].payload.len() < 1200,
            "{}",
            failed[0].payload.len()
        );
    }
}
