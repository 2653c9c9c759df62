"""Rotary-embedding tables: the (cos, sin) cache per position, computed as transformers does.

We take the inverse frequencies and attention scaling from transformers' own rope
initializers (default, linear, llama3, yarn, longrope) so scaled variants match the reference
exactly. A partial rotary (``spec.rotary_dim``: Phi-3, GLM-4.5) makes tables ``rotary_dim`` wide.
LongRoPE (Phi-3/4-mini) keeps two frequency sets: short for a sequence within
``original_max_position_embeddings``, long past it. Our table is per position: short factors below
that length, long from it on. That equals transformers' ``generate`` for every sequence that stays
within the original length. Past it transformers recomputes the whole sequence with the long set
(``Phi3ForCausalLM.prepare_inputs_for_generation`` drops its cache at the crossing); we do not
re-rotate keys already cached, so a sequence that crosses keeps its first positions' short
rotation (as vLLM does; vLLM switches the whole batch to the long set instead, per step).
M-RoPE (Qwen2-VL, Qwen2.5-VL: ``mrope_section``) splits the frequencies into t/h/w sections,
each rotated by its own position id: :func:`mrope_cos_sin` gathers each token's row of the one
table section by section (a token whose three ids are equal reads the plain row).
"""

from __future__ import annotations

from typing import Any

import torch


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's rotary parameters, the one place they are read. transformers 5 (our floor:
    4.x kept them in ``rope_scaling`` and the scaled variants would silently go unscaled)
    normalizes every checkpoint's keys into ``rope_parameters``."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        raise ValueError("this model config has no rope_parameters: transformers >= 5 is required")
    return dict(params)


def _inv_freq(
    config: Any, head_dim: int, layer_type: str | None = None, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (``head_dim`` is the rotary width) and the cos/sin scaling; ``seq_len``
    picks LongRoPE's long set when past the original length."""
    params = rope_parameters(config)
    if layer_type is not None:  # per-layer-type parameters (Gemma 3: full_attention, sliding_attention)
        params = dict(params[layer_type])
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    extra: dict[str, Any] = {} if layer_type is None else {"layer_type": layer_type}
    if seq_len is not None:
        extra["seq_len"] = seq_len
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **extra)
    return inv_freq.float(), float(scaling)


def build_rope_tables(config: Any, spec: Any, max_position: int) -> torch.Tensor:
    """``[num_tables, max_position, head_dim]``: table 0 for every layer, except that with
    ``spec.local_rope`` (Gemma 3) table 0 is the global layers' and table 1 the sliding
    layers' (``spec.layer_rope_table`` says which a layer reads)."""
    rotary_dim = getattr(spec, "rotary_dim", None) or spec.head_dim
    config = getattr(config, "text_config", None) or config  # a vision-language config: its decoder's
    if not spec.local_rope:
        return build_cos_sin_cache(config, rotary_dim, max_position)[None]
    tables = [build_cos_sin_cache(config, rotary_dim, max_position, kind)
              for kind in ("full_attention", "sliding_attention")]  # fmt: skip
    return torch.stack(tables)


def build_cos_sin_cache(
    config: Any, head_dim: int, max_position: int, layer_type: str | None = None
) -> torch.Tensor:
    """``[max_position, head_dim]`` float32 (``head_dim``: the rotary width): cos of each
    frequency, then sin; LongRoPE's long set from ``original_max_position_embeddings`` on."""
    inv_freq, scaling = _inv_freq(config, head_dim, layer_type)  # [head_dim / 2]
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
    params = rope_parameters(config)
    if layer_type is None and params.get("rope_type") == "longrope":
        original = int(params["original_max_position_embeddings"])
        if max_position > original:
            long_inv_freq, _ = _inv_freq(config, head_dim, seq_len=original + 1)
            freqs[original:] = positions[original:, None] * long_inv_freq[None, :]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


def mrope_sections(config: Any) -> tuple[int, ...] | None:
    """The ``mrope_section`` (t, h, w frequency counts) of a vision-language config, or None."""
    params = rope_parameters(getattr(config, "text_config", None) or config)
    sections = params.get("mrope_section")
    return None if sections is None else tuple(int(s) for s in sections)


def mrope_cos_sin(
    table: torch.Tensor,  # [max_position, rotary_dim]: cos of each frequency, then sin
    positions: torch.Tensor,  # [3, num_tokens] t, h, w position ids
    sections: tuple[int, ...],  # frequencies per axis, summing to rotary_dim / 2
) -> torch.Tensor:  # [num_tokens, rotary_dim]
    """Each token's (cos, sin) row for M-RoPE: frequency ``j`` of section ``s`` at ``positions[s]``
    (transformers' ``Qwen2_5_VLRotaryEmbedding``, for ``rope_type`` default)."""
    half = table.shape[-1] // 2
    if sum(sections) != half:
        raise ValueError(f"mrope_section {list(sections)} must sum to half the rotary width ({half}).")
    axis = torch.repeat_interleave(torch.arange(len(sections)), torch.tensor(sections)).to(table.device)
    axis = torch.cat((axis, axis))  # [rotary_dim]: the axis each column reads
    rows = table[positions.T]  # [num_tokens, 3, rotary_dim]
    return rows.gather(1, axis.expand(rows.shape[0], 1, -1)).squeeze(1)
