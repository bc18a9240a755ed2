"""A single-node Slurm cluster of the tests' own, for running deploy/slurm/prorl.sbatch for real.

Debian's `slurm-wlm` (22.05) and `munge`, configured in a temporary folder: a munge key
made there and `munged` on a socket there (a system munged, if any, is not touched),
slurm.conf with this host as the only node, reached at 127.0.0.1, `slurmctld` and
`slurmd` on free ports bound to that address only (CommunicationParameters=NoInAddrAny),
no accounting, no cgroups (proctrack/linuxproc, task/none). Every command is pointed at
it with SLURM_CONF. The daemons are children of the test process: stopping them is
killing what was started here, and the folder is removed afterwards.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scancel", "scontrol", "sinfo", "squeue")


def missing_programs() -> list[str]:
    """What of Slurm and munge is not installed (Debian: `apt-get install slurm-wlm`)."""
    return [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def node_line() -> tuple[str, str]:
    """This host as `slurmd -C` describes it (its name, CPUs, sockets, ...), minus its
    memory: a node that reports less memory than configured is drained, and the jobs
    here ask for none."""
    first = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True, timeout=60).stdout
    line = re.sub(r"\s*RealMemory=\d+", "", first.splitlines()[0]).strip()
    match = re.match(r"NodeName=(\S+)", line)
    assert match, f"unexpected `slurmd -C` output: {first!r}"
    return match.group(1), line


def slurm_conf(root: Path, name: str, node: str, ctld_port: int, slurmd_port: int) -> str:
    return f"""\
ClusterName=prorltest
SlurmctldHost={name}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
CommunicationParameters=NoInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/slurmd
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
KillWait=30
MinJobAge=300
{node} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    root: Path
    node: str
    env: dict[str, str]
    """The environment for Slurm's commands: SLURM_CONF set, no other SLURM_ variable."""
    daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def run(self, *argv: str, cwd: Path | None = None, env: Mapping[str, str] | None = None) -> str:
        done = subprocess.run(
            list(argv), cwd=cwd, env=dict(env or self.env), capture_output=True, text=True, timeout=60, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def sbatch(self, script: Path, *options: str, cwd: Path, env: Mapping[str, str]) -> int:
        out = self.run("sbatch", "--parsable", *options, str(script), cwd=cwd, env={**env, **self.env})
        return int(out.strip().split(";")[0])

    def job_state(self, job_id: int) -> str:
        """RUNNING, PENDING, COMPLETED, CANCELLED, FAILED, ... (the controller keeps ended
        jobs for MinJobAge seconds)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id))
        match = re.search(r"\bJobState=(\S+)", out)
        assert match, out
        return match.group(1)

    def wait_job_ended(self, job_id: int, timeout_s: float = 90) -> str:
        deadline = time.monotonic() + timeout_s
        while (state := self.job_state(job_id)) in {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"}:
            assert time.monotonic() < deadline, f"job {job_id} still {state} after {timeout_s} s"
            time.sleep(0.5)
        # COMPLETING ends when every process of the job is gone; the step daemons go last.
        self.wait_no_steps(timeout_s)
        return state

    def wait_no_steps(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while steps := [p for p in marked_processes(self.root) if p.startswith("slurmstepd:")]:
            assert time.monotonic() < deadline, f"step daemons still running: {steps}"
            time.sleep(0.2)

    def node_state(self) -> str:
        return self.run("sinfo", "-h", "-n", self.node, "-o", "%T").strip()

    def daemon_logs(self) -> str:
        logs = sorted((self.root / "log").glob("*"))
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}" for path in logs)


def _start(cluster: SlurmCluster, name: str, argv: list[str]) -> None:
    log = (cluster.root / "log" / f"{name}.out").open("wb")
    with log:
        cluster.daemons[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=cluster.env, cwd=cluster.root, start_new_session=True
        )


def _wait(cluster: SlurmCluster, what: str, ready: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for name, process in cluster.daemons.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited ({process.returncode}) while {what}:\n{cluster.daemon_logs()}")
        try:
            if ready():
                return
        except RuntimeError:
            pass  # a command that cannot reach the daemon yet
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out while {what}:\n{cluster.daemon_logs()}")
        time.sleep(0.2)


def _require_loopback(name: str) -> None:
    """srun and slurmd bind to the address this host's name resolves to
    (CommunicationParameters=NoInAddrAny): it must be a loopback one, so that every
    connection of the test cluster stays on this machine's loopback interface."""
    address = socket.gethostbyname(name)
    if not ipaddress.ip_address(address).is_loopback:
        raise RuntimeError(
            f"this host's name {name!r} resolves to {address}, not to a loopback address: "
            f"add '127.0.1.1 {name}' to /etc/hosts (as Debian's installer does) to run the test Slurm cluster"
        )


def _cancel_all(cluster: SlurmCluster) -> None:
    for job in cluster.run("squeue", "-h", "-o", "%i").split():
        cluster.run("scancel", job)
        cluster.wait_job_ended(int(job))


def _stop(cluster: SlurmCluster, daemon: str) -> None:
    process = cluster.daemons.get(daemon)
    if process is not None and process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


@contextmanager
def single_node_slurm() -> Iterator[SlurmCluster]:
    """munged, slurmctld and slurmd in a temporary folder; all stopped, and the folder
    removed, on exit. Needs root (slurmd starts jobs as their users)."""
    name, node = node_line()
    _require_loopback(name)
    # 0755 and under /tmp: the sandbox user (PostgreSQL's owner in the job) must reach the
    # job's scratch folder inside it, and Unix socket paths must stay under 108 bytes.
    root = Path(tempfile.mkdtemp(prefix="prorl-slurm-"))
    root.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "PRORL_"))}
    env["SLURM_CONF"] = str(root / "slurm.conf")
    cluster = SlurmCluster(root=root, node=name, env=env)
    try:
        with ExitStack() as stack:
            for folder in ("munge", "ctld", "slurmd", "log", "run", "scratch"):
                (root / folder).mkdir(mode=0o755)
            (root / "munge").chmod(0o700)
            key = root / "munge" / "munge.key"
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
            cluster.conf.write_text(slurm_conf(root, name, node, free_port(), free_port()))
            for daemon in DAEMONS:  # stopped last to first: slurmd, slurmctld, munged
                stack.callback(_stop, cluster, daemon)
            munge = root / "munge"
            _start(cluster, "munged", [
                "munged", "--foreground", "--force", f"--socket={munge}/munge.socket", f"--key-file={key}",
                f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/munged.seed",
                f"--log-file={root}/log/munged.log",
            ])  # fmt: skip
            _wait(cluster, "munged started", lambda: (munge / "munge.socket").exists())
            _start(cluster, "slurmctld", ["slurmctld", "-D", "-f", str(cluster.conf)])
            _wait(cluster, "slurmctld started", lambda: "UP" in cluster.run("scontrol", "ping"))
            _start(cluster, "slurmd", ["slurmd", "-D", "-f", str(cluster.conf), "-N", name])
            _wait(cluster, "the node became idle", lambda: cluster.node_state() == "idle")
            stack.callback(_cancel_all, cluster)  # first: jobs a failed test left running
            yield cluster
    finally:
        shutil.rmtree(root, ignore_errors=True)
    left = marked_processes(root)
    assert not left, f"processes of the test Slurm cluster are still running: {left}"
    assert not root.exists(), f"{root} was not removed"


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # gone meanwhile, or a kernel thread
        return b""


