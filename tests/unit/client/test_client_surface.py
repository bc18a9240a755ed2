"""The thin client covers every RPC of the contract, and its public surface is pinned."""

from __future__ import annotations

import inspect
import re

from prorl_client._proto.prorl.v1 import admin_service_pb2, rollout_service_pb2

import prorl_client
from prorl_client import Client


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_every_rpc_has_a_client_method() -> None:
    aliases = {"rollout_stream": "rollout_many"}
    for module in (rollout_service_pb2, admin_service_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                name = aliases.get(snake(method.name), snake(method.name))
                assert callable(getattr(Client, name, None)), f"Client lacks {name} for {service.name}.{method.name}"


def test_public_surface() -> None:
    assert sorted(prorl_client.__all__) == ["Client", "RpcError", "connect", "v1"]


def test_connect_takes_a_target_and_keyword_only_options() -> None:
    parameters = inspect.signature(Client.connect).parameters
    assert list(parameters) == ["target", "load_balancing", "credentials", "token", "metadata", "options"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for name, p in parameters.items() if name != "target")
    # prorl_client.connect is the same call.
    assert inspect.signature(prorl_client.connect) == inspect.signature(Client.connect)


def test_rpc_names_follow_the_contract() -> None:
    rollout = rollout_service_pb2.DESCRIPTOR.services_by_name["RolloutService"]
    assert [m.name for m in rollout.methods] == [
        "Rollout", "RolloutStream", "Submit", "Watch", "GetJob", "ListJobs", "Cancel", "Subscribe", "ForkJob",
    ]  # fmt: skip
    admin = admin_service_pb2.DESCRIPTOR.services_by_name["AdminService"]
    assert [m.name for m in admin.methods] == [
        "AddBackend", "RemoveBackend", "ListBackends", "GetStats", "Pause", "Resume", "UpdateWeights",
    ]  # fmt: skip
