//! This node of a cluster: its id (kept in the data directory between starts), this run's
//! incarnation, the address other nodes reach it on, and its lease timing. The runtime takes
//! leases in its name; `cluster` runs its heartbeat and takeovers.

use std::net::SocketAddr;
use std::time::Duration;

use crate::config::ClusterSettings;
use crate::store::Node;

/// This node.
#[derive(Debug)]
pub struct Cluster {
    pub node_id: String,
    /// This process's run of the node (a fresh id at every start): the owner of the leases
    /// it takes, so that a restarted node finds those of its previous run ended.
    pub incarnation: String,
    /// The base URL other nodes reach this node's API on.
    pub advertise: String,
    pub ttl: Duration,
    pub heartbeat: Duration,
    /// Carries commands to the nodes that own their conversations.
    pub http: reqwest::Client,
    /// The data directory's node id file, locked while this process runs (see `kept_id`).
    _kept: Option<std::fs::File>,
}

/// The file in the data directory that keeps a node's generated id between starts.
const NODE_ID_FILE: &str = "node-id";

/// The node id kept in `data_dir` when none is configured: read from its `node-id` file, or
/// made and written there at the first start, so a restarted node is the same node and ends
/// its previous run's leases at once (not after the lease TTL). The file stays locked while
/// the process runs; a second process on the same data directory (which finds it locked)
/// gets an id of its own. `None` when the file cannot be used: a fresh id then.
fn kept_id(data_dir: &std::path::Path) -> Option<(String, std::fs::File)> {
    use std::io::{Read, Seek, Write};
    let path = data_dir.join(NODE_ID_FILE);
    let opened = std::fs::create_dir_all(data_dir).and_then(|()| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
    });
    let mut file = match opened {
        Ok(file) => file,
        Err(error) => {
            tracing::warn!(path = %path.display(), %error, "cannot keep the node id; a new one at every start");
            return None;
        }
    };
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            tracing::info!(path = %path.display(), "another process runs on this data directory's node id; this one gets its own");
            return None;
        }
        Err(std::fs::TryLockError::Error(error)) => {
            tracing::warn!(path = %path.display(), %error, "cannot lock the node id file; a new id at every start");
            return None;
        }
    }
    let mut kept = String::new();
    // At most 128 bytes count (the limit of a configured id); more is not ours.
    let _ = Read::by_ref(&mut file).take(256).read_to_string(&mut kept);
    let kept = kept.trim();
    let valid = !kept.is_empty()
        && kept.len() <= 128
        && kept
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if valid {
        return Some((kept.to_owned(), file));
    }
    let id = format!("node-{}", uuid::Uuid::now_v7());
    let written = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| file.write_all(format!("{id}\n").as_bytes()))
        .and_then(|()| file.sync_all());
    match written {
        Ok(()) => Some((id, file)),
        Err(error) => {
            tracing::warn!(path = %path.display(), %error, "cannot write the node id; a new one at every start");
            None
        }
    }
}

impl Cluster {
    /// This node as configured; `listen` is the address the API is bound to. Without a
    /// configured id, the one kept in `data_dir` (made there at the first start).
    pub fn new(
        settings: &ClusterSettings,
        listen: SocketAddr,
        data_dir: &std::path::Path,
    ) -> Cluster {
        let incarnation = uuid::Uuid::now_v7().to_string();
        let (node_id, kept) = if settings.node_id.trim().is_empty() {
            match kept_id(data_dir) {
                Some((id, file)) => (id, Some(file)),
                None => (format!("node-{incarnation}"), None),
            }
        } else {
            (settings.node_id.trim().to_owned(), None)
        };
        let advertise = if settings.advertise.is_empty() {
            format!("http://{listen}")
        } else {
            settings.advertise.trim_end_matches('/').to_owned()
        };
        Cluster {
            node_id,
            incarnation,
            advertise,
            ttl: Duration::from_millis(settings.lease_ttl_ms),
            heartbeat: Duration::from_millis(settings.heartbeat_ms),
            http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(2))
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap_or_default(),
            _kept: kept,
        }
    }

    /// This node, as the store's lease statements name it.
    pub fn node(&self) -> Node<'_> {
        Node {
            id: &self.node_id,
            incarnation: &self.incarnation,
            ttl: self.ttl,
        }
    }
}
