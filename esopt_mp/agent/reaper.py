"""The keeper of one harness command: runs it, and when it exits ends and reaps everything it started.

The trainer runs ``python -I -S reaper.py TRAINER_PID -- program args...`` once per episode (standard library
only, no package import: it starts in a few tens of milliseconds). The command inherits its stdin, stdout and stderr.

A process can leave its process group and its session (``setsid``, ``start_new_session=True``), and a daemon
double-forks so that its parent is gone; none of them can leave this process's tree on Linux, where the keeper is a
child subreaper (``PR_SET_CHILD_SUBREAPER``): an orphaned descendant is re-parented to it, not to init. So:

- when the command exits, every descendant still running is killed (a helper holding stdout open would
  otherwise keep the episode waiting for an end of file) and reaped: no zombie reaches the trainer, even when the
  trainer is PID 1 of a container without an init;
- the kernel sends it SIGTERM when the trainer dies (``PR_SET_PDEATHSIG``, ``kill -9`` included), and on SIGTERM,
  SIGINT or SIGHUP it kills and reaps the whole tree before it exits: no harness outlives the trainer;
- it exits with the command's status (killed by a signal: by the same signal), 75 (EX_TEMPFAIL) if the command
  could not be started.

The command runs in a process group of its own (a ``kill 0`` of its own does not reach the keeper). Beyond the
keeper: a process that changed its user (it may not be signalled), a harness that kills or stops the keeper
itself, and work handed to a daemon outside the tree (``docker run -d``, ``systemd-run``). Without ``prctl`` or
``/proc`` (not Linux) it waits for the command and reaps its own children only.
"""
import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
EX_TEMPFAIL = 75
_END_S = 10.0  # longest wait for the killed tree to be reaped (a process in uninterruptible sleep dies late)


def _prctl(option: int, arg: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a scan of /proc; [] where there is none)."""
    found = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after "(comm)", which may hold spaces and parentheses
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(name))
    return found


def end_tree() -> None:
    """SIGKILL every descendant and reap each, until none is left: a killed process's children are re-parented
    here (a subreaper), so each round reaches one generation further down. A descendant this process may not signal
    (one that changed its user, ``sudo cmd &``) is left alone: waiting for it would hold the episode."""
    me, deadline, spared = os.getpid(), time.monotonic() + _END_S, set()
    while True:
        left = [pid for pid in children(me) if pid not in spared]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            except PermissionError:
                spared.add(pid)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:  # no child left
            return
        if not left or time.monotonic() > deadline:  # only spared ones remain, or out of time
            return
        time.sleep(0.005)


def _on_signal(signum, frame) -> None:
    end_tree()
    os._exit(128 + signum)


def _exit_as(status: int) -> None:
    """Exit as the command did: its exit code, or death by its signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal whose default is not to terminate
    os._exit(os.waitstatus_to_exitcode(status))


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--":
        sys.stderr.write("usage: reaper.py TRAINER_PID -- program [args...]\n")
        os._exit(2)
    trainer, cmd = int(argv[1]), argv[3:]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != trainer:  # the trainer died before the death signal was asked for
        os._exit(EX_TEMPFAIL)
    try:  # in a process group of its own (its `kill 0` is not the keeper's), with the signals Python ignores
        # (SIGPIPE, SIGXFSZ) back to their defaults: a pipeline such as `find | head` ends as in a shell
        child = os.posix_spawnp(cmd[0], cmd, os.environ, setpgroup=0, setsigmask=(),
                                setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
    except OSError as e:
        sys.stderr.write(f"could not start {cmd[0]}: {type(e).__name__}: {e}\n")
        os._exit(EX_TEMPFAIL)
    while True:  # orphans re-parented here meanwhile are reaped as they end
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            break
    end_tree()
    _exit_as(status)


if __name__ == "__main__":
    try:
        main(sys.argv)
    except Exception as e:  # noqa: BLE001 - the keeper's own failure is the infrastructure's, not the model's
        sys.stderr.write(f"the harness's keeper failed: {type(e).__name__}: {e}\n")
        os._exit(EX_TEMPFAIL)
