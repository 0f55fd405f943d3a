"""Qwen3.5 hybrid models (Gated DeltaNet + gated attention) on the CPU: against Hugging Face transformers on
the same random weights (save_pretrained writes the checkpoint, our loader reads it), dense and MoE; chunked
prefill split anywhere, mixed steps, the overlapped engine and preemption giving the tokens of one cold run;
the state slots coming back; the config's bad input refused naming the key or flag; the state cache in the
budget."""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from autoprofile import budget
from autoprofile.config import ConfigError, ServerConfig, validate
from autoprofile.engine.attention import get_backend_class
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.kv_cache import KVCache
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.state_cache import StateCache, layer_caches
from autoprofile.engine.weights import load_weights
from autoprofile.layers.attention import AttentionMetadata
from autoprofile.model_config import CONFIG_DIR, ModelConfigError, from_hf_dict, load_model_config
from models import model_class

transformers = pytest.importorskip("transformers", minversion="5.0")

PAGE = 16
CPU = torch.device("cpu")
TINY = {**json.loads((CONFIG_DIR / "tiny-hybrid" / "config.json").read_text()), "hidden_size": 64,
        "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 300, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 8, "torch_dtype": "float32", "max_position_embeddings": 512}
TINY_MOE = {**{k: v for k, v in TINY.items() if k != "intermediate_size"},
            "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48}
TINY_NEXT = {**TINY_MOE, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
             "intermediate_size": 96, "mlp_only_layers": [1], "decoder_sparse_step": 1,
             "norm_topk_prob": True,
             "partial_rotary_factor": 0.25}
HF_KEYS = ("architectures", "torch_dtype")
HF_CLASSES = {"Qwen3_5ForCausalLM": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig"),
              "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig"),
              "Qwen3NextForCausalLM": ("Qwen3NextForCausalLM", "Qwen3NextConfig")}


def perturb(hf) -> None:
    """HF's init leaves the zero-centred norms at 0, the gated norm at 1, the router near uniform: every one
    moved, A_log and dt_bias spread, the rest at 0.1 (the router's at 0.5: a decisive top-k)."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("norm.weight"):
                p.uniform_(-0.3, 0.3)
            elif name.endswith(("A_log", "dt_bias")):
                p.uniform_(-1.0, 1.0)
            else:
                p.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") else 0.1)


@pytest.fixture(autouse=True)
def hf_torch_delta_rule(monkeypatch):
    """transformers takes fla-core's Triton delta rule where fla is installed (our dependency on Linux), which
    needs a GPU: the reference here is its torch path, the function fla's wrapper was made from."""
    import importlib
    import inspect
    for name in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            if hasattr(mod, fn):
                monkeypatch.setattr(mod, fn, inspect.unwrap(getattr(mod, fn)))


def hf_model(config: dict, seed: int = 0):
    cls, cfg_cls = (getattr(transformers, n) for n in HF_CLASSES[config["architectures"][0]])
    torch.manual_seed(seed)
    hf = cls(cfg_cls(**{k: v for k, v in config.items() if k not in HF_KEYS})).float().eval()
    perturb(hf)
    return hf


def ours_from(folder):
    mc = load_model_config(str(folder))
    backend = get_backend_class("torch")(mc.num_heads, mc.num_kv_heads, mc.head_dim, PAGE, torch.float32, CPU)
    model = model_class(mc)(mc, backend, dtype=torch.float32)
    load_weights(model, mc.checkpoint_files, seed=0, show_progress=False)
    return model


@pytest.fixture(scope="module", params=["dense", "moe", "next"])
def models(request, tmp_path_factory):
    hf = hf_model({"dense": TINY, "moe": TINY_MOE, "next": TINY_NEXT}[request.param])
    folder = tmp_path_factory.mktemp(f"tiny-hybrid-{request.param}")
    hf.save_pretrained(str(folder))
    return hf, ours_from(folder), folder


class Caches:
    """The KV of the attention layers and the state slots of the linear ones, for direct forwards."""

    def __init__(self, mc, slots: int = 4):
        self.kv = KVCache(mc.attention_layers, 64, mc.num_kv_heads, PAGE, mc.head_dim, torch.float32, CPU)
        self.state = StateCache(mc, slots, 1, torch.float32, CPU)
        self.layers = layer_caches(mc, self.kv.layers, self.state.layers)


def chunk_logits(model, caches: Caches, ids: list[int], start: int, slot: int = 1) -> torch.Tensor:
    """A prefill chunk of one request (pages 1, 2, ...; state slot `slot`) at positions start..: every
    token's logits; a chunk after the first attends to the prefix through the cache."""
    n = len(ids)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(start, start + n) + PAGE,
                             cu_seqlens=torch.tensor([0, n], dtype=torch.int32), max_seqlen=n,
                             state_slots=torch.tensor([slot]))
    if start:
        meta.kv_slots = torch.arange(start + n) + PAGE
        meta.cu_seqlens_k, meta.max_seqlen_k = torch.tensor([0, start + n], dtype=torch.int32), start + n
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(start, start + n), meta, caches.layers)
        return model.compute_logits(hidden)


