"""Our varlen causal prefill attention (flash attention, one Triton kernel): the non-deterministic prefill of
the aiter_triton backend.

AITER's varlen kernel (flash_attn_varlen_func, at its tuned configs) measured 0.77x torch SDPA at T=8192 and
0.55x at a serving step's 8 x 1,024 on an H100 (scripts/tune_prefill.py; issue 19). What this kernel does
differently:
- heavy programs first: a causal query block near a sequence's end reads the most keys, so the grid walks the
  blocks from the last (AITER's walks from the first and ends on its longest programs: a tail);
- the query heads of one GQA group are adjacent programs, so one K/V tile serves the group from L2;
- full key tiles below the block's diagonal run without a mask; only the diagonal tiles are masked;
- the softmax scale rides in the exp2's FMA (scores are scaled once, inside the exponent);
- on Hopper, tiles arrive by TMA (tensor descriptors): 0.85x SDPA at T=8192 where plain loads give 0.78x;
- it writes into the caller's `out` (a mixed step's prefill rows of one buffer: no concatenation after) and
  allocates nothing (AITER's wrapper zero-fills its output and a softmax-LSE buffer every call);
- q, k, v are read through their row and head strides: the views of the packed projection, no copies.

The causal mask is aligned bottom-right: sequence b's queries are the last cu_q[b+1] - cu_q[b] of its
cu_k[b+1] - cu_k[b] keys (a chunk over its cached prefix), query i seeing keys 0 .. prefix + i.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128  # the head sizes the configs are tuned for (tl.dot needs 16)
# Launch configs per NVIDIA compute capability from scripts/tune_prefill.py --kernel ours; others take CONFIG
# (no TMA: any GPU). TMA: the Hopper kernel (tensor descriptors). The times behind them, and what was tried and
# left out (warp specialization, FA4's lazy rescale, FA3's rotated loop, BLOCK_M 256): docs/measurements.md,
# "Serving speed".
CONFIG = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
CONFIGS: dict[str, dict] = {
    "sm_90": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "TMA": True},
}
# A call whose longest request reads at most SHORT_KEYS keys (a serving step of 1k prompts) takes the short
# entry where one exists; aiter_triton.SHORT_PREFILL_KEYS is this threshold (the stress runs both sides).
SHORT_KEYS = 1024
CONFIGS_SHORT: dict[str, dict] = {
    "sm_90": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "TMA": True},
}


def serves(head_dim: int, rocm: bool) -> bool:
    """Whether aiter_triton's prefill runs this kernel: heads of a power of two in MIN_HEAD_DIM..MAX_HEAD_DIM
    (the tuned configs' tiles hold a 128-wide head in shared memory) on NVIDIA. Wider or odd heads, and ROCm
    (AITER's kernel is tuned there), keep AITER's varlen kernel."""
    return not rocm and head_dim & (head_dim - 1) == 0 and MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM


def configs(capability: str | None) -> tuple[dict, dict | None]:
    """(long, short) launch configs on a GPU of `capability` ("sm_90"; None: the interpreter), copies; short
    None where none is tuned."""
    short = CONFIGS_SHORT.get(capability)
    return dict(CONFIGS.get(capability, CONFIG)), None if short is None else dict(short)


def pick_config(max_keys: int, long: dict, short: dict | None) -> dict:
    """The launch config of a varlen call whose longest request reads max_keys keys (a copy: AITER's launcher
    may consume it): the short one at most SHORT_KEYS keys where one exists. Both prefill kernels' rule."""
    return dict(short if short is not None and max_keys <= SHORT_KEYS else long)


@triton.jit
def _online_softmax(qk, v, m_i, l_i, acc, scale_log2):
    """One key tile of the online softmax: scores qk [M, N] (unscaled; -inf where masked), values v [N, D]
    -> the running max (log2 units), sum and output. The scale rides in the exp2's FMA. (P @ V accumulated
    through tl.dot's acc measured the same on an H100, 1.043 ms at T=8192 against SDPA's 0.890, and was not
    kept: this form is the one tests/test_local_memory.py checked for spills.)"""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
    p = tl.math.exp2(qk * scale_log2 - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, cu_k_ptr, scale_log2,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    m_block = tl.num_programs(2) - 1 - tl.program_id(2)  # the heaviest query blocks first
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    k_start = tl.load(cu_k_ptr + seq)
    prefix = tl.load(cu_k_ptr + seq + 1) - k_start - q_len  # keys before the first query
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # every row of the block sees keys 0 .. prefix + first row: whole tiles below that run unmasked
    unmasked = (prefix + m_block * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    last_key = prefix + tl.minimum((m_block + 1) * BLOCK_M, q_len)  # one past the last row's last key
    for start in range(0, unmasked, BLOCK_N):
        keys = (k_start + start + offs_n).to(tl.int64)
        k = tl.load(k_base + keys[None, :] * stride_kt + offs_d[:, None])
        v = tl.load(v_base + keys[:, None] * stride_vt + offs_d[None, :])
        m_i, l_i, acc = _online_softmax(tl.dot(q, k), v, m_i, l_i, acc, scale_log2)
    for start in range(unmasked, last_key, BLOCK_N):
        key_pos = start + offs_n
        keys = (k_start + key_pos).to(tl.int64)
        key_ok = key_pos < prefix + q_len
        k = tl.load(k_base + keys[None, :] * stride_kt + offs_d[:, None], mask=key_ok[None, :], other=0.0)
        v = tl.load(v_base + keys[:, None] * stride_vt + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        qk = tl.where(key_pos[None, :] <= prefix + offs_m[:, None], tl.dot(q, k), float("-inf"))
        m_i, l_i, acc = _online_softmax(qk, v, m_i, l_i, acc, scale_log2)  # key 0: every row's
    acc = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _prefill_kernel_tma(q_desc, k_desc, v_desc, out_ptr, cu_q_ptr, cu_k_ptr, scale_log2, stride_ot, stride_oh,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """_prefill_kernel with q/k/v tiles loaded by the Hopper TMA (tensor descriptors over [rows, heads * D]):
    a tile's rows past its sequence are another sequence's (or zeros past the end), masked as there."""
    head = tl.program_id(0)
    seq = tl.program_id(1)
    m_block = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    k_start = tl.load(cu_k_ptr + seq)
    prefix = tl.load(cu_k_ptr + seq + 1) - k_start - q_len
    kv_col = (head // GROUP) * HEAD_DIM

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = q_desc.load([q_start + m_block * BLOCK_M, head * HEAD_DIM])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    unmasked = (prefix + m_block * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    last_key = prefix + tl.minimum((m_block + 1) * BLOCK_M, q_len)
    for start in range(0, unmasked, BLOCK_N):
        k = k_desc.load([k_start + start, kv_col])
        v = v_desc.load([k_start + start, kv_col])
        m_i, l_i, acc = _online_softmax(tl.dot(q, k.T), v, m_i, l_i, acc, scale_log2)
    for start in range(unmasked, last_key, BLOCK_N):
        key_pos = start + offs_n
        k = k_desc.load([k_start + start, kv_col])
        v = v_desc.load([k_start + start, kv_col])
        v = tl.where((key_pos < prefix + q_len)[:, None], v, 0.0)  # rows past the sequence: p is 0, v any
        qk = tl.where(key_pos[None, :] <= prefix + offs_m[:, None], tl.dot(q, k.T), float("-inf"))
        m_i, l_i, acc = _online_softmax(qk, v, m_i, l_i, acc, scale_log2)
    acc = acc / l_i[:, None]
    q_rows = (q_start + offs_m).to(tl.int64)
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + tl.arange(0, HEAD_DIM)[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(offs_m < q_len)[:, None])


def prefill(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
            cu_k: torch.Tensor, max_q: int, max_k: int, scale: float,
            config: dict | None = None) -> torch.Tensor:
    """out [T, Hq, D] <- causal attention of q [T, Hq, D] over k, v [Tk, Hkv, D] (each with unit stride in D;
    rows and heads at any stride), sequence b's queries rows cu_q[b]..cu_q[b+1] and its keys rows
    cu_k[b]..cu_k[b+1] (int32 [B+1]), aligned bottom-right; max_q, max_k: the longest of each (host ints).
    D a power of two >= 16. Returns out."""
    tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if not serves(head_dim, rocm=False) or q_heads % kv_heads:
        raise ValueError(f"triton_prefill takes head_dim a power of two in {MIN_HEAD_DIM}..{MAX_HEAD_DIM} "
                         f"and query heads a multiple of KV heads, got head_dim {head_dim}, "
                         f"{q_heads}/{kv_heads} heads")
    if any(t.stride(-1) != 1 for t in (out, q, k, v)):
        raise ValueError("triton_prefill needs unit stride in head_dim")
    if tokens == 0:
        return out
    if config is None:
        config = pick_config(max_k, *configs(capability()))
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    grid = (q_heads, cu_q.shape[0] - 1, triton.cdiv(max_q, block_m))
    # a descriptor reads a row's heads as one [heads * D] run: heads at another stride take the plain loads
    if config.get("TMA") and all(t.stride(1) == head_dim for t in (q, k, v)):
        from triton.tools.tensor_descriptor import TensorDescriptor

        def desc(t: torch.Tensor, rows: int) -> TensorDescriptor:
            return TensorDescriptor(t, [t.shape[0], t.shape[1] * head_dim], [t.stride(0), 1],
                                    [rows, head_dim])

        _prefill_kernel_tma[grid](desc(q, block_m), desc(k, block_n), desc(v, block_n), out, cu_q, cu_k,
                                  scale * LOG2E, out.stride(0), out.stride(1), GROUP=q_heads // kv_heads,
                                  HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
                                  num_warps=config["num_warps"], num_stages=config["num_stages"])
        return out
    _prefill_kernel[grid](q, k, v, out, cu_q, cu_k, scale * LOG2E, q.stride(0), q.stride(1), k.stride(0),
                          k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
                          GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m,
                          BLOCK_N=block_n, num_warps=config["num_warps"],
                          num_stages=config["num_stages"])
    return out


def capability() -> str | None:
    """"sm_XY" of the current NVIDIA GPU; None elsewhere (the interpreter, ROCm). Read once, when a backend is
    built (aiter_triton keeps its configs), not per call."""
    if torch.version.hip is not None or not torch.cuda.is_available():
        return None
    return "sm_%d%d" % torch.cuda.get_device_capability()
