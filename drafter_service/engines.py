"""Which drafting engine serves a drafter model source."""
from __future__ import annotations

from drafter_service.drafter import DrafterEngine
from drafter_service.feature_drafter import FeatureDrafter
from drafter_service.ngram_drafter import NgramDrafter
from drafter_service.oracle_drafter import OracleDrafter
from specdec.core.feature_head import is_feature_head
from specdec.core.models import ModelSpec
from specdec.core.ngram import is_model_free
from specdec.core.oracle import is_oracle


def drafter_for(spec: ModelSpec, *args, **options) -> DrafterEngine:
    """An n-gram drafter (no model) for 'prompt-lookup' or 'suffix', the oracle for a benchmark's
    reference table, a feature head when the source is one, else the model drafter."""
    if is_model_free(spec.source):
        return NgramDrafter(spec, *args, **options)
    if is_oracle(spec.source):
        return OracleDrafter(spec, *args, **options)
    return (FeatureDrafter if is_feature_head(spec.source) else DrafterEngine)(spec, *args, **options)
