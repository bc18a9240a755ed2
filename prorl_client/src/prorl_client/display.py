"""What `prorl run` shows while it runs and when it ends.

A live progress bar (rich, the `cli` extra) on a terminal; one plain line per
finished rollout otherwise (a log file, CI, or rich not installed), so the
output never mixes redrawn lines with anything else. At the end, a summary
table per task family computed from the result records alone, so the same
table can be made from any results file (`summarize`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

try:
    from rich import box
    from rich.console import Console, RenderableType
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TaskID,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.table import Table
    from rich.text import Text

    class _StatsProgress(Progress):
        """The bar on one line and the run's counts on the next (fits an 80-column terminal)."""

        stats = ""

        def get_renderables(self) -> Iterable[RenderableType]:
            yield self.make_tasks_table(self.tasks)
            yield Text.from_markup(self.stats)

except ImportError:  # the `cli` extra is not installed: plain text
    Console = None  # type: ignore[assignment,misc]


def _format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds + 0.5), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class RunDisplay:
    """Counts of a run (done, failed, running, queued, mean reward, rate, ETA) and their display.

    `started(job)` when a job's first phase begins, `finished(job, ok=...,
    reward=...)` when it ends; `close()` leaves the final state on screen.
    """

    def __init__(self, total: int, stream: TextIO, *, live: bool | None = None) -> None:
        self.total = total
        self.done = self.failed = 0
        self.reward_sum = 0.0
        self.started_at = time.monotonic()
        self._running: set[str] = set()
        self._stream = stream
        is_tty = bool(getattr(stream, "isatty", lambda: False)())
        self.live = (is_tty and Console is not None) if live is None else (live and Console is not None)
        self._progress: _StatsProgress | None = None
        self._task: TaskID | None = None
        if self.live and total:
            self._progress = _StatsProgress(
                SpinnerColumn(),
                TextColumn("[bold]rollouts"),
                BarColumn(bar_width=None),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                # rich's own estimate waits for a steady rate; this one is (left / rate so far).
                TextColumn("ETA {task.fields[eta]}"),
                console=Console(file=stream),
                expand=True,
            )
            self._task = self._progress.add_task("rollouts", total=total, eta="-")
            self._refresh()
            self._progress.start()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def queued(self) -> int:
        return max(self.total - self.done - self.running, 0)

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.done if self.done else 0.0

    @property
    def per_minute(self) -> float:
        return self.done / max(time.monotonic() - self.started_at, 1e-6) * 60

    def eta_seconds(self) -> float | None:
        if not self.done:
            return None
        return (self.total - self.done) / self.per_minute * 60

    def stats(self) -> str:
        return (
            f"  failed [red]{self.failed}[/] · running {self.running} · queued {self.queued} · "
            f"mean reward [cyan]{self.mean_reward:.3f}[/] · {self.per_minute:.1f} rollouts/min"
        )

    def started(self, job_id: str) -> None:
        if job_id not in self._running:
            self._running.add(job_id)
            self._refresh()

    def finished(self, job_id: str, *, ok: bool, reward: float) -> None:
        self._running.discard(job_id)
        self.done += 1
        self.failed += 0 if ok else 1
        self.reward_sum += reward
        if self._progress is None:
            self._stream.write(self.line() + "\n")
            self._stream.flush()
        self._refresh()

    def note(self, text: str) -> None:
        """A message above the bar (or a plain line)."""
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            self._stream.write(text + "\n")
            self._stream.flush()

    def line(self) -> str:
        return (
            f"rollouts {self.done}/{self.total} | failed {self.failed} | running {self.running} | "
            f"queued {self.queued} | mean reward {self.mean_reward:.3f} | {self.per_minute:.1f} rollouts/min | "
            f"ETA {_format_eta(self.eta_seconds())}"
        )

    def _refresh(self) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.stats = self.stats()
            self._progress.update(self._task, completed=self.done, eta=_format_eta(self.eta_seconds()))

    def close(self) -> None:
        if self._progress is not None:
            self._refresh()
            self._progress.stop()
            self._progress = None


# --- The summary table -------------------------------------------------------


@dataclass
class FamilySummary:
    family: str
    rollouts: int = 0
    succeeded: int = 0
    reward_sum: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    format_errors: int = 0
    stop_reasons: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.rollouts if self.rollouts else 0.0

    @property
    def mean_turns(self) -> float:
        return self.turns / self.rollouts if self.rollouts else 0.0


