"""GPU: local memory is part of the envelope. A kernel that needs more than memory.STACK_BOUND bytes of local
memory per thread (spills) makes the driver raise the context's stack limit and reserve limit x every resident
thread for the life of the process (2.5-4.5 GiB on an H100 with AITER's v2 reduce).

Each check runs in a fresh process (a fresh CUDA context, stack limit at its 1 KiB default): a profile of
a small model whose attention has the served models' decode shapes (32/8 heads of 128, llama-3.1's
context), then every Triton kernel compiled in that process (the serving set) is read: its local memory
from the driver (cuFuncGetAttribute LOCAL_SIZE_BYTES, which Triton reports as n_spills x 4) and its stack
frame from Triton's bundled cuobjdump -res-usage on its cubin."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoprofile import memory

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[1]
SMALL_MODEL = {  # the served models' attention (GQA 32/8, head_dim 128, 131072 context), 2 small layers
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
    "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 4096, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}

SMALL_MOE = {**SMALL_MODEL, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
             "moe_intermediate_size": 256, "num_experts": 32, "num_experts_per_tok": 8, "norm_topk_prob": True}

SMALL_HYBRID = {**SMALL_MODEL, "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",  # Qwen3.5
                "num_hidden_layers": 4, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
                "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
                "partial_rotary_factor": 0.25, "tie_word_embeddings": False}

KERNELS = r'''
import ctypes, json, os, re, subprocess, sys, tempfile
import triton
from triton.runtime.jit import JITFunction

def cuobjdump_stack(kernel) -> int | None:
    """Stack or local bytes per thread, cuobjdump -res-usage on the kernel's cubin (None if absent)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    cubin = kernel.asm.get("cubin") if hasattr(kernel, "asm") else None
    if cubin is None or not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    sizes = [int(n) for n in re.findall(r"(?:STACK|LOCAL):(\d+)", out)]
    return max(sizes) if sizes else None

def local_size(function) -> int:
    lib = ctypes.CDLL("libcuda.so.1")
    v = ctypes.c_int()
    assert lib.cuFuncGetAttribute(ctypes.byref(v), 3, ctypes.c_void_p(function)) == 0  # LOCAL_SIZE_BYTES
    return v.value

def compiled_kernels() -> list[dict]:
    seen, rows = set(), []
    for name, mod in list(sys.modules.items()):
        if not name.startswith(("autoprofile", "aiter")) or mod is None:
            continue
        for attr in list(vars(mod).values()):
            for _ in range(3):  # @triton.heuristics / autotune wrap the JIT function
                if isinstance(attr, JITFunction) or not hasattr(attr, "fn"):
                    break
                attr = attr.fn
            if not isinstance(attr, JITFunction) or id(attr) in seen:
                continue
            seen.add(id(attr))
            for cache in attr.device_caches.values():
                for kernel in cache[0].values():
                    kernel._init_handles()
                    rows.append({"kernel": attr.__name__, "n_regs": kernel.n_regs,
                                 "n_spills": kernel.n_spills, "local": local_size(kernel.function),
                                 "stack": cuobjdump_stack(kernel)})
    return rows
'''

PROFILE = KERNELS + r'''
import logging
import torch
from autoprofile import memory
from autoprofile.config import ServerConfig, validate
from autoprofile.profiler import profile
logging.basicConfig(level=logging.INFO)
torch.cuda.init()
torch.empty(1, device="cuda")
before = memory.stack_limit_bytes()
cfg = validate(ServerConfig(model=sys.argv[1], load_format="dummy",
                            attention_backend="aiter_triton", max_req_total_len=131072,
                            batch_max_tokens=8192, graph_max_batch_size=16, report_dir=None,
                            deterministic=sys.argv[2] == "deterministic"))
result = profile(cfg)
print("RESULT " + json.dumps({
    "before": before, "after": memory.stack_limit_bytes(), "profiled": result.stack_limit,
    "local_memory": result.local_memory, "tokens": result.tokens,
    "non_torch": result.terms["cuda_context_non_torch"], "kernels": compiled_kernels()}))
