//! The HTTP server: an accept loop over hyper with the limits a public listener needs
//! (docs/security.md, "Slow clients"):
//! - a cap on open connections (WebSockets included), below the open-file limit: one more
//!   is closed as soon as it is accepted, counted, and logged once per burst;
//! - a header read timeout (hyper's, for HTTP/1.1; for the first request of any connection,
//!   here too);
//! - a time limit on reading a request's body ([`DeadlineBody`], 408 in the API);
//! - an idle timeout for connections with no request in flight (keep-alive);
//! - graceful shutdown: stop accepting, let every connection finish its requests.

use std::convert::Infallible;
use std::error::Error as StdError;
use std::future::Future as _;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt as _;

use crate::config::ServerSettings;
use crate::metrics::Metrics;

/// The limits of one listener.
#[derive(Clone, Debug)]
pub struct Limits {
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
    pub keep_alive_timeout: Duration,
    pub max_connections: usize,
}

impl Limits {
    /// The public listener's limits, with its connection cap decided.
    pub fn of(settings: &ServerSettings, max_connections: usize) -> Limits {
        Limits {
            header_read_timeout: Duration::from_millis(settings.header_read_timeout_ms),
            body_read_timeout: Duration::from_millis(settings.body_read_timeout_ms),
            keep_alive_timeout: Duration::from_millis(settings.keep_alive_timeout_ms),
            max_connections,
        }
    }
}

/// Raises the soft limit of open files to the hard limit; returns the limit in force.
pub fn raise_open_file_limit() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(error) => {
                tracing::warn!(%error, soft, hard, "cannot raise the open-file limit");
                soft
            }
        },
        Ok((soft, _)) => soft,
        Err(error) => {
            tracing::warn!(%error, "cannot read the open-file limit; assuming 1024");
            1024
        }
    }
}

/// A log line for a kind of event that may come in bursts: the first of a burst is logged
/// at once; the ones after it within `every` are only counted, and the next line (at the
/// first event after `every`) says how many there were since the line before. The exact
/// counts are the metrics'.
#[derive(Debug)]
pub struct BurstLog {
    what: &'static str,
    every: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl BurstLog {
    pub const fn new(what: &'static str, every: Duration) -> BurstLog {
        BurstLog {
            what,
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// Notes one event; logs when the last line is older than `every`.
    pub fn note(&self, detail: &dyn std::fmt::Display) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.1 += 1;
        if state.0.is_some_and(|at| at.elapsed() < self.every) {
            return;
        }
        let count = std::mem::take(&mut state.1);
        state.0 = Some(Instant::now());
        drop(state);
        tracing::warn!(
            since_last_line = count,
            "{}: {detail} (logged at most once per {} s)",
            self.what,
            self.every.as_secs()
        );
    }
}

/// The body of a request, with a deadline for the whole of it: past it, reading fails with
/// [`BodyTimedOut`].
#[derive(Debug)]
pub struct DeadlineBody {
    inner: Incoming,
    deadline: tokio::time::Instant,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// A request body that did not arrive within its time limit.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within the server's time limit")]
pub struct BodyTimedOut;

/// Whether `error`, or an error it was caused by, is a [`BodyTimedOut`].
pub fn timed_out(error: &(dyn StdError + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if error.is::<BodyTimedOut>() {
            return true;
        }
        next = error.source();
    }
    false
}

impl HttpBody for DeadlineBody {
    type Data = Bytes;
    type Error = Box<dyn StdError + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let deadline = this.deadline;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyTimedOut)))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// What a connection's watchdog knows: requests in flight and since when none is.
#[derive(Debug)]
struct Activity {
    born: Instant,
    in_flight: AtomicUsize,
    /// Milliseconds after `born` when the last request in flight ended; `u64::MAX`: never
    /// had one.
    idle_since_ms: AtomicU64,
    changed: Notify,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            born: Instant::now(),
            in_flight: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(u64::MAX),
            changed: Notify::new(),
        }
    }

    fn started(&self) {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_one();
    }

    fn ended(&self) {
        let ms = u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        self.idle_since_ms.store(ms, Ordering::SeqCst);
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.changed.notify_one();
    }

    /// When the connection is to be closed for idleness, if it stays as it is.
    fn deadline(&self, limits: &Limits) -> Option<Instant> {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        Some(match self.idle_since_ms.load(Ordering::SeqCst) {
            // The first request must begin within the header timeout.
            u64::MAX => self.born + limits.header_read_timeout,
            ms => self.born + Duration::from_millis(ms) + limits.keep_alive_timeout,
        })
    }
}

/// Marks a request in flight until its response's body is done (or dropped).
#[derive(Debug)]
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.ended();
    }
}

