"""Our Triton kernels compile for an H100 (sm_90) on a CPU machine, with the argument types and constexprs
of real launches. The interpreter (TRITON_INTERPRET=1, what the other kernel tests run) executes Python and
accepts kernels the compiler refuses (a plain global; a name rebound with another type inside an `if`).

Two subprocesses a case: (1) through the interpreter, a launch script calls a kernel module's public
functions on CPU tensors while every kernel launch is recorded as the real JIT would specialize it for CUDA
(jit.create_function_from_signature and JITFunction._pack_args with the CUDA backend: pointer dtypes, i32/i64
ints, 1 as a constexpr, divisibility attributes); (2) without the interpreter, each distinct recorded
(kernel, signature, constexprs, options) goes through triton.compile(ASTSource(...), GPUTarget("cuda", 90,
32)): the front end, TTIR/TTGIR/LLIR, PTX and ptxas. Launchers that never read a kernel's output on the host
are only recorded (RUN = False): real vocabulary and model sizes cost nothing then, and the PDL launches
of an H100 (pdl.launch: PDL=True, launch_pdl) are recorded too."""
from __future__ import annotations

import importlib.util
import pickle

import pytest

from unit_tests.interpreter import ROOT, run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
# the sampler and the greedy argmax run in every CI run (the default decode step's kernels; the interpreter
# once accepted a sampler the compiler refused); the other modules in the slow set
FAST = {"triton_sample", "triton_argmax", "triton_bitmask"}

RECORD = r'''
import pickle, sys
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime import interpreter
from triton.runtime.jit import JITFunction, create_function_from_signature

BACKEND = make_backend(GPUTarget("cuda", 90, 32))
SPECIALIZE = ("do_not_specialize", "do_not_specialize_on_alignment")
RUN = True  # a launch script sets False where its launcher never reads a kernel's output
launches = {}
_run = interpreter.InterpretedFunction.run


def record(self, *args, grid, warmup, **kwargs):
    """The launch as JITFunction.run would specialize it on a CUDA device."""
    jit = JITFunction(self.fn, **{k: v for k, v in self.kwargs.items() if k in SPECIALIZE})
    bound, specialization, options = create_function_from_signature(jit.signature, jit.params, BACKEND)(
        *args, **kwargs)
    _, signature, constexprs, attrs = jit._pack_args(BACKEND, kwargs, bound, specialization, options)
    key = repr((self.fn.__module__, self.fn.__name__, signature, constexprs, options))
    launches.setdefault(key, (self.fn.__module__, self.fn.__name__, signature, constexprs, attrs, options))
    if RUN:
        return _run(self, *args, grid=grid, warmup=warmup, **kwargs)


interpreter.InterpretedFunction.run = record
from autoprofile.kernels import pdl
H100_PDL = (lambda: False, lambda: True)  # for pdl.enabled in H100_PDL: launches without PDL, then with it
'''

SAVE = r'''
with open(sys.argv[1], "wb") as f:
    pickle.dump(list(launches.values()), f)
print("ok")
'''

COMPILE = r'''
import importlib, pickle, sys, time
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from triton.runtime.jit import JITFunction

failed = 0
for module, name, signature, constexprs, attrs, options in pickle.load(open(sys.argv[1], "rb")):
    kernel = getattr(importlib.import_module(module), name)
    while not isinstance(kernel, JITFunction):  # an autotune / heuristics wrapper
        kernel = kernel.fn
    what = f"{module}.{name} {dict((kernel.arg_names[p[0]], v) for p, v in constexprs.items())} {options}"
    start = time.perf_counter()
    try:
        compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                options=options)
    except Exception as e:
        failed += 1
        print(f"FAILED {what}: {type(e).__name__}: {e}")
    else:
        print(f"compiled {what} in {time.perf_counter() - start:.1f} s")
print(f"{failed} failed" if failed else "ok")
'''

SAMPLING = r'''
from autoprofile.engine.sampling import SamplingBatch, SamplingParams

PARAMS = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9),
          SamplingParams(temperature=0.7, top_k=40, top_p=0.95)]  # greedy, top-p, top-k + top-p
BATCH = SamplingBatch.from_params(PARAMS, torch.device("cpu"))
SEEDS = torch.arange(len(PARAMS))
'''

