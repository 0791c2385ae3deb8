"""The orchestrator's store fails under a real orchestrator process: a real filesystem that
fills up (a tmpfs with a size limit mounted on its state directory), and a page of its
database corrupted while it runs. Nothing wedges silently: health goes NOT_SERVING,
calls are answered UNAVAILABLE naming the reason, GetGroupStatus still answers, and freed
space brings everything back on its own."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.sim.cluster import ORCHESTRATOR, LocalCluster

pytestmark = pytest.mark.slow

#: Every call's deadline: an Acquire held back by the store is answered before it.
CALL_S = 3.0
#: Hand-overs tried on a full disk before one must have met it.
MAX_TRIES = 200
FULL = "database or disk is full"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _mount_unavailable() -> str:
    """ "" when a tmpfs can be mounted here, else why not."""
    if os.geteuid() != 0:
        return "mounting a size-limited tmpfs needs root"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "no mount/umount commands"
    return ""


@pytest.fixture
def base_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="ts-store-"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def small_fs(base_dir: Path) -> Iterator[Path]:
    """The orchestrator's state directory on a 1 MiB tmpfs of its own."""
    why = _mount_unavailable()
    if why:
        pytest.skip(why)
    state_dir = base_dir / ORCHESTRATOR
    state_dir.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(state_dir)]
    done = subprocess.run(mount, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield state_dir
    finally:
        subprocess.run(["umount", "-l", str(state_dir)], check=False, capture_output=True)


def _fill(directory: Path) -> Path:
    """Fill the filesystem of ``directory`` to the last byte; the filler file."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        chunk = b"\0" * 4096
        while True:
            try:
                os.write(fd, chunk)
            except OSError as err:
                assert err.errno == 28, err  # ENOSPC: the filesystem is full
                if len(chunk) == 1:
                    return filler
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)


class _Calls:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = opb_grpc.TimeSliceOrchestratorServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def handover(self, job: str) -> None:
        self.stub.Acquire(opb.AcquireRequest(job_id=job, group_id="g"), timeout=CALL_S)
        self.stub.Yield(opb.YieldRequest(job_id=job, group_id="g"), timeout=CALL_S)

    def first_failure(self) -> grpc.RpcError:
        """Hand-overs between jobs until one fails; its error."""
        for i in range(MAX_TRIES):
            try:
                self.handover(f"job-{i % 3}")
            except grpc.RpcError as err:
                return err
        raise AssertionError(f"{MAX_TRIES} hand-overs went through on a failing store")

    def serving(self) -> int:
        return self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=CALL_S).status

    def wait_serving(self, status: int) -> None:
        """Until health says ``status`` (its Watch stream: no polling)."""
        watch = self.health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
        try:
            for reply in watch:
                if reply.status == status:
                    return
        finally:
            watch.cancel()

    def status(self) -> opb.GroupStatus:
        reply = self.stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="g"), timeout=CALL_S)
        return reply.group


def _unavailable(err: grpc.RpcError, *words: str) -> str:
    assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
    details = err.details() or ""
    for word in words:
        assert word in details, details
    return details


def _no_tracebacks(cluster: LocalCluster) -> None:
    log = cluster.log_path(ORCHESTRATOR).read_text()
    assert "Traceback" not in log, log[-4000:]


def test_a_full_disk_is_loud_and_freed_space_recovers_on_its_own(
    base_dir: Path, small_fs: Path
) -> None:
    with LocalCluster(agents=1, groups={"g": ("node-1",)}, base_dir=base_dir) as cluster:
        calls = _Calls(cluster.orchestrator_address)
        calls.handover("warm-up")
        filler = _fill(small_fs)

        # The Acquire whose grant cannot be written is answered UNAVAILABLE with the
        # reason before its deadline (it was a bare DEADLINE_EXCEEDED).
        _unavailable(calls.first_failure(), FULL, str(small_fs))
        assert calls.serving() == NOT_SERVING
        # A new call is refused at once, naming the reason; nothing is changed.
        with pytest.raises(grpc.RpcError) as refused:
            calls.handover("newcomer")
        _unavailable(refused.value, "cannot persist its state", FULL)
        # Status still answers, and says why.
        status = calls.status()
        assert status.group_state == opb.GroupStatus.STATE_UNKNOWN
        assert FULL in status.detail

        filler.unlink()
        calls.wait_serving(SERVING)
        calls.handover("after")
        assert calls.status().group_state != opb.GroupStatus.STATE_UNKNOWN
        calls.channel.close()
    _no_tracebacks(cluster)


def test_a_page_corrupted_while_running_is_reported_as_a_corrupt_database(
    base_dir: Path,
) -> None:
    with LocalCluster(agents=1, groups={"g": ("node-1",)}, base_dir=base_dir) as cluster:
        calls = _Calls(cluster.orchestrator_address)
        calls.handover("warm-up")
        database = cluster.state_dir(ORCHESTRATOR) / "orchestrator.db"
        # Another reader empties the WAL into the file (the orchestrator's connection then
        # reads the file's pages again), and a page of the groups table is overwritten.
        with sqlite3.connect(database, timeout=10) as reader:
            reader.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            (root,) = reader.execute(
                "SELECT rootpage FROM sqlite_master WHERE name='groups'"
            ).fetchone()
            (page_size,) = reader.execute("PRAGMA page_size").fetchone()
        reader.close()
        with database.open("r+b") as file:
            file.seek((root - 1) * page_size)
            file.write(b"\xa5" * page_size)

        _unavailable(calls.first_failure(), "is corrupt", str(database))
        assert calls.serving() == NOT_SERVING
        status = calls.status()
        assert status.group_state == opb.GroupStatus.STATE_UNKNOWN
        assert "is corrupt" in status.detail and "move the file aside" in status.detail
        calls.channel.close()
    _no_tracebacks(cluster)
