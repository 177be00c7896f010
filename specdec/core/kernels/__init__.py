"""The engine's native CPU kernels (engine_cpu.cpp), compiled for this machine's CPU on first
use and cached; `native()` is None where they cannot be built (no C++ compiler, a failed
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

_SOURCE = Path(__file__).with_name("engine_cpu.cpp")
# Built for the CPU it runs on; no fused multiply-add the source did not write.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]


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
        from torch.utils.cpp_extension import load

        # One build per source text, compiler flags and CPU: -march=native code must not move
        # to a CPU without the same instructions.
        key = hashlib.sha256(f"{_SOURCE.read_text()}{_FLAGS}{_cpu_flags()}".encode()).hexdigest()[:12]
        build = cache_dir() / "kernels" / key
        build.mkdir(parents=True, exist_ok=True)
        # torch guards a build with a lock file that a killed build leaves behind, and then
        # every later load waits on it forever. An flock dies with its process: hold one, and
        # clear torch's file under it.
        with open(build / "build.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (build / "lock").unlink(missing_ok=True)
            return load(name=f"specdec_engine_cpu_{key}", sources=[str(_SOURCE)], extra_cflags=_FLAGS,
                        extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except Exception as err:  # no compiler, no ninja, a failed build: the torch ops still work
        log.warning("native engine kernels unavailable, running torch ops instead: %s", err)
        return None

