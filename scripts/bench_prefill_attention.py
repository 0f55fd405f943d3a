"""Prefill attention backends side by side in one run on this GPU (issue 34, item 4): our Triton kernel
(engine/attention/triton_prefill.py) against torch SDPA's flash and cuDNN backends and torch's varlen
attention (torch.nn.attention.varlen.varlen_attn: FlashAttention kernels bundled with torch 2.10+).

    PYTHONPATH=. python3 scripts/bench_prefill_attention.py [--iters 10] [--gather]

bf16, llama-3.1-8b's heads (32 query, 8 KV, dim 128), three shapes:
  causal 8192      one request of 8,192 tokens, causal
  varlen 8x1024    eight requests of 1,024 tokens in one varlen call (SDPA: a [8, H, 1024, D] batch)
  chunk 2048/32k   a 2,048-token chunk over 32,768 keys (its 30,720-token prefix cached), causal bottom-right
Each cell: median ms, and the speed against SDPA flash (x; > 1 is faster). A backend that is missing or
refuses a shape prints its reason instead; the run goes on. "err": max |out - SDPA flash's| (a wrong
kernel shows here). SDPA's inputs are [B, H, L, D] batches with K/V expanded to 32 heads outside the timing;
the chunk is causal_lower_right (where this torch's flash refuses it, the memory-efficient kernel is the
base, said so in the cell).

--gather: instead, a chunked prefill's K/V gather from the paged cache (AttentionBackend.gather_kv: the keys
of chunks over cached prefixes, every layer of such a step) in torch's advanced indexing against our one
launch (kernels.triton_kv_gather), at 8,192 slots (a c256 prefill step) and 131,072 (the stress's longest
corner), bf16 and FP8 pages of 16 tokens, slots shuffled by page; each cell: the GPU's median ms a call (calls
captured in a graph) and GB/s (bytes read + written).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_timing import cuda_median_ms, graph_median_ms  # noqa: E402

HQ, HKV, D = 32, 8, 128
SHAPES = {"causal 8192": ([8192], [8192]), "varlen 8x1024": ([1024] * 8, [1024] * 8),
          "chunk 2048/32k": ([2048], [32768])}


def cu(lens: list[int], dev: torch.device) -> torch.Tensor:
    return torch.tensor([0, *lens], device=dev).cumsum(0).to(torch.int32)


def make(q_lens: list[int], k_lens: list[int], dev: torch.device):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(sum(q_lens), HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(sum(k_lens), HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(sum(k_lens), HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    return q, k, v


def sdpa_inputs(q, k, v, q_lens, k_lens):
    """[B, H, L, D] batches (every request of one shape has the same lengths here), K/V expanded to HQ."""
    b = len(q_lens)
    qh = q.view(b, q_lens[0], HQ, D).transpose(1, 2)
    kh = k.view(b, k_lens[0], HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    vh = v.view(b, k_lens[0], HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    return qh, kh, vh


def as_varlen(out_bhld: torch.Tensor) -> torch.Tensor:
    b, h, length, d = out_bhld.shape
    return out_bhld.transpose(1, 2).reshape(b * length, h, d)


def sdpa_runner(backend, q, k, v, q_lens, k_lens) -> Callable[[], torch.Tensor]:
    """SDPA restricted to one backend; a chunk over its prefix as causal_lower_right (bottom-right)."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    qh, kh, vh = sdpa_inputs(q, k, v, q_lens, k_lens)
    mask = causal_lower_right(q_lens[0], k_lens[0]) if q_lens[0] != k_lens[0] else None

    def run() -> torch.Tensor:
        with sdpa_kernel(backend):
            if mask is None:
                return as_varlen(F.scaled_dot_product_attention(qh, kh, vh, is_causal=True))
            return as_varlen(F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask))
    return run


def triton_runner(q, k, v, q_lens, k_lens) -> Callable[[], torch.Tensor]:
    from autoprofile.kernels import triton_prefill
    long, short = triton_prefill.configs(triton_prefill.capability())
    config = triton_prefill.pick_config(max(k_lens), long, short)
    cq, ck, out = cu(q_lens, q.device), cu(k_lens, q.device), torch.empty_like(q)
    return lambda: triton_prefill.prefill(out, q, k, v, cq, ck, max(q_lens), max(k_lens), D ** -0.5,
                                          dict(config))


def varlen_runner(q, k, v, q_lens, k_lens) -> Callable[[], torch.Tensor]:
    """torch.nn.attention.varlen.varlen_attn; GQA as given (FlashAttention takes fewer KV heads), K/V expanded
    when this torch refuses them. Its causal mask for q shorter than k: FlashAttention's bottom-right."""
    from torch.nn.attention.varlen import varlen_attn
    cq, ck = cu(q_lens, q.device), cu(k_lens, q.device)

    import inspect
    # torch 2.10 takes is_causal; 2.11+ a window: (-1, 0) is causal (bottom-right), and 2.12 adds enable_gqa
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}

    def call(kk, vv, **extra):
        return varlen_attn(q, kk, vv, cq, ck, max(q_lens), max(k_lens), **causal, **extra)
    try:
        call(k, v, **gqa)
        return lambda: call(k, v, **gqa)
    except RuntimeError:
        ke, ve = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
        return lambda: call(ke, ve)


