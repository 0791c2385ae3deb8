"""TorchAdapter: moves a PyTorch job's tensors off the device and back, bit for bit.

Why this shape:

* **Storages, not tensors, are the unit.** Several tensors may view one storage
  (tied weights, non-contiguous views, a buffer sliced out of another). Copying
  each storage's bytes once keeps aliasing, strides and offsets exactly as they
  were, and freeing the storage (``untyped_storage().resize_(0)``) really
  releases the memory even if some view we do not know about holds it.
* **Identity is kept.** Optimizers (and user code) hold references to the
  ``Parameter`` and state tensor objects, so nothing is ever replaced: while
  suspended each known tensor is re-pointed (``tensor.data = ...``) at an empty
  placeholder of its dtype and device, so a stray use fails with a shape error
  rather than reading freed memory; restore re-points it at its original
  storage, which is resized back and refilled.
* **Host buffers are paid for once.** Each tag owns one flat byte buffer
  (pinned when the tensors are on a CUDA device, at its exact size: no power-of-two
  rounding), sized at the first offload and reused by every later one; it grows only
  if the tag's tensors grow.
* **What did not change is not copied again** (``skip_unchanged``). After a restore
  the host buffer still holds every storage's bytes; a storage none of whose tensors
  has been written since (their version counters, ``tensor._version``, unchanged: any
  in-place operation, an optimizer step included, bumps them) is only freed at the
  next snapshot, not copied. With a frozen base model or LoRA a snapshot then moves
  only the trainable part. Writes through ``tensor.data`` (``p.data.copy_(w)``, as some
  weight loaders do) bypass the counter: call :meth:`TorchAdapter.mark_changed`
  after them, or leave ``skip_unchanged`` off.
* **Copies are chunked.** On CUDA the chunks alternate between side streams so
  that copies overlap and the training stream is not blocked; on CPU a chunked
  ``copy_`` keeps the cost of a plain copy of the same bytes (see
  ``bench/offload.py``).

* **Switches may overlap** (issue 9 §2). With ``free_progressively`` a snapshot frees
  each storage as soon as its bytes are on the host (chunked offload: memory comes
  free piece by piece) instead of once everything is copied; ``torch_overlap.overlap_switch``
  runs one adapter's snapshot and another's restore at once (device-to-host on the
  outgoing adapter's streams, host-to-device on the incoming one's: opposite copy
  directions), the restore allocating each storage only once the snapshot has freed
  enough within a device budget, so a switch costs about the longer copy.

The storage machinery (blocks, host buffers, the copier) is in
:mod:`tslice.workload.adapters.torch_storage`; this module decides what to move.

Tags: ``weights`` (parameters except LoRA ones, their gradients, and buffers),
``lora`` (parameters whose name matches ``lora_patterns``, and their gradients),
``optimizer`` (every tensor in ``optimizer.state``) and any custom tag given to
:meth:`TorchAdapter.add_tensors` (e.g. ``kv_cache``).

OFFLOAD keeps the bytes in host memory and restore brings back exactly what was
offloaded. DISCARD frees the storage without copying (e.g. weights that the next
weight sync re-sends); restore re-allocates it zero-filled and the tag stays in
:attr:`TorchAdapter.discarded_tags` until :meth:`TorchAdapter.mark_resynced`, so
tensors restored after DISCARD are *not* the old values, by design.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import ClassVar

import torch

from tslice.workload.adapters import base, torch_spill, torch_storage

WEIGHTS = "weights"
LORA = "lora"
OPTIMIZER = "optimizer"
BUILTIN_TAGS = (WEIGHTS, LORA, OPTIMIZER)

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
DEFAULT_LORA_PATTERNS = ("lora_",)

OFFLOAD = base.SuspendMode.OFFLOAD
DISCARD = base.SuspendMode.DISCARD


@dataclasses.dataclass(frozen=True)
class TorchAdapterStats:
    """What an adapter has done since it was created (for logs, tests and metrics)."""

    #: Successful snapshot calls, and device bytes they freed.
    snapshots: int = 0
    bytes_out: int = 0
    #: Successful restore calls, and device bytes they brought back.
    restores: int = 0
    bytes_in: int = 0
    #: Bytes snapshots copied to host memory, and bytes they did not copy because the
    #: host already held them unchanged (``skip_unchanged``).
    bytes_copied_out: int = 0
    bytes_skipped_out: int = 0
    #: Host buffers allocated so far (reused ones are not counted again).
    host_allocations: int = 0
    #: Spill tier (``spill_dir``): bytes written to files and read back, and the seconds
    #: those copies took (flush to disk included), for GB/s.
    bytes_spilled: int = 0
    spill_write_s: float = 0.0
    bytes_unspilled: int = 0
    spill_read_s: float = 0.0


class TorchAdapter(base.WorkloadAdapter):
    """Offloads (or discards) a module's parameters and buffers, an optimizer's state
    and custom tensors, by tag, and restores them bit for bit.

    Usage::

        adapter = TorchAdapter(model, optimizer)
        adapter.add_tensors("kv_cache", {"k": k_cache, "v": v_cache})
        handle = tslice.workload.register_workload(agent, job_id, workload=adapter)

    The same tensor objects stay valid across a cycle; only their storage
    moves. Do not touch the tensors of a suspended tag (the time-slicing client
    blocks in ``acquire()`` while they are away).

    Args:
        module: its parameters, gradients and buffers (tags ``weights``, ``lora``).
        optimizer: its state tensors (tag ``optimizer``).
        lora_patterns: a parameter whose name contains one of these is ``lora``.
        chunk_bytes: size of one copy; on CUDA, chunks alternate between streams.
        streams_per_device: CUDA side streams used for the copies.
        release_cached_memory: after a snapshot, hand freed CUDA memory back to
            the driver (``torch.cuda.empty_cache()``) so that another process
            can use it; turn off only if the next job runs in this process.
        free_progressively: an OFFLOAD snapshot frees each storage once its bytes
            are on the host (a later failure copies the freed ones back first, so
            a failed snapshot still leaves the tensors intact).
        skip_unchanged: a snapshot does not copy a storage whose tensors were not
            written since the last restore (see the module docstring); off by
            default, since writes through ``.data`` go unseen.
        spill_dir, host_budget_bytes: the host buffers stay within
            ``host_budget_bytes``; a tag whose state does not fit is parked in a file
            in ``spill_dir`` (local disk) instead, restored bit for bit
            (:mod:`tslice.workload.adapters.torch_spill`). Results report only the
            bytes held in host memory; ``stats`` the bytes spilled and their GB/s.
    """

    name: ClassVar[str] = "torch"

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        lora_patterns: Sequence[str] = DEFAULT_LORA_PATTERNS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        streams_per_device: int = 2,
        release_cached_memory: bool = True,
        free_progressively: bool = False,
        skip_unchanged: bool = False,
        spill_dir: str | os.PathLike[str] | None = None,
        host_budget_bytes: int | None = None,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive (got {chunk_bytes})")
        if streams_per_device <= 0:
            raise ValueError(f"streams_per_device must be positive (got {streams_per_device})")
        self._module = module
        self._optimizer = optimizer
        self._lora_patterns = tuple(lora_patterns)
        self._custom: dict[str, dict[str, torch.Tensor]] = {}
        self._parked: dict[str, torch_storage.Parked] = {}
        self._needs_resync: set[str] = set()
        self._buffers = torch_storage.HostBuffers()
        self._copier = torch_storage.Copier(
            chunk_bytes=chunk_bytes, streams_per_device=streams_per_device
        )
        self._release_cached_memory = release_cached_memory
        self._free_progressively = free_progressively
        self._skip_unchanged = skip_unchanged
        if (spill_dir is None) != (host_budget_bytes is None):
            raise ValueError("give spill_dir and host_budget_bytes together (or neither)")
        self._spill = torch_spill.SpillFiles(spill_dir) if spill_dir is not None else None
        self._host_budget = host_budget_bytes
        self._host_copies = torch_storage.HostCopies()
        self._stats = TorchAdapterStats()
        # The workload channel runs commands on its own thread; one move at a time.
        self._lock = threading.Lock()

    # ---- tags -------------------------------------------------------------

    @property
    def tags(self) -> list[str]:
        """Every tag this adapter can move, in a stable order."""
        tags: list[str] = []
        if self._module is not None:
            tags.append(WEIGHTS)
            if any(self._is_lora(name) for name, _ in self._module.named_parameters()):
                tags.append(LORA)
        if self._optimizer is not None:
            tags.append(OPTIMIZER)
        tags.extend(self._custom)
        return tags

    @property
    def suspended_tags(self) -> list[str]:
        """Tags whose tensors are off the device now."""
        return [tag for tag in self.tags if tag in self._parked]

    @property
    def resident_tags(self) -> list[str]:
        """Tags whose tensors are on the device now."""
        return [tag for tag in self.tags if tag not in self._parked]

    @property
    def discarded_tags(self) -> list[str]:
        """Tags dropped by DISCARD whose values have not been re-synced since
        (see :meth:`mark_resynced`); their tensors hold zeros once restored."""
        return sorted(self._needs_resync)

    @property
    def stats(self) -> TorchAdapterStats:
        """Counts of successful snapshots and restores and the bytes they moved."""
        return dataclasses.replace(self._stats, host_allocations=self._buffers.allocations)

    @property
    def host_buffer_bytes(self) -> int:
        """Host memory reserved for offloads, kept across cycles (see ``release_host_buffers``)."""
        return self._buffers.nbytes

    def mark_changed(self, *tags: str) -> None:
        """Say that tensors of ``tags`` (all when none) were written in a way their version
        counters do not see (through ``.data``): the next snapshot copies them."""
        self._check_known(tags)
        with self._lock:
            for tag in tags or self.tags:
                self._host_copies.forget(tag)

    def mark_resynced(self, *tags: str) -> None:
        """Say that the application has re-provisioned discarded tags (e.g. after a weight sync)."""
        self._check_known(tags)
        self._needs_resync.difference_update(tags)

    def add_tensors(self, tag: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Add custom tensors (e.g. a KV cache) under ``tag``; calling again adds to the tag."""
        if not tag or tag in BUILTIN_TAGS:
            raise ValueError(
                f"custom tag {tag!r} is not allowed: use a non-empty name other than "
                f"{', '.join(BUILTIN_TAGS)}"
            )
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{tag}/{name} is a {type(tensor).__name__}, not a torch.Tensor")
        with self._lock:
            if tag in self._parked:
                raise RuntimeError(f"tag {tag!r} is suspended; restore it before adding tensors")
            self._custom.setdefault(tag, {}).update(tensors)

    def reserve_host_buffers(self, tags: Sequence[str] = ()) -> int:
        """Allocate the host buffers of resident ``tags`` (all when empty) now, so that
        the first switch does not pay for it (pinning memory is slow); returns the
        bytes reserved in all."""
        with self._lock:
            wanted = [tag for tag in self._resolve(tags) if tag not in self._parked]
            for tag, blocks in self._plan(wanted).items():
                self._host_buffer_for(tag, blocks)
            return self._buffers.nbytes

    def release_host_buffers(self) -> None:
        """Free the host buffers of resident tags (the next offload allocates them again)."""
        with self._lock:
            resident = [tag for tag in self.tags if tag not in self._parked]
            for tag in resident:
                self._host_copies.forget(tag)
            self._buffers.release(resident)

    # ---- moves ------------------------------------------------------------

    def capabilities(self) -> base.Capabilities:
        return base.Capabilities(
            supported_modes=(OFFLOAD, DISCARD), default_mode=OFFLOAD, tags=tuple(self.tags)
        )

    def state(self) -> base.AdapterState:
        return base.AdapterState(
            suspended=bool(self._parked), resident_tags=tuple(self.resident_tags)
        )

    def snapshot(
        self,
        mode: base.SuspendMode | int | str,
        tags: Sequence[str] = (),
        *,
        freed_bytes: Callable[[int], None] | None = None,
    ) -> base.AdapterResult:
        """Take ``tags`` (all when empty) off the device: OFFLOAD copies them to host
        memory first, DISCARD drops them. Tags already off the device are left as they are.

        Nothing is freed unless every copy succeeded, so a failure leaves the tensors
        intact (with ``free_progressively``, the storages freed so far are copied back
        first). ``freed_bytes`` is told every storage's bytes as they are freed.
        """
        resolved = base.SuspendMode.parse(mode)
        with self._lock:
            wanted = [tag for tag in self._resolve(tags) if tag not in self._parked]
            plan = self._plan(wanted)
            progressive = self._free_progressively and resolved == OFFLOAD
            if resolved == OFFLOAD:
                copy = self._offload_progressively if progressive else self._copy_to_host
                for tag, blocks in plan.items():
                    copy(tag, blocks, freed_bytes)
            freed = 0
            for tag, blocks in plan.items():
                for block in blocks:
                    if not progressive:
                        torch_storage.free(block)
                        if freed_bytes is not None:
                            freed_bytes(block.nbytes)
                    freed += block.nbytes
                self._parked[tag] = torch_storage.Parked(mode=resolved, blocks=blocks)
                self._host_copies.forget(tag)
                if resolved == DISCARD:
                    self._needs_resync.add(tag)
            if self._release_cached_memory:
                torch_storage.empty_device_caches(plan.values())
            self._stats = dataclasses.replace(
                self._stats,
                snapshots=self._stats.snapshots + 1,
                bytes_out=self._stats.bytes_out + freed,
            )
            return base.AdapterResult(device_bytes=freed, host_bytes=self._saved_bytes())

    def restore(
        self, tags: Sequence[str] = (), *, admit: Callable[[int], None] | None = None
    ) -> base.AdapterResult:
        """Bring ``tags`` (all suspended ones when empty) back onto their devices.

        Tags already resident are left as they are. If allocation fails, the tags
        whose memory could not be allocated stay suspended, with their saved bytes.
        ``admit`` is called with each storage's bytes before it is allocated and may
        block until there is room (an overlapping switch, see ``torch_overlap.overlap_switch``);
        the storages of a tag are then allocated and refilled one by one.
        """
        with self._lock:
            wanted = [
                tag for tag in self._resolve(tags, default=self._parked) if tag in self._parked
            ]
            restored = 0
            for tag in wanted:
                parked = self._parked[tag]
                try:
                    self._bring_back(tag, parked, admit)
                except BaseException:
                    for block in parked.blocks:
                        block.storage.resize_(0)
                    raise
                for block in parked.blocks:
                    torch_storage.repoint(block)
                del self._parked[tag]
                restored += parked.nbytes
                if self._spill is not None and self._spill.holds(tag):
                    self._spill.drop(tag)
                elif parked.mode == OFFLOAD:
                    self._remember_host_copy(tag, parked.blocks)
            self._stats = dataclasses.replace(
                self._stats,
                restores=self._stats.restores + 1,
                bytes_in=self._stats.bytes_in + restored,
            )
            return base.AdapterResult(device_bytes=restored, host_bytes=self._saved_bytes())

    # ---- internals ----------------------------------------------------------

    def _bring_back(
        self, tag: str, parked: torch_storage.Parked, admit: Callable[[int], None] | None
    ) -> None:
        """Allocate and refill a parked tag's storages (one by one when ``admit`` gates them)."""
        steps = [[block] for block in parked.blocks] if admit is not None else [parked.blocks]
        for blocks in steps:
            if admit is not None:
                admit(sum(b.nbytes for b in blocks))
            torch_storage.allocate(blocks)
            if parked.mode == OFFLOAD and self._spill is not None and self._spill.holds(tag):
                began = time.perf_counter()
                self._copier.to_device(blocks, self._spill.get(tag))
                self._count_spill(read=sum(b.nbytes for b in blocks), began=began)
            elif parked.mode == OFFLOAD:
                self._copier.to_device(blocks, self._buffers.get(tag))
            else:
                for block in blocks:
                    block.byte_view().zero_()

    def _remember_host_copy(self, tag: str, blocks: Sequence[torch_storage.Block]) -> None:
        """The tag is resident again and its host buffer holds every storage's bytes."""
        if self._skip_unchanged:
            self._host_copies.remember(tag, blocks, self._buffers.get(tag))

    def _to_copy(
        self, tag: str, blocks: Sequence[torch_storage.Block], buffer: torch.Tensor
    ) -> list[torch_storage.Block]:
        """The blocks whose bytes the host buffer does not hold unchanged (all of them
        without ``skip_unchanged``); counts the bytes copied and skipped."""
        copy = [b for b in blocks if not self._host_copies.unchanged(tag, b, buffer)]
        copied = sum(b.nbytes for b in copy)
        skipped = sum(b.nbytes for b in blocks) - copied
        self._stats = dataclasses.replace(
            self._stats,
            bytes_copied_out=self._stats.bytes_copied_out + copied,
            bytes_skipped_out=self._stats.bytes_skipped_out + skipped,
        )
        return copy

    def _offload_progressively(
        self,
        tag: str,
        blocks: list[torch_storage.Block],
        freed_bytes: Callable[[int], None] | None,
    ) -> None:
        """Copy each storage to the host and free it at once; on a failure, copy the ones
        freed so far back (the snapshot then changes nothing) and re-raise."""
        buffer = self._host_buffer_for(tag, blocks, may_spill=True)
        needed = {id(block) for block in self._to_copy(tag, blocks, buffer)}
        done: list[torch_storage.Block] = []
        try:
            for block in blocks:
                if id(block) in needed:
                    self._copier.to_host([block], buffer)
                torch_storage.free(block)
                done.append(block)
                if freed_bytes is not None:
                    freed_bytes(block.nbytes)
        except BaseException:
            torch_storage.allocate(done)
            self._copier.to_device(done, buffer)
            for block in done:
                torch_storage.repoint(block)
            raise

    def _resolve(self, tags: Sequence[str], *, default: Iterable[str] | None = None) -> list[str]:
        if not tags:
            return list(self.tags if default is None else default)
        self._check_known(tags)
        return list(dict.fromkeys(tags))

    def _check_known(self, tags: Iterable[str]) -> None:
        available = self.tags
        unknown = [tag for tag in tags if tag not in available]
        if unknown:
            raise ValueError(
                f"unknown tag(s) {', '.join(map(repr, unknown))}; this workload has "
                f"{', '.join(available) or 'no tags'}"
            )

    def _is_lora(self, name: str) -> bool:
        return any(pattern in name for pattern in self._lora_patterns)

    def _named_tensors(self, tag: str) -> Iterator[tuple[str, torch.Tensor]]:
        if tag in (WEIGHTS, LORA) and self._module is not None:
            for name, param in self._module.named_parameters():
                if self._is_lora(name) == (tag == LORA):
                    yield name, param
                    if param.grad is not None:
                        yield f"{name}.grad", param.grad
            if tag == WEIGHTS:
                for name, buffer in self._module.named_buffers():
                    yield name, buffer
        elif tag == OPTIMIZER and self._optimizer is not None:
            names = self._param_names()
            for index, (owner, state) in enumerate(self._optimizer.state.items()):
                prefix = names.get(id(owner), f"param{index}")
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        yield f"{prefix}.{key}", value
        else:
            yield from self._custom.get(tag, {}).items()

    def _param_names(self) -> dict[int, str]:
        if self._module is None:
            return {}
        return {id(param): name for name, param in self._module.named_parameters()}

    def _plan(self, tags: Sequence[str]) -> dict[str, list[torch_storage.Block]]:
        """Group the tags' tensors by storage, checking everything before anything moves."""
        plan: dict[str, list[torch_storage.Block]] = {}
        seen: dict[tuple[torch.device, int], torch_storage.Block] = {}
        for tag in tags:
            blocks: list[torch_storage.Block] = []
            for name, tensor in self._named_tensors(tag):
                block = torch_storage.block_for(f"{tag}/{name}", tensor, seen)
                if block is not None:
                    blocks.append(block)
            plan[tag] = blocks
        self._check_not_shared_with_resident(tags, seen)
        return plan

    def _check_not_shared_with_resident(
        self, moving: Sequence[str], seen: Mapping[tuple[torch.device, int], torch_storage.Block]
    ) -> None:
        # Freeing a storage that a tensor of a tag staying on the device also
        # views would leave that tensor pointing at freed memory.
        for tag in self.tags:
            if tag in moving or tag in self._parked:
                continue
            for name, tensor in self._named_tensors(tag):
                if tensor.layout != torch.strided or tensor.device.type == "meta":
                    continue
                block = seen.get(torch_storage.storage_key(tensor))
                if block is not None and tensor.untyped_storage().nbytes() > 0:
                    raise ValueError(
                        f"{block.aliases[0].name} shares memory with {tag}/{name}; "
                        f"move tag {tag!r} together with it"
                    )

    def _copy_to_host(
        self,
        tag: str,
        blocks: list[torch_storage.Block],
        _freed: Callable[[int], None] | None = None,
    ) -> None:
        buffer = self._host_buffer_for(tag, blocks, may_spill=True)
        began = time.perf_counter()
        self._copier.to_host(self._to_copy(tag, blocks, buffer), buffer)
        if self._spill is not None and self._spill.holds(tag):
            self._spill.flush(tag)
            self._count_spill(written=sum(b.nbytes for b in blocks), began=began)

    def _host_buffer_for(
        self, tag: str, blocks: Sequence[torch_storage.Block], *, may_spill: bool = False
    ) -> torch.Tensor:
        """Lay ``blocks`` out in the tag's host buffer, growing it only if they do not fit;
        ``may_spill``: in a spill file instead where the host budget cannot hold them."""
        total = 0
        for block in blocks:
            block.host_offset = total
            total = torch_storage.align(total + block.nbytes)
        if may_spill and self._spill is not None and self._host_budget is not None:
            held = self._buffers.nbytes - self._buffers.size_of(tag)
            if held + total > self._host_budget:
                self._buffers.release([tag])
                self._host_copies.forget(tag)
                return self._spill.buffer(tag, total)
        pinned = torch.cuda.is_available() and any(b.device.type == "cuda" for b in blocks)
        return self._buffers.reserve(tag, total, pinned=pinned)

    def _count_spill(self, *, began: float, written: int = 0, read: int = 0) -> None:
        took = time.perf_counter() - began
        stats = self._stats
        self._stats = dataclasses.replace(
            stats,
            bytes_spilled=stats.bytes_spilled + written,
            spill_write_s=stats.spill_write_s + (took if written else 0.0),
            bytes_unspilled=stats.bytes_unspilled + read,
            spill_read_s=stats.spill_read_s + (took if read else 0.0),
        )

    def _saved_bytes(self) -> int:
        """Host memory the parked state holds (a spilled tag holds none)."""
        spilled = self._spill.holds if self._spill is not None else (lambda _tag: False)
        return sum(
            p.nbytes for tag, p in self._parked.items() if p.mode == OFFLOAD and not spilled(tag)
        )


__all__ = ["TorchAdapter", "TorchAdapterStats"]
