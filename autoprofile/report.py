"""The budget report: a log table, a JSON file and a PNG timeline of reserved/free memory."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

from autoprofile.budget import gib
from autoprofile.engine.kv_cache import KV_SCALE_TEXT
from autoprofile.engine.stress import CORNER
from autoprofile.timeline_plot import draw

ROOT = Path(__file__).resolve().parents[1]  # the folder holding the package: the plotting process imports it

log = logging.getLogger(__name__)

VISION_TERMS = ("vision_weights", "encoder_buffer")  # shown for vision-language models only
OPTIONAL_TERMS = (*VISION_TERMS, "state_cache")  # shown where the model has them (state_cache: hybrid models)
ROWS = (  # (term key, label, how it was obtained)
    ("total", "GPU total", "driver"),
    ("weights", "weights", "measured"),
    ("cuda_context_non_torch", "CUDA context + non-torch", "measured"),
    ("non_kv_peak", "non-KV peak (weights+activations+graphs)", "measured"),
    ("graph_pools", "decode graph pools (incl. warmup)", "measured"),
    ("workspace_declared", "attention workspace (declared)", "declared"),
    ("request_table", "request table", "declared"),
    ("state_cache", "state slots (hybrid: conv + delta-rule states)", "declared"),
    ("vision_weights", "vision encoder weights (in weights)", "measured"),
    ("encoder_buffer", "encoder output buffer (in non-KV peak)", "declared"),
    ("peers", "peers on this GPU", "measured"),
    ("canary", "canary (held through validation)", "config"),
    ("driver_reserve", "driver reserve (never planned)", "config"),
    ("kv", "KV cache", "built"),
    ("reserved_after", "reserved by this process after", "measured"),
    ("free_after", "free on the GPU after (headroom)", "measured"),
)


def weight_format(cfg) -> str:
    """The weights' dtype and scale layout (ModelConfig.weight_format): "bf16", "fp8_e4m3 (block 128x128,
    ...)"."""
    mc = getattr(cfg, "model_config", None)
    return "unknown" if mc is None else mc.weight_format


def to_dict(result) -> dict:
    m = result.measurement
    return {
        "model": result.cfg.model,
        "tp": result.cfg.tp,
        "attention_backend": result.cfg.attention_backend,
        "kv_cache_dtype": result.cfg.kv_dtype_name,
        "weights": weight_format(result.cfg),
        "kv_scales": result.kv_scales,
        "max_total_token_num": result.tokens,
        "max_req_total_len": getattr(result.cfg, "context_len", None),
        "context_cut_from": getattr(result, "context_cut_from", None),
        "kv_gib": gib(result.kv_bytes),
        "cell_bytes": result.cell_bytes,
        "pinned": result.pinned,
        "reused_probe": result.reused_probe,
        "attempts": result.attempts,
        "initial_target": result.initial_target,
        "probe_tokens": result.probe_tokens,
        "measurement": asdict(m) if m else None,
        "terms_bytes": result.terms,
        "phases_s": dict(result.phases),
        "phase_steps_s": [list(step) for step in getattr(result, "phase_steps", ())],
        "timeline": [asdict(s) for s in result.samples],
        "errors": result.errors,
        "stack_limit_bytes": result.stack_limit,
        "local_memory_bytes": result.local_memory,
        "forced_routings": list(result.forced_routings),
        "host_kv_pages": getattr(result, "host_kv_pages", 0),
        "host_kv_gib": gib(getattr(result, "host_kv_bytes", 0)),
        "state_slots": getattr(result, "state_slots", 0),
    }


SLOWEST_CORNERS = 3  # the stress corners a phase's report names


def phase_steps_lines(steps) -> list[str]:
    """A line a phase with timed steps: "    probe: graphs 9.6s, stress prefill 11.9s, stress decode 0.3s"
    (what the rest of the phase spent: the build, the KV, the measurement); and its slowest stress corners
    (each one a step named stress.CORNER + its label; all of them in the JSON's phase_steps_s)."""
    by_phase: dict[str, list[str]] = {}
    corners: dict[str, list[tuple[float, str]]] = {}
    for phase, step, seconds in steps:
        if step.startswith(CORNER):
            corners.setdefault(phase, []).append((seconds, step.removeprefix(CORNER)))
        else:
            by_phase.setdefault(phase, []).append(f"{step} {seconds:.2f}s")
    lines = []
    for phase, parts in by_phase.items():
        lines.append(f"    {phase}: " + ", ".join(parts))
        slowest = sorted(corners.get(phase, []), reverse=True)[:SLOWEST_CORNERS]
        if slowest:
            lines.append(f"      slowest of {len(corners[phase])} stress corners: "
                         + "; ".join(f"{label} {s:.2f}s" for s, label in slowest))
    return lines


