"""Counts what one batch-1 decode forward launches per decoder layer: the torch ops that run a kernel (views and
allocations are free) and the Triton launches, on the CPU with the aiter_triton backend through Triton's
interpreter (TRITON_INTERPRET=1 must be set before triton is imported: run this in a fresh process, as
unit_tests/test_decode_ops.py does). On a GPU each counted op is one kernel of a graph replay, so the counts
are the step's tiny kernels (scripts/profile_decode.py shows them on the device).

    TRITON_INTERPRET=1 PYTHONPATH=. python3 unit_tests/decode_ops.py tiny-moe tiny-mla
"""
from __future__ import annotations

import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# allocations and metadata ops: no kernel on a GPU
FREE = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "detach", "alias",
        "lift_fresh", "_to_copy_noop", "set_", "resize_", "item", "_local_scalar_dense", "is_nonzero"}


class OpCounter(TorchDispatchMode):
    """Counts aten ops (leaf, after decomposition) that would launch a kernel; paused inside Triton launches
    (the interpreter's own tensor handling), which are counted by name instead."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            name = func.overloadpacket.__name__
            if not func.is_view and name.rstrip("_") not in FREE:
                self.ops[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


def count_triton(counter: OpCounter):
    """Patch the interpreter's launch to count kernels by name with the op counter paused."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        counter.ops[f"triton.{self.fn.__name__}"] += 1
        was, counter.paused = counter.paused, True
        try:
            return run(self, *args, **kwargs)
        finally:
            counter.paused = was

    InterpretedFunction.run = counted
    return lambda: setattr(InterpretedFunction, "run", run)


def cpu_ops() -> None:
    """The aiter_triton backend's AITER kernels without the varlen prefill (its module probes a GPU at import):
    a decode needs the paged decode only."""
    from autoprofile.engine.attention import aiter_triton
    from autoprofile.kernels import aiter_loader

    def load():
        pa = aiter_loader.load_pa_decode()
        return aiter_loader.AiterTriton(paged_attn_decode_v1=pa.paged_attn_decode_v1,
                                        seq_partition_size=pa._SEQ_PARTITION_SIZE,
                                        pa_kernels=aiter_loader.load_pa_kernels(), flash_attn_varlen_func=None)

    aiter_triton.load_aiter_triton = load


def tiny_decode(name: str, dtype=torch.float16, ctx: int = 40, seed: int = 0):
    """(model, backend, run) for the model config `name` with random weights: run() is one decode forward of one
    row at position ctx - 1 over a paged cache of random K/V, returning the hidden state."""
    from autoprofile.engine.attention.aiter_triton import AiterTritonBackend
    from autoprofile.engine.kv_cache import KVCache
    from autoprofile.engine.state_cache import StateCache, layer_caches
    from autoprofile.layers.attention import AttentionMetadata
    from autoprofile.layers.parallel import TP
    from autoprofile.model_config import load_model_config
    from models import model_class

    cpu_ops()
    torch.manual_seed(seed)
    mc = load_model_config(name)
    page = 16
    head_dim = mc.kv_lora_rank + mc.qk_rope_head_dim if mc.is_mla else mc.head_dim
    kv_heads = 1 if mc.is_mla else mc.num_kv_heads
    backend = AiterTritonBackend(mc.num_heads, mc.num_kv_heads, mc.head_dim, page, dtype, torch.device("cpu"))
    pages_per_req = -(-ctx // page)
    backend.build(1, pages_per_req * page, graph_rows=1)
    tp = TP(matmul=backend.gemm, fp8_matmul=backend.fp8_gemm, add_in_gemm=True)
    model = model_class(mc)(mc, backend, tp, dtype, max_positions=4 * ctx)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
    for module in model.modules():
        if module.__class__.__name__ == "RMSNorm":
            module.weight.data.fill_(1.0)
    attention_layers = mc.num_layers - (mc.linear_layers if mc.is_hybrid else 0)
    kv = KVCache(attention_layers, pages_per_req + 2, kv_heads, page, head_dim, dtype, torch.device("cpu"),
                 latent=mc.is_mla)
    kv.buffer.normal_()
    caches = kv.layers
    table = torch.arange(2, pages_per_req + 2, dtype=torch.int32)[None]
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor([2 * page + ctx - 1]),
                             block_tables=table, seq_lens=torch.tensor([ctx], dtype=torch.int32),
                             max_seq_len=pages_per_req * page)
    if mc.is_hybrid:  # the row's recurrent state in slot 0 of a one-slot state cache, random as the K/V
        state = StateCache(mc, 1, 1, dtype, torch.device("cpu"))
        state.conv.normal_()
        state.ssm.normal_()
        caches = layer_caches(mc, kv.layers, state.layers)
        meta.state_slots = torch.tensor([0])
    ids, positions = torch.tensor([7]), torch.tensor([ctx - 1])

    def run() -> torch.Tensor:
        with torch.no_grad():
            return model(ids, positions, meta, caches)

    return model, backend, run


def ops_per_layer(name: str) -> tuple[Counter, Counter, int]:
    """(the op counts of one decode forward, those of its last layer alone (an MoE layer in the tiny configs),
    the number of layers)."""
    model, _, run = tiny_decode(name)
    run()  # warm (lazy imports, caches)
    counter = OpCounter()
    layer_ops = Counter()
    last = model.model.layers[-1]
    restore = count_triton(counter)
    hook_state = {}

    def pre(_module, _args):
        hook_state["before"] = Counter(counter.ops)

    def post(_module, _args, _out):
        layer_ops.update(counter.ops - hook_state["before"])

    handles = [last.register_forward_pre_hook(pre), last.register_forward_hook(post)]
    try:
        with counter:
            run()
    finally:
        restore()
        for h in handles:
            h.remove()
    return counter.ops, layer_ops, len(model.model.layers)


def main(names: list[str]) -> None:
    for name in names:
        total, layer, n = ops_per_layer(name)
        print(f"{name}: {sum(total.values())} ops in the forward ({n} layers); its last (MoE) layer: "
              f"{sum(layer.values())}")
        for op, c in sorted(layer.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {c:4d}  {op}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["tiny-moe", "tiny-mla"])
