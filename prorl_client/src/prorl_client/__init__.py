"""Asyncio client of the prorl rollout service.

`Client.connect(target)` opens a channel, to one server or balanced over
several that share a job store (a list of addresses, or a DNS name with
`load_balancing="round_robin"`); its methods map one to one onto the RPCs of
`prorl.v1.RolloutService` and `prorl.v1.AdminService`, and `follow` is a Watch
that resumes on another server when its server goes away. Messages live in
`prorl_client.v1`. Every failed call raises `RpcError`.
"""

from prorl_client import v1
from prorl_client._client import Client, connect
from prorl_client._errors import RpcError

__all__ = ["Client", "RpcError", "connect", "v1"]
