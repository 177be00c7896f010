"""Files the training commands write while they run."""
from __future__ import annotations

from pathlib import Path

import torch


def atomic_save(obj, path: Path) -> None:
    """torch.save that a kill mid-write cannot leave half-written: the old file stays until the new one is whole."""
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.rename(path)


def load_or_make(path: Path, settings: dict, make, weights_only: bool = True) -> dict:
    """The dict cached at `path` if it was made with these `settings`, else `make()` (with the
    settings added), saved there first. Sample caches: making them is the slow part of a run."""
    data = torch.load(path, weights_only=weights_only) if path.is_file() else None
    if data is None or data.get("settings") != settings:
        data = make() | {"settings": settings}
        atomic_save(data, path)
    return data
