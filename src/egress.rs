//! The egress policy: what the server may connect to on a tenant's behalf (tenants' MCP
//! servers now; any later fetch of a tenant-given URL, e.g. webhooks, goes through it too).
//! docs/security.md, "Server-side requests (SSRF)".
//!
//! An address is refused when it is not on the public internet: loopback, private
//! (RFC 1918), shared (CGNAT), link-local and cloud metadata, unique local, unspecified,
//! multicast, broadcast, documentation, benchmarking and reserved ranges, and the IPv6 forms
//! that carry such an IPv4 address (mapped, compatible, NAT64, 6to4). The operator's allow
//! list (`[egress] allow`: CIDRs and host names) lets chosen internal servers through.
//!
//! Three checks, one policy:
//! - [`Egress::check_url`] at registration: the URL's form, an IP literal in any spelling
//!   the URL parser accepts (it normalises them, WHATWG), `localhost`, and a name that
//!   resolves only to refused addresses;
//! - [`Egress::check_target`] before each request: the same without DNS (IP literals reach no
//!   resolver);
//! - the resolver of every [`Client`] at connect time: each name is resolved, its refused
//!   addresses dropped, and the connection goes to an address that was checked, so a name
//!   that changed since (DNS rebinding) gets nowhere. A client follows no redirect and uses
//!   no proxy.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use url::{Host, Url};

/// How long a name may take to resolve, at registration and at connect time.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(3);

/// The AWS/GCP/Azure instance metadata address, and AWS's IPv6 one.
const METADATA_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
const METADATA_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254);

/// Why a URL or a connection is not made. Its text is meant for the tenant: it names the
/// host and the kind of range, never anything the host answered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EgressError {
    #[error("the URL must be an http:// or https:// URL")]
    Scheme,
    #[error("the URL must not carry a user name or password (send credentials as headers)")]
    Userinfo,
    #[error("the URL has no host")]
    NoHost,
    #[error("the URL is not valid")]
    Invalid,
    /// The host is, or resolves only to, addresses the policy refuses.
    #[error("the address of {host} is not allowed ({why})")]
    Refused { host: String, why: &'static str },
    #[error("{host} does not resolve")]
    Unresolved { host: String },
    #[error("{host} did not resolve in time")]
    LookupTimeout { host: String },
}

impl EgressError {
    /// A refusal of the policy (not a name that failed to resolve).
    pub fn is_refusal(&self) -> bool {
        !matches!(
            self,
            EgressError::Unresolved { .. } | EgressError::LookupTimeout { .. }
        )
    }

    /// The egress error in an error's chain, if any: a refused connection comes back from
    /// reqwest (and from what wraps it) with this as one of its sources.
    pub fn find<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a EgressError> {
        let mut next = Some(error);
        while let Some(error) = next {
            if let Some(found) = error.downcast_ref::<EgressError>() {
                return Some(found);
            }
            // An io::Error's source() skips the error it wraps.
            if let Some(found) = error
                .downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<EgressError>())
            {
                return Some(found);
            }
            next = error.source();
        }
        None
    }
}

/// Why `ip` is not on the public internet, or `None` when it is. IPv4 addresses inside IPv6
/// ones (mapped, compatible, NAT64, 6to4) are judged as the IPv4 address they reach.
pub fn classify(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => classify_v4(v4),
        IpAddr::V6(v6) => classify_v6(v6),
    }
}

fn classify_v4(ip: Ipv4Addr) -> Option<&'static str> {
    if ip == METADATA_V4 {
        return Some("cloud metadata");
    }
    if ip.is_broadcast() {
        return Some("broadcast");
    }
    let [a, b, c, _] = ip.octets();
    Some(match (a, b, c) {
        // 0.0.0.0/8: "this network"; a connection to 0.0.0.0 reaches the host itself.
        (0, _, _) => "unspecified",
        (10, _, _) | (172, 16..=31, _) | (192, 168, _) => "private network",
        (100, 64..=127, _) => "shared address space (CGNAT)",
        (127, _, _) => "loopback",
        (169, 254, _) => "link-local",
        (192, 0, 0) => "reserved (IETF protocol assignments)",
        (192, 0, 2) | (198, 51, 100) | (203, 0, 113) => "documentation",
        (192, 88, 99) => "reserved (6to4 relay anycast)",
        (198, 18..=19, _) => "benchmarking",
        (224..=239, _, _) => "multicast",
        (240..=255, _, _) => "reserved",
        _ => return None,
    })
}

