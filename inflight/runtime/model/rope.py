"""Rotary-embedding tables: the (cos, sin) cache per position, computed as transformers does.

We take the inverse frequencies and attention scaling from transformers' own rope
initializers (default, linear, llama3, yarn) so scaled variants match the reference exactly.
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


def _inv_freq(config: Any, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config)
    if layer_type is not None:  # per-layer-type parameters (Gemma 3: full_attention, sliding_attention)
        params = dict(params[layer_type])
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    extra = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **extra)
    return inv_freq.float(), float(scaling)


def build_rope_tables(config: Any, spec: Any, max_position: int) -> torch.Tensor:
    """``[num_tables, max_position, head_dim]``: table 0 for every layer, except that with
    ``spec.local_rope`` (Gemma 3) table 0 is the global layers' and table 1 the sliding
    layers' (``spec.layer_rope_table`` says which a layer reads)."""
    if not spec.local_rope:
        return build_cos_sin_cache(config, spec.head_dim, max_position)[None]
    tables = [build_cos_sin_cache(config, spec.head_dim, max_position, kind)
              for kind in ("full_attention", "sliding_attention")]  # fmt: skip
    return torch.stack(tables)


def build_cos_sin_cache(
    config: Any, head_dim: int, max_position: int, layer_type: str | None = None
) -> torch.Tensor:
    """``[max_position, head_dim]`` float32: cos of each frequency, then sin."""
    inv_freq, scaling = _inv_freq(config, head_dim, layer_type)  # [head_dim / 2]
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
