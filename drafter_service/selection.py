"""Which drafter serves a drafter model source."""
from __future__ import annotations

from drafter_service.drafting_sessions import DraftingSessions
from drafter_service.cross_tokenizer_drafter import CrossTokenizerDrafter
from drafter_service.drafting import Drafter
from drafter_service.feature_drafter import FeatureDrafter
from drafter_service.hybrid_drafter import HybridDrafter
from drafter_service.model_drafter import ModelDrafter
from drafter_service.ngram_drafter import NgramDrafter
from drafter_service.oracle_drafter import OracleDrafter
from drafter_service.tokenizer_bridge import TokenizerBridge
from specdec.core.feature_head import is_feature_head
from specdec.core.models import ModelSpec, load_tokenizer
from specdec.core.ngram import NGRAM_METHODS, NgramProposer, NgramSettings, OwnChoices, is_model_free
from specdec.core.oracle import is_oracle
from specdec.serving.config import LimitsConfig


def drafter_for(
    spec: ModelSpec, proposal_top_k: int = 32, steering_checkpoint: str | None = None, ngram: NgramSettings | None = None,
    staged_lookahead: int = 0, limits: LimitsConfig = LimitsConfig(), verifier_tokenizer: str | None = None,
) -> DraftingSessions:
    """The n-gram drafter (no model) for 'prompt-lookup' or 'suffix', the oracle for a
    benchmark's reference table, else a feature head or a model drafter with n-gram candidates
    on request (hybrid; by default `ngram.method`). Staged speculation (`staged_lookahead`
    tokens guessed per forward) is the model drafter's. With `verifier_tokenizer` (the verifier's
    model source) a model drafter drafts in its own tokens, mapped to the verifier's; hybrid
    drafting then adds n-gram candidates in the verifier's."""
    settings = ngram or NgramSettings()
    methods = {method: NgramProposer(method, settings) for method in NGRAM_METHODS}
    drafter: Drafter
    if is_model_free(spec.source) or is_oracle(spec.source) or is_feature_head(spec.source):
        if steering_checkpoint:
            raise ValueError(f"the '{spec.source}' drafter has no model to steer (SD²); it takes no steering checkpoint")
        if staged_lookahead:
            raise ValueError(f"staged speculation (drafter.staged_lookahead) is the model drafter's, not the '{spec.source}' drafter's")
    if is_model_free(spec.source):
        drafter = NgramDrafter(methods, spec.source)
    elif is_oracle(spec.source):
        drafter = OracleDrafter(spec.source)
    else:
        if is_feature_head(spec.source):
            inner: Drafter = FeatureDrafter(spec, proposal_top_k)
        else:
            # Staged speculation: an n-gram stage guesses the drafter's next tokens, which it checks
            # in the forward it runs anyway; right guesses save forwards, the draft is unchanged.
            memory = settings.recent_output_tokens * len(OwnChoices.ORDERS)
            inner = ModelDrafter(
                spec, proposal_top_k, steering_checkpoint, methods[settings.method or "prompt-lookup"] if staged_lookahead else None,
                staged_lookahead, OwnChoices(memory) if staged_lookahead and memory else None,
            )
            if verifier_tokenizer:
                bridge = TokenizerBridge(load_tokenizer(spec.source), load_tokenizer(verifier_tokenizer))
                inner = CrossTokenizerDrafter(inner, bridge, settings.max_ngram, limits.max_draft_tokens)
        drafter = HybridDrafter(inner, methods, settings.method or "none", settings.fallback)
    return DraftingSessions(drafter, methods, settings.max_ngram, spec.source, limits)
