"""scripts/import_graph.py on the tree: no circle anywhere, no import from a lower layer to a higher one; and
its two rules do catch a circle and an upward import; the kernels below the engine, the launcher at the CLI's
level."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "import_graph.py"
spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
ig = importlib.util.module_from_spec(spec)
sys.modules["import_graph"] = ig
spec.loader.exec_module(ig)


def test_the_tree_has_no_circle_and_no_upward_import():
    g = ig.graph()
    assert "autoprofile.launch" in g and "models.llama" in g and len(g) > 40
    assert ig.problems(g) == [] and ig.stale(g) == []
    assert ig.summary(g) == f"{len(g)} modules in {len(ig.LAYERS)} layers: 0 circles, 0 upward imports"


def test_the_kernels_sit_below_the_engine_and_import_none_of_it():
    g = ig.graph()
    kernels = [m for m in g if m.startswith("autoprofile.kernels.")]
    assert {"autoprofile.kernels.triton_prefill", "autoprofile.kernels.triton_sample",
            "autoprofile.kernels.aiter_loader"} <= set(kernels)
    assert not any(m.startswith("autoprofile.engine.") and "triton_" in m for m in g)  # every kernel moved
    assert ig.layer_of("autoprofile.kernels.triton_norm") > ig.layer_of("autoprofile.engine.runner")
    assert not any(b.startswith("autoprofile.engine") for m in kernels for b in g[m])
    assert "autoprofile.kernels.triton_prefill" in g["autoprofile.engine.attention.aiter_triton"]
    assert "autoprofile.kernels.triton_sample" in g["autoprofile.engine.sampling"]
    assert ig.problems({"autoprofile.kernels.triton_norm": {"autoprofile.engine.sampling"},
                        "autoprofile.engine.sampling": set()}) == [
        "autoprofile.kernels.triton_norm (kernels) imports autoprofile.engine.sampling (engine): a lower "
        "layer imports a higher one"]


def test_the_launcher_is_at_the_cli_level_and_tp_imports_nothing_above_it():
    g = ig.graph()
    assert ig.layer_of("autoprofile.launch") == ig.layer_of("autoprofile.cli") == 0
    assert {"autoprofile.profiler", "autoprofile.server"} <= g["autoprofile.launch"]
    assert "autoprofile.launch" in g["autoprofile.cli"]
    above = ("autoprofile.launch", "autoprofile.cli", "autoprofile.server", "autoprofile.profiler")
    assert not any(b.startswith(above) for m in g if m.startswith("autoprofile.tp") for b in g[m])
    # the launcher back inside tp/ is a tp module importing the server: reported
    assert ig.problems({"autoprofile.tp.launch": {"autoprofile.server"}, "autoprofile.server": set()})


def test_a_layer_entry_that_names_no_module_is_reported(monkeypatch, capsys):
    monkeypatch.setattr(ig, "LAYERS", (("cli", ("autoprofile.cli", "autoprofile.tp.launch")), *ig.LAYERS[1:]))
    assert ig.stale(ig.graph()) == [("cli", "autoprofile.tp.launch")]
    assert ig.main([]) == 1
    assert "FAIL: autoprofile.tp.launch (layer cli) names no module" in capsys.readouterr().err


def test_models_and_engine_import_one_way_and_the_profiler_not_the_launcher():
    g = ig.graph()
    assert not any(b.startswith("autoprofile.engine") for m in g if m.startswith("models") for b in g[m])
    assert any(b == "models" for b in g["autoprofile.engine.runner"])
    assert not any(b.startswith(("autoprofile.launch", "autoprofile.server", "autoprofile.cli"))
                   for b in g["autoprofile.profiler"])


def test_a_circle_and_an_upward_import_are_both_reported():
    g = ig.graph()
    # config imports budget: a circle
    g["autoprofile.budget"] = g["autoprofile.budget"] | {"autoprofile.config"}
    bad = ig.problems(g)
    assert any("a circle" in b and "autoprofile.budget" in b for b in bad)
    assert any(b.startswith("autoprofile.budget (base) imports autoprofile.config (config)") for b in bad)
    assert ig.problems({"models.llama": {"autoprofile.engine.runner"},
                        "autoprofile.engine.runner": set()}) == [
        "models.llama (models) imports autoprofile.engine.runner (engine): a lower layer imports a higher "
        "one"]


def test_the_script_exits_1_on_a_broken_rule(monkeypatch, capsys):
    assert ig.main([]) == 0
    real = ig.graph
    monkeypatch.setattr(ig, "graph", lambda: {**real(), "autoprofile.memory": {"autoprofile.server"}})
    assert ig.main([]) == 1
    assert "FAIL: autoprofile.memory (base) imports autoprofile.server (server)" in capsys.readouterr().err


def test_the_model_config_sits_at_the_config_floor_and_nothing_below_models_imports_them():
    """The schema's old home (models/config.py in the base layer) hid layers.quant's import back up."""
    g = ig.graph()
    assert ig.layer_of("autoprofile.model_config") == ig.layer_of("autoprofile.config")
    assert "models.config" not in g  # no alias left behind: every importer names the new module
    assert all(ig.layer_of(m) == ig.layer_of("models.llama") for m in g if m.split(".")[0] == "models")
    below = [m for m in g if ig.layer_of(m) > ig.layer_of("models.llama")]
    assert "autoprofile.layers.quant" in below and "autoprofile.config" in below
    assert [(m, b) for m in below for b in g[m] if b.split(".")[0] == "models"] == []
    assert "autoprofile.model_config" in g["autoprofile.layers.quant"]
    assert not any(b.startswith("autoprofile.") for b in g["autoprofile.model_config"])
