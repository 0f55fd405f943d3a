"""Hybrid models (Qwen3.5: Gated DeltaNet + attention) on the GPU: fla-core's delta-rule kernels over states
gathered by slot against the torch reference, and the tiny hybrid model profiled and served through the AITER
Triton backend with its decode graphs (padded rows on the pad state slot) against the torch backend."""
from __future__ import annotations

import pytest
import torch

from autoprofile.config import ServerConfig, validate
from autoprofile.layers import gdn
from tests.conftest import require_backend

pytestmark = pytest.mark.gpu


def _inputs(t: int, hk: int, hv: int, d: int, dev):
    g = torch.Generator(device=dev).manual_seed(t)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
    q, k, v = r(t, hk, d).bfloat16(), r(t, hk, d).bfloat16(), r(t, hv, d).bfloat16()
    gate = -torch.rand(t, hv, device=dev, generator=g) * 0.5
    beta = torch.rand(t, hv, device=dev, generator=g).bfloat16()
    return q, k, v, gate, beta


def test_fla_prefill_and_decode_equal_the_reference_over_states_by_slot():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gdn.fla_ops()  # fla-core is a dependency on Linux: without it this raises naming the install
    dev, hk, hv, d = torch.device("cuda"), 4, 8, 128
    lens = [1, 77, 300, 5]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev)
    slots = torch.tensor([6, 2, 0, 4], device=dev)
    q, k, v, g, beta = _inputs(sum(lens), hk, hv, d, dev)
    ssm = torch.randn(8, hv, d, d, device=dev) * 0.05
    ref_ssm = ssm.clone()
    out = gdn.delta_rule_prefill(q, k, v, g, beta, ssm, slots, cu)
    ref = torch.empty_like(out)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o, s = gdn.chunked_delta_rule(*gdn._expand(q[a:b], k[a:b], hv), v[a:b], g[a:b], beta[a:b],
                                      ref_ssm[slots[i]].clone())
        ref[a:b], ref_ssm[slots[i]] = o.to(ref.dtype), s
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < 2e-2, err
    torch.testing.assert_close(ssm, ref_ssm, rtol=5e-2, atol=5e-3)
    untouched = [1, 3, 5, 7]
    assert torch.equal(ssm[untouched], ref_ssm[untouched])
    q, k, v, g, beta = _inputs(4, hk, hv, d, dev)
    before = ssm.clone()
    out = gdn.delta_rule_decode(q, k, v, g, beta, ssm, slots)
    with torch.device("cpu"):
        ref = gdn.delta_rule_decode(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), before.cpu(), slots.cpu())
    err = (out.float().cpu() - ref.float()).norm() / ref.float().norm()
    assert err < 2e-2, err


