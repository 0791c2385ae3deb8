"""Storages moved as a unit: what a TorchAdapter moves, where it parks it, how it copies.

Several tensors may view one storage (tied weights, non-contiguous views), so a
:class:`Block` is one storage with every known tensor that views it. Each tag owns
one flat :class:`HostBuffers` byte buffer, allocated once and reused; the
:class:`Copier` moves blocks in chunks, alternating CUDA side streams so that
copies overlap. Freeing a block re-points its tensors at empty placeholders, so a
stray use fails with a shape error instead of reading freed memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterable, Sequence

import torch

from tslice.workload.adapters import base

# Slots in a host buffer start on this boundary so that copies stay aligned for any dtype.
SLOT_ALIGN = 256


@dataclasses.dataclass(frozen=True)
class Alias:
    """A tensor we know about and where it points into its storage."""

    name: str
    tensor: torch.Tensor
    dtype: torch.dtype
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> Alias:
        return cls(
            name=name,
            tensor=tensor,
            dtype=tensor.dtype,
            storage_offset=int(tensor.storage_offset()),
            size=tuple(int(n) for n in tensor.size()),
            stride=tuple(int(n) for n in tensor.stride()),
        )


@dataclasses.dataclass
class Block:
    """One storage moved as a unit, with every known tensor that views it."""

    storage: torch.UntypedStorage
    device: torch.device
    nbytes: int
    aliases: list[Alias]
    #: Where the bytes live in the tag's host buffer (OFFLOAD only).
    host_offset: int = 0

    def byte_view(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=self.device).set_(self.storage)


@dataclasses.dataclass
class Parked:
    """A tag whose tensors are off the device."""

    mode: base.SuspendMode
    blocks: list[Block]

    @property
    def nbytes(self) -> int:
        return sum(block.nbytes for block in self.blocks)


class HostBuffers:
    """One flat byte buffer per tag, allocated once at its exact size and reused.

    Pinned buffers are plain host allocations of the exact size, then registered with
    the driver (``cudaHostRegister``): PyTorch's pinned allocator (``pin_memory=True``)
    rounds every block up to a power of two, which over-commits host memory (1.67x in
    one field report) exactly where parked states must fit a budget.
    """

    def __init__(self) -> None:
        self._by_tag: dict[str, torch.Tensor] = {}
        #: Buffers allocated so far (a reused buffer is not counted again).
        self.allocations = 0

    def reserve(self, tag: str, nbytes: int, *, pinned: bool) -> torch.Tensor:
        current = self._by_tag.get(tag)
        if (
            current is not None
            and current.numel() >= nbytes
            and (current.is_pinned() or not pinned)
        ):
            return current
        # Drop the old one first so that peak host memory is not old + new.
        self._drop(tag)
        del current
        buffer = _exact_host_buffer(nbytes, pinned=pinned)
        self._by_tag[tag] = buffer
        self.allocations += 1
        return buffer

    def get(self, tag: str) -> torch.Tensor:
        return self._by_tag[tag]

    def size_of(self, tag: str) -> int:
        buffer = self._by_tag.get(tag)
        return 0 if buffer is None else buffer.numel()

    def release(self, tags: Iterable[str]) -> None:
        for tag in tags:
            self._drop(tag)

    def _drop(self, tag: str) -> None:
        self._by_tag.pop(tag, None)  # its finaliser unregisters it, before it is freed

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() for buffer in self._by_tag.values())


def _exact_host_buffer(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """``nbytes`` of host memory, page-locked if ``pinned`` (registered where the driver
    allows it, else PyTorch's rounded pinned allocation)."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if not pinned or nbytes == 0:
        return buffer
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)) != 0:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    # Unregistered when the buffer goes, before its memory returns to the allocator.
    weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
    return buffer


class Copier:
    """Chunked copies between storages and a host buffer; side streams on CUDA."""

    def __init__(self, *, chunk_bytes: int, streams_per_device: int) -> None:
        self._chunk_bytes = chunk_bytes
        self._streams_per_device = streams_per_device
        self._streams: dict[torch.device, list[torch.cuda.Stream]] = {}

    def to_host(self, blocks: Sequence[Block], buffer: torch.Tensor) -> None:
        self._copy(blocks, buffer, to_host=True)

    def to_device(self, blocks: Sequence[Block], buffer: torch.Tensor) -> None:
        self._copy(blocks, buffer, to_host=False)

    def _copy(self, blocks: Sequence[Block], buffer: torch.Tensor, *, to_host: bool) -> None:
        for device, group in _by_device(blocks).items():
            if device.type == "cuda":
                self._cuda_copy(device, group, buffer, to_host=to_host)
                continue
            for block in group:
                src, dst = _ends(block, buffer, to_host=to_host)
                for start in range(0, block.nbytes, self._chunk_bytes):
                    stop = start + self._chunk_bytes
                    dst[start:stop].copy_(src[start:stop])

    def _cuda_copy(
        self, device: torch.device, blocks: Sequence[Block], buffer: torch.Tensor, *, to_host: bool
    ) -> None:
        streams = self._side_streams(device)
        with torch.cuda.device(device):
            # Training may have queued work on any stream that still reads or
            # writes these storages (or, for a restore, on memory just handed back
            # by the caching allocator); wait for all of it, once per switch.
            torch.cuda.synchronize(device)
            turn = 0
            for block in blocks:
                src, dst = _ends(block, buffer, to_host=to_host)
                for start in range(0, block.nbytes, self._chunk_bytes):
                    stop = start + self._chunk_bytes
                    # Alternate streams so that consecutive chunks overlap.
                    with torch.cuda.stream(streams[turn % len(streams)]):
                        dst[start:stop].copy_(src[start:stop], non_blocking=True)
                    turn += 1
            # The host buffer is reused and device memory may be freed right after;
            # neither is safe before the copies have landed.
            for stream in streams:
                stream.synchronize()

    def _side_streams(self, device: torch.device) -> list[torch.cuda.Stream]:
        if device not in self._streams:
            self._streams[device] = [
                torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call,unused-ignore]
                for _ in range(self._streams_per_device)
            ]
        return self._streams[device]


