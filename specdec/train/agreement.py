"""How closely a student drafter follows its teacher along teacher text: greedy agreement,
sampling acceptance and accepted tokens per verify call, optionally under SD² steering."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from specdec.core.steering import DrafterSteering, VerifierSteering, cycled_offsets, gather_steering, round_offsets
from specdec.train.samples import Sample, batch_tensors

def student_full_logp(student_logits: torch.Tensor, vocab_ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    logp = student_logits.float().log_softmax(-1)
    if vocab_ids is None:
        return logp
    full = torch.full((*logp.shape[:-1], vocab), float("-inf"))
    full[..., vocab_ids] = logp
    return full


@dataclass
class SteeringPair:
    verifier: VerifierSteering
    drafter: DrafterSteering
    max_offset: int

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.verifier.parameters()) + list(self.drafter.parameters())


@contextmanager
def steered(steering: SteeringPair | None, hidden_states, mask: torch.Tensor, offsets: tuple[torch.Tensor, torch.Tensor] | None):
    """Student forwards inside are steered by the teacher's hidden states, each position from
    its offset source position (see steering.sample_offsets)."""
    if steering is None:
        yield
        return
    source, present = offsets
    vectors = steering.verifier(hidden_states)
    with steering.drafter.steer(gather_steering(vectors, source), present & mask.bool()):
        yield


@torch.inference_mode()
def evaluate(
    student, teacher, samples: list[Sample], pad: int, vocab_ids, steering: SteeringPair | None = None, depth: int = 4, batch: int = 8
) -> dict:
    """Agreement, acceptance and accepted tokens per verify call along teacher greedy text.
    Steered, each position reads the vector from o = 1..k positions back, cycling, as in
    rounds of k drafts. `by_offset` splits agreement and acceptance by o (for an unsteered
    drafter, by the same cycle of positions, so the two compare): in a live round the first
    drafts weigh most."""
    agree, accept, positions = 0.0, 0.0, 0
    cycle = steering.max_offset if steering else depth
    by_offset = torch.zeros(3, cycle)  # agreement, acceptance, positions
    accepted_per_call: list[int] = []
    for start in range(0, len(samples), batch):
        chunk = samples[start : start + batch]
        ids, mask, loss_mask = batch_tensors(chunk, pad)
        out = teacher(input_ids=ids, attention_mask=mask, output_hidden_states=steering is not None)
        p_logp = out.logits.float().log_softmax(-1)
        offsets = cycled_offsets(*ids.shape, steering.max_offset) if steering else None
        with steered(steering, out.hidden_states, mask, offsets):
            q_logp = student_full_logp(student(input_ids=ids, attention_mask=mask).logits, vocab_ids, p_logp.shape[-1])
        matches = (p_logp.argmax(-1) == q_logp.argmax(-1)) & loss_mask
        overlap = torch.minimum(p_logp.exp(), q_logp.exp()).sum(-1) * loss_mask
        agree += float(matches.sum())
        accept += float(overlap.sum())
        positions += int(loss_mask.sum())
        column_offset = round_offsets(ids.shape[1], cycle) - 1  # the offset each column was steered from, less one
        for i, per_position in enumerate((matches.float(), overlap, loss_mask.float())):
            by_offset[i].index_add_(0, column_offset, per_position.sum(0))
        for row in range(len(chunk)):
            hits = matches[row][loss_mask[row]].tolist()
            t = 0
            while t < len(hits):  # greedy rounds: drafts are accepted while they match
                run = 0
                while run < depth and t + run < len(hits) and hits[t + run]:
                    run += 1
                accepted_per_call.append(run)
                t += run + 1
    return {
        "greedy_agreement": agree / positions,
        "sampling_acceptance_t1": accept / positions,
        f"accepted_per_verify_call_depth{depth}": sum(accepted_per_call) / len(accepted_per_call),
        "positions": positions,
        "by_offset": {
            str(o + 1): {
                "greedy_agreement": float(by_offset[0, o] / by_offset[2, o]),
                "sampling_acceptance_t1": float(by_offset[1, o] / by_offset[2, o]),
                "positions": int(by_offset[2, o]),
            }
            for o in range(cycle)
            if by_offset[2, o] > 0
        },
    }
