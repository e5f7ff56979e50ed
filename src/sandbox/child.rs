//! What runs in the forked child before `exec`: namespaces, the new root, the drop to the
//! sandbox user, the per-run process (PID 1 of its own PID namespace), resource limits and
//! Landlock.
//!
//! A run is started the way `posix_spawn` starts a process: `clone(CLONE_VM | CLONE_VFORK)`
//! on a stack of its own, so the server's page tables are never copied (a `fork` of a large
//! server takes milliseconds and stalls its other threads on the memory-map lock). The
//! children share the server's memory until they `exec`, so this code only reads data the
//! parent prepared ([`Plan`], [`Exec`]) and makes raw system calls: no allocation, no
//! locks, no formatting, and no glibc wrapper that keeps process-wide state (the
//! credential calls go straight to the kernel). A step that fails writes `bedrock sandbox: <step> failed (errno N)` to
//! stderr and exits with status 125, so the reason reaches the tool result and the start-up
//! self-test verbatim instead of being lost as an errno.

use std::ffi::{CStr, CString};
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::sync::atomic::{AtomicI32, Ordering};

/// The inside uid and gid of a tool process.
pub const INSIDE_ID: u32 = 1000;

/// Exit status of a run whose sandbox could not be set up.
pub const SETUP_FAILED: i32 = 125;

#[derive(Debug)]
pub enum Step {
    Mkdir(CString),
    Touch(CString),
    Symlink {
        target: CString,
        link: CString,
    },
    /// A recursive bind mount; `remount` flags (read-only, nosuid, and the flags the source
    /// mount has locked) are applied in a second call, as the kernel requires.
    Bind {
        src: CString,
        dst: CString,
        remount: libc::c_ulong,
    },
    /// A bind mount of a directory the server opened as `rel` beneath `root` (no link on
    /// the way), opened again the same way in this mount namespace (a descriptor of the
    /// server's namespace cannot be bind-mounted here) and checked to be the same directory
    /// (`dev`, `ino`): a directory swapped meanwhile fails the run instead of being mounted.
    BindPinned {
        root: CString,
        rel: CString,
        dev: u64,
        ino: u64,
        dst: CString,
        remount: libc::c_ulong,
    },
    Tmpfs {
        dst: CString,
        data: CString,
    },
    /// Makes an already mounted tmpfs read-only.
    ReadOnly(CString),
}

/// Everything the child does, prepared by the parent.
#[derive(Debug)]
pub struct Plan {
    /// The server runs as root: build the root as root, then drop to these ids before the
    /// user namespace (so the process limit applies: the kernel exempts uid 0 from it).
    pub switch_user: Option<(libc::uid_t, libc::gid_t)>,
    pub uid_map: CString,
    pub gid_map: CString,
    pub new_net: bool,
    /// The mount point of the new root.
    pub root: CString,
    /// The steps every run shares (prepared once at start), then this run's own.
    pub base: std::sync::Arc<[Step]>,
    pub steps: Vec<Step>,
    /// `<root>/.oldroot`, and the same seen from the new root.
    pub old_root: CString,
    pub old_root_inside: CString,
    pub cwd: CString,
    pub limits: Vec<(libc::__rlimit_resource_t, libc::rlim_t)>,
    /// The nice value the run starts with.
    pub nice: libc::c_int,
    /// Run in the kernel's idle scheduling class (`SCHED_IDLE`).
    pub idle_scheduling: bool,
}

/// Writes a failure line to stderr and ends the process.
fn fail(step: &str, detail: &[u8]) -> ! {
    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    let mut digits = [0u8; 12];
    let mut n = errno.unsigned_abs();
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let parts: [&[u8]; 7] = [
        b"bedrock sandbox: ",
        step.as_bytes(),
        if detail.is_empty() { b"" } else { b" " },
        detail,
        b" failed (errno ",
        &digits[at..],
        b")\n",
    ];
    for part in parts {
        // SAFETY: writing a borrowed buffer to stderr.
        unsafe { libc::write(2, part.as_ptr().cast(), part.len()) };
    }
    // SAFETY: ends the child without running the parent's atexit handlers.
    unsafe { libc::_exit(SETUP_FAILED) }
}

fn check(result: libc::c_int, step: &str, detail: &CStr) {
    if result != 0 {
        fail(step, detail.to_bytes());
    }
}

