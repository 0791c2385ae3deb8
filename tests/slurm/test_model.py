"""Slurm mode's pure parts: the nodes and groups (``model``), the settings and their errors,
the jobs that live, end and act as names (``jobs``), on text as the commands print it."""

# ruff: noqa: E501  (scontrol prints each node on one long line)
from __future__ import annotations

import pytest

from tslice.common import errors
from tslice.orchestrator import config
from tslice.orchestrator.slurm import jobs, model
from tslice.orchestrator.slurm import settings as slurm_settings

LINES = """\
NodeName=gpu-01 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 AvailableFeatures=h100,ib ActiveFeatures=h100,ib Gres=gpu:h100:4(S:0-1),shard:8 NodeAddr=10.0.0.1 NodeHostName=gpu-01 Version=22.05.8 OS=Linux 6.1.0 #1 SMP PREEMPT_DYNAMIC  RealMemory=1 State=MIXED ThreadsPerCore=1 Partitions=gpu,all  BootTime=None
NodeName=gpu-02 AvailableFeatures=a100 Gres=gpu:2 NodeAddr=10.0.0.2 NodeHostName=gpu-02 State=IDLE+DRAIN Partitions=gpu Reason=bad fan [root@2026-01-01T00:00:00]
NodeName=gpu-03 AvailableFeatures=h100 Gres=gpu:a:1,gpu:b:1 NodeAddr=10.0.0.3 NodeHostName=gpu-03 State=IDLE* Partitions=gpu
NodeName=gpu-04 AvailableFeatures=(null) Gres=gpu:2 NodeAddr=10.0.0.4 NodeHostName=gpu-04 State=DOWN Partitions=gpu
NodeName=cpu-01 AvailableFeatures=(null) Gres=(null) NodeAddr=10.0.1.1 NodeHostName=cpu-01 State=IDLE Partitions=all
NodeName=gpu-05 AvailableFeatures=h100 Gres=gpu:8 NodeAddr=10.0.0.5 NodeHostName=gpu-05 State=ALLOCATED+COMPLETING Partitions=other
"""


def settings(**fields: object) -> slurm_settings.SlurmSettings:
    return slurm_settings.build(slurm_settings.SlurmModel.model_validate(fields))


def test_nodes_are_read_from_scontrols_oneliner() -> None:
    nodes = {n.name: n for n in model.parse_nodes(LINES)}
    first = nodes["gpu-01"]
    assert (first.addr, first.partitions, first.features, first.gpus) == (
        "10.0.0.1",
        frozenset({"gpu", "all"}),
        frozenset({"h100", "ib"}),
        4,
    )
    assert nodes["gpu-02"].reason == "bad fan [root@2026-01-01T00:00:00]"
    assert nodes["gpu-03"].gpus == 2
    why = {name: node.why_out() for name, node in nodes.items()}
    assert why == {
        "gpu-01": None,
        "gpu-02": "is drained or draining (Reason=bad fan [root@2026-01-01T00:00:00])",
        "gpu-03": "does not respond",
        "gpu-04": "is down",
        "cpu-01": "has no GPU in its GRES (Gres=gpu:N)",
        "gpu-05": None,
    }


def test_by_default_each_usable_gpu_node_is_a_group_named_after_it() -> None:
    groups = model.groups(model.parse_nodes(LINES), settings())
    assert groups == {
        "gpu-01": (config.NodeRef("gpu-01", "10.0.0.1:9001", (0, 1, 2, 3)),),
        "gpu-05": (config.NodeRef("gpu-05", "10.0.0.5:9001", tuple(range(8))),),
    }


def test_groups_of_a_partition_a_feature_and_a_host_list() -> None:
    nodes = model.parse_nodes(LINES)
    chosen = settings(
        groups=["train=partition:gpu", "fast=feature:h100", "pair=nodes:gpu-0[1-2],gpu-05"],
        agent_address="{node_hostname}.cluster:9101",
        agents={"gpu-05": "10.9.9.9:1"},
    )
    groups = {
        gid: [(n.name, n.address) for n in ns] for gid, ns in model.groups(nodes, chosen).items()
    }
    # Drained, down and unresponsive nodes count for no group; gpu-02 leaves "pair".
    assert groups == {
        "train": [("gpu-01", "gpu-01.cluster:9101")],
        "fast": [("gpu-01", "gpu-01.cluster:9101"), ("gpu-05", "10.9.9.9:1")],
        "pair": [("gpu-01", "gpu-01.cluster:9101"), ("gpu-05", "10.9.9.9:1")],
    }
    assert model.left_out(nodes, chosen) == {
        "gpu-02": "is drained or draining (Reason=bad fan [root@2026-01-01T00:00:00])",
        "gpu-03": "does not respond",
        "gpu-04": "is down",
    }


def test_a_group_that_loses_every_node_is_left_out() -> None:
    nodes = [n for n in model.parse_nodes(LINES) if n.name != "gpu-01"]
    assert "train" not in model.groups(nodes, settings(groups={"train": {"partition": "gpu"}}))


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"groups": ["train"]}, r"write NAME=KIND:VALUE"),
        ({"groups": ["train=rack:3"]}, r"KIND one of partition, feature, nodes"),
        ({"groups": {"train": {}}}, r"group 'train' selects nothing"),
        ({"groups": {"bad group": {"partition": "p"}}}, r"group id 'bad group' is malformed"),
        ({"groups": {"x": {"nodes": "gpu-[1-"}}}, r"is not a host list"),
        ({"agent_address": "{node_addr}"}, r"has no port"),
        ({"agent_address": "{rack}:9001"}, r"is not an address template"),
        ({"poll_s": 0}, r"slurm.poll_s: Input should be greater than 0"),
        ({"sbatch": "x"}, r"slurm.sbatch: Extra inputs are not permitted"),
    ],
)
def test_bad_settings_name_the_field_and_the_fix(section: object, message: str) -> None:
    with pytest.raises(errors.ConfigError, match=message):
        config.build(overrides={"slurm": section})