IDS = [5, 17, 250, 3, 3, 3, 99, 140, 7, 8, 299, 42, 0, 12, 77, 1, 200, 31, 9, 64, 65, 66, 10, 11, 12, 13, 140]


def test_config_reads_the_hybrid_layout_as_transformers_5_writes_it(models):
    _, ours, folder = models
    saved = json.loads((folder / "config.json").read_text())
    mc = ours.config
    assert mc.layer_types == tuple(saved["layer_types"]) == ("linear_attention",) * 3 + ("full_attention",)
    assert (mc.linear_layers, mc.attention_layers, mc.rotary_dim) == (3, 1, 4)  # head_dim 16 x 0.25
    kinds = [type(layer.linear_attn if layer.linear else layer.self_attn).__name__
             for layer in ours.model.layers]
    assert kinds == ["GatedDeltaNet"] * 3 + ["GatedAttention"]
    # a request's state: per linear layer the conv window (conv_dim x 3) and the [4, 8, 8] fp32 matrices
    conv_dim = 2 * 2 * 8 + 4 * 8
    assert mc.state_bytes(1, 4) == 3 * (conv_dim * 3 * 4 + 4 * 8 * 8 * 4)
    assert StateCache(mc, 5, 1, torch.float32, CPU).nbytes == 6 * mc.state_bytes(1, 4)  # 5 slots + the pad


def test_prefill_logits_match_hf(models):
    hf, ours, _ = models
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(chunk_logits(ours, Caches(ours.config), IDS, 0), ref, rtol=1e-4, atol=1e-4)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(1, len(IDS) - 1), max_size=4, unique=True))
def test_a_prefill_chunked_anywhere_equals_one_prefill(models, cuts):
    """Chunks continue from the state their slot holds (conv window and delta-rule matrices) and the KV of
    the prefix: every token's logits as one prefill's."""
    _, ours, _ = models
    whole = chunk_logits(ours, Caches(ours.config), IDS, 0)
    caches, bounds = Caches(ours.config), [0, *sorted(cuts), len(IDS)]
    parts = [chunk_logits(ours, caches, IDS[a:b], a) for a, b in zip(bounds, bounds[1:])]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-4, atol=1e-4)


def cfg_for(folder, **kw) -> ServerConfig:
    base = dict(model=str(folder), dtype="float32", attention_backend="torch", max_req_total_len=128,
                batch_max_tokens=64, graph_max_batch_size=4, running_max_req_size=6, report_dir=None)
    return validate(ServerConfig(**{**base, **kw}))


def engine_for(folder, kv_tokens: int = 2048, overlap: bool = False, **kw) -> LLMEngine:
    runner = ModelRunner(cfg_for(folder, **kw))
    runner.build(kv_tokens)
    return LLMEngine(runner, overlap=overlap)


def test_32_greedy_steps_through_the_engine_match_hf(models):
    hf, _, folder = models
    prompt = IDS[:11]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert engine_for(folder).generate([prompt], max_tokens=32) == [ref]


PROMPTS = [IDS * 3, IDS[:5], [7, 8, 9] * 20, IDS[3:20], [250] * 40]


