//! The dispatcher: one per node. It sends the deliveries handed to it as they are stored
//! (claimed by this node in their own transaction), claims the others when due (a
//! conversation's delivery behind an undone one, a retry, those whose claim ran out: a
//! dead node's are taken by another node), sends each, and writes what came of it, in
//! cycles (one transaction for the results of the moment and the claim). All its writes go
//! through the persistence actor. A conversation's deliveries to an endpoint go out one at a
//! time, in the order of its events (a delivery is handed over only when its pair has no
//! undone one, and the claim takes only the first undone one). It also fans out the outbox
//! rows an earlier release left.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use secrecy::ExposeSecret as _;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::{Subscribers, hook_key, signature};
use crate::config::WebhookSettings;
use crate::metrics::Metrics;
use crate::model::{Webhook, WebhookDelivery};
use crate::persistence::{Persistence, WebhookCycle, WriteJob};
use crate::store::{Attempt, Store, WebhookResults};

/// Outbox rows fanned out per write.
const FAN_OUT_BATCH: u64 = 256;
/// The most of an answer's body that is kept.
const EXCERPT_BYTES: usize = 256;
/// After deliveries were stored, how long more gather before they are taken.
const GATHER: Duration = Duration::from_millis(10);
/// How often the subscribed tenants are read again (an endpoint made on another node).
const REFRESH_EVERY: Duration = Duration::from_secs(1);
/// How often the backlog is counted (for the metric, and to drain what tenants without an
/// endpoint left behind).
const COUNT_EVERY: Duration = Duration::from_secs(10);

/// The node's dispatcher and what it needs.
#[derive(Debug)]
pub struct Dispatcher {
    pub store: Store,
    pub persistence: Persistence,
    pub egress: crate::egress::Egress,
    pub settings: WebhookSettings,
    pub subscribers: Arc<Subscribers>,
    pub metrics: Arc<Metrics>,
    /// This node's id: claims are made as `node/process`, so a restarted node's old claims
    /// are not taken for its own.
    pub node: String,
}

impl Dispatcher {
    /// Runs until `stop` fires.
    pub fn start(self, stop: CancellationToken) -> anyhow::Result<tokio::task::JoinHandle<()>> {
        let timeout = Duration::from_millis(self.settings.timeout_ms);
        let client = self.egress.client(|builder| {
            builder
                .timeout(timeout)
                .connect_timeout(timeout.min(Duration::from_secs(5)))
                .user_agent(concat!("Bedrock-Webhooks/", env!("CARGO_PKG_VERSION")))
                .pool_idle_timeout(Duration::from_secs(30))
        })?;
        let claimer = format!("{}/{}", self.node, uuid::Uuid::now_v7().simple());
        Ok(tokio::spawn(self.run(client, claimer, stop)))
    }

