"""What a running, idle Ray stack costs the kernels on this machine: a config's drafter and verifier
in two processes of their own, taking turns as served rounds do (`--draft-passes` one-token drafter
passes, then one verifier pass of draft-passes + 1 tokens), while every process of the local Ray
instance (raylet, GCS, agents, Serve's controller, proxy and replicas) is stopped and resumed
every half second. Each pass counts as "stopped" or "running" by the state it ran through, so the
two are paired in time and the machine's drift hits both alike. `--renice N` first sets every one
of those processes to niceness N (and leaves them there): whether Ray's processes cost less at a
lower priority than the passes' (nice 0). Start a stack first:

    specdec serve --config deploy/qwen2.5-coder-0.5b.yaml &
    .venv/bin/python scripts/idle_stack_cost.py --config deploy/qwen2.5-coder-0.5b.yaml --seconds 30
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import signal
import statistics
import subprocess
import time
from pathlib import Path

RAY_PROCESSES = "ray::|raylet|gcs_server|dashboard|log_monitor|autoscaler|specdec serve"
CONTEXT = 200


def take_turns(role: str, config: str, draft_passes: int, seconds: float, link, results) -> None:
    """One side of the rounds: (start, end) of each of its passes go to `results`."""
    import torch

    from specdec.core.engine import engine_for
    from specdec.core.models import load_model
    from specdec.serving.config import load_config

    spec = getattr(load_config(config), role).model
    model = load_model(spec)
    engine = engine_for(model, model.weight_format)
    sizes = [1] * draft_passes if role == "drafter" else [draft_passes + 1]
    ids = [(7 + 31 * i) % model.config.vocab_size for i in range(CONTEXT)]
    passes = []
    with torch.inference_mode():
        cache = engine.new_cache()
        engine(cache, ids, prefill=True)
        link.send("ready")
        link.recv()
        ends = time.time() + seconds
        while True:
            if role == "verifier" and link.recv() == "stop":
                break
            for k in sizes:
                cache.truncate(CONTEXT)
                start = time.time()
                engine(cache, ids[-k:], num_logits=k)
                passes.append((start, time.time()))
            if role == "verifier":
                link.send("go")
            elif time.time() > ends:
                link.send("stop")
                break
            else:
                link.send("go")
                link.recv()
    results.put((role, passes))


def each_alive(pids: list[int], act) -> None:
    """act(pid) for each of `pids`, skipping those that have ended."""
    for pid in pids:
        try:
            act(pid)
        except ProcessLookupError:
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML config whose drafter and verifier models take turns")
    parser.add_argument("--draft-passes", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--renice", type=int, default=None, metavar="N", help="set every Ray process to niceness N first")
    parser.add_argument("--out", default="runs/idle_stack_cost.json")
    args = parser.parse_args()
    from specdec.core.ngram import is_model_free
    from specdec.serving.config import load_config

    drafter = load_config(args.config).drafter.model.source
    if is_model_free(drafter):
        raise SystemExit(f"{args.config}: its drafter ({drafter}) runs no model; name a config whose drafter is one")
    found = subprocess.run(["pgrep", "-f", RAY_PROCESSES], capture_output=True, text=True).stdout.split()
    pids = [int(p) for p in found if int(p) != os.getpid()]
    if not pids:
        raise SystemExit("no Ray processes on this machine: start a stack first (specdec serve)")
    if args.renice is not None:
        each_alive(pids, lambda pid: os.setpriority(os.PRIO_PROCESS, pid, args.renice))
    drafter_end, verifier_end = multiprocessing.Pipe()
    results = multiprocessing.Queue()
    sides = [multiprocessing.Process(target=take_turns, args=(role, args.config, args.draft_passes, args.seconds, end, results))
             for role, end in (("drafter", drafter_end), ("verifier", verifier_end))]
    for side in sides:
        side.start()
    stopped, changes, passes = False, [], {}
    try:
        while len(passes) < 2:
            try:
                role, times = results.get(timeout=0.5)
                passes[role] = times
            except queue.Empty:
                stopped = not stopped
                each_alive(pids, lambda pid: os.kill(pid, signal.SIGSTOP if stopped else signal.SIGCONT))
                changes.append((time.time(), stopped))
    finally:
        each_alive(pids, lambda pid: os.kill(pid, signal.SIGCONT))
    for side in sides:
        side.join()

    def state(start: float, end: float) -> bool | None:
        """Whether Ray was stopped through the whole pass; None where it changed during it."""
        now = None
        for at, value in changes:
            if at <= start:
                now = value
            elif at < end:
                return None
        return now

    report = {"config": args.config, "draft_passes": args.draft_passes, "ray_processes": len(pids), "renice": args.renice}
    for role, times in passes.items():
        by_state = {True: [], False: []}
        for start, end in times:
            if (s := state(start, end)) is not None:
                by_state[s].append((end - start) * 1e3)
        stopped_ms, running_ms = statistics.median(by_state[True]), statistics.median(by_state[False])
        report[role] = {"ray_stopped_ms": stopped_ms, "ray_running_ms": running_ms, "running_over_stopped": running_ms / stopped_ms,
                        "passes": [len(by_state[True]), len(by_state[False])]}
        print(f"{role}: Ray stopped {stopped_ms:.2f} ms, running {running_ms:.2f} ms: {running_ms / stopped_ms:.3f}x "
              f"({len(by_state[True])} and {len(by_state[False])} passes)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