fn v4_at(segments: &[u16; 8], at: usize) -> Ipv4Addr {
    let [hi, lo] = [segments[at], segments[at + 1]];
    Ipv4Addr::new((hi >> 8) as u8, hi as u8, (lo >> 8) as u8, lo as u8)
}

fn classify_v6(ip: Ipv6Addr) -> Option<&'static str> {
    if ip.is_unspecified() {
        return Some("unspecified");
    }
    if ip.is_loopback() {
        return Some("loopback");
    }
    if ip == METADATA_V6 {
        return Some("cloud metadata");
    }
    let s = ip.segments();
    // ::ffff:a.b.c.d (mapped): a dual-stack socket connects to a.b.c.d.
    if let Some(v4) = ip.to_ipv4_mapped() {
        return classify_v4(v4);
    }
    // 64:ff9b::/96 (NAT64, well-known prefix): the translator connects to a.b.c.d.
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return classify_v4(v4_at(&s, 6));
    }
    // 2002:AABB:CCDD::/48 (6to4): a relay delivers to AA.BB.CC.DD.
    if s[0] == 0x2002 {
        return classify_v4(v4_at(&s, 1));
    }
    // ::a.b.c.d (IPv4-compatible, deprecated) and ::ffff:0:a.b.c.d (IPv4-translated): refused
    // whatever they carry, named after it when that is refused too.
    if s[..6] == [0; 6] || s[..6] == [0, 0, 0, 0, 0xffff, 0] {
        return Some(classify_v4(v4_at(&s, 6)).unwrap_or("reserved (IPv4-compatible)"));
    }
    Some(match s[0] {
        0xff00..=0xffff => "multicast",
        0xfe80..=0xfebf => "link-local",
        0xfec0..=0xfeff => "private network (site-local)",
        0xfc00..=0xfdff => "private network (unique local)",
        // 64:ff9b:1::/48: NAT64 for local use.
        0x64 if s[1] == 0xff9b && s[2] == 1 => "private network (local-use NAT64)",
        0x2001 if s[1] == 0x0db8 => "documentation",
        0x3fff if s[1] < 0x1000 => "documentation",
        0x2001 if s[1] == 0x0002 && s[2] == 0 => "benchmarking",
        // 2001::/23: IETF protocol assignments (Teredo included).
        0x2001 if s[1] < 0x0200 => "reserved (IETF protocol assignments)",
        // Segment routing SIDs.
        0x5f00 => "reserved",
        // Only 2000::/3 is global unicast (100::/64, discard-only, is outside it).
        0x2000..=0x3fff => return None,
        _ => "reserved",
    })
}

/// The operator's allow list, parsed: networks, host names and `*.suffix` patterns.
#[derive(Clone, Debug, Default)]
struct AllowList {
    nets: Vec<IpNet>,
    hosts: Vec<String>,
    suffixes: Vec<String>,
}

/// A host name as compared: lower case, without the root's trailing dot.
fn normalise(name: &str) -> String {
    name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase()
}

/// `localhost` and every name under it are the host itself (RFC 6761): never asked of DNS.
fn is_localhost(name: &str) -> bool {
    name == "localhost" || name.ends_with(".localhost")
}

