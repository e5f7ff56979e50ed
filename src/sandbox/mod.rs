//! The tool sandbox (docs/security.md): every tool process runs confined by the kernel.
//!
//! A run gets its own user, mount, PID, IPC and (network off) network namespaces. Its root
//! is a read-only tmpfs holding only bind mounts of what it may see: the system paths
//! read-only, minus hidden secrets; a minimal /dev; a private /tmp; its conversation's cwd
//! read-write. Landlock then allows exactly those paths (and, with network on, only the
//! configured TCP ports), so even a mistake in the mount list stays closed. Resource limits
//! bound each process and the process count bounds the run. When the server runs as root,
//! tool processes run as `sandbox.uid`, which owns the working directories.
//!
//! [`Sandbox::new`] checks the kernel and runs a self-test; it fails, naming what is missing,
//! when the configured confinement cannot be had (fail closed).

#[allow(unsafe_code)] // system calls between clone and exec; see child.rs
mod child;

use std::collections::BTreeSet;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use landlock::{
    ABI, Access, AccessFs, AccessNet, CompatLevel, Compatible, NetPort, PathBeneath, PathFd,
    Ruleset, RulesetAttr, RulesetCreated, RulesetCreatedAttr, Scope,
};

pub use child::SETUP_FAILED;
use child::{INSIDE_ID, Plan, Step};

use crate::config::{SandboxMode, SandboxSettings, Settings};
use crate::workspace::Pinned;

/// Device nodes a tool gets in its /dev.
const DEVICES: [&str; 5] = ["null", "zero", "full", "random", "urandom"];

/// The oldest Landlock ABI the sandbox works with: filesystem rules with truncate and
/// TCP port rules.
const MIN_ABI: ABI = ABI::V4;

/// A read-only path of the host, as found at start.
#[derive(Clone, Debug)]
enum Visible {
    Dir(PathBuf, libc::c_ulong),
    File(PathBuf, libc::c_ulong),
    Symlink(PathBuf, PathBuf),
}

/// What the kernel offers, read at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelSupport {
    /// The Landlock ABI version (0: none).
    pub landlock_abi: i32,
}

impl KernelSupport {
    pub fn detect() -> Self {
        // SAFETY: the documented ABI-version query of landlock_create_ruleset.
        #[allow(unsafe_code)]
        let version = unsafe {
            libc::syscall(
                libc::SYS_landlock_create_ruleset,
                std::ptr::null::<libc::c_void>(),
                0usize,
                1u32, // LANDLOCK_CREATE_RULESET_VERSION
            )
        };
        KernelSupport {
            landlock_abi: i32::try_from(version).unwrap_or(0).max(0),
        }
    }

    /// What the configured confinement needs and the kernel lacks (empty: all there).
    pub fn missing(&self, network_on_anywhere: bool) -> Vec<String> {
        let mut missing = Vec::new();
        if self.landlock_abi < MIN_ABI as i32 {
            missing.push(format!(
                "Landlock ABI {} or later (the kernel offers {}; Linux 6.7+ with landlock in the lsm= list)",
                MIN_ABI as i32,
                if self.landlock_abi == 0 {
                    "none".to_owned()
                } else {
                    self.landlock_abi.to_string()
                }
            ));
        } else if network_on_anywhere && self.landlock_abi < ABI::V6 as i32 {
            missing.push(format!(
                "Landlock ABI 6 (scoped abstract UNIX sockets and signals), needed because \
                 sandbox.network lets some tenants' tools use the host's network; the kernel offers {}",
                self.landlock_abi
            ));
        }
        missing
    }
}

/// A run's network access.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Network {
    /// A network namespace of its own with only loopback.
    #[default]
    Off,
    /// The host's network, TCP only to `sandbox.network.tcp_ports`.
    On,
}