'''

AITER_REDUCE = KERNELS + r'''
import math
import torch
from autoprofile import memory
from autoprofile.kernels.aiter_loader import load_aiter_triton
import triton.language as tl
ops = load_aiter_triton()
import aiter.ops.triton.pa_decode as pa
torch.empty(1, device="cuda")
before = memory.stack_limit_bytes()
rows, hq, hkv, d, page, L = 1, 32, 8, 128, 16, 131072
q = torch.randn(rows, hq, d, device="cuda", dtype=torch.bfloat16)
kc = torch.randn(L // page, hkv, page, d, device="cuda", dtype=torch.bfloat16)
tables = torch.arange(L // page, device="cuda", dtype=torch.int32)[None]
seq_lens = torch.tensor([L], device="cuda", dtype=torch.int32)
out = torch.empty_like(q)
pa._SEQ_PARTITION_SIZE = 512  # 256 partitions: the largest specialization the backend captured
pa.paged_attn_decode_v2(out, q, kc, kc, tables, seq_lens, L, tl.bfloat16, hkv, 1 / math.sqrt(d), None,
                        1.0, 1.0, L // 512)
torch.cuda.synchronize()
print("RESULT " + json.dumps({"before": before, "after": memory.stack_limit_bytes(),
                              "kernels": compiled_kernels()}))
'''

FP8 = KERNELS + r'''
import torch
from autoprofile.kernels import triton_fp8, triton_moe, triton_moe_gemv
from autoprofile.layers.quant import Fp8Rows
from unit_tests.test_triton_fp8 import REFERENCE
ref = {}
exec(REFERENCE, ref)
torch.empty(1, device="cuda")
schemes = (ref["Scheme"]("channel"), ref["Scheme"]("block", (128, 128), "group"))
for scheme in schemes:  # llama-3.1-8b's widest GEMMs, one row (the GEMV) and each GEMM config
    for n, k in ((28672, 4096), (4096, 14336)):
        wq, ws = ref["quantize_weight"](torch.randn(n, k, device="cuda") * 0.02, scheme)
        for m in (1, 7, 300):
            x = torch.randn(m, k, device="cuda").bfloat16()
            triton_fp8.linear(x, wq, ws, scheme)
            triton_fp8.gemm(*triton_fp8.quantize_per_token(x), wq, ws, scheme.block, torch.float16)
            res = torch.zeros(1, n, device="cuda").bfloat16()
            triton_fp8.linear(x[:1].contiguous(), wq, ws, scheme, residual=res)
        for m in (2, 3, 8):  # the multi-row GEMV's tables (kernels.triton_fp8_rows): bf16 and producers' rows
            x = torch.randn(m, k, device="cuda").bfloat16()
            group = scheme.block[1] if scheme.activation == "group" else None
            q, s = triton_fp8.quantize_per_group(x, group) if group else triton_fp8.quantize_per_token(x)
            res = torch.zeros_like(x[:, :1]).expand(m, n).contiguous()
            triton_fp8.linear(Fp8Rows(q, s, x.dtype), wq, ws, scheme, residual=res)
            triton_fp8.linear(x, wq, ws, scheme)
    for m in (1, 300):  # the producers that quantize their rows: llama-3.1-8b's hidden and intermediate sizes
        triton_fp8.rms_norm_quant(torch.randn(m, 4096, device="cuda").bfloat16(),
                                  torch.ones(4096, device="cuda").bfloat16(), 1e-5, scheme)
        triton_fp8.silu_mul_quant(torch.randn(m, 2 * 14336, device="cuda").bfloat16(), scheme)
        # past SILU_QUANT_ROW: the per-token two-pass kernel (qwen2.5-72b's 29,568)
        triton_fp8.silu_mul_quant(torch.randn(m, 2 * 29568, device="cuda").bfloat16(), scheme)
    e, h, i = 32, 2048, 768  # the FP8 experts at both launch configs
    w13, s13 = ref["quantize_weight"](torch.randn(e, 2 * i, h, device="cuda") * 0.02, scheme)
    w2, s2 = ref["quantize_weight"](torch.randn(e, h, i, device="cuda") * 0.02, scheme)
    for tokens in (1, 512):
        ids = torch.randint(0, e, (tokens, 8), device="cuda", dtype=torch.int32)
        triton_moe.fused_moe(torch.randn(tokens, h, device="cuda").bfloat16(), w13, w2,
                             torch.rand(tokens, 8, device="cuda"), ids, ref["MoeQuant"](s13, s2, scheme))
    # the experts as GEMVs (kernels.triton_moe_gemv, at each dtype's config): FP8 here, bf16 below
    ids = torch.randint(0, e, (2, 8), device="cuda", dtype=torch.int32)
    x, rw = torch.randn(2, h, device="cuda").bfloat16(), torch.rand(2, 8, device="cuda")
    triton_moe_gemv.experts(x, w13, w2, rw, ids, ref["MoeQuant"](s13, s2, scheme))
triton_moe_gemv.experts(x, torch.randn(e, 2 * i, h, device="cuda").bfloat16(),
                        torch.randn(e, h, i, device="cuda").bfloat16(), rw, ids)
torch.cuda.synchronize()
print("RESULT " + json.dumps({"kernels": compiled_kernels()}))
'''

SPLIT_DECODE = KERNELS + r'''
import math
import torch
from autoprofile.kernels import triton_decode
from autoprofile.layers.attention import FP8_MAX, quantize
torch.empty(1, device="cuda")
hq, hkv, d, page = 32, 8, 128, 16
for rows, ctx in ((1, 131072), (256, 1024)):  # several splits (stage 2 too), one split
    pages = rows * ctx // page
    kc = torch.randn(pages, hkv, page, d, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(pages, device="cuda").to(torch.int32).view(rows, -1)
    seq_lens = torch.full((rows,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(rows, hq, d, device="cuda", dtype=torch.bfloat16)
    scales = torch.stack([kc.abs().max(), kc.abs().max()]).float() / FP8_MAX
    k8 = quantize(kc, scales[0], torch.float8_e4m3fn)
    for cfg in (triton_decode.DEFAULT, triton_decode.FP8, *triton_decode.SWEEP):
        triton_decode.decode(torch.empty_like(q), q, k8, k8, tables, seq_lens, ctx, 1 / math.sqrt(d),
                             scales[0], scales[1], cfg)
        triton_decode.decode(torch.empty_like(q), q, kc, kc, tables, seq_lens, ctx, 1 / math.sqrt(d),
                             override=cfg)
torch.cuda.synchronize()
print("RESULT " + json.dumps({"kernels": compiled_kernels()}))
'''

FUSED = KERNELS + r"""
import torch
from autoprofile.engine.host_kv import HostKVPool
from autoprofile.kernels import (triton_argmax, triton_kv_copy, triton_kv_gather, triton_mla_absorb,
                                 triton_moe, triton_rope)
torch.empty(1, device="cuda")
for rows in (1, 256):  # the greedy argmax (the profile's stress samples, so its serving set never has it)
    triton_argmax.argmax(torch.randn(rows, 128256, device="cuda", dtype=torch.bfloat16))
bf = dict(device="cuda", dtype=torch.bfloat16)
for t in (1, 8192):  # Qwen3-30B-A3B's q/k norm + RoPE + store (32/4 heads of 128); DeepSeek-V2's MLA
    qkv = torch.randn(t, (32 + 2 * 4) * 128, **bf)
    cos, sin = torch.rand(t, 1, 64, device="cuda"), torch.rand(t, 1, 64, device="cuda")
    cache = torch.zeros(t // 16 + 1, 4, 16, 128, **bf)
    slots = torch.arange(t, device="cuda")
    triton_rope.rope_store(qkv, cos, sin, cache, cache, slots, 32, 4, 128,
                           qk_norm=(torch.ones(128, **bf), torch.ones(128, **bf), 1e-6))
    # Qwen3.5-27B's gated attention: 24 q heads beside their gates, 4 kv heads of 256, rotary 64
    qkv = torch.randn(t, (2 * 24 + 2 * 4) * 256, **bf)
    cache = torch.zeros(t // 16 + 1, 4, 16, 256, **bf)
    triton_rope.rope_store(qkv, cos[..., :32], sin[..., :32], cache, cache, slots, 24, 4, 256,
                           qk_norm=(torch.ones(256, **bf), torch.ones(256, **bf), 1e-6), rotary_dim=64,
                           gated=True)
    q, kv_a = torch.randn(t, 16, 192, **bf), torch.randn(t, 512 + 64, **bf)
    latents = torch.zeros(t // 16 + 1, 1, 16, 576, **bf)
    triton_rope.mla_rope_store(q, kv_a, torch.ones(512, **bf), 1e-6, cos[..., :32], sin[..., :32], latents,
                               slots, 128)
    down, res = torch.randn(t, 8, 2048, **bf), torch.randn(t, 2048, **bf)
    triton_moe.moe_sum(down, torch.empty(t, 2048, **bf), (res, res))
w_uk, w_uv = torch.randn(16, 256, 512, **bf).split([128, 128], dim=1)  # MLA's absorption at its most rows
q = torch.randn(triton_mla_absorb.MAX_ROWS, 16, 192, **bf)
triton_mla_absorb.absorb(q[..., :128], q[..., 128:], w_uk)
triton_mla_absorb.unabsorb(torch.randn(triton_mla_absorb.MAX_ROWS, 16, 512, **bf), w_uv)
gpu = torch.randn(2, 4, 64, 8, 16, 128, **bf)  # the host tier's page copies, both directions
pool = HostKVPool(32, (2, 4, 8, 16, 128), torch.bfloat16, pin=True)
pairs = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32, device="cuda")
triton_kv_copy.copy_pages(gpu, pool.buffer, pairs)
triton_kv_copy.copy_pages(pool.buffer, gpu, pairs)
for hkv, d in ((8, 128), (4, 256)):  # a chunked prefill's K/V gather (llama-3.1-8b's cache, qwen3.5-27b's)
    cache = torch.zeros(64, hkv, 16, d, **bf)
    triton_kv_gather.gather(cache, cache, torch.arange(1000, device="cuda"))
torch.cuda.synchronize()
print("RESULT " + json.dumps({"kernels": compiled_kernels()}))
"""


def run_fresh(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=900, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-4000:] + out.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def spilling(kernels: list[dict]) -> list[dict]:
    return [k for k in kernels if k["local"] > memory.STACK_BOUND or (k["stack"] or 0) > memory.STACK_BOUND]


def test_the_check_sees_aiters_spilling_reduce():
    """The measurement itself: AITER's own v2 reduce at 256 partitions of head_dim 128 needs more than 1 KiB
    per thread and grows the stack limit (what issue 18 measured); if this stops failing the kernel moved."""
    got = run_fresh(AITER_REDUCE)
    assert got["before"] == memory.STACK_BOUND
    bad = {k["kernel"] for k in spilling(got["kernels"])}
    assert "_paged_attn_decode_v2_w_dot_reduce_kernel" in bad, got["kernels"]
    assert got["after"] > memory.STACK_BOUND


@pytest.mark.parametrize("model, mode", [(SMALL_MODEL, "default"), (SMALL_MOE, "default"),
                                         (SMALL_MODEL, "deterministic"), (SMALL_HYBRID, "default")],
                         ids=["dense", "moe", "deterministic", "hybrid"])
def test_no_kernel_of_the_serving_set_spills_past_the_bound(tmp_path, model, mode):
    """A profile (probe stress, validate stress at llama-3.1's context through the decode graphs) on a
    small model with the served attention shapes (and an MoE variant: AITER's Triton MoE kernels; and
    --deterministic: AITER's unified attention and our GEMM): no compiled kernel needs more than 1 KiB of
    local memory per thread, the stack limit stays at 1 KiB, and the profile recorded it."""
    folder = tmp_path / "small"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(model))
    got = run_fresh(PROFILE, str(folder), mode)
    names = {k["kernel"] for k in got["kernels"]}
    print(json.dumps({k: v for k, v in got.items() if k != "kernels"}))
    for k in sorted(got["kernels"], key=lambda k: -k["local"]):
        print(k)
    if mode == "deterministic":  # one attention kernel for prefill and decode, one GEMM for every layer
        assert {"kernel_unified_attention_2d", "_matmul_kernel"} <= names, names
        assert not names & {"_attn_fwd", "_paged_attn_decode_v2_w_dot_kernel",
                            "_paged_attn_decode_v1_w_dot_kernel"}
    else:
        # decode graphs up to launch_rules.SPLIT_DECODE_ROWS rows take our split decode (AITER's past them)
        assert {"_split_decode_kernel", "_merge_splits_kernel"} <= names, names
        assert "_gemv_kernel" in names, names  # the batch-1 graph's linear layers
    assert "_paged_attn_decode_v2_w_dot_reduce_kernel" not in names
    if model is SMALL_HYBRID:  # the Gated DeltaNet decode; the gated attention's one rope_store kernel
        assert {"_gdn_decode_kernel", "_rope_store_kernel"} <= names, names
    if model is SMALL_MOE:
        moe_kernels = {"_fused_moe_silu_kernel", "_fused_moe_kernel",  # AITER's experts
                       "_route_kernel", "_sort_by_expert_kernel",  # our router and expert sort
                       "_moe_sum_kernel", "_rope_store_kernel"}  # the top-k sum; Qwen3's q/k norm + RoPE
        assert moe_kernels <= names, names
    assert spilling(got["kernels"]) == []
    assert got["before"] == memory.STACK_BOUND
    assert got["after"] <= memory.STACK_BOUND and got["profiled"] == got["after"], got


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_serving_never_grows_the_stack_limit_or_the_non_torch_memory_the_profile_measured(tmp_path):
    """Issue 32: at --tp 2 the served models' ranks log a stack limit of 1,744 B (1,024 at --tp 1). Each rank
    of a --tp 2 auto-profile of the small model reads its stack limit and non-torch memory at every stage
    (scripts/tp_local_memory.py: NCCL's init and first collectives, each profiler checkpoint, 8 served
    requests). No Triton kernel of ours spills past the bound; whatever raised the limit (the report names
    the stage; NCCL's kernels' stack frames are listed), the profile recorded the final limit, and serving
    grew neither it nor the non-torch memory."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import tp_local_memory
    from autoprofile.config import ServerConfig, validate
    from autoprofile import launch
    folder = tmp_path / "small"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMALL_MODEL))
    cfg = validate(ServerConfig(model=str(folder), attention_backend="aiter_triton", max_req_total_len=131072,
                                batch_max_tokens=8192, graph_max_batch_size=16, report_dir=None, tp=2,
                                load_format="dummy"))
    out = launch.launch(tp_local_memory.rank_probe, 2, (cfg, 8, True),
                        env={"NCCL_NVLS_ENABLE": "0"}, timeout_s=900)
    assert all(o.ok for o in out), out
    ranks = [o.value for o in out]
    print(tp_local_memory.report(ranks))
    for r in ranks:
        stages = {s["stage"]: s for s in r["stages"]}
        served, validated = stages["served 8 requests"], stages["validated"]
        assert served["stack"] == validated["stack"] == r["profile_stack_limit"], r["stages"]
        assert served["non_torch_gib"] <= validated["non_torch_gib"] + 1 / 32, r["stages"]  # 32 MiB: noise
        ours = [{**k, "local": k["local"] or 0} for k in r["triton"] if "error" not in k]
        assert ours and spilling(ours) == [], [k for k in r["triton"] if "error" in k] + spilling(ours)


def test_no_fp8_kernel_spills_past_the_bound():
    """triton_fp8 (quant, GEMV with and without its residual, the multi-row GEMV's table launches at 2-8 rows
    from bf16 and FP8 rows, both GEMM configs, the norm and SiLU-mul that quantize their rows, at
    llama-3.1-8b's widest shapes) and the FP8 experts (AITER's block-scaled path, both launch configs; the
    experts' GEMVs, bf16 too), channel and block scales: none needs more than 1 KiB of local memory per
    thread."""
    got = run_fresh(FP8)
    for k in sorted(got["kernels"], key=lambda k: -k["local"]):
        print(k)
    names = {k["kernel"] for k in got["kernels"]}
    assert {"_quant_token_kernel", "_quant_group_kernel", "_gemv_fp8_kernel", "_gemm_fp8_kernel",
            "_gemv_rows_fp8_kernel", "_rms_norm_quant_kernel", "_silu_mul_quant_kernel",
            "_fused_moe_silu_kernel", "_fused_moe_kernel", "_gate_up_kernel",
            "_down_kernel"} <= names, names
    assert spilling(got["kernels"]) == []


def test_no_split_decode_kernel_spills_past_the_bound():
    """Our split decode (kernels.triton_decode: FP8 and bf16 pages, llama-3.1-8b's 32/8 heads of 128, one
    split and several, the default launch config and every one bench_decode_attention.py --configs times):
    no variant needs more than 1 KiB of local memory per thread."""
    got = run_fresh(SPLIT_DECODE)
    for k in sorted(got["kernels"], key=lambda k: -k["local"]):
        print(k)
    names = {k["kernel"] for k in got["kernels"]}
    assert {"_split_decode_kernel", "_merge_splits_kernel"} <= names, names
    assert spilling(got["kernels"]) == []


def test_no_fused_decode_or_page_copy_kernel_spills_past_the_bound():
    """This session's fused kernels (Qwen3's q/k norm + RoPE + store and Qwen3.5's gated variant, MLA's RoPE
    + latent norm + store, the MoE top-k sum with its addends), the host tier's page copies, a chunked
    prefill's K/V gather, at one token
    and at a prefill's 8,192, and the greedy argmax at 1 and 256 rows: no variant needs more than 1 KiB of
    local memory per thread."""
    got = run_fresh(FUSED)
    for k in sorted(got["kernels"], key=lambda k: -k["local"]):
        print(k)
    names = {k["kernel"] for k in got["kernels"]}
    assert {"_rope_store_kernel", "_mla_rope_store_kernel", "_moe_sum_kernel", "_copy_pages_kernel",
            "_absorb_kernel", "_unabsorb_kernel", "_argmax_kernel", "_gather_kernel"} <= names
    assert spilling(got["kernels"]) == []