def test_triton_prefill_layer_equals_the_reference_on_qwen3_5_widths():
    """The GPU backend's prefill layer (our conv's two launches, fla's rule with the key heads grouped, our
    gated norm) against layers.gdn.prefill_layer on the CPU (the torch conv, the chunked rule over repeated
    key heads), at qwen3.5-27b's widths: rows of 1, 3, 700 and 64 tokens from their slots' windows and
    states."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gdn.fla_ops()  # fla-core is a dependency on Linux: without it this raises naming the install
    from autoprofile.kernels import triton_gdn
    dev, hk, kd, hv, vd, kw = torch.device("cuda"), 16, 128, 48, 128, 4
    c, lens = 2 * hk * kd + hv * vd, [1, 3, 700, 64]
    g = torch.Generator().manual_seed(0)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale)  # noqa: E731
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.tensor([5, 0, 3, 6])
    t = sum(lens)
    qkvz = r(t, c + hv * vd).bfloat16()
    ba = r(t, 2 * hv, scale=3.0).bfloat16()
    weight, a_log, dt_bias, norm = r(c, kw, scale=0.5).bfloat16(), r(hv, scale=0.5), r(hv), r(vd).bfloat16()
    conv, ssm = r(8, c, kw - 1).bfloat16(), r(8, hv, kd, vd, scale=0.05)
    args = lambda d: [x.to(d) for x in (*qkvz.split([c, hv * vd], dim=-1), ba, weight, a_log, dt_bias, norm)]  # noqa
    ref_conv, ref_ssm = conv.clone(), ssm.clone()
    want = gdn.prefill_layer(*args("cpu"), 1e-6, ref_conv, ref_ssm, slots, cu)
    qkv, z, ba_d, w, al, db, nw = args(dev)
    conv_d, ssm_d, slots_d, cu_d = conv.to(dev), ssm.to(dev), slots.to(dev), cu.to(dev)
    q, k, v = triton_gdn.conv_prefill(qkv, w, conv_d, slots_d, cu_d, hk, kd, hv, vd)
    g_ours, beta_ours = triton_gdn.gates(ba_d, al, db)  # the backend's one-launch gates
    g_ref, beta_ref = gdn.gating(ba_d, al, db)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-5)
    assert (beta_ours.float() - beta_ref.float()).abs().max() <= 1e-2
    ssm_chunks = ssm_d.clone()  # the rule again with the chunk indices the runner uploads with a step
    o = gdn.delta_rule_prefill(q, k, v, *gdn.gating(ba_d, al, db), ssm_d, slots_d, cu_d)
    o_chunks = gdn.delta_rule_prefill(q, k, v, *gdn.gating(ba_d, al, db), ssm_chunks, slots_d, cu_d.long(),
                                      torch.from_numpy(gdn.chunk_indices(cu.numpy())).to(dev))
    assert torch.equal(o_chunks, o) and torch.equal(ssm_chunks, ssm_d)
    got = triton_gdn.gated_rms_norm(o, z, nw, 1e-6).cpu()
    assert torch.equal(conv_d.cpu(), ref_conv)
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < 2e-2, err
    err = (ssm_d.cpu() - ref_ssm).norm() / ref_ssm.norm()
    assert err < 2e-2, err
    assert torch.equal(ssm_d.cpu()[[1, 2, 4, 7]], ssm[[1, 2, 4, 7]])


def _runner(backend: str, dtype: str):
    from autoprofile.engine.runner import ModelRunner
    from autoprofile.engine.weights import init_random
    cfg = validate(ServerConfig(model="tiny-hybrid", dtype=dtype, attention_backend=backend,
                                max_req_total_len=1024, batch_max_tokens=512, graph_max_batch_size=8,
                                running_max_req_size=8, report_dir=None))
    r = ModelRunner(cfg)
    init_random(r.model, seed=1, std=0.08)
    r.build(8192)
    return r


def _serve(runner, prompts, max_tokens=24, overlap=False):
    from autoprofile.engine.engine import LLMEngine
    e = LLMEngine(runner, overlap=overlap)
    outs = {}
    for i, p in enumerate(prompts):
        e.add_request(p, max_tokens=max_tokens, request_id=str(i))
    while e.scheduler.has_work():
        for o in e.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [outs[str(i)] for i in range(len(prompts))]


def test_tiny_hybrid_stress_and_graphs_serve_the_torch_backends_tokens():
    """The stress corners run; a crowd of 3 rows (a graph batch of 4: one padded row on the pad state slot)
    decodes through the graphs, overlapped, and its first tokens are those of each request alone and of the
    torch backend's steps. Later tokens may part: bf16 logits are not batch-invariant (near ties flip)."""
    require_backend("aiter_triton")
    prompts = [[5, 6, 7, 8, 9, 10] * 50, [11, 12, 13] * 7, [100, 200] * 90]
    fast = _runner("aiter_triton", "bfloat16")
    assert fast.graphs is not None and fast.state is not None
    fast.stress_prefill()
    fast.stress_decode()
    crowd = _serve(fast, prompts, overlap=True)
    alone = [_serve(fast, [p])[0] for p in prompts]
    fast.teardown()
    ref = _runner("torch", "bfloat16")
    slow = _serve(ref, prompts)
    ref.teardown()
    first = [[c[:4] for c in out] for out in (crowd, alone, slow)]
    assert first[0] == first[1] == first[2], first
    agree = sum(x == y for c, s in zip(crowd, slow) for x, y in zip(c, s))
    assert agree >= len(prompts) * 24 // 2, (agree, crowd, slow)
