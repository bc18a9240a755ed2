from __future__ import annotations

from pathlib import Path

import pytest

from prorl_server.config import ConfigError, load_settings, mask_url, parse_assignments, url_password


def test_defaults_are_valid() -> None:
    settings = load_settings(None, environ={})
    assert settings.server.port == 50051 and settings.sandbox.cpus == 1.0


def test_file_then_environment_then_overrides(tmp_path: Path) -> None:
    config = tmp_path / "prorl.toml"
    config.write_text('[server]\nport = 6000\nlog_format = "json"\n[sandbox]\ncpus = 0.5\n')
    settings = load_settings(
        config,
        environ={"PRORL_SERVER__PORT": "7000", "PRORL_SANDBOX__MEMORY_MIB": "512", "UNRELATED": "x"},
        overrides=parse_assignments(["server.port=8000"]),
    )
    assert settings.server.port == 8000
    assert settings.server.log_format == "json"
    assert settings.sandbox.cpus == 0.5 and settings.sandbox.memory_mib == 512


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"PRORL_SANDBOX__CPUS": "-1"}, "setting 'sandbox.cpus'"),
        ({"PRORL_SERVER__PORT": "99999"}, "setting 'server.port'"),
        ({"PRORL_SERVER__PROT": "1"}, "setting 'server.prot': unknown setting"),
        ({"PRORL_LLM__BACKENDS": '[{"id": "a", "base_url": "localhost:8000"}]'}, "setting 'llm.backends.0.base_url'"),
    ],
)
def test_a_bad_setting_is_named(environ: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_settings(None, environ=environ)
    assert named in str(error.value)


def test_missing_or_broken_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml", environ={})
    broken = tmp_path / "broken.toml"
    broken.write_text("[server\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(broken, environ={})


def test_set_flag_needs_an_equals_sign() -> None:
    with pytest.raises(ConfigError, match=r"SECTION\.FIELD=VALUE"):
        parse_assignments(["server.port"])


def test_cli_exits_2_naming_the_setting(capsys: pytest.CaptureFixture[str]) -> None:
    from prorl_server.cli import main

    assert main(["serve", "--set", "sandbox.cpus=0"]) == 2
    assert "setting 'sandbox.cpus'" in capsys.readouterr().err


def test_tls_settings_go_together(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tls_cert_file and tls_key_file go together"):
        load_settings(None, environ={"PRORL_SERVER__TLS_CERT_FILE": "/x.pem"})


def test_tokens_are_secret_and_can_come_from_a_file(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("from-file\n\n")
    settings = load_settings(
        None, environ={"PRORL_SERVER__AUTH_TOKENS": '["inline"]', "PRORL_SERVER__AUTH_TOKENS_FILE": str(tokens)}
    )
    assert settings.server.accepted_tokens() == ["inline", "from-file"]
    assert "inline" not in repr(settings) and "inline" not in str(settings.model_dump())


def test_images_are_an_allow_list_of_the_projects_own_by_default() -> None:
    box = load_settings(None, environ={}).sandbox
    assert box.allow_exec_fallback is False
    assert box.image_allowed(box.default_image)
    assert box.image_allowed("localhost/prorl-swe-kjd__idna-3.8:latest")
    for image in (
        "localhost/prorl-no-python:latest",
        "localhost/prorl-base:bookworm",
        "docker.io/library/python:3.12",
        "localhost/prorl-python:latest ",
        "localhost/PRORL-python:latest",
        "",
    ):
        assert not box.image_allowed(image), image
    wider = load_settings(None, environ={}, overrides=parse_assignments(['sandbox.allowed_images=["localhost/*"]']))
    assert wider.sandbox.image_allowed("localhost/prorl-no-python:latest")


def test_the_servers_own_images_must_be_allowed() -> None:
    with pytest.raises(ConfigError, match="default_image 'localhost/other:latest' matches none of allowed_images"):
        load_settings(None, environ={"PRORL_SANDBOX__DEFAULT_IMAGE": "localhost/other:latest"})
    pools = '[{"image": "localhost/prorl-no-python:latest"}]'
    with pytest.raises(ConfigError, match=r"warm_pools\.0\.image"):
        load_settings(None, environ={"PRORL_SANDBOX__WARM_POOLS": pools})


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["jobs.default_budget_s=7200", "jobs.max_budget_s=3600"], "default_budget_s 7200 exceeds max_budget_s"),
        (["jobs.default_max_turns=50", "jobs.max_turns_ceiling=20"], "default_max_turns 50 exceeds"),
        (["sandbox.cpus=4", "sandbox.max_cpus=2"], "cpus 4 exceeds max_cpus 2"),
        (["sandbox.memory_mib=4096", "sandbox.max_memory_mib=2048"], "memory_mib 4096 exceeds"),
    ],
)
def test_defaults_beyond_their_maxima_are_refused_at_start(overrides: list[str], named: str) -> None:
    """Otherwise every request leaving the field unset would be refused."""
    with pytest.raises(ConfigError, match=named):
        load_settings(None, environ={}, overrides=parse_assignments(overrides))


def test_warm_pools_are_checked_like_requests(tmp_path: Path) -> None:
    config = tmp_path / "prorl.toml"
    config.write_text("[sandbox]\nmax_cpus = 2\n[[sandbox.warm_pools]]\ncpus = 4\n")
    with pytest.raises(ConfigError, match=r"warm_pools\.0\.cpus 4 exceeds max_cpus 2"):
        load_settings(config, environ={})
    config.write_text("[[sandbox.warm_pools]]\ncpus = -1\n")
    with pytest.raises(ConfigError, match="cpus"):
        load_settings(config, environ={})


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://prorl:s3cret@db:5432/jobs", "postgresql://prorl:***@db:5432/jobs"),
        ("postgresql://db/jobs?user=u&password=s3cret", "postgresql://db/jobs?user=u&password=***"),
        ("postgresql://db/jobs?PASSWORD=s3cret&sslmode", "postgresql://db/jobs?PASSWORD=***&sslmode="),
        ("postgresql://u:@db/jobs", "postgresql://u:***@db/jobs"),
        ("http://u:s3cret@[::1/v1", "http://***"),  # unreadable: the scheme only
        # Nothing to hide: as given, to the letter (a query is not re-encoded).
        ("postgresql://prorl@/jobs?host=/run/pg&sslmode", "postgresql://prorl@/jobs?host=/run/pg&sslmode"),
        ("not a url, a=b c", "not a url, a=b c"),
    ],
)
def test_mask_url_hides_a_password_wherever_the_url_carries_one(url: str, shown: str) -> None:
    assert mask_url(url) == shown
    assert "s3cret" not in shown


def test_url_password_finds_what_mask_url_hides() -> None:
    assert url_password("postgresql://u:s3cret@db/jobs") == "s3cret"
    assert url_password("postgresql://db/jobs?Password=s3cret") == "s3cret"
    assert url_password("postgresql://u@db/jobs") == url_password("http://[::1") == ""


@pytest.mark.parametrize("value", ["mysql://prorl:s3cret@db/jobs", "mysql://db/jobs?password=s3cret"])
def test_a_refused_url_setting_is_echoed_without_its_password(value: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_settings(None, environ={"PRORL_JOBS__STORE": value})
    message = str(error.value)
    assert "setting 'jobs.store'" in message and "mysql://" in message and "***" in message
    assert "s3cret" not in message


def test_a_stores_driver_error_is_told_without_the_password() -> None:
    from prorl_server.jobs.postgres_store import PostgresJobStore

    store = PostgresJobStore("postgresql://prorl:s3cret@db/jobs")
    reason = store._reason(OSError("connect to postgresql://prorl:s3cret@db/jobs failed (s3cret)"))
    assert "s3cret" not in reason and "s3cret" not in repr(store)
    assert reason == "connect to postgresql://prorl:***@db/jobs failed (***) (OSError)"
