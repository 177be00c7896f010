"""Conversions between the wire messages and the in-process types."""
from __future__ import annotations

from pathlib import Path

from specdec.core.sampling import Sampling, validate_sampling
from specdec.core.tree import DraftTree, Proposal, TreeShape
from specdec.serving.rpc import invalid
from specdec.v1 import common_pb2

VERIFIER_SERVICE = "specdec.v1.Verifier"
DRAFTER_SERVICE = "specdec.v1.Drafter"
COORDINATOR_SERVICE = "specdec.v1.Coordinator"


def tree_to_proto(tree: DraftTree) -> common_pb2.DraftTree:
    message = common_pb2.DraftTree(token_ids=tree.token_ids, parent=tree.parent)
    for node, proposal in tree.proposals.items():
        message.expanded_nodes.append(node)
        message.proposal.add(token_ids=proposal.token_ids, probs=proposal.probs)
    return message


def tree_from_proto(message: common_pb2.DraftTree) -> DraftTree:
    if len(message.expanded_nodes) != len(message.proposal):
        raise invalid(
            f"tree.expanded_nodes has {len(message.expanded_nodes)} entries but tree.proposal has {len(message.proposal)}"
        )
    proposals = {}
    for node, dist in zip(message.expanded_nodes, message.proposal):
        if node in proposals:
            raise invalid(f"tree.expanded_nodes names node {node} twice")
        proposals[node] = Proposal(list(dist.token_ids), list(dist.probs))
    return DraftTree(list(message.token_ids), list(message.parent), proposals)


def sampling_from_proto(message: common_pb2.SamplingParams, field_prefix: str = "") -> Sampling:
    top_p = message.top_p if message.top_p != 0 else 1.0
    try:
        validate_sampling(message.temperature, top_p, message.top_k)
    except ValueError as err:
        raise invalid(field_prefix + str(err)) from None
    return Sampling(message.temperature, top_p, message.top_k, message.seed)


def model_info(engine, sessions, model_name: str, batcher=None) -> common_pb2.ModelInfo:
    """What a service runs (`engine`: the verifier's engine, or a drafter's DrafterInfo), and its
    load (`sessions`: its SessionStore). A drafter without a model (n-gram) reports no
    tokenizer, vocabulary or context limit: it takes any verifier's token ids."""
    config = engine.model.config if engine.model is not None else None
    prefix = getattr(engine, "prefix", None)  # the verifier's
    return common_pb2.ModelInfo(
        model=model_name,
        vocab_size=engine.vocab_size if config else 0,
        tokenizer_fingerprint=engine.fingerprint,
        eos_token_ids=sorted(engine.eos_ids),
        max_context=engine.max_context if config else 0,
        hidden_size=config.hidden_size if config else 0,
        num_layers=config.num_hidden_layers if config else 0,
        steering_size=engine.steering_size,
        steering_fingerprint=engine.steering_fingerprint,
        verifier_state=engine.verifier_state,
        active_sessions=len(sessions),
        kv_cache_mib=sessions.nbytes() / 2**20,
        resident_mib=resident_mib(),
        forward_passes=batcher.passes if batcher else 0,
        batched_calls=batcher.calls if batcher else 0,
        batched_jobs=batcher.jobs if batcher else 0,
        batch_queue_ms=batcher.queue_ms if batcher else 0.0,
        prefix_hit_tokens=prefix.hit_tokens if prefix else 0,
        prefix_read_tokens=prefix.read_tokens if prefix else 0,
        evicted_sessions=sessions.evicted,
        weight_format=engine.weight_format,
    )


def resident_mib() -> float:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0.0
    return next((int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0.0)


def shape_to_proto(shape: TreeShape) -> common_pb2.TreeShape:
    return common_pb2.TreeShape(
        method=shape.method, branching=shape.branching, width=shape.width, max_depth=shape.max_depth, ngram=shape.ngram
    )


def shape_from_proto(message: common_pb2.TreeShape) -> TreeShape:
    """Empty fields take TreeShape's defaults, except max_depth, where 0 already means 'no cap'."""
    default = TreeShape()
    return TreeShape(
        method=message.method or default.method,
        branching=list(message.branching) or default.branching,
        width=message.width or default.width,
        max_depth=message.max_depth,
        ngram=message.ngram,
    )
