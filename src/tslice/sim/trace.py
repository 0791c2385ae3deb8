"""Phase model of a synchronous RL job, derived from a recorded two-job veRL trace.

The recorded run (``verl-sync-2xH100.json``) holds, for two GRPO jobs sharing a
sampler GPU and a trainer GPU, every lock window per pool, every acquire (with its
wait and restore time), yield, checkpoint and restore, plus per-GPU duty curves of a
baseline run in which one job had both GPUs to itself.

What is measured (steady-state steps; the first window of each job also covers model
loading and is left out):

* ``sync``   - the job holds BOTH pools: it got the sampler while still holding the
  trainer (weight hand-over), until it yields the trainer;
* ``sample`` - sampler held alone, after the trainer was yielded;
* ``reward`` - CPU only: from the sampler yield to the next trainer request
  (request time = acquired time - max(wait, restore));
* ``train``  - trainer held, up to the next sampler request;
* snapshot / restore durations per pool (``ckpt_done`` / ``restore_done`` events);
* the baseline step period: mean spacing of the onsets of sampler activity in the
  baseline duty curve (one job alone on its own GPUs).

One step of the time-sliced run takes ``sync+sample+reward+train`` seconds of work,
more than a baseline step: the two jobs slowed each other down on the shared host.
That ratio is the *contention* factor. The model therefore stores uncontended phase
durations (measured / contention) and the simulated job stretches them by the factor
only when it shares the pools. Everything above is computed here from the trace;
nothing is typed in from the trace's summary, whose numbers are kept only to be
shown next to what the simulation measures.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import random
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tslice.common import errors

SAMPLER = "sampler"
TRAINER = "trainer"
POOLS = (SAMPLER, TRAINER)
TRACE_NAME = "verl-sync-2xH100.json"

# A jittered phase stays within this share of its median, so a rare draw from the
# tails cannot produce a negative or absurdly long phase.
_JITTER_CLAMP = 0.5


@dataclasses.dataclass(frozen=True)
class Stat:
    """A measured duration: median, robust spread (1.4826 x MAD) and sample count."""

    median: float
    spread: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        if not values:
            raise ValueError("no samples")
        median = statistics.median(values)
        mad = statistics.median(abs(v - median) for v in values)
        return cls(median=median, spread=1.4826 * mad, count=len(values))

    def draw(self, rng: random.Random) -> float:
        """A normal draw around the median, clamped to +/- 50 % of it."""
        value = rng.gauss(self.median, self.spread)
        low, high = self.median * (1 - _JITTER_CLAMP), self.median * (1 + _JITTER_CLAMP)
        return min(max(value, low), high)


@dataclasses.dataclass(frozen=True)
class Phase:
    """One stretch of a step: ``pools`` held for ``duration_s`` trace seconds (() = CPU only)."""

    name: str
    pools: tuple[str, ...]
    duration_s: float


@dataclasses.dataclass(frozen=True)
class SwitchCost:
    """Recorded device-state move times of one pool, in trace seconds."""

    snapshot: Stat
    restore: Stat

    @property
    def switch_s(self) -> float:
        """A full hand-over moves one job off (snapshot) and the next one on (restore)."""
        return self.snapshot.median + self.restore.median


@dataclasses.dataclass(frozen=True)
class Recorded:
    """The trace's own summary, shown beside the simulated results (never used by them)."""

    speedup: float
    duty_baseline_pct: float
    duty_time_sliced_pct: float
    baseline_min: float
    time_sliced_min: float
    switches: int


@dataclasses.dataclass(frozen=True)
class PhaseModel:
    """Per-step phases of one job, switch costs per pool, and the calibration behind them.

    ``sync``/``sample``/``reward``/``train`` are as measured in the time-sliced run
    (contended); :meth:`job_steps` hands out uncontended durations.
    """

    source: str
    sync: Stat
    sample: Stat
    reward: Stat
    train: Stat
    switch: Mapping[str, SwitchCost]
    baseline_step_s: float
    contention: float
    recorded: Recorded

    @property
    def contended_step_s(self) -> float:
        return self.sync.median + self.sample.median + self.reward.median + self.train.median

    def job_steps(self, *, steps: int, seed: int, jitter: bool = True) -> list[list[Phase]]:
        """Phases of one job running alone (uncontended), step by step, in trace seconds.

        Step 0 has no weight sync (nothing trained yet): sample, reward, train. Every
        later step starts by taking the sampler while still holding the trainer (sync).
        The same ``seed`` gives the same phases, so an exclusive and a time-sliced run
        of a job do exactly the same work.
        """
        if steps < 1:
            raise ValueError(f"steps must be at least 1 (got {steps})")
        rng = random.Random(seed)

        def duration(stat: Stat) -> float:
            value = stat.draw(rng) if jitter else stat.median
            return value / self.contention

        plan: list[list[Phase]] = []
        for step in range(steps):
            phases: list[Phase] = []
            if step > 0:
                phases.append(Phase("sync", (SAMPLER, TRAINER), duration(self.sync)))
            phases.append(Phase("sample", (SAMPLER,), duration(self.sample)))
            phases.append(Phase("reward", (), duration(self.reward)))
            phases.append(Phase("train", (TRAINER,), duration(self.train)))
            plan.append(phases)
        return plan


def default_trace_path() -> Path:
    """The repository's ``shared/traces`` copy if present, else the one shipped in the package."""
    repo_root = Path(__file__).resolve().parents[3]
    shared = repo_root.parent / "shared" / "traces" / TRACE_NAME
    if shared.is_file():
        return shared
    return Path(str(importlib.resources.files("tslice.sim") / "traces" / TRACE_NAME))


