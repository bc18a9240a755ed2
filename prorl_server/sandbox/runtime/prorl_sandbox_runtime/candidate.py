"""The candidate's process (function mode's child, `prorl_judge.py candidate`): it
loads the submission and answers each call with plain data; it never sees check().
"""

import builtins
import traceback

from .judge_processes import ERROR_CHARS
from .pipe_frames import FrameReader, write_all
from .plain_data import NotPlainData, decode_plain, encode_plain
from .wire import encode_frame


def _builtin_exception(exc):
    """The nearest builtin Exception class of `exc`, by name (None if none is)."""
    for kind in type(exc).__mro__:
        name = getattr(kind, "__name__", None)
        if isinstance(name, str) and getattr(builtins, name, None) is kind and issubclass(kind, Exception):
            return name
    return None


def candidate_worker(fd_in, fd_out):
    """The untrusted side: load the candidate, then answer calls. Nothing here is trusted."""
    reader = FrameReader(fd_in)
    setup = reader.read()
    if setup is None:
        return
    namespace = {"__name__": "__candidate__", "__builtins__": builtins}
    try:
        for label, code, required in setup["sources"]:
            try:
                exec(compile(code, label, "exec"), namespace)
            except Exception:
                if required:
                    raise
        function = namespace.get(setup["entry_point"])
        if not callable(function):
            raise NameError("the submission defines no function %r" % setup["entry_point"])
    except BaseException as exc:
        write_all(fd_out, encode_frame({"load_error": describe_exception(exc)}))
        return
    write_all(fd_out, encode_frame({"ready": True}))
    while True:
        request = reader.read()
        if request is None:
            return
        seq = request.get("call")
        reply = {"seq": seq}
        try:
            args, kwargs = decode_plain(request["args"])
            result = function(*args, **kwargs)
        except Exception as exc:
            reply["raised"] = {
                "type": _builtin_exception(exc) or "Exception",
                "message": ("%s: %s" % (type(exc).__name__, exc))[:ERROR_CHARS],
            }
            try:
                reply["raised"]["args"] = encode_plain(list(exc.args))
            except NotPlainData:
                pass
        except BaseException as exc:
            reply["exit"] = ("%s: %s" % (type(exc).__name__, exc))[:ERROR_CHARS]
        else:
            try:
                reply["value"] = encode_plain(result)
            except NotPlainData as exc:
                reply["not_plain"] = str(exc)
        write_all(fd_out, encode_frame(reply))
        if "exit" in reply:
            return


def describe_exception(exc):
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text[-ERROR_CHARS:]