def cudnn_varlen_runner(q, k, v, q_lens, k_lens) -> Callable[[], torch.Tensor]:
    """cuDNN's ragged attention on the packed tokens (aten._cudnn_attention_forward with cumulative lengths,
    the call SDPA makes for a jagged nested tensor): what serving would call, no [B, H, L, D] padding. GQA as
    given, K/V expanded when this torch refuses them. is_causal with q shorter than k: cuDNN aligns the
    mask top-left, so the chunk row is checked by its err."""
    cq, ck = cu(q_lens, q.device), cu(k_lens, q.device)

    def call(kk, vv):
        return torch.ops.aten._cudnn_attention_forward(q, kk, vv, None, cq, ck, max(q_lens), max(k_lens), False,
                                                       0.0, True, False, scale=D ** -0.5)[0]
    try:
        call(k, v)
        return lambda: call(k, v)
    except RuntimeError:
        ke, ve = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
        return lambda: call(ke, ve)


def cell(make_runner: Callable[[], Callable[[], torch.Tensor]], ref: torch.Tensor | None, base: float | None,
         iters: int) -> tuple[str, float | None, torch.Tensor | None]:
    """'ms (x vs base, err)', the ms, the output; or the reason it could not run."""
    try:
        run = make_runner()
        out = run()
        torch.cuda.synchronize()
        ms = cuda_median_ms(run, iters=iters)
    except Exception as e:  # a missing or refusing backend is a result here, not a failure
        return f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:60] if str(e) else ''})", None, None
    text = f"{ms:.3f} ms"
    if base:
        text += f" ({base / ms:.2f}x)"
    if ref is not None:
        text += f" err {(out.float() - ref.float()).abs().max().item():.1e}"
    return text, ms, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--gather", action="store_true", help="the K/V gather instead (see above)")
    args = p.parse_args()
    dev = torch.device("cuda")
    if args.gather:
        bench_gather(dev, args.iters)
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, {HQ}/{HKV} heads x {D}")
    names = ["SDPA flash", "SDPA cuDNN", "torch varlen_attn", "triton_prefill (ours)", "cuDNN varlen"]
    print("| shape | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for shape, (q_lens, k_lens) in SHAPES.items():
        print(f"| {shape} | " + " | ".join(bench_shape(q_lens, k_lens, dev, args.iters)) + " |", flush=True)
        torch.cuda.empty_cache()


def bench_shape(q_lens: list[int], k_lens: list[int], dev: torch.device, iters: int) -> list[str]:
    """One row of the table: SDPA flash (the base), SDPA cuDNN, torch varlen_attn, ours, cuDNN varlen."""
    from torch.nn.attention import SDPBackend
    q, k, v = make(q_lens, k_lens, dev)
    text, base, ref = cell(lambda: sdpa_runner(SDPBackend.FLASH_ATTENTION, q, k, v, q_lens, k_lens), None,
                           None, iters)
    if base is None:  # this torch's flash refuses the shape: the memory-efficient kernel is the base
        text, base, ref = cell(lambda: sdpa_runner(SDPBackend.EFFICIENT_ATTENTION, q, k, v, q_lens, k_lens),
                               None, None, iters)
        text += " (mem-efficient: flash refused)"
    row = [text]
    for make_runner in (lambda: sdpa_runner(SDPBackend.CUDNN_ATTENTION, q, k, v, q_lens, k_lens),
                        lambda: varlen_runner(q, k, v, q_lens, k_lens),
                        lambda: triton_runner(q, k, v, q_lens, k_lens),
                        lambda: cudnn_varlen_runner(q, k, v, q_lens, k_lens)):
        row.append(cell(make_runner, ref, base, iters)[0])
    return row


def bench_gather(dev: torch.device, iters: int, page: int = 16) -> None:
    from autoprofile.kernels import triton_kv_gather
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; K/V gather, {HKV} heads x {D}, "
          f"pages of {page}")
    print("| slots, cache | torch indexing | triton_kv_gather | speed-up |")
    print("|---|---|---|---|")
    for n in (8192, 131072):
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            pages = 2 * n // page
            kc = torch.randn(pages, HKV, page, D, device=dev).to(dtype)
            vc = torch.randn(pages, HKV, page, D, device=dev).to(dtype)
            order = torch.randperm(pages, device=dev)[:n // page]  # a request's pages: anywhere in the pool
            slots = (order[:, None] * page + torch.arange(page, device=dev)).reshape(-1)
            p, o = slots // page, slots % page
            # the GPU's time (calls captured back to back): a served prefill step keeps the GPU busy, so a
            # launch's host time is hidden there (eager, Triton's launch alone takes tens of microseconds)
            ms_torch = graph_median_ms(lambda: (kc[p, :, o], vc[p, :, o]), iters)
            ms_ours = graph_median_ms(lambda: triton_kv_gather.gather(kc, vc, slots), iters)
            got, want = triton_kv_gather.gather(kc, vc, slots), (kc[p, :, o], vc[p, :, o])
            assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want))
            gb = 2 * 2 * n * HKV * D * kc.element_size() / 1e9  # K and V, read and written
            name = str(dtype).removeprefix("torch.")
            print(f"| {n}, {name} | {ms_torch:.3f} ms ({gb / ms_torch * 1e3:,.0f} GB/s) | {ms_ours:.3f} ms "
                  f"({gb / ms_ours * 1e3:,.0f} GB/s) | {ms_torch / ms_ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