LAUNCHES = {
    # every dtype the engine gives the fused sampler (sampling._FUSED_DTYPES), with and without bounds, with
    # the split top-k path and without
    "triton_sample": SAMPLING + r'''
RUN = False
from autoprofile.kernels import triton_sample as ts
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for bounds in (False, True):
        for split in ("some", "none"):  # _split_kernel (top_k <= K_MAX) beside _sample_kernel, and alone
            ts.sample_batch(torch.randn(3, 151936, dtype=dtype), BATCH.temperatures, BATCH.top_ps,
                            BATCH.top_ks, SEEDS, bounds=bounds, split=split)
''',
    # llama-3.1-8b sizes in bf16 (router logits in fp32), a deepseek-v3 router, a qwen3-moe sort
    "triton_act": r'''
RUN = False
from autoprofile.kernels import triton_act
for pdl.enabled in H100_PDL:
    triton_act.silu_mul(torch.randn(4, 2 * 14336, dtype=torch.bfloat16))
''',
    "triton_norm": r'''
RUN = False
from autoprofile.kernels import triton_norm
for pdl.enabled in H100_PDL:
    triton_norm.rms_norm(torch.randn(4, 4096, dtype=torch.bfloat16), torch.ones(4096, dtype=torch.bfloat16),
                         1e-5)
''',
    "triton_gemv": r'''
RUN = False
from autoprofile.kernels import triton_gemv
x, w = torch.randn(1, 4096, dtype=torch.bfloat16), torch.randn(6144, 4096, dtype=torch.bfloat16)
for pdl.enabled in H100_PDL:
    triton_gemv.linear(x, w)
    triton_gemv.linear_add(x, w[:4096], torch.randn(1, 4096, dtype=torch.bfloat16))
    triton_gemv.router_linear(x, torch.randn(128, 4096, dtype=torch.bfloat16))
''',
    "triton_route": r'''
RUN = False
from autoprofile.kernels import triton_route
mode = torch.zeros(1, dtype=torch.int32)
for dtype in (torch.bfloat16, torch.float32):
    triton_route.route_topk(torch.randn(5, 128, dtype=dtype), 8, True, 1.0, mode)
    triton_route.biased_grouped_topk(torch.randn(5, 256, dtype=dtype), torch.zeros(256), 8, 8, 4, True, 2.5,
                                     mode)
''',
    # qwen3.5-27b's linear layers (bf16, fp32 state): prefill rows' conv, decode rows' layer, the gated norm
    "triton_gdn": r'''
RUN = False
from autoprofile.kernels import triton_gdn
hk, kd, hv, vd, kw = 16, 128, 48, 128, 4
c = 2 * hk * kd + hv * vd
conv, ssm = torch.zeros(4, c, kw - 1, dtype=torch.bfloat16), torch.zeros(4, hv, kd, vd)
w, slots = torch.randn(c, kw, dtype=torch.bfloat16), torch.tensor([2, 0])
bf16 = lambda *shape: torch.randn(*shape, dtype=torch.bfloat16)  # noqa: E731
triton_gdn.conv_prefill(bf16(7, c), w, conv, slots, torch.tensor([0, 3, 7]), hk, kd, hv, vd)
triton_gdn.gates(bf16(40, 2 * hv), torch.zeros(hv), torch.zeros(hv))
for pdl.enabled in H100_PDL:
    triton_gdn.decode_layer(bf16(2, c), bf16(2, hv * vd), bf16(2, 2 * hv), w, torch.zeros(hv),
                            torch.zeros(hv), torch.ones(vd, dtype=torch.bfloat16), 1e-6, conv, ssm, slots)
    triton_gdn.gated_rms_norm(bf16(2, hv, vd), bf16(2, hv * vd), torch.ones(vd, dtype=torch.bfloat16), 1e-6)
    triton_gdn.gated_rms_norm(bf16(20, hv, vd), bf16(20, hv * vd), torch.ones(vd, dtype=torch.bfloat16), 1e-6)
# a block holding a whole head: the gated norm inside the rule's kernel
triton_gdn.decode_layer(bf16(2, c), bf16(2, hv * vd), bf16(2, 2 * hv), w, torch.zeros(hv), torch.zeros(hv),
                        torch.ones(vd, dtype=torch.bfloat16), 1e-6, conv, ssm, slots,
                        launch=triton_gdn.GdnLaunch(block_v=vd))
''',
    # rope_store at llama-3.1-8b's heads, qwen3-30b-a3b's (q/k norm) and qwen3.5-27b's (gated, q/k norm,
    # RoPE on 64 of 256 channels), into bf16 and FP8 pages
    "triton_rope": r'''
RUN = False
from autoprofile.kernels import triton_rope
bf16 = lambda *shape: torch.randn(*shape, dtype=torch.bfloat16)  # noqa: E731
slots, scales = torch.tensor([17, 40]), torch.ones(2)
for pdl.enabled in H100_PDL:
    for cache_dtype, kv_scales in ((torch.bfloat16, None), (torch.float8_e4m3fn, scales)):
        for hq, hkv, d, rotary, gated, norm in ((32, 8, 128, 0, False, False), (32, 4, 128, 0, False, True),
                                                (24, 4, 256, 64, True, True)):
            qkv = bf16(2, ((2 if gated else 1) * hq + 2 * hkv) * d)
            cache = torch.zeros(8, hkv, 16, d, dtype=cache_dtype)
            cos, sin = torch.randn(2, 1, (rotary or d) // 2), torch.randn(2, 1, (rotary or d) // 2)
            triton_rope.rope_store(qkv, cos, sin, cache, cache, slots, hq, hkv, d, kv_scales,
                                   (bf16(d), bf16(d), 1e-6) if norm else None, rotary, gated)
''',
    # the multi-row FP8 GEMV at llama-3.1-8b's qkv: every padded ROWS under each table's launch (with PDL
    # and without), bf16 rows and the producers' FP8 rows (a scale a row, a K group's), bias, the residual;
    # then every launch scripts/bench_fp8.py --rows_gemv sweeps, at 2 and 8 rows
    "triton_fp8_rows": r'''
RUN = False
from autoprofile.kernels import launch_rules, triton_fp8_rows as r
from autoprofile.kernels.launch_rules import GemvRowsLaunch, fp8_gemv_rows_launch
FP8 = torch.float8_e4m3fn
n, k = 6144, 4096
w, bias = torch.zeros(n, k, dtype=FP8), torch.zeros(n, dtype=torch.bfloat16)
scales = {None: torch.ones(n), (128, 128): torch.ones(n // 128, k // 128)}
SWEEP = [GemvRowsLaunch(*c) for c in ((4, 512, 16, 1), (2, 512, 16, 1), (4, 256, 16, 1), (2, 1024, 16, 1),
                                      (8, 512, 16, 4), (4, 512, 512, 1))]


def launch_all(m, block, launch, **kw):
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    xs = torch.ones(m, 1) if block is None else torch.ones(m, k // 128)
    r.gemv(x, None, w, scales[block], block, torch.bfloat16, launch, **kw)
    r.gemv(x.to(FP8), xs, w, scales[block], block, torch.bfloat16, launch, **kw)


for pdl.enabled in H100_PDL:
    for block in scales:
        for m in (2, 3, 8, 16):
            launch = fp8_gemv_rows_launch(m, n, k, block=block is not None) or GemvRowsLaunch()
            launch_all(m, block, launch, bias=bias)
            launch_all(m, block, launch, residual=torch.zeros(m, n, dtype=torch.bfloat16))
for cfg in SWEEP:
    for m in (2, 8):
        launch_all(m, (128, 128), fp8_gemv_rows_launch(m, n, k, ((16, cfg),), block=True))
''',
    # the skinny FP8 GEMM at llama-3.1-8b's o_proj (bf16 rows) and qkv (the producers' FP8 rows): each table's
    # launch at 2, 17 and 33 rows, then with bias and with the residual; then other split launches
    # (SkinnyLaunch.split_k) as scripts/bench_fp8.py --skinny_variants sweeps them; channel and 128 x 128
    # block scales
    "triton_fp8_skinny": r'''
RUN = False
from autoprofile.kernels import triton_fp8_skinny as s
from autoprofile.kernels.launch_rules import SkinnyLaunch, fp8_skinny_launch
FP8 = torch.float8_e4m3fn
k = 4096
w = {n: torch.zeros(n, k, dtype=FP8) for n in (4096, 6144)}
scales = {None: lambda n: torch.ones(n), (128, 128): lambda n: torch.ones(n // 128, k // 128)}
VARIANTS = [SkinnyLaunch(64, 256, 4, 3, split_k=4), SkinnyLaunch(64, 128, 4, 4, split_k=8),
            SkinnyLaunch(128, 256, 8, 3, split_k=2)]


def launch_all(m, block, table=None, bias=False, residual=False):
    for n, fp8_rows in ((4096, False), (6144, True)):
        launch = fp8_skinny_launch(m, n, k, table, block is not None) or SkinnyLaunch()
        x, xs = torch.zeros(m, k, dtype=torch.bfloat16), None
        if fp8_rows:
            x, xs = x.to(FP8), torch.ones(m, 1) if block is None else torch.ones(m, k // 128)
        s.gemm(x, xs, w[n], scales[block](n), block, torch.bfloat16, launch,
               bias=torch.zeros(n, dtype=torch.bfloat16) if bias else None,
               residual=torch.zeros(m, n, dtype=torch.bfloat16) if residual else None)


for block in scales:
    for m in (2, 17, 33):
        launch_all(m, block)
    launch_all(2, block, bias=True)
    launch_all(2, block, residual=True)
    for cfg in VARIANTS:
        for m in (2, 64):
            launch_all(m, block, ((64, cfg),))
''',
    # the greedy argmax at llama-3's vocabulary and 256 rows, each dtype and grid: several programs a row (the
    # atomic max and count), then one (no scratch); the flat grid at 1,024 rows (a program ends one row and
    # starts the next) as a dependent launch
    "triton_argmax": r'''
RUN = False
from autoprofile.kernels import triton_argmax as ta
for ta.GRID in ("rows", "flat"):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.empty(256, 128256, dtype=dtype)
        ta.argmax(x)
        ta.argmax(x, 1)
ta.PDL, pdl.enabled = True, H100_PDL[1]
ta.argmax(torch.empty(1024, 128256, dtype=torch.bfloat16))
''',
    # structured output's mask: every stress corner applies it to every sampled row; a step with few grammar
    # rows names them
    "triton_bitmask": r'''
RUN = False
from autoprofile.kernels import triton_bitmask as tb
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    x, bits = torch.empty(256, 128256, dtype=dtype), torch.empty(256, 4008, dtype=torch.int32)
    grid = (256, -(-128256 // tb.BLOCK))
    for index in (None, torch.zeros(3, dtype=torch.int32)):
        rows = index if index is not None else bits
        tb._apply_bitmask[grid](x, bits, rows, 128256, x.stride(0), bits.stride(0),
                                HAS_INDEX=index is not None, BLOCK=tb.BLOCK, num_warps=tb.NUM_WARPS)
''',
    # the prefill's K/V gather at llama-3.1-8b's cache (8 heads of 128) and qwen3.5-27b's (4 of 256), bf16 and
    # FP8 pages
    "triton_kv_gather": r'''
RUN = False
from autoprofile.kernels import triton_kv_gather
for dtype in (torch.bfloat16, torch.float8_e4m3fn):
    for hkv, d in ((8, 128), (4, 256)):
        cache = torch.zeros(8, hkv, 16, d, dtype=dtype)
        triton_kv_gather.gather(cache, cache, torch.tensor([17, 40, 3]))
''',
    # the experts' GEMVs at qwen3-30b-a3b's experts (128 of 2,048 x 768, top 8), bf16 and FP8 (block 128 x 128
    # and per channel), one token
    "triton_moe_gemv": r'''
RUN = False
from autoprofile.kernels import triton_moe_gemv
from autoprofile.layers.quant import Fp8Scheme, MoeQuant
E, H, I = 128, 2048, 768
ids, weights = torch.randint(0, E, (1, 8), dtype=torch.int32), torch.rand(1, 8)
x = torch.zeros(1, H, dtype=torch.bfloat16)
w13, w2 = torch.zeros(E, 2 * I, H, dtype=torch.bfloat16), torch.zeros(E, H, I, dtype=torch.bfloat16)
triton_moe_gemv.experts(x, w13, w2, weights, ids)
f13, f2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
block = Fp8Scheme("block", (128, 128), "group")
quant = MoeQuant(torch.ones(E, 2 * I // 128, H // 128), torch.ones(E, H // 128, I // 128), block)
triton_moe_gemv.experts(x, f13, f2, weights, ids, quant)
triton_moe_gemv.experts(x, f13, f2, weights, ids, MoeQuant(torch.ones(E, 2 * I), torch.ones(E, H),
                                                           Fp8Scheme("channel")))
''',
    "triton_moe_sort": r'''
from autoprofile.kernels import triton_moe_sort
RUN = False  # Triton 3.6's interpreter with numpy 2 cannot loop to a runtime bound (int() of a 1-element array)
triton_moe_sort.sort_by_expert(torch.randint(0, 128, (5, 8), dtype=torch.int32), 128, 64)
''',
}