/// A response body that keeps its request counted in flight while it is sent.
struct Tracked {
    inner: Body,
    _in_flight: InFlight,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// An accepted connection: holds its place under the cap until it is closed, also after a
/// WebSocket upgrade took it over.
#[derive(Debug)]
struct Counted {
    tcp: TcpStream,
    _permit: OwnedSemaphorePermit,
    metrics: Arc<Metrics>,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.metrics.connection(false);
    }
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

static REFUSED: BurstLog = BurstLog::new(
    "connections refused over the connection cap",
    Duration::from_secs(10),
);
static ACCEPT_FAILED: BurstLog =
    BurstLog::new("accepting connections failed", Duration::from_secs(10));

/// Whether an accept error concerns only the connection that was being accepted.
fn connection_error(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// Serves `router` on `listener` under `limits` until `shutdown` fires, then stops
/// accepting and waits for the open connections to finish their requests (WebSockets,
/// which outlive their connection's HTTP part, close on the application's own token).
/// `name` names the listener in logs and metrics.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    name: &'static str,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let connections = TaskTracker::new();
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (tcp, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) if connection_error(&error) => continue,
            Err(error) => {
                // Out of file descriptors, say: wait a little rather than spin.
                ACCEPT_FAILED.note(&error);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            // Refused cheaply: closed at once, before any byte is read.
            drop(tcp);
            metrics.connection_refused(name, "max_connections");
            REFUSED.note(&format_args!(
                "{name}: {} open, the cap (server.max_connections)",
                limits.max_connections
            ));
            continue;
        };
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY");
        }
        metrics.connection(true);
        let io = Counted {
            tcp,
            _permit: permit,
            metrics: metrics.clone(),
        };
        connections.spawn(connection(
            io,
            peer,
            router.clone(),
            builder.clone(),
            limits.clone(),
            metrics.clone(),
            shutdown.clone(),
            name,
        ));
    }
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// One connection: hyper serves it; its watchdog closes it when it idles too long.
#[allow(clippy::too_many_arguments)]
async fn connection(
    io: Counted,
    peer: SocketAddr,
    router: Router,
    builder: Arc<Builder<TokioExecutor>>,
    limits: Limits,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    name: &'static str,
) {
    let activity = Arc::new(Activity::new());
    let body_timeout = limits.body_read_timeout;
    let service = {
        let activity = activity.clone();
        tower::service_fn(move |request: http::Request<Incoming>| {
            activity.started();
            let in_flight = InFlight(activity.clone());
            let deadline = tokio::time::Instant::now() + body_timeout;
            let request = request.map(|inner| {
                Body::new(DeadlineBody {
                    inner,
                    deadline,
                    sleep: None,
                })
            });
            let router = router.clone();
            async move {
                let response = router.oneshot(request).await?;
                Ok::<_, Infallible>(response.map(|inner| {
                    Body::new(Tracked {
                        inner,
                        _in_flight: in_flight,
                    })
                }))
            }
        })
    };
    let conn =
        builder.serve_connection_with_upgrades(TokioIo::new(io), TowerToHyperService::new(service));
    let mut conn = std::pin::pin!(conn);
    let mut closing: Option<tokio::time::Instant> = None;
    // Why the server closed the connection, counted once.
    let mut closed_for: Option<&'static str> = None;
    // One timer for the connection's life, moved when its deadline moves.
    let wake = tokio::time::sleep_until(tokio::time::Instant::now());
    tokio::pin!(wake);
    let mut armed: Option<tokio::time::Instant> = None;
    loop {
        let idle_deadline = match closing {
            Some(at) => Some(at),
            None => activity
                .deadline(&limits)
                .map(tokio::time::Instant::from_std),
        };
        if let Some(at) = idle_deadline
            && armed != Some(at)
        {
            wake.as_mut().reset(at);
            armed = Some(at);
        }
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(error) = result {
                    let header_timeout = error
                        .downcast_ref::<hyper::Error>()
                        .is_some_and(hyper::Error::is_timeout);
                    if header_timeout && closed_for.is_none() {
                        closed_for = Some("header_timeout");
                    }
                    tracing::trace!(%peer, %error, "connection ended with an error");
                }
                break;
            }
            () = activity.changed.notified() => {}
            () = shutdown.cancelled(), if closing.is_none() => {
                conn.as_mut().graceful_shutdown();
                // Requests in flight finish; the application's grace period bounds them.
                closing = Some(tokio::time::Instant::now() + Duration::from_secs(3600));
            }
            () = &mut wake, if idle_deadline.is_some() => {
                armed = None;
                if closing.is_some() {
                    break;
                }
                // Still idle past its deadline (a request may have begun meanwhile).
                if activity
                    .deadline(&limits)
                    .is_some_and(|at| at <= Instant::now())
                {
                    let first = activity.idle_since_ms.load(Ordering::SeqCst) == u64::MAX;
                    closed_for = Some(if first { "header_timeout" } else { "idle" });
                    conn.as_mut().graceful_shutdown();
                    // An idle connection closes at once; give one that is mid-head a moment.
                    closing = Some(tokio::time::Instant::now() + Duration::from_secs(1));
                }
            }
        }
    }
    if let Some(reason) = closed_for {
        metrics.connection_closed(name, reason);
    }
}
