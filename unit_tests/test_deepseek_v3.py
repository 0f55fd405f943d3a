"""DeepSeek-V3 on CPU (torch backend, fp32) against Hugging Face transformers' DeepseekV3ForCausalLM with the
same random weights (HF's save_pretrained writes the checkpoint, our loader reads it), its router's correction
bias drawn large enough to change the choice: prefill logits, 32 greedy decode steps through the engine, a
block-FP8 checkpoint in DeepSeek's names with its multi-token-prediction layer (skipped, one log line). The
noaux_tc router (layers.moe.biased_grouped_topk) against a plain per-row reference under hypothesis (ties,
groups, the bias), and the stress's forced routings whatever the bias. The built-in configs."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from autoprofile.engine.attention import get_backend_class
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.runner import ModelRunner
from autoprofile.layers.moe import GroupedTopk, Routing, biased_grouped_topk
from autoprofile.model_config import ModelConfigError, from_hf_dict, load_model_config
from models.deepseek_v2 import DeepseekV3ForCausalLM
from unit_tests.test_deepseek_v2 import hf_logits, latent_cache, tiny_cfg
from unit_tests.test_fp8_models import compare, ours, prefill_logits, write
from unit_tests.test_moe import PAGE, perturb, save_and_load
from unit_tests.test_moe import logits as prefill

transformers = pytest.importorskip("transformers", minversion="5.0")

V3 = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
          n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24,
          qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=512, n_group=4,
          topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, bos_token_id=1, eos_token_id=2,
          rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
IDS = [5, 17, 250, 3, 3, 3, 99, 140, 7, 8, 299, 42, 0, 12, 77, 78, 79, 80, 81]


def hf_v3():
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**V3)).float().eval()
    perturb(hf)
    with torch.no_grad():  # a buffer HF leaves at 0: as large as the sigmoid scores' spread
        for layer in hf.model.layers[V3["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    return hf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf = hf_v3()
    folder = tmp_path_factory.mktemp("v3")
    ours_ = save_and_load(hf, folder)
    assert isinstance(ours_, DeepseekV3ForCausalLM)
    return hf, ours_, folder


def test_config_reads_the_v3_router(models):
    _, model, _ = models
    mc = model.config
    assert (mc.topk_method, mc.scoring_func, mc.n_group, mc.topk_group) == ("noaux_tc", "sigmoid", 4, 2)
    assert (mc.routed_scaling_factor, mc.norm_topk_prob, mc.mlp_only_layers) == (2.5, True, (0,))
    assert mc.num_nextn_predict_layers == 1  # transformers' default, written by save_pretrained
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["LlamaMLP", "DeepseekV2MoE",
                                                                            "DeepseekV2MoE"]


def test_prefill_logits_match_hf_and_the_bias_is_what_makes_them(models):
    """HF's logits; with our correction biases zeroed they move (so the comparison covers the bias)."""
    hf, model, _ = models
    want = hf_logits(hf, IDS)
    torch.testing.assert_close(prefill(model, IDS, latent_cache(model.config)), want, rtol=1e-4, atol=1e-4)
    biases = [layer.mlp.gate.e_score_correction_bias for layer in model.model.layers[1:]]
    saved = [b.clone() for b in biases]
    try:
        for b in biases:
            b.zero_()
        assert (prefill(model, IDS, latent_cache(model.config)) - want).abs().max() > 1e-2
    finally:
        for b, s in zip(biases, saved):
            b.copy_(s)


def test_32_greedy_decode_steps_through_the_engine_match_hf(models):
    """The runner (latent cache, the stress's routing corners) and the engine (chunked prefill, decode steps)
    generate HF's 32 greedy tokens."""
    hf, _, folder = models
    runner = ModelRunner(tiny_cfg(folder, 256))
    runner.build(1024)
    runner.stress_prefill()
    runner.stress_decode()
    prompts = [IDS * 4, [200, 201, 7]]  # 76 tokens: two chunks
    out = LLMEngine(runner).generate(prompts, max_tokens=32)
    for prompt, got in zip(prompts, out):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):]
        assert got == want.tolist(), prompt