def format_report(result) -> str:
    lines = [f"autoprofile budget report: {result.cfg.model}, tp={result.cfg.tp}, "
             f"backend={result.cfg.attention_backend}, KV {result.cfg.kv_dtype_name}"
             + (f" (scales: {KV_SCALE_TEXT[result.kv_scales]})" if result.kv_scales else ""),
             f"  weights {weight_format(result.cfg)}",
             f"  {'term':<44}{'GiB':>10}  source"]
    lines += [f"  {label:<44}{gib(result.terms.get(key, 0)):>10.2f}  {src}" for key, label, src in ROWS
              if key not in OPTIONAL_TERMS or result.terms.get(key)]
    how = "pinned by --max_total_token_num" if result.pinned else (
        f"probe {result.probe_tokens} tokens, initial target {result.initial_target}"
        + (f" (the probe of {result.reused_probe}, from the profile cache)" if result.reused_probe else ""))
    lines.append(f"  max_total_token_num = {result.tokens} tokens ({gib(result.kv_bytes):.2f} GiB KV, "
                 f"{result.cell_bytes} B/token) after {result.attempts} attempt(s); {how}")
    context, cut = getattr(result.cfg, "context_len", None), getattr(result, "context_cut_from", None)
    if context is not None:
        why = f" (auto: the model's {cut} do not fit; one request of {context} and the pad page do)"
        lines.append(f"  max_req_total_len = {context} tokens" + (why if cut else ""))
    if getattr(result, "host_kv_pages", 0):
        tokens = result.host_kv_pages * result.cfg.page_size
        lines.append(f"  host KV tier (--host_kv {result.cfg.host_kv}): {result.host_kv_pages} pages "
                     f"({tokens} tokens, {gib(result.host_kv_bytes):.2f} GiB of host memory a rank): "
                     "the prefix cache's evicted pages, copied back on a hit")
    if getattr(result, "state_slots", 0):
        lines.append(f"  state slots = {result.state_slots} (one per request slot: --running_max_req_size; "
                     f"{gib(result.terms.get('state_cache', 0)):.2f} GiB declared beside the KV)")
    lines.append("  phases: " + ", ".join(f"{n} {t:.2f}s" for n, t in result.phases))
    lines += phase_steps_lines(getattr(result, "phase_steps", ()))
    if result.stack_limit is not None:
        lines.append(f"  local memory: stack limit {result.stack_limit} B/thread after the stress, "
                     f"{gib(result.local_memory):.2f} GiB reserved by the driver (inside non-torch)")
    if result.forced_routings:
        m = result.cfg.model_config
        forced = " and ".join(result.forced_routings)
        lines.append(f"  experts: the stress's most-token corners also ran under {forced} routing (worst: "
                     f"every token to the same {m.num_experts_per_tok} of {m.num_experts} experts)")
    if result.errors:
        lines.append("  retried after: " + " | ".join(result.errors))
    return "\n".join(lines)


def write_report(result, out_dir: str | Path, plot_later: bool = False) -> tuple[Path, Path | None]:
    """The JSON now; the memory timeline's PNG now, or in a process of its own (plot_later: a server's boot,
    which is healthy without it; timeline_plot says why not a thread). The process outlives a server stopped
    right after its boot, so the PNG is still left."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "budget_report.json"
    report = to_dict(result)
    js.write_text(json.dumps(report, indent=2) + "\n")
    png = out / "budget_timeline.png" if result.samples else None
    if png is not None and plot_later:
        plot_apart(js, png)
    elif png is not None:
        draw(report, png)
    log.info("budget report written: %s%s", js, f", {png}{' (drawing)' if plot_later else ''}" if png else "")
    return js, png


def plot_apart(js: Path, png: Path) -> subprocess.Popen:
    """`python -m autoprofile.timeline_plot js png`, reaped by a thread that only waits (no GIL held)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                                       if p)}
    proc = subprocess.Popen([sys.executable, "-m", "autoprofile.timeline_plot", str(js), str(png)], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    threading.Thread(target=proc.wait, name="budget-timeline", daemon=True).start()
    return proc
