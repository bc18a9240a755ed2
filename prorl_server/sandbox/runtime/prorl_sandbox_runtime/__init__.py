"""The program that runs inside a sandbox: the runtime and its judging harness.

Stdlib only, for the sandbox image's own python3 (3.8 and newer). It is staged
read-only into each container beside its two entry scripts (prorl_runtime.py,
prorl_judge.py), which put that folder first on sys.path and import this
package by its own distinctive name before anything else. Every module uses
relative imports only, so the server imports the same files as
`prorl_server.sandbox.runtime.prorl_sandbox_runtime` (the frame codec and the
operation names, `wire`, are the server's too).

Nothing is imported here: the runtime, its Python worker and the judge each load
only what they run.
"""

import os

FOLDER = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""Where the program is staged (RUNTIME_MOUNT in a container): the entry scripts and this package."""
RUNTIME_SCRIPT = os.path.join(FOLDER, "prorl_runtime.py")
"""The runtime's entry script (its Python worker is started as `RUNTIME_SCRIPT python-worker`)."""
JUDGE_SCRIPT = os.path.join(FOLDER, "prorl_judge.py")
"""The judging harness's entry script (started under python3 -I, its children too)."""
