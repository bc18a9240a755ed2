"""The checks a fork's snapshot passes: on the host (check_archive) and in the fork's sandbox
(the unpacking script refuses the same members itself). Hostile archives as a policy that
replaced the sandbox's python3 could write them: none may name anything outside its roots."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from prorl_server.sandbox import snapshot
from prorl_server.sandbox.snapshot import Root, SnapshotRefused, check_archive


def archive(*members: tuple[str, bytes | str | None, bytes]) -> bytes:
    """(name, kind, content): kind b"" a file, "dir", "sym:<target>", "hard:<target>", "chr", "fifo"."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, kind, content in members:
            info = tarfile.TarInfo(name)
            if kind == "dir":
                info.type = tarfile.DIRTYPE
            elif isinstance(kind, str) and kind.startswith("sym:"):
                info.type, info.linkname = tarfile.SYMTYPE, kind[4:]
            elif isinstance(kind, str) and kind.startswith("hard:"):
                info.type, info.linkname = tarfile.LNKTYPE, kind[5:]
            elif kind == "chr":
                info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
            else:
                info.size = len(content)
            tar.addfile(info, io.BytesIO(content) if info.isreg() else None)
    return buffer.getvalue()


ROOTS = (Root("work"), Root("tmp"))
GOOD = archive(("work", "dir", b""), ("work/a.txt", b"", b"hello"), ("work/link", "sym:/etc/passwd", b""))
HOSTILE = {
    "traversal": archive(("work/../../etc/cron.d/x", b"", b"pwn")),
    "absolute": archive(("/etc/passwd", b"", b"pwn")),
    "unknown root": archive(("home/.ssh/authorized_keys", b"", b"key")),
    "device": archive(("work/mem", "chr", b"")),
    "fifo": archive(("work/pipe", "fifo", b"")),
    "hard link out": archive(("work/h", "hard:/etc/shadow", b"")),
    "huge": archive(("work/big", b"", b"x" * 5000)),
    "beneath a link": archive(("work/l", "sym:/etc", b""), ("work/l/cron.d", "dir", b""), ("work/l/x", b"", b"pwn")),
}


def test_an_ordinary_snapshot_passes_and_a_link_stays_a_link() -> None:
    check_archive(GOOD, ROOTS, max_bytes=4096)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_the_host_refuses_a_hostile_archive(case: str) -> None:
    with pytest.raises(SnapshotRefused):
        check_archive(HOSTILE[case], ROOTS, max_bytes=4096)


def test_the_host_refuses_what_is_not_an_archive() -> None:
    with pytest.raises(SnapshotRefused, match="not a readable archive"):
        check_archive(b"\x00garbage" * 100, ROOTS, max_bytes=4096)


def restore_in(folder: Path, data: bytes) -> subprocess.CompletedProcess[str]:
    """The fork's unpacking script, as the fork's sandbox runs it, on a folder of this host."""
    (folder / "scratch").mkdir()
    path = folder / "scratch" / "files.tar"
    path.write_bytes(data)
    args = {"archive": str(path), "roots": [["work", str(folder / "work"), []]]}
    return subprocess.run(
        [sys.executable, "-c", snapshot._RESTORE, json.dumps(args)], capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize(
    "case", ["traversal", "absolute", "unknown root", "device", "fifo", "hard link out", "beneath a link"]
)
def test_the_unpacking_script_refuses_a_hostile_archive_too(tmp_path: Path, case: str) -> None:
    (tmp_path / "outside.txt").write_text("untouched")
    result = restore_in(tmp_path, HOSTILE[case])
    assert result.returncode != 0 and "bad member" in result.stderr
    assert (tmp_path / "outside.txt").read_text() == "untouched"
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())


def test_the_unpacking_script_makes_the_root_exactly_the_snapshot(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "old").mkdir(parents=True)
    (work / "old" / "stale.txt").write_text("not in the snapshot")
    (work / "a.txt").write_text("before")
    result = restore_in(tmp_path, GOOD)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in work.iterdir()) == ["a.txt", "link"]
    assert (work / "a.txt").read_bytes() == b"hello" and (work / "link").readlink() == Path("/etc/passwd")
