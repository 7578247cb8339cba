"""Trusted bootstrap run first inside every sandboxed interpreter (``python -I -c <this file> <json>``).

Standalone on purpose (stdlib only, no project imports): under bwrap the project is not visible. It reads the
untrusted code from an inherited pipe, optionally forks a supervisor, then confines itself -- resource limits, a
drop to the per-call uid (when started as root), no_new_privs, Landlock (filesystem, signals, ptrace) and a seccomp
filter (no sockets, nothing done to other processes by pid or IPC key) as the plan asks -- and only then runs the
code, on the trainer's import path. Order matters: limits and the uid drop come before anything untrusted runs, and
``RLIMIT_NPROC`` is set after entering the user namespace so that it counts only this sandbox's processes (per user
namespace since Linux 5.14).
"""
import ctypes
import json
import os
import resource
import signal
import struct
import sys
import time

PLAN = json.loads(sys.argv[1])
LIBC = ctypes.CDLL(None, use_errno=True)
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER = 38, 22, 36
ARCH = {"x86_64": (0xC000003E, 41, True), "aarch64": (0xC00000B7, 198, False)}  # audit arch, socket nr, x32
SYS_IO_URING_SETUP, SYS_LL_CREATE, SYS_LL_ADD, SYS_LL_RESTRICT = 425, 444, 445, 446
X86, ARM = ARCH["x86_64"][0], ARCH["aarch64"][0]
# (syscall, [(argument index, required value)]): prlimit64, sched_setparam, sched_setscheduler,
# sched_setaffinity, sched_setattr take a pid (0: the caller); setpriority and ioprio_set (which, who)
SELF_ONLY = {X86: [(302, [(0, 0)]), (142, [(0, 0)]), (144, [(0, 0)]), (203, [(0, 0)]), (314, [(0, 0)]),
                   (141, [(0, 0), (1, 0)]), (251, [(0, 1), (1, 0)])],
             ARM: [(261, [(0, 0)]), (118, [(0, 0)]), (119, [(0, 0)]), (122, [(0, 0)]), (274, [(0, 0)]),
                   (140, [(0, 0), (1, 0)]), (30, [(0, 1), (1, 0)])]}
# System V IPC: shm{get,at,ctl}, sem{get,op,ctl,timedop}, msg{get,snd,rcv,ctl}
SYSV = {X86: [29, 30, 31, 64, 65, 66, 220, 68, 69, 70, 71], ARM: list(range(186, 197))}
# the kernel keyrings: add_key, request_key, keyctl (the trainer's session keyring holds Kerberos/NFS keys)
KEYS = {X86: [248, 249, 250], ARM: [217, 218, 219]}
KEYCTL_JOIN_SESSION_KEYRING = 1


def _fail(msg):
    os.write(2, f"sandbox setup failed: {msg}\n".encode())
    os._exit(125)


