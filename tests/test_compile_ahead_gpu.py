"""GPU: kernels.compile_ahead. A dry launch compiles and enqueues nothing; the sampler's dry calls
(sampling.compile_ahead) are specialized as the real steps' launches are, so each real launch waits for the
pool's compile instead of submitting its own; the tokens are those of a run without it. Each case runs in a
subprocess with an empty TRITON_CACHE_DIR (compiles are real, not cache hits)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import require_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DRY_WRITES_NOTHING = r'''
import torch, triton, triton.language as tl
from autoprofile.kernels.compile_ahead import CompileAhead

@triton.jit
def _ones(out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.full([BLOCK], 1, tl.int32), mask=offs < n)

out = torch.zeros(64, dtype=torch.int32, device="cuda")
with CompileAhead(torch.device("cuda"), max_workers=2) as ahead:
    ahead.dry(lambda: _ones[(1,)](out, 64, BLOCK=64))
    torch.cuda.synchronize()
    assert int(out.sum()) == 0, "a dry launch wrote its output"
    assert len(ahead.mode.raw_futures) == 1, ahead.mode.raw_futures
    _ones[(1,)](out, 64, BLOCK=64)  # the real launch: the pool's compile, launched
    assert len(ahead.mode.raw_futures) == 1, "the real launch compiled again"
torch.cuda.synchronize()
assert int(out.sum()) == 64
print("ok")
'''

SAMPLER_AHEAD = r'''
import sys, torch
from autoprofile.engine import grammar, sampling
from autoprofile.engine.sampling import (STRESS, STRESS_WIDE, SamplingBatch, SamplingParams, greedy,
                                         make_generator, sample)
from autoprofile.kernels.compile_ahead import CompileAhead

VOCAB, dev = 128256, torch.device("cuda")
x = torch.randn(256, VOCAB, device=dev).to(torch.bfloat16)
top_k, top_p = SamplingParams(temperature=0.7, top_k=40), SamplingParams(temperature=0.9, top_p=0.8)
BATCHES = [((STRESS,) * 256, True), ((STRESS_WIDE,) * 256, True), ((top_k,) * 256, False),
           ((top_k, top_p) * 128, False)]

mask = grammar.TokenBitmask(256, VOCAB, dev)
mask.host[200, :7] = 0

def steps():
    """What a boot's stress and serving sample: the stress corners' rows, top-k and mixed batches, greedy;
    structured output's mask over every row (the stress's) and over two named rows."""
    out = [sample(x.clone(), SamplingBatch.from_params(p, dev), make_generator(1, dev), stress=s)
           for p, s in BATCHES]
    every, named = x.clone(), x.clone()
    mask.apply_stress(every)
    mask._apply(named, [3, 200])
    return out + [greedy(x), greedy(x[:1]), every, named]

with CompileAhead(dev, max_workers=4) as ahead:
    ahead.dry(sampling.compile_ahead, VOCAB, torch.bfloat16, dev)
    ahead.dry(grammar.compile_ahead, VOCAB, torch.bfloat16, dev)
    dry = len(ahead.mode.raw_futures)
    got = steps()
    assert len(ahead.mode.raw_futures) == dry, f"{len(ahead.mode.raw_futures) - dry} launches compiled anew"
want = steps()  # the same calls without it (the kernels cached by now)
for g, w in zip(got, want):
    assert torch.equal(g, w)
print("ok", dry)
'''


def _run(script: str, tmp_path, *args: str) -> str:
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "PYTHONPATH": ROOT}
    path = tmp_path / "case.py"  # a file: @triton.jit reads its kernel's source
    path.write_text(script)
    out = subprocess.run([sys.executable, str(path), *args], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_a_dry_launch_compiles_and_writes_nothing(tmp_path):
    _run(DRY_WRITES_NOTHING, tmp_path)


def test_the_sampler_compiled_ahead_is_what_the_steps_launch(tmp_path):
    out = _run(SAMPLER_AHEAD, tmp_path)
    # the split kernel, the one-program kernel (two SKIPs), the argmax, the mask (every row, by index)
    assert int(out.split()[-1]) >= 5


GRAPHS_AHEAD = r'''
import sys
import torch
from autoprofile.config import ServerConfig, validate
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.sampling import GREEDY
from autoprofile.engine.scheduler import StepRow
from autoprofile.engine.weights import init_random
from autoprofile.kernels.compile_ahead import CompileAhead
from autoprofile.profiler import compile_ahead

cfg = validate(ServerConfig(model=sys.argv[1], dtype="bfloat16", attention_backend="aiter_triton",
                            max_req_total_len=4096, batch_max_tokens=8192, graph_max_batch_size=16,
                            running_max_req_size=32, piecewise_cuda_graph_max_tokens=0, report_dir=None))
r = ModelRunner(cfg)
init_random(r.model, seed=3, std=0.08)
with CompileAhead(r.device, max_workers=4) as ahead:
    ahead.dry(compile_ahead, cfg, r.device)  # as profiler.boot does: the sampler's, the kept scratch
    r.build(65536)
    late = len(ahead.mode.raw_futures) - ahead.dry_compiles
    assert ahead.dry_compiles > 0 and late == 0, (ahead.dry_compiles, late)
prompts = [[5 + i, 9, 200 + i, 3] * (3 + i) for i in range(5)]
r.req_table.write([(slot, 0, [1 + 4 * slot + j for j in range(4)]) for slot in range(len(prompts))])
with torch.no_grad():
    tok = r._prefill([StepRow(s, 0, p, True, GREEDY) for s, p in enumerate(prompts)])[0].argmax(-1).tolist()
    rows = [StepRow(s, len(p), [tok[s]], True, GREEDY) for s, p in enumerate(prompts)]
    graphed = r._decode(rows)[0].float().clone()
    graphs, r.graphs = r.graphs, None
    eager = r._decode(rows)[0].float()
    r.graphs = graphs
err = ((graphed - eager).norm() / eager.norm()).item()
assert err < 3e-2, err  # bf16 graph against eager: tests/test_graphs.py's bound
r.teardown()
print("ok", ahead.dry_compiles)
'''


@pytest.mark.parametrize("model", ["tiny", "tiny-fp8"])
def test_the_decode_graphs_compile_in_their_dry_capture(tmp_path, model):
    """Built inside a CompileAhead, every decode graph's Triton launch was compiled by the dry capture (the
    real warm-ups and captures started none), and the graphs decode as eager decode does. FP8 weights: the
    split skinny GEMM's first launch is inside the dry capture, its kept counters made before it
    (by the runner's build); without them the dry capture failed and its compiles came late."""
    require_backend("aiter_triton")
    out = _run(GRAPHS_AHEAD, tmp_path, model)
    assert int(out.split()[-1]) > 0


PREFILL_AHEAD = r'''
import sys
import torch
from autoprofile.config import ServerConfig, validate
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.weights import init_random
from autoprofile.kernels.compile_ahead import CompileAhead
from autoprofile.profiler import compile_ahead

cfg = validate(ServerConfig(model=sys.argv[1], dtype="bfloat16", attention_backend="aiter_triton",
                            max_req_total_len=4096, batch_max_tokens=8192, graph_max_batch_size=16,
                            running_max_req_size=32, report_dir=None))
r = ModelRunner(cfg)
init_random(r.model, seed=3, std=0.08)
with CompileAhead(r.device, max_workers=4) as ahead:
    ahead.dry(compile_ahead, cfg, r.device)
    r.build(65536)
    built = len(ahead.mode.raw_futures)
    r.stress_prefill()
    late = len(ahead.mode.raw_futures) - built
    assert late == 0, f"{late} Triton compiles started at the prefill corners"
r.teardown()
print("ok", built)
'''


@pytest.mark.parametrize("model", ["tiny", "tiny-fp8", "tiny-moe"])
def test_the_prefill_corners_compile_during_the_build(tmp_path, model):
    """A boot's first build runs the stress's prefill corners' forwards dry (runner._prefill_dry): every
    Triton kernel the prefill corners launch (the prefill attention's long and short configs, the prefix's
    K/V gather, the mixed corners' eager decode, MoE's experts at a corner's tokens) was compiled by then,
    none at the corners."""
    require_backend("aiter_triton")
    out = _run(PREFILL_AHEAD, tmp_path, model)
    assert int(out.split()[-1]) > 0
