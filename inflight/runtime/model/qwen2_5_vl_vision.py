"""Qwen2.5-VL's vision tower: patches in, one embedding per merged 2x2 patch block out.

The patch embedding (a ``temporal_patch x patch x patch`` Conv3d, run as one matmul over the
flattened patches), ``depth`` pre-norm blocks (RMSNorm, attention with a 2D rotary over the
patch rows and columns, a SwiGLU MLP with biases) that attend within windows of
``window_size`` pixels except the ``fullatt_block_indexes`` blocks, which attend over the whole
image, and the patch merger (RMSNorm, the ``merge_size**2`` neighbours concatenated, a GELU MLP to
the language model's width). The patches are reordered window by window before the blocks and
back after the merger, as transformers does. Attention runs per window (or per image) with
torch's SDPA: the encoder runs once per image, at the first prefill chunk that needs it.
Parameter names are the checkpoint's under ``visual.``. Linears are plain parameters, not
``nn.Linear``, so the CPU prepacking of the decoder's linears leaves them alone.
Knows nothing about the KV cache, scheduling or the language model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class _PatchEmbed(nn.Module):
    def __init__(self, in_channels: int, temporal_patch: int, patch: int, embed_dim: int) -> None:
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(embed_dim, in_channels, temporal_patch, patch, patch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_patches, patch_dim] -> [num_patches, embed]
        weight = self.proj.weight
        return F.linear(x.to(weight.dtype), weight.reshape(weight.shape[0], -1))


class _Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = _Linear(dim, 3 * dim)
        self.proj = _Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).unbind(1)  # each [n, heads, head_dim]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
            if end > start:
                seg = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]  # [1, heads, len, head_dim]
                out[start:end] = F.scaled_dot_product_attention(*seg)[0].transpose(0, 1)  # 4D: the fused CPU kernel
        return self.proj(out.reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary (halves) in float32, as transformers' ``apply_rotary_pos_emb_vision``."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class _Block(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim, inter = config.hidden_size, config.intermediate_size
        self.norm1 = _RMSNorm(dim)
        self.norm2 = _RMSNorm(dim)
        self.attn = _Attention(dim, config.num_heads)
        self.mlp = nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj, self.mlp.down_proj = _Linear(dim, inter), _Linear(dim, inter), \
            _Linear(inter, dim)  # fmt: skip
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported vision hidden_act {config.hidden_act!r}; only silu is implemented.")

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        h = self.norm2(x)
        mlp = self.mlp
        return x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))


class _Merger(nn.Module):
    def __init__(self, context_dim: int, out_dim: int, merge_size: int) -> None:
        super().__init__()
        self.hidden = context_dim * merge_size**2
        self.ln_q = _RMSNorm(context_dim)
        self.mlp = nn.ModuleDict({"0": _Linear(self.hidden, self.hidden), "2": _Linear(self.hidden, out_dim)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_q(x).reshape(-1, self.hidden)
        return self.mlp["2"](F.gelu(self.mlp["0"](h)))


class VisionTower(nn.Module):
    """Qwen2.5-VL's ``visual`` module (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge_size = int(config.spatial_merge_size)
        self.patch_size = int(config.patch_size)
        self.window_size = int(config.window_size)
        self.full_blocks = frozenset(int(i) for i in config.fullatt_block_indexes)
        head_dim = config.hidden_size // config.num_heads
        # Plain numbers, not a buffer: the loader builds the model on the meta device and then
        # allocates it empty, which leaves a non-persistent buffer (in no checkpoint) as garbage.
        self.rope_theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.rope_dim = head_dim // 2
        self.patch_embed = _PatchEmbed(config.in_channels, config.temporal_patch_size, config.patch_size,
                                       config.hidden_size)  # fmt: skip
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.depth))
        self.merger = _Merger(config.hidden_size, config.out_hidden_size, self.merge_size)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """``[sum(t * h * w / merge**2), out_hidden]`` embeddings of the images, image by image."""
        unit = self.merge_size**2
        x = self.patch_embed(pixel_values)  # [num_patches, hidden]
        n = x.shape[0]
        window_index, cu_windows = self._windows(grids)
        x = x.reshape(n // unit, unit, -1)[window_index].reshape(n, -1)
        freqs = self._rotary(grids, x.device)  # [num_patches, head_dim / 2]
        freqs = freqs.reshape(n // unit, unit, -1)[window_index].reshape(n, -1)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        cu_images = [0]
        for t, h, w in grids:
            cu_images.extend(cu_images[-1] + h * w for _ in range(t))
        for i, block in enumerate(self.blocks):
            x = block(x, cu_images if i in self.full_blocks else cu_windows, cos, sin)
        merged = self.merger(x)
        return merged[torch.argsort(window_index.to(merged.device))]

    def _rotary(self, grids: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
        """Each patch's (row, column) frequencies, patches in merge-block order."""
        m = self.merge_size
        rows = []
        for t, h, w in grids:
            hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            hpos = hpos.reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
            wpos = wpos.reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
            rows.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
        pos = torch.cat(rows).to(device)  # [num_patches, 2]
        spatial = self.rope_dim
        inv = 1.0 / self.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial)
        return torch.cat((pos[:, 0, None].float() * inv, pos[:, 1, None].float() * inv), dim=-1)

    def _windows(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """The merged blocks' order window by window, and the windows' patch boundaries."""
        m, unit = self.merge_size, self.merge_size**2
        side = self.window_size // m // self.patch_size  # merged blocks per window side
        index: list[torch.Tensor] = []
        cu = [0]
        base = 0
        for t, h, w in grids:
            lh, lw = h // m, w // m
            ids = torch.arange(t * lh * lw).reshape(t, lh, lw)
            pad_h, pad_w = side - lh % side, side - lw % side
            nh, nw = (lh + pad_h) // side, (lw + pad_w) // side
            padded = F.pad(ids, (0, pad_w, 0, pad_h), value=-100)
            padded = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, side, side)
            counts = (padded != -100).sum([2, 3]).reshape(-1)
            flat = padded.reshape(-1)
            index.append(flat[flat != -100] + base)
            for c in counts.tolist():
                if c:  # transformers drops the empty windows' repeated boundaries (unique_consecutive)
                    cu.append(cu[-1] + c * unit)
            base += t * lh * lw
        return torch.cat(index), cu


def load_vision_tensor(tower: VisionTower, name: str, part: Any) -> None:
    """Copy checkpoint tensor ``visual.<name>`` (a safetensors slice) into ``tower``."""
    params = dict(tower.named_parameters())
    if name not in params:
        raise ValueError(f"checkpoint tensor 'visual.{name}' does not fit the Qwen2.5-VL vision tower.")
    tensor = part[:]
    dest = params[name]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(f"visual.{name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}.")
    with torch.no_grad():
        dest.copy_(tensor.to(dest.dtype))
