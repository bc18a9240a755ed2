"""Process hygiene: killing what a session or a job left running, making the runtime
non-dumpable, and removing what processes of the same uid share beyond their lifetime
(System V IPC objects, keyrings) when a sandbox is reset.
"""

import os
import re
import signal
import time


def kill_session(session_id):
    """SIGKILL every process of a session (bash and the jobs it left running)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session_id:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


PR_SET_DUMPABLE = 4


def make_non_dumpable():
    """prctl(PR_SET_DUMPABLE, 0): processes of the same uid (everything the agent and
    the tested code run) can then neither ptrace this one, read its memory, nor open
    its fds (the server's socket, the judge's verdict pipe) through /proc."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except Exception:  # no ctypes or no prctl: keep serving, less protected
        return False


SYSVIPC = {"msg": "msgctl", "sem": "semctl", "shm": "shmctl"}
IPC_RMID = 0
KEYCTL_CLEAR = 7
KEY_SPEC_USER_KEYRING = -4
KEY_SPEC_USER_SESSION_KEYRING = -5
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "ppc64le": 311, "s390x": 280}


def _other_pids():
    """Pids in this PID namespace other than init (1) and this process, with their state."""
    me = os.getpid()
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in (1, me):
            try:
                with open("/proc/%s/stat" % entry) as handle:
                    found[int(entry)] = handle.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                pass  # gone meanwhile
    return found


def _reap_children():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _descendants():
    """Pids of this process's descendants (by /proc parent links), with their state."""
    parents, states = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/stat" % entry) as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            parents.setdefault(int(fields[1]), []).append(int(entry))
            states[int(entry)] = fields[0]
    found, todo = {}, [os.getpid()]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found[child] = states[child]
                todo.append(child)
    return found


def reset_kill_all(deadline, in_own_namespace=True):
    """SIGKILL every process but init and this one (kill(-1) spares exactly those, and
    reaches nested PID namespaces too) until none is left; forks racing the kill are
    caught by the next round. Outside a sandbox's own namespace (`in_own_namespace`
    False: a child subreaper on a test host) only this process's descendants are
    killed. Returns the pids still there at the deadline."""
    while True:
        if in_own_namespace:
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass  # ESRCH: nothing left to signal
        else:
            for pid in _descendants():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        _reap_children()
        left = _other_pids() if in_own_namespace else _descendants()
        if not left or time.monotonic() > deadline:
            return sorted(left)
        time.sleep(0.002 if all(state == "Z" for state in left.values()) else 0.0005)


def load_libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def reset_sysv_ipc():
    """Remove every SysV message queue, semaphore set and shared memory segment of this
    IPC namespace; returns those that remain, as "kind:id"."""
    libc = load_libc()
    left = []
    for kind, call in sorted(SYSVIPC.items()):
        for ident in _sysv_ids(kind):
            if kind == "sem":
                libc.semctl(ident, 0, IPC_RMID)
            else:
                getattr(libc, call)(ident, IPC_RMID, None)
        left += ["%s:%d" % (kind, ident) for ident in _sysv_ids(kind)]
    return left


def _sysv_ids(kind):
    try:
        with open("/proc/sysvipc/%s" % kind) as handle:
            lines = handle.read().splitlines()[1:]
    except OSError:
        return []
    return [int(line.split()[1]) for line in lines if line.split()]


def reset_keyrings():
    """Clear the user's keyrings (shared by every process of the uid); returns the keys
    still visible in /proc/keys other than those two, now empty."""
    number = SYS_KEYCTL.get(os.uname().machine)
    if number is not None:
        libc = load_libc()
        for keyring in (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING):
            libc.syscall(number, KEYCTL_CLEAR, keyring)
    try:
        with open("/proc/keys") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    return [line for line in lines if not re.search(r" _uid(_ses)?\.\d+: empty$", line)]
