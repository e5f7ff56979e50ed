//! What runs in the forked child before `exec`: namespaces, the new root, the drop to the
//! sandbox user, the per-run process (PID 1 of its own PID namespace), resource limits and
//! Landlock.
//!
//! This code runs between `fork` and `exec` in a copy of a multi-threaded process, so it
//! keeps to raw system calls on data prepared by the parent ([`Plan`]): no locks, no
//! formatting. A step that fails writes `bedrock sandbox: <step> failed (errno N)` to
//! stderr and exits with status 125, so the reason reaches the tool result and the start-up
//! self-test verbatim instead of being lost as an errno.

use std::ffi::{CStr, CString};

use landlock::RulesetCreated;

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
fn write_file(dir: libc::c_int, path: &[u8], content: &CString) {
    // SAFETY: NUL-terminated path and a borrowed buffer.
    unsafe {
        let fd = libc::openat(dir, path.as_ptr().cast(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            fail("open", &path[..path.len() - 1]);
        }
        let bytes = content.as_bytes();
        if libc::write(fd, bytes.as_ptr().cast(), bytes.len()) != bytes.len() as isize {
            fail("write", &path[..path.len() - 1]);
        }
        libc::close(fd);
    }
}

fn null() -> *const libc::c_char {
    std::ptr::null()
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
                    check(
                        libc::mount(
                            src.as_ptr(),
                            dst.as_ptr(),
                            null(),
                            libc::MS_BIND | libc::MS_REC,
                            std::ptr::null(),
                        ),
                        "bind",
                        src,
                    );
                    if *remount != 0 {
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
    write_file(proc, b"self/setgroups\0", &CString::from(c"deny"));
    write_file(proc, b"self/uid_map\0", &plan.uid_map);
    write_file(proc, b"self/gid_map\0", &plan.gid_map);
    // SAFETY: closing our own descriptor.
    unsafe { libc::close(proc) };
}

fn switch_user(uid: libc::uid_t, gid: libc::gid_t) {
    // SAFETY: credential system calls.
    unsafe {
        let none = c"";
        check(libc::setgroups(0, std::ptr::null()), "setgroups", none);
        check(libc::setresgid(gid, gid, gid), "setresgid", none);
        check(libc::setresuid(uid, uid, uid), "setresuid", none);
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

/// Runs in the child after `fork`, before `exec`. The child sets up the namespaces and the
/// new root, then clones PID 1 of the run as a child of the *server* (`CLONE_PARENT`),
/// writes its pid to `report` and exits: no process is left sharing the server's memory
/// (a forked copy that stayed would make every write of the server copy a page). Returns in
/// PID 1, with every restriction applied.
pub fn enter(
    plan: &Plan,
    ruleset: Option<RulesetCreated>,
    report: libc::c_int,
) -> std::io::Result<()> {
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
    // SAFETY: fork in a single-threaded child; each side only makes system calls.
    // A sibling, not a child: its parent is the server's spawner thread.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            libc::CLONE_PARENT as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    if pid < 0 {
        fail("clone", b"");
    }
    if pid > 0 {
        let bytes = (pid as i32).to_le_bytes();
        // SAFETY: a write of a local buffer, then the end of this process.
        unsafe {
            if libc::write(report, bytes.as_ptr().cast(), bytes.len()) != bytes.len() as isize {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
                fail("report the pid", b"");
            }
            libc::_exit(0);
        }
    }
    // PID 1 of the run: dies with the server (its parent is the spawner thread).
    // SAFETY: prctl and setrlimit with plain values.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
        for (resource, value) in &plan.limits {
            let limit = libc::rlimit {
                rlim_cur: *value,
                rlim_max: *value,
            };
            if libc::setrlimit(*resource, &limit) != 0 {
                fail("setrlimit", b"");
            }
        }
    }
    if let Some(ruleset) = ruleset
        && ruleset.restrict_self().is_err()
    {
        fail("landlock_restrict_self", b"");
    }
    Ok(())
}