def load_model(path: Path | None = None) -> PhaseModel:
    """Read a trace file and derive its phase model; :class:`ConfigError` if unusable."""
    trace_path = path or default_trace_path()
    try:
        raw = json.loads(trace_path.read_text())
    except FileNotFoundError as err:
        raise errors.ConfigError(f"trace file {trace_path} does not exist") from err
    except (OSError, ValueError) as err:
        raise errors.ConfigError(f"trace file {trace_path} is not readable JSON: {err}") from err
    try:
        return derive_model(raw, source=str(trace_path))
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise errors.ConfigError(
            f"trace file {trace_path} does not have the expected shape "
            f"(timeslice.windows/events, baseline.duty_gpus): {err!r}"
        ) from err


def derive_model(trace: Mapping[str, Any], *, source: str = "<trace>") -> PhaseModel:
    """Compute the phase model from a parsed trace (see the module docstring)."""
    ts = trace["timeslice"]
    windows: Mapping[str, list[Mapping[str, Any]]] = ts["windows"]
    events: list[Mapping[str, Any]] = ts["events"]
    for pool in POOLS:
        if pool not in windows:
            raise ValueError(f"timeslice.windows has no {pool!r} pool")

    requests = _request_times(events)
    sync: list[float] = []
    sample: list[float] = []
    reward: list[float] = []
    train: list[float] = []
    jobs = sorted({w["job"] for pool in POOLS for w in windows[pool]})
    for job in jobs:
        sw = sorted((w for w in windows[SAMPLER] if w["job"] == job), key=lambda w: w["t0"])
        tw = sorted((w for w in windows[TRAINER] if w["job"] == job), key=lambda w: w["t0"])
        # Window k of each pool belongs to step k; k = 0 includes model loading.
        for k in range(1, len(sw)):
            if k >= len(tw):
                break
            overlap = tw[k]["t1"] - sw[k]["t0"]
            if overlap > 0:
                sync.append(overlap)
            sample.append(sw[k]["t1"] - max(tw[k]["t1"], sw[k]["t0"]))
            if k + 1 < len(tw):
                asked = requests.get((job, TRAINER, _key(tw[k + 1]["t0"])))
                if asked is not None:
                    reward.append(asked - sw[k]["t1"])
                if k + 1 < len(sw):
                    asked = requests.get((job, SAMPLER, _key(sw[k + 1]["t0"])))
                    if asked is not None:
                        train.append(asked - tw[k + 1]["t0"])
    if not (sample and reward and train):
        raise ValueError("too few steady-state steps to measure sample/reward/train phases")

    baseline_step = _baseline_step(trace["baseline"]["duty_gpus"])
    model_stats = {
        "sync": Stat.of(sync) if sync else Stat(0.0, 0.0, 0),
        "sample": Stat.of(sample),
        "reward": Stat.of(reward),
        "train": Stat.of(train),
    }
    contended = sum(s.median for s in model_stats.values())
    return PhaseModel(
        source=source,
        sync=model_stats["sync"],
        sample=model_stats["sample"],
        reward=model_stats["reward"],
        train=model_stats["train"],
        switch={pool: _switch_cost(events, pool) for pool in POOLS},
        baseline_step_s=baseline_step,
        contention=max(contended / baseline_step, 1.0),
        recorded=_recorded(trace.get("summary", {})),
    )


def _key(t: float) -> float:
    return round(float(t), 1)


def _request_times(events: list[Mapping[str, Any]]) -> dict[tuple[str, str, float], float]:
    """(job, pool, acquired time) -> when the job asked for the pool."""
    out: dict[tuple[str, str, float], float] = {}
    for e in events:
        if e.get("kind") != "acquired":
            continue
        # wait_ms includes the restore, except on a free pool where it is reported as 0.
        waited = max(float(e.get("wait_ms", 0)), float(e.get("restore_ms", 0))) / 1000.0
        out[(e["job"], e["pool"], _key(e["t"]))] = float(e["t"]) - waited
    return out


def _switch_cost(events: list[Mapping[str, Any]], pool: str) -> SwitchCost:
    ckpt = [e["ms"] / 1000.0 for e in events if e.get("kind") == "ckpt_done" and e["pool"] == pool]
    rest = [
        e["ms"] / 1000.0 for e in events if e.get("kind") == "restore_done" and e["pool"] == pool
    ]
    if not ckpt or not rest:
        raise ValueError(f"no ckpt_done/restore_done events for pool {pool!r}")
    return SwitchCost(snapshot=Stat.of(ckpt), restore=Stat.of(rest))


def _baseline_step(duty_gpus: Mapping[str, list[list[float]]]) -> float:
    """Mean period between onsets of sampler activity (GPU 0) in the baseline duty curve."""
    curve = duty_gpus["0"]
    onsets = [curve[i][0] for i in range(1, len(curve)) if curve[i][1] > 0 and curve[i - 1][1] <= 0]
    if len(onsets) < 2:
        raise ValueError("baseline duty curve of GPU 0 shows fewer than two sampling phases")
    return (onsets[-1] - onsets[0]) / (len(onsets) - 1)


def _recorded(summary: Mapping[str, Any]) -> Recorded:
    return Recorded(
        speedup=float(summary.get("speedup", 0.0)),
        duty_baseline_pct=float(summary.get("duty_base", 0.0)),
        duty_time_sliced_pct=float(summary.get("duty_ts", 0.0)),
        baseline_min=float(summary.get("base_min", 0.0)),
        time_sliced_min=float(summary.get("ts_min", 0.0)),
        switches=int(summary.get("swaps", 0)),
    )
