"""Start-up checks of a draft model (``"method": "draft_model"``) against the served model.

A draft model proposes token ids that the served (target) model verifies, so it must share
the target's vocabulary: the same vocabulary size (its logits index the same ids) and, when
its directory has a tokenizer, the same id for every token of the target's tokenizer (it may
add tokens of its own). Output is right whatever the draft proposes (the target verifies
it); these checks catch a draft that could never be right. It must also support the positions
the engine runs (``max_model_len``). Each problem raises ``ValueError`` with one line saying
what to change, before any weight loads (``inflight serve`` runs the checks in its preflight,
the engine again when it loads). Reads configs and tokenizers only; knows nothing about the
engine.
"""

from __future__ import annotations

import logging
from pathlib import Path

from inflight.runtime.config import EngineConfig
from inflight.runtime.spec_decode.speculative import parse_speculative_config

logger = logging.getLogger("inflight.loading")

# Files whose presence means a directory carries its own tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def draft_model_dir(config: EngineConfig) -> Path | None:
    """The draft model's directory when ``config`` speculates with a draft model, else None."""
    spec = parse_speculative_config(config.speculative_config)
    if spec is None or spec.method != "draft_model":
        return None
    assert spec.model is not None  # SpeculativeConfig requires it for draft_model
    return Path(spec.model).expanduser()


def check_draft_model(model_dir: str | Path, config: EngineConfig) -> int:
    """Raise ``ValueError`` unless the configured draft model can serve beside ``model_dir``;
    returns the ``max_model_len`` both run with (the configured one, else the target's)."""
    from inflight.runtime.model.loader import load_hf_config
    from inflight.runtime.model.spec import spec_from_hf_config

    draft_dir = draft_model_dir(config)
    if draft_dir is None:
        raise ValueError("check_draft_model: the speculative config names no draft model")
    if not draft_dir.is_dir():
        raise ValueError(f'speculative_config "model": {draft_dir} is not a directory (a draft model must be a '
                         "local Hugging Face directory with config.json and safetensors weights)")
    try:
        draft = spec_from_hf_config(load_hf_config(draft_dir))
    except ValueError as exc:
        raise ValueError(f"the draft model in {draft_dir} cannot be served: {exc}") from None
    if draft.state_layers:
        raise ValueError(f"the draft model in {draft_dir} is a hybrid model ({draft.arch}: a recurrent state per "
                         "sequence); a draft model must be a plain decoder (a hybrid served model may take one)")
    target = spec_from_hf_config(load_hf_config(model_dir))
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.vocab_size} tokens, {draft_dir}/config.json) "
                         f"differs from the served model's ({target.vocab_size} tokens): a draft model must "
                         "share the served model's tokenizer")
    max_model_len = config.max_model_len or target.max_position_embeddings
    if max_model_len > draft.max_position_embeddings:
        raise ValueError(f"the draft model supports {draft.max_position_embeddings} positions "
                         f"({draft_dir}/config.json), fewer than max_model_len {max_model_len}; set "
                         f"--max-model-len {draft.max_position_embeddings} or lower")
    _check_tokenizers(Path(model_dir), draft_dir)
    return max_model_len


def _check_tokenizers(model_dir: Path, draft_dir: Path) -> None:
    """The draft's tokenizer, when its directory has one, maps every token as the target's does."""
    if not any((draft_dir / name).is_file() for name in TOKENIZER_FILES):
        logger.info("the draft model in %s has no tokenizer of its own: only its vocabulary size was checked",
                    draft_dir)
        return
    from inflight.runtime.tokenizer import load_tokenizer

    try:
        draft_vocab = load_tokenizer(draft_dir).get_vocab()
    except Exception as exc:  # transformers raises many kinds; all mean the same to the user
        raise ValueError(f"the draft model's tokenizer in {draft_dir} does not load: {exc}") from exc
    target_vocab = load_tokenizer(model_dir).get_vocab()
    differing = sorted((i, t) for t, i in target_vocab.items() if draft_vocab.get(t) != i)
    if differing:  # the draft may know more (added) tokens; every one of the target's must match
        token_id, token = differing[0]
        raise ValueError(f"the draft model's tokenizer ({draft_dir}) differs from the served model's: "
                         f"{len(differing)} of its {len(target_vocab)} tokens have other ids in the draft's (e.g. "
                         f"{token!r}, {token_id} in the served model's, {draft_vocab.get(token)} in the draft's); "
                         "a draft model must share the served model's tokenizer")
