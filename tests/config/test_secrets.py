"""server.auth_token: given by file or environment, never written anywhere (***), never empty; IPv6 hosts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from appliance.config.compose import load_runtime_config
from appliance.config.overrides import CONF_DIR
from appliance.core.errors import ConfigError
from appliance.core.secrets import AUTH_TOKEN_ENV, REDACTED, redact

TOKEN = "Tok3n-0f-the-day"


def issues_of(overrides):
    with pytest.raises(ConfigError) as info:
        load_runtime_config(overrides)
    return info.value.issues


@pytest.fixture(autouse=True)
def no_token_in_the_environment(monkeypatch):
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)


def test_token_on_the_command_line_is_used_and_redacted_everywhere():
    rc = load_runtime_config([f"server.auth_token={TOKEN}"])
    assert rc.server.auth_token == TOKEN
    assert TOKEN not in rc.resolved_yaml and TOKEN not in repr(rc) and TOKEN not in str(rc.server)
    assert yaml.safe_load(rc.resolved_yaml)["server"]["auth_token"] == REDACTED
    assert yaml.safe_load(load_runtime_config([]).resolved_yaml)["server"]["auth_token"] is None


def test_token_from_a_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    rc = load_runtime_config([f"server.auth_token_file={path}"])
    assert rc.server.auth_token == TOKEN and TOKEN not in rc.resolved_yaml


def test_token_from_the_environment(monkeypatch):
    monkeypatch.setenv(AUTH_TOKEN_ENV, TOKEN)
    rc = load_runtime_config([])
    assert rc.server.auth_token == TOKEN and TOKEN not in rc.resolved_yaml
    # The server's default config names the same variable the client reads.
    assert AUTH_TOKEN_ENV in (CONF_DIR / "server" / "default.yaml").read_text()


@pytest.mark.parametrize("overrides, path, words", [
    (["server.auth_token=''"], "server.auth_token", ["empty token", "turn authentication off"]),
    (["server.auth_token='with space'"], "server.auth_token", ["printable ASCII without spaces"]),
    (["server.auth_token_file=/nonexistent/token"], "server.auth_token_file", ["cannot be read"]),
])
def test_bad_tokens_are_errors_that_never_show_the_token(overrides, path, words):
    issues = issues_of(overrides)
    assert [i.path for i in issues] == [path]
    assert all(w in str(issues[0]) for w in words), str(issues[0])
    assert "with space" not in str(issues[0])


def test_empty_token_file_and_two_sources_are_errors(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert "is empty" in str(issues_of([f"server.auth_token_file={empty}"])[0])
    monkeypatch.setenv(AUTH_TOKEN_ENV, TOKEN)
    issue = issues_of([f"server.auth_token_file={empty}"])[0]
    assert issue.path == "server.auth_token_file" and "not both" in str(issue) and TOKEN not in str(issue)
    monkeypatch.setenv(AUTH_TOKEN_ENV, "")                 # set but empty: the same error as auth_token=''
    assert "empty token" in str(issues_of([])[0])


def test_redact_override_strings_and_nested_keys():
    tree = {"hydra": {"overrides": {"task": [f"server.auth_token={TOKEN}", "server.auth_token_file=/t"]},
                      "job": {"override_dirname": f"mode=plan,server.auth_token='{TOKEN}',x=1"}},
            "server": {"auth_token": TOKEN, "port": 1}, "other": {"auth_token": None}}
    clean = redact(tree)
    assert TOKEN not in str(clean)
    assert clean["hydra"]["overrides"]["task"] == ["server.auth_token=***", "server.auth_token_file=/t"]
    assert clean["hydra"]["job"]["override_dirname"] == "mode=plan,server.auth_token=***,x=1"
    assert clean["server"] == {"auth_token": REDACTED, "port": 1} and clean["other"] == {"auth_token": None}


@pytest.mark.parametrize("host, stored", [("::1", "::1"), ("'[::1]'", "::1"), ("localhost", "localhost"),
                                          ("127.0.0.2", "127.0.0.2")])
def test_loopback_hosts_with_or_without_brackets(host, stored):
    assert load_runtime_config([f"server.host={host}"]).server.host == stored


@pytest.mark.parametrize("host", ["::", "'[::]'", "0.0.0.0", "example.com"])
def test_other_hosts_need_tls_or_insecure(host):
    assert [i.path for i in issues_of([f"server.host={host}"])] == ["server.host"]
    load_runtime_config([f"server.host={host}", "server.insecure=true"])


# -- the CLI writes no secret: stdout, .hydra/*.yaml, multirun.yaml, sweep tables --------------------------

def all_text_under(root: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in root.rglob("*") if p.is_file() and p.suffix != ".png")


def test_cli_validate_and_its_hydra_files_show_no_token(cli, tmp_path):
    proc = cli("mode=validate", f"server.auth_token={TOKEN}")
    assert proc.returncode == 0, proc.stderr
    assert TOKEN not in proc.stdout + proc.stderr and "auth_token: '***'" in proc.stdout
    run = tmp_path / "run"
    assert TOKEN not in all_text_under(run)
    assert f"server.auth_token={REDACTED}" in (run / ".hydra" / "overrides.yaml").read_text()


def test_cli_plan_sweep_shows_no_token(cli, tmp_path):
    proc = cli("-m", "mode=plan", "device=ascend_a3", f"server.auth_token={TOKEN}", "decode_batch=4,8")
    assert proc.returncode == 0, proc.stderr
    assert TOKEN not in proc.stdout + proc.stderr
    sweep = tmp_path / "multirun"
    assert (sweep / "multirun.yaml").is_file() and (sweep / "sweep.csv").is_file()
    assert TOKEN not in all_text_under(sweep)