# kernels each launch script must reach (a launcher that stops launching one would leave it untested)
KERNELS = {
    "triton_sample": {"_sample_kernel", "_split_kernel"},
    "triton_act": {"_silu_mul_kernel"},
    "triton_norm": {"_rms_norm_kernel"},
    "triton_gemv": {"_gemv_kernel"},
    "triton_route": {"_route_kernel", "_grouped_route_kernel"},
    "triton_moe_sort": {"_sort_by_expert_kernel"},
    "triton_moe_gemv": {"_gate_up_kernel", "_down_kernel"},
    "triton_argmax": {"_argmax_kernel"},
    "triton_bitmask": {"_apply_bitmask"},
    "triton_fp8_rows": {"_gemv_rows_fp8_kernel"},
    "triton_fp8_skinny": {"_skinny_fp8_kernel"},
    "triton_rope": {"_rope_store_kernel"},
    "triton_kv_gather": {"_gather_kernel"},
    "triton_gdn": {"_conv_prefill_kernel", "_conv_window_kernel", "_gdn_decode_kernel", "_gated_norm_kernel",
                   "_gates_kernel"},
}


# the GPU hosts' Triton (DESIGN: torch 2.11, Triton 3.6), beside the one installed here: .ci/run installs it
# into this folder (`pip install --no-deps --target .ci/triton-gpu-hosts triton==3.6.0`); a kernel that only
# that compiler refuses (Triton 3.6's bf16 tl.maximum gave fp32) fails in CI, not first on the device
GPU_HOSTS_TRITON = ROOT / ".ci" / "triton-gpu-hosts"
GPU_HOSTS_VERSION = "3.6.0"
TRITONS = {"installed": None, "gpu-hosts": GPU_HOSTS_TRITON}
IS_GPU_HOSTS = f"import triton\nassert triton.__version__ == {GPU_HOSTS_VERSION!r}, triton.__version__\n"