/// The confinement of tool processes, set up once at start.
#[derive(Debug)]
pub struct Sandbox {
    settings: SandboxSettings,
    abi: ABI,
    /// The mount point of every run's new root.
    root: PathBuf,
    /// Where the private temp dirs live.
    tmp: PathBuf,
    /// Ids tool processes have on the host: (uid, gid), and whether to switch to them.
    owner: (u32, u32),
    switch_user: bool,
    /// The mount steps every run shares, built once: the new root, the read-only paths,
    /// the hidden ones, /dev, and the directories for /tmp and the old root.
    base: std::sync::Arc<[Step]>,
    /// The directories (host paths) the base steps create inside the new root.
    made: BTreeSet<PathBuf>,
    /// The mount flags of the filesystem of the temp dirs.
    tmp_flags: libc::c_ulong,
    /// Landlock's read-only and device rules, opened once.
    read_only: Vec<PathFd>,
    devices: Vec<PathFd>,
    passthrough: Vec<(String, String)>,
}

/// Why the sandbox cannot start.
#[derive(Debug, thiserror::Error)]
#[error(
    "the tool sandbox cannot start: {0}. Fix it, or set sandbox.mode = \"off\" (BEDROCK_SANDBOX__MODE=off) to run tools unconfined"
)]
pub struct SandboxError(pub String);

impl Sandbox {
    /// Checks the kernel and the settings and prepares the directories. `None` when the
    /// sandbox is off.
    pub fn new(settings: &Settings) -> Result<Option<Sandbox>, SandboxError> {
        let config = &settings.sandbox;
        if config.mode == SandboxMode::Off {
            return Ok(None);
        }
        let network_on_anywhere = !config.network.tenants.is_empty()
            || !config.network.per_conversation_tenants.is_empty();
        let kernel = KernelSupport::detect();
        let missing = kernel.missing(network_on_anywhere);
        if !missing.is_empty() {
            return Err(SandboxError(format!(
                "the kernel lacks {}",
                missing.join(" and ")
            )));
        }
        let abi = ABI::from(kernel.landlock_abi);
        let dir = config.dir(&settings.data);
        let io = |what: &str, path: &Path, e: std::io::Error| {
            SandboxError(format!("{what} {}: {e}", path.display()))
        };
        std::fs::create_dir_all(&dir).map_err(|e| io("cannot create", &dir, e))?;
        let dir = dir
            .canonicalize()
            .map_err(|e| io("cannot resolve", &dir, e))?;
        let root = dir.join("root");
        let tmp = dir.join("tmp");
        for path in [&root, &tmp] {
            std::fs::create_dir_all(path).map_err(|e| io("cannot create", path, e))?;
        }
        let (euid, egid) = (
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
        );
        let switch_user = euid == 0;
        let owner = if switch_user {
            (config.uid, config.gid)
        } else {
            (euid, egid)
        };
        if switch_user && config.uid == 0 {
            return Err(SandboxError(
                "sandbox.uid is 0: tool processes must not run as root".into(),
            ));
        }
        let visible = read_only_entries(&config.read_only_paths)?;
        let hidden: Vec<(PathBuf, bool)> = config
            .hidden_paths
            .iter()
            .filter_map(|path| {
                std::fs::symlink_metadata(path)
                    .ok()
                    .map(|m| (path.clone(), m.is_dir()))
            })
            .collect();
        // The server's own files, other workspaces and other runs' temp dirs must not be
        // among what tools see.
        for (setting, path, why) in [
            (
                "data.dir",
                &settings.data.dir,
                "tools would read the database",
            ),
            (
                "workspace.root",
                &settings.workspace.root,
                "tools would see every tenant's workspace",
            ),
            ("sandbox.dir", &dir, "tools would see other runs' temp dirs"),
        ] {
            let real = path.canonicalize().unwrap_or_else(|_| path.clone());
            if let Some(under) = exposes(&visible, &hidden, &real) {
                return Err(SandboxError(format!(
                    "{setting} {} lies under sandbox.read_only_paths ({}): {why}",
                    real.display(),
                    under.display()
                )));
            }
        }
        let mut base = RootBuilder {
            root: root.clone(),
            steps: Vec::new(),
            made: BTreeSet::new(),
        };
        base.shared(&visible, &hidden)
            .map_err(|e| SandboxError(format!("cannot plan the sandbox's root: {e}")))?;
        let open = |path: &Path| {
            PathFd::new(path)
                .map_err(|e| SandboxError(format!("cannot open {}: {e}", path.display())))
        };
        let read_only = visible
            .iter()
            .filter_map(|v| match v {
                Visible::Dir(path, _) | Visible::File(path, _) => Some(open(path)),
                Visible::Symlink(..) => None,
            })
            .collect::<Result<_, _>>()?;
        let devices = DEVICES
            .iter()
            .map(|name| open(&Path::new("/dev").join(name)))
            .collect::<Result<_, _>>()?;
        Ok(Some(Sandbox {
            settings: config.clone(),
            abi,
            tmp_flags: mount_flags(&tmp).map_err(|e| io("cannot stat", &tmp, e))?,
            root,
            tmp,
            owner,
            switch_user,
            base: base.steps.into(),
            made: base.made,
            read_only,
            devices,
            passthrough: config
                .env_passthrough
                .iter()
                .filter_map(|name| std::env::var(name).ok().map(|v| (name.clone(), v)))
                .collect(),
        }))
    }