impl AllowList {
    fn parse(entries: &[String]) -> Result<AllowList, String> {
        let mut list = AllowList::default();
        for entry in entries {
            let text = entry.trim();
            let bad = || {
                format!(
                    "{entry:?} is neither a CIDR (10.1.0.0/16), an IP address nor a host name \
                     (mcp.internal, *.mcp.internal)"
                )
            };
            if text.is_empty() {
                return Err(bad());
            }
            if let Ok(net) = text.parse::<IpNet>() {
                list.nets.push(net.trunc());
                continue;
            }
            if let Ok(ip) = text.trim_matches(['[', ']']).parse::<IpAddr>() {
                list.nets.push(IpNet::from(ip.to_canonical()));
                continue;
            }
            let (wildcard, name) = match text.strip_prefix("*.") {
                Some(rest) => (true, rest),
                None => (false, text),
            };
            match Host::parse(name) {
                Ok(Host::Domain(domain)) if !domain.contains('*') && !domain.is_empty() => {
                    let domain = normalise(&domain);
                    if wildcard {
                        list.suffixes.push(format!(".{domain}"));
                    } else {
                        list.hosts.push(domain);
                    }
                }
                // "127.1" and other spellings the URL parser reads as an address.
                Ok(Host::Ipv4(ip)) if !wildcard => list.nets.push(IpNet::from(IpAddr::V4(ip))),
                Ok(Host::Ipv6(ip)) if !wildcard => list.nets.push(IpNet::from(IpAddr::V6(ip))),
                Ok(_) | Err(_) => return Err(bad()),
            }
        }
        Ok(list)
    }

    fn allows_ip(&self, ip: IpAddr) -> bool {
        self.nets.iter().any(|net| net.contains(&ip))
    }

    /// `name` normalised.
    fn allows_host(&self, name: &str) -> bool {
        self.hosts.iter().any(|host| host == name)
            || self.suffixes.iter().any(|suffix| name.ends_with(suffix))
    }
}

/// How names are resolved: the system's resolver, or one a test gives.
pub type Lookup = Arc<
    dyn Fn(String) -> Pin<Box<dyn Future<Output = std::io::Result<Vec<IpAddr>>> + Send>>
        + Send
        + Sync,
>;

fn system_lookup() -> Lookup {
    Arc::new(|name: String| {
        Box::pin(async move {
            let found = tokio::net::lookup_host((name.as_str(), 0)).await?;
            Ok(found.map(|addr| addr.ip()).collect())
        })
    })
}

/// The policy, with the operator's allow list. Cheap to clone.
#[derive(Clone)]
pub struct Egress {
    allow: Arc<AllowList>,
    lookup: Lookup,
    lookup_timeout: Duration,
}

impl std::fmt::Debug for Egress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Egress")
            .field("allow", &self.allow)
            .finish_non_exhaustive()
    }
}

impl Egress {
    /// The policy with `allow` (CIDRs, IP addresses, host names, `*.suffix`); an error names
    /// the entry that is none of those.
    pub fn new(allow: &[String]) -> Result<Egress, String> {
        Ok(Egress {
            allow: Arc::new(AllowList::parse(allow)?),
            lookup: system_lookup(),
            lookup_timeout: LOOKUP_TIMEOUT,
        })
    }

    /// The same policy with names resolved by `lookup`, given `timeout` (tests).
    pub fn with_lookup(mut self, lookup: Lookup, timeout: Duration) -> Egress {
        self.lookup = lookup;
        self.lookup_timeout = timeout;
        self
    }