@pytest.mark.parametrize("triton_at", list(TRITONS))
@pytest.mark.parametrize("module", [m if m in FAST else pytest.param(m, marks=pytest.mark.slow)
                                    for m in LAUNCHES])
def test_kernels_compile_for_sm90(module, triton_at, tmp_path):
    first = TRITONS[triton_at]
    if first is not None and not (first / "triton").is_dir():
        pytest.skip(f"no Triton at {first} (.ci/run installs the GPU hosts' there)")
    pin = "" if first is None else IS_GPU_HOSTS
    first = None if first is None else str(first)
    launches = tmp_path / "launches.pkl"
    run_script(pin + RECORD + LAUNCHES[module] + SAVE, str(launches), first_on_path=first)
    with open(launches, "rb") as f:
        recorded = pickle.load(f)
    assert {name for _, name, *_ in recorded} >= KERNELS[module]
    run_script(pin + COMPILE, str(launches), interpret=False, first_on_path=first)


GATHER_COUNTS = r'''
RUN = False
from autoprofile.kernels import triton_kv_gather
cache = torch.zeros(8, 8, 16, 128, dtype=torch.bfloat16)
for n in (1, 16, 17, 4096, 4103):
    triton_kv_gather.gather(cache, cache, torch.zeros(n, dtype=torch.int64))
'''


def test_the_kv_gather_is_one_specialization_at_every_slot_count(tmp_path):
    """A chunk over a prefix gathers its rows' slots, a count that follows the step: recorded as a CUDA
    launch would specialize it, 1, 16, 17, 4,096 and 4,103 slots are one compile (the stress's corners gather
    one count; a served step's other count would compile on the serving path)."""
    launches = tmp_path / "launches.pkl"
    run_script(RECORD + GATHER_COUNTS + SAVE, str(launches))
    with open(launches, "rb") as f:
        recorded = pickle.load(f)
    assert [name for _, name, *_ in recorded] == ["_gather_kernel"]
