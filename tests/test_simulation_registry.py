"""The simulation-first fields as a reviewer and an agent see them, and their configuration.

``show`` and each MCP tool's description list a row's expected effects (with
how each is observed and whether it is verifiable after the fact) and its
required context; the venues, scoped roles and simulation settings of the
configuration are checked key by key, with their file and line.  And an
effect no transaction covers is recorded after a real rollback: a MariaDB
trigger writing to a non-transactional (MyISAM) audit table.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from capgate.config import read_settings
from capgate.executor import outcome as oc
from capgate.executor.call import Executor
from capgate.executor.connectors import ConnectorConfig, venue_rank
from capgate.executor.grants import Grants
from capgate.mcp_server import description_for
from capgate.registry import errors
from capgate.registry.review import card
from tests.fix_capgate import registry
from tests.sim_support import NEW_CLAIM, registry_with, venues

__all__ = ["venues"]  # the fixture


def test_show_lists_effects_context_returns_and_the_declared_exemption_points() -> None:
    text = card(registry().resolve("claim.open"))
    assert "returns claim_id (claim)" in text
    assert "claim_id_identity [sequence]" in text
    assert "observed by returned claim_id; verifiable after the fact: no" in text
    assert "required context:\n    first_notice_of_loss:" in text
    assert "exemption (4) no downstream consumer: declared fails" in text
    assert "reconciliation no_claim_left_behind:" in text


def test_the_mcp_tool_description_lists_effects_and_required_context() -> None:
    row = registry().resolve("claim.open")
    text = description_for(row, "insurance", "dev")
    assert "Effects no transaction covers: claim_id_identity (sequence, observed by returned " \
           "claim_id, not verifiable after the fact)" in text
    assert "dashboard_cache (cache, observed by unobservable" in text
    assert "Required context: first_notice_of_loss:" in text
    assert "Effects no transaction covers" not in description_for(
        registry().resolve("policy.get"), "insurance", "dev")


def test_the_venues_are_ranked_and_the_rig_is_one() -> None:
    assert [venue_rank(e) for e in ("rig", "dev", "qa", "staging", "prod")] == [0, 1, 2, 3, 4]
    assert ConnectorConfig("c", "sqlite://", "rig").promotes is False
    assert ConnectorConfig("c", "sqlite://", "staging").promotes is True
    assert ConnectorConfig("c", "sqlite://", "qa", requires_simulation=True).promotes is True
    with pytest.raises(errors.ConfigError):
        ConnectorConfig("c", "sqlite://", "production")


def test_the_configuration_of_venues_and_simulation_is_checked_key_by_key(
        tmp_path: Path) -> None:
    config = tmp_path / "capgate.toml"
    config.write_text("""[capgate]
ledger = "sqlite:///ledger.db"

[connectors.insurance]
url = "sqlite:///prod.db"
environment = "prod"
requires_simulation = "yes"
business_timezone = "Mars/Olympus"
simulation_max_age_seconds = 0

[connectors.insurance.venues.qa]
url = "sqlite:///qa.db"
environment = "dev"

[connectors.insurance.venues.prod]
url = "sqlite:///again.db"

