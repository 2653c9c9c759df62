"""Training an EAGLE-3 head in plain torch (for :mod:`bench.train_eagle3`), saved in the published
layout that :mod:`inflight.runtime.spec_decode.eagle3_head` loads.

The head computes what :class:`~inflight.runtime.spec_decode.eagle3_head.Eagle3Head` computes
(same parameter names and math: ``fc`` over the three aux states, ``input_layernorm`` of the next
token's embedding beside ``hidden_norm`` of the fused state into one Llama layer with neox rope,
``norm`` and a draft-vocabulary ``lm_head``), over whole sequences with dense attention instead of
paged KV. Training unrolls ``steps`` chained passes (EAGLE-3's training-time test): pass ``s`` at
position ``i`` reads pass ``s - 1``'s pre-norm state at ``i - 1`` and attends to pass 1's keys up to
``i - s + 1`` and to pass ``r``'s key at ``i - s + r`` (r = 2..s), exactly the entries the served
head's KV holds when it chains its drafts. Every pass learns the target's own greedy next token
where the example's mask says (its answer), on the draft vocabulary only (logits of those rows
alone); ``lm_head`` and ``norm`` may start from the target's (:meth:`TrainHead.start_from_target`).
Knows nothing about the engine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn


@dataclass(frozen=True, slots=True)
class HeadShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int  # the target's
    draft_vocab: int
    eps: float
    rope_theta: float


@dataclass(frozen=True, slots=True)
class Example:
    """One sequence: aux states ``[n, 3 * hidden]`` (any float dtype), token ids ``[n]``, the
    target's greedy next-token ids ``[n]`` (``labels[i]``: its token after token ``i``) and a loss
    mask ``[n]`` (the labels to learn: its answer's tokens)."""

    aux: torch.Tensor
    tokens: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:  # x [n, h, d]
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    f = pos.float()[:, None] * inv[None]
    c, s = f.cos()[:, None], f.sin()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class TrainHead(nn.Module):
    """The head's parameters under their checkpoint names (``midlayer.*`` flattened with ``_``)."""

    def __init__(self, shape: HeadShape) -> None:
        super().__init__()
        h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        self.shape = shape
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.q_proj, self.k_proj = nn.Linear(2 * h, q, bias=False), nn.Linear(2 * h, kv, bias=False)
        self.v_proj, self.o_proj = nn.Linear(2 * h, kv, bias=False), nn.Linear(q, h, bias=False)
        self.gate_proj = nn.Linear(h, shape.intermediate, bias=False)
        self.up_proj = nn.Linear(h, shape.intermediate, bias=False)
        self.down_proj = nn.Linear(shape.intermediate, h, bias=False)
        self.norms = nn.ParameterDict({n: nn.Parameter(torch.ones(h)) for n in
                                       ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm")})  # fmt: skip
        self.lm_head = nn.Linear(h, shape.draft_vocab, bias=False)

    def _layer_inputs(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        eps = self.shape.eps
        return torch.cat(
            [_rms(emb, self.norms["input_layernorm"], eps), _rms(hidden, self.norms["hidden_norm"], eps)], -1
        )

    def unrolled(self, emb: torch.Tensor, fused: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Pre-norm states ``[n, hidden]`` of passes 1..steps (see module docstring; logits through
        :meth:`draft_logits`); ``emb[i]`` is the embedding of token ``i + 1``."""
        s, n = self.shape, emb.shape[0]
        pos = torch.arange(n)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        hidden, out = fused, []
        for step in range(1, steps + 1):
            x = self._layer_inputs(emb, hidden)
            q = _rope(self.q_proj(x).view(n, s.heads, s.head_dim), pos, s.rope_theta)
            keys.append(_rope(self.k_proj(x).view(n, s.kv_heads, s.head_dim), pos, s.rope_theta))
            values.append(self.v_proj(x).view(n, s.kv_heads, s.head_dim))
            i, j = pos[:, None], pos[None, :]
            masks = [j <= i - step + 1] + [j == i - step + r for r in range(2, step + 1)]
            k = torch.cat(keys, 0).repeat_interleave(s.heads // s.kv_heads, 1).transpose(0, 1)
            v = torch.cat(values, 0).repeat_interleave(s.heads // s.kv_heads, 1).transpose(0, 1)
            mask = torch.cat(masks, 1)
            mask[:, 0] |= ~mask.any(1)  # rows with nothing to read (no loss there) stay finite
            attn = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)
            residual = hidden + self.o_proj(attn.transpose(0, 1).reshape(n, -1))
            y = _rms(residual, self.norms["post_attention_layernorm"], s.eps)
            pre = residual + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
            out.append(pre)
            hidden = torch.cat([pre[:1] * 0, pre[:-1]], 0)  # pass s+1 at i reads pass s at i - 1
        return out

    def draft_logits(self, pre: torch.Tensor) -> torch.Tensor:  # [n, draft_vocab]
        """Draft-vocabulary logits of pre-norm states (the rows a loss reads only)."""
        return self.lm_head(_rms(pre, self.norms["norm"], self.shape.eps))

    def start_from_target(self, lm_rows: torch.Tensor, final_norm: torch.Tensor, train_lm_head: bool) -> None:
        """Start ``lm_head`` from the target's output rows of the draft vocabulary ``[draft_vocab,
        hidden]`` and ``norm`` from its final norm, so the head's output space is the target's from
        the first step; with ``train_lm_head`` False the rows stay fixed (fewer parameters to fit
        from little data)."""
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_rows)
            self.norms["norm"].copy_(final_norm)
        self.lm_head.weight.requires_grad_(train_lm_head)

    def state_dict_published(self) -> dict[str, torch.Tensor]:
        """The published EAGLE-3 tensor names (``midlayer.*``)."""
        out = {"fc.weight": self.fc.weight, "norm.weight": self.norms["norm"],
               "lm_head.weight": self.lm_head.weight}  # fmt: skip
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"midlayer.self_attn.{name}.weight"] = getattr(self, name).weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"midlayer.mlp.{name}.weight"] = getattr(self, name).weight
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            out[f"midlayer.{name}.weight"] = self.norms[name]
        return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


def chain_ok(ex: Example, step: int) -> torch.Tensor:
    """``[n - 1]``: where pass ``step + 1`` (0-based ``step``) at position ``i`` is a case serving
    meets: the ``step`` tokens it was fed after pass 1's (tokens ``i + 2 - step .. i + 1``) are each
    the target's own greedy choice after the token before (a served chain only goes on while its
    drafts are the target's tokens). Always true for answers the target decoded greedily; with
    teacher-forced text (:mod:`bench.eagle3_jacobi`) it drops the chains through tokens the target
    would not have chosen."""
    n = ex.tokens.shape[0]
    greedy = torch.ones(n, dtype=torch.bool)
    greedy[1:] = ex.tokens[1:] == ex.labels[:-1]  # token j is the target's choice after token j - 1
    ok = torch.ones(n - 1, dtype=torch.bool)
    ok[:step] = False
    for back in range(step):  # position i reads the chain of tokens i + 1 - back, back < step
        ok[step:] &= greedy[step + 1 - back : n - back]
    return ok


def train(head: TrainHead, embed: torch.Tensor, examples: list[Example], draft_of: torch.Tensor, *, epochs: int,
          steps: int, lr: float, seed: int, log: object = partial(print, flush=True),
          bf16: bool = False) -> list[float]:  # fmt: skip
    """AdamW with cosine decay over ``examples`` (one sequence per update); the mean loss of each
    epoch. ``draft_of[t]`` is target id ``t``'s draft id, -1 outside the draft vocabulary
    (such labels are skipped). ``bf16``: the passes' products under bf16 autocast (about 1.5x
    faster on a CPU with AVX-512 BF16; the parameters and the optimizer stay fp32)."""
    gen = torch.Generator().manual_seed(seed)
    trained = [q for q in head.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0, betas=(0.9, 0.95), foreach=True)
    total = epochs * len(examples)
    losses, done = [], 0
    for epoch in range(epochs):
        order = torch.randperm(len(examples), generator=gen).tolist()
        running = 0.0
        for idx in order:
            ex = examples[idx]
            for group in opt.param_groups:
                group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * done / total))
            done += 1
            emb = embed[ex.tokens[1:]]  # position i reads token i + 1
            target = draft_of[ex.labels[1:]]  # position i predicts the target's token after i + 1
            loss = torch.zeros(())
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                fused = head.fc(ex.aux[:-1].float())
                for step, pre in enumerate(head.unrolled(emb, fused, steps)):
                    keep = ex.mask[1:] & (target >= 0) & chain_ok(ex, step)
                    if keep.any():
                        logits = head.draft_logits(pre[keep]).float()
                        loss = loss + (0.8**step) * F.cross_entropy(logits, target[keep])
            if not loss.requires_grad:  # no answer token in the draft vocabulary: nothing to learn
                continue
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            opt.step()
            running += loss.item()
        losses.append(running / len(examples))
        log(f"epoch {epoch + 1}/{epochs}: loss {losses[-1]:.3f}")  # type: ignore[operator]
    return losses


@torch.no_grad()
def agreement(head: TrainHead, embed: torch.Tensor, examples: list[Example], draft_of: torch.Tensor,
              steps: int) -> list[float]:  # fmt: skip
    """Offline acceptance proxy: the share of masked positions where pass ``s`` (1..steps) ranks
    the target's token first (a token outside the draft vocabulary counts as a miss)."""
    hits, total = [0] * steps, [0] * steps
    for ex in examples:
        target = draft_of[ex.labels[1:]]
        for step, pre in enumerate(head.unrolled(embed[ex.tokens[1:]], head.fc(ex.aux[:-1].float()), steps)):
            keep = ex.mask[1:] & chain_ok(ex, step)
            if keep.any():
                hits[step] += int((head.draft_logits(pre[keep]).argmax(-1) == target[keep]).sum())
                total[step] += int(keep.sum())
    return [h / t if t else 0.0 for h, t in zip(hits, total, strict=True)]


def save_head(head: TrainHead, out: Path, draft_ids: torch.Tensor, aux_ids: tuple[int, ...],
              target_config: dict) -> Path:  # fmt: skip
    """config.json + model.safetensors in the published layout; ``draft_ids`` ``[draft_vocab]``
    are the target ids of the draft vocabulary (sorted), written as ``d2t`` offsets and a ``t2d``
    membership mask."""
    s = head.shape
    out.mkdir(parents=True, exist_ok=True)
    tensors = head.state_dict_published()
    tensors["d2t"] = (draft_ids - torch.arange(s.draft_vocab)).to(torch.int64)
    t2d = torch.zeros(s.vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": s.hidden,
              "intermediate_size": s.intermediate, "num_hidden_layers": 1, "num_attention_heads": s.heads,
              "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim, "hidden_act": "silu",
              "rms_norm_eps": s.eps, "rope_theta": s.rope_theta, "rope_scaling": None,
              "max_position_embeddings": target_config.get("max_position_embeddings", 8192),
              "vocab_size": s.vocab, "draft_vocab_size": s.draft_vocab, "target_hidden_size": s.hidden,
              "tie_word_embeddings": False, "bos_token_id": target_config.get("bos_token_id"),
              "eos_token_id": target_config.get("eos_token_id"), "torch_dtype": "float32",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids), "use_aux_hidden_state": True}}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
