"""The fake sandbox provider now ships as prorl_server.testing.sandbox_provider (for plugins' tests too)."""

from prorl_server.testing.sandbox_provider import (  # noqa: F401
    BOOTSTRAP,
    FakeContainer,
    FakeSandboxProvider,
    ImageSetup,
    kill_tree,
)
