"""Resetting a used sandbox for the next job (the `reset` operation).

`reset` makes a used sandbox fit for the next job without a new container. It
runs in this (trusted) process: every other process but the container's init is
killed first, so nothing the previous job started can undo what follows; then
its IPC objects, keyrings and POSIX message queues are removed, and each writable
path the server names is emptied and refilled from the image's read-only copy
("lower"), its mode and extended attributes restored. The shell, the Python
worker and the editor start afresh, so environment, cwd, names and undo history
are the new job's. The answer reports what is left; the server checks the rest
from outside (sandbox/podman/reset_check.py) and retires a sandbox it cannot
prove clean.
"""

import os
import shutil
import time

from . import RUNTIME_SCRIPT
from .bash import BashSession
from .editor import Editor
from .hygiene import load_libc, reset_keyrings, reset_kill_all, reset_sysv_ipc
from .python_worker import PythonSession


def _make_removable(top):
    """Give the owner write and search rights on every directory below `top` (the job may
    have taken them away), so that its entries can be deleted."""
    for root, dirs, _ in os.walk(top):
        for name in dirs:
            path = os.path.join(root, name)
            try:
                if not os.path.islink(path):
                    os.chmod(path, 0o700)
            except OSError:
                pass


def _clear_xattrs(path):
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return
    for name in names:
        try:
            os.removexattr(path, name, follow_symlinks=False)
        except OSError:
            pass


def reset_tree(path, lower, mode):
    """Empty the mount `path` and refill it from `lower` (None: leave it empty), then give
    its top the mode `mode` and no extended attributes. Raises OSError when it cannot."""
    owned = os.lstat(path).st_uid == os.geteuid()  # a top owned by root: the job could not change it either
    if owned:
        os.chmod(path, 0o700)
        _clear_xattrs(path)
    _make_removable(path)
    for name in os.listdir(path):
        entry = os.path.join(path, name)
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry)
        else:
            os.unlink(entry)
    if lower is not None and os.path.isdir(lower):
        for name in os.listdir(lower):
            source, target = os.path.join(lower, name), os.path.join(path, name)
            if os.path.isdir(source) and not os.path.islink(source):
                shutil.copytree(source, target, symlinks=True)
            else:
                shutil.copy2(source, target, follow_symlinks=False)
    if owned:
        os.chmod(path, mode)


def _serving_under_own_init():
    """Whether this process is the runtime forked by `serve --init` as its PID namespace's
    init: kill(-1) anywhere else would reach far more than one sandbox."""
    try:
        with open("/proc/1/cmdline", "rb") as handle:
            init = handle.read().split(b"\0")
    except OSError:
        return False
    return (
        os.getppid() == 1
        and b"serve" in init
        and b"--init" in init
        and any(part.endswith(os.path.basename(RUNTIME_SCRIPT).encode()) for part in init)
    )


def _is_subreaper():
    """PR_GET_CHILD_SUBREAPER: every descendant stays in this process's tree."""
    import ctypes

    value = ctypes.c_int(0)
    return load_libc().prctl(37, ctypes.byref(value), 0, 0, 0) == 0 and value.value == 1


def reset_runtime(runtime, request):
    """The `reset` op (see the section's comment). Request: "paths", a list of
    {"path", "lower" (or null), "mode"}; "timeout_s". Answer: "processes" (pids left),
    "ipc" (SysV objects left), "keys" (keys left), "failed" ({path: error})."""
    own = _serving_under_own_init()
    if not own and not _is_subreaper():
        raise RuntimeError("reset runs only in a sandbox whose init is this runtime (serve --init)")
    deadline = time.monotonic() + float(request.get("timeout_s") or 30.0)
    left = reset_kill_all(deadline, own)  # ends any call still running, so its lock comes free
    scratch = [runtime.bash.scratch, runtime.python.scratch]
    with runtime.bash.lock, runtime.python.lock:
        runtime.bash.close()
        runtime.python._kill()
        left = reset_kill_all(deadline, own)
        bash, python = BashSession(runtime.workdir), PythonSession(runtime.workdir)
        for session, path in zip((bash, python), scratch):
            os.rmdir(session.scratch)
            session.scratch = path
        runtime.bash, runtime.python, runtime.editor = bash, python, Editor(runtime.workdir)
    failed = {}
    if not left:  # with a process left, nothing below could be trusted to stay done
        for item in request.get("paths") or []:
            try:
                reset_tree(item["path"], item.get("lower"), int(item["mode"]))
            except (OSError, shutil.Error) as exc:
                failed[item["path"]] = "%s: %s" % (type(exc).__name__, exc)
        for path in scratch:
            try:
                os.mkdir(path, 0o700)
            except OSError as exc:
                failed[path] = "%s: %s" % (type(exc).__name__, exc)
    # IPC objects and keys are the namespace's, or on a test host everyone's: left alone there.
    return {
        "processes": left,
        "ipc": reset_sysv_ipc() if own else [],
        "keys": reset_keyrings() if own else [],
        "failed": failed,
    }
