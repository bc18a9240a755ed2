"""The in-sandbox runtime (prorl_runtime.py), its judging harness
(prorl_judge.py) and where to find them on the host.

Both are stdlib-only and run on the sandbox image's own python3 (3.8 and
newer); they are bind-mounted read-only into each container. This package's
other modules run in the server.
"""

from pathlib import Path

RUNTIME_FILE = Path(__file__).with_name("prorl_runtime.py")
JUDGE_FILE = Path(__file__).with_name("prorl_judge.py")
"""The judging harness, staged beside the runtime (it starts it for `judge`)."""