def _ends(
    block: Block, buffer: torch.Tensor, *, to_host: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, destination) byte views between a storage and its slot in ``buffer``."""
    device_bytes = block.byte_view()
    host_bytes = buffer[block.host_offset : block.host_offset + block.nbytes]
    return (device_bytes, host_bytes) if to_host else (host_bytes, device_bytes)


def _by_device(blocks: Iterable[Block]) -> dict[torch.device, list[Block]]:
    grouped: dict[torch.device, list[Block]] = {}
    for block in blocks:
        grouped.setdefault(block.device, []).append(block)
    return grouped


def align(offset: int) -> int:
    return -(-offset // SLOT_ALIGN) * SLOT_ALIGN


def storage_key(tensor: torch.Tensor) -> tuple[torch.device, int]:
    return tensor.device, tensor.untyped_storage().data_ptr()


def empty_device_caches(plans: Iterable[Sequence[Block]]) -> None:
    # Freed CUDA storages go back to this process's caching allocator; another
    # job (another process) can use the memory only once it is handed back to
    # the driver.
    devices = {block.device for blocks in plans for block in blocks if block.device.type == "cuda"}
    for device in devices:
        with torch.cuda.device(device):
            torch.cuda.empty_cache()


def on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Make ``device`` current for allocations on it (a no-op off CUDA)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def free(block: Block) -> None:
    for alias in block.aliases:
        alias.tensor.data = torch.empty(0, dtype=alias.dtype, device=block.device)
    block.storage.resize_(0)


def allocate(blocks: Sequence[Block]) -> None:
    done: list[Block] = []
    try:
        for block in blocks:
            with on_device(block.device):
                block.storage.resize_(block.nbytes)
            done.append(block)
    except BaseException:
        for block in done:
            block.storage.resize_(0)
        raise


def repoint(block: Block) -> None:
    for alias in block.aliases:
        alias.tensor.data = torch.empty(0, dtype=alias.dtype, device=block.device).set_(
            block.storage, alias.storage_offset, alias.size, alias.stride
        )


def block_for(
    name: str, tensor: torch.Tensor, seen: dict[tuple[torch.device, int], Block]
) -> Block | None:
    """Record ``tensor`` under its storage's block in ``seen``; the block if it is new."""
    if tensor.layout != torch.strided:
        raise ValueError(f"{name} has layout {tensor.layout}; only strided tensors can move")
    if tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0:
        return None
    key = storage_key(tensor)
    block = seen.get(key)
    if block is not None:
        block.aliases.append(Alias.of(name, tensor))
        return None
    if not storage.resizable():
        raise ValueError(
            f"{name} uses memory that torch cannot free (e.g. torch.from_numpy or "
            "shared memory); allocate it with torch instead"
        )
    block = Block(
        storage=storage, device=tensor.device, nbytes=nbytes, aliases=[Alias.of(name, tensor)]
    )
    seen[key] = block
    return block


@dataclasses.dataclass(frozen=True)
class HostCopy:
    """A resident storage whose bytes its tag's host buffer still holds since a restore."""

    host_offset: int
    nbytes: int
    buffer_ptr: int
    #: ``(id(tensor), tensor._version)`` of every tensor viewing the storage then.
    versions: frozenset[tuple[int, int]]


def _versions(block: Block) -> frozenset[tuple[int, int]]:
    return frozenset((id(a.tensor), int(a.tensor._version)) for a in block.aliases)


class HostCopies:
    """What each tag's host buffer still holds unchanged since the tag's last restore.

    A storage counts as held while it is the same storage (address), at the same slot of
    the same buffer, and none of its tensors' version counters moved (any in-place
    operation bumps them; writes through ``.data`` do not, see ``mark_changed``).
    """

    def __init__(self) -> None:
        self._by_tag: dict[str, dict[tuple[torch.device, int], HostCopy]] = {}

    def remember(self, tag: str, blocks: Sequence[Block], buffer: torch.Tensor) -> None:
        self._by_tag[tag] = {
            (block.device, block.storage.data_ptr()): HostCopy(
                host_offset=block.host_offset,
                nbytes=block.nbytes,
                buffer_ptr=buffer.data_ptr(),
                versions=_versions(block),
            )
            for block in blocks
        }

    def forget(self, tag: str) -> None:
        self._by_tag.pop(tag, None)

    def unchanged(self, tag: str, block: Block, buffer: torch.Tensor) -> bool:
        known = self._by_tag.get(tag, {}).get((block.device, block.storage.data_ptr()))
        return (
            known is not None
            and known.host_offset == block.host_offset
            and known.nbytes == block.nbytes
            and known.buffer_ptr == buffer.data_ptr()
            and known.versions == _versions(block)
        )
