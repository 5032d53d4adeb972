"""Configuration: every problem at once, located; no configuration is said, not defaulted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from capgate.config import load_settings, read_settings
from capgate.registry.errors import ConfigError, ConfigMissing
from tests.test_init import capgate, clean_env

TYPOS = """\
[capgate]
capabilities = ["capabilities"]
ledgr = "sqlite:///.capgate/ledger.db"

[connectors.insurance]
url = "sqlite:///insurance.db"
enviroment = "dev"
session_budget = "six"

[connector.other]
url = "sqlite:///x.db"
"""


def test_every_configuration_problem_is_reported_at_once(tmp_path: Path) -> None:
    config = tmp_path / "capgate.toml"
    config.write_text(TYPOS, "utf-8")
    with pytest.raises(ConfigError) as caught:
        load_settings(config, {})
    message = caught.value.message
    assert "4 problems" in message
    assert f"{config}:3: CG902: capgate.ledgr: unknown key (did you mean `ledger`?)" in message
    assert f"{config}:7: CG902: connectors.insurance.enviroment: unknown key (did you mean " \
           "`environment`?)" in message
    assert f"{config}:8: CG902: connectors.insurance.session_budget: must be an integer" \
           in message
    assert f"{config}:10: CG902: connector: unknown section [connector] (did you mean " \
           "`connectors`?)" in message
    _, problems = read_settings(config, {})
    assert [p.line for p in problems] == [10, 3, 7, 8]


def test_validate_reports_the_configuration_too(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    capgate(["init", "proj"], tmp_path, env)
    proj = tmp_path / "proj"
    config = proj / "capgate.toml"
    config.write_text(config.read_text("utf-8").replace("environment =", "enviroment =", 1),
                      "utf-8")
    said = capgate(["validate"], proj, env, code=1)
    assert "enviroment: unknown key (did you mean `environment`?)" in said.stdout


def test_a_command_without_configuration_says_so_and_creates_nothing(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    for args in (["cases"], ["ledger", "show", "T-1"], ["call", "policy.get", "--case", "T"],
                 ["doctor"]):
        said = capgate(args, empty, env, code=2)
        assert "CG903" in said.stderr + said.stdout, args
        assert "capgate init" in said.stderr + said.stdout
    assert list(empty.iterdir()) == []
    as_json = capgate(["cases", "--json"], empty, env, code=2)
    assert json.loads(as_json.stdout)["code"] == "CG903"
    with pytest.raises(ConfigMissing):
        load_settings(None, {})


def test_the_environment_alone_is_a_configuration(tmp_path: Path) -> None:
    ledger = tmp_path / "l" / "ledger.db"
    settings = load_settings(None, {"CAPGATE_LEDGER_URL": f"sqlite:///{ledger}"})
    assert settings.configured and settings.ledger_url.endswith("ledger.db")
    assert not ledger.parent.exists()  # reading creates nothing


def test_a_named_file_that_is_missing_is_an_error(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "capgate", "cases", "--config",
                           str(tmp_path / "nope.toml")], cwd=tmp_path, env=clean_env(tmp_path),
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and "configuration file not found" in proc.stderr