def tool_call_count(record: dict[str, Any]) -> int:
    """Tool calls of a rollout: from its timeline when the runner saw the events, else from its messages."""
    timeline = record.get("timeline")
    if timeline:
        return sum(1 for span in timeline if span.get("kind") == "tool")
    return sum(
        1
        for m in record.get("messages", [])
        if m.get("role") == "tool" or (m.get("role") == "user" and "<tool_response>" in m.get("content", ""))
    )


def failure_label(failure: dict[str, Any] | None) -> str | None:
    if not failure:
        return None
    kind = str(failure.get("kind", "")).removeprefix("FAILURE_KIND_").lower() or "unknown"
    return f"{kind}: {failure.get('reason') or 'unknown'}"


def summarize(records: Iterable[dict[str, Any]]) -> list[FamilySummary]:
    """One row per task family (handler), in first-seen order."""
    rows: dict[str, FamilySummary] = {}
    for record in records:
        family = str(record.get("handler") or "?")
        row = rows.setdefault(family, FamilySummary(family))
        details = record.get("details") or {}
        row.rollouts += 1
        row.succeeded += record.get("status") == "JOB_STATUS_SUCCEEDED"
        row.reward_sum += float(record.get("reward") or 0.0)
        row.turns += int(record.get("num_turns") or 0)
        row.tool_calls += tool_call_count(record)
        row.format_errors += int(details.get("format_errors") or 0)
        if details.get("stop_reason"):
            row.stop_reasons[str(details["stop_reason"])] += 1
        label = failure_label(record.get("failure"))
        if label:
            row.failures[label] += 1
    return list(rows.values())


COLUMNS = (
    "family",
    "rollouts",
    "ok",
    "mean reward",
    "mean turns",
    "tool calls",
    "format errors",
    "stopped by",
    "failures",
)


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{name} x{n}" for name, n in counter.most_common()) or "-"


def summary_rows(rows: list[FamilySummary]) -> list[list[str]]:
    table = [
        [
            r.family,
            str(r.rollouts),
            str(r.succeeded),
            f"{r.mean_reward:.3f}",
            f"{r.mean_turns:.1f}",
            str(r.tool_calls),
            str(r.format_errors),
            _counts(r.stop_reasons),
            _counts(r.failures),
        ]
        for r in rows
    ]
    if len(rows) > 1:
        total = FamilySummary("all")
        for r in rows:
            total.rollouts += r.rollouts
            total.succeeded += r.succeeded
            total.reward_sum += r.reward_sum
            total.turns += r.turns
            total.tool_calls += r.tool_calls
            total.format_errors += r.format_errors
            total.stop_reasons.update(r.stop_reasons)
            total.failures.update(r.failures)
        table.append(summary_rows([total])[0])
    return table


def plain_table(rows: list[list[str]]) -> str:
    """The summary as fixed-width text (no rich needed; also what the README shows)."""
    widths = [max(len(COLUMNS[i]), *(len(row[i]) for row in rows)) for i in range(len(COLUMNS))]

    def fmt(cells: Iterable[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()

    return "\n".join([fmt(COLUMNS), fmt("-" * w for w in widths), *(fmt(row) for row in rows)])


def print_summary(records: list[dict[str, Any]], stream: TextIO, *, rich: bool | None = None) -> None:
    """The per-family summary table, drawn with rich when it is installed and `stream` is a terminal."""
    rows = summary_rows(summarize(records))
    if not rows:
        return
    use_rich = (bool(getattr(stream, "isatty", lambda: False)()) if rich is None else rich) and Console is not None
    if not use_rich:
        stream.write(plain_table(rows) + "\n")
        stream.flush()
        return
    table = Table(title="rollouts by task family", title_justify="left", box=box.SIMPLE_HEAD)
    for index, name in enumerate(COLUMNS):
        # Two-line headers keep the numeric columns narrow.
        numeric = 0 < index < 7
        table.add_column(name.replace(" ", "\n"), justify="right" if numeric else "left", no_wrap=index < 7)
    for index, row in enumerate(rows):
        table.add_row(*row, end_section=index == len(rows) - 2 and len(rows) > 1)
    Console(file=stream).print(table)