@dataclass(frozen=True)
class Process:
    pid: int
    uid: int
    cmdline: str
    environ: bytes

    def __str__(self) -> str:
        return f"{self.cmdline} (pid {self.pid}, uid {self.uid})"


def live_processes() -> Iterator[Process]:
    """Every process but this one, its zombies left out (already dead, waiting for PID 1
    to reap them), and Podman's pause process (`catatonit -P`) too: it holds the sandbox
    user's user namespace for every rootless Podman of that user on the host, outlives
    any one Podman by design and is shared with whatever else uses that user's Podman."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        state = _read(proc / "stat").rsplit(b")", 1)[-1].split()
        if not state or state[0] in (b"Z", b"X"):
            continue
        cmdline = _read(proc / "cmdline").replace(b"\0", b" ").strip().decode(errors="replace")
        if cmdline == "catatonit -P":
            continue
        try:
            uid = proc.stat().st_uid
        except OSError:
            continue
        yield Process(int(proc.name), uid, cmdline, _read(proc / "environ"))


def marked_processes(marker: Path) -> list[str]:
    """Processes whose command line or environment names `marker`: every daemon of the
    test cluster has it in its arguments, every process of a job and every step daemon
    inherits SLURM_CONF, which lies under it."""
    needle = str(marker)
    return [str(p) for p in live_processes() if needle in p.cmdline or needle.encode() in p.environ]


def job_processes(cluster: SlurmCluster, job_id: int) -> list[str]:
    """What still runs of one job: its step daemons and every process that inherited its
    SLURM_JOB_ID (the batch script, srun, the servers, PostgreSQL, Podman's service)."""
    conf = f"SLURM_CONF={cluster.conf}\0".encode()
    job = f"SLURM_JOB_ID={job_id}\0".encode()
    return [
        str(p)
        for p in live_processes()
        if conf in p.environ and (job in p.environ or p.cmdline.startswith(f"slurmstepd: [{job_id}."))
    ]
