"""The engine's native CPU kernels (engine_cpu.cpp and the parts it includes), compiled for this
machine's CPU on first use and cached; `native()` is None where they cannot be built (no C++ compiler, a failed
build, or SPECDEC_NATIVE_KERNELS=0), and the engine then runs torch ops instead."""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
from pathlib import Path

from specdec.core.hub import cache_dir

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent
MODULE_SOURCE = "engine_cpu.cpp"  # the translation unit; it includes the other parts
SOURCE_SUFFIXES = (".cpp", ".h")  # what a kernel source file's name ends with


def sources() -> dict[str, str]:
    """The kernels' source files by name: the module and every part it includes."""
    return {path.name: path.read_text() for path in sorted(KERNEL_DIR.iterdir()) if path.suffix in SOURCE_SUFFIXES}


def fingerprint(texts: dict[str, str]) -> str:
    """One hash of a set of kernel sources (names and texts)."""
    digest = hashlib.sha256()
    for name in sorted(texts):
        digest.update(f"{name}\0{texts[name]}\0".encode())
    return digest.hexdigest()


# What build(emulate=...) can emulate: AVX-512 with VNNI through SIMDe's headers (the simde-py
# package, a test dependency), AMX's tiles in plain C++.
EMULATED = {"avx512": "-DSPECDEC_SIMDE", "amx": "-DSPECDEC_EMULATE_AMX"}


def _flags(march: str, emulate: tuple[str, ...] = ()) -> list[str]:
    """No fused multiply-add the source did not write."""
    # an emulated build checks results, not speed: -O1 compiles SIMDe's headers in a fraction of -O3's time
    flags = ["-O1" if "avx512" in emulate else "-O3", f"-march={march}", "-ffp-contract=off", "-fopenmp"]
    for isa in emulate:
        flags.append(EMULATED[isa])
        if isa == "avx512":
            import simde_py

            flags.append(f"-I{simde_py.get_include()}")
    return flags


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


@functools.cache
def native():
    """The compiled kernel module, or None (with the reason logged once)."""
    if os.environ.get("SPECDEC_NATIVE_KERNELS", "1") == "0":
        return None
    try:
        return build(sources())
    except Exception as err:  # no compiler, no ninja, a failed build: the torch ops still work
        log.warning("native engine kernels unavailable, running torch ops instead: %s", err)
        return None


def build(texts: dict[str, str], march: str = "native", emulate: tuple[str, ...] = ()):
    """The kernels compiled from `texts` (every source file by name, as sources() gives) for `march` (GCC's
    -march: the CPU it runs on by default; "x86-64" gives the scalar paths, "x86-64-v3" the AVX2
    ones, for tests on a CPU that has more), built once per set of sources, compiler flags and CPU
    (-march=native code must not move to a CPU without the same instructions) and cached; a
    module of its own, so builds of two versions load side by side (scripts/kernel_ab.py).
    `emulate` names instruction sets (EMULATED) built without the CPU's help, so their paths run,
    and are tested, on any x86 CPU."""
    from torch.utils.cpp_extension import load

    flags = _flags(march, emulate)
    key = hashlib.sha256(f"{fingerprint(texts)}{flags}{_cpu_flags()}".encode()).hexdigest()[:12]
    directory = cache_dir() / "kernels" / key
    directory.mkdir(parents=True, exist_ok=True)
    # torch guards a build with a lock file that a killed build leaves behind, and then every
    # later load waits on it forever. An flock dies with its process: hold one, and clear
    # torch's file under it.
    with open(directory / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        for name, text in texts.items():
            copy = directory / name
            if not copy.exists() or copy.read_text() != text:
                copy.write_text(text)
        return load(name=f"specdec_engine_cpu_{key}", sources=[str(directory / MODULE_SOURCE)], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
