"""The SRE documentation under docs/ names only real things: runtime flags the CLI accepts,
CR fields the CRD has, metrics the contract lists, the autoscaler's real reasons and
defaults; and it covers every metric and every knob it promises to."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from chart_support import METRIC, REPO, contract_metrics

DOCS = REPO / "docs"
TUNING_KNOBS = (
    "max_num_sequences",
    "max_num_tokens",
    "kv_cache_free_gpu_mem_fraction",
    "enable_chunked_context",
    "enable_prefix_caching",
)
TRT_PARAMETERS = {
    "max_num_sequences": "--max-num-sequences",
    "max_tokens_in_paged_kv_cache": "--num-kv-blocks",
    "kv_cache_free_gpu_mem_fraction": "--kv-cache-free-gpu-mem-fraction",
    "enable_chunked_context": "--enable-chunked-context",
    "gpt_model_type": "--scheduler-policy",
}


def _doc(name: str) -> str:
    path = DOCS / name
    assert path.is_file(), f"docs/{name} is missing"
    return path.read_text()


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.capitalize() for p in rest)


def _runtime_flags() -> set[str]:
    try:
        from inflight.runtime.cli.command import build_parser
    except ImportError as err:
        pytest.fail(f"inflight.runtime.cli.command.build_parser is missing ({err})")
    parser = build_parser()
    flags: set[str] = set()
    stack = [parser]
    while stack:
        current = stack.pop()
        for action in current._actions:
            flags |= {s for s in action.option_strings if s.startswith("--")}
            choices = getattr(action, "choices", None)
            if isinstance(choices, dict):  # subcommands (serve)
                stack += [sub for sub in choices.values() if hasattr(sub, "_actions")]
    return flags


def _crd_engine_fields() -> set[str]:
    crd = yaml.safe_load((REPO / "crds" / "inflight.dev_inferencedeployments.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return set(spec["properties"]["engine"]["properties"])


@pytest.mark.parametrize("name", ["tuning.md", "from-tensorrt-llm.md"])
def test_runtime_flags_in_docs_exist(name: str) -> None:
    text = _doc(name)
    # Flags in code spans and in the `inflight serve` example (not helm's or kubectl's).
    mentioned = set(re.findall(r"`(--[a-z][a-z-]+)", text))
    serve = re.search(r"inflight serve (.*?)```", text, re.S)
    if serve:
        mentioned |= set(re.findall(r"(--[a-z][a-z-]+)", serve.group(1)))
    unknown = sorted(mentioned - _runtime_flags())
    assert unknown == [], f"docs/{name} names flags `inflight serve` does not have: {unknown}"


@pytest.mark.parametrize("name", ["tuning.md", "from-tensorrt-llm.md", "kubernetes.md"])
def test_engine_fields_in_docs_exist(name: str) -> None:
    text = _doc(name)
    crd_fields = _crd_engine_fields()
    mentioned = set(re.findall(r"spec\.engine\.([A-Za-z]+)", text))
    for block in re.findall(r"```yaml\n(.*?)```", text, re.S):
        engine = (yaml.safe_load(block) or {}).get("spec", {}).get("engine") or {}
        mentioned |= set(engine)
    unknown = sorted(mentioned - crd_fields)
    assert unknown == [], f"docs/{name} names spec.engine fields the CRD lacks: {unknown}"


def test_tuning_guide_covers_each_knob() -> None:
    text = _doc("tuning.md")
    flags = _runtime_flags()
    for knob in TUNING_KNOBS:
        flag = "--" + knob.replace("_", "-")
        assert flag in flags
        assert f"`{flag}`" in text and f"`{_camel(knob)}`" in text, knob
        assert f"## {_camel(knob)}" in text, f"tuning.md needs a section on {_camel(knob)}"
    for effect in ("throughput", "TTFT", "ITL", "inflight:kv_cache_usage_perc", "inflight:num_preemptions_total"):
        assert effect in text


def test_tensorrt_llm_mapping_covers_each_parameter() -> None:
    text = _doc("from-tensorrt-llm.md")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    for parameter, flag in TRT_PARAMETERS.items():
        row = next((r for r in rows if r.startswith(f"| `{parameter}`")), None)
        assert row is not None, f"no table row for {parameter}"
        assert f"`{flag}`" in row, f"{parameter} should map to {flag}"
    for strategy in ("inflight_fused_batching", "V1", "`static`"):
        assert strategy in text


def test_every_contract_metric_is_documented() -> None:
    text = _doc("metrics.md")
    rows = {m for line in text.splitlines() if line.startswith("| `inflight:") for m in METRIC.findall(line)[:1]}
    missing = sorted(contract_metrics() - rows)
    assert missing == [], f"docs/metrics.md has no table row for {missing}"


@pytest.mark.parametrize("path", sorted(p.name for p in DOCS.glob("*.md") if p.name != "CONTRACTS.md"))
def test_docs_name_only_contract_metrics(path: str) -> None:
    known = contract_metrics()
    used = {m.removesuffix("_bucket") for m in METRIC.findall(_doc(path))}
    assert used - known == set(), f"docs/{path} names unknown metrics {sorted(used - known)}"


def test_autoscaling_guide_matches_the_autoscaler() -> None:
    try:
        from inflight.operator import autoscaler
    except ImportError as err:
        pytest.fail(f"inflight.operator.autoscaler is missing ({err})")
    text = _doc("autoscaling.md")
    source = Path(autoscaler.__file__).read_text()
    literals = set(re.findall(r'"([A-Z][a-z]+(?:[A-Z][a-z]+)*)"', source))
    # f"ScaleUp{signal}" with signal KvCache, Queue or Ttft; "ScaleUp" alone is only a prefix test.
    signals = {"KvCache", "Queue", "Ttft"}
    reasons = (literals - signals - {"ScaleUp"}) | {f"ScaleUp{s}" for s in signals}
    undocumented = sorted(r for r in reasons if f"`{r}`" not in text)
    assert undocumented == [], f"autoscaling.md does not explain reasons {undocumented}"
    assert f"|ratio - 1| <= {autoscaler.DEFAULT_TOLERANCE:g}" in text
    assert "max(kv / targetKvCacheUsage, queue / targetQueueDepth)" in text
    assert "ceil(ready x ratio)" in text

    crd = yaml.safe_load((REPO / "crds" / "inflight.dev_inferencedeployments.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    defaults = {k: v.get("default") for k, v in spec["properties"]["autoscaling"]["properties"].items()}
    for field in ("targetKvCacheUsage", "targetQueueDepth", "intervalSeconds"):
        assert f"**{field}** (default {defaults[field]:g}" in text, field
    assert f"({defaults['scaleDownStabilizationSeconds']:g} by default)" in text
    assert f"({defaults['scaleUpStabilizationSeconds']:g} by default" in text