    async fn run(self, client: crate::egress::Client, claimer: String, stop: CancellationToken) {
        let this = Arc::new(self);
        // Attempts made (with their conversations, and whether they were handed over).
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<Done>();
        let mut flights = Flights {
            tasks: JoinSet::new(),
            client,
            done: done_tx,
            flying: HashSet::new(),
            per_tenant: HashMap::new(),
        };
        // Attempts whose results wait for the next write.
        let mut finished: Vec<Attempt> = Vec::new();
        // The results being written (one write at a time; those of attempts made meanwhile
        // gather in `finished`). The loop does not wait for it: lanes go on sending. Its
        // deliveries (whatever becomes of its task) and those in `finished` are still
        // claimed, so a cycle must not take them for undone ones of its claim.
        let mut writing: JoinSet<()> = JoinSet::new();
        let mut in_write: Vec<String> = Vec::new();
        // Deliveries handed over as they were stored, per (endpoint, conversation): sent one
        // at a time, in order; and those given back to the claim behind a failed one.
        let mut lanes: HashMap<Pair, Lane> = HashMap::new();
        let mut released: Vec<String> = Vec::new();
        // Deliveries our claims hold that were not sent (their tenant's or the node's
        // attempts in flight were at the most): the next cycle reads them again, even when
        // it claims nothing new and nothing is in flight any more.
        let mut held = false;
        let poll = Duration::from_millis(this.settings.poll_ms);
        // Events or deliveries wait (as last counted, at once): work even with no endpoint
        // enabled; the outbox of an earlier release is fanned out while it has rows.
        let (mut outbox, mut pending) = this.backlog().await;
        let (mut refreshed, mut counted) = (Instant::now(), Instant::now());
        // When due deliveries were last claimed: at least every `poll`, at once when some
        // were stored unclaimed, and in the cycle that finishes one that others wait behind.
        let mut claimed_at: Option<Instant> = None;
        let mut behind = false;
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(poll) => {}
                // Deliveries stored: those of the next moment are taken with them. An attempt
                // made: its lane's next goes at once (results gather in the write, which
                // waits for a group commit).
                _ = this.subscribers.woken() => tokio::time::sleep(GATHER).await,
                Some(done) = done_rx.recv() => {
                    flights.landed(&done.attempt);
                    behind |= this.attempt_done(done, &mut finished, &mut lanes, &mut released);
                }
                Some(_) = writing.join_next(), if !writing.is_empty() => in_write.clear(),
            }
            while let Ok(done) = done_rx.try_recv() {
                flights.landed(&done.attempt);
                behind |= this.attempt_done(done, &mut finished, &mut lanes, &mut released);
            }
            if refreshed.elapsed() >= REFRESH_EVERY {
                refreshed = Instant::now();
                if let Err(e) = this.subscribers.refresh(&this.store).await {
                    tracing::debug!(error = %e, "webhook endpoints not read");
                }
            }
            if counted.elapsed() >= COUNT_EVERY {
                counted = Instant::now();
                (outbox, pending) = this.backlog().await;
            }
            for (delivery, hook) in this.subscribers.take_handed() {
                let pair = (
                    delivery.webhook_id.clone(),
                    delivery.conversation_id.clone(),
                );
                // Its pair waits for the claim (one of it failed since it was made): the
                // claim takes it, in its place.
                if this.subscribers.waits_behind(&pair.0, &pair.1) {
                    released.push(delivery.id.clone());
                    continue;
                }
                let lane = lanes.entry(pair).or_default();
                let at = lane
                    .queue
                    .iter()
                    .position(|(d, _)| d.event_seq > delivery.event_seq)
                    .unwrap_or(lane.queue.len());
                lane.queue.insert(at, (delivery, hook));
            }
            // Handed over as they were stored: sent now, no claim to make or read; a pair's
            // next once the one before it is delivered.
            let claim_of_handed = this.subscribers.direct_claimer().to_owned();
            for lane in lanes.values_mut() {
                if lane.flying {
                    continue;
                }
                let Some((delivery, _)) = lane.queue.front() else {
                    continue;
                };
                if !flights.room(&this.settings, &delivery.tenant_id) {
                    continue;
                }
                let Some((delivery, hook)) = lane.queue.pop_front() else {
                    continue;
                };
                lane.flying = true;
                flights.start(&this, delivery, hook, claim_of_handed.clone(), true);
            }
            lanes.retain(|_, lane| lane.flying || !lane.queue.is_empty());
            let claim = this.subscribers.take_claim()
                || held
                || std::mem::take(&mut behind)
                || claimed_at.is_none_or(|at| at.elapsed() >= poll);
            // A node whose tenants use no webhooks writes nothing for them.
            if this.subscribers.is_empty()
                && !outbox
                && !pending
                && flights.flying.is_empty()
                && finished.is_empty()
                && writing.is_empty()
                && !held
            {
                continue;
            }
            // The results of the attempts made: on SQLite with the next batch of commits. One
            // write at a time, beside the loop: a write waits for a group commit (up to 5 ms)
            // and its sync, and a loop that waited with it left every lane idle meanwhile
            // (deliveries fell seconds behind under load).
            if writing.is_empty() && (!finished.is_empty() || !released.is_empty()) {
                let results = WebhookResults {
                    attempts: std::mem::take(&mut finished),
                    released: std::mem::take(&mut released),
                };
                let disabled: Vec<String> = results
                    .attempts
                    .iter()
                    .filter(|a| a.disable.is_some())
                    .map(|a| a.webhook_id.clone())
                    .collect();
                behind |= !results.released.is_empty();
                in_write = results
                    .attempts
                    .iter()
                    .map(|a| a.delivery_id.clone())
                    .collect();
                let this = Arc::clone(&this);
                writing.spawn(Box::pin(async move {
                    match this
                        .persistence
                        .write(WriteJob::WebhookResults(results))
                        .await
                    {
                        Ok(_) => {
                            for id in &disabled {
                                this.subscribers.forget(id);
                            }
                        }
                        // Results not written: their claims run out and the deliveries are
                        // made again (at least once).
                        Err(e) => {
                            tracing::warn!(error = %e, "webhook results could not be stored");
                        }
                    }
                }));
            }
            // Only outbox rows to fan out or deliveries to claim make a cycle: a delivery
            // handed over as it was stored needs none before it is sent.
            if !outbox && !claim {
                continue;
            }
            let free = this
                .settings
                .concurrency
                .saturating_sub(flights.flying.len());
            if claim {
                claimed_at = Some(Instant::now());
            }
            // Deliveries the cycle must not take for undone ones of its claim: in flight, or
            // attempted with their results not yet written.
            let busy: HashSet<String> = flights
                .flying
                .iter()
                .chain(&in_write)
                .chain(finished.iter().map(|a| &a.delivery_id))
                .cloned()
                .collect();
            let now = now_ms();
            let cycle = WebhookCycle {
                now,
                retry_for_ms: ms(this.settings.retry_for_ms),
                fan_out_limit: if outbox { FAN_OUT_BATCH } else { 0 },
                claimed_by: claimer.clone(),
                until: now.saturating_add(ms(this.settings.claim_ms)),
                claim_limit: if claim { free as u64 } else { 0 },
                flying: busy.iter().cloned().collect(),
                held,
                claimed: Arc::default(),
            };
            let claimed = Arc::clone(&cycle.claimed);
            if let Err(e) = this
                .persistence
                .write(WriteJob::WebhookCycle(Box::new(cycle)))
                .await
            {
                tracing::warn!(error = %e, "a webhook cycle could not be stored");
                continue;
            }
            // What its claims hold, read in the cycle (none when it claimed nothing, nothing
            // was in flight and nothing held), but those in flight.
            let mine = std::mem::take(
                &mut *claimed
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
            );
            held = false;
            for (delivery, hook) in mine {
                if busy.contains(&delivery.id) {
                    continue;
                }
                if !flights.room(&this.settings, &delivery.tenant_id) {
                    // Still claimed: handed out by a later cycle (`held`), when one of the
                    // tenant's ends.
                    held = true;
                    continue;
                }
                flights.start(&this, delivery, Arc::new(hook), claimer.clone(), false);
            }
        }
        flights.tasks.abort_all();
        // A results write under way is let finish (for a while): what it does not write is
        // sent again when its claims run out.
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while writing.join_next().await.is_some() {}
        })
        .await;
    }

    /// An attempt's result: kept for the next write. A handed delivery's lane sends its next
    /// one if it was delivered, and gives the rest back to the claim if it failed (they go
    /// after its retry). Whether deliveries of its pair may wait behind it for the claim.
    fn attempt_done(
        &self,
        done: Done,
        finished: &mut Vec<Attempt>,
        lanes: &mut HashMap<Pair, Lane>,
        released: &mut Vec<String>,
    ) -> bool {
        let pair = (
            done.attempt.webhook_id.clone(),
            done.conversation_id.clone(),
        );
        if done.handed {
            if done.attempt.succeeded {
                if let Some(lane) = lanes.get_mut(&pair) {
                    lane.flying = false;
                }
            } else {
                self.subscribers.failed(&pair.0, &pair.1);
                if let Some(lane) = lanes.remove(&pair) {
                    released.extend(lane.queue.into_iter().map(|(d, _)| d.id));
                }
            }
        }
        let behind = self.subscribers.waits_behind(&pair.0, &pair.1);
        finished.push(done.attempt);
        behind
    }

    /// Whether outbox rows (of an earlier release) and deliveries wait (and the metric of
    /// how many).
    async fn backlog(&self) -> (bool, bool) {
        match self.store.webhook_backlog().await {
            Ok((outbox, pending)) => {
                self.metrics.webhook_backlog(outbox, pending);
                (outbox > 0, pending > 0)
            }
            Err(_) => (true, true),
        }
    }

    /// One attempt of `delivery`: its result, for the dispatcher's next write.
    async fn deliver(
        &self,
        client: &crate::egress::Client,
        claimer: &str,
        delivery: WebhookDelivery,
        hook: &Webhook,
    ) -> Attempt {
        let started = Instant::now();
        let sent = send(client, &delivery, hook).await;
        let latency = started.elapsed();
        let at = now_ms();
        let (status, error, excerpt, retryable) = match sent {
            Sent::Answered { status, excerpt } => (Some(status), None, excerpt, true),
            Sent::Failed(error) => (None, Some(error), None, true),
            Sent::Refused(error) => (None, Some(error), None, false),
        };
        let succeeded = status.is_some_and(|s| (200..300).contains(&s));
        let retry_at = (!succeeded && retryable)
            .then(|| {
                let next = at.saturating_add(retry_delay_ms(&self.settings, delivery.attempts));
                (next <= delivery.expires_at).then_some(next)
            })
            .flatten();
        let disable = (!succeeded)
            .then(|| {
                let since = hook.failing_since?;
                (at.saturating_sub(since) >= ms(self.settings.disable_after_ms)).then(|| {
                    let since = chrono::DateTime::from_timestamp_millis(since)
                        .map(|t| t.to_rfc3339())
                        .unwrap_or_default();
                    let last = match (status, &error) {
                        (Some(status), _) => format!("HTTP {status}"),
                        (None, Some(error)) => error.clone(),
                        (None, None) => String::new(),
                    };
                    format!("every attempt has failed since {since} (the last: {last})")
                })
            })
            .flatten();
        let outcome = if succeeded {
            "delivered"
        } else if !retryable {
            "refused"
        } else if retry_at.is_some() {
            "retry"
        } else {
            "failed"
        };
        self.metrics.webhook_attempt(outcome, latency.as_secs_f64());
        if !succeeded {
            // Its span is not logged (telemetry::STEP): the line says which.
            tracing::info!(
                tenant = %delivery.tenant_id,
                conversation = %delivery.conversation_id,
                webhook = %hook.id,
                event = %delivery.event_type,
                delivery = %delivery.id,
                attempt = delivery.attempts + 1,
                outcome,
                ?status,
                error = error.as_deref().unwrap_or(""),
                "webhook attempt failed"
            );
        }
        Attempt {
            delivery_id: delivery.id.clone(),
            webhook_id: hook.id.clone(),
            tenant_id: delivery.tenant_id.clone(),
            claimed_by: claimer.to_owned(),
            log_before: delivery.attempts_log.clone(),
            at,
            status,
            error,
            latency_ms: i64::try_from(latency.as_millis()).unwrap_or(i64::MAX),
            excerpt,
            succeeded,
            retry_at,
            disable,
        }
    }
}

