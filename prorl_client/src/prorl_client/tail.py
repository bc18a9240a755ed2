"""`prorl tail --server ADDR --out PATH`: every finished trajectory that matches a filter, appended to PATH.

Follows the service's event feed (Subscribe, `finished` events only) and appends one record per
finished job: to a JSON Lines file (the default; the fields of a `prorl run` line plus the
feed's), or to a directory of Parquet part files (`--format parquet`, or a PATH ending in
.parquet), since a Parquet file cannot be appended to. Each part is written under a temporary
name and renamed when complete.

Exactly once across crashes. Beside the output, PATH.cursor (JSON, replaced atomically) holds
the feed cursor to go on after and how much of the output it covers: bytes of the JSONL file,
or part files of the directory. It is written only once the data it covers is durable (fsync),
so it never claims more than the output holds. The output may hold more than it says (the
tail was killed between the two writes): on start the records beyond it are kept, a line cut
short is cut off, and the feed resumes after the last complete record's own cursor. Progress
marks (nothing matched up to a cursor) advance the saved cursor too. So a tail killed at any
moment and started again with the same arguments writes every matching finished job exactly
once in all.

Stopping: SIGINT or SIGTERM, --max-records, --until-idle (exit 0, the cursor saved). A server
that went away (UNAVAILABLE) or a tail that fell behind (RESOURCE_EXHAUSTED) is resumed by
Client.follow_feed. Events deleted by retention after the saved cursor end the tail with exit
code 3 and a message saying how to go on (`--from oldest`, accepting the gap): nothing is
skipped silently.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import grpc

from prorl_client import v1
from prorl_client._client import Client
from prorl_client._errors import RpcError
from prorl_client.tail_output import (
    EXIT_ERROR,
    STATUSES,
    Position,
    Sink,
    TailError,
    TailFilter,
    cursor_path,
    load_position,
    open_sink,
    save_position,
)

try:
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text
except ImportError:  # the `cli` extra is not installed: plain lines
    Live = None  # type: ignore[assignment,misc]

EXIT_GAP = 3
FORMATS = ("jsonl", "parquet")
# How often the output is made durable and the cursor saved, by format: every N records or T
# seconds, whichever comes first. A Parquet part per second would be thousands of tiny files.
FLUSH_DEFAULTS = {"jsonl": (100, 1.0), "parquet": (1000, 30.0)}
# Responses read ahead of the writer; beyond it the stream waits (gRPC flow control), so a
# slow disk shows on the server as a slow consumer rather than as memory here.
READ_AHEAD = 256


# --- Progress --------------------------------------------------------------------------


class TailDisplay:
    """Records written this run, their rate, and how long ago the store received the last one:
    a live line (rich) on a terminal, else a plain line every few seconds while records come."""

    def __init__(self, stream: TextIO, *, quiet: bool = False, interval_s: float = 5.0) -> None:
        self.written = 0
        self.started = time.monotonic()
        self.last_store_time: float | None = None
        self._stream = stream
        self._quiet = quiet
        self._interval_s = interval_s
        self._shown_at = self.started
        self._shown = 0
        self._live: Any = None
        if not quiet and Live is not None and bool(getattr(stream, "isatty", lambda: False)()):
            self._live = Live(Text(self.line()), console=Console(file=stream), refresh_per_second=4)
            self._live.start()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        lag = "-" if self.last_store_time is None else f"{max(time.time() - self.last_store_time, 0.0):.1f}s"
        return f"tail: {self.written} records written | {self.written / elapsed:.1f}/s | last stored {lag} ago"

    def record(self, store_time: float) -> None:
        self.written += 1
        self.last_store_time = store_time

    def tick(self) -> None:
        if self._live is not None:
            self._live.update(Text(self.line()))
        elif not self._quiet and self.written != self._shown and time.monotonic() - self._shown_at >= self._interval_s:
            self._print(self.line())

    def note(self, text: str, *, always: bool = False) -> None:
        """A message above the live line (or a plain line); `always`: even when quiet."""
        if self._live is not None:
            self._live.console.print(text, markup=False, highlight=False)
        elif always or not self._quiet:
            self._print(text)

    def _print(self, text: str) -> None:
        self._stream.write(text + "\n")
        self._stream.flush()
        self._shown, self._shown_at = self.written, time.monotonic()

    def close(self) -> None:
        if self._live is not None:
            self._live.update(Text(self.line()))
            self._live.stop()
            self._live = None


# --- Following -------------------------------------------------------------------------


@dataclass(frozen=True)
class TailOptions:
    output_format: str = "jsonl"
    wanted: TailFilter = field(default_factory=TailFilter)
    start: str | None = None
    """"now" or "oldest" for a first start; "oldest" also accepts a gap at a restart whose
    saved cursor is behind retention. None: "now"."""
    flush_records: int = 100
    flush_seconds: float = 1.0
    max_records: int | None = None
    until_idle_s: float | None = None
    retries: int = 20
    """Failed resumptions in a row before giving up (see Client.follow_feed)."""


Item = v1.FeedEvent | Exception


class Tail:
    """Reads the feed ahead in one task, writes and saves in another (`run`), so the writer
    can wait at once for an item of the feed, its next flush and a request to stop."""

    def __init__(self, client: Client, out: Path, sink: Sink, options: TailOptions, display: TailDisplay) -> None:
        self.client = client
        self.out = out
        self.sink = sink
        self.options = options
        self.display = display
        self.position = Position("", 0, 0)
        self.cursor = ""
        self.pending = 0
        self._pending_since = 0.0
        self._queue: asyncio.Queue[Item] = asyncio.Queue(READ_AHEAD)
        self._reader: asyncio.Task[None] | None = None
        self._getter: asyncio.Future[Item] | None = None
        self._stopping: asyncio.Future[Any] | None = None
        self._sink_failed = False

    async def run(self, stop: asyncio.Event) -> None:
        """Follow until stopped; the cursor is saved on every way out. Raises RpcError (the
        feed's own errors, OUT_OF_RANGE included) and TailError."""
        state = cursor_path(self.out)
        saved = load_position(state, output_format=self.options.output_format, wanted=self.options.wanted)
        resumed = await asyncio.to_thread(self.sink.recover, saved)
        if resumed is not None and resumed != saved:
            self.display.note(
                f"{self.out} holds {resumed.records - (saved.records if saved else 0)} record(s) past its cursor "
                "file: going on after the last of them"
            )
        self.position = resumed or self.position
        self.cursor = self.position.cursor
        if resumed != saved:
            await self._save(force=True)  # the cursor file covers the recovered output from now on
        start = self.cursor or ("oldest" if self.options.start == "oldest" else "")
        self.display.note(
            f"following into {self.out}: "
            + (f"after its saved cursor ({self.position.records} records)" if self.cursor else f"from {start or 'now'}")
        )
        self._read_from(start)
        self._stopping = stopping = asyncio.ensure_future(stop.wait())
        try:
            await self._follow(stopping, resumed is not None)
        finally:
            for task in (self._reader, self._getter, stopping):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            if not self._sink_failed:  # else the output may end in a part-written record: the next start cuts it
                await self._save()
            await asyncio.to_thread(self.sink.close)
            self.display.close()

    def _read_from(self, after_cursor: str) -> None:
        self._reader = asyncio.create_task(self._read(after_cursor), name="tail-read")

    async def _read(self, after_cursor: str) -> None:
        """follow_feed resumes a stream that ended UNAVAILABLE, RESOURCE_EXHAUSTED or
        CANCELLED (a stopping server's), from the last cursor read."""
        try:
            async for item in self.client.follow_feed(
                after_cursor=after_cursor, retries=self.options.retries, **self.options.wanted.subscribe_args()
            ):
                await self._queue.put(item)
        except Exception as exc:  # the writer raises it after what came before it
            await self._queue.put(exc)

    async def _follow(self, stopping: asyncio.Future[Any], resumed: bool) -> None:
        options = self.options
        started = False
        last_record: float | None = None  # the idle clock starts at the feed's first message
        while not stopping.done():
            now = time.monotonic()
            waits = [1.0]  # the display's tick
            if self.pending:
                waits.append(self._pending_since + options.flush_seconds - now)
            if options.until_idle_s is not None and last_record is not None:
                waits.append(last_record + options.until_idle_s - now)
            item = await self._next(stopping, max(min(waits), 0.0))
            if isinstance(item, Exception):
                if self._accepts_gap(item, started=started, resumed=resumed):
                    started = True
                    self._read_from("oldest")
                    continue
                raise item
            if item is not None:
                started = True
                if await self._take(item) or last_record is None:
                    last_record = time.monotonic()
            if self.pending and (
                self.pending >= options.flush_records or time.monotonic() - self._pending_since >= options.flush_seconds
            ):
                await self._save()
            self.display.tick()
            if options.max_records is not None and self.display.written >= options.max_records:
                return
            if (
                options.until_idle_s is not None
                and last_record is not None
                and time.monotonic() - last_record >= options.until_idle_s
            ):
                return

    def _accepts_gap(self, error: Exception, *, started: bool, resumed: bool) -> bool:
        """A restart's saved cursor is behind retention and `--from oldest` says to go on."""
        if not (isinstance(error, RpcError) and error.code == grpc.StatusCode.OUT_OF_RANGE):
            return False
        if started or not resumed or self.options.start != "oldest":
            return False
        self.display.note(
            f"warning: {error.details}. --from oldest: going on from the oldest event the server keeps; "
            "the jobs that finished in between are NOT in the output",
            always=True,
        )
        return True

    async def _next(self, stopping: asyncio.Future[Any], wait_s: float) -> Item | None:
        """The next item of the feed or error; None when `wait_s` passes or a stop is asked for first."""
        if self._getter is None:
            self._getter = asyncio.ensure_future(self._queue.get())
        done, _ = await asyncio.wait({self._getter, stopping}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        if self._getter not in done:
            return None
        item, self._getter = self._getter.result(), None
        return item

    async def _take(self, item: v1.FeedEvent) -> bool:
        """Write an item's record, if it has one; True when it had. The cursor moves past
        an item once it is written, not before."""
        if not (item.HasField("event") and item.event.HasField("finished")):
            self.cursor = item.cursor
            if not self.pending:  # a progress mark with nothing unsaved before it
                await self._save()
            return False
        try:
            self.sink.append(item)
        except BaseException:
            self._sink_failed = True
            raise
        self.cursor = item.cursor
        if not self.pending:
            self._pending_since = time.monotonic()
        self.pending += 1
        self.display.record(item.store_time.ToNanoseconds() / 1e9)
        return True

    async def _save(self, *, force: bool = False) -> None:
        """Make the output durable, then record in the cursor file how far it goes."""
        if not self.cursor:
            return  # no message yet: nothing to resume after
        position = Position(self.cursor, 0, self.position.records + self.pending)
        if position.cursor == self.position.cursor and not self.pending and not force:
            return
        extent = await asyncio.to_thread(self.sink.sync)
        position = replace(position, extent=extent)
        options = self.options
        await asyncio.to_thread(
            save_position,
            cursor_path(self.out),
            position,
            output_format=options.output_format,
            wanted=options.wanted,
        )
        self.position, self.pending = position, 0


# --- The command -----------------------------------------------------------------------


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "tail", help="append every finished trajectory that matches a filter to --out (resumable, exactly once)"
    )
    parser.add_argument("--server", default="localhost:50051", help="host:port of the prorl server")
    parser.add_argument("--out", type=Path, required=True, help="JSONL file, or Parquet directory (see --format)")
    parser.add_argument(
        "--format", choices=FORMATS, help="jsonl (default) or parquet (default for an --out ending in .parquet)"
    )
    parser.add_argument("--handler", action="append", default=[], help="only jobs of this handler (repeatable)")
    parser.add_argument("--group", action="append", default=[], help="only jobs of this GRPO group (repeatable)")
    parser.add_argument(
        "--label", action="append", type=_label, default=[], metavar="KEY=VALUE", help="only jobs with this label"
    )
    parser.add_argument("--status", action="append", choices=sorted(STATUSES), default=[], help="only jobs ending so")
    parser.add_argument(
        "--from",
        dest="start",
        choices=("now", "oldest"),
        help="where a first start begins (default now); a restart goes on from the saved cursor, and with "
        "--from oldest also past events that retention deleted (accepting the gap)",
    )
    parser.add_argument("--flush-records", type=int, help="save every N records (default 100; Parquet: 1000)")
    parser.add_argument("--flush-seconds", type=float, help="or every T seconds (default 1; Parquet: 30)")
    parser.add_argument("--max-records", type=int, help="stop after writing N records")
    parser.add_argument(
        "--until-idle",
        type=float,
        metavar="S",
        help="stop when no record came for S seconds (counted from the server's first answer)",
    )
    parser.add_argument("--retries", type=int, default=20, help="failed reconnections in a row before giving up")
    parser.add_argument("--quiet", action="store_true", help="no progress on standard error")
    parser.add_argument("--token", default=os.environ.get("PRORL_TOKEN"), help="bearer token (or PRORL_TOKEN)")
    parser.add_argument("--tls-ca", type=Path, help="PEM CA certificate: connect with TLS, trusting it")


def options_of(args: argparse.Namespace) -> TailOptions:
    output_format = args.format or ("parquet" if args.out.suffix == ".parquet" else "jsonl")
    records, seconds = FLUSH_DEFAULTS[output_format]
    options = TailOptions(
        output_format=output_format,
        wanted=TailFilter(
            handlers=tuple(args.handler),
            group_ids=tuple(args.group),
            labels=tuple(args.label),
            statuses=tuple(args.status),
        ),
        start=args.start,
        flush_records=args.flush_records or records,
        flush_seconds=args.flush_seconds or seconds,
        max_records=args.max_records,
        until_idle_s=args.until_idle,
        retries=args.retries,
    )
    if options.flush_records < 1 or options.flush_seconds <= 0:
        raise TailError("--flush-records and --flush-seconds must be positive", code=2)
    return options


def gap_message(error: RpcError, out: Path) -> str:
    return (
        f"prorl tail: the server no longer has the events after the saved cursor ({error.details}).\n"
        f"{out} is complete up to that cursor; nothing was skipped. To go on from the oldest event the "
        "server keeps, accepting that the jobs that finished in between are missing, run the same "
        "command again with --from oldest."
    )


async def _tail(args: argparse.Namespace, options: TailOptions, sink: Sink, display: TailDisplay) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals: Sequence[signal.Signals] = (signal.SIGINT, signal.SIGTERM)
    for number in signals:
        loop.add_signal_handler(number, stop.set)
    credentials = grpc.ssl_channel_credentials(args.tls_ca.read_bytes()) if args.tls_ca else None
    try:
        async with Client.connect(args.server, credentials=credentials, token=args.token) as client:
            await Tail(client, args.out, sink, options, display).run(stop)
    finally:
        for number in signals:
            loop.remove_signal_handler(number)


def command(args: argparse.Namespace) -> int:
    display = TailDisplay(sys.stderr, quiet=args.quiet)
    try:
        options = options_of(args)
        asyncio.run(_tail(args, options, open_sink(args.out, options.output_format), display))
    except TailError as exc:
        print(f"prorl tail: {exc}", file=sys.stderr)
        return exc.code
    except RpcError as exc:
        if exc.code == grpc.StatusCode.OUT_OF_RANGE:
            print(gap_message(exc, args.out), file=sys.stderr)
            return EXIT_GAP
        print(f"prorl tail: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(
        f"prorl tail: {display.written} records written to {args.out} this run; cursor in {cursor_path(args.out)}",
        file=sys.stderr,
    )
    return 0