    /// The ids tool processes have on the host; files the server writes for them (the
    /// patch tool's) are given to these.
    pub fn owner(&self) -> Option<(u32, u32)> {
        self.switch_user.then_some(self.owner)
    }

    /// The network a new conversation of `tenant` gets (`requested`: what it asked for).
    /// The lists name tenants by id or by name.
    pub fn network_for(&self, tenant: &crate::model::Tenant, requested: bool) -> Network {
        let network = &self.settings.network;
        let listed = |list: &[String]| list.iter().any(|t| *t == tenant.id || *t == tenant.name);
        if listed(&network.tenants) || (requested && listed(&network.per_conversation_tenants)) {
            Network::On
        } else {
            Network::Off
        }
    }

    /// The extra environment of tool processes.
    pub fn passthrough(&self) -> &[(String, String)] {
        &self.passthrough
    }

    /// A summary for /readyz and the start-up log.
    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "mode": "enforce",
            "landlock_abi": self.abi as i32,
            "run_as": if self.switch_user { Some(self.owner.0) } else { None },
            "network_tenants": self.settings.network.tenants.len()
                + self.settings.network.per_conversation_tenants.len(),
        })
    }

    /// Checks that a TCP port the server depends on is not open to tools with network on.
    pub fn check_port(&self, port: u16, what: &str) -> Result<(), SandboxError> {
        if self.settings.network.tcp_ports.contains(&port) {
            return Err(SandboxError(format!(
                "sandbox.network.tcp_ports contains {port}, the port of {what}"
            )));
        }
        Ok(())
    }

    /// Prepares one run in `cwd`: its private temp dir, mount plan and Landlock ruleset.
    ///
    /// The directory is the one `cwd` was opened as: it is bind-mounted through its
    /// descriptor and Landlock is given the descriptor, so no path a tool could have
    /// changed is looked up again. The directory itself (never what is in it) is given to
    /// the tool user if it is not theirs.
    pub fn prepare(&self, cwd: &Pinned, network: Network) -> std::io::Result<Prepared> {
        let given = |path: &Path, e: std::io::Error| {
            std::io::Error::new(
                e.kind(),
                format!(
                    "cannot give {} to the tool user (uid {}): {e}",
                    path.display(),
                    self.owner.0
                ),
            )
        };
        if let Some(owner) = self.owner()
            && cwd.owner()? != owner
        {
            cwd.give(owner).map_err(|e| given(cwd.path(), e))?;
        }
        let tmp = self.tmp.join(uuid::Uuid::now_v7().simple().to_string());
        std::fs::create_dir(&tmp)?;
        let tmp = TempDir(tmp);
        std::fs::set_permissions(&tmp.0, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        if let Some((uid, gid)) = self.owner() {
            std::os::unix::fs::chown(&tmp.0, Some(uid), Some(gid)).map_err(|e| given(&tmp.0, e))?;
        }
        let plan = self.plan(cwd, &tmp.0, network)?;
        let ruleset = self.ruleset(cwd, &tmp.0, network).map_err(|e| {
            std::io::Error::other(format!("cannot build the Landlock ruleset: {e:#}"))
        })?;
        Ok(Prepared {
            plan,
            ruleset,
            tmp,
            _cwd: cwd.clone(),
        })
    }

    /// This run's steps after the shared ones: its temp dir, its cwd.
    fn plan(&self, pinned: &Pinned, tmp: &Path, network: Network) -> std::io::Result<Plan> {
        let cwd = pinned.path();
        let inside = |path: &Path| inside(&self.root, path);
        let mut steps = vec![bind(
            tmp,
            &inside(Path::new("/tmp")),
            libc::MS_NOSUID | libc::MS_NODEV | self.tmp_flags,
        )?];
        let mut at = PathBuf::from("/");
        for part in cwd.strip_prefix("/").unwrap_or(cwd).components() {
            at.push(part);
            if !self.made.contains(&at) {
                steps.push(Step::Mkdir(c_path(&inside(&at))?));
            }
        }
        // Opened again in the run's mount namespace the way it was opened here, and checked
        // to be the same directory.
        let (root, rel) = pinned.beneath();
        let (dev, ino) = pinned.identity()?;
        steps.push(Step::BindPinned {
            root: c_path(root)?,
            rel: c_path(rel)?,
            dev,
            ino,
            dst: c_path(&inside(cwd))?,
            remount: libc::MS_NOSUID
                | libc::MS_NODEV
                | fd_mount_flags(pinned.fd())?
                | libc::MS_NOSUID,
        });
        let old = Path::new("/.oldroot");
        let s = &self.settings;
        let limits = vec![
            (libc::RLIMIT_CPU, s.cpu_seconds),
            (libc::RLIMIT_AS, s.address_space_bytes),
            (libc::RLIMIT_NPROC, s.max_processes),
            (libc::RLIMIT_NOFILE, s.max_open_files),
            (libc::RLIMIT_FSIZE, s.max_file_bytes),
            (libc::RLIMIT_CORE, 0),
        ];
        Ok(Plan {
            switch_user: self.switch_user.then_some(self.owner),
            uid_map: CString::new(format!("{INSIDE_ID} {} 1\n", self.owner.0))?,
            gid_map: CString::new(format!("{INSIDE_ID} {} 1\n", self.owner.1))?,
            new_net: network == Network::Off,
            root: c_path(&self.root)?,
            base: self.base.clone(),
            steps,
            old_root: c_path(&inside(old))?,
            old_root_inside: c_path(old)?,
            cwd: c_path(cwd)?,
            limits,
            nice: s.nice,
            idle_scheduling: s.idle_scheduling,
        })
    }

    fn ruleset(
        &self,
        cwd: &Pinned,
        tmp: &Path,
        network: Network,
    ) -> anyhow::Result<RulesetCreated> {
        let abi = self.abi;
        let mut ruleset = Ruleset::default()
            .set_compatibility(CompatLevel::HardRequirement)
            .handle_access(AccessFs::from_all(abi))?;
        if network == Network::On {
            ruleset = ruleset
                .handle_access(AccessNet::from_all(abi))?
                .scope(Scope::from_all(abi))?;
        }
        let mut created = ruleset.create()?;
        for fd in &self.read_only {
            created = created.add_rule(PathBeneath::new(fd, AccessFs::from_read(abi)))?;
        }
        for fd in &self.devices {
            created = created.add_rule(PathBeneath::new(fd, AccessFs::from_file(abi)))?;
        }
        created = created.add_rule(PathBeneath::new(cwd.fd(), AccessFs::from_all(abi)))?;
        created = created.add_rule(PathBeneath::new(PathFd::new(tmp)?, AccessFs::from_all(abi)))?;
        if network == Network::On {
            for port in &self.settings.network.tcp_ports {
                created = created.add_rule(NetPort::new(*port, AccessNet::ConnectTcp))?;
            }
        }
        Ok(created)
    }
}