    /// Whether a connection to `ip` may be made; if not, why.
    pub fn check_ip(&self, ip: IpAddr) -> Result<(), &'static str> {
        let ip = ip.to_canonical();
        if self.allow.allows_ip(ip) {
            return Ok(());
        }
        classify(ip).map_or(Ok(()), Err)
    }

    /// The checks of a URL that need no DNS, to make before every request (a request to an
    /// IP literal reaches no resolver): http(s), no user info, a host, and for an IP literal
    /// or `localhost` an address the policy allows. A host name that resolves is checked by
    /// the client's resolver when it connects.
    pub fn check_target(&self, url: &Url) -> Result<(), EgressError> {
        if !matches!(url.scheme(), "http" | "https") {
            return Err(EgressError::Scheme);
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(EgressError::Userinfo);
        }
        let refused = |host: String, why| EgressError::Refused { host, why };
        match url.host() {
            None => Err(EgressError::NoHost),
            Some(Host::Ipv4(ip)) => self
                .check_ip(IpAddr::V4(ip))
                .map_err(|why| refused(ip.to_string(), why)),
            Some(Host::Ipv6(ip)) => self
                .check_ip(IpAddr::V6(ip))
                .map_err(|why| refused(format!("[{ip}]"), why)),
            Some(Host::Domain(name)) => {
                let name = normalise(name);
                if !self.allow.allows_host(&name) && is_localhost(&name) {
                    self.localhost(&name)?;
                }
                Ok(())
            }
        }
    }

    /// `localhost`'s addresses that the policy allows (those of the allow list), or the
    /// refusal.
    fn localhost(&self, name: &str) -> Result<Vec<IpAddr>, EgressError> {
        let allowed: Vec<IpAddr> = [Ipv4Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into()]
            .into_iter()
            .filter(|ip| self.check_ip(*ip).is_ok())
            .collect();
        if allowed.is_empty() {
            Err(EgressError::Refused {
                host: name.to_owned(),
                why: "loopback",
            })
        } else {
            Ok(allowed)
        }
    }

    /// A URL a tenant registers: [`check_target`](Self::check_target), then its host name
    /// resolved (within [`LOOKUP_TIMEOUT`]) and refused when every address is. A name that
    /// does not resolve now is accepted: it is resolved and checked again at each connection.
    pub async fn check_url(&self, url: &Url) -> Result<(), EgressError> {
        self.check_target(url)?;
        if let Some(Host::Domain(name)) = url.host() {
            match self.resolve(name).await {
                Ok(_) => {}
                Err(error) if error.is_refusal() => return Err(error),
                Err(_) => {}
            }
        }
        Ok(())
    }

    /// The addresses of `name` a connection may go to: all of them for a name on the allow
    /// list, otherwise those the policy allows; an error when none is.
    pub async fn resolve(&self, name: &str) -> Result<Vec<IpAddr>, EgressError> {
        let host = normalise(name);
        let listed = self.allow.allows_host(&host);
        if !listed && is_localhost(&host) {
            return self.localhost(&host);
        }
        let found =
            match tokio::time::timeout(self.lookup_timeout, (self.lookup)(host.clone())).await {
                Err(_) => return Err(EgressError::LookupTimeout { host }),
                Ok(Err(_)) => return Err(EgressError::Unresolved { host }),
                Ok(Ok(found)) if found.is_empty() => return Err(EgressError::Unresolved { host }),
                Ok(Ok(found)) => found,
            };
        if listed {
            return Ok(found);
        }
        let mut why = None;
        let allowed: Vec<IpAddr> = found
            .into_iter()
            .filter(|ip| match self.check_ip(*ip) {
                Ok(()) => true,
                Err(reason) => {
                    why.get_or_insert(reason);
                    false
                }
            })
            .collect();
        match why {
            Some(why) if allowed.is_empty() => Err(EgressError::Refused { host, why }),
            Some(why) => {
                tracing::debug!(%host, why, "some addresses of the host are refused; the others are used");
                Ok(allowed)
            }
            None => Ok(allowed),
        }
    }

    /// A client under this policy: `configure` sets timeouts and the like; then the policy's
    /// resolver, no redirects and no proxy are set over whatever it set.
    pub fn client(
        &self,
        configure: impl FnOnce(reqwest::ClientBuilder) -> reqwest::ClientBuilder,
    ) -> reqwest::Result<Client> {
        crate::install_crypto();
        let http = configure(reqwest::Client::builder())
            .dns_resolver(Resolver(self.clone()))
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .build()?;
        Ok(Client {
            http,
            egress: self.clone(),
        })
    }
}

/// The resolver of a [`Client`]: the policy's [`Egress::resolve`].
struct Resolver(Egress);