/// Writes `content` to `path` relative to the directory `dir`.
fn write_file(dir: libc::c_int, path: &[u8], content: &CStr) {
    // SAFETY: NUL-terminated path and a borrowed buffer.
    unsafe {
        let fd = libc::openat(dir, path.as_ptr().cast(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            fail("open", &path[..path.len() - 1]);
        }
        let bytes = content.to_bytes();
        if libc::write(fd, bytes.as_ptr().cast(), bytes.len()) != bytes.len() as isize {
            fail("write", &path[..path.len() - 1]);
        }
        libc::close(fd);
    }
}

fn null() -> *const libc::c_char {
    std::ptr::null()
}

/// A recursive bind mount of `src` (named `shown` in a failure) on `dst`, then the
/// `remount` flags.
///
/// # Safety
/// `src` is a NUL-terminated string.
unsafe fn bind(src: *const libc::c_char, shown: &CStr, dst: &CStr, remount: libc::c_ulong) {
    // SAFETY: mount calls on NUL-terminated strings.
    unsafe {
        check(
            libc::mount(
                src,
                dst.as_ptr(),
                null(),
                libc::MS_BIND | libc::MS_REC,
                std::ptr::null(),
            ),
            "bind",
            shown,
        );
        if remount != 0 {
            check(
                libc::mount(
                    null(),
                    dst.as_ptr(),
                    null(),
                    libc::MS_REMOUNT | libc::MS_BIND | remount,
                    std::ptr::null(),
                ),
                "remount",
                dst,
            );
        }
    }
}

/// The kernel's `struct open_how` (libc's is non-exhaustive).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// `/proc/self/fd/<fd>` written into `buf` (NUL-terminated), without allocating.
fn proc_fd_path(fd: libc::c_int, buf: &mut [u8; 32]) -> *const libc::c_char {
    let prefix = b"/proc/self/fd/";
    buf[..prefix.len()].copy_from_slice(prefix);
    let mut digits = [0u8; 10];
    let mut n = fd.unsigned_abs();
    let mut count = 0;
    loop {
        digits[count] = b'0' + (n % 10) as u8;
        count += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for i in 0..count {
        buf[prefix.len() + i] = digits[count - 1 - i];
    }
    buf[prefix.len() + count] = 0;
    buf.as_ptr().cast()
}

/// Builds the new root and moves into it.
fn build_root(plan: &Plan) {
    // SAFETY: system calls on NUL-terminated strings owned by the plan.
    unsafe {
        let slash = c"/";
        check(
            libc::mount(
                null(),
                slash.as_ptr(),
                null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ),
            "make / private",
            c"",
        );
        for step in plan.base.iter().chain(&plan.steps) {
            match step {
                Step::Mkdir(path) => {
                    if libc::mkdir(path.as_ptr(), 0o755) != 0
                        && std::io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST)
                    {
                        fail("mkdir", path.as_bytes());
                    }
                }
                Step::Touch(path) => {
                    let fd = libc::open(
                        path.as_ptr(),
                        libc::O_WRONLY | libc::O_CREAT | libc::O_CLOEXEC,
                        0o644,
                    );
                    if fd < 0 {
                        fail("create", path.as_bytes());
                    }
                    libc::close(fd);
                }
                Step::Symlink { target, link } => {
                    check(
                        libc::symlink(target.as_ptr(), link.as_ptr()),
                        "symlink",
                        link,
                    );
                }
                Step::Bind { src, dst, remount } => {
                    bind(src.as_ptr(), src, dst, *remount);
                }
                Step::BindPinned {
                    root,
                    rel,
                    dev,
                    ino,
                    dst,
                    remount,
                } => {
                    let base = libc::open(
                        root.as_ptr(),
                        libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
                    );
                    if base < 0 {
                        fail("open", root.as_bytes());
                    }
                    let how = OpenHow {
                        flags: (libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) as u64,
                        mode: 0,
                        resolve: libc::RESOLVE_BENEATH
                            | libc::RESOLVE_NO_SYMLINKS
                            | libc::RESOLVE_NO_MAGICLINKS,
                    };
                    let fd = libc::syscall(
                        libc::SYS_openat2,
                        base,
                        rel.as_ptr(),
                        &raw const how,
                        size_of::<OpenHow>(),
                    ) as libc::c_int;
                    if fd < 0 {
                        fail(
                            "open the working directory (through no link)",
                            rel.as_bytes(),
                        );
                    }
                    let mut stat: libc::stat = std::mem::zeroed();
                    check(libc::fstat(fd, &mut stat), "fstat", rel);
                    if stat.st_dev != *dev || stat.st_ino != *ino {
                        *libc::__errno_location() = libc::ESTALE;
                        fail(
                            "the working directory was replaced while the run started:",
                            rel.as_bytes(),
                        );
                    }
                    let mut name = [0u8; 32];
                    let src = proc_fd_path(fd, &mut name);
                    bind(src, rel, dst, *remount);
                    libc::close(fd);
                    libc::close(base);
                }
                Step::Tmpfs { dst, data } => {
                    check(
                        libc::mount(
                            c"tmpfs".as_ptr(),
                            dst.as_ptr(),
                            c"tmpfs".as_ptr(),
                            libc::MS_NOSUID | libc::MS_NODEV,
                            data.as_ptr().cast(),
                        ),
                        "mount tmpfs on",
                        dst,
                    );
                }
                Step::ReadOnly(dst) => {
                    check(
                        libc::mount(
                            null(),
                            dst.as_ptr(),
                            null(),
                            libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
                            std::ptr::null(),
                        ),
                        "read-only remount of",
                        dst,
                    );
                }
            }
        }
        check(
            libc::syscall(
                libc::SYS_pivot_root,
                plan.root.as_ptr(),
                plan.old_root.as_ptr(),
            ) as libc::c_int,
            "pivot_root to",
            &plan.root,
        );
        check(libc::chdir(slash.as_ptr()), "chdir", c"");
        check(
            libc::umount2(plan.old_root_inside.as_ptr(), libc::MNT_DETACH),
            "detach the old root",
            c"",
        );
        libc::rmdir(plan.old_root_inside.as_ptr());
        check(
            libc::mount(
                null(),
                slash.as_ptr(),
                null(),
                libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
                std::ptr::null(),
            ),
            "read-only remount of the new root",
            c"",
        );
        check(libc::chdir(plan.cwd.as_ptr()), "chdir to", &plan.cwd);
    }
}

/// `proc`: a descriptor of the host's /proc, opened before the new root hid it.
fn enter_user_namespace(plan: &Plan, proc: libc::c_int, extra: libc::c_int) {
    let mut flags = libc::CLONE_NEWUSER | libc::CLONE_NEWPID | libc::CLONE_NEWIPC | extra;
    if plan.new_net {
        flags |= libc::CLONE_NEWNET;
    }
    // SAFETY: unshare and file writes on prepared buffers.
    unsafe {
        check(
            libc::unshare(flags),
            "unshare (user, pid, ipc, net namespaces)",
            c"",
        );
    }
    write_file(proc, b"self/setgroups\0", c"deny");
    write_file(proc, b"self/uid_map\0", &plan.uid_map);
    write_file(proc, b"self/gid_map\0", &plan.gid_map);
    // SAFETY: closing our own descriptor.
    unsafe { libc::close(proc) };
}

fn switch_user(uid: libc::uid_t, gid: libc::gid_t) {
    // Raw system calls: glibc's wrappers would try to change every thread of the server
    // (which shares this process's memory) to keep POSIX's process-wide semantics.
    // SAFETY: credential system calls with plain values.
    unsafe {
        let none = c"";
        let call = |result: libc::c_long| result as libc::c_int;
        check(
            call(libc::syscall(libc::SYS_setgroups, 0usize, 0usize)),
            "setgroups",
            none,
        );
        check(
            call(libc::syscall(libc::SYS_setresgid, gid, gid, gid)),
            "setresgid",
            none,
        );
        check(
            call(libc::syscall(libc::SYS_setresuid, uid, uid, uid)),
            "setresuid",
            none,
        );
        // A uid change clears it; /proc/self/uid_map needs it.
        check(
            libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0),
            "prctl(PR_SET_DUMPABLE)",
            none,
        );
    }
}

