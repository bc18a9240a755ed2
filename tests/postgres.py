"""A throwaway PostgreSQL server for the tests marked `postgres` (the job store).

Import the fixtures into a test module (`from tests.postgres import
postgres_cluster_fixture, postgres_url_fixture`): they are the fixtures `postgres_cluster`
and `postgres_url`. One cluster per test session, made with Debian's own server binaries
(/usr/lib/postgresql/<version>/bin, package `postgresql`; the system cluster that
package starts is not used) in a temporary folder, listening only on a Unix socket
in that folder (no TCP port: sessions side by side never collide), run as an
unprivileged user (PostgreSQL refuses root), with trust authentication over that
socket. At the end it is stopped and its folder deleted: no process, no file left.
Each test gets a database of its own (`postgres_url`), dropped after it.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# PostgreSQL refuses to run as root: as root the cluster runs as this user (the
# sandbox user of these machines, see scripts/setup_host.sh), else as whoever runs the tests.
CLUSTER_USER = os.environ.get("PRORL_TEST_POSTGRES_USER", "prorl")
_databases = itertools.count(1)


@dataclass(frozen=True)
class PostgresCluster:
    bin_dir: Path
    folder: Path
    """Holds the data directory (data/), the log (server.log) and the socket."""
    user: str
    options: str = ""
    """The server's command-line options (pg_ctl -o)."""
    run_as: str | None = None
    """The unprivileged user the server runs as (when the tests run as root)."""

    def stop(self) -> None:
        """Stop the server (`fast`: every connection is cut at once), e.g. to test an outage.
        Not `immediate`: with this throwaway cluster's fsync=off and synchronous_commit=off
        a crash may lose what was committed last."""
        _run(
            _as_user(self.run_as, self.bin_dir / "pg_ctl", "-D", self.folder / "data", "-m", "fast", "-w", "stop"),
            self.folder,
        )

    def start(self) -> None:
        _pg_ctl_start(self.run_as, self.bin_dir, self.folder, self.options)

    def postmaster_pid(self) -> int | None:
        return _postmaster_pid(self.folder / "data")

    @property
    def socket_dir(self) -> Path:
        return self.folder

    def url(self, database: str = "postgres", password: str = "") -> str:
        secret = f":{password}" if password else ""
        return f"postgresql://{self.user}{secret}@/{database}?host={self.socket_dir}"

    def client(self, program: str, *args: str) -> None:
        """Run one of PostgreSQL's client programs (createdb, dropdb, ...) against the cluster."""
        _run([str(self.bin_dir / program), "-h", str(self.socket_dir), "-U", self.user, *args], self.folder)

    def log(self) -> str:
        path = self.folder / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""


def server_binaries() -> Path | None:
    """The newest installed PostgreSQL's bin folder (Debian: /usr/lib/postgresql/15/bin)."""
    found = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")]
    found = [folder for folder in found if (folder / "initdb").exists()]
    found.sort(key=lambda folder: int(folder.parent.name) if folder.parent.name.isdigit() else 0)
    return found[-1] if found else None


def _as_user(user: str | None, *argv: str | Path) -> list[str]:
    command = [str(arg) for arg in argv]
    return ["runuser", "-u", user, "--", *command] if user else command


def _run(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")


def _postmaster_pid(data: Path) -> int | None:
    try:
        return int((data / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pg_ctl_start(user: str | None, bin_dir: Path, folder: Path, options: str) -> None:
    data = folder / "data"
    try:
        _run(
            _as_user(user, bin_dir / "pg_ctl", "-D", data, "-l", folder / "server.log", "-o", options, "-w", "start"),
            folder,
        )
    except RuntimeError as exc:
        log = (folder / "server.log").read_text(errors="replace") if (folder / "server.log").exists() else ""
        raise RuntimeError(f"{exc}\nserver log:\n{log}") from None


@contextlib.contextmanager
def throwaway_postgres(*, prefix: str = "prorl-pg-", max_connections: int = 60) -> Iterator[PostgresCluster]:
    """A PostgreSQL server of its own in a temporary folder, on a Unix socket only; stopped
    and its folder deleted at the end, whatever happened (no process, no file left).
    Used by the tests' session fixture and by bench/cluster.py."""
    bin_dir = server_binaries()
    if bin_dir is None:
        raise RuntimeError(
            "PostgreSQL's server binaries are not installed (/usr/lib/postgresql/*/bin): make setup-host"
        )
    root = os.geteuid() == 0
    user = CLUSTER_USER if root else None
    name = user or pwd.getpwuid(os.geteuid()).pw_name
    # Under the system's temp folder: a Unix socket's path must stay under 108 bytes.
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    data = folder / "data"
    pid: int | None = None
    try:
        if user:
            shutil.chown(folder, user=user, group=pwd.getpwnam(user).pw_gid)
        _run(
            _as_user(user, bin_dir / "initdb", "-D", data, "-U", name, "--auth=trust", "-E", "UTF8", "--no-sync"),
            folder,
        )
        options = " ".join(
            [
                "-c listen_addresses=''",  # no TCP at all
                f"-c unix_socket_directories='{folder}'",
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off",  # throwaway data
                f"-c max_connections={max_connections} -c shared_buffers=32MB",
            ]
        )
        _pg_ctl_start(user, bin_dir, folder, options)
        pid = _postmaster_pid(data)
        yield PostgresCluster(bin_dir=bin_dir, folder=folder, user=name, options=options, run_as=user)
    finally:
        if data.exists() and (data / "postmaster.pid").exists():
            pid = _postmaster_pid(data) or pid
            try:
                _run(_as_user(user, bin_dir / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"), folder)
            except (RuntimeError, subprocess.TimeoutExpired):
                if pid is not None and _alive(pid):
                    os.kill(pid, signal.SIGKILL)  # the postmaster started here
        if pid is not None:
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _alive(pid), f"the throwaway PostgreSQL server (pid {pid}) is still running"
        shutil.rmtree(folder, ignore_errors=True)
        assert not folder.exists(), f"{folder} was not removed"


@pytest.fixture(scope="session", name="postgres_cluster")
def postgres_cluster_fixture() -> Iterator[PostgresCluster]:
    if server_binaries() is None:
        pytest.fail("PostgreSQL's server binaries are not installed (/usr/lib/postgresql/*/bin): run `make setup-host`")
    with throwaway_postgres() as cluster:
        yield cluster


@pytest.fixture(name="postgres_url")
def postgres_url_fixture(postgres_cluster: PostgresCluster) -> Iterator[str]:
    """The URL of a fresh, empty database of the session's cluster, dropped after the test.
    (Synchronous, with PostgreSQL's own client programs: usable from getfixturevalue too.)"""
    database = f"prorl_test_{os.getpid()}_{next(_databases)}"
    postgres_cluster.client("createdb", database)
    yield postgres_cluster.url(database)
    postgres_cluster.client("dropdb", "--force", database)
