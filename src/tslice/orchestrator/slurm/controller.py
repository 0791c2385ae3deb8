"""Reading the Slurm controller: ``scontrol show node --oneliner`` and ``squeue``.

The commands talk to ``slurmctld`` as the orchestrator's user (munge authenticates it;
``$SLURM_CONF`` or /etc/slurm/slurm.conf says where the controller is). Nothing here
writes to Slurm. A command that fails or hangs raises :class:`ControllerError`, whose
message says what to check.
"""

from __future__ import annotations

import asyncio
import shutil

from tslice.orchestrator.slurm import jobs, model
from tslice.orchestrator.slurm import settings as slurm_settings

#: Longest a command may take, seconds (a busy controller answers within a few).
COMMAND_TIMEOUT_S = 20.0
#: The columns :func:`tslice.orchestrator.slurm.jobs.parse_jobs` reads.
SQUEUE_FORMAT = "%A|%F|%T|%u"


class ControllerError(Exception):
    """The controller could not be read (its message says what to check)."""


def missing_commands(settings: slurm_settings.SlurmSettings) -> list[str]:
    """The Slurm commands that are not found."""
    return [c for c in (settings.scontrol, settings.squeue) if shutil.which(c) is None]


async def run(*argv: str, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
    """The standard output of a Slurm command; ControllerError if it fails."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as err:
        raise ControllerError(
            f"cannot run {argv[0]} ({err.strerror or err}): install Slurm's client commands "
            "(slurm-client) or give their paths (slurm.scontrol, slurm.squeue)"
        ) from err
    try:
        out, err_out = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:  # not the builtin on Python 3.10
        proc.kill()
        await proc.wait()
        raise ControllerError(
            f"{' '.join(argv)} did not answer within {timeout_s:g} s: is slurmctld up?"
        ) from None
    if proc.returncode != 0:
        detail = err_out.decode(errors="replace").strip().splitlines()
        raise ControllerError(
            f"{' '.join(argv)} failed (exit {proc.returncode}): "
            f"{detail[-1] if detail else 'no message'}; check that slurmctld is up, that "
            "munge runs here with the cluster's key, and $SLURM_CONF"
        )
    return out.decode(errors="replace")


async def read_nodes(settings: slurm_settings.SlurmSettings) -> list[model.Node]:
    return model.parse_nodes(await run(settings.scontrol, "show", "node", "--oneliner"))


async def read_jobs(settings: slurm_settings.SlurmSettings) -> list[jobs.JobRow]:
    """Every job the controller lists, ended ones included (for ``MinJobAge``)."""
    text = await run(settings.squeue, "--noheader", "--states=all", f"--format={SQUEUE_FORMAT}")
    return jobs.parse_jobs(text)