/// `path` inside the new root mounted at `root`.
fn inside(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// The read-only path under which `path` would be visible to tools, if any.
fn exposes(visible: &[Visible], hidden: &[(PathBuf, bool)], path: &Path) -> Option<PathBuf> {
    if hidden.iter().any(|(h, _)| path.starts_with(h)) {
        return None;
    }
    visible.iter().find_map(|v| match v {
        Visible::Dir(p, _) | Visible::File(p, _) => path.starts_with(p).then(|| p.clone()),
        Visible::Symlink(..) => None,
    })
}

/// Builds the mount steps every run shares.
struct RootBuilder {
    root: PathBuf,
    steps: Vec<Step>,
    made: BTreeSet<PathBuf>,
}

impl RootBuilder {
    fn inside(&self, path: &Path) -> PathBuf {
        inside(&self.root, path)
    }

    /// mkdir -p of `path` inside the new root.
    fn mkdir_all(&mut self, path: &Path) -> std::io::Result<()> {
        let mut at = PathBuf::from("/");
        for part in path.strip_prefix("/").unwrap_or(path).components() {
            at.push(part);
            if self.made.insert(at.clone()) {
                self.steps.push(Step::Mkdir(c_path(&self.inside(&at))?));
            }
        }
        Ok(())
    }

    fn shared(&mut self, visible: &[Visible], hidden: &[(PathBuf, bool)]) -> std::io::Result<()> {
        self.steps.push(Step::Tmpfs {
            dst: c_path(&self.root)?,
            data: CString::new("mode=0755,size=1m")?,
        });
        for entry in visible {
            match entry {
                Visible::Symlink(link, target) => self.steps.push(Step::Symlink {
                    target: c_path(target)?,
                    link: c_path(&self.inside(link))?,
                }),
                Visible::Dir(path, flags) => {
                    self.mkdir_all(path)?;
                    self.steps
                        .push(bind(path, &self.inside(path), libc::MS_RDONLY | flags)?);
                }
                Visible::File(path, flags) => {
                    if let Some(parent) = path.parent() {
                        self.mkdir_all(parent)?;
                    }
                    self.steps.push(Step::Touch(c_path(&self.inside(path))?));
                    self.steps
                        .push(bind(path, &self.inside(path), libc::MS_RDONLY | flags)?);
                }
            }
        }
        for (path, is_dir) in hidden {
            let dst = self.inside(path);
            if *is_dir {
                self.steps.push(Step::Tmpfs {
                    dst: c_path(&dst)?,
                    data: CString::new("mode=0555,size=4k")?,
                });
                self.steps.push(Step::ReadOnly(c_path(&dst)?));
            } else {
                self.steps
                    .push(bind(Path::new("/dev/null"), &dst, libc::MS_RDONLY)?);
            }
        }
        // A minimal /dev.
        let dev = Path::new("/dev");
        self.mkdir_all(dev)?;
        self.steps.push(Step::Tmpfs {
            dst: c_path(&self.inside(dev))?,
            data: CString::new("mode=0755,size=64k")?,
        });
        for name in DEVICES {
            let path = dev.join(name);
            self.steps.push(Step::Touch(c_path(&self.inside(&path))?));
            self.steps
                .push(bind(&path, &self.inside(&path), mount_flags(&path)?)?);
        }
        for (name, target) in [
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
        ] {
            self.steps.push(Step::Symlink {
                target: CString::new(target)?,
                link: c_path(&self.inside(&dev.join(name)))?,
            });
        }
        self.steps.push(Step::ReadOnly(c_path(&self.inside(dev))?));
        // Mount points of each run's temp dir, and of the old root for pivot_root.
        self.mkdir_all(Path::new("/tmp"))?;
        self.mkdir_all(Path::new("/.oldroot"))
    }
}

/// A job for the spawner thread, given its launch stacks.
type SpawnJob = Box<dyn FnOnce(Result<&child::Stacks, &std::io::Error>) + Send>;

/// Runs `job` on the one long-lived spawner thread and returns its answer.
///
/// The parent-death signal that ties a run to the server is sent when the *thread* that
/// started it exits, so runs must start from a thread that lives as long as the process
/// (not a blocking-pool thread, which ends when idle). Launching blocks for the
/// milliseconds the kernel takes to build the namespaces: on this thread, not on an async
/// worker.
async fn on_spawner<T: Send + 'static>(
    job: impl FnOnce(Result<&child::Stacks, &std::io::Error>) -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    static SPAWNER: std::sync::OnceLock<std::sync::mpsc::Sender<SpawnJob>> =
        std::sync::OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<SpawnJob>();
        let started = std::thread::Builder::new()
            .name("bedrock-spawner".into())
            .spawn(move || {
                let stacks = child::Stacks::new();
                while let Ok(job) = rx.recv() {
                    job(stacks.as_ref());
                }
            });
        if let Err(e) = started {
            tracing::error!(error = %e, "cannot start the tool spawner thread");
        }
        tx
    });
    let (reply, answer) = tokio::sync::oneshot::channel();
    let job: SpawnJob = Box::new(move |stacks| {
        let _ = reply.send(job(stacks));
    });
    let gone = || std::io::Error::other("the tool spawner thread is gone");
    spawner.send(job).map_err(|_| gone())?;
    answer.await.map_err(|_| gone())?
}

