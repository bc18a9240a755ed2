#!/usr/bin/env python3
"""prorl in-sandbox runtime: bash, Python and files behind a Unix socket.

Runs inside a sandbox container on the image's own python3 (3.8 and newer),
stdlib only. The server connects to the socket and sends requests; each
connection may carry several requests at once (answers are matched by id).

Wire format, both directions (prorl_sandbox_runtime/wire.py, the server's too): a
frame is an 8-byte big-endian length and that many bytes of UTF-8 JSON. A request is
{"id": int, "op": str, ...}; the answer is {"id": int, "ok": true, ...result} or
{"id": int, "ok": false, "error": str} when the request itself could not be served. A tool that ran but failed (a
command's non-zero exit, an editor mistake) is ok: true with is_error set.

`judge` starts the judging harness (prorl_judge.py, beside this file) and
returns the verdict it wrote on a pipe of its own (see judge_launcher.py). The runtime
makes itself non-dumpable before serving: what the agent or the judged code
runs (the same uid) cannot ptrace it, read its memory or open its fds.

`gateway`, sent on a connection of its own, makes the runtime listen for HTTP on
the sandbox's own loopback (127.0.0.1, and [::1] when there is IPv6) and relay
each request to the server over that connection (see http_relay.py), so a program
inside reaches the server's endpoint while the sandbox has no network.

This file only starts the program: its modules are the package prorl_sandbox_runtime
beside it (the frames and words in wire.py, the shell in bash.py, Python in
python_worker.py, the editor, judging, reset, the HTTP relay, the socket in server.py).
"""

import os
import sys

if __package__:  # imported as part of the server's package
    from .prorl_sandbox_runtime.runtime_main import main
else:  # run as a script: the package beside this file comes first, whatever else is on sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from prorl_sandbox_runtime.runtime_main import main

if __name__ == "__main__":
    sys.exit(main())
