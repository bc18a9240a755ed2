"""Host ids of a rootless container's users, from /etc/subuid and /etc/subgid.

Rootless Podman maps container id 0 to the sandbox user itself and ids 1..n
to the user's subordinate range, so container uid 1000 is host uid
start + 999. Files the server prepares for the container (the socket folder)
are owned accordingly.
"""

from __future__ import annotations

import pwd
from pathlib import Path


def host_id(user: str, container_id: int, *, kind: str = "uid") -> int:
    account = pwd.getpwnam(user)
    if container_id == 0:
        return account.pw_uid if kind == "uid" else account.pw_gid
    table = Path("/etc/subuid" if kind == "uid" else "/etc/subgid")
    for line in table.read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in (user, str(account.pw_uid)):
            start, count = (int(part) for part in rest.split(":"))
            if container_id <= count:
                return start + container_id - 1
    raise LookupError(f"{table} has no range for {user} covering id {container_id}")