/// One run's preparation: its mount plan, Landlock ruleset and private temp dir.
#[derive(Debug)]
pub struct Prepared {
    plan: Plan,
    ruleset: RulesetCreated,
    tmp: TempDir,
    /// The working directory's descriptor, open until the run has started (the plan names
    /// it by number).
    _cwd: Pinned,
}

/// What a run executes: a program, its arguments, its environment and where its output
/// goes (standard input is /dev/null).
#[derive(Debug)]
pub struct Command {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub stdout: std::os::fd::OwnedFd,
    pub stderr: std::os::fd::OwnedFd,
}

/// A started run.
#[derive(Debug)]
pub enum Launched {
    Running(RunProcess),
    /// The sandbox could not be set up; the setup process said why on the run's stderr
    /// and exited so.
    SetupFailed(std::process::ExitStatus),
}

impl Prepared {
    /// Starts `command` in the sandbox. The temp dir lives as long as the run.
    pub async fn launch(self, command: Command) -> std::io::Result<Launched> {
        use std::os::unix::process::ExitStatusExt as _;
        let Prepared {
            plan,
            ruleset,
            tmp,
            _cwd: cwd,
        } = self;
        let ruleset = Option::<std::os::fd::OwnedFd>::from(ruleset)
            .ok_or_else(|| std::io::Error::other("the Landlock ruleset has no descriptor"))?;
        let c_string = |s: &str| CString::new(s).map_err(std::io::Error::other);
        let exec = child::Exec {
            program: c_path(&command.program)?,
            argv: std::iter::once(
                command
                    .program
                    .file_name()
                    .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
            )
            .chain(command.args)
            .map(|arg| c_string(&arg))
            .collect::<Result<_, _>>()?,
            env: command
                .env
                .iter()
                .map(|(k, v)| c_string(&format!("{k}={v}")))
                .collect::<Result<_, _>>()?,
            stdio: [
                above_stdio(std::fs::File::open("/dev/null")?.into())?,
                above_stdio(command.stdout)?,
                above_stdio(command.stderr)?,
            ],
        };
        // The job owns the descriptors: the run's copies of the output pipe close on the
        // spawner thread as soon as it has started, so the reader sees the end of output.
        let started = on_spawner(move |stacks| {
            let stacks = stacks.map_err(|e| std::io::Error::new(e.kind(), e.to_string()))?;
            let started = child::launch(&plan, &ruleset, &exec, stacks);
            drop(cwd);
            started
        })
        .await?;
        if started.pid1 == 0 {
            return Ok(Launched::SetupFailed(std::process::ExitStatus::from_raw(
                started.setup_status,
            )));
        }
        let pid = rustix::process::Pid::from_raw(started.pid1)
            .ok_or_else(|| std::io::Error::other("the sandbox reported no pid"))?;
        let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())
            .map_err(std::io::Error::from)?;
        // SAFETY: the AsyncFd owns the OwnedFd, which stays open and the same while it lives.
        #[allow(unsafe_code)]
        let pidfd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE)
        }
        .map_err(std::io::Error::from)?;
        Ok(Launched::Running(RunProcess {
            pid: started.pid1,
            group: started.setup_pid,
            pidfd,
            reaped: false,
            status: None,
            _tmp: tmp,
        }))
    }
}

