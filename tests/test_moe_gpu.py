"""GPU: the experts through AITER's Triton MoE kernels against the torch reference, under each routing; the
memory a step of experts holds, worst routing against balanced, measured; an MoE model's profile and
serving through the decode graphs."""
from __future__ import annotations

import json

import pytest
import torch

from autoprofile import budget
from autoprofile.layers.moe import Routing, moe_reference, route
from tests.conftest import require_backend
from tests.test_sampling_gpu import _peak as peak_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# qwen3-30b-a3b's experts: 128 of 768, top-8, hidden 2048
E, K, H, I = 128, 8, 2048, 768


def experts(e: int, h: int, i: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=g).mul_(h ** -0.5).bfloat16()
    w2 = torch.randn(e, h, i, device="cuda", generator=g).mul_(i ** -0.5).bfloat16()
    return w13, w2


def routed(tokens: int, e: int, k: int, h: int, routing: str, seed: int = 1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
    weights, ids = route(torch.randn(tokens, e, device="cuda", generator=g).bfloat16(), k, True)
    r = Routing(torch.device("cuda"))
    r.set(routing)
    return x, weights, r.apply(ids, e)


@pytest.mark.parametrize("routing", ["model", "worst", "balanced"])
@pytest.mark.parametrize("tokens", [1, 7, 16, 300, 2048])
def test_aiter_triton_experts_match_the_torch_reference(tokens, routing):
    require_backend("aiter_triton")
    from autoprofile.kernels import triton_moe
    w13, w2 = experts(E, H, I)
    x, weights, ids = routed(tokens, E, K, H, routing)
    got = triton_moe.fused_moe(x, w13, w2, weights, ids).float()
    want = moe_reference(x.float(), w13.float(), w2.float(), weights.float(), ids)
    err = (got - want).norm() / want.norm()
    assert err < 1e-2, (tokens, routing, float(err))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("tokens", [1, 2, 4, 5])
def test_the_experts_run_as_gemvs_where_the_rule_says_and_both_paths_match_the_reference(tokens, fp8,
                                                                                          monkeypatch):
    """fused_moe sends a step of few (token, slot) pairs to the experts' GEMVs (launch_rules.moe_gemv), the
    rest to AITER's blocked kernels; each path against its own torch reference: FP8 block-scaled experts as
    W8A16 (the GEMVs: the dequantized weights, x as it is) or W8A8 (the blocked kernels: activations
    quantized)."""
    require_backend("aiter_triton")
    from autoprofile.kernels import launch_rules, triton_moe, triton_moe_gemv
    from autoprofile.layers.quant import dequantize_weight, moe_reference_fp8
    from tests.test_fp8_gpu import BLOCK, fp8_experts
    x, weights, ids = routed(tokens, E, K, H, "model")
    if fp8:
        w13, w2, quant = fp8_experts(BLOCK, E, H, I)
        d13, d2 = dequantize_weight(w13, quant.w13_scale, BLOCK), dequantize_weight(w2, quant.w2_scale, BLOCK)
    else:
        (w13, w2), quant = experts(E, H, I), None
        d13, d2 = w13.float(), w2.float()
    calls = []
    real = triton_moe_gemv.experts
    monkeypatch.setattr(triton_moe_gemv, "experts", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = triton_moe.fused_moe(x, w13, w2, weights, ids, quant).float()
    gemv = launch_rules.moe_gemv(tokens * K)
    assert len(calls) == gemv, (tokens, fp8, calls)
    if gemv or not fp8:
        want = moe_reference(x.float(), d13, d2, weights.float(), ids)
        tol = 1e-2
    else:
        want = moe_reference_fp8(x.float(), w13, w2, weights.float(), ids, quant)
        tol = 3e-2  # (test_fp8_gpu: the blocked kernel rounds silu(gate) * up to bf16 before quantizing it)
    err = (got - want).norm() / want.norm()
    assert err < tol, (tokens, fp8, gemv, float(err))


@pytest.mark.parametrize("tokens", [4, 16, 4096])
def test_worst_routing_holds_more_than_balanced_in_the_reference_and_the_same_in_the_kernels(tokens):
    """Measured: the torch reference gathers each expert's tokens, so the worst routing (every token on the
    same experts) holds ~E/k times the balanced case's per-expert temporaries; the kernels allocate by
    the tokens alone, the same under every routing, and no more than budget.moe_scratch_bytes (4 tokens:
    32 pairs, the experts' GEMVs; 16 and 4,096: AITER's blocked path)."""
    require_backend("aiter_triton")
    from autoprofile.kernels import triton_moe
    w13, w2 = experts(E, H, I)
    peaks = {}
    for routing in ("balanced", "worst"):
        x, weights, ids = routed(tokens, E, K, H, routing)
        peaks["reference", routing] = peak_bytes(lambda: moe_reference(x, w13, w2, weights, ids))
        triton_moe.fused_moe(x, w13, w2, weights, ids)  # compiled before it is measured
        peaks["aiter_triton", routing] = peak_bytes(lambda: triton_moe.fused_moe(x, w13, w2, weights, ids))
    print(json.dumps({f"{a} {b}": v for (a, b), v in peaks.items()}))
    if tokens * K > E:
        assert peaks["reference", "worst"] > 2 * peaks["reference", "balanced"]
    assert peaks["aiter_triton", "worst"] == peaks["aiter_triton", "balanced"]
    declared = budget.moe_scratch_bytes(tokens, K, E, I, H, 2)
    assert peaks["aiter_triton", "worst"] <= declared + (1 << 20), (peaks, declared)  # allocator rounding


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-deepseek-v3"])
def test_an_moe_model_profiles_and_serves_through_the_decode_graphs(model):
    """tiny-moe and tiny-deepseek-v3 (noaux_tc's grouped router, MLA) on aiter_triton: the stresses (worst and
    balanced routing corners included) run, the decode graphs capture the experts, and requests are served
    through them."""
    require_backend("aiter_triton")
    from autoprofile.config import ServerConfig, validate
    from autoprofile.engine.engine import LLMEngine
    from autoprofile.engine.runner import ModelRunner
    cfg = validate(ServerConfig(model=model, attention_backend="aiter_triton", max_req_total_len=2048,
                                batch_max_tokens=2048, running_max_req_size=64, graph_max_batch_size=16,
                                report_dir=None))
    runner = ModelRunner(cfg)
    runner.build(64 * 1024)
    try:
        assert runner.graphs is not None and runner.use_graphs
        shapes = runner.stress_prefill() + runner.stress_decode()
        assert shapes and runner.routing.current == "model"
        prompts = [[5, 6, 7, 8], list(range(100, 400)), [9] * 50]
        out = LLMEngine(runner).generate(prompts, max_tokens=16)
        assert [len(o) for o in out] == [16, 16, 16]
    finally:
        runner.teardown()


def test_the_one_launch_router_compiled_and_captured_on_the_gpu():
    """kernels.triton_route compiled: the interpreter test's checks against route + Routing.apply, then one
    capture replayed under each routing (the mode is read on the device)."""
    require_backend("aiter_triton")
    from unit_tests.interpreter import run_script
    from unit_tests.test_triton_route import ROUTE
    run_script(ROUTE, "cuda", interpret=False)


def test_the_grouped_router_compiled_and_captured_on_the_gpu():
    """kernels.triton_route.biased_grouped_topk compiled (libdevice's exp, as torch's sigmoid): the interpreter
    tests' checks against layers.moe.biased_grouped_topk + Routing.apply, hypothesis included, then one capture
    replayed under each routing."""
    require_backend("aiter_triton")
    from unit_tests.interpreter import run_script
    from unit_tests.test_triton_route_grouped import FIXED, HYPOTHESIS
    run_script(FIXED, "cuda", interpret=False)
    run_script(HYPOTHESIS, "cuda", "300", interpret=False)