@pytest.fixture(scope="module")
def cold(models):
    """Each prompt alone, in its own engine: the tokens every other schedule must give."""
    _, _, folder = models
    return [engine_for(folder).generate([p], max_tokens=20)[0] for p in PROMPTS]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_crowd_of_mixed_steps_gives_each_request_its_tokens_alone(models, cold, overlap):
    """Chunked prefills beside decode rows in one forward (mixed steps), 6 state slots for 5 requests: no row
    reads another's state; every slot comes back."""
    _, _, folder = models
    engine = engine_for(folder, overlap=overlap)
    shapes = engine.runner.step_log = []
    assert engine.generate(PROMPTS, max_tokens=20) == cold
    assert any(s.decode_rows and s.prefill_rows for s in shapes)  # mixed steps ran
    assert sorted(engine.scheduler.free_slots) == list(range(6))


def test_preemption_recomputes_from_a_zero_state_and_gives_the_cold_tokens(models, cold):
    """A cache too small for the crowd: requests are preempted (state discarded, slot freed) and recomputed
    from their first chunk, whose slot is zeroed first."""
    _, _, folder = models
    engine = engine_for(folder, kv_tokens=12 * PAGE)
    assert engine.generate(PROMPTS, max_tokens=20) == cold
    assert engine.scheduler.num_preemptions > 0
    assert sorted(engine.scheduler.free_slots) == list(range(6))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(order=st.permutations(range(len(PROMPTS))), budget_tokens=st.sampled_from([16, 40, 64]),
       pages=st.sampled_from([10, 16, 64]))
def test_random_traffic_gives_every_request_its_cold_tokens_and_every_slot_back(models, cold, order,
                                                                                 budget_tokens, pages):
    _, _, folder = models
    engine = engine_for(folder, kv_tokens=pages * PAGE, batch_max_tokens=budget_tokens, overlap=True)
    got = engine.generate([PROMPTS[i] for i in order], max_tokens=20)
    assert got == [cold[i] for i in order]
    assert sorted(engine.scheduler.free_slots) == list(range(6))
    assert engine.scheduler.cache.num_free == engine.scheduler.cache.capacity


def test_n_choices_agree_and_a_prompt_sent_again_resumes_from_its_checkpoint(models, cold):
    """Two choices admitted together each compute the prompt (no checkpoint of it yet); the prompt sent again
    resumes from the checkpoint at its last full page (unit_tests/test_hybrid_prefix.py covers the rest)."""
    _, _, folder = models
    engine = engine_for(folder)
    assert engine.generate([PROMPTS[0], PROMPTS[0]], max_tokens=20) == [cold[0], cold[0]]
    assert engine.scheduler.prefix_hit_tokens == 0
    assert engine.generate([PROMPTS[0]], max_tokens=20) == [cold[0]]
    assert engine.scheduler.prefix_hit_tokens == (len(PROMPTS[0]) - 1) // PAGE * PAGE


def test_a_conditional_generation_checkpoint_loads_its_text_model_and_skips_the_rest(models, tmp_path,
                                                                                     caplog):
    """Qwen3_5ForConditionalGeneration's names (model.language_model.*), its vision tower and MTP layer: the
    text model loads, each skipped part is one log line."""
    hf, ours, folder = models
    if ours.config.architecture == "Qwen3NextForCausalLM":
        pytest.skip("Qwen3-Next ships as a causal LM only")
    saved = load_file(str(folder / "model.safetensors"))  # HF's checkpoint names (experts one by one)
    sd = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
          for k, v in saved.items()}
    sd |= {f"model.visual.blocks.{i}.attn.qkv.weight": torch.zeros(4, 4) for i in range(3)}
    sd |= {"mtp.fc.weight": torch.zeros(4, 4), "mtp.layers.0.input_layernorm.weight": torch.zeros(4)}
    save_file(sd, str(tmp_path / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    arch = config["architectures"][0].replace("ForCausalLM", "ForConditionalGeneration")
    wrapped = {"architectures": [arch], "model_type": "qwen3_5", "text_config": config,
               "vision_config": {"depth": 2, "hidden_size": 8, "num_heads": 2}, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    with caplog.at_level(logging.INFO, logger="models.qwen3_5"):
        loaded = ours_from(tmp_path)
    skipped = [r.getMessage() for r in caplog.records if "tensors skipped" in r.getMessage()]
    assert len(skipped) == 2
    assert any("vision" in m for m in skipped) and any("multi-token" in m for m in skipped)
    torch.testing.assert_close(chunk_logits(loaded, Caches(loaded.config), IDS, 0),
                               chunk_logits(ours, Caches(ours.config), IDS, 0))


# ---------------------------------------------------------------- bad input, budget
@pytest.mark.parametrize("change, key", [
    ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"mamba_ssm_dtype": "float64"}, "mamba_ssm_dtype"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"partial_rotary_factor": 0.01}, "partial_rotary_factor"),
])
def test_a_hybrid_config_the_engine_cannot_serve_is_refused_naming_its_key(change, key):
    with pytest.raises(ModelConfigError, match=f"key '{key}'"):
        from_hf_dict({**TINY, **change})


