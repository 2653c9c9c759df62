"""Qwen3-Next's MTP layer (``mtp.*``) as the drafter (``"method": "mtp"``): a tiny random Qwen3-Next
(tests/engine/qwen3_next_models.py) given an MTP layer in the published layout (``mtp.fc``, the
``pre_fc_norm_*`` norms, ``mtp.layers.0.*`` a gated-attention layer with the model's experts,
``mtp.norm``; transformers' ``save_pretrained`` drops ``mtp.*``, so the test writes them); greedy
output token-identical with and without speculation (plain, preemption, async scheduling), every
draft chain equal to a plain-torch reference of the layer as vLLM computes it (transformers' model
for the served states and its own decoder layer as the block), the layer's tensors checked at start,
a checkpoint without the layer refused with the reason."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.spec_decode.mtp_head import check_mtp

from .qwen3_next_models import make_qwen3_next

MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 2})


def add_mtp_layer(model_dir: Path, seed: int = 5, drop: str | None = None) -> Path:
    """Write an MTP layer into ``model_dir``'s checkpoint: layer 3's tensors (gated full attention,
    experts) as ``mtp.layers.0.*``, a random ``fc`` and norms (stored as Qwen3-Next stores them:
    ``1 + weight`` is what scales). ``drop``: leave that tensor out."""
    weights = load_file(model_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    hidden = weights["model.norm.weight"].shape[0]
    mtp = {name.replace("model.layers.3.", "mtp.layers.0."): value.clone()
           for name, value in weights.items() if name.startswith("model.layers.3.")}  # fmt: skip
    mtp["mtp.fc.weight"] = 0.08 * torch.randn(hidden, 2 * hidden, generator=gen)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = 0.1 * torch.randn(hidden, generator=gen)
    if drop is not None:
        del mtp[drop]
    save_file({**weights, **mtp}, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_mtp_layer(make_qwen3_next(tmp_path_factory.mktemp("qwen3-next-mtp")))


def _engine(model_dir: Path, spec: str | None, **knobs: object) -> LLMEngine:
    config = dict(device="cpu", dtype="float32", num_kv_blocks=128, max_num_tokens=256, speculative_config=spec)
    return LLMEngine.from_model_dir(model_dir, EngineConfig(**{**config, **knobs}))  # type: ignore[arg-type]


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 20) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.req_id].extend(o.new_token_ids)
    stats = engine.stats()
    assert stats.num_used_kv_blocks == 0 and engine.kv.state_pool is not None and engine.kv.state_pool.num_used == 0
    return out


def _prompts(count: int = 5) -> list[list[int]]:
    return [[(31 * i + 17 * j * j + 11) % 900 + 20 for j in range(4 + 15 * i)] for i in range(count)]


@pytest.mark.parametrize("knobs", [{}, {"num_kv_blocks": 14, "block_size": 16}, {"async_scheduling": True}],
                         ids=["plain", "preemption", "async"])  # fmt: skip
def test_mtp_drafts_keep_greedy_output_identical(model_dir: Path, knobs: dict,
                                                 caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    prompts = _prompts()
    off = _run(_engine(model_dir, None, **knobs), prompts)
    with caplog.at_level(logging.INFO):
        engine = _engine(model_dir, MTP, **knobs)
    assert "scratch state slots for speculation" in caplog.text
    assert _run(engine, prompts) == off
    stats = engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > stats.num_accepted_tokens  # rejections roll back
    if "num_kv_blocks" in knobs:
        assert engine.stats().num_preemptions > 0


def test_the_mtp_layer_is_loaded_with_the_served_models_norm_and_head(model_dir: Path) -> None:
    engine = _engine(model_dir, MTP)
    head = engine.drafter.head  # type: ignore[union-attr]
    target = engine.runner.model
    assert head.lm_head_weight is target.lm_head.weight and head.final_norm[0] is target.norm.weight
    assert head.spec.linear_attention is None and head.spec.moe.sparse_layers == (0,)  # gated attention + experts
    stored = load_file(model_dir / "model.safetensors")["mtp.pre_fc_norm_hidden.weight"]
    assert torch.equal(head.pre_fc_norm_hidden.weight, stored + 1.0)  # zero-centred, folded at load


def test_a_checkpoint_without_the_layer_is_refused(model_dir: Path, tmp_path: Path) -> None:
    bare = make_qwen3_next(tmp_path / "bare")
    with pytest.raises(ValueError, match="has no MTP layer"):
        check_mtp(bare, EngineConfig(device="cpu", speculative_config=MTP))
    with pytest.raises(ValueError, match="has no MTP layer"):
        _engine(bare, MTP)
    partial = add_mtp_layer(make_qwen3_next(tmp_path / "partial"), drop="mtp.norm.weight")
    with pytest.raises(ValueError, match="lacks 1 tensor"):
        _engine(partial, MTP)


def _rms1(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-Next's RMSNorm: scales by ``1 + weight``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def reference_drafts(model_dir: Path, tokens: list[int], k: int) -> list[int]:
    """The MTP layer's ``k`` chained greedy drafts after ``tokens`` (the last not yet computed), in
    plain torch as vLLM's ``Qwen3NextMTP`` computes them: the served model's final-normed states from
    transformers, ``fc`` over the normed embedding and state, transformers' own decoder layer 3 as
    the block (the MTP layer's tensors are its), ``mtp.norm``, the served model's LM head; each next
    pass reads the layer's own normed output."""
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    t = {name.removeprefix("mtp."): v for name, v in load_file(model_dir / "model.safetensors").items()
         if name.startswith("mtp.") and not name.startswith("mtp.layers.")}  # fmt: skip
    eps = full.config.rms_norm_eps
    s = len(tokens) - 1
    with torch.no_grad():
        target = full.model(torch.tensor([tokens[:s]])).last_hidden_state[0]  # [s, hidden], final-normed
        ids, states = list(tokens[1:]), [target[p] for p in range(s)]
        drafts: list[int] = []
        for _ in range(k):
            n = len(ids)
            positions = torch.arange(n)
            emb = full.model.embed_tokens(torch.tensor(ids))
            x = torch.cat([_rms1(emb, t["pre_fc_norm_embedding.weight"], eps),
                           _rms1(torch.stack(states), t["pre_fc_norm_hidden.weight"], eps)], -1) @ t["fc.weight"].T
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            rope = full.model.rotary_emb(x[None], positions[None])
            out = full.model.layers[3](x[None], attention_mask=mask, position_ids=positions[None],
                                       position_embeddings=rope)  # fmt: skip
            out = _rms1((out[0] if isinstance(out, tuple) else out)[0], t["norm.weight"], eps)  # [n, hidden]
            drafts.append(int((out[-1] @ full.lm_head.weight.T).argmax()))
            ids.append(drafts[-1])
            states.append(out[-1])
    return drafts


def test_drafts_equal_a_plain_torch_reference_of_the_mtp_layer(model_dir: Path) -> None:
    """Every draft chain of a decoding request (the first draft from the served model's state, the
    next from the layer's own) is what the reference computes from the tokens known at that step."""
    engine = _engine(model_dir, json.dumps({"method": "mtp", "num_speculative_tokens": 3}))
    drafter = engine.drafter
    assert drafter is not None
    seen: list[tuple[int, tuple[int, ...]]] = []
    propose = drafter.propose

    def recording(chunks, sampling_row):  # type: ignore[no-untyped-def]
        fallbacks = drafter.num_fallback_proposals
        proposal = propose(chunks, sampling_row)
        if drafter.num_fallback_proposals == fallbacks:  # not a state-less chunk's last-token proposal
            seen.extend((c.start, c.draft_token_ids) for c in proposal.chunks if c.draft_token_ids)
        return proposal

    drafter.propose = recording  # type: ignore[method-assign]
    prompt = _prompts(3)[2]
    out = _run(engine, [prompt], max_tokens=12)["0"]
    tokens = prompt + out
    assert len(seen) >= 3
    for start, drafts in seen:
        assert list(drafts) == reference_drafts(model_dir, tokens[: start + 1], len(drafts)), start
