"""HA mode's pure parts: the flags' checks (exit 2, naming the fix), the record codec that
keeps a group's state in a ConfigMap, and the ConfigMap names."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from tests.cli.test_cli import run_cli
from tslice.orchestrator import records
from tslice.orchestrator.kube import codec

pytest.importorskip("lightkube")

from tslice.orchestrator.kube import state


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--ha", "--local-agent", "127.0.0.1:1"],
            "--ha elects a leader through a Kubernetes Lease .*: add --kubernetes",
        ),
        (["--kubernetes", "--lease-name", "x"], "--lease-name: options of --ha; add --ha"),
        (
            ["--kubernetes", "--ha", "--lease-duration", "3", "--renew-interval", "2"],
            "--renew-interval 2 must be above 0 and well below --lease-duration 3",
        ),
        (["--kubernetes", "--ha", "--advertise-address", "pod"], "is not HOST:PORT"),
    ],
)
def test_bad_ha_flags_are_usage_errors(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    code, _, err = run_cli(capsys, "orchestrator", *flags)
    assert code == 2
    assert re.search(message, err), err


def test_a_record_round_trips_and_reads_what_another_release_wrote() -> None:
    record = records.LockRecord(
        "job-a",
        "job-a",
        3,
        4,
        7,
        (records.QueueRecord("job-b", 5, 2**33),),
        records.IntentRecord(None, "job-a", 3, 4),
        (("job-a", 2**34),),
        holder_lease_ms=1500,
        draining=True,
        holder_unclaimed_until=1.5e9,
    )
    assert codec.decode(codec.encode(record)) == record
    assert codec.decode(codec.encode(records.LockRecord.empty())) == records.LockRecord.empty()
    # Older (a field missing: its default) and newer (a field unknown: ignored) writers.
    data = json.loads(codec.encode(record))
    del data["draining"]
    data["a_field_of_a_later_release"] = {"x": 1}
    assert codec.decode(json.dumps(data)) == dataclasses.replace(record, draining=False)
    with pytest.raises(ValueError, match="not a lock record"):
        codec.decode('{"holder": null}')


def test_configmap_names_are_dns_names_unique_per_group() -> None:
    names = {state.configmap_name(g) for g in ("trainer", "Trainer", "a_b", "a-b", "x" * 200)}
    assert len(names) == 5
    for name in names:
        assert len(name) <= 63 and name == name.lower() and name[0].isalpha()
        assert set(name) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")