def test_a_block_fp8_checkpoint_with_its_mtp_layer_loads_and_skips_that_layer(models, tmp_path, caplog):
    """DeepSeek's FP8 format (weight_scale_inv per 32x32 block here) in V3's names (q_a/q_b, the router's
    e_score_correction_bias): logits within the FP8 tolerance of the dequantized twin. The checkpoint's MTP
    layer (model.layers.3.*, FP8 too) is skipped without a warning per tensor, with one log line."""
    hf, _, _ = models
    fp8, ref = write(hf, "hf-block", tmp_path)
    mtp = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128, dtype=torch.float8_e4m3fn),
           "model.layers.3.eh_proj.weight_scale_inv": torch.ones(2, 4),
           "model.layers.3.enorm.weight": torch.ones(64),
           "model.layers.3.mlp.experts.0.gate_proj.weight": torch.zeros(32, 64, dtype=torch.float8_e4m3fn),
           "model.layers.3.mlp.gate.e_score_correction_bias": torch.zeros(16)}
    save_file(mtp, str(fp8 / "model-mtp.safetensors"))
    with caplog.at_level(logging.INFO):
        model = ours(fp8)
    assert model.config.quant.block == (32, 32)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert sum("multi-token-prediction" in r.getMessage() for r in caplog.records) == 1
    err, agree = compare(prefill_logits(model), prefill_logits(ours(ref)))
    # measured 0.094 (0.057 with the biases at 0): 3 of 22 positions at 0.14-0.25, where the W8A8 noise
    # crosses a near-tie of corrected scores and an expert changes; every decisive greedy token agrees
    assert err < 0.12 and agree >= 0.9, (err, agree)


# ---------------------------------------------------------------- the router
def reference_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                    renormalize: bool, scale: float) -> tuple[list[list[float]], list[list[int]]]:
    """noaux_tc row by row in plain Python over the fp32 scores: groups by the sum of their two best
    corrected scores, experts by corrected score, the lower index first among equals."""
    scores = logits.float().sigmoid().numpy()
    choice = scores + bias.float().numpy()
    size = logits.shape[1] // n_group
    all_w, all_ids = [], []
    for s, c in zip(scores, choice):
        def group_score(g):
            top = sorted(c[g * size:(g + 1) * size], reverse=True)[:2]
            return np.float32(sum(top[1:], top[0]))  # one fp32 addition, as the router's sum of two
        groups = sorted(range(n_group), key=lambda g: (-group_score(g), g))[:topk_group]
        experts = [e for g in sorted(groups) for e in range(g * size, (g + 1) * size)]
        ids = sorted(experts, key=lambda e: (-c[e], e))[:top_k]
        w = [float(s[e]) for e in ids]
        if renormalize:
            w = [x / (sum(w) + 1e-20) for x in w]
        all_w.append([x * scale for x in w])
        all_ids.append(ids)
    return all_w, all_ids


# small integer-valued logits and biases: equal scores, equal group sums, a bias that flips a choice
LAYOUTS = st.sampled_from([(8, 1, 1, 2), (8, 4, 2, 3), (16, 4, 2, 4), (16, 8, 3, 5), (32, 8, 4, 8),
                           (12, 3, 1, 4)])  # (experts, n_group, topk_group, top_k)


@settings(max_examples=150, deadline=None)
@given(layout=LAYOUTS, data=st.data(), renormalize=st.booleans(),
       scale=st.sampled_from([1.0, 2.5]))
