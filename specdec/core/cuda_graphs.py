"""LlamaEngine on a GPU: every pass but a prompt's prefill replays a captured CUDA graph.

Speed: a small model's eager step is ~30 layers x ~20 kernels launched one by one from
Python (~21 ms a token for SmolLM2-135M on an H100, whatever k); a graph launches them all at once.

Exactness: cuBLAS chooses its GEMM kernel by shape, and kernels sum in different orders, so
eagerly a k-row tree pass and a one-row step can give a token different logits (0.375 apart at
k = 33). Here every pass has the same shape: its rows are padded to a row bucket (longer feeds
run in several passes) and its keys sit in a buffer of a fixed capacity (256, 512, ...
positions, the unused tail masked). Each row of a linear then comes from the same kernel whatever
the other rows hold, so a row's result depends on its own token, position and mask alone.
Attention runs in float64 over those buffers: bf16 products are exact there and what rounding
is left (~1e-16) sits far below the bf16 the result is rounded to, so a row's attention does
not depend on the capacity either. tests/test_cuda_graphs.py compares tree passes with one-token
steps bit for bit, captured on a GPU (all pass on an H100; its CUDA cases skip without a GPU, and
the same runner, uncaptured, passes them on a CPU); scripts/gpu_engine.py measures exactness and
the cost curve (docs/engine.md).
"""
from __future__ import annotations

import os

import torch

# Rows of every pass. One bucket: every pass runs the same GEMM shapes, exact by construction
# (a one-token step costs a 16-row pass, nothing to a GPU). Several buckets are faster for long
# feeds but exact only if cuBLAS sums their rows alike: scripts/gpu_engine.py checks a set.
ROW_BUCKETS = (16,)
MIN_CAPACITY = 256  # key/value positions of the smallest buffer; each next one doubles


def row_buckets() -> tuple[int, ...]:
    """The row buckets in use: SPECDEC_CUDA_ROW_BUCKETS ("16" or "16,64") or ROW_BUCKETS."""
    text = os.environ.get("SPECDEC_CUDA_ROW_BUCKETS", "")
    buckets = tuple(sorted({int(b) for b in text.split(",") if b.strip()})) or ROW_BUCKETS
    if buckets[0] < 1:
        raise ValueError(f"SPECDEC_CUDA_ROW_BUCKETS must be positive integers, got {text!r}")
    return buckets