@pytest.mark.parametrize("flags, flag", [({"host_kv": "auto"}, "host_kv"),
                                         ({"deterministic": True}, "deterministic"),
                                         ({"quantization": "fp8"}, "quantization"), ({"tp": 3}, "tp")])
def test_what_a_hybrid_model_does_not_serve_yet_is_refused_naming_the_flag(flags, flag):
    with pytest.raises(ConfigError, match=f"--{flag}"):
        validate(ServerConfig(model="tiny-hybrid", attention_backend="torch", report_dir=None, **flags))


def test_the_state_cache_is_declared_beside_the_request_table_and_the_solver_leaves_it_room():
    mc = load_model_config("qwen3.5-27b")
    conv, ssm = budget.state_cache_bytes(mc, 256, 2)
    assert ssm == 257 * 48 * 48 * 128 * 128 * 4  # 144 MiB a request, fp32, 48 linear layers
    assert conv == 257 * 48 * (2 * 16 * 128 + 48 * 128) * 3 * 2
    plain = budget.Sizing(cell_bytes=mc.attention_layers * 2 * 4 * 256 * 2, context_len=262144, page_size=16,
                          running_reqs=256, decode_rows=256)
    hybrid = budget.Sizing(**{**plain.__dict__, "state": (conv, ssm)})
    available = 60 << 30
    gap = budget.solve_target_tokens(available, plain) - budget.solve_target_tokens(available, hybrid)
    assert gap * plain.cell_bytes >= conv + ssm  # the KV gives way to every state byte
    assert gap * plain.cell_bytes <= conv + ssm + 2 * (2 << 20) + 16 * plain.cell_bytes


@pytest.mark.parametrize("free_gib, expect", [(200, 256), (30, 104), (0.05, 1)])
def test_state_slots_fill_the_envelope_unless_their_state_would_take_over_half_the_free_memory(free_gib,
                                                                                                expect):
    per_slot = load_model_config("qwen3.5-27b").state_bytes(1, 2)
    assert budget.state_slots(256, int(free_gib * (1 << 30)), per_slot) == expect


def test_the_runner_declares_the_state_cache_it_builds():
    runner = ModelRunner(validate(ServerConfig(
        model="tiny-hybrid", dtype="float32", attention_backend="torch", max_req_total_len=256,
        running_max_req_size=5, graph_max_batch_size=4, report_dir=None)))
    sizing = runner.sizing
    runner.build(1024)
    assert sizing.state == (runner.state.conv.nbytes, runner.state.ssm.nbytes)
    assert runner.state.conv.shape[1] == 6 + 4  # 5 request slots + the pad slot + 4 state checkpoints
    runner.teardown()
    assert runner.state is None and runner.caches is None


