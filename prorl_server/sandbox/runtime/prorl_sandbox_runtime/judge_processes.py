"""The judge's hardening and its children's processes: non-dumpable and a child
subreaper before untrusted code runs, the clean environment that code starts with, and
killing whatever it left behind (judged code runs in children; see prorl_judge.py).
"""

import os
import signal
import time

PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
ERROR_CHARS = 4000


def prctl(option, value):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, "prctl(%d, %d): %s" % (option, value, os.strerror(error)))


def harden(subreaper=False):
    """Non-dumpable (and optionally a child subreaper) before untrusted code runs."""
    prctl(PR_SET_DUMPABLE, 0)
    if subreaper:
        prctl(PR_SET_CHILD_SUBREAPER, 1)


def clean_env(**extra):
    """The environment untrusted code starts with: nothing inherited but the basics. TMPDIR is
    kept when the runtime started with one: it names the sandbox's own temporary directory
    (unset in the images, so /tmp; a folder of the fake sandbox's on a test host, where the
    tests' pytest would otherwise share, and prune, the host's /tmp/pytest-of-<user>)."""
    env = {
        "PATH": os.environ.get("PATH") or DEFAULT_PATH,
        "HOME": os.environ.get("HOME") or "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if os.environ.get("TMPDIR"):
        env["TMPDIR"] = os.environ["TMPDIR"]
    env.update(extra)
    return env


def _process_table():
    """ppid -> [(pid, state)] for every visible process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry, "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table.setdefault(int(fields[1]), []).append((int(entry), fields[0]))
    return table


def descendants(root):
    """Living (not zombie) descendants of `root`."""
    table = _process_table()
    found, stack = [], [root]
    while stack:
        for pid, state in table.get(stack.pop(), ()):
            stack.append(pid)
            if state != b"Z":
                found.append(pid)
    return found


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_descendants():
    """SIGKILL everything below this process (orphans come back to it as subreaper).

    Only call once the exit status of every subprocess.Popen still needed has
    been collected: it reaps any child."""
    me = os.getpid()
    for _ in range(200):
        pids = descendants(me)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
        reap()
    reap()


def kill_group(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        process.kill()
    except OSError:
        pass