impl reqwest::dns::Resolve for Resolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let egress = self.0.clone();
        let name = name.as_str().to_owned();
        Box::pin(async move {
            let allowed = egress.resolve(&name).await?;
            let addrs: reqwest::dns::Addrs =
                Box::new(allowed.into_iter().map(|ip| SocketAddr::new(ip, 0)));
            Ok(addrs)
        })
    }
}

/// An HTTP client under the policy: its resolver refuses what the policy refuses, it follows
/// no redirect (a reply of 3xx is the answer) and uses no proxy. Requests go through
/// [`execute`](Self::execute), which checks the URL first; code that uses [`http`](Self::http)
/// directly must call [`check`](Self::check) on each URL.
#[derive(Clone, Debug)]
pub struct Client {
    http: reqwest::Client,
    egress: Egress,
}

impl Client {
    /// [`Egress::check_target`] of this client's policy.
    pub fn check(&self, url: &Url) -> Result<(), EgressError> {
        self.egress.check_target(url)
    }

    /// Sends `request` if its URL passes [`check`](Self::check).
    pub async fn execute(&self, request: reqwest::Request) -> Result<reqwest::Response, Error> {
        self.check(request.url())?;
        Ok(self.http.execute(request).await?)
    }

    /// The underlying client, for requests whose URL was checked.
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }
}