def row_chunks(count: int, buckets: tuple[int, ...]) -> list[tuple[int, int]]:
    """How `count` new rows run: (real rows, bucket) per pass, in order. Full passes of the
    largest bucket, then the rest padded to the smallest bucket that holds it."""
    largest = buckets[-1]
    chunks = [(largest, largest)] * ((count - 1) // largest)
    rest = count - largest * len(chunks)
    return chunks + [(rest, next(b for b in buckets if b >= rest))]


def capacity_for(end: int) -> int:
    """The key/value buffer a pass writing up to position `end` (exclusive) runs over."""
    capacity = MIN_CAPACITY
    while capacity < end:
        capacity *= 2
    return capacity


def cuda_graphs_enabled() -> bool:
    """On unless SPECDEC_CUDA_GRAPHS=0 (the eager path, to compare with)."""
    return os.environ.get("SPECDEC_CUDA_GRAPHS", "1") != "0"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """q (B, heads, d) over float64 keys/values (kv_heads, C, d); blocked (groups * B, C):
    True where a query may not look. The engine's float64 attention with a mask given."""
    kv_heads, _, dim = keys.shape
    count, heads = q.shape[0], q.shape[1]
    queries = q.double().permute(1, 0, 2).reshape(kv_heads, heads // kv_heads * count, dim)
    scores = torch.bmm(queries, keys.transpose(1, 2)) * dim**-0.5
    scores.masked_fill_(blocked, float("-inf"))
    out = torch.bmm(torch.softmax(scores, dim=-1), values)
    return out.view(heads, count, dim).transpose(0, 1)


def _fixed_pass(engine, ids, cos, sin, write, mask, keys, values) -> tuple[torch.Tensor, torch.Tensor]:
    """The captured work: rows `ids` (B,) at rotary cos/sin (B, 1, d), their keys and values
    written at positions `write` (B,) of the float64 buffers [layers, kv_heads, C, d],
    attending under `mask` (B, C). Returns the logits (B, vocab) float32 and the residual
    stream at every depth (layers + 1, B, H), the last after the final norm."""
    count = ids.shape[0]
    heads, kv_heads, dim = engine.num_heads, engine.num_kv_heads, engine.head_dim
    blocked = ~mask.repeat(heads // kv_heads, 1)  # query rows are stacked head group by head group
    x = engine.embed(ids)
    states = [x]
    for index, block in enumerate(engine.layers):
        q, k, v = block.qkv(block.input_norm(x)).split([engine.q_size, engine.kv_size, engine.kv_size], dim=-1)
        q = _rotate(q.view(count, heads, dim), cos, sin)
        k = _rotate(k.view(count, kv_heads, dim), cos, sin)
        keys[index].index_copy_(1, write, k.transpose(0, 1).double())
        values[index].index_copy_(1, write, v.view(count, kv_heads, dim).transpose(0, 1).double())
        attended = _attention(q, keys[index], values[index], blocked)
        x = x + block.o(attended.reshape(count, engine.q_size).to(x.dtype))
        gate, up = block.gate_up(block.post_norm(x)).split(engine.intermediate, dim=-1)
        x = x + block.down(torch.nn.functional.silu(gate) * up)
        states.append(x)
    states[-1] = engine.norm(x)
    return engine.lm_head(states[-1]).float(), torch.stack(states)


class _Graph:
    """One captured pass of `rows` rows over the key/value buffers of one capacity, with its
    static inputs (written before each replay) and outputs (read after it). Without `capture`
    (a CPU, in tests) a replay runs the pass eagerly."""

    def __init__(self, engine, rows: int, keys: torch.Tensor, values: torch.Tensor, capture: bool = True):
        device, capacity = engine.device, keys.shape[2]
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.cos = torch.zeros(rows, 1, engine.head_dim, dtype=engine.dtype, device=device)
        self.sin = torch.zeros_like(self.cos)
        self.write = torch.arange(rows, device=device)
        self.columns = torch.arange(capacity, device=device)
        self.mask = self.columns[None] <= self.write[:, None]
        self.args = args = (engine, self.ids, self.cos, self.sin, self.write, self.mask, keys, values)
        self.graph = None
        if not capture:
            return
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up runs before capture, as torch's CUDA graph notes ask
            for _ in range(2):
                _fixed_pass(*args)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: a service's other threads may touch CUDA while its compute thread captures.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.logits, self.states = _fixed_pass(*args)

    def replay(self) -> None:
        if self.graph is None:
            self.logits, self.states = _fixed_pass(*self.args)
        else:
            self.graph.replay()


class GraphRunner:
    """Runs LlamaEngine forwards (not prefills, not steered ones) as graph replays. Sessions keep
    their own bf16 caches; before a pass the cached rows are copied into the float64 buffer of
    the pass's capacity (one copy per tensor), and the new rows are copied back after it."""

    def __init__(self, engine, buckets: tuple[int, ...] | None = None):
        self.engine = engine
        self.buckets = buckets or row_buckets()
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # capacity -> float64 keys, values
        self.graphs: dict[tuple[int, int], _Graph] = {}  # (rows, capacity) -> graph, captured when first needed

    def _graph(self, rows: int, capacity: int) -> _Graph:
        if capacity not in self.buffers:
            e = self.engine
            shape = (len(e.layers), e.num_kv_heads, capacity, e.head_dim)
            # Zeros: a masked key or value is still multiplied by its zero weight, and must not be NaN.
            self.buffers[capacity] = (torch.zeros(shape, dtype=torch.float64, device=e.device),
                                      torch.zeros(shape, dtype=torch.float64, device=e.device))
        if (rows, capacity) not in self.graphs:
            self.graphs[rows, capacity] = _Graph(self.engine, rows, *self.buffers[capacity], capture=self.engine.device.type == "cuda")
        return self.graphs[rows, capacity]

    def forward(self, call, depths: tuple[int, ...]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """What LlamaEngine.forward returns for `call` (its cache reserved), the residual stream
        read at `depths` (depths_of its hidden_states)."""
        with torch.inference_mode():
            engine, cache, device = self.engine, call.cache, self.engine.device
            count, start = len(call.input_ids), cache.length
            positions = torch.arange(start, start + count) if call.position_ids is None else call.position_ids[0].cpu()
            mask = None if call.attention_mask is None else call.attention_mask[0, 0].to(device)
            depths = list(depths)
            first_logit = count - call.num_logits
            logits, states, done = [], [], 0
            for rows, bucket in row_chunks(count, self.buckets):
                at = start + done  # the cache's length before this pass
                graph = self._graph(bucket, capacity_for(at + bucket))
                padding = bucket - rows  # padded rows: token 0 at rotary position 0, written after the real rows, causal
                graph.ids.copy_(torch.tensor(call.input_ids[done : done + rows] + [0] * padding), non_blocking=True)
                # Positions stay on the CPU: the table reads their maximum, which on the GPU would wait for it.
                cos, sin = engine.rotary_rows(torch.cat([positions[done : done + rows], torch.zeros(padding, dtype=torch.long)]))
                graph.cos.copy_(cos[:, None])
                graph.sin.copy_(sin[:, None])
                graph.write.copy_(torch.arange(at, at + bucket), non_blocking=True)
                torch.le(graph.columns[None], graph.write[:, None], out=graph.mask)
                if mask is not None:
                    graph.mask[:rows, : at + rows] = mask[done : done + rows, : at + rows]
                keys, values = self.buffers[graph.mask.shape[1]]
                keys[:, :, :at].copy_(cache.keys[:, :, :at])
                values[:, :, :at].copy_(cache.values[:, :, :at])
                graph.replay()
                cache.keys[:, :, at : at + rows].copy_(keys[:, :, at : at + rows])  # bf16 values widened: exact back
                cache.values[:, :, at : at + rows].copy_(values[:, :, at : at + rows])
                if first_logit < done + rows:
                    logits.append(graph.logits[max(first_logit - done, 0) : rows].clone())
                if depths:
                    states.append(graph.states[depths, :rows].clone())
                done += rows
            cache.length = start + count
            read = torch.cat(states, dim=1) if depths else None
            return torch.cat(logits), None if read is None else tuple(read[i][None] for i in range(len(depths)))
