"""DeepSeek-V2 on CPU (torch backend, fp32) against Hugging Face transformers with the same random weights
(HF's save_pretrained writes the checkpoint, our loader reads it): MLA's expanded prefill, a chunk over a
cached prefix (its latents expanded), the absorbed decode over the latent cache, YaRN; the MoE with shared
experts, greedy and group-limited routing; greedy generation through the engine (scheduler, prefix cache,
stress); the latent cell in the budget."""
from __future__ import annotations

import math

import pytest
import torch

from autoprofile import budget
from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.kv_cache import KVCache
from autoprofile.engine.runner import ModelRunner
from autoprofile.layers.attention import AttentionMetadata
from autoprofile.model_config import CONFIG_DIR, load_model_config
from models.deepseek_v2 import DeepseekV2ForCausalLM, mla_softmax_scale
from models.llama import rope_attention_factor, rope_inv_freq
from unit_tests.test_moe import logits as prefill
from unit_tests.test_moe import perturb, save_and_load

transformers = pytest.importorskip("transformers", minversion="5.0")

PAGE = 16
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
            n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=512,
            bos_token_id=1, eos_token_id=2,
            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                          "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})
VARIANTS = {
    "lite": {**BASE, "q_lora_rank": None},  # V2-Lite's shape: greedy top-k, no query bottleneck
    "v2": {**BASE, "q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
           "routed_scaling_factor": 1.5, "num_experts_per_tok": 3,
           "rope_scaling": {**BASE["rope_scaling"], "mscale": 1.0}},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**VARIANTS[request.param])).float()
    hf = hf.eval()
    perturb(hf)
    folder = tmp_path_factory.mktemp(request.param)
    ours = save_and_load(hf, folder)
    assert isinstance(ours, DeepseekV2ForCausalLM)
    return hf, ours, folder


def latent_cache(mc) -> KVCache:
    return KVCache(mc.num_layers, 32, 1, PAGE, mc.kv_lora_rank + mc.qk_rope_head_dim, torch.float32,
                   torch.device("cpu"), latent=True)


def tiny_cfg(folder, max_req_total_len: int) -> ServerConfig:
    return validate(ServerConfig(model=str(folder), dtype="float32", attention_backend="torch",
                                 max_req_total_len=max_req_total_len, batch_max_tokens=64,
                                 running_max_req_size=8, graph_max_batch_size=8, report_dir=None))


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0]


IDS = [5, 17, 250, 3, 3, 3, 99, 140, 7, 8, 299, 42, 0, 12, 77, 78, 79, 80, 81]


def test_config_reads_mla_and_the_moe_layout(models):
    _, ours, _ = models
    mc = ours.config
    widths = (mc.kv_lora_rank, mc.qk_rope_head_dim, mc.qk_nope_head_dim, mc.v_head_dim)
    assert mc.is_mla and widths == (32, 8, 16, 16)
    assert mc.mlp_only_layers == (0,) and mc.n_shared_experts == 2
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == ["LlamaMLP", "DeepseekV2MoE",
                                                                           "DeepseekV2MoE"]


def test_yarn_frequencies_and_scales_match_hf(models):
    hf, ours, _ = models
    mc = ours.config
    rotary = hf.model.rotary_emb
    torch.testing.assert_close(rope_inv_freq(mc.qk_rope_head_dim, mc.rope_theta, mc.rope_scaling),
                               rotary.inv_freq.float(), rtol=1e-6, atol=0)
    assert rope_attention_factor(mc.rope_scaling) == pytest.approx(rotary.attention_scaling)
    assert mla_softmax_scale(mc) == pytest.approx(hf.model.layers[0].self_attn.scaling)
    # models are built under a default device (cuda on a GPU): the frequencies are still computed on the CPU
    with torch.device("meta"):
        under_default = rope_inv_freq(mc.qk_rope_head_dim, mc.rope_theta, mc.rope_scaling)
    torch.testing.assert_close(under_default, rotary.inv_freq.float(), rtol=1e-6, atol=0)


def test_prefill_logits_match_hf(models):
    hf, ours, _ = models
    torch.testing.assert_close(prefill(ours, IDS, latent_cache(ours.config)), hf_logits(hf, IDS),
                               rtol=1e-4, atol=1e-4)


def test_a_chunk_over_the_cached_latents_matches_hf(models):
    hf, ours, _ = models
    kv = latent_cache(ours.config)
    prefill(ours, IDS[:11], kv)
    torch.testing.assert_close(prefill(ours, IDS[11:], kv, start=11), hf_logits(hf, IDS)[11:],
                               rtol=1e-4, atol=1e-4)