/// A request of a [`Client`] that was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Egress(#[from] EgressError),
    #[error(transparent)]
    Http(#[from] reqwest::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn egress(allow: &[&str]) -> Egress {
        Egress::new(&allow.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
            .expect("a valid allow list")
    }

    /// What the policy says of a URL without DNS: `Ok(())` or the reason.
    fn target(egress: &Egress, url: &str) -> Result<(), String> {
        let url = Url::parse(url).map_err(|e| format!("unparsable: {e}"))?;
        egress.check_target(&url).map_err(|e| e.to_string())
    }

    #[test]
    fn internal_addresses_are_refused_in_every_spelling() {
        let none = egress(&[]);
        let cases = [
            // IPv4 loopback, as the URL parser reads them (WHATWG).
            ("http://127.0.0.1/", "loopback"),
            ("http://127.0.0.1:5432/", "loopback"),
            ("http://127.1/", "loopback"),
            ("http://127.0.1/", "loopback"),
            ("http://2130706433/", "loopback"),
            ("http://0x7f000001/", "loopback"),
            ("http://0x7f.1/", "loopback"),
            ("http://0x7F.0.0.1/", "loopback"),
            ("http://0177.0.0.1/", "loopback"),
            ("http://017700000001/", "loopback"),
            ("http://127.0.0.1./", "loopback"),
            ("http://127.000.000.001/", "loopback"),
            ("http://%31%32%37.0.0.1/", "loopback"),
            ("http://\u{ff11}\u{ff12}\u{ff17}.0.0.1/", "loopback"),
            ("http://127.255.255.254/", "loopback"),
            ("https://127.0.0.2:8443/mcp", "loopback"),
            // Unspecified ("this network"; 0.0.0.0 reaches the host).
            ("http://0.0.0.0/", "unspecified"),
            ("http://0/", "unspecified"),
            ("http://0.1.2.3/", "unspecified"),
            // Cloud metadata and link-local.
            ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
            ("http://2852039166/", "cloud metadata"),
            ("http://0xa9fea9fe/", "cloud metadata"),
            ("http://0251.0376.0251.0376/", "cloud metadata"),
            ("http://169.254.43518/", "cloud metadata"),
            ("http://[fd00:ec2::254]/", "cloud metadata"),
            ("http://[::ffff:169.254.169.254]/", "cloud metadata"),
            ("http://169.254.0.1/", "link-local"),
            ("http://[fe80::1]/", "link-local"),
            // Private, shared, unique local, site-local.
            ("http://10.0.0.1/", "private network"),
            ("http://10.255.255.255/", "private network"),
            ("http://012.0.0.1/", "private network"),
            ("http://167772161/", "private network"),
            ("http://172.16.0.1/", "private network"),
            ("http://172.31.255.255/", "private network"),
            ("http://192.168.1.1/", "private network"),
            ("http://0xc0a80101/", "private network"),
            ("http://100.64.0.1/", "shared address space (CGNAT)"),
            ("http://100.127.255.255/", "shared address space (CGNAT)"),
            ("http://100.100.100.200/", "shared address space (CGNAT)"),
            ("http://[fc00::1]/", "private network (unique local)"),
            ("http://[fd12:3456::1]/", "private network (unique local)"),
            ("http://[fec0::1]/", "private network (site-local)"),
            // IPv6 loopback and unspecified.
            ("http://[::1]/", "loopback"),
            ("http://[::1]:8080/", "loopback"),
            ("http://[0:0:0:0:0:0:0:1]/", "loopback"),
            ("http://[::]/", "unspecified"),
            // IPv4 inside IPv6: mapped, compatible, translated, NAT64, 6to4.
            ("http://[::ffff:127.0.0.1]/", "loopback"),
            ("http://[::ffff:7f00:1]/", "loopback"),
            ("http://[0:0:0:0:0:ffff:7f00:0001]/", "loopback"),
            ("http://[::ffff:10.0.0.1]/", "private network"),
            ("http://[::ffff:192.168.0.1]/", "private network"),
            ("http://[::127.0.0.1]/", "loopback"),
            ("http://[::7f00:1]/", "loopback"),
            ("http://[::8.8.8.8]/", "reserved (IPv4-compatible)"),
            ("http://[::ffff:0:127.0.0.1]/", "loopback"),
            ("http://[64:ff9b::127.0.0.1]/", "loopback"),
            ("http://[64:ff9b::a9fe:a9fe]/", "cloud metadata"),
            ("http://[64:ff9b::10.1.2.3]/", "private network"),
            (
                "http://[64:ff9b:1::8.8.8.8]/",
                "private network (local-use NAT64)",
            ),
            ("http://[2002:7f00:1::]/", "loopback"),
            ("http://[2002:a9fe:a9fe::1]/", "cloud metadata"),
            ("http://[2002:c0a8:101::]/", "private network"),
            // Multicast, broadcast, documentation, benchmarking, reserved.
            ("http://224.0.0.1/", "multicast"),
            ("http://239.255.255.250/", "multicast"),
            ("http://[ff02::1]/", "multicast"),
            ("http://255.255.255.255/", "broadcast"),
            ("http://4294967295/", "broadcast"),
            ("http://192.0.2.1/", "documentation"),
            ("http://198.51.100.7/", "documentation"),
            ("http://203.0.113.9/", "documentation"),
            ("http://[2001:db8::1]/", "documentation"),
            ("http://[3fff::1]/", "documentation"),
            ("http://198.18.0.1/", "benchmarking"),
            ("http://198.19.255.255/", "benchmarking"),
            ("http://[2001:2::1]/", "benchmarking"),
            ("http://240.0.0.1/", "reserved"),
            (
                "http://192.0.0.170/",
                "reserved (IETF protocol assignments)",
            ),
            ("http://192.88.99.1/", "reserved (6to4 relay anycast)"),
            ("http://[2001::1]/", "reserved (IETF protocol assignments)"),
            ("http://[100::1]/", "reserved"),
            ("http://[5f00::1]/", "reserved"),
            ("http://[4000::1]/", "reserved"),
            // localhost by name, in its spellings (never asked of DNS).
            ("http://localhost/", "loopback"),
            ("http://LOCALHOST:8080/", "loopback"),
            ("http://localhost./", "loopback"),
            ("http://api.localhost/", "loopback"),
            ("http://a.b.LocalHost./", "loopback"),
            ("http://%6c%6f%63%61%6c%68%6f%73%74/", "loopback"),
        ];
        for (url, why) in cases {
            let got = target(&none, url);
            assert!(
                matches!(&got, Err(text) if text.ends_with(&format!("is not allowed ({why})"))),
                "{url}: expected refused ({why}), got {got:?}"
            );
        }
    }

    #[test]
    fn public_addresses_and_names_pass_the_target_check() {
        let none = egress(&[]);
        for url in [
            "http://8.8.8.8/",
            "https://1.1.1.1:8443/mcp",
            "http://134744072/",
            "http://[2606:4700:4700::1111]/",
            "http://[::ffff:8.8.8.8]/",
            "http://[64:ff9b::8.8.8.8]/",
            "http://[2002:808:808::1]/",
            "http://100.63.255.255/",
            "http://100.128.0.1/",
            "http://172.15.255.255/",
            "http://172.32.0.1/",
            "http://192.169.0.1/",
            "http://169.253.255.255/",
            "http://198.20.0.1/",
            "http://223.255.255.255/",
            // Names are resolved (and checked) at registration and at connect time.
            "https://mcp.example.com/mcp",
            "http://localhost.example.com/",
            "http://notlocalhost/",
        ] {
            assert_eq!(target(&none, url), Ok(()), "{url}");
        }
    }

    #[test]
    fn the_form_of_a_url_is_checked() {
        let none = egress(&[]);
        for (url, error) in [
            ("ftp://example.com/", EgressError::Scheme),
            ("file:///etc/passwd", EgressError::Scheme),
            ("gopher://127.0.0.1:6379/", EgressError::Scheme),
            ("http://user@example.com/", EgressError::Userinfo),
            ("http://user:pw@example.com/", EgressError::Userinfo),
            ("http://:pw@example.com/", EgressError::Userinfo),
        ] {
            let parsed = Url::parse(url).expect("parses");
            assert_eq!(none.check_target(&parsed), Err(error), "{url}");
        }
    }

    #[test]
    fn the_allow_list_lets_chosen_addresses_and_names_through() {
        let allow = egress(&[
            "10.1.0.0/16",
            "127.0.0.1",
            "fd00:1::/32",
            "mcp.internal",
            "*.tools.corp.",
        ]);
        assert_eq!(target(&allow, "http://10.1.2.3/"), Ok(()));
        assert_eq!(target(&allow, "http://[::ffff:10.1.2.3]/"), Ok(()));
        assert_eq!(target(&allow, "http://0xa010203/"), Ok(()));
        assert!(target(&allow, "http://10.2.0.1/").is_err());
        assert_eq!(target(&allow, "http://127.0.0.1:9/"), Ok(()));
        assert_eq!(target(&allow, "http://127.1:9/"), Ok(()));
        assert!(target(&allow, "http://127.0.0.2/").is_err());
        assert!(target(&allow, "http://169.254.169.254/").is_err());
        assert_eq!(target(&allow, "http://[fd00:1::5]/"), Ok(()));
        assert!(target(&allow, "http://[fd00:2::5]/").is_err());
        // localhost: allowed through its address on the list.
        assert_eq!(target(&allow, "http://localhost:9/"), Ok(()));
        assert!(target(&egress(&["::1"]), "http://localhost/").is_ok());
        assert!(target(&egress(&["10.0.0.0/8"]), "http://localhost/").is_err());
        assert!(target(&egress(&["localhost"]), "http://localhost/").is_ok());
        // Host names and suffixes, in any case, with the root's dot.
        assert!(allow.allow.allows_host("mcp.internal"));
        assert!(allow.allow.allows_host("a.tools.corp"));
        assert!(!allow.allow.allows_host("tools.corp"));
        assert!(!allow.allow.allows_host("xmcp.internal"));
        assert!(!allow.allow.allows_host("mcp.internal.evil"));
        for bad in [
            "",
            "10.1.0.0/33",
            "not a host",
            "http://x/",
            "*",
            "a*b.c",
            "*.10.0.0.1",
        ] {
            let error = Egress::new(&[bad.to_owned()]).expect_err(bad);
            assert!(error.contains(&format!("{bad:?}")), "{error}");
        }
    }

    fn lookup(table: &'static [(&'static str, &'static [&'static str])]) -> Lookup {
        Arc::new(move |name: String| {
            Box::pin(async move {
                table
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, ips)| ips.iter().filter_map(|ip| ip.parse().ok()).collect())
                    .ok_or_else(|| std::io::Error::other("no such name"))
            })
        })
    }

    const TABLE: &[(&str, &[&str])] = &[
        (
            "public.test",
            &["93.184.215.14", "2606:2800:21f:cb07:6820:80da:af6b:8b2c"],
        ),
        ("internal.test", &["10.0.0.7"]),
        ("rebind.test", &["127.0.0.1"]),
        ("metadata.test", &["169.254.169.254", "fd00:ec2::254"]),
        ("mixed.test", &["127.0.0.1", "93.184.215.14", "10.0.0.1"]),
        ("mcp.internal", &["10.9.9.9", "127.0.0.1"]),
        ("mapped.test", &["::ffff:127.0.0.1"]),
    ];

    #[tokio::test]
    async fn names_are_judged_by_what_they_resolve_to() {
        let none = egress(&[]).with_lookup(lookup(TABLE), LOOKUP_TIMEOUT);
        let refused = |host: &str, why| {
            Err::<Vec<IpAddr>, _>(EgressError::Refused {
                host: host.into(),
                why,
            })
        };
        assert_eq!(none.resolve("public.test").await.map(|v| v.len()), Ok(2));
        assert_eq!(
            none.resolve("internal.test").await,
            refused("internal.test", "private network")
        );
        assert_eq!(
            none.resolve("REBIND.test.").await,
            refused("rebind.test", "loopback")
        );
        assert_eq!(
            none.resolve("metadata.test").await,
            refused("metadata.test", "cloud metadata")
        );
        assert_eq!(
            none.resolve("mapped.test").await,
            refused("mapped.test", "loopback")
        );
        // Only the allowed addresses of a name are connected to.
        assert_eq!(
            none.resolve("mixed.test").await,
            Ok(vec!["93.184.215.14".parse().expect("an address")])
        );
        assert_eq!(
            none.resolve("nowhere.test").await,
            Err(EgressError::Unresolved {
                host: "nowhere.test".into()
            })
        );
        // localhost is not asked of DNS.
        assert_eq!(
            none.resolve("localhost").await,
            refused("localhost", "loopback")
        );
        // A name on the allow list gets whatever it resolves to; a network, those addresses.
        let allow =
            egress(&["mcp.internal", "127.0.0.0/8"]).with_lookup(lookup(TABLE), LOOKUP_TIMEOUT);
        assert_eq!(allow.resolve("mcp.internal").await.map(|v| v.len()), Ok(2));
        assert_eq!(
            allow.resolve("rebind.test").await,
            Ok(vec!["127.0.0.1".parse().expect("an address")])
        );
        assert_eq!(
            allow.resolve("localhost").await,
            Ok(vec!["127.0.0.1".parse().expect("an address")])
        );
        assert!(allow.resolve("internal.test").await.is_err());

        // Registration: refused only when every address is.
        let url = |u: &str| Url::parse(u).expect("a URL");
        assert!(none.check_url(&url("http://public.test/mcp")).await.is_ok());
        assert!(none.check_url(&url("http://mixed.test/mcp")).await.is_ok());
        assert!(
            none.check_url(&url("http://nowhere.test/mcp"))
                .await
                .is_ok()
        );
        assert_eq!(
            none.check_url(&url("http://internal.test/mcp"))
                .await
                .map_err(|e| e.to_string()),
            Err("the address of internal.test is not allowed (private network)".into())
        );
    }

    #[tokio::test]
    async fn a_slow_resolver_is_given_up_on() {
        let slow: Lookup = Arc::new(|_| {
            Box::pin(async {
                tokio::time::sleep(Duration::from_secs(60)).await;
                Ok(vec![])
            })
        });
        let none = egress(&[]).with_lookup(slow, Duration::from_millis(100));
        assert_eq!(
            none.resolve("slow.test").await,
            Err(EgressError::LookupTimeout {
                host: "slow.test".into()
            })
        );
        // Accepted at registration; checked again when connecting.
        let url = Url::parse("http://slow.test/").expect("a URL");
        assert!(none.check_url(&url).await.is_ok());
    }
}
