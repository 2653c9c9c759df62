"""What ``inflight serve``'s start-up checks read through transformers' config classes, which
import torch: the tokenizer class ``AutoTokenizer`` chooses, the positions the model supports
(its architecture must be one we serve), and a draft model's fit beside it.

The engine-core process reads them while it prewarms (it imports torch anyway) and sends them
to the front end (``protocol.Prewarmed``), so the front end, which tokenizes, renders
templates and speaks HTTP, never imports torch and is up in a fraction of the time;
``--single-process`` reads them in place. Each problem is a one-line ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.runtime.config import EngineConfig


@dataclass(frozen=True, slots=True)
class ServedFacts:
    tokenizer_class: str  # the class AutoTokenizer chose, as tokenizer.tokenizer_class_path
    max_position_embeddings: int  # as the runner caps it (attention enforces a sliding window)


def load_checked_tokenizer(model_dir: Path, tokenizer_class: str | None = None) -> Any:
    """``model_dir``'s tokenizer (``tokenizer.load_tokenizer``); one that does not load is a
    ``ValueError`` saying so."""
    from inflight.runtime.tokenizer import load_tokenizer

    try:
        return load_tokenizer(model_dir, tokenizer_class)
    except Exception as exc:  # transformers raises many kinds; all mean the same to the user
        raise ValueError(f"the tokenizer in {model_dir} does not load: {exc}") from exc


def read_served_facts(served: Path, config: EngineConfig) -> tuple[ServedFacts, Any]:
    """The facts of the directory to serve and its tokenizer, loaded as ``AutoTokenizer`` does.
    ``ValueError``: a tokenizer that does not load, an architecture or setting we do not serve,
    a configured draft model that cannot serve beside it (``draft_checks``)."""
    from inflight.runtime.model.loader import load_hf_config
    from inflight.runtime.model.spec import spec_from_hf_config
    from inflight.runtime.spec_decode.draft_checks import check_draft_model, draft_model_dir
    from inflight.runtime.tokenizer import tokenizer_class_path

    tokenizer = load_checked_tokenizer(served)
    spec = spec_from_hf_config(load_hf_config(served))
    from inflight.runtime.core.state_pool import hybrid_refusal

    refusal = hybrid_refusal(spec, config)  # a hybrid model's settings, before any weight loads
    if refusal is not None:
        raise ValueError(refusal)
    from inflight.runtime.model.mla_kv import check_mla_engine

    check_mla_engine(spec, config.kv_cache_dtype, config.enable_lora)  # DeepSeek-V3's, before any weight loads
    if draft_model_dir(config) is not None:
        check_draft_model(served, config)
    from inflight.runtime.spec_decode.eagle3_head import check_eagle3_head, eagle3_head_dir

    if eagle3_head_dir(config) is not None:
        check_eagle3_head(served, config)  # the head's config against the served model's (no weights read)
    from inflight.runtime.spec_decode.mtp_head import check_mtp

    check_mtp(served, config)  # method mtp: the served model's MTP layers, in its config and tensor names
    return ServedFacts(tokenizer_class_path(tokenizer), spec.max_position_embeddings), tokenizer
