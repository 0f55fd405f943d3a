"""GPU: MLA through the aiter_triton backend (our MLA decode over the paged latent cache, kernels.triton_mla;
AITER's varlen flash attention with MLA's widths for the expanded prefill) against the torch reference, at
DeepSeek-V2-Lite's widths (16 heads, latent 512 + rope 64, q/k 192, v 128), bf16. Until these pass, MLA models
run on the torch backend only (config.validate refuses the others)."""
from __future__ import annotations

import pytest
import torch

from autoprofile.layers.attention import AttentionMetadata, KVLayer
from tests.conftest import require_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

H, RANK, ROPE, NOPE, V, PAGE = 16, 512, 64, 128, 128, 16
SCALE = (NOPE + ROPE) ** -0.5


def backends():
    require_backend("aiter_triton")
    from autoprofile.engine.attention.aiter_triton import AiterTritonBackend
    from autoprofile.engine.attention.torch_sdpa import TorchBackend
    dev = torch.device("cuda")
    ours = AiterTritonBackend(H, H, 128, PAGE, torch.bfloat16, dev)
    ours.build(64, 4096, 16)
    return ours, TorchBackend(H, H, 128, PAGE, torch.bfloat16, dev)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("rows", [1, 7, 16, 40, 64])
def test_mla_decode_matches_the_reference(rows):
    ours, ref = backends()
    g = torch.Generator(device="cuda").manual_seed(rows)
    pages = 2048
    latents = torch.randn(pages, 1, PAGE, RANK + ROPE, device="cuda", generator=g).bfloat16()
    lens = torch.randint(1, 4096, (rows,), device="cuda", generator=g, dtype=torch.int32)
    tables = torch.stack([torch.randperm(pages - 1, device="cuda", generator=g)[:256] + 1
                          for _ in range(rows)]).int()
    slots = torch.zeros(rows, dtype=torch.long, device="cuda")
    meta = AttentionMetadata(is_prefill=False, slot_mapping=slots, block_tables=tables, seq_lens=lens,
                             max_seq_len=4096)
    q = torch.randn(rows, H, RANK + ROPE, device="cuda", generator=g).bfloat16()
    kv = KVLayer(latents, latents)
    assert rel_err(ours.mla_decode(q, kv, meta, SCALE, RANK), ref.mla_decode(q, kv, meta, SCALE, RANK)) < 2e-2


def test_mla_prefill_matches_the_reference_with_and_without_a_cached_prefix():
    ours, ref = backends()
    g = torch.Generator(device="cuda").manual_seed(0)
    for lens, kv_lens in (([300, 17], None), ([64, 200], [1000, 200])):
        t, tk = sum(lens), sum(kv_lens or lens)
        cu = torch.tensor([0, lens[0], t], dtype=torch.int32, device="cuda")
        slots = torch.zeros(t, dtype=torch.long, device="cuda")
        meta = AttentionMetadata(is_prefill=True, slot_mapping=slots, cu_seqlens=cu, max_seqlen=max(lens))
        if kv_lens:
            meta.cu_seqlens_k = torch.tensor([0, kv_lens[0], tk], dtype=torch.int32, device="cuda")
            meta.max_seqlen_k = max(kv_lens)
        q = torch.randn(t, H, NOPE + ROPE, device="cuda", generator=g).bfloat16()
        k = torch.randn(tk, H, NOPE + ROPE, device="cuda", generator=g).bfloat16()
        v = torch.randn(tk, H, V, device="cuda", generator=g).bfloat16()
        got = ours.mla_prefill(q, k, v, meta, SCALE)
        assert got.shape == (t, H, V)
        assert rel_err(got, ref.mla_prefill(q, k, v, meta, SCALE)) < 2e-2, (lens, kv_lens)


MLA_KERNELS = r'''
import json, torch
from autoprofile import memory
from autoprofile.kernels import triton_mla
torch.empty(1, device="cuda")
before = memory.stack_limit_bytes()
latents = torch.randn(512, 1, 16, 576, device="cuda").bfloat16()
for rows in (1, 64):
    q = torch.randn(rows, 16, 576, device="cuda").bfloat16()
    tables = torch.randint(1, 512, (rows, 256), device="cuda", dtype=torch.int32)
    lens = torch.full((rows,), 4000, device="cuda", dtype=torch.int32)
    triton_mla.mla_decode(q, latents, tables, lens, 0.1, 512, rows)
torch.cuda.synchronize()
after = memory.stack_limit_bytes()
print("RESULT " + json.dumps({"before": before, "after": after, "kernels": compiled_kernels()}))
'''


def test_the_mla_decode_kernels_do_not_spill():
    """Local memory is memory (issue 18): our MLA decode and its splits' merge at V2-Lite's widths need at
    most memory.STACK_BOUND bytes per thread, and the stack limit stays."""
    require_backend("aiter_triton")
    from autoprofile import memory
    from tests.test_local_memory import KERNELS, run_fresh, spilling
    got = run_fresh(KERNELS + MLA_KERNELS)
    names = {k["kernel"] for k in got["kernels"]}
    print(got["kernels"])
    assert {"_mla_decode_kernel", "_merge_splits_kernel"} <= names, names
    assert spilling(got["kernels"]) == [] and got["after"] <= memory.STACK_BOUND, got


def test_an_mla_model_profiles_and_serves_through_the_decode_graphs():
    """tiny-mla (a small DeepSeek-V2: MLA + MoE) on aiter_triton: the stresses run, the decode graphs capture
    the absorbed decode over the latent cache, and every greedy token they serve is the torch reference
    backend's argmax for the same weights and sequence, up to a bf16 tie (random weights tie: the repeated
    prompt's second token has two logits equal in bf16)."""
    require_backend("aiter_triton")
    from autoprofile.config import ServerConfig, validate
    from autoprofile.engine.engine import LLMEngine
    from autoprofile.engine.runner import ModelRunner
    from tests.test_model_vs_hf import all_logits
    prompts = [[5, 6, 7, 8], list(range(100, 400)), [9] * 50]

    def runner_on(backend: str) -> ModelRunner:
        cfg = validate(ServerConfig(model="tiny-mla", attention_backend=backend, max_req_total_len=2048,
                                    batch_max_tokens=2048, running_max_req_size=64, graph_max_batch_size=16,
                                    report_dir=None, seed=0))
        runner = ModelRunner(cfg)
        runner.build(64 * 1024)
        return runner

    runner = runner_on("aiter_triton")
    try:
        assert runner.graphs is not None and runner.use_graphs
        assert runner.stress_prefill() + runner.stress_decode()
        outs = LLMEngine(runner).generate(prompts, max_tokens=8)
    finally:
        runner.teardown()
    assert [len(o) for o in outs] == [8, 8, 8]
    ref = runner_on("torch")
    try:
        for prompt, out in zip(prompts, outs):
            logits = all_logits(ref, prompt + out)[len(prompt) - 1:-1]  # the logits each token was chosen by
            chosen = logits.gather(1, torch.tensor(out, device="cuda")[:, None])[:, 0]
            assert (chosen >= logits.amax(1) - 0.02).all(), (prompt[:4], out, logits.argmax(1).tolist())
    finally:
        ref.teardown()
