"""Parked tags that go to files on local disk instead of host memory (the spill tier).

Why: host memory is a budget (DESIGN.md invariant 8), and a parked state beyond it must
go somewhere other than the OOM killer's reach. A TorchAdapter given ``spill_dir`` and
``host_budget_bytes`` keeps its host buffers within that budget; a tag that does not fit
is copied into a file instead: a file-backed mapping (``torch.from_file(shared=True)``)
stands where the host buffer would, so the same chunked copies write it and read it
back, bit for bit. The file is flushed to disk (``fsync``) and its pages are dropped
from the page cache, so it holds no memory while parked; it is deleted once the tag is
restored. The cuda backend cannot spill: the driver keeps a checkpointed process's state
inside that process.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import torch


class SpillFiles:
    """One file per spilled tag in ``directory``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._prefix = f"tslice-{os.getpid()}-{id(self):x}"
        self._files: dict[str, tuple[Path, torch.Tensor]] = {}

    def holds(self, tag: str) -> bool:
        return tag in self._files

    def buffer(self, tag: str, nbytes: int) -> torch.Tensor:
        """A file-backed byte tensor of ``nbytes`` for ``tag`` (a new, empty file)."""
        self.drop(tag)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", tag)
        path = self.directory / f"{self._prefix}-{safe}.spill"
        with path.open("wb") as file:
            file.truncate(nbytes)
        tensor = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        self._files[tag] = (path, tensor)
        return tensor

    def get(self, tag: str) -> torch.Tensor:
        return self._files[tag][1]

    def flush(self, tag: str) -> None:
        """Write the tag's file to disk and drop its pages from the page cache."""
        path = self._files[tag][0]
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            with contextlib.suppress(AttributeError, OSError):  # not on every platform
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def drop(self, tag: str) -> None:
        entry = self._files.pop(tag, None)
        if entry is not None:
            path, tensor = entry
            del tensor
            path.unlink(missing_ok=True)

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() for _, tensor in self._files.values())

    def close(self) -> None:
        for tag in list(self._files):
            self.drop(tag)
