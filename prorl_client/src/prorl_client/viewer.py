"""`prorl view RESULTS.jsonl`: one self-contained HTML page of rollouts.

Reads the lines `prorl run` (or the demo) writes and renders, with no network
needed to open the page: the rollouts (status, reward, family; filterable),
and for each one its conversation (messages, tool calls and results, the
evaluation's details), its tokens coloured by loss mask and shaded by
log-prob (hover: id, text, log-prob), the policy version of each turn, and
its timing as a waterfall (each model turn's wait for a slot on a shared
backend is a bar of its own before the turn). Everything is rendered here as static HTML; the
page's small script only filters the list and switches rollouts, so the
content is there even with scripts off.

Token text needs the model's tokenizer (`token_decoder`); without one the
page shows token ids. Standard library only, like the rest of the client.
"""

from __future__ import annotations

import html
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prorl_client.display import failure_label, summarize, summary_rows, tool_call_count

TokenText = Callable[[Sequence[int]], list[str]]


def load_records(path: Path, jobs: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The complete result lines of `path`, only those of `jobs` when given (job id or task id)."""
    wanted = set(jobs)
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by an interrupted run
        if not isinstance(record, dict):
            continue
        if wanted and record.get("job_id") not in wanted and record.get("task_id") not in wanted:
            continue
        records.append(record)
    return records


def token_decoder(path: Path) -> TokenText:
    """Per-token text from a GGUF model's vocabulary or a Hugging Face tokenizer.json (or its folder)."""
    if path.suffix == ".gguf":
        try:
            from llama_cpp import Llama
        except ImportError as exc:
            raise SystemExit(f"--tokenizer {path}: reading a GGUF vocabulary needs llama-cpp-python") from exc
        llama = Llama(model_path=str(path), vocab_only=True, verbose=False)

        def gguf(ids: Sequence[int]) -> list[str]:
            return [llama.detokenize([i], special=True).decode("utf-8", errors="replace") for i in ids]

        return gguf
    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise SystemExit(f"--tokenizer {path}: reading tokenizer.json needs the tokenizers package") from exc
    tokenizer = Tokenizer.from_file(str(file))

    def hf(ids: Sequence[int]) -> list[str]:
        return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    return hf


# --- Rendering ---------------------------------------------------------------

STATUS_CLASS = {
    "JOB_STATUS_SUCCEEDED": "ok",
    "JOB_STATUS_FAILED": "failed",
    "JOB_STATUS_CANCELLED": "cancelled",
    "JOB_STATUS_TIMED_OUT": "timed-out",
}


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _status(record: dict[str, Any]) -> str:
    return str(record.get("status", "")).removeprefix("JOB_STATUS_").lower().replace("_", " ") or "?"


def _seconds(value: Any) -> float:
    """A duration as MessageToDict writes it ("1.250s") in seconds."""
    if isinstance(value, int | float):
        return float(value)
    text = str(value or "0s").removesuffix("s")
    try:
        return float(text)
    except ValueError:
        return 0.0


def _scalar(value: Any) -> str:
    if isinstance(value, str):
        return _e(value)
    if isinstance(value, dict | list):
        return f"<pre>{_e(json.dumps(value, indent=2, ensure_ascii=False))}</pre>"
    return _e(json.dumps(value))


def _details(record: dict[str, Any]) -> str:
    rows = [f"<tr><th>reward</th><td>{_e(record.get('reward', 0))}</td></tr>"]
    label = failure_label(record.get("failure"))
    if label:
        failure = record["failure"]
        phase = str(failure.get("phase", "")).removeprefix("PHASE_").lower()
        rows.append(
            f"<tr class='bad'><th>failure</th><td>{_e(label)} (in {_e(phase or '?')}): "
            f"{_e(failure.get('message', ''))}</td></tr>"
        )
    for key, value in (record.get("details") or {}).items():
        rows.append(f"<tr><th>{_e(key)}</th><td>{_scalar(value)}</td></tr>")
    return f"<table class='kv'>{''.join(rows)}</table>"


def _waterfall(record: dict[str, Any]) -> str:
    spans = list(record.get("timeline") or [])
    if not spans:  # a line from an older runner: the phases one after another, from the timing
        timing, at = record.get("timing") or {}, 0.0
        starts: dict[str, float] = {}
        for name in ("queue", "init", "run", "eval", "cleanup"):
            length = _seconds(timing.get(name))
            if length:
                starts[name] = at
                spans.append({"kind": "phase", "name": name, "start": at, "end": at + length})
                at += length
        waited = _seconds(timing.get("modelWait", timing.get("model_wait")))
        if waited:  # where in the phases is not known: the total, from the start of run
            start = starts.get("run", starts.get("init", 0.0))
            spans.append({"kind": "wait", "name": "model wait", "start": start, "end": start + waited})
    if not spans:
        return "<p class='muted'>no timing recorded</p>"
    total = max(float(s["end"]) for s in spans) or 1.0
    rows = []
    for span in spans:
        start, end = float(span["start"]), float(span["end"])
        left = 100 * max(start, 0.0) / total
        width = max(100 * (end - start) / total, 0.3)
        label = span["name"]
        extra = ""
        if span.get("kind") == "model":
            extra = (
                f" · policy v{span.get('policy_version', 0)} · {span.get('completion_tokens', 0)} tokens"
                f" · {span.get('finish_reason') or '-'}"
            )
        elif span.get("kind") == "wait":
            extra = " · waiting for a model slot (other jobs' turns or a pause; not in the budget)"
        elif span.get("kind") == "tool":
            code = span.get("exit_code")
            extra = (" · error" if span.get("error") else "") + (f" · exit {code}" if code is not None else "")
        tip = f"{label}: {start:.3f}s → {end:.3f}s ({end - start:.3f}s){extra}"
        rows.append(
            f"<div class='wf-row'><div class='wf-label'>{_e(label)}</div><div class='wf-track'>"
            f"<div class='wf-bar wf-{_e(span.get('kind', 'phase'))} wf-{_e(label.split()[0])}' "
            f"style='left:{left:.2f}%;width:{min(width, 100 - left):.2f}%' title='{_e(tip)}'>"
            f"<span>{end - start:.2f}s</span></div></div></div>"
        )
    axis = "".join(f"<span style='left:{100 * f:.0f}%'>{total * f:.1f}s</span>" for f in (0, 0.25, 0.5, 0.75, 1.0))
    return f"<div class='waterfall'>{''.join(rows)}<div class='wf-axis'>{axis}</div></div>"


def _message(message: dict[str, Any], turn: int | None, version: int | None) -> str:
    role = str(message.get("role", "?"))
    head = [f"<span class='role'>{_e(role)}</span>"]
    if turn is not None:
        head.append(f"turn {turn}")
    if version is not None:
        head.append(f"<span class='pv'>policy v{version}</span>")
    if message.get("name"):
        head.append(f"tool {_e(message['name'])}")
    content = str(message.get("content", ""))
    kind = "tool-result" if role == "tool" or (role == "user" and "<tool_response>" in content) else role
    calls = "".join(
        f"<div class='call'>→ <b>{_e(call.get('name', '?'))}</b>"
        f"(<code>{_e(call.get('argumentsJson', ''))}</code>)</div>"
        for call in message.get("toolCalls", [])
    )
    return (
        f"<div class='msg msg-{_e(kind)}'><div class='msg-head'>{' · '.join(head)}</div>"
        f"<pre class='content'>{_e(content)}</pre>{calls}</div>"
    )


def _conversation(record: dict[str, Any]) -> str:
    versions = list(record.get("turn_policy_versions") or [])
    parts, turn = [], 0
    for message in record.get("messages", []):
        if message.get("role") == "assistant":
            version = versions[turn] if turn < len(versions) else None
            parts.append(_message(message, turn, version))
            turn += 1
        else:
            parts.append(_message(message, None, None))
    return "".join(parts) or "<p class='muted'>no messages</p>"


def _shade(logprob: float) -> str:
    """Green for likely sampled tokens through to red for unlikely ones."""
    probability = math.exp(max(min(logprob, 0.0), -50.0))
    return f"hsl({120 * probability:.0f},70%,80%)"


def _turn_marks(record: dict[str, Any], mask: Sequence[int]) -> dict[int, str]:
    """Where each model turn's sampled ids start: from the trajectory's turn spans when the
    server sent them, else at each run of loss mask 1 (turn order, policy versions in order)."""
    marks = {}
    for span in record.get("turn_spans") or []:
        mode = str(span.get("logprobs_mode", "")).removeprefix("LOGPROBS_MODE_").lower()
        extra = f" · {mode} log-probs" if mode and mode != "unspecified" else ""
        marks[int(span.get("start", 0))] = (
            f"turn {span.get('turn', 0)} · policy v{span.get('policy_version', 0)}{extra}"
        )
    if marks:
        return marks
    versions = list(record.get("turn_policy_versions") or [])
    turn, previous = 0, 0
    for index, masked in enumerate(mask):
        if masked and not previous:
            marks[index] = f"turn {turn}" + (f" · policy v{versions[turn]}" if turn < len(versions) else "")
            turn += 1
        previous = masked
    return marks


def _tokens(record: dict[str, Any], token_text: TokenText | None) -> str:
    ids = [int(i) for i in record.get("token_ids") or []]
    if not ids:
        return "<p class='muted'>no token ids (the backend returned text only)</p>"
    mask = list(record.get("loss_mask") or [0] * len(ids))
    logprobs = [float(x) for x in record.get("logprobs") or [0.0] * len(ids)]
    texts = token_text(ids) if token_text else None
    marks = _turn_marks(record, mask)
    spans = []
    for index, token in enumerate(ids):
        masked = mask[index] if index < len(mask) else 0
        logprob = logprobs[index] if index < len(logprobs) else 0.0
        if index in marks:
            spans.append(f"<span class='turn-mark'>{_e(marks[index])}</span>")
        text = texts[index] if texts else str(token)
        shown = text.replace("\n", "↵\n") if texts else f"{token} "
        tip = f"id {token} · {json.dumps(text, ensure_ascii=False)} · log-prob {logprob:.4f}"
        style = f" style='background:{_shade(logprob)}'" if masked else ""
        spans.append(
            f"<span class='tok m{1 if masked else 0}' data-id='{token}' data-lp='{logprob:.4f}'"
            f"{style} title='{_e(tip)}'>{_e(shown)}</span>"
        )
    sampled = sum(1 for m in mask if m)
    lowest = sorted((lp, i) for i, lp in enumerate(logprobs) if i < len(mask) and mask[i])[:1]
    note = f"{len(ids)} tokens, {sampled} sampled (loss mask 1)"
    if lowest:
        note += f"; lowest log-prob {lowest[0][0]:.3f} at token {lowest[0][1]}"
    if not texts:
        note += "; token ids shown (pass --tokenizer for text)"
    return f"<p class='muted'>{_e(note)}</p><div class='tokens{'' if texts else ' ids'}'>{''.join(spans)}</div>"


def _turns(record: dict[str, Any]) -> str:
    turns = [s for s in record.get("timeline") or [] if s.get("kind") == "model"]
    if not turns:
        versions = record.get("turn_policy_versions") or []
        turns = [{"turn": i, "policy_version": v} for i, v in enumerate(versions)]
    if not turns:
        return ""
    waits = {
        s.get("turn"): float(s["end"]) - float(s["start"])
        for s in record.get("timeline") or []
        if s.get("kind") == "wait" and "turn" in s
    }
    rows = []
    for t in turns:
        latency = f"{float(t['end']) - float(t['start']):.2f}s" if "start" in t else ""
        waited = f"{waits[t.get('turn')]:.2f}s" if t.get("turn") in waits else ("0.00s" if "start" in t else "")
        cells = (
            t.get("turn", ""),
            f"v{t.get('policy_version', 0)}",
            t.get("backend", ""),
            t.get("prompt_tokens", ""),
            t.get("completion_tokens", ""),
            waited,
            latency,
            t.get("finish_reason", ""),
        )
        rows.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    return (
        "<table class='grid turns'><tr><th>turn</th><th>policy</th><th>backend</th><th>prompt tokens</th>"
        "<th>completion tokens</th><th title='waiting for a model slot before the turn was sent'>waited</th>"
        f"<th>latency</th><th>finish</th></tr>{''.join(rows)}</table>"
    )


def _rollout(index: int, record: dict[str, Any], token_text: TokenText | None) -> str:
    details = record.get("details") or {}
    facts = [
        f"<span class='badge {STATUS_CLASS.get(str(record.get('status')), '')}'>{_e(_status(record))}</span>",
        f"reward <b>{_e(record.get('reward', 0))}</b>",
        f"family <b>{_e(record.get('handler') or '?')}</b>",
        f"{_e(record.get('num_turns', 0))} turns",
        f"{tool_call_count(record)} tool calls",
        f"{int(details.get('format_errors') or 0)} format errors",
    ]
    if details.get("stop_reason"):
        facts.append(f"stopped by <b>{_e(details['stop_reason'])}</b>")
    return (
        f"<section class='rollout' id='r{index}' data-idx='{index}'>"
        f"<h2>{_e(record.get('task_id', '?'))} <small>#{_e(record.get('sample', 0))} · "
        f"job {_e(record.get('job_id', ''))}</small></h2>"
        f"<div class='facts'>{' · '.join(facts)}</div>"
        f"<h3>Evaluation</h3>{_details(record)}"
        f"<h3>Timing</h3>{_waterfall(record)}"
        "<div class='panes'>"
        f"<div><h3>Conversation</h3><div class='conversation'>{_conversation(record)}</div></div>"
        f"<div><h3>Tokens</h3>{_turns(record)}{_tokens(record, token_text)}</div>"
        "</div></section>"
    )


def _list_row(index: int, record: dict[str, Any]) -> str:
    search = " ".join(str(record.get(k, "")) for k in ("task_id", "job_id", "handler", "status")).lower()
    status = _status(record)
    return (
        f"<tr class='row' data-idx='{index}' data-status='{_e(status)}' "
        f"data-family='{_e(record.get('handler') or '?')}' data-search='{_e(search)}'>"
        f"<td>{_e(record.get('task_id', '?'))}<small>#{_e(record.get('sample', 0))}</small></td>"
        f"<td>{_e(record.get('handler') or '?')}</td>"
        f"<td><span class='badge {STATUS_CLASS.get(str(record.get('status')), '')}'>{_e(status)}</span></td>"
        f"<td class='num'>{float(record.get('reward') or 0):.2f}</td>"
        f"<td class='num'>{_e(record.get('num_turns', 0))}</td></tr>"
    )


def _options(values: Sequence[str]) -> str:
    return "".join(f"<option value='{_e(v)}'>{_e(v)}</option>" for v in sorted(set(values)))


def _summary(records: list[dict[str, Any]]) -> str:
    rows = summary_rows(summarize(records))
    head = (
        "<tr><th>family</th><th>rollouts</th><th>ok</th><th>mean reward</th><th>mean turns</th>"
        "<th>tool calls</th><th>format errors</th><th>stopped by</th><th>failures</th></tr>"
    )
    body = "".join("<tr>" + "".join(f"<td>{_e(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table class='grid summary'>{head}{body}</table>"


def render(records: list[dict[str, Any]], *, token_text: TokenText | None = None, source: str = "") -> str:
    """The HTML page of `records` (result lines of `prorl run`)."""
    rows = "".join(_list_row(i, r) for i, r in enumerate(records))
    sections = "".join(_rollout(i, r, token_text) for i, r in enumerate(records))
    statuses = _options([_status(r) for r in records])
    families = _options([str(r.get("handler") or "?") for r in records])
    return (
        PAGE.replace("{{title}}", _e(f"prorl rollouts · {source}" if source else "prorl rollouts"))
        .replace("{{source}}", _e(source))
        .replace("{{count}}", str(len(records)))
        .replace("{{summary}}", _summary(records))
        .replace("{{statuses}}", statuses)
        .replace("{{families}}", families)
        .replace("{{rows}}", rows)
        .replace("{{sections}}", sections or "<p class='muted'>no rollouts in this file</p>")
    )


def write_report(
    results: Path, out: Path, *, jobs: Sequence[str] = (), token_text: TokenText | None = None
) -> list[dict[str, Any]]:
    """Render `results` (only `jobs` when given) into `out`; returns the records shown."""
    records = load_records(results, jobs)
    out.write_text(render(records, token_text=token_text, source=results.name), encoding="utf-8")
    return records


def view_command(results: Path, *, out: Path | None, jobs: Sequence[str], tokenizer: Path | None) -> int:
    if not results.is_file():
        print(f"prorl view: {results} does not exist", file=sys.stderr)
        return 2
    out = out or results.with_suffix(".html")
    records = write_report(results, out, jobs=jobs, token_text=token_decoder(tokenizer) if tokenizer else None)
    if jobs and not records:
        print(f"prorl view: no rollout of {', '.join(jobs)} in {results}", file=sys.stderr)
        return 1
    print(f"{len(records)} rollouts: file://{out.absolute()}", file=sys.stderr)
    return 0


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{title}}</title>
<style>
:root { --line: #d8dbe0; --muted: #6b7280; --accent: #2563eb; }
* { box-sizing: border-box; }
body { margin: 0; font: 13px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #111827;
  height: 100vh; display: flex; flex-direction: column; overflow: hidden; }
header { padding: 8px 14px; border-bottom: 1px solid var(--line); background: #f8fafc; }
header h1 { font-size: 16px; margin: 0 8px 0 0; display: inline; }
header details { margin-top: 4px; }
#layout { display: flex; flex: 1; min-height: 0; }
nav { width: 390px; min-width: 300px; border-right: 1px solid var(--line); overflow: auto; }
nav .filters { position: sticky; top: 0; background: #fff; padding: 8px; display: flex; gap: 6px;
  border-bottom: 1px solid var(--line); }
nav input { flex: 1; min-width: 0; }
main { flex: 1; overflow: auto; padding: 0 18px 40px; }
table { border-collapse: collapse; }
#rollouts { width: 100%; }
#rollouts td { padding: 4px 8px; border-bottom: 1px solid #eef0f3; cursor: pointer; white-space: nowrap; }
#rollouts tr.row:hover { background: #f1f5f9; }
#rollouts tr.selected { background: #dbeafe; }
.num { text-align: right; font-variant-numeric: tabular-nums; }
small { color: var(--muted); margin-left: 3px; }
.badge { padding: 1px 7px; border-radius: 9px; font-size: 11px; background: #e5e7eb; }
.badge.ok { background: #dcfce7; color: #166534; } .badge.failed { background: #fee2e2; color: #991b1b; }
.badge.timed-out, .badge.cancelled { background: #fef3c7; color: #92400e; }
h2 { font-size: 18px; margin: 14px 0 4px; } h3 { font-size: 13px; margin: 18px 0 6px; text-transform: uppercase;
  letter-spacing: .04em; color: var(--muted); }
.facts { color: #374151; }
.kv th { text-align: left; padding: 2px 12px 2px 0; vertical-align: top; color: var(--muted); font-weight: 500; }
.kv td pre { margin: 0; }
.kv tr.bad td { color: #991b1b; }
.grid th, .grid td { border: 1px solid var(--line); padding: 3px 8px; text-align: left; }
.grid th { background: #f8fafc; font-weight: 600; }
.muted { color: var(--muted); }
.waterfall { max-width: 980px; }
.wf-row { display: flex; align-items: center; height: 20px; }
.wf-label { width: 110px; color: #374151; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.wf-track { position: relative; flex: 1; height: 14px; background: #f8fafc; }
.wf-bar { position: absolute; height: 14px; border-radius: 2px; font-size: 10px; color: #fff; overflow: hidden;
  white-space: nowrap; padding-left: 3px; }
.wf-phase { background: #64748b; } .wf-queue { background: #cbd5e1; color: #334155; }
.wf-cleanup { background: #94a3b8; } .wf-model { background: #7c3aed; } .wf-tool { background: #ea580c; }
.wf-wait { background: repeating-linear-gradient(45deg, #ddd6fe, #ddd6fe 4px, #ede9fe 4px, #ede9fe 8px);
  color: #4c1d95; }
.wf-axis { position: relative; margin-left: 110px; height: 16px; color: var(--muted); font-size: 10px; }
.wf-axis span { position: absolute; transform: translateX(-50%); }
.panes { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 18px; }
@media (max-width: 1100px) { .panes { grid-template-columns: minmax(0, 1fr); } }
.msg { border: 1px solid var(--line); border-radius: 6px; margin: 6px 0; }
.msg-head { padding: 3px 8px; background: #f8fafc; border-bottom: 1px solid var(--line); color: var(--muted); }
.msg .role { font-weight: 600; color: #111827; }
.msg-assistant { border-left: 4px solid #7c3aed; } .msg-user { border-left: 4px solid #2563eb; }
.msg-system { border-left: 4px solid #9ca3af; } .msg-tool-result { border-left: 4px solid #ea580c; }
.pv { background: #ede9fe; color: #5b21b6; padding: 0 6px; border-radius: 8px; }
pre { white-space: pre-wrap; word-break: break-word; margin: 0; font: 12px/1.4 ui-monospace, Menlo, monospace; }
.msg pre.content { padding: 6px 8px; max-height: 320px; overflow: auto; }
.call { padding: 3px 8px; border-top: 1px dashed var(--line); }
.tokens { font: 12px/1.9 ui-monospace, Menlo, monospace; white-space: pre-wrap; word-break: break-all;
  border: 1px solid var(--line); padding: 8px; border-radius: 6px; }
.turns { margin-bottom: 6px; }
.tok { border-radius: 2px; cursor: default; }
.tok.m0 { color: #6b7280; background: #f3f4f6; }
.tok.m1 { color: #111827; }
.tok:hover { outline: 2px solid var(--accent); }
.turn-mark { display: inline-block; font: 10px system-ui, sans-serif; background: #5b21b6; color: #fff;
  padding: 0 5px; border-radius: 7px; margin: 0 3px; }
.legend span { display: inline-block; padding: 0 6px; margin-right: 4px; border-radius: 2px; }
.gradient { background: linear-gradient(90deg, hsl(0,70%,80%), hsl(60,70%,80%), hsl(120,70%,80%)); }
#tip { position: fixed; bottom: 0; right: 0; background: #111827; color: #fff; padding: 4px 10px;
  font: 12px ui-monospace, monospace; border-top-left-radius: 6px; }
#tip:empty { display: none; }
</style></head>
<body>
<header><h1>prorl rollouts</h1><span class="muted">{{source}} · {{count}} rollouts</span>
<span class="legend" style="margin-left:18px">tokens: <span class="tok m0">prompt / tool (mask 0)</span>
<span class="gradient">sampled (mask 1): log-prob low → high</span></span>
<details><summary>summary by task family</summary>{{summary}}</details></header>
<div id="layout">
<nav><div class="filters"><input id="q" type="search" placeholder="filter: task, job, family">
<select id="status"><option value="">any status</option>{{statuses}}</select>
<select id="family"><option value="">any family</option>{{families}}</select></div>
<table id="rollouts"><tbody>{{rows}}</tbody></table></nav>
<main id="detail">{{sections}}</main></div>
<div id="tip"></div>
<script>
(function () {
  var rows = Array.prototype.slice.call(document.querySelectorAll("#rollouts tr.row"));
  var sections = Array.prototype.slice.call(document.querySelectorAll("section.rollout"));
  var q = document.getElementById("q"), st = document.getElementById("status"), fam = document.getElementById("family");
  function show(idx) {
    sections.forEach(function (s) { s.hidden = s.dataset.idx !== String(idx); });
    rows.forEach(function (r) { r.classList.toggle("selected", r.dataset.idx === String(idx)); });
    if (history.replaceState) history.replaceState(null, "", "#r" + idx);
  }
  function filter() {
    var text = q.value.toLowerCase();
    rows.forEach(function (r) {
      r.hidden = (text && r.dataset.search.indexOf(text) < 0) || (st.value && r.dataset.status !== st.value) ||
        (fam.value && r.dataset.family !== fam.value);
    });
  }
  rows.forEach(function (r) { r.addEventListener("click", function () { show(r.dataset.idx); }); });
  [q, st, fam].forEach(function (el) { el.addEventListener("input", filter); });
  var tip = document.getElementById("tip");
  document.getElementById("detail").addEventListener("mouseover", function (ev) {
    var t = ev.target.closest ? ev.target.closest(".tok") : null;
    tip.textContent = t ? t.title : "";
  });
  var start = /^#r(\\d+)$/.exec(location.hash);
  if (rows.length) show(start ? start[1] : rows[0].dataset.idx);
})();
</script>
</body></html>
"""