/// The node's attempts in flight: their tasks, and how many per tenant.
struct Flights {
    tasks: JoinSet<()>,
    client: crate::egress::Client,
    done: tokio::sync::mpsc::UnboundedSender<Done>,
    /// The deliveries in flight.
    flying: HashSet<String>,
    per_tenant: HashMap<String, usize>,
}

impl Flights {
    /// Whether another attempt of the tenant may start (the node's and the tenant's limits).
    fn room(&self, settings: &WebhookSettings, tenant_id: &str) -> bool {
        self.flying.len() < settings.concurrency
            && self.per_tenant.get(tenant_id).copied().unwrap_or(0) < settings.per_tenant
    }

    /// An attempt ended.
    fn landed(&mut self, attempt: &Attempt) {
        self.flying.remove(&attempt.delivery_id);
        if let Some(n) = self.per_tenant.get_mut(&attempt.tenant_id) {
            *n = n.saturating_sub(1);
        }
        while self.tasks.try_join_next().is_some() {}
    }

    /// Sends `delivery` under `claim` in a task of its own.
    fn start(
        &mut self,
        dispatcher: &Arc<Dispatcher>,
        delivery: WebhookDelivery,
        hook: Arc<Webhook>,
        claim: String,
        handed: bool,
    ) {
        *self
            .per_tenant
            .entry(delivery.tenant_id.clone())
            .or_default() += 1;
        self.flying.insert(delivery.id.clone());
        let (this, client, done) = (
            Arc::clone(dispatcher),
            self.client.clone(),
            self.done.clone(),
        );
        let span = tracing::info_span!(target: crate::telemetry::STEP, "webhook delivery", tenant = %delivery.tenant_id,
            conversation = %delivery.conversation_id, webhook = %hook.id,
            event = %delivery.event_type, delivery = %delivery.id,
            attempt = delivery.attempts + 1);
        let conversation_id = delivery.conversation_id.clone();
        // Boxed: a task's future is copied as the task is made and again as it ends, and an
        // attempt's (the HTTP request's) is a few KB (issue 41).
        self.tasks.spawn(Box::pin(
            async move {
                let attempt = this.deliver(&client, &claim, delivery, &hook).await;
                let _ = done.send(Done {
                    attempt,
                    conversation_id,
                    handed,
                });
            }
            .instrument(span),
        ));
    }
}