def test_the_absorbed_decode_over_the_latent_cache_matches_hf(models):
    """Prefill all but the last token (expanded), then decode it (absorbed: the query into the latent space,
    the cache read as one shared head): HF's logits at that token."""
    hf, ours, _ = models
    kv = latent_cache(ours.config)
    n = len(IDS) - 1
    prefill(ours, IDS[:n], kv)
    pages = math.ceil(len(IDS) / PAGE)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor([PAGE + n]),
                             block_tables=torch.arange(1, pages + 1, dtype=torch.int32)[None],
                             seq_lens=torch.tensor([n + 1], dtype=torch.int32), max_seq_len=pages * PAGE)
    with torch.no_grad():
        step = ours.compute_logits(ours(torch.tensor(IDS[n:]), torch.tensor([n]), meta, kv.layers))
    torch.testing.assert_close(step[0], hf_logits(hf, IDS)[-1], rtol=1e-4, atol=1e-4)


def test_greedy_generation_through_the_engine_matches_hf(models):
    """The runner (latent cache, stress with the routing corners) and the engine (chunks, prefix cache,
    decode steps, a second request sharing the first's prefix) generate HF's greedy tokens."""
    hf, _, folder = models
    runner = ModelRunner(tiny_cfg(folder, 256))
    runner.build(1024)
    runner.stress_prefill()
    runner.stress_decode()
    prompts = [IDS * 4, IDS * 4 + [9, 10], [200, 201]]  # 76 tokens: two chunks; the second shares 4 pages
    out = LLMEngine(runner).generate(prompts, max_tokens=8)
    for prompt, got in zip(prompts, out):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
        assert got == want.tolist(), prompt


def test_the_budget_counts_one_latent_per_token_and_layer(models):
    _, _, folder = models
    runner = ModelRunner(tiny_cfg(folder, 256))
    runner.build(512)
    mc = runner.model_config
    cell = mc.num_layers * (mc.kv_lora_rank + mc.qk_rope_head_dim) * 4
    assert runner.sizing.cell_bytes == cell == runner.kv.nbytes // 512
    lite = load_model_config("deepseek-v2-lite")
    assert budget.cell_bytes_for(lite, 2) == 27 * 576 * 2 == 31_104
    assert budget.cell_bytes_for(lite, 2, tp=2) == 31_104  # the latent is replicated on every rank


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_and_prefix_hits_on_the_latent_cache_keep_hf_greedy_tokens(models, overlap):
    """A latent cache too small for the batch: requests are preempted and recomputed, taking their own cached
    pages back. Every answer is HF's greedy one, with the overlapped engine too (the server's)."""
    hf, _, folder = models
    runner = ModelRunner(tiny_cfg(folder, 128))
    runner.build(12 * PAGE)  # 11 usable pages: 4 requests of 3-4 pages each cannot all stay
    engine = LLMEngine(runner, overlap=overlap)
    prompts = [[7 + i] + IDS * 2 for i in range(4)]
    out = engine.generate(prompts, max_tokens=12)
    assert engine.stats.preemptions > 0
    again = engine.generate(prompts[:1], max_tokens=12)
    # the hits are preempted requests taking their own pages back (the cache is too small to keep the first
    # prompt's); in this run the overlapped engine's re-admissions came after those pages were reused
    assert engine.stats.prefix_hit_tokens >= 2 * PAGE or overlap
    for prompt, got in zip(prompts + prompts[:1], out + again):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
        assert got == want.tolist(), prompt


def test_mla_is_read_for_deepseek_architectures_only_and_required_there(tmp_path):
    """The model class follows the architecture: a DeepSeek-V2 config without kv_lora_rank is refused naming
    the key; another architecture's stray kv_lora_rank is not MLA (its cache stays K/V)."""
    import json
    from autoprofile.model_config import ModelConfigError, from_hf_dict
    from models import model_class
    lite = json.loads((CONFIG_DIR / "deepseek-v2-lite" / "config.json").read_text())
    with pytest.raises(ModelConfigError, match="key 'kv_lora_rank' is missing"):
        from_hf_dict({k: v for k, v in lite.items() if k != "kv_lora_rank"})
    tiny = json.loads((CONFIG_DIR / "tiny" / "config.json").read_text())
    stray = from_hf_dict(tiny | {"kv_lora_rank": 64, "qk_rope_head_dim": 8})
    assert not stray.is_mla and model_class(stray).__name__ == "LlamaForCausalLM"
    assert budget.cache_shape(stray) == (2, 32) and budget.cache_shape(from_hf_dict(lite), tp=2) == (1, 576)