/// PID 1 of a run: a child of the server, waited for through its pidfd.
#[derive(Debug)]
pub struct RunProcess {
    pid: i32,
    /// The run's process group (the setup process's pid).
    group: i32,
    pidfd: tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
    reaped: bool,
    status: Option<std::process::ExitStatus>,
    _tmp: TempDir,
}

impl RunProcess {
    /// The process group every process of the run is in.
    pub fn group(&self) -> i32 {
        self.group
    }

    /// Waits until it exits (and with it every process of the run) and reaps it.
    pub async fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        if let Some(status) = self.status {
            return Ok(status);
        }
        loop {
            let mut ready = self.pidfd.readable().await?;
            if let Some(status) = reap(self.pidfd.get_ref(), false)? {
                self.reaped = true;
                self.status = Some(status);
                return Ok(status);
            }
            ready.clear_ready();
        }
    }
}

impl Drop for RunProcess {
    fn drop(&mut self) {
        if self.reaped {
            return;
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        // Reap it off the async threads once the kernel has taken it down.
        if let Ok(fd) = self.pidfd.get_ref().try_clone() {
            let reap_it = move || {
                let _ = reap(&fd, true);
            };
            match tokio::runtime::Handle::try_current() {
                Ok(handle) => {
                    handle.spawn_blocking(reap_it);
                }
                Err(_) => reap_it(),
            }
        }
    }
}

/// waitid(P_PIDFD): the exit status, if it has exited (always, when `block`).
fn reap(
    pidfd: &std::os::fd::OwnedFd,
    block: bool,
) -> std::io::Result<Option<std::process::ExitStatus>> {
    use std::os::unix::process::ExitStatusExt;
    let mut options = rustix::process::WaitIdOptions::EXITED;
    if !block {
        options |= rustix::process::WaitIdOptions::NOHANG;
    }
    let Some(status) = rustix::process::waitid(
        rustix::process::WaitId::PidFd(std::os::fd::AsFd::as_fd(pidfd)),
        options,
    )
    .map_err(std::io::Error::from)?
    else {
        return Ok(None);
    };
    let raw = if let Some(signal) = status.terminating_signal() {
        signal
    } else {
        (status.exit_status().unwrap_or(0) & 0xff) << 8
    };
    Ok(Some(std::process::ExitStatus::from_raw(raw)))
}

/// A run's private temp dir, removed when dropped.
#[derive(Debug)]
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let path = std::mem::take(&mut self.0);
        // The tool wrote what is in it (a tree thousands of levels deep, say): removed by
        // descriptor, iteratively (std's removal recurses, and a blocking thread's stack is
        // small).
        let remove = move || {
            let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
                return;
            };
            let flags = rustix::fs::OFlags::RDONLY
                | rustix::fs::OFlags::DIRECTORY
                | rustix::fs::OFlags::CLOEXEC;
            if let Ok(dir) = rustix::fs::open(parent, flags, rustix::fs::Mode::empty()) {
                let _ = crate::workspace::remove_entry(&dir, Path::new(name));
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn_blocking(remove);
            }
            Err(_) => remove(),
        }
    }
}

