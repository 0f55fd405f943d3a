"""The budget report's PNG: memory reserved by this process, used on the GPU and free, over the profile's
timeline with its phases, drawn from budget_report.json (no torch here).

A server draws it in a process of its own (report.write_report, plot_later: `python -m
autoprofile.timeline_plot JSON PNG`): matplotlib's import and the drawing took 1.0-2.4 s of an H100 boot, all
of it holding the GIL, and on a thread of the server they ran beside the first requests served (seen in a
cProfile of a c256 run on an H200), sharing the GIL with the event loop and the engine thread.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from autoprofile.budget import gib  # (no torch: the plotting process imports none)


def draw(report: dict, path: Path) -> Path:
    # matplotlib's object API (Figure draws with Agg, no pyplot state)
    from matplotlib.figure import Figure

    s = report["timeline"]
    t = [x["t"] for x in s]
    fig = Figure(figsize=(11, 5))
    ax = fig.subplots()
    ax.step(t, [gib(x["reserved"]) for x in s], where="post", label="reserved by this process", lw=2)
    ax.step(t, [gib(x["total"] - x["free"]) for x in s], where="post",
            label="used on the GPU (all processes)", lw=1.2)
    ax.step(t, [gib(x["free"]) for x in s], where="post", label="free on the GPU", lw=1.2, ls="--")
    total = gib(s[0]["total"])
    ax.axhline(total, color="grey", lw=0.8, ls=":", label="GPU total")
    starts = {x["label"][:-6]: x["t"] for x in s if x["label"].endswith(":start")}
    for i, x in enumerate(e for e in s if e["label"].endswith(":end")):
        name = x["label"][:-4]
        t0 = starts.get(name, x["t"])
        ax.axvspan(t0, x["t"], alpha=0.08, color=f"C{i % 10}")
        ax.text((t0 + x["t"]) / 2, total * 0.98, name, ha="center", va="top", fontsize=8, rotation=90)
    ax.set_xlabel("seconds since profiler start")
    ax.set_ylabel("GiB")
    ax.set_title(f"autoprofile: {report['model']}: {report['max_total_token_num']} KV tokens "
                 f"({report['kv_gib']:.1f} GiB), {report['attempts']} attempt(s)")
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    js, png = argv if argv is not None else sys.argv[1:]
    draw(json.loads(Path(js).read_text()), Path(png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
