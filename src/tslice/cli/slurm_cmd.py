"""``tslice slurm prolog``: what Slurm's Prolog runs on a node (``deploy/slurm/prolog.sh``).

As root, before the job starts, it writes the job's credential
(``tslice.orchestrator.slurm.token``) to ``<run-dir>/<job id>/token``, a directory and
file owned by the job's user and readable by nobody else; the TaskProlog points
``$TSLICE_TOKEN_FILE`` there and the Epilog removes the directory. It never fails the
job: a Prolog that exits non-zero makes Slurm drain the node, which a job that never
calls tslice must not suffer; a problem is one line on stderr (slurmd's log) instead,
and a job that then calls the orchestrator is told it has no credential.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from tslice.cli import render

DEFAULT_RUN_DIR = Path("/run/tslice/jobs")

slurm_app = typer.Typer(
    name="slurm",
    help="What Slurm's Prolog runs on a node (see deploy/slurm/).",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(slurm_app)


@slurm_app.command("prolog")
def prolog(
    *,
    key_file: Annotated[
        Path | None,
        typer.Option(
            "--key-file",
            help="The cluster's job key (default /etc/tslice/slurm/job.key).",
            metavar="FILE",
        ),
    ] = None,
    run_dir: Annotated[
        Path,
        typer.Option("--run-dir", help="Where each job's credential goes.", metavar="DIR"),
    ] = DEFAULT_RUN_DIR,
) -> None:
    """Write the Slurm job's credential (from $SLURM_JOB_ID, $SLURM_JOB_USER...); exits 0."""
    from tslice.orchestrator.slurm import token

    env = os.environ
    job = env.get("SLURM_JOB_ID", "")
    try:
        key = token.load_key(key_file or token.DEFAULT_KEY_FILE)
        claims = token.Claims(
            job=job,
            array_job=env.get("SLURM_ARRAY_JOB_ID", ""),
            user=env.get("SLURM_JOB_USER", ""),
        )
        minted = token.mint(key, claims)
        uid, gid = int(env.get("SLURM_JOB_UID", "")), int(env.get("SLURM_JOB_GID", "-1"))
        written = write_credential(run_dir, job, minted, uid=uid, gid=gid)
    except (ValueError, OSError) as err:
        render.error(f"tslice prolog of Slurm job {job or '?'}: no credential written: {err}")
        return
    render.stdout().print(f"tslice: credential of Slurm job {job} written to {written}")


def write_credential(run_dir: Path, job: str, text: str, *, uid: int, gid: int) -> Path:
    """``<run_dir>/<job>/token``: the directory 0700 and the file 0600, both the user's."""
    if not job.isdigit():
        raise ValueError(f"$SLURM_JOB_ID {job!r} is not a job id")
    run_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    job_dir = run_dir / job
    job_dir.mkdir(mode=0o700, exist_ok=True)
    path = job_dir / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text + "\n")
    if os.geteuid() == 0:
        os.chown(job_dir, uid, gid)
        os.chown(path, uid, gid)
    return path