# ---------------------------------------------------------------- served through HTTP
def test_health_and_metrics_show_the_state_slots_held_while_a_request_runs():
    """/health and /metrics count a hybrid model's state slots: all of them, and those requests hold (one
    while a streamed request runs, none after); a text model shows none."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from autoprofile import server
    from unit_tests.cpu_server import boot_cpu
    from unit_tests.test_server import metric_samples

    cfg = validate(ServerConfig(model="tiny-hybrid", dtype="float32", attention_backend="torch",
                                max_req_total_len=256, batch_max_tokens=64, graph_max_batch_size=4,
                                running_max_req_size=6, report_dir=None))
    runner, result = boot_cpu(cfg)
    engine = LLMEngine.from_config(runner, cfg)

    async def go():
        app = server.make_app(cfg, engine, result, None)
        async with TestClient(TestServer(app)) as c:
            body = {"prompt": "Hello there", "max_tokens": 40, "stream": True, "ignore_eos": True}
            async with c.post("/v1/completions", json=body) as resp:
                await resp.content.readline()  # the first chunk: the request holds its slot
                during = await (await c.get("/health")).json()
                text = await (await c.get("/metrics")).text()
                await resp.read()
            for _ in range(50):  # the loop publishes its snapshot after the request ends
                after = await (await c.get("/health")).json()
                if after["state_slots_used"] == 0:
                    break
                await asyncio.sleep(0.05)
            return during, metric_samples(text), after
    during, samples, after = asyncio.run(go())
    runner.teardown()
    assert during["state_slots"] == 6 and during["state_slots_used"] == 1
    assert samples[("autoprofile_state_slots_total", ())] == 6
    assert samples[("autoprofile_state_slots_used", ())] == 1
    assert after["state_slots_used"] == 0


def test_the_stress_writes_every_state_slot_and_its_prefill_corners_start_from_zero():
    """The envelope's corner at the most decode rows holds a row in every request slot, so the profile
    measures every slot's state written (and the decode through all of them); a prefill corner's fresh rows
    zero their slots first, so no corner reads what an earlier corner left."""
    runner = ModelRunner(validate(ServerConfig(
        model="tiny-hybrid", dtype="float32", attention_backend="torch", max_req_total_len=256,
        running_max_req_size=6, graph_max_batch_size=4, batch_max_tokens=64, report_dir=None)))
    runner.build(4096)
    slots = runner.envelope.running_reqs
    assert not runner.state.ssm.any()
    runner.stress_decode()
    written = runner.state.ssm[:, :slots].flatten(2).ne(0).any(-1)  # [layer, slot]
    assert written.all(), written
    assert not runner.state.ssm[:, slots].any() or runner.graphs is not None  # eager: the pad slot untouched
    zeroed = []
    real_reset = runner.state.reset
    runner.state.reset = lambda s: (zeroed.extend(s.tolist()), real_reset(s))
    runner.stress_prefill()
    assert set(zeroed) == set(range(min(slots, runner.envelope.prefill_rows)))
    runner.teardown()


def test_requests_beyond_the_state_slots_wait_for_one_and_get_their_cold_tokens(models, cold):
    """Three state slots for ten requests: the others wait (no 500, no shared state) and each gets its
    tokens."""
    _, _, folder = models
    engine = engine_for(folder, running_max_req_size=3, graph_max_batch_size=3, overlap=True)
    shapes = engine.runner.step_log = []
    assert engine.generate(PROMPTS * 2, max_tokens=20) == cold * 2
    assert max(s.running_reqs for s in shapes) == 3
    assert sorted(engine.scheduler.free_slots) == [0, 1, 2]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_step_that_fails_mid_forward_ends_its_decode_rows_too_and_no_state_is_applied_twice(
        models, cold, monkeypatch, overlap):
    """A mixed step raises in its last linear layer, after the earlier ones advanced its decode rows' states:
    a text model's decode rows would run that token again (K/V written twice is the same K/V); a hybrid's
    would apply it twice, so the engine ends every row of the step with "error". The rest of the crowd, and a
    request sent after, get their cold tokens."""
    _, ours, folder = models
    engine = engine_for(folder, overlap=overlap)
    layer = [m for m in engine.runner.model.modules() if type(m).__name__ == "GatedDeltaNet"][-1]
    real, fired = type(layer).forward, []

    def forward(self, x, meta, state, residual=None):
        if self is layer and not fired and meta.is_prefill and meta.decode is not None:
            fired.append(meta.decode.state_slots.tolist())
            raise RuntimeError("injected: the forward failed")
        return real(self, x, meta, state, residual)
    monkeypatch.setattr(type(layer), "forward", forward)
    ids = [engine.add_request(p, max_tokens=20) for p in PROMPTS]
    out: dict[str, tuple[list[int], str]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens, _ = out.get(o.request_id, ([], ""))
            out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason)
    assert fired and engine.stats.failed_steps == 1
    failed = [i for i, rid in enumerate(ids) if out[rid][1] == "error"]
    assert len(failed) > len(fired[0])  # the decode rows and the prefill rows
    for i, rid in enumerate(ids):
        if i not in failed:
            assert out[rid] == (cold[i], "length")
        else:
            assert out[rid][0] == cold[i][:len(out[rid][0])]  # what was sent before the failure was right
    assert engine.generate([PROMPTS[0]], max_tokens=20) == [cold[0]]
    assert sorted(engine.scheduler.free_slots) == list(range(6))


def test_the_profile_solves_the_kv_around_the_state_slots_and_reports_them():
    """The profiler (a simulated GPU: only the CUDA memory API is faked) builds the state cache in the
    probe and at the target and subtracts it as declared memory: the target gives way to every state byte,
    and the budget report shows the slots and their bytes."""
    from autoprofile.profiler import Profiler
    from autoprofile.report import format_report, to_dict
    from unit_tests.fakes import FakeGPU, FakeRunner, llama8b_sizing

    cfg = ServerConfig(model="llama-3.1-8b", max_req_total_len=8192, canary_mb=1, batch_max_tokens=8192,
                       graph_max_batch_size=256, report_dir=None)
    state = budget.state_cache_bytes(load_model_config("qwen3.5-27b"), 40, 2)  # 41 x 147 MiB: about 6 GiB
    results = []
    for sizing in (llama8b_sizing(), dataclasses.replace(llama8b_sizing(), state=state)):
        gpu = FakeGPU()
        with gpu.patched():
            runner = FakeRunner(gpu, sizing)
            prof = Profiler(cfg, runner)
            runner.profiler = prof
            results.append(prof.run())
    plain, hybrid = results
    reserved = sum(map(budget.reserved_bytes, state))
    assert hybrid.terms["state_cache"] == reserved and plain.terms["state_cache"] == 0
    gap = (plain.tokens - hybrid.tokens) * plain.cell_bytes
    assert reserved <= gap < reserved + 2 * 16 * plain.cell_bytes
    assert hybrid.state_slots == 256 and plain.state_slots == 0 and to_dict(hybrid)["state_slots"] == 256
    text = format_report(hybrid)
    assert "state slots = 256" in text and "state slots (hybrid" in text
    assert "state slots" not in format_report(plain)


@pytest.mark.parametrize("free_gib, slots", [(100, 256), (30, 104)])
def test_before_the_probe_a_hybrid_keeps_the_slots_half_the_free_memory_holds_and_says_why(free_gib, slots,
                                                                                           caplog):
    """profiler.choose_state_slots on a simulated GPU: qwen3.5-27b's 256 decode rows keep their state where
    it fits in half of what the weights leave; else the most slots that do, set as --running_max_req_size
    (the graphs' batch capped by it), in the runner's config too, with the reason in the log. A flag given:
    as is."""
    from types import SimpleNamespace

    from autoprofile.layers.parallel import TP
    from autoprofile.profiler import choose_state_slots
    from unit_tests.fakes import FakeGPU

    cfg = ServerConfig(model="qwen3.5-27b", report_dir=None)
    gpu = FakeGPU()
    gpu.total, gpu.non_torch, gpu.peers, gpu.reserved = int(free_gib * (1 << 30)), 0, 0, 0
    runner = SimpleNamespace(device=torch.device("cuda", 0), tp=TP(), dtype=torch.bfloat16, cfg=cfg)
    with gpu.patched(), caplog.at_level(logging.INFO, logger="autoprofile.profiler"):
        got = choose_state_slots(cfg, runner, None)
        pinned = choose_state_slots(cfg.replace(running_max_req_size=7, graph_max_batch_size=7), runner, None)
    assert (got.running_max_req_size, got.graph_max_batch_size) == (slots, min(256, slots))
    assert runner.cfg is got and pinned.running_max_req_size == 7
    assert ("would take more than 50%" in caplog.text) == (slots < 256)