def test_slurm_mode_takes_no_topology_of_another_kind() -> None:
    with pytest.raises(errors.ConfigError, match=r"--slurm takes the topology .*--local-agent"):
        config.build(overrides={"slurm": {"enabled": True}, "local_agents": ["127.0.0.1:1"]})
    with pytest.raises(errors.ConfigError, match=r"--kubernetes cannot be combined"):
        config.build(overrides={"slurm": True, "kubernetes": True})


def test_host_lists_expand_as_slurms() -> None:
    expand = slurm_settings.expand_hostlist
    assert expand("gpu-[01-03,07],login1") == ["gpu-01", "gpu-02", "gpu-03", "gpu-07", "login1"]
    assert expand("n[1-2]r[8-9]") == ["n1r8", "n1r9", "n2r8", "n2r9"]
    for bad in ("gpu[1-", "x]", "a[]", "gpu-[3-1]", "gpu-[a-b]"):
        with pytest.raises(ValueError):
            expand(bad)


# ---- jobs -------------------------------------------------------------------------------


def rows(text: str) -> list[jobs.JobRow]:
    return jobs.parse_jobs(text)


def test_a_job_is_gone_once_when_it_ends_and_again_after_a_requeue() -> None:
    book = jobs.JobBook()
    assert book.update(rows("12|12|RUNNING|alice\n13|13|PENDING|bob")) == [
        jobs.Gone("13", "Slurm job 13 ended (PENDING)")  # never ran: nothing to evict
    ]
    assert book.update(rows("12|12|COMPLETING|alice\n13|13|RUNNING|bob")) == [
        jobs.Gone("12", "Slurm job 12 ended (COMPLETING)")
    ]
    assert book.update(rows("12|12|CANCELLED|alice\n13|13|RUNNING|bob")) == []
    assert book.ended("12") == "CANCELLED"  # its latest state
    # Requeued, it runs again (and lives); then it times out.
    assert book.update(rows("12|12|RUNNING|alice\n13|13|RUNNING|bob")) == []
    assert book.ended("12") is None
    assert book.update(rows("12|12|TIMEOUT|alice")) == [
        jobs.Gone("12", "Slurm job 12 ended (TIMEOUT)"),
        jobs.Gone("13", "Slurm job 13 ended (no longer listed)"),
    ]


def test_an_array_lives_while_one_of_its_tasks_runs() -> None:
    book = jobs.JobBook()
    book.update(rows("21|20|RUNNING|alice\n20|20|RUNNING|alice"))
    # Task 20 (the last task has the array's id) ended; task 21 runs: the array lives.
    assert book.update(rows("21|20|RUNNING|alice\n20|20|COMPLETED|alice")) == []
    assert book.update(rows("21|20|CANCELLED|alice\n20|20|COMPLETED|alice")) == [
        jobs.Gone("20", "Slurm job 20 ended (COMPLETED)"),
        jobs.Gone("21", "Slurm job 21 ended (CANCELLED)"),
    ]


def test_jobs_that_ended_before_the_first_read_are_gone_at_once() -> None:
    assert jobs.JobBook().update(rows("7|7|NODE_FAIL|alice\n8|8|RUNNING|bob")) == [
        jobs.Gone("7", "Slurm job 7 ended (NODE_FAIL)")
    ]


def test_a_name_is_one_users_while_a_job_bound_to_it_lives() -> None:
    book = jobs.JobBook()
    book.update(rows("30|30|RUNNING|alice\n31|31|RUNNING|alice\n40|40|RUNNING|bob"))
    assert book.claim("grpo", job="30", user="alice") is None
    assert book.claim("grpo", job="31", user="alice") is None
    refused = book.claim("grpo", job="40", user="bob")
    assert refused is not None and "in use by user 'alice' (Slurm jobs 30, 31)" in refused
    assert book.update(rows("30|30|CANCELLED|alice\n31|31|RUNNING|alice\n40|40|RUNNING|bob")) == [
        jobs.Gone("30", "Slurm job 30 ended (CANCELLED)")
    ]
    gone = book.update(rows("30|30|CANCELLED|alice\n31|31|COMPLETED|alice\n40|40|RUNNING|bob"))
    assert gone == [
        jobs.Gone("31", "Slurm job 31 ended (COMPLETED)"),
        jobs.Gone(
            "grpo", "every Slurm job that acted as grpo ended: 30 (CANCELLED), 31 (COMPLETED)"
        ),
    ]
    # A group that comes back on its persisted queue learns why these went.
    assert book.gone_reason("31") == "Slurm job 31 ended (COMPLETED)"
    assert book.gone_reason(
        "grpo",
    ).startswith("every Slurm job that acted as grpo ended")
    assert book.gone_reason("40") is None
    assert book.claim("grpo", job="40", user="bob") is None  # free again
    assert book.gone_reason("grpo") is None
