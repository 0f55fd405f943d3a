"""The built-in FP8 tiny models served on CPU (torch backend): random weights quantized at load, the
envelope's stress corners (the MoE's forced routings too), generation through the engine, /health and the
report naming the weight format."""
from __future__ import annotations

import asyncio

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from autoprofile import profiler, server
from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine import weights
from autoprofile.engine.runner import ModelRunner
from autoprofile.layers.quant import FP8, dequantize_weight, quantize_weight
from unit_tests.cpu_server import boot_cpu


def config(model: str, **kw) -> ServerConfig:
    return validate(ServerConfig(model=model, dtype="float32", attention_backend="torch",
                                 max_req_total_len=128, batch_max_tokens=64, running_max_req_size=4,
                                 graph_max_batch_size=4,
                                 report_dir=None, **kw))


@pytest.mark.parametrize("model", ["tiny-fp8", "tiny-moe-fp8", "tiny-mla-fp8"])
def test_fp8_tiny_models_run_the_stress_and_serve(model):
    runner = ModelRunner(config(model))
    runner.build(1024)
    try:
        assert any(p.dtype == FP8 for p in runner.model.parameters())
        runner.stress_prefill()
        runner.stress_decode()
        out = LLMEngine(runner).generate([[3, 4, 5], [9] * 40, list(range(10, 100))], max_tokens=5)
        assert [len(o) for o in out] == [5, 5, 5]
    finally:
        runner.teardown()


@pytest.mark.parametrize("experts_at_once", [None, 3])
@pytest.mark.parametrize("model,flags", [("tiny-moe-fp8", {}), ("tiny-moe", {"quantization": "fp8"})])
def test_random_fp8_weights_are_their_bf16_twin_quantized(model, flags, experts_at_once, monkeypatch):
    """Same seed: every FP8 weight and scale is the quantization of the plain model's weight (drawn in the
    same order, one layer at a time), so an FP8 run's numbers are comparable with the bf16 one's. The experts
    are drawn several at a time (weights.DRAW_ELEMENTS; 3: groups of 3 of the 16 and a last one of 1)."""
    if experts_at_once:  # an expert's gate_up [256, 256] is the larger: 3 of those, 6 of down's [256, 128]
        monkeypatch.setattr(weights, "DRAW_ELEMENTS", experts_at_once * 256 * 256)
    fp8 = ModelRunner(config(model, **flags)).model
    twin = dict(ModelRunner(config("tiny-moe")).model.named_parameters())
    params = dict(fp8.named_parameters())
    checked = 0
    for name, p in params.items():
        if p.dtype != FP8:
            if not name.endswith("_scale"):
                assert torch.equal(p, twin[name]), name
            continue
        quant = fp8.get_submodule(name.rpartition(".")[0]).quant
        w = twin[name]
        pairs = [quantize_weight(w[e], quant) for e in range(w.shape[0])] if w.dim() == 3 else [
            quantize_weight(w, quant)]
        q, s = (torch.stack(t) for t in zip(*pairs)) if w.dim() == 3 else pairs[0]
        assert torch.equal(p.float(), q.float()) and torch.equal(params[name + "_scale"], s), name
        assert ((dequantize_weight(p, s, quant) - w).norm() / w.norm()) < 0.05
        checked += 1
    assert checked == 4 * 4  # qkv, o and (dense gate_up, down or the experts' two) in each of 4 layers


def test_experts_drawn_at_once_only_where_no_block_spans_two():
    assert weights.expert_group(128, 1536, 2048, 128) == weights.DRAW_ELEMENTS // (1536 * 2048)
    assert weights.expert_group(16, 256, 256, 32) == 16  # all of them under the bound
    assert weights.expert_group(16, 200, 256, 128) == 1  # 200 rows: a 128-row block would span two experts
    assert weights.expert_group(8, 1 << 14, 1 << 14, 1) == 1  # one expert past the bound: still one


def test_health_and_report_name_the_weight_format():
    from autoprofile.report import format_report, to_dict
    cfg = config("tiny-fp8")
    runner, result = boot_cpu(cfg)
    try:
        engine = LLMEngine.from_config(runner, cfg)

        async def go():
            async with TestClient(TestServer(server.make_app(cfg, engine, result))) as client:
                return await (await client.get("/health")).json()
        health = asyncio.run(go())
    finally:
        runner.teardown()
    assert health["weights"] == "fp8_e4m3 (block 32x32, dynamic per-group activations)"
    assert config("tiny").model_config.weight_format == "bf16"

    result = profiler.ProfileResult(cfg, 1024, 2, False, 1, 1024, 16, None, {}, [], [], [])
    assert "  weights fp8_e4m3 (block 32x32, dynamic per-group activations)" in format_report(result)
    assert to_dict(result)["weights"] == "fp8_e4m3 (block 32x32, dynamic per-group activations)"
