"""The output of `prorl tail`: its records (JSON Lines, Parquet), the sinks that append them
durably, and the cursor file that says how far the output goes (see tail.py for the guarantees)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timezone
from pathlib import Path
from typing import IO, Any, Protocol

from google.protobuf.json_format import MessageToDict

from prorl_client import v1
from prorl_client.records import result_record

EXIT_ERROR = 1
STATUSES = {
    "succeeded": v1.JOB_STATUS_SUCCEEDED,
    "failed": v1.JOB_STATUS_FAILED,
    "cancelled": v1.JOB_STATUS_CANCELLED,
    "timed_out": v1.JOB_STATUS_TIMED_OUT,
}
CURSOR_FILE_VERSION = 1
TIMING_FIELDS = tuple(f.name for f in v1.Timing.DESCRIPTOR.fields)


class TailError(Exception):
    """A reason to stop that the user can act on: printed without a traceback."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


# --- What to follow, and where it was left ---------------------------------------------


@dataclass(frozen=True)
class TailFilter:
    handlers: tuple[str, ...] = ()
    group_ids: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    statuses: tuple[str, ...] = ()
    """Names of STATUSES."""

    def subscribe_args(self) -> dict[str, Any]:
        return {
            "handlers": list(self.handlers),
            "group_ids": list(self.group_ids),
            "labels": dict(self.labels),
            "statuses": [STATUSES[name] for name in self.statuses],
            "event_kinds": ["finished"],
        }

    def describe(self) -> dict[str, Any]:
        """As the cursor file keeps it: the same filter always gives the same value."""
        return {
            "handlers": sorted(set(self.handlers)),
            "group_ids": sorted(set(self.group_ids)),
            "labels": dict(sorted(self.labels)),
            "statuses": sorted(set(self.statuses)),
        }


@dataclass(frozen=True)
class Position:
    """How far the output goes: the feed cursor it ends at, its extent (bytes of a JSONL file,
    part files of a Parquet directory) and the records it holds."""

    cursor: str
    extent: int
    records: int