def _read_code():
    chunks = []
    while True:
        b = os.read(PLAN["code_fd"], 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.close(PLAN["code_fd"])
    return b"".join(chunks).decode()


def _descendants(root):
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _supervise(child):
    """Subreaper: orphans of the code re-parent here; when the code's main process ends, kill them all."""
    _, status = os.waitpid(child, 0)
    for _ in range(1000):
        kids = _descendants(os.getpid())
        if not kids:
            break
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        time.sleep(0.001)
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _user_tasks():
    uid, n = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return n


def _limits():
    for name, value in PLAN["rlimits"].items():
        # CPU: SIGXCPU at the limit (reported as such), SIGKILL one second later if it is caught
        hard = value + 1 if name == "RLIMIT_CPU" else value
        resource.setrlimit(getattr(resource, name), (value, hard))


def _drop(uid):
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _landlock(spec):
    """Read/execute below ``ro``, everything below ``rw``, nothing else; no signals out of the domain."""
    abi = LIBC.syscall(SYS_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        _fail("Landlock is not available in this kernel")
    fs_all = (1 << {1: 13, 2: 14}.get(abi, 16 if abi >= 5 else 15)) - 1
    read_x = 0b1101  # EXECUTE | READ_FILE | READ_DIR
    file_only = 0b111 | ((1 << 14) if abi >= 3 else 0) | ((1 << 15) if abi >= 5 else 0)
    scoped = 0b11 if abi >= 6 else 0  # abstract unix sockets, signals
    net = 0b11 if abi >= 4 else 0  # TCP bind, TCP connect
    attr = struct.pack("QQQ", fs_all, net, scoped)
    size = 24 if abi >= 6 else (16 if abi >= 4 else 8)
    fd = LIBC.syscall(SYS_LL_CREATE, ctypes.c_char_p(attr[:size]), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        _fail(f"landlock_create_ruleset: errno {ctypes.get_errno()}")
    rules = [(p, read_x) for p in spec["ro"]] + [(p, fs_all) for p in spec["rw"]]
    rules += [(p, 0b110) for p in spec["dev_rw"]]
    for path, access in rules:
        try:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        if not os.path.isdir(path):
            access &= file_only
        rule = struct.pack("=Qi", access, pfd)  # struct landlock_path_beneath_attr is packed
        if LIBC.syscall(SYS_LL_ADD, ctypes.c_int(fd), ctypes.c_int(1), ctypes.c_char_p(rule), ctypes.c_uint32(0)):
            _fail(f"landlock_add_rule({path}): errno {ctypes.get_errno()}")
        os.close(pfd)
    if LIBC.syscall(SYS_LL_RESTRICT, ctypes.c_int(fd), ctypes.c_uint32(0)):
        _fail(f"landlock_restrict_self: errno {ctypes.get_errno()}")
    os.close(fd)
    if abi < 6 and spec.get("need_scope"):
        _fail(f"Landlock ABI {abi} cannot keep signals inside the sandbox (needs 6, Linux 6.12)")


def _seccomp(full: bool = True):
    """No kernel keyrings (EPERM: every level, the per-call uid still possesses the trainer's session keyring);
    foreign syscall ABIs kill. ``full`` (the levels without namespaces for them): also no sockets or io_uring
    (EACCES) and nothing done to another process by pid, uid or IPC key (EPERM): no resource limits,
    priorities, scheduling or CPU affinity but its own (pid 0; Landlock and the per-call uid do not cover these,
    the kernel allows them for the same uid), no System V IPC."""
    arch = ARCH.get(os.uname().machine)
    if arch is None:
        _fail(f"no seccomp filter for {os.uname().machine}")
    audit, sys_socket, x32 = arch
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    kill, allow, eacces, eperm = 0x80000000, 0x7FFF0000, 0x00050000 | 13, 0x00050000 | 1
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, audit), (ret, 0, 0, kill), (ld, 0, 0, 0)]
    if x32:
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, kill)]
    denied = [(nr, eperm) for nr in KEYS[audit]]
    if full:
        denied += [(sys_socket, eacces), (SYS_IO_URING_SETUP, eacces)] + [(nr, eperm) for nr in SYSV[audit]]
    for nr, action in denied:
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, action)]
    for nr, args in SELF_ONLY[audit] if full else ():  # allowed only when each (argument, value) matches: itself
        body = []
        for i, value in args:
            body += [(ld, 0, 0, 16 + 8 * i), (jeq, 0, 0, value)]  # low 32 bits (pid_t / int arguments)
        body += [(ret, 0, 0, allow), (ret, 0, 0, eperm)]
        for j in range(1, len(body) - 2, 2):  # a mismatch jumps to the EPERM
            body[j] = (jeq, 0, len(body) - 2 - j, body[j][3])
        prog += [(jeq, 0, len(body), nr)] + body  # not this syscall: skip the block (A still holds nr)
    prog += [(ret, 0, 0, allow)]
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw)
    fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(buf))
    if LIBC.prctl(PR_SET_SECCOMP, 2, ctypes.c_char_p(fprog), 0, 0):
        _fail(f"seccomp: errno {ctypes.get_errno()}")


def main():
    code = _read_code()
    if PLAN.get("supervise"):
        if LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0):
            _fail(f"PR_SET_CHILD_SUBREAPER: errno {ctypes.get_errno()}")
        child = os.fork()
        if child:
            _supervise(child)
    _limits()
    if PLAN.get("own_cwd"):  # bwrap's private /tmp: 0700 and owned by the uid that runs the code
        os.chmod(PLAN["cwd"], 0o700)
        if PLAN.get("uid") is not None:
            os.chown(PLAN["cwd"], PLAN["uid"], PLAN["uid"])
    if PLAN.get("uid") is not None:
        _drop(PLAN["uid"])
    nproc = PLAN["nproc"] + (_user_tasks() if PLAN.get("nproc_relative") else 0)
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
        _fail(f"no_new_privs: errno {ctypes.get_errno()}")
    if PLAN.get("landlock"):
        _landlock(PLAN["landlock"])
    arch = ARCH.get(os.uname().machine)
    if arch is not None:  # a fresh anonymous session keyring first: the trainer's is no longer possessed
        LIBC.syscall(KEYS[arch[0]][2], KEYCTL_JOIN_SESSION_KEYRING, None)
    if PLAN.get("seccomp") or arch is not None:  # bwrap on another architecture: its namespaces only, as before
        _seccomp(full=bool(PLAN.get("seccomp")))
    os.chdir(PLAN["cwd"])
    sys.path[:] = PLAN["path"]  # the trainer's import path (-I gave the interpreter's own only)
    sys.argv = ["main.py"]
    glb = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(code, "main.py", "exec"), glb)


main()
