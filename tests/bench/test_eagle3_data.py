"""The EAGLE-3 training prompts (``bench/eagle3_data.py``): passages cut at sentence ends within
their bounds, the same prompts for the same seed, and held-out prompts from other texts."""

from __future__ import annotations

from pathlib import Path

from bench.eagle3_data import held_out_prompts, passages, training_prompts

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_passages_are_cut_at_sentence_ends_within_bounds() -> None:
    text = " ".join(f"Sentence number {i} says a few words about item {i}." for i in range(40))
    cut = passages(text + "\n\n" + "Too short.", low=160, high=520)
    assert len(cut) > 2 and all(160 <= len(p) <= 520 and p.endswith(".") for p in cut)
    assert " ".join(cut) in text and not any("Too short" in p for p in cut)


def test_prompts_are_seeded_and_held_out_texts_are_not_trained_on() -> None:
    first, again = training_prompts(40, seed=0), training_prompts(40, seed=0)
    assert first == again and len(first) == 40 and len(set(first)) == 40
    assert training_prompts(40, seed=1) != first
    held = held_out_prompts(DOCS, 6, seed=0)
    assert len(held) == 6
    trained = "\n".join(training_prompts(400, seed=0))
    for prompt in held:
        body = max(prompt.split("\n\n"), key=len)  # the passage the template wraps
        assert body not in trained
