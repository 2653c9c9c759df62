"""The markdown page of a ``make gpu-check`` report, rendered from its JSON payload.

Owns the layout only: the step table first, the issue's targets (met or MISSED), then each
step's tables (kernel checks, decode
attention bandwidth, the multi-LoRA delta's times, engine step vs roofline, the served burst) where the step produced them.
Knows nothing about how anything was measured.
"""

from __future__ import annotations

from typing import Any


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "" if value is None else format(value, spec)


def _steps(payload: dict[str, Any]) -> list[str]:
    lines = ["| step | result | seconds | summary |", "|---|---|---:|---|"]
    for s in payload["steps"]:
        summary = str(s["summary"]).replace("|", "\\|")
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']:.0f} | {summary} |")
    return lines


def _checks(data: dict[str, Any]) -> list[str]:
    lines = ["", "### Kernels against their torch reference (fresh random inputs)", "",
             "| kernel | dtype | max abs err | result |", "|---|---|---:|---|"]  # fmt: skip
    for c in data.get("checks", []):
        verdict = "ok" if c["ok"] else f"FAIL: {c['error']}".replace("|", "\\|") if c.get("error") else "FAIL"
        lines.append(f"| {c['kernel']} | {c['dtype'][6:]} | {c['max_abs_err']:.2e} | {verdict} |")
    return lines