/// Brings up the loopback interface of the new network namespace.
fn loopback_up() {
    // SAFETY: a datagram socket and two interface ioctls on a zeroed ifreq.
    unsafe {
        let none = c"";
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            fail("socket", b"");
        }
        let mut request: libc::ifreq = std::mem::zeroed();
        request.ifr_name[0] = b'l' as libc::c_char;
        request.ifr_name[1] = b'o' as libc::c_char;
        check(
            libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut request),
            "SIOCGIFFLAGS lo",
            none,
        );
        request.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        check(
            libc::ioctl(fd, libc::SIOCSIFFLAGS, &request),
            "bring up lo",
            none,
        );
        libc::close(fd);
    }
}

/// The program a run executes, with its arguments, environment and standard streams.
#[derive(Debug)]
pub struct Exec {
    pub program: CString,
    /// `argv`, the program's name first.
    pub argv: Vec<CString>,
    /// `NAME=value` entries.
    pub env: Vec<CString>,
    /// Descriptors for 0, 1 and 2.
    pub stdio: [OwnedFd; 3],
}

/// Two stacks, each above a guard page: one for the setup process, one for PID 1 of the
/// run until it executes. They are used one after the other by the spawner thread's runs.
#[derive(Debug)]
pub struct Stacks {
    base: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is owned by this value and used by one run at a time.
unsafe impl Send for Stacks {}

const STACK_BYTES: usize = 256 * 1024;
const GUARD_BYTES: usize = 64 * 1024;

impl Stacks {
    pub fn new() -> std::io::Result<Stacks> {
        let len = 2 * (GUARD_BYTES + STACK_BYTES);
        // SAFETY: a fresh private anonymous mapping; only its stack parts are made writable.
        unsafe {
            let base = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            );
            if base == libc::MAP_FAILED {
                return Err(std::io::Error::last_os_error());
            }
            let stacks = Stacks { base, len };
            for i in 0..2 {
                let bottom = stacks.bottom(i);
                if libc::mprotect(bottom, STACK_BYTES, libc::PROT_READ | libc::PROT_WRITE) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(stacks)
        }
    }

