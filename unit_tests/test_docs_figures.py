"""The figures in README.md and docs/measurements.md agree with docs/measured_kv_tokens.csv (what the profiler
measured, the CSV CI checks `plan` against) and with `plan` itself, so no page drifts from the measurement."""
from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from autoprofile.plan import GPUS, make_plan
from unit_tests.test_failures import measured_config, record_rules

ROOT = Path(__file__).resolve().parents[1]
MEASUREMENTS = ROOT / "docs" / "measurements.md"
NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+")
CARDS = {"H100": "h100", "H200": "h200"}


def csv_rows() -> list[dict]:
    with open(ROOT / "docs" / "measured_kv_tokens.csv", newline="") as f:
        return list(csv.DictReader(f))


def measured(model: str, card: str, kv: str = "auto") -> int:
    key = (model, card, kv)
    hits = [int(r["tokens"]) for r in csv_rows() if (r["model"], r["card"], r["kv_cache_dtype"]) == key]
    assert len(hits) == 1, f"docs/measured_kv_tokens.csv has {len(hits)} rows for {model} {card} {kv}"
    return hits[0]


def planned(model: str, card: str, kv: str = "auto", command: str = "", date: str = "") -> int:
    """`plan` for a measured row's configuration and kernel rules (test_failures.measured_config,
    record_rules)."""
    with record_rules(date):
        return make_plan(measured_config(model, kv, command, date), GPUS[card]).tokens


def number(cell: str) -> int:
    m = NUMBER.search(cell)
    assert m, f"no figure in {cell!r}"
    return int(m.group().replace(",", ""))


def tables(text: str) -> list[list[list[str]]]:
    """Every markdown table of `text`: its rows (the header first, the |---| line left out) as cells."""
    out, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):
                rows.append(cells)
        elif rows:
            out.append(rows)
            rows = []
    return out


def table(text: str, header_start: str) -> list[list[str]]:
    found = [t for t in tables(text) if "|".join(t[0]).startswith(header_start)]
    assert len(found) == 1, f"{len(found)} tables whose header starts {header_start!r}"
    return found[0]


def test_tables_reads_cells_rows_and_separate_tables():
    text = "a\n| x | y |\n|---|---|\n| 1 | 2,000 |\n\n| z |\n|:-:|\n| 3 |\ntext\n"
    assert tables(text) == [[["x", "y"], ["1", "2,000"]], [["z"], ["3"]]]
    assert number("1,987,760 (1.99x)") == 1987760


def test_plan_table_is_every_csv_row_with_plan_today():
    rows = table(MEASUREMENTS.read_text(), "model|card|KV dtype|measured KV tokens|plan")[1:]
    want = [(r["model"], r["card"], r["kv_cache_dtype"], int(r["tokens"]), r["date"]) for r in csv_rows()]
    got = [(m.split(" (")[0], c.lower(), kv, number(t), d) for m, c, kv, t, _, _, d in rows]
    assert got == want, "the plan table must list docs/measured_kv_tokens.csv's rows, in order"
    for (model, card, kv, tokens, _), cells, row in zip(want, rows, csv_rows()):
        plan = planned(model, card, kv, row["command"], row["date"])
        assert number(cells[4]) == plan, f"{model} {card} {kv}: `plan` says {plan:,}, the table {cells[4]}"
        assert cells[5] == f"{(plan - tokens) / tokens * 100:+.1f}%", (model, card, kv, cells[5])


def test_fp8_kv_table_matches_the_csv():
    rows = table(MEASUREMENTS.read_text(), "model, default profile|H100 bf16|H100 fp8|H200 bf16|H200 fp8")
    cols = [(CARDS[h.split()[0]], "auto" if h.split()[1] == "bf16" else "fp8_e4m3") for h in rows[0][1:]]
    assert len(rows) == 4
    for model, *cells in rows[1:]:
        for (card, kv), cell in zip(cols, cells):
            assert number(cell) == measured(model, card, kv), f"{model} {card} {kv}: {cell}"
            ratio = re.search(r"\((\d\.\d\d)x\)", cell)
            if ratio:  # the FP8 cache against the bf16 cache on the same card
                want = round(measured(model, card, kv) / measured(model, card), 2)
                assert float(ratio.group(1)) == want, cell


def test_moe_and_mla_table_matches_the_csv_and_plan():
    rows = table(MEASUREMENTS.read_text(), "model, card|KV tokens|plan|")[1:]
    assert len(rows) == 2
    for name, kv_cell, plan_cell, *_ in rows:
        model, card = (s.strip() for s in name.split(","))
        key = (model, CARDS[card], "auto")
        row = next(r for r in csv_rows() if (r["model"], r["card"], r["kv_cache_dtype"]) == key)
        tokens = measured(model, CARDS[card])
        plan = planned(model, CARDS[card], "auto", row["command"], row["date"])  # under the row's rules
        assert number(kv_cell) == tokens, f"{name}: {kv_cell}, the CSV {tokens:,}"
        assert number(plan_cell) == plan, f"{name}: {plan_cell}, `plan` says {plan:,} today"
        assert f"({(plan - tokens) / tokens * 100:.1f}%)" in plan_cell, plan_cell


def deterministic_costs(text: str) -> list[dict[int, int]]:
    """{concurrency: cost %} of each --deterministic table, its cost checked against its throughputs."""
    out = []
    for t in tables(text):
        if "with `--deterministic`" not in t[0]:
            continue
        costs = {}
        for conc, default, det, cost, *_ in t[1:]:
            rate, rate_det = int(default.replace(",", "")), int(det.replace(",", ""))
            assert cost == f"{round((1 - rate_det / rate) * 100)}%", (conc, default, det, cost)
            costs[int(conc)] = int(cost.rstrip("%"))
        out.append(costs)
    return out


def test_deterministic_costs_agree_with_their_throughputs_and_the_text():
    text = MEASUREMENTS.read_text()
    one_gpu, tp2 = deterministic_costs(text)
    assert tp2 == {1: 17, 256: 8}
    pages = {p.name: p.read_text() for p in (ROOT / "README.md", MEASUREMENTS, ROOT / "docs/design.md")}
    stated = r"`--deterministic` costs (\d+)% at concurrency 256 and (\d+)% at 1"
    claims = [(name, int(m.group(1)), int(m.group(2))) for name, page in pages.items()
              for m in re.finditer(stated, page)]
    claims += [(name, int(m.group(1)), one_gpu[1]) for name, page in pages.items()
               for m in re.finditer(r"about (\d+)% of throughput at concurrency 256", page)]
    assert claims, "no text states the --deterministic cost"
    for name, at256, at1 in claims:
        assert (at256, at1) == (one_gpu[256], one_gpu[1]), f"{name}: {at256}% / {at1}%, the table {one_gpu}"


def test_every_large_figure_in_the_readme_is_a_checked_measurement():
    """The README quotes KV-token figures only from the CSV (the rest of its figures are in docs/)."""
    allowed = {int(r["tokens"]) for r in csv_rows()}
    text = (ROOT / "README.md").read_text()
    big = {int(m.group().replace(",", "")) for m in NUMBER.finditer(text)} - {1000, 1024}
    stray = sorted(n for n in big if n >= 100_000 and n not in allowed)
    assert not stray, f"README figures not in docs/measured_kv_tokens.csv: {stray}"


@pytest.mark.parametrize("page", ["README.md", "docs/design.md", "docs/server.md", "docs/measurements.md"])
def test_links_between_the_pages_resolve(page):
    path = ROOT / page
    for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", path.read_text()):
        assert (path.parent / target).exists(), f"{page} links to {target}, which does not exist"