def _decode(data: dict[str, Any]) -> list[str]:
    copy = data.get("copy_gb_per_s")
    against = f"{copy:.0f} GB/s" if copy else f"not measured ({data.get('copy_error')}); % of a nominal 1000 GB/s"
    lines = ["", f"### Paged decode attention vs copy bandwidth ({against})", "",
             "| batch | context | splits | us | GB/s | % of copy |", "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in data.get("decode", []):
        if r.get("error"):
            error = str(r["error"]).replace("|", "\\|")
            lines.append(f"| {r['batch']} | {r['context']} | | FAILED: {error} | | |")
            continue
        lines.append(f"| {r['batch']} | {r['context']} | {r['splits']} | {1e3 * r['ms']:.1f} | "
                     f"{r['gb_per_s']:.0f} | {100 * r['fraction_of_copy']:.1f}% |")  # fmt: skip
    return lines + _graph_width(data.get("decode_graph_width"))


def _graph_width(g: dict[str, Any] | None) -> list[str]:
    """The graph-width row: per-row splits against splits sized for the table's width."""
    if not g:
        return []
    if g.get("error"):
        return ["", f"Graph-width decode row FAILED: {str(g['error']).replace('|', chr(92) + '|')}"]
    return ["", f"### Decode attention at graph width (batch {g['batch']}, contexts {g['contexts']}, "
                f"a {g['width_tokens']}-token table)", "",
            "| splits | per row | us | % of copy |", "|---|---:|---:|---:|",
            f"| each row's own (now) | {g['splits_per_row']} | {1e3 * g['per_row_ms']:.1f} | "
            f"{100 * g['per_row_fraction_of_copy']:.1f}% |",
            f"| sized for the width (before) | {g['splits_by_width']} | {1e3 * g['by_width_ms']:.1f} | "
            f"{100 * g['by_width_fraction_of_copy']:.1f}% |",
            "", f"Per-row splits: {g['speedup']:.2f}x the width-sized plan."]  # fmt: skip


def _lora(data: dict[str, Any]) -> list[str]:
    if not data.get("lora"):
        return []
    lines = ["", "### Multi-LoRA delta (adapters round-robin over the rows) vs its reference and the base GEMM", "",
             "| tokens | triton us | reference us | base GEMM us | triton / base |", "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in data.get("lora", []):
        if r.get("error"):
            lines.append(f"| {r['num_tokens']} | FAILED: {str(r['error']).replace('|', chr(92) + '|')} | | | |")
            continue
        lines.append(f"| {r['num_tokens']} | {1e3 * r['triton_ms']:.1f} | {1e3 * r['reference_ms']:.1f} | "
                     f"{1e3 * r['base_ms']:.1f} | {r['triton_ms'] / r['base_ms']:.2f} |")  # fmt: skip
    return lines


def _engine(data: dict[str, Any]) -> list[str]:
    lines = ["", "### Engine decode step vs its roofline ((weights + K/V) / copy bandwidth)", "",
             "| batch | mode | step ms | roofline ms | x roofline |", "|---:|---|---:|---:|---:|"]  # fmt: skip
    for r in data.get("rows", []):
        mode = ("CUDA graphs" if r.get("graphs") else "eager") + (" + async scheduling" if r.get("async") else "")
        lines.append(f"| {r['batch']} | {mode} | {r['step_ms']:.2f} | {r['roofline_ms']:.3f} | {r['x_roofline']:.2f}x |")
    return lines + _sim_profile(data.get("sim_profile"))


def _sim_profile(sim: dict[str, Any] | None) -> list[str]:
    if not sim:
        return []
    if "profile" not in sim:
        return ["", f"Simulated-device profile: not written ({sim.get('error')})."]
    fields = ", ".join(f"{k} {v:.4g}" for k, v in sim["profile"].items())
    dry = " (DRY RUN: CPU figures, not a GPU's)" if sim.get("dry_run") else ""
    return ["", f"Simulated-device profile{dry}: `{sim['file']}` ({fields}; {sim['fit']})."]


def _breakdown(data: dict[str, Any]) -> list[str]:
    lines = ["", "### Where a decode step's time goes (a device sync after each stage)", "",
             "| batch | mode | prepare ms | forward ms | sample ms | step ms |", "|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in data.get("breakdown", []):
        mode = "graphs" if r.get("graphs") else "eager"
        lines.append(f"| {r['batch']} | {mode} | {r['prepare']:.2f} | {r['forward']:.2f} | {r['sample']:.2f} | {r['step']:.2f} |")
    for p in data.get("profiles", []):
        mode = "graphs" if p.get("graphs") else "eager"
        lines += ["", f"GPU kernels, batch {p['batch']}, {mode} (per step; the batch's prefill is in these totals too):",
                  "", "| us per step | calls per step | kernel |", "|---:|---:|---|"]  # fmt: skip
        lines += [f"| {k['us_per_step']:.1f} | {k['calls_per_step']:.1f} | `{k['kernel']}` |" for k in p["kernels"]]
    return lines


def _burst(data: dict[str, Any]) -> list[str]:
    if "sync" not in data:  # a report from before the burst ran both ways
        return _burst_line(data)
    lines = ["", "### Served burst", "", f"{data['requests']} streaming requests of {data['max_tokens']} tokens at "
             f"once on {data['model']}:", "",
             "| scheduling | output tok/s | TTFT p50 s | TPOT p50 ms | GPU busy | NVML samples | errors |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, run in (("synchronous", data.get("sync")), ("async", data)):
        if not run:
            continue
        busy = run.get("gpu_busy_fraction")
        lines.append(f"| {name} | {run['output_tok_per_s']:.0f} | {_fmt(run.get('ttft_p50_s'), '.3f')} | "
                     f"{_fmt(1e3 * run['tpot_p50_s'] if run.get('tpot_p50_s') else None, '.1f')} | "
                     f"{'n/a' if busy is None else f'{100 * busy:.0f}%'} | {run.get('busy_samples', 0)} | "
                     f"{run['num_errors']} |")
    return lines


def _burst_line(data: dict[str, Any]) -> list[str]:
    busy = data.get("gpu_busy_fraction")
    return ["", "### Served burst", "",
            f"{data['requests']} streaming requests of {data['max_tokens']} tokens at once on {data['model']}: "
            f"{data['output_tok_per_s']:.0f} output tok/s, TTFT p50 {_fmt(data.get('ttft_p50_s'), '.3f')} s, "
            f"TPOT p50 {_fmt(1e3 * data['tpot_p50_s'] if data.get('tpot_p50_s') else None, '.1f')} ms, "
            f"GPU busy {'n/a' if busy is None else f'{100 * busy:.0f}%'} "
            f"({data.get('busy_samples', 0)} NVML samples), {data['num_errors']} errors."]  # fmt: skip


SECTIONS = {"kernel bench": (_checks, _decode, _lora), "engine step": (_engine, _breakdown), "served burst": (_burst,)}


def _targets(payload: dict[str, Any]) -> list[str]:
    """The issue's GPU targets, each met or MISSED (a step's "pass" means it ran, not that
    its figure reached the target)."""
    data = {s["name"]: s["data"] for s in payload["steps"] if s["data"]}
    rows = []
    decode = data.get("kernel bench", {}).get("decode_target")
    if decode and decode.get("worst_fraction") is not None:
        rows.append(("decode attention at batch 64, worst % of copy bandwidth", f">= {100 * decode['target']:.0f}%",
                     f"{100 * decode['worst_fraction']:.0f}%", decode["met"]))
    for batch, t in sorted(data.get("engine step", {}).get("targets", {}).items(), key=lambda kv: int(kv[0])):
        if t.get("x_roofline") is not None:  # a dry run measures no step with graphs
            rows.append((f"decode step at batch {batch} with CUDA graphs, x roofline", f"<= {t['bound']:.1f}x",
                         f"{t['x_roofline']:.2f}x", t["met"]))
    burst = data.get("served burst", {})
    if burst.get("busy_target") is not None and burst.get("gpu_busy_fraction") is not None:
        rows.append(("GPU busy in the served burst" + (" (async scheduling)" if "sync" in burst else ""), f">= {100 * burst['busy_target']:.0f}%",
                     f"{100 * burst['gpu_busy_fraction']:.0f}%", burst["gpu_busy_fraction"] >= burst["busy_target"]))
    if not rows:
        return []
    lines = ["", "### Against the issue's targets", "", "| target | wanted | measured | |", "|---|---|---:|---|"]
    return lines + [f"| {name} | {want} | {got} | {'met' if met else 'MISSED'} |" for name, want, got, met in rows]


def render_markdown(payload: dict[str, Any]) -> str:
    env = next((s["data"] for s in payload["steps"] if s["name"] == "environment"), {})
    title = "dry run of the harness on the CPU" if payload["dry_run"] else env.get("device", "GPU")
    lines = [f"# make gpu-check: {title}", "",
             f"{payload['date']}; " + ", ".join(f"{k} {env[k]}" for k in ("torch", "triton", "transformers", "cuda")
                                                if k in env), ""]  # fmt: skip
    if payload["dry_run"]:
        lines += ["No GPU: every figure below is a toy measurement on the CPU that proves the harness runs.", ""]
    if payload.get("running"):
        lines += [f"In progress: the `{payload['running']}` step is running (this report is rewritten after each step).", ""]
    lines += _steps(payload) + _targets(payload)
    for note in payload.get("notes", []):
        lines += ["", f"Note: {note}"]
    for step in payload["steps"]:
        for section in SECTIONS.get(step["name"], ()):
            if step["data"]:
                lines += section(step["data"])
    for step in payload["steps"]:
        if step["status"] in ("fail", "timeout") and step["data"].get("failures"):
            lines += ["", f"### Failures in {step['name']}", "", "```", *step["data"]["failures"], "```"]
    return "\n".join(lines) + "\n"