    fn bottom(&self, i: usize) -> *mut libc::c_void {
        self.base
            .cast::<u8>()
            .wrapping_add(i * (GUARD_BYTES + STACK_BYTES) + GUARD_BYTES)
            .cast()
    }

    /// The top of stack `i` (stacks grow down).
    fn top(&self, i: usize) -> *mut libc::c_void {
        self.bottom(i).cast::<u8>().wrapping_add(STACK_BYTES).cast()
    }
}

impl Drop for Stacks {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping made in `new`; no run uses it any more.
        unsafe { libc::munmap(self.base, self.len) };
    }
}

/// What the two children read: everything is prepared before the first clone.
struct Context<'a> {
    plan: &'a Plan,
    ruleset: libc::c_int,
    stdio: [libc::c_int; 3],
    program: *const libc::c_char,
    argv: *const *const libc::c_char,
    env: *const *const libc::c_char,
    pid1_stack: *mut libc::c_void,
    /// Written by the setup process: PID 1's pid.
    pid1: AtomicI32,
}

/// How a launch went.
#[derive(Debug)]
pub struct Started {
    /// The setup process; its pid is the run's process group.
    pub setup_pid: i32,
    /// Its wait status (0 when the run started).
    pub setup_status: libc::c_int,
    /// PID 1 of the run (host pid), a child of this process; 0 when the setup failed.
    pub pid1: i32,
}

/// Starts a run: the setup process enters the namespaces and the new root, clones PID 1 of
/// the run as a child of *this* process (`CLONE_PARENT`) and exits; PID 1 applies the
/// limits and Landlock and executes the program. Blocks the calling thread until the setup
/// process is done (milliseconds); call it from the spawner thread only, which PID 1's
/// parent-death signal is tied to.
pub fn launch(
    plan: &Plan,
    ruleset: &OwnedFd,
    exec: &Exec,
    stacks: &Stacks,
) -> std::io::Result<Started> {
    let pointers = |items: &[CString]| -> Vec<*const libc::c_char> {
        items
            .iter()
            .map(|item| item.as_ptr())
            .chain(std::iter::once(std::ptr::null()))
            .collect()
    };
    let argv = pointers(&exec.argv);
    let env = pointers(&exec.env);
    let context = Context {
        plan,
        ruleset: ruleset.as_raw_fd(),
        stdio: [
            exec.stdio[0].as_raw_fd(),
            exec.stdio[1].as_raw_fd(),
            exec.stdio[2].as_raw_fd(),
        ],
        program: exec.program.as_ptr(),
        argv: argv.as_ptr(),
        env: env.as_ptr(),
        pid1_stack: stacks.top(1),
        pid1: AtomicI32::new(0),
    };
    // SAFETY: the children run on their own stacks and only read `context` (and what it
    // points to, alive until this function returns) until they exec or exit; CLONE_VFORK
    // suspends this thread until then. Signals stay blocked in them until PID 1 has reset
    // every handler, so no handler of the server runs in a child.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut previous: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut previous);
        let setup_pid = libc::clone(
            setup_main,
            stacks.top(0),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            std::ptr::from_ref(&context).cast_mut().cast(),
        );
        let clone_error = std::io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &previous, std::ptr::null_mut());
        if setup_pid < 0 {
            return Err(clone_error);
        }
        let mut status = 0;
        while libc::waitpid(setup_pid, &mut status, 0) < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() != std::io::ErrorKind::Interrupted {
                return Err(error);
            }
        }
        let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
        Ok(Started {
            setup_pid,
            setup_status: status,
            pid1: if ok {
                context.pid1.load(Ordering::Acquire)
            } else {
                0
            },
        })
    }
}