[connectors.insurance.venues.production]
url = "sqlite:///nope.db"
""", "utf-8")
    _, problems = read_settings(config, env={})
    found = {(p.key, p.line) for p in problems}
    assert ("connectors.insurance.requires_simulation", 7) in found
    assert ("connectors.insurance.business_timezone", 8) in found
    assert ("connectors.insurance.simulation_max_age_seconds", 9) in found
    assert ("connectors.insurance.venues.qa.environment", 13) in found
    assert ("connectors.insurance.venues.prod", 15) in found
    assert ("connectors.insurance.venues.production", 18) in found


def test_roles_scoped_by_environment_are_read_and_checked() -> None:
    grants = Grants.from_dict({"principals": {"rita": {"roles": [
        "dba", {"role": "release_manager", "environments": ["prod"]}]}}})
    rita = grants.principal("rita")
    assert rita.holds("dba", "qa") and rita.holds("dba", None)
    assert rita.holds("release_manager", "prod")
    assert not rita.holds("release_manager", "qa") and not rita.holds("release_manager", None)
    with pytest.raises(errors.ConfigError, match=r"principals\.rita\.roles\[0\]"):
        Grants.from_dict({"principals": {"rita": {"roles": [{"role": "x"}]}}})


AUDITED = """
format: 1
connectors: {insurance: {description: insurance}}
rows:
  - operation_id: claim.audited_open
    version: 1
    connector: insurance
    description: Open a claim; a trigger writes an audit row outside the transaction.
    input:
      type: object
      additionalProperties: false
      required: [policy_id, claim_ref, reported_on, amount]
      properties:
        policy_id: {type: integer, minimum: 1}
        claim_ref: {type: string, pattern: "^CLM-[0-9]{4}-[0-9]{3,6}$"}
        reported_on: {type: string, format: date}
        amount: {type: integer, minimum: 1, maximum: 1000000}
    target: {system: insurance, object: claim, keys: [policy_id]}
    effect_class: transactional
    shape: collapsed
    authorization: {kind: write_grant}
    environments: [dev]
    idempotency_key: "{case}:{claim_ref}"
    timeout: {seconds: 5, on_timeout: rolled_back}
    recovery: retryable
    statements:
      - name: insert_claim
        sql: >
          INSERT INTO claim (policy_id, claim_ref, reported_on, amount, status)
          VALUES (:policy_id, :claim_ref, :reported_on, :amount, 'open')
        expect_rows: 1
        returns: {table: claim, key: claim_id}
    verify:
      - name: policy_active
        sql: "SELECT count(*) FROM policy WHERE policy_id = :policy_id AND status = 'active'"
        expect: {value: 1}
    expected_effects:
      - name: claim_id_identity
        class: sequence
        description: the claim id is drawn from the identity
        returned: claim_id
      - name: audit_row
        class: autonomous_audit
        description: a trigger records every new claim in a non-transactional audit table
        probe:
          sql: "SELECT claim_ref FROM claim_audit WHERE claim_ref = :claim_ref"
          expect: {rows: 1}
"""


@pytest.mark.mariadb
def test_an_autonomous_audit_row_survives_a_rollback_and_is_recorded(
        mariadb_url: URL, tmp_path: Path, venues: Callable[..., Executor]) -> None:
    ex = venues(mariadb_url, f"sqlite:///{tmp_path / 'ledger.db'}", "dev",
                registry=registry_with(tmp_path, AUDITED))
    engine = sa.create_engine(mariadb_url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE claim_audit (claim_ref VARCHAR(40)) ENGINE=MyISAM"))
        conn.execute(sa.text("CREATE TRIGGER claim_audit_ins AFTER INSERT ON claim FOR EACH "
                             "ROW INSERT INTO claim_audit (claim_ref) VALUES (NEW.claim_ref)"))
    lapsed = {**NEW_CLAIM, "policy_id": 3, "claim_ref": "CLM-2024-700"}
    out = ex.call("claim.audited_open", lapsed, case="EFF-1", who="agent")
    assert out.status == oc.ROLLED_BACK and out.reason and out.reason["kind"] == "verify"
    survived = {e["effect"]: e for e in out.evidence["survived_rollback"]}
    assert survived["audit_row"]["survived"] is True
    assert survived["audit_row"]["probe"]["rows"] == [["CLM-2024-700"]]
    assert survived["audit_row"]["verifiable"] is True
    assert survived["claim_id_identity"]["survived"] is True  # InnoDB keeps it consumed
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM claim WHERE claim_ref = "
                                    "'CLM-2024-700'")).scalar() == 0
    engine.dispose()
    recorded = ex.ledger.intent("EFF-1", out.intent_id)["outcome_record"]
    assert recorded["evidence"]["survived_rollback"] == out.evidence["survived_rollback"]