def test_the_noaux_tc_router_matches_a_per_row_reference(layout, data, renormalize, scale):
    experts, n_group, topk_group, top_k = layout
    tokens = data.draw(st.integers(1, 6))
    values = st.sampled_from([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0])
    logits = torch.tensor(data.draw(st.lists(st.lists(values, min_size=experts, max_size=experts),
                                             min_size=tokens, max_size=tokens)))
    bias = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.0, -0.25, 0.25, 1.0, -8.0]),
                                           min_size=experts, max_size=experts)))
    weights, ids = biased_grouped_topk(logits, bias, top_k, n_group, topk_group, renormalize, scale)
    want_w, want_ids = reference_route(logits, bias, top_k, n_group, topk_group, renormalize, scale)
    assert ids.dtype == torch.int32 and ids.tolist() == want_ids
    torch.testing.assert_close(weights, torch.tensor(want_w), rtol=1e-6, atol=0)


def test_the_bias_chooses_but_does_not_weigh():
    """A bias that drags expert 7 in: it is chosen, with its own sigmoid score as weight."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, 0.2, 0.1, -3.0]])
    bias = torch.zeros(8)
    bias[7] = 10.0
    weights, ids = biased_grouped_topk(logits, bias, 2, 2, 1, False, 1.0)
    assert ids.tolist() == [[7, 4]]  # group 1 (4..7) wins on 7's corrected score; then 4, its best plain
    torch.testing.assert_close(weights, torch.tensor([[-3.0, 0.5]]).sigmoid())


@settings(max_examples=60, deadline=None)
@given(data=st.data(), routing=st.sampled_from(["model", "worst", "balanced"]))
def test_no_bias_or_prompt_escapes_the_stress_corners(data, routing):
    """The envelope for noaux_tc: whatever the logits (a prompt) and the correction bias (a checkpoint), the
    router gives each token top_k distinct experts, so no expert holds more than T tokens (the worst corner
    puts all T on each of experts 0..k-1) and at most min(E, T k) experts are hit (the balanced corner hits
    that many). And the stress's forced routings replace the router's ids whatever the bias: the backend
    applies Routing after noaux_tc as after the greedy router."""
    experts, n_group, topk_group, top_k = 32, 8, 4, 8
    tokens = data.draw(st.integers(1, 40))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16)))
    logits = torch.randn(tokens, experts, generator=gen) * data.draw(st.sampled_from([0.0, 1.0, 30.0]))
    bias = torch.randn(experts, generator=gen) * data.draw(st.sampled_from([0.0, 1.0, 1e3]))
    backend = get_backend_class("torch")(4, 4, 16, PAGE, torch.float32, torch.device("cpu"))
    r = Routing()
    r.set(routing)
    weights, ids = backend.route_experts(logits, top_k, True, 2.5, r, GroupedTopk(bias, n_group, topk_group))
    assert weights.shape == ids.shape == (tokens, top_k) and torch.isfinite(weights).all()
    assert ((0 <= ids) & (ids < experts)).all()
    assert all(len(set(row)) == top_k for row in ids.tolist())  # distinct: no expert twice in a token
    counts = torch.bincount(ids.flatten().long(), minlength=experts)
    assert counts.max() <= tokens and (counts > 0).sum() <= min(experts, tokens * top_k)
    if routing == "worst":
        assert ids.tolist() == [list(range(top_k))] * tokens
    elif routing == "balanced":
        want = (torch.arange(tokens)[:, None] * top_k + torch.arange(top_k)) % experts
        assert torch.equal(ids, want.to(torch.int32))


# ---------------------------------------------------------------- configs
def test_the_built_in_v3_configs():
    full, eight, tiny = (load_model_config(n) for n in ("deepseek-v3", "deepseek-v3-8l", "tiny-deepseek-v3"))
    for mc in (full, eight, tiny):
        assert mc.architecture == "DeepseekV3ForCausalLM" and mc.topk_method == "noaux_tc" and mc.is_mla
    assert round(full.num_params() / 1e9) == 671  # DeepSeek's 671B (the MTP layer's 14B not built)
    assert (full.num_layers, eight.num_layers, full.moe_layers, eight.moe_layers) == (61, 8, 58, 5)
    assert (full.num_experts, full.num_experts_per_tok, full.n_shared_experts) == (256, 8, 1)
    assert (full.n_group, full.topk_group, full.routed_scaling_factor) == (8, 4, 2.5)
    assert full.quant.block == (128, 128) and eight.quant == full.quant and tiny.quant is None
    assert full.hidden_size == eight.hidden_size == 7168 and full.rope_scaling["factor"] == 40


@pytest.mark.parametrize("change,key", [
    ({"topk_group": 1, "num_experts_per_tok": 40}, "topk_group"),  # 1 group of 32 cannot hold 40
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "sinkhorn"}, "topk_method"),
    ({"rope_interleave": False}, "rope_interleave"),
    ({"n_group": 7}, "n_group"),
])
def test_a_bad_v3_config_is_refused_naming_the_key(change, key):
    d = load_model_config("deepseek-v3").raw
    with pytest.raises(ModelConfigError, match=f"key '{key}'"):
        from_hf_dict({**d, **change})


def test_noaux_tc_is_refused_for_v2():
    d = load_model_config("deepseek-v2-lite").raw | {"topk_method": "noaux_tc", "n_group": 8, "topk_group": 4}
    with pytest.raises(ModelConfigError, match="key 'topk_method'.*DeepseekV3ForCausalLM"):
        from_hf_dict(d)


# ---------------------------------------------------------------- plan
def v3_plan(gpu: str, tp: int):
    from autoprofile.config import ServerConfig, validate
    from autoprofile.plan import GPUS, make_plan
    return make_plan(validate(ServerConfig(model="deepseek-v3", tp=tp), serving=False), GPUS[gpu])


@pytest.mark.parametrize("gpu,tp", [("h200", 8), ("h100", 16)])
def test_plan_of_deepseek_v3_on_8_h200_and_16_h100(gpu, tp):
    """Weights per rank about the checkpoint's ~690 GB over the ranks (the MTP layer's ~12 GB not built), one
    latent of 576 per token and layer on every rank (replicated: the cell does not shrink with TP), KV
    tokens left, and plan says the latent is replicated. --tp 16 is planned as 16 ranks of one kind; two hosts
    (--nnodes) are not served yet."""
    from autoprofile.plan import format_plan
    p = v3_plan(gpu, tp)
    weights = next(r for r in p.fixed if r.term == "weights").bytes
    assert 650e9 / tp < weights < 700e9 / tp, weights * tp / 1e9
    assert p.cell_bytes == 61 * 576 * 2 and p.problem is None
    assert p.tokens > {"h200": 500_000, "h100": 300_000}[gpu]
    text = format_plan(p)
    assert f"MLA latent replicated on all {tp} ranks" in text and f"of the model ({p.tokens:,})" in text


def test_plan_counts_the_v3_model_s_parameters_on_every_rank(tmp_path):
    """The tiny V3 in block FP8 at --tp 2: the plan's weights row is each rank's parameter bytes (fp32 router
    weight and correction bias included), built on the meta device."""
    import json

    from autoprofile.config import ServerConfig, validate
    from autoprofile.layers.parallel import TP
    from autoprofile.model_config import CONFIG_DIR
    from autoprofile.plan import GPUS, make_plan
    from models import model_class
    d = json.loads((CONFIG_DIR / "tiny-deepseek-v3" / "config.json").read_text())
    d["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                "weight_block_size": [32, 32], "modules_to_not_convert": ["lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = validate(ServerConfig(model=str(tmp_path), attention_backend="torch", max_req_total_len=1024,
                                batch_max_tokens=512, graph_max_batch_size=8, disable_cudagraph=True, tp=2,
                                load_format="dummy"))
    mc = cfg.model_config
    p = make_plan(cfg, GPUS["h100"])
    want = sum(r.bytes for r in p.fixed if r.term in ("weights", "rope table"))
    for rank in range(2):
        with torch.device("meta"):
            model = model_class(mc)(mc, None, TP(rank, 2), torch.bfloat16, cfg.context_len)
        assert want == sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