def cursor_path(out: Path) -> Path:
    return out.with_name(out.name + ".cursor")


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` by `data`: a reader (or a crash) sees the old content or the new, never a mix."""
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    _fsync_dir(path.parent)


def save_position(path: Path, position: Position, *, output_format: str, wanted: TailFilter) -> None:
    unit = "bytes" if output_format == "jsonl" else "parts"
    document = {
        "version": CURSOR_FILE_VERSION,
        "format": output_format,
        "cursor": position.cursor,
        unit: position.extent,
        "records": position.records,
        "filter": wanted.describe(),
    }
    write_atomic(path, (json.dumps(document, indent=1) + "\n").encode())


def load_position(path: Path, *, output_format: str, wanted: TailFilter) -> Position | None:
    """The saved position; refuses a cursor file of another format or filter, whose cursor
    would not mean what this run takes it to mean."""
    if not path.exists():
        return None
    try:
        document = json.loads(path.read_text())
        unit = "bytes" if document["format"] == "jsonl" else "parts"
        position = Position(str(document["cursor"]), int(document[unit]), int(document["records"]))
        saved_format, saved_filter = document["format"], document["filter"]
    except (ValueError, KeyError, TypeError) as exc:
        raise TailError(f"{path}: not a cursor file of prorl tail ({exc!r}); move it away to start again") from None
    if saved_format != output_format:
        raise TailError(f"{path} belongs to a {saved_format} output, this run writes {output_format}")
    if saved_filter != wanted.describe():
        raise TailError(
            f"{path} was written for the filter {json.dumps(saved_filter)}, this run asks for "
            f"{json.dumps(wanted.describe())}: use the same filter, or another --out"
        )
    return position


# --- Records ---------------------------------------------------------------------------


def _job_fields(item: v1.FeedEvent) -> dict[str, Any]:
    """The job's handler, group and labels, as a feed event carries them."""
    return {"handler": item.handler, "group_id": item.group_id, "labels": dict(item.labels)}


def json_record(item: v1.FeedEvent) -> dict[str, Any]:
    """A JSONL line: the feed's fields, the job's, then the fields of a `prorl run` line."""
    result = item.event.finished.result
    fields = _job_fields(item)
    run_fields = result_record(fields["group_id"] or "", 0, result, handler=fields["handler"] or "")
    # `prorl run` names the GRPO group after the task; the sample number exists in its job ids only.
    run_fields.update(task_id=fields["group_id"], sample=None, handler=fields["handler"])
    return {
        "job_id": item.event.job_id,
        "attempt": item.attempt,
        "cursor": item.cursor,
        "store_time": item.store_time.ToJsonString(),
        "group_id": fields["group_id"],
        "labels": fields["labels"],
        **run_fields,
    }


def parquet_schema(pa: Any) -> Any:
    tool_call = pa.struct([("id", pa.string()), ("name", pa.string()), ("arguments_json", pa.string())])
    message = pa.struct(
        [
            ("role", pa.string()),
            ("content", pa.string()),
            ("tool_calls", pa.list_(tool_call)),
            ("tool_call_id", pa.string()),
            ("name", pa.string()),
        ]
    )
    span = pa.struct(
        [
            ("turn", pa.int32()),
            ("start", pa.int32()),
            ("end", pa.int32()),
            ("policy_version", pa.int64()),
            ("logprobs_mode", pa.string()),
        ]
    )
    failure = pa.struct([(name, pa.string()) for name in ("kind", "phase", "reason", "message")])
    return pa.schema(
        [
            ("job_id", pa.string()),
            ("attempt", pa.int32()),
            ("cursor", pa.string()),
            ("store_time", pa.timestamp("us", tz="UTC")),
            ("handler", pa.string()),
            ("group_id", pa.string()),
            ("labels", pa.map_(pa.string(), pa.string())),
            ("status", pa.string()),
            ("reward", pa.float64()),
            ("failure", failure),
            ("messages", pa.list_(message)),
            ("token_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int32())),
            ("logprobs", pa.list_(pa.float32())),
            ("turn_policy_versions", pa.list_(pa.int64())),
            ("turn_spans", pa.list_(span)),
            ("num_turns", pa.int32()),
            ("timing", pa.struct([(name, pa.float64()) for name in TIMING_FIELDS])),
            ("details", pa.string()),
        ]
    )


def parquet_row(item: v1.FeedEvent) -> dict[str, Any]:
    """A Parquet row: the JSONL record's fields, typed (snake_case throughout, timing in
    seconds, details as a JSON text)."""
    result = item.event.finished.result
    trajectory = result.trajectory
    failure = result.failure
    return {
        "job_id": item.event.job_id,
        "attempt": item.attempt,
        "cursor": item.cursor,
        "store_time": item.store_time.ToDatetime(tzinfo=timezone.utc),  # noqa: UP017 (the client runs on 3.10)
        **_job_fields(item),
        "status": v1.JobStatus.Name(result.status),
        "reward": result.reward,
        "failure": {
            "kind": v1.FailureKind.Name(failure.kind),
            "phase": v1.Phase.Name(failure.phase),
            "reason": failure.reason,
            "message": failure.message,
        }
        if result.HasField("failure")
        else None,
        "messages": [
            {
                "role": m.role,
                "content": m.content,
                "tool_calls": [{"id": c.id, "name": c.name, "arguments_json": c.arguments_json} for c in m.tool_calls],
                "tool_call_id": m.tool_call_id,
                "name": m.name,
            }
            for m in trajectory.messages
        ],
        "token_ids": list(trajectory.token_ids),
        "loss_mask": list(trajectory.loss_mask),
        "logprobs": list(trajectory.logprobs),
        "turn_policy_versions": list(trajectory.turn_policy_versions),
        "turn_spans": [
            {
                "turn": s.turn,
                "start": s.start,
                "end": s.end,
                "policy_version": s.policy_version,
                "logprobs_mode": v1.LogprobsMode.Name(s.logprobs_mode),
            }
            for s in trajectory.turn_spans
        ],
        "num_turns": trajectory.num_turns,
        "timing": {name: getattr(result.timing, name).ToNanoseconds() / 1e9 for name in TIMING_FIELDS},
        "details": json.dumps(MessageToDict(result.details)),
    }


# --- Outputs ---------------------------------------------------------------------------


class Sink(Protocol):
    def recover(self, saved: Position | None) -> Position | None:
        """Open the output; the position to go on from (None: nothing written yet)."""

    def append(self, item: v1.FeedEvent) -> None: ...

    def sync(self) -> int:
        """Make everything appended durable; the output's extent."""

    def close(self) -> None: ...


def _record_cursor(line: bytes) -> str | None:
    """The cursor of a complete JSONL record, None for anything else (a line cut short)."""
    if not line.endswith(b"\n"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    cursor = record.get("cursor") if isinstance(record, dict) else None
    return cursor if isinstance(cursor, str) and cursor else None


class JsonlSink:
    """One JSON line per record, written through to the OS at once (a killed process loses
    nothing it wrote), made durable by `sync`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[bytes] | None = None

    def recover(self, saved: Position | None) -> Position | None:
        position = saved or Position("", 0, 0)
        size = self.path.stat().st_size if self.path.exists() else 0
        if size < position.extent:
            raise TailError(
                f"{self.path} holds {size} bytes, fewer than the {position.extent} its cursor file covers: "
                "it was truncated or replaced; move both away to start again"
            )
        if size > position.extent:
            position = self._complete_records(position)
            if position.extent < size:  # a line cut short by a kill: its record comes again
                os.truncate(self.path, position.extent)
        created = not self.path.exists()
        self._file = self.path.open("ab")
        if created:
            _fsync_dir(self.path.parent)
        return position if position.cursor else None

    def _complete_records(self, position: Position) -> Position:
        """The position after the complete records beyond `position`."""
        with self.path.open("rb") as file:
            file.seek(position.extent)
            for line in file:
                cursor = _record_cursor(line)
                if cursor is None:
                    break
                position = Position(cursor, position.extent + len(line), position.records + 1)
        return position

    def append(self, item: v1.FeedEvent) -> None:
        assert self._file is not None
        self._file.write(json.dumps(json_record(item)).encode() + b"\n")
        self._file.flush()

    def sync(self) -> int:
        assert self._file is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        return self._file.tell()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _import_pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow  # type: ignore[import-not-found,import-untyped,unused-ignore]
        import pyarrow.parquet  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        raise TailError("writing Parquet needs pyarrow: pip install 'prorl-client[parquet]'") from None
    return pyarrow, pyarrow.parquet


def part_name(index: int) -> str:
    return f"part-{index:06d}.parquet"


class ParquetSink:
    """Records kept in memory until `sync` writes them as the directory's next part file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pa, self._pq = _import_pyarrow()
        self._schema = parquet_schema(self._pa)
        self._rows: list[dict[str, Any]] = []
        self._parts = 0

    def recover(self, saved: Position | None) -> Position | None:
        position = saved or Position("", 0, 0)
        self.path.mkdir(parents=True, exist_ok=True)
        for leftover in self.path.glob(".part-*.tmp"):  # a part not yet renamed: its records come again
            leftover.unlink()
        parts = sorted(p.name for p in self.path.glob("part-*.parquet"))
        if parts != [part_name(index) for index in range(len(parts))] or len(parts) < position.extent:
            raise TailError(
                f"{self.path} should hold parts {part_name(0)} to {part_name(max(position.extent, 1) - 1)} "
                f"without gaps, it holds {len(parts)} part files: move it and its cursor file away to start again"
            )
        for name in parts[position.extent :]:  # renamed, but not yet in the cursor file
            cursors = self._pq.read_table(self.path / name, columns=["cursor"]).column("cursor")
            last = cursors[-1].as_py() if len(cursors) else position.cursor
            position = Position(last, position.extent + 1, position.records + len(cursors))
        self._parts = len(parts)
        return position if position.cursor else None

    def append(self, item: v1.FeedEvent) -> None:
        self._rows.append(parquet_row(item))

    def sync(self) -> int:
        if self._rows:
            table = self._pa.Table.from_pylist(self._rows, schema=self._schema)
            final = self.path / part_name(self._parts)
            temporary = self.path / f".{final.name}.tmp"
            self._pq.write_table(table, temporary)
            with temporary.open("rb") as file:
                os.fsync(file.fileno())
            os.replace(temporary, final)
            _fsync_dir(self.path)
            self._parts += 1
            self._rows = []
        return self._parts

    def close(self) -> None:
        self._rows = []


def open_sink(out: Path, output_format: str) -> Sink:
    return JsonlSink(out) if output_format == "jsonl" else ParquetSink(out)
