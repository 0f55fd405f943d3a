"""Startup cost of the two-pass auto-profile vs a single-pass build at the same size, side by side.

Each run is a fresh process (same Triton/JIT cache state for the two compared runs):
  1. auto-profile (warms the JIT caches; its result gives the size)
  2. single pass: --max_total_token_num <that size>
  3. auto-profile again
and prints the phase times of 2 and 3 and their ratio.
    PYTHONPATH=. python3 scripts/bench_startup.py --model llama-3.1-8b --max_req_total_len 32768 --out DIR
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def run(args: list[str], report_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "autoprofile.cli", "profile", *args, "--report_dir", str(report_dir)]
    subprocess.run(cmd, check=True)
    return json.loads((report_dir / "budget_report.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    args, passthrough = p.parse_known_args()
    out = Path(args.out)
    warm = run(passthrough, out / "auto_warmup")
    single = run(passthrough + ["--max_total_token_num", str(warm["max_total_token_num"])], out / "single")
    auto = run(passthrough, out / "auto")
    rows = {"single-pass": single, "two-pass": auto}
    print(f"{'run':<12}{'tokens':>10}{'KV GiB':>9}  phases (s)")
    for name, r in rows.items():
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r["phases_s"].items())
        print(f"{name:<12}{r['max_total_token_num']:>10}{r['kv_gib']:>9.2f}  {phases}  total "
              f"{sum(r['phases_s'].values()):.2f}")
    ratio = sum(auto["phases_s"].values()) / sum(single["phases_s"].values())
    print(f"two-pass / single-pass startup time: {ratio:.2f}x")
    (out / "startup.json").write_text(json.dumps({"single": single["phases_s"], "auto": auto["phases_s"],
                                                  "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
