"""The search over groupings: which jobs share one set of pools.

A *grouping* splits the jobs into blocks; each block gets a set of pools of its own (one
of each shared pool its jobs use) and its jobs take turns there. Its score is the
throughput gain over giving every job pools of its own:

    gain = sum over jobs of (solo time x pools used)
           / sum over blocks of (predicted makespan x pools of the block)

i.e. the GPU-seconds the same work takes dedicated, over the GPU-seconds it takes as
grouped (1 = no better than dedicated; for jobs of one shape all in one block it is the
speedup over running them back to back). The work is fixed, so the best grouping is the
one whose blocks cost the fewest GPU-seconds: the cost is a sum over blocks, and each
block is predicted once (:mod:`tslice.planner.predict`) whatever grouping it is in.

Up to :data:`EXHAUSTIVE_MAX_JOBS` jobs every grouping is scored (Bell(8) = 4140); beyond,
a heuristic: start from every job alone, merge the two blocks whose merge saves the most
GPU-seconds while one does (or while there are more blocks than sets allowed), then move
single jobs between blocks and swap pairs of jobs while that improves (a local optimum,
not a proven one). ``max_sets`` and ``max_share`` bound the blocks and their size.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence

EXHAUSTIVE_MAX_JOBS = 8
EXHAUSTIVE = "exhaustive"
HEURISTIC = "heuristic"

Block = tuple[str, ...]
Grouping = tuple[Block, ...]


def canonical(blocks: Sequence[Sequence[str]], order: Sequence[str]) -> Grouping:
    """Blocks in the jobs' order, each sorted, so a grouping has one spelling."""
    rank = {job: i for i, job in enumerate(order)}
    sorted_blocks = [tuple(sorted(b, key=rank.__getitem__)) for b in blocks if b]
    return tuple(sorted(sorted_blocks, key=lambda b: rank[b[0]]))


def partitions(items: Sequence[str]) -> Iterator[list[list[str]]]:
    """Every set partition of ``items`` (Bell(len(items)) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for smaller in partitions(rest):
        for i in range(len(smaller)):
            yield [*smaller[:i], [first, *smaller[i]], *smaller[i + 1 :]]
        yield [[first], *smaller]


@dataclasses.dataclass(frozen=True)
class Searched:
    """What the search looked at: every grouping it scored, cheapest first."""

    method: str
    #: (grouping, its GPU-seconds), cheapest first.
    scored: tuple[tuple[Grouping, float], ...]


def search(
    jobs: Sequence[str],
    cost: Callable[[Block], float],
    *,
    max_sets: int | None = None,
    max_share: int | None = None,
) -> Searched:
    """The groupings of ``jobs`` by ``cost`` (GPU-seconds of a block), at most ``max_sets``
    blocks of at most ``max_share`` jobs each; exhaustive for few jobs, heuristic beyond
    (see the module doc)."""
    limit = max_sets or len(jobs)
    share = max_share or len(jobs)
    if limit * share < len(jobs):
        raise ValueError(
            f"{len(jobs)} jobs do not fit {limit} set(s) of pools of at most {share} job(s)"
        )

    def allowed(blocks: Sequence[Sequence[str]]) -> bool:
        return len(blocks) <= limit and all(len(b) <= share for b in blocks)

    def total(grouping: Grouping) -> float:
        return sum(cost(block) for block in grouping)

    seen: dict[Grouping, float] = {}
    if len(jobs) <= EXHAUSTIVE_MAX_JOBS:
        method = EXHAUSTIVE
        for blocks in partitions(list(jobs)):
            if allowed(blocks):
                grouping = canonical(blocks, jobs)
                seen[grouping] = total(grouping)
    else:
        method = HEURISTIC
        _heuristic(jobs, total, limit, share, seen)
    scored = sorted(seen.items(), key=lambda kv: (round(kv[1], 9), len(kv[0]), kv[0]))
    return Searched(method=method, scored=tuple(scored))


def _heuristic(
    jobs: Sequence[str],
    total: Callable[[Grouping], float],
    limit: int,
    share: int,
    seen: dict[Grouping, float],
) -> None:
    def score(blocks: Sequence[Sequence[str]]) -> tuple[Grouping, float]:
        grouping = canonical(blocks, jobs)
        if grouping not in seen:
            seen[grouping] = total(grouping)
        return grouping, seen[grouping]

    current, best = score([[j] for j in jobs])
    # Merging: the pair of blocks whose merge saves the most, while one saves anything
    # (or while there are more blocks than sets to put them on).
    while len(current) > 1:
        merges = [
            score([*(b for k, b in enumerate(current) if k not in (i, j)), current[i] + current[j]])
            for i, j in itertools.combinations(range(len(current)), 2)
            if len(current[i]) + len(current[j]) <= share
        ]
        if not merges:
            break
        grouping, value = min(merges, key=lambda gv: gv[1])
        if value >= best and len(current) <= limit:
            break
        current, best = grouping, value
    # Local moves: one job to another block (or a block of its own), or two jobs swapped.
    improved = True
    while improved:
        improved = False
        for candidate in _neighbours(current):
            if len(candidate) > limit or any(len(b) > share for b in candidate):
                continue
            grouping, value = score(candidate)
            if value < best - 1e-9:
                current, best, improved = grouping, value, True
                break


def _neighbours(grouping: Grouping) -> Iterator[list[list[str]]]:
    blocks = [list(b) for b in grouping]
    for i, block in enumerate(blocks):
        for job in block:
            for j in [*range(len(blocks)), None]:
                if j == i or (j is None and len(block) == 1):
                    continue
                moved = [[x for x in b if x != job] for b in blocks]
                if j is None:
                    moved.append([job])
                else:
                    moved[j].append(job)
                yield [b for b in moved if b]
    for (i, a), (j, b) in itertools.combinations(enumerate(blocks), 2):
        for x, y in itertools.product(a, b):
            swapped = [list(block) for block in blocks]
            swapped[i] = [y if v == x else v for v in a]
            swapped[j] = [x if v == y else v for v in b]
            yield swapped