/// An endpoint and a conversation.
type Pair = (String, String);

/// A pair's deliveries handed over as they were stored: one in flight at a time.
#[derive(Default)]
struct Lane {
    flying: bool,
    queue: VecDeque<(WebhookDelivery, Arc<Webhook>)>,
}

/// An attempt made, for the dispatcher's loop.
struct Done {
    attempt: Attempt,
    conversation_id: String,
    /// The delivery was handed over as it was stored (not claimed by a cycle).
    handed: bool,
}

/// What an attempt came to.
enum Sent {
    /// The endpoint answered with this status (and the first bytes of its body).
    Answered {
        status: u16,
        excerpt: Option<String>,
    },
    /// A timeout or a connection error: retried.
    Failed(String),
    /// Refused before sending (the egress policy, a URL that is not one): not retried.
    Refused(String),
}

/// Sends `delivery` to `hook`: `{"type", "timestamp", "data"}`, signed with the endpoint's
/// secret (and its previous one during a rotation).
async fn send(client: &crate::egress::Client, delivery: &WebhookDelivery, hook: &Webhook) -> Sent {
    let Some(url) = parsed(&hook.url) else {
        return Sent::Refused("the endpoint's URL is not a URL".into());
    };
    let created = chrono::DateTime::from_timestamp_millis(delivery.created_at)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let body = format!(
        "{{\"type\":{},\"timestamp\":{},\"data\":{}}}",
        serde_json::Value::from(delivery.event_type.as_str()),
        serde_json::Value::from(created),
        delivery.payload
    );
    let timestamp = chrono::Utc::now().timestamp();
    let mut signatures = Vec::new();
    for secret in std::iter::once(&hook.secret).chain(hook.previous_secret.iter().filter(|_| {
        hook.previous_secret_until
            .is_some_and(|until| until > now_ms())
    })) {
        if let Some(key) = hook_key(secret.expose_secret()) {
            signatures.push(signature(&key, &delivery.id, timestamp, body.as_bytes()));
        }
    }
    let request = client
        .http()
        .post(url)
        .header("content-type", "application/json")
        .header("webhook-id", &delivery.id)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", signatures.join(" "))
        .body(body)
        .build();
    let request = match request {
        Ok(request) => request,
        Err(e) => return Sent::Refused(format!("the request could not be made: {e}")),
    };
    let mut response = match client.execute(request).await {
        Ok(response) => response,
        Err(crate::egress::Error::Egress(e)) if e.is_refusal() => {
            return Sent::Refused(format!("refused by the egress policy: {e}"));
        }
        Err(crate::egress::Error::Egress(e)) => return Sent::Failed(e.to_string()),
        Err(crate::egress::Error::Http(e)) => {
            if let Some(refused) = crate::egress::EgressError::find(&e).filter(|e| e.is_refusal()) {
                return Sent::Refused(format!("refused by the egress policy: {refused}"));
            }
            let why = if e.is_timeout() {
                "no answer in time".to_owned()
            } else if e.is_connect() {
                "the endpoint could not be reached".to_owned()
            } else {
                "the request failed".to_owned()
            };
            return Sent::Failed(why);
        }
    };
    let status = response.status().as_u16();
    let mut kept = Vec::new();
    while kept.len() < EXCERPT_BYTES {
        match response.chunk().await {
            Ok(Some(chunk)) => kept.extend_from_slice(&chunk),
            Ok(None) | Err(_) => break,
        }
    }
    kept.truncate(EXCERPT_BYTES);
    let excerpt = (!kept.is_empty()).then(|| String::from_utf8_lossy(&kept).into_owned());
    Sent::Answered { status, excerpt }
}