/// Makes `from` descriptor `to` of this process, open across exec.
fn install(from: libc::c_int, to: libc::c_int) {
    // SAFETY: descriptor calls on this process's own table.
    unsafe {
        if from == to {
            let flags = libc::fcntl(to, libc::F_GETFD);
            if flags < 0 || libc::fcntl(to, libc::F_SETFD, flags & !libc::FD_CLOEXEC) != 0 {
                fail("fcntl", b"");
            }
        } else if libc::dup2(from, to) < 0 {
            fail("dup2", b"");
        }
    }
}

/// The setup process: namespaces, the new root, then PID 1.
extern "C" fn setup_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the launcher's context, alive while this process runs.
    let context = unsafe { &*arg.cast::<Context<'_>>() };
    let plan = context.plan;
    // SAFETY: a process group of its own (the run's), for killpg.
    if unsafe { libc::setpgid(0, 0) } != 0 {
        fail("setpgid", b"");
    }
    // The streams first, so a failing step's message reaches the run's output (the
    // launcher moved every source above 2, so no dup2 overwrites a later source).
    for (to, from) in (0..).zip(context.stdio) {
        install(from, to);
    }
    // SAFETY: /proc is opened as a path only.
    let proc = unsafe {
        libc::open(
            c"/proc".as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if proc < 0 {
        fail("open /proc", b"");
    }
    match plan.switch_user {
        Some((uid, gid)) => {
            // Mounts as root (paths under root-only directories resolve), then the drop.
            // SAFETY: unshare of the mount namespace.
            unsafe {
                check(
                    libc::unshare(libc::CLONE_NEWNS),
                    "unshare (mount namespace)",
                    c"",
                );
            }
            build_root(plan);
            switch_user(uid, gid);
            enter_user_namespace(plan, proc, 0);
        }
        None => {
            enter_user_namespace(plan, proc, libc::CLONE_NEWNS);
            build_root(plan);
        }
    }
    if plan.new_net {
        loopback_up();
    }
    // A sibling, not a child: its parent is the server's spawner thread, so it dies with
    // the server (PR_SET_PDEATHSIG) and the server reaps it.
    // SAFETY: PID 1 runs on its own stack and only reads the context until it executes.
    let pid = unsafe {
        libc::clone(
            pid1_main,
            context.pid1_stack,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PARENT | libc::SIGCHLD,
            arg,
        )
    };
    if pid < 0 {
        fail("clone", b"");
    }
    context.pid1.store(pid, Ordering::Release);
    0
}

/// PID 1 of the run: limits and CPU priority, signals back to their defaults, Landlock, exec.
extern "C" fn pid1_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the launcher's context, alive until this process executes.
    let context = unsafe { &*arg.cast::<Context<'_>>() };
    // SAFETY: prctl, setrlimit, setpriority, sched_setscheduler and signal calls with plain
    // values.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
        if libc::setpriority(libc::PRIO_PROCESS, 0, context.plan.nice) != 0 {
            fail("setpriority", b"");
        }
        // Any thread of the server that wakes takes the CPU from an idle-class process at
        // once; from a niced normal one only when the kernel's fairness says so, which with a
        // CPU-bound tool spinning was up to a scheduler tick (4 ms) per wake-up.
        let param = libc::sched_param { sched_priority: 0 };
        if context.plan.idle_scheduling
            && libc::sched_setscheduler(0, libc::SCHED_IDLE, &raw const param) != 0
        {
            fail("sched_setscheduler", b"");
        }
        for (resource, value) in &context.plan.limits {
            let limit = libc::rlimit {
                rlim_cur: *value,
                rlim_max: *value,
            };
            if libc::setrlimit(*resource, &limit) != 0 {
                fail("setrlimit", b"");
            }
        }
        // Every signal to its default action (the server's handlers are not the tool's, and
        // an ignored SIGPIPE would survive exec), then none blocked.
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        for signal in 1..=64 {
            if signal != libc::SIGKILL && signal != libc::SIGSTOP {
                libc::sigaction(signal, &default, std::ptr::null_mut());
            }
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK,
            &none,
            std::ptr::null_mut::<libc::sigset_t>(),
            size_of::<libc::c_ulong>(),
        );
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            fail("prctl(PR_SET_NO_NEW_PRIVS)", b"");
        }
        if libc::syscall(libc::SYS_landlock_restrict_self, context.ruleset, 0u32) != 0 {
            fail("landlock_restrict_self", b"");
        }
        libc::execve(context.program, context.argv, context.env);
    }
    fail("execve", b"")
}
