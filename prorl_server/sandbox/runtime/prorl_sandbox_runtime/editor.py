"""The file editor the agents call (view, create, str_replace, insert, undo), and how a
path the agent names is resolved against the sandbox's working folder.
"""

import codecs
import os

from .capped import DEFAULT_CAP, CappedBuffer


class ToolError(Exception):
    """A mistake the agent can fix; the message tells it how."""


def resolve_path(path, workdir):
    if not path:
        raise ToolError("path is empty: give a file path such as /workspace/main.py")
    return os.path.normpath(path if os.path.isabs(path) else os.path.join(workdir, path))


def _read_text(path):
    if not os.path.exists(path):
        raise ToolError("%s does not exist; check the path (use view on a directory to list it)" % path)
    if os.path.isdir(path):
        raise ToolError("%s is a directory; give a file path" % path)
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError("%s is not a UTF-8 text file" % path)


def _write_text(path, text):
    parent = os.path.dirname(path)
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def _view_lines(path, first, last, buffer):
    """Write lines first..last (-1: to the end) of a UTF-8 file, numbered as `_numbered` does,
    into `buffer`; return the file's line count. The file is streamed, never held whole, so
    viewing a file of any size costs the buffer's cap in memory and the output is capped."""
    if not os.path.exists(path):
        raise ToolError("%s does not exist; check the path (use view on a directory to list it)" % path)
    if os.path.isdir(path):
        raise ToolError("%s is a directory; give a file path" % path)
    decoder = codecs.getincrementaldecoder("utf-8")()
    state = {"number": 1, "started": False, "held": None, "any": False}

    def start_line(number):
        buffer.write(("%s%6d\t" % ("\n" if state["any"] else "", number)).encode("utf-8"))
        state["any"] = True

    def feed(part, ends_line):
        number = state["number"]
        if first <= number and (last == -1 or number <= last):
            if part or (ends_line and state["started"]):
                if state["held"] is not None:  # an empty line that turned out not to be the last
                    start_line(state["held"])
                    state["held"] = None
                if not state["started"]:
                    start_line(number)
                    state["started"] = True
                buffer.write(part.encode("utf-8", "surrogateescape"))
            elif ends_line:
                if state["held"] is not None:
                    start_line(state["held"])
                state["held"] = number  # shown only if a line follows it in the range
        if ends_line:
            state["number"] += 1
            state["started"] = False

    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(1 << 16)
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError:
                raise ToolError("%s is not a UTF-8 text file" % path)
            parts = text.split("\n")
            for part in parts[:-1]:
                feed(part, True)
            if not chunk:
                feed(parts[-1], True)
                return state["number"] - 1
            feed(parts[-1], False)


def _numbered(text, start=1):
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return "\n".join("%6d\t%s" % (number, line) for number, line in enumerate(lines, start))


def _snippet(text, line, context=4):
    lines = text.split("\n")
    first = max(line - context, 0)
    last = min(line + context + 1, len(lines))
    return _numbered("\n".join(lines[first:last]), first + 1)


class Editor:
    """A str_replace-style file editor with per-file undo."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.history = {}

    def _remember(self, path, previous):
        self.history.setdefault(path, []).append(previous)

    def handle(self, request):
        command = request.get("command")
        path = resolve_path(request.get("path", ""), self.workdir)
        handler = getattr(self, "cmd_" + str(command), None)
        if handler is None:
            raise ToolError(
                "unknown editor command %r; use one of: view, create, str_replace, insert, undo" % (command,)
            )
        return handler(path, request)

    def cmd_view(self, path, request):
        if os.path.isdir(path):
            entries = []
            for name in sorted(os.listdir(path)):
                full = os.path.join(path, name)
                entries.append(name + ("/" if os.path.isdir(full) else ""))
            return "Contents of %s:\n%s" % (path, "\n".join(entries) or "(empty)")
        first, last = 1, -1
        view_range = request.get("view_range")
        if view_range:
            try:
                first, last = int(view_range[0]), int(view_range[1])
            except (TypeError, ValueError, IndexError):
                raise ToolError("view_range must be two line numbers [first, last]; use -1 as last for the end")
        buffer = CappedBuffer(int(request.get("max_output_bytes") or DEFAULT_CAP))
        count = _view_lines(path, first, last, buffer)
        if not 1 <= first <= (count if last == -1 else last) <= count:
            raise ToolError("view_range %r is outside the file's lines 1-%d" % (view_range, count))
        return buffer

    def cmd_create(self, path, request):
        if "file_text" not in request:
            raise ToolError("create needs file_text: the whole content of the new file")
        if os.path.exists(path):
            raise ToolError("%s already exists; use str_replace to change it, or view to read it" % path)
        _write_text(path, request["file_text"])
        self._remember(path, None)
        return "Created %s" % path

    def cmd_str_replace(self, path, request):
        old = request.get("old_str")
        new = request.get("new_str", "")
        if not old:
            raise ToolError("str_replace needs old_str: the exact text to replace (copy it from view)")
        text = _read_text(path)
        count = text.count(old)
        if count == 0:
            raise ToolError(
                "old_str was not found in %s; it must match exactly, including whitespace and indentation "
                "(view the file to copy it)" % path
            )
        if count > 1:
            lines = [text[:m].count("\n") + 1 for m in _find_all(text, old)]
            raise ToolError(
                "old_str occurs %d times in %s (lines %s); include more surrounding lines so it is unique"
                % (count, path, ", ".join(map(str, lines)))
            )
        self._remember(path, text)
        updated = text.replace(old, new, 1)
        _write_text(path, updated)
        line = updated[: updated.find(new)].count("\n") if new else text[: text.find(old)].count("\n")
        return "Edited %s. The changed region:\n%s" % (path, _snippet(updated, line))

    def cmd_insert(self, path, request):
        if "new_str" not in request:
            raise ToolError("insert needs new_str: the text to insert")
        try:
            after = int(request.get("insert_line"))
        except (TypeError, ValueError):
            raise ToolError("insert needs insert_line: the line number after which to insert (0 for the top)")
        text = _read_text(path)
        lines = text.split("\n")
        if not 0 <= after <= len(lines):
            raise ToolError("insert_line %d is outside 0-%d" % (after, len(lines)))
        self._remember(path, text)
        new_lines = request["new_str"].split("\n")
        updated = "\n".join(lines[:after] + new_lines + lines[after:])
        _write_text(path, updated)
        return "Inserted %d line(s) into %s after line %d:\n%s" % (
            len(new_lines),
            path,
            after,
            _snippet(updated, after),
        )

    def cmd_undo(self, path, request):
        history = self.history.get(path)
        if not history:
            raise ToolError("there is no edit of %s to undo" % path)
        previous = history.pop()
        if previous is None:
            os.remove(path)
            return "Undid the creation of %s (removed it)" % path
        _write_text(path, previous)
        return "Undid the last edit of %s" % path


def _find_all(text, needle):
    start = text.find(needle)
    while start >= 0:
        yield start
        start = text.find(needle, start + 1)
