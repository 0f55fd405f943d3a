"""MoE, MLA and hybrid models under tensor parallelism on CPU (gloo ranks, fp32, torch backend): TP splits every
expert's intermediate dimension (and DeepSeek's heads, its latent cache and router replicated; Qwen3.5's Gated
DeltaNet heads and their state slots), both ranks
run the stress with its forced-routing corners, and --tp 2 generates the tokens --tp 1 does."""
from __future__ import annotations

import json
import pickle

import pytest
import torch

from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.runner import ModelRunner
from autoprofile.tp import broadcast
from unit_tests.test_deepseek_v2 import VARIANTS
from unit_tests.test_moe import TINY, perturb
from unit_tests.test_tp import run

transformers = pytest.importorskip("transformers", minversion="5.0")

PROMPTS = [[5, 17, 250, 3, 3, 3, 99, 140] * 5, [9] * 30, [200, 201, 202]]
NEW = 6


@pytest.fixture(scope="module", params=["qwen3-moe", "deepseek-v2", "qwen3.5-moe"])
def folder(request, tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3.5-moe":  # hybrid: GDN heads, the state slots and the shared expert split too
        from unit_tests import test_qwen3_5
        test_qwen3_5.hf_model(test_qwen3_5.TINY_MOE).save_pretrained(str(path))
        return str(path)
    if request.param == "qwen3-moe":
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY))
    else:
        hf = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**VARIANTS["v2"]))
    perturb(hf, expert_std=0.2)  # the experts loud enough to decide the tokens
    hf.float().save_pretrained(str(path))
    return str(path)


def cfg(folder: str, tp: int) -> ServerConfig:
    return validate(ServerConfig(model=folder, attention_backend="torch", dtype="float32", page_size=16,
                                 batch_max_tokens=32, max_req_total_len=256, running_max_req_size=8,
                                 graph_max_batch_size=4, report_dir=None, tp=tp))


def _serve(guard, folder: str):
    runner = ModelRunner(cfg(folder, 2), rank=guard.rank, world_size=2, group=guard.data)
    guarded = guard.bind(runner)
    guarded.build(2048)
    shapes = len(guarded.stress_prefill()) + len(guarded.stress_decode())  # in lockstep on both ranks
    if guard.rank:
        return shapes, broadcast.worker_loop(guarded)
    broadcaster = broadcast.StepBroadcaster(guarded)
    out = LLMEngine(broadcaster).generate(PROMPTS, max_tokens=NEW)
    broadcaster.close()
    return shapes, out


@pytest.mark.slow
def test_tp2_generates_what_tp1_does(folder):
    one = ModelRunner(cfg(folder, 1))
    one.build(2048)
    want = LLMEngine(one).generate(PROMPTS, max_tokens=NEW)
    out, _ = run(_serve, 2, folder)
    assert out[0].ok and out[1].ok, out
    (shapes0, got), (shapes1, steps) = out[0].value, out[1].value
    assert got == want
    assert shapes0 == shapes1 == len(one.stress_prefill()) + len(one.stress_decode())
    assert steps > NEW  # the worker ran every step


def test_a_rank_holds_half_of_every_expert(folder):
    mc = cfg(folder, 2).model_config
    runner = ModelRunner(cfg(folder, 2), rank=1, world_size=2)
    experts = next(m for m in runner.model.modules() if type(m).__name__ == "FusedMoE")
    assert tuple(experts.gate_up_proj.shape) == (mc.num_experts, mc.moe_intermediate_size, mc.hidden_size)
    assert tuple(experts.down_proj.shape) == (mc.num_experts, mc.hidden_size, mc.moe_intermediate_size // 2)
    saved = json.loads((runner.model_config.checkpoint_files[0].parent / "config.json").read_text())
    assert saved["architectures"][0] == mc.architecture


def test_a_forced_routing_survives_the_step_broadcast():
    from autoprofile.engine.scheduler import Step, StepRow
    from autoprofile.engine.sampling import GREEDY
    step = Step(True, [StepRow(0, 0, [1, 2, 3], True, GREEDY)], [(0, 0, [1])], running=1, pages_used=1,
                routing="worst")
    assert broadcast.decode(pickle.loads(pickle.dumps(broadcast.encode(step)))).routing == "worst"
