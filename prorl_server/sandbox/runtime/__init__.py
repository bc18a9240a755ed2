"""The in-sandbox runtime (prorl_runtime.py) and where to find it on the host.

prorl_runtime.py is stdlib-only and runs on the sandbox image's own python3
(3.8 and newer); it is bind-mounted read-only into each container. This
package's other modules run in the server.
"""

from pathlib import Path

RUNTIME_FILE = Path(__file__).with_name("prorl_runtime.py")
