"""Slurm identity: a job's credential is bound to its Slurm job and user.

The prolog (``tslice slurm prolog``, ``deploy/slurm/``) writes each job a token
(``token``) readable by the job's user only; the TaskProlog points ``$TSLICE_TOKEN_FILE``
at it, so ``tslice.Client()`` presents it with no configuration. The orchestrator checks
it with this verifier (the ``auth:`` section's hook)::

    auth:
      verifier: tslice.orchestrator.slurm.identity:verifier
      verifier_settings: {key_file: /etc/tslice/slurm/job.key}
      tokens_file: /etc/tslice/tokens.yaml   # admin and other callers, as before

A token of Slurm job J (user U, array job A) has the job role and may act as job J and
as A, never as another Slurm job's id, and as a name (``$TSLICE_JOB_ID=grpo-7``) unless
another user's live job acts as that name: the name is then bound to J (``jobs.JobBook``)
and goes when every job bound to it has ended. So one user's job cannot acquire, yield or
hold as another's; evicting is the admin role's only. A token of a job the controller
lists as ended is refused (UNAUTHENTICATED), and a forged one too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tslice.common import errors
from tslice.orchestrator.slurm import jobs, token
from tslice.security import identities


@dataclasses.dataclass(frozen=True)
class SlurmPrincipal(identities.Principal):
    """A Slurm job's principal: its ``jobs`` are its Slurm job id and array job id."""

    user: str = ""
    slurm_job: str = ""
    book: jobs.JobBook = dataclasses.field(default_factory=jobs.book, compare=False, repr=False)

    def may_act_as(self, job_id: str) -> bool:
        if super().may_act_as(job_id):
            return True
        if jobs.is_slurm_id(job_id):
            return False  # another Slurm job's id
        # A name: acting as it binds it to this job, unless another user's job holds it.
        return self.book.claim(job_id, job=self.slurm_job, user=self.user) is None


class SlurmVerifier:
    """Recognises the tokens the prolog writes; other credentials go to the next verifier."""

    def __init__(self, key: bytes, *, book: jobs.JobBook | None = None) -> None:
        self._key = key
        self._book = book if book is not None else jobs.book()

    def verify(self, presented: identities.Presented) -> identities.Principal | None:
        if presented.token is None:
            return None
        try:
            claims = token.read(self._key, presented.token)
        except token.BadToken as err:
            raise identities.Unauthenticated(str(err)) from None
        if claims is None:
            return None
        ended = self._book.ended(claims.job)
        if ended is not None:
            raise identities.Unauthenticated(
                f"the credential of Slurm job {claims.job} is void: the job ended ({ended})"
            )
        return SlurmPrincipal(
            name=f"slurm-job-{claims.job}",
            roles=frozenset({identities.JOB}),
            jobs=tuple(j for j in (claims.job, claims.array_job) if j),
            via="Slurm job token",
            user=claims.user,
            slurm_job=claims.job,
            book=self._book,
        )


def verifier(settings: Mapping[str, Any]) -> SlurmVerifier:
    """The ``auth.verifier`` factory: ``verifier_settings: {key_file: PATH}``."""
    unknown = sorted(set(settings) - {"key_file"})
    if unknown:
        raise errors.ConfigError(
            f"auth.verifier_settings: unknown key {unknown[0]!r}; the Slurm verifier takes key_file"
        )
    path = Path(str(settings.get("key_file") or token.DEFAULT_KEY_FILE)).expanduser()
    try:
        return SlurmVerifier(token.load_key(path))
    except ValueError as err:
        raise errors.ConfigError(f"auth.verifier_settings.key_file: {err}") from err
