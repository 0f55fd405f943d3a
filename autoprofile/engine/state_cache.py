"""A hybrid model's second cache: one state slot per request slot (conv window + delta-rule matrix of every
linear layer), beside the paged KV of its attention layers.

ONE owner of two tensors (they differ in dtype): conv [linear layers, slots + 1, conv_dim, kernel - 1] in the
model dtype and ssm [linear layers, slots + 1, v_heads, k_dim, v_dim] in the checkpoint's mamba_ssm_dtype.
Slot `pad` absorbs the padded rows of a decode graph, as PAD_PAGE absorbs their K/V. After it come the state
checkpoint rows (prefix caching: the state at the end of a cached prefix, engine.prefix_cache hands out their
ids), copied from and into request slots outside any graph. Its bytes are declared
(budget.state_cache_bytes): they follow the running requests and the checkpoints, not T.

NOTE: captured decode graphs hold raw pointers into both tensors: drop the graphs first.
"""
from __future__ import annotations

import torch

from autoprofile.layers.gdn import StateLayer

STATE_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StateCache:
    def __init__(self, mc, slots: int, tp: int, dtype: torch.dtype, device: torch.device,
                 checkpoints: int = 0):
        """slots: request slots (envelope.running_reqs); one more is the pad slot; checkpoints: rows after it
        that keep a cached prefix's state (budget.state_checkpoints)."""
        layers, k = mc.linear_layers, mc.linear_conv_kernel_dim
        v_heads = mc.linear_num_value_heads // tp
        self.pad, self.checkpoints = slots, checkpoints
        rows = slots + 1 + checkpoints
        # zeros: a request's first chunk starts from a zero state (reset), and masked reads must not be NaN
        self.conv = torch.zeros(layers, rows, mc.conv_dim // tp, k - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(layers, rows, v_heads, mc.linear_key_head_dim, mc.linear_value_head_dim,
                               dtype=STATE_TORCH_DTYPES[mc.state_dtype], device=device)
        self.layers = [StateLayer(self.conv[i], self.ssm[i]) for i in range(layers)]

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the state of these slots in every layer (a request's first chunk: fresh, or recomputed after a
        preemption)."""
        if slots.numel():
            self.conv.index_fill_(1, slots, 0)
            self.ssm.index_fill_(1, slots, 0)

    def checkpoint_bytes(self) -> int:
        """The checkpoint rows' share of nbytes."""
        return self.nbytes * self.checkpoints // self.conv.shape[1]

    def save(self, pairs: list[tuple[int, int]]) -> None:
        """(request slot, checkpoint id): the slot's state of every layer copied into the checkpoint."""
        if pairs:
            self._copy([s for s, _ in pairs], [self.pad + 1 + c for _, c in pairs])

    def load(self, pairs: list[tuple[int, int]]) -> None:
        """(checkpoint id, request slot): a request resuming a cached prefix starts from its checkpoint."""
        if pairs:
            self._copy([self.pad + 1 + c for c, _ in pairs], [s for _, s in pairs])

    def _copy(self, src: list[int], dst: list[int]) -> None:
        if max(src + dst) >= self.conv.shape[1] or len(set(dst)) < len(dst):
            raise ValueError(f"state copy {src} -> {dst} outside the {self.conv.shape[1]} rows, or twice")
        # row by row, view to view: index_select would materialise every row's state first (144 MiB a row
        # for qwen3.5-27b), a transient the probe's stress never allocates
        for s, d in zip(src, dst):
            for t in (self.conv, self.ssm):
                t[:, d].copy_(t[:, s])


def layer_caches(mc, kv_layers: list, state_layers: list) -> list:
    """One cache per model layer, in order: the next KVLayer for an attention layer, the next StateLayer for a
    linear one."""
    kv, state = iter(kv_layers), iter(state_layers)
    return [next(state) if mc.is_linear_layer(i) else next(kv) for i in range(mc.num_layers)]