/// `fd`, moved to a number above 2 if it is one of 0-2 (a server started with a standard
/// stream closed gets those numbers for new files).
fn above_stdio(fd: std::os::fd::OwnedFd) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::AsRawFd as _;
    // try_clone duplicates with F_DUPFD_CLOEXEC from 3 up.
    if fd.as_raw_fd() < 3 {
        fd.try_clone()
    } else {
        Ok(fd)
    }
}

fn c_path(path: &Path) -> std::io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)
}

/// The flags of the mount `path` is on that a bind remount must keep (the kernel refuses to
/// clear locked ones).
fn mount_flags(path: &Path) -> std::io::Result<libc::c_ulong> {
    let stat = nix::sys::statvfs::statvfs(path).map_err(std::io::Error::from)?;
    Ok(flags_of(&stat))
}

/// [`mount_flags`] of an open file or directory.
fn fd_mount_flags(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<libc::c_ulong> {
    let stat = nix::sys::statvfs::fstatvfs(fd).map_err(std::io::Error::from)?;
    Ok(flags_of(&stat))
}

fn flags_of(stat: &nix::sys::statvfs::Statvfs) -> libc::c_ulong {
    use nix::sys::statvfs::FsFlags;
    let flags = stat.flags();
    let mut out = 0;
    for (fs, ms) in [
        (FsFlags::ST_RDONLY, libc::MS_RDONLY),
        (FsFlags::ST_NOSUID, libc::MS_NOSUID),
        (FsFlags::ST_NODEV, libc::MS_NODEV),
        (FsFlags::ST_NOEXEC, libc::MS_NOEXEC),
        (FsFlags::ST_NOATIME, libc::MS_NOATIME),
        (FsFlags::ST_NODIRATIME, libc::MS_NODIRATIME),
        (FsFlags::ST_RELATIME, libc::MS_RELATIME),
    ] {
        if flags.contains(fs) {
            out |= ms;
        }
    }
    out
}

fn bind(src: &Path, dst: &Path, flags: libc::c_ulong) -> std::io::Result<Step> {
    Ok(Step::Bind {
        src: c_path(src)?,
        dst: c_path(dst)?,
        remount: flags | libc::MS_NOSUID,
    })
}

fn read_only_entries(paths: &[PathBuf]) -> Result<Vec<Visible>, SandboxError> {
    let mut entries = Vec::new();
    for path in paths {
        if !path.is_absolute() {
            return Err(SandboxError(format!(
                "sandbox.read_only_paths: {} is not absolute",
                path.display()
            )));
        }
        let Ok(meta) = std::fs::symlink_metadata(path) else {
            continue;
        };
        if meta.file_type().is_symlink() {
            let target = std::fs::read_link(path)
                .map_err(|e| SandboxError(format!("cannot read {}: {e}", path.display())))?;
            entries.push(Visible::Symlink(path.clone(), target));
            continue;
        }
        let flags = mount_flags(path)
            .map_err(|e| SandboxError(format!("cannot stat {}: {e}", path.display())))?;
        entries.push(if meta.is_dir() {
            Visible::Dir(path.clone(), flags)
        } else {
            Visible::File(path.clone(), flags)
        });
    }
    // Directories before what is under them.
    entries.sort_by_key(|e| match e {
        Visible::Dir(p, _) | Visible::File(p, _) | Visible::Symlink(p, _) => p.components().count(),
    });
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_to_expose_the_servers_files() {
        let base = std::env::temp_dir().join(format!("bedrock-expose-{}", std::process::id()));
        let env = |extra: &[(&str, String)]| {
            let mut env = vec![
                (
                    "BEDROCK_DATA_DIR".to_owned(),
                    base.join("data").display().to_string(),
                ),
                (
                    "BEDROCK_WORKSPACE_ROOT".to_owned(),
                    base.join("ws").display().to_string(),
                ),
            ];
            env.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
            Settings::load_from(None, env).expect("valid settings")
        };
        std::fs::create_dir_all(base.join("ws")).expect("a dir");
        assert!(Sandbox::new(&env(&[])).is_ok());
        let exposed = env(&[(
            "BEDROCK_SANDBOX__READ_ONLY_PATHS",
            format!("[\"/usr\", \"{}\"]", base.join("ws").display()),
        )]);
        let error = Sandbox::new(&exposed).expect_err("refused").to_string();
        assert!(error.contains("workspace.root"), "{error}");
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn missing_names_what_the_kernel_lacks() {
        let none = KernelSupport { landlock_abi: 0 };
        let missing = none.missing(false);
        assert_eq!(missing.len(), 1);
        assert!(missing[0].contains("Landlock ABI 4"), "{missing:?}");
        let v5 = KernelSupport { landlock_abi: 5 };
        assert!(v5.missing(false).is_empty());
        let needs_scopes = v5.missing(true);
        assert!(needs_scopes[0].contains("ABI 6"), "{needs_scopes:?}");
        assert!(KernelSupport { landlock_abi: 7 }.missing(true).is_empty());
    }
}