/// `url` parsed, from a cache of the endpoints' URLs (parsing one, with its host's IDNA
/// checks, costs more than signing a delivery). The parse is pure, so the cache is shared
/// by every dispatcher of the process; it is emptied when it holds `URLS_KEPT`.
fn parsed(url: &str) -> Option<url::Url> {
    const URLS_KEPT: usize = 1024;
    static URLS: std::sync::LazyLock<std::sync::Mutex<HashMap<String, url::Url>>> =
        std::sync::LazyLock::new(Default::default);
    let mut urls = URLS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(parsed) = urls.get(url) {
        return Some(parsed.clone());
    }
    let parsed = url::Url::parse(url).ok()?;
    if urls.len() >= URLS_KEPT {
        urls.clear();
    }
    urls.insert(url.to_owned(), parsed.clone());
    Some(parsed)
}

/// The delay before the retry after `attempts` failed ones: `retry_initial_ms` doubled per
/// attempt, at most `retry_max_delay_ms`, with up to 20% jitter either way (so endpoints
/// that fail together are not retried together).
pub fn retry_delay_ms(settings: &WebhookSettings, attempts: u32) -> i64 {
    let base = settings
        .retry_initial_ms
        .saturating_mul(1u64 << attempts.min(40))
        .min(settings.retry_max_delay_ms);
    let jitter = rand::random_range(0.8..1.2);
    ms((base as f64 * jitter) as u64).max(1)
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

fn ms(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hostile tenant's first try on the attempt's path: an endpoint whose name
    /// resolved to a public address when it was made and resolves to the node's own now,
    /// or the loopback in other spellings (kept from before the checks at creation). Each
    /// attempt is refused at its moment, before any connection, and not retried (refused,
    /// not failed); the second attempt, which finds the URL parsed and kept, too.
    #[tokio::test]
    async fn an_endpoint_that_now_points_inside_is_refused_at_each_attempt() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let port = listener.local_addr().expect("an address").port();
        let lookup: crate::egress::Lookup = Arc::new(|name: String| {
            Box::pin(async move {
                if name == "rebind.test" {
                    Ok(vec![std::net::IpAddr::from([127, 0, 0, 1])])
                } else {
                    Err(std::io::Error::other("no such name"))
                }
            })
        });
        let client = crate::egress::Egress::new(&[])
            .expect("a policy")
            .with_lookup(lookup, Duration::from_secs(1))
            .client(|builder| builder.timeout(Duration::from_secs(2)))
            .expect("a client");
        let delivery = WebhookDelivery {
            id: "msg_1".into(),
            webhook_id: "wh_1".into(),
            tenant_id: "t".into(),
            conversation_id: "c".into(),
            event_seq: 1,
            event_type: "turn.completed".into(),
            payload: "{}".into(),
            status: "pending".into(),
            attempts: 0,
            next_attempt_at: 0,
            expires_at: i64::MAX,
            last_status: None,
            last_error: None,
            last_latency_ms: None,
            attempts_log: "[]".into(),
            created_at: 0,
            updated_at: 0,
        };
        for url in [
            format!("http://rebind.test:{port}/"),
            format!("http://127.1:{port}/"),
            format!("http://[::ffff:127.0.0.1]:{port}/"),
            format!("http://0x7f000001:{port}/"),
        ] {
            let hook = Webhook {
                url: url.clone(),
                ..super::super::tests::hook("wh_1", "t", &["turn.completed"])
            };
            for attempt in 1..=2 {
                let sent = send(&client, &delivery, &hook).await;
                assert!(
                    matches!(&sent, Sent::Refused(why) if why.contains("egress policy")),
                    "{url}, attempt {attempt}: not refused"
                );
            }
        }
        assert!(
            tokio::time::timeout(Duration::from_millis(200), listener.accept())
                .await
                .is_err(),
            "nothing reached the node's own port"
        );
    }
}
