"""Qwen3-MoE on CPU: against Hugging Face transformers on the same random weights (HF's save_pretrained writes
the per-expert checkpoint, our loader packs it), the experts' TP shards, and the routing the stress forces:
every token to the same experts and an even spread, the two ends real traffic routes between."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from autoprofile.config import ServerConfig, validate
from autoprofile.engine import stress
from autoprofile.engine.attention import get_backend_class
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.kv_cache import KVCache
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.weights import checkpoint_target, load_weights
from autoprofile.layers.attention import AttentionMetadata
from autoprofile.kernels.launch_rules import sorted_slots
from autoprofile.layers.moe import FusedMoE, Routing, expert_part, moe_reference, route, sort_by_expert
from autoprofile.layers.parallel import TP
from autoprofile.model_config import CONFIG_DIR, load_model_config
from models import model_class
from models.llama import LlamaForCausalLM, SparseMoeBlock

transformers = pytest.importorskip("transformers", minversion="5.0")

PAGE = 16
TINY = {**json.loads((CONFIG_DIR / "tiny-moe" / "config.json").read_text()), "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "num_hidden_layers": 3, "num_attention_heads": 4, "head_dim": 16, "vocab_size": 300,
        "max_position_embeddings": 512, "torch_dtype": "float32"}


def perturb(hf, expert_std: float = 0.05) -> None:
    """HF's init leaves norms at 1 and the router near uniform: norms off 1, the router's logits spread so
    that the top-k is decisive, the experts at expert_std."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") else
                          expert_std if ".experts." in name else 0.05)


def save_and_load(hf, folder):
    """HF's save_pretrained, then our model (fp32, torch backend) loaded from that folder."""
    hf.save_pretrained(str(folder))
    mc = load_model_config(str(folder))
    backend = get_backend_class("torch")(mc.num_heads, mc.num_kv_heads, mc.head_dim, PAGE, torch.float32,
                                         torch.device("cpu"))
    ours = model_class(mc)(mc, backend, dtype=torch.float32)
    load_weights(ours, mc.checkpoint_files, seed=0, show_progress=False)
    return ours


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(HF fp32 model, ours loaded from what HF saved): layer 0 dense (mlp_only_layers), 1 and 2 experts."""
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY)).float().eval()
    perturb(hf)
    folder = tmp_path_factory.mktemp("tiny-moe")
    return hf, save_and_load(hf, folder), folder


def logits(model, ids: list[int], kv: KVCache, start: int = 0) -> torch.Tensor:
    """Prefill of ids at positions start.. of one request on pages 1, 2, ... (page 0 is the pad)."""
    n = len(ids)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(start, start + n) + PAGE,
                             cu_seqlens=torch.tensor([0, n], dtype=torch.int32), max_seqlen=n)
    if start:  # the prefix is in the cache: attend to prefix + new tokens
        meta.kv_slots = torch.arange(start + n) + PAGE
        meta.cu_seqlens_k, meta.max_seqlen_k = torch.tensor([0, start + n], dtype=torch.int32), start + n
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(start, start + n), meta, kv.layers))


def kv_cache(mc) -> KVCache:
    return KVCache(mc.num_layers, 32, mc.num_kv_heads, PAGE, mc.head_dim, torch.float32, torch.device("cpu"))


def test_config_reads_the_moe_layout_as_transformers_5_writes_it(models):
    _, ours, folder = models
    saved = json.loads((folder / "config.json").read_text())
    assert "num_experts" not in saved and saved["num_local_experts"] == 8  # 5.x's spelling
    mc = ours.config
    layout = (mc.num_experts, mc.num_experts_per_tok, mc.norm_topk_prob, mc.mlp_only_layers)
    assert layout == (8, 2, True, (0,))
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == ["LlamaMLP", "SparseMoeBlock",
                                                                           "SparseMoeBlock"]


def test_prefill_logits_match_hf(models):
    hf, ours, _ = models
    ids = [5, 17, 250, 3, 3, 3, 99, 140, 7, 8, 299, 42, 0, 12]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits(ours, ids, kv_cache(ours.config)), ref, rtol=1e-4, atol=1e-4)


def test_a_chunk_over_the_cached_prefix_matches_hf(models):
    """The last 5 tokens as a chunk over the first 9 in the paged cache: HF's logits at those tokens."""
    hf, ours, _ = models
    ids = [11, 250, 7, 199, 42, 6, 6, 6, 6, 100, 101, 102, 103, 104]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0, 9:]
    kv = kv_cache(ours.config)
    logits(ours, ids[:9], kv)
    torch.testing.assert_close(logits(ours, ids[9:], kv, start=9), ref, rtol=1e-4, atol=1e-4)


def test_experts_are_packed_from_per_expert_checkpoint_names():
    assert expert_part("model.layers.3.mlp.experts.17.gate_proj.weight") == (
        "model.layers.3.mlp.experts.gate_up_proj", 34)
    assert expert_part("model.layers.3.mlp.experts.17.up_proj.weight") == (
        "model.layers.3.mlp.experts.gate_up_proj", 35)
    assert expert_part("model.layers.3.mlp.experts.17.down_proj.weight") == (
        "model.layers.3.mlp.experts.down_proj", 17)
    assert expert_part("model.layers.3.mlp.gate.weight") is None
    assert expert_part("model.layers.3.mlp.experts.x.gate_proj.weight") is None
    assert checkpoint_target("model.layers.0.mlp.gate_proj.weight", {"gate_proj": ("gate_up_proj", 0)}) == (
        "model.layers.0.mlp.gate_up_proj.weight", 0)  # a dense MLP's gate is not an expert's


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tp_rank_holds_its_columns_of_every_expert_and_the_ranks_sum_to_the_whole(rank):
    """TP 2 splits each expert's intermediate dimension: rank r's gate/up rows and down columns; the two
    ranks' partial outputs (before the all-reduce) sum to the unsplit layer's."""
    e, k, h, i = 4, 2, 8, 6
    g = torch.Generator().manual_seed(1)
    gate, up, down = (torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g),
                      torch.randn(e, h, i, generator=g))
    x, logits_ = torch.randn(5, h, generator=g), torch.randn(5, e, generator=g)
    backend = get_backend_class("torch")(2, 2, 4, PAGE, torch.float32, torch.device("cpu"))

    def layer(r: int, size: int) -> FusedMoE:
        moe = FusedMoE(e, k, h, i, TP(r, size), torch.float32, backend, Routing())
        for x_ in range(e):
            for part, src in ((2 * x_, gate[x_]), (2 * x_ + 1, up[x_])):
                moe.gate_up_proj.weight_loader(moe.gate_up_proj, src, part)
            moe.down_proj.weight_loader(moe.down_proj, down[x_], x_)
        return moe

    shard = layer(rank, 2)
    half = slice(rank * i // 2, (rank + 1) * i // 2)
    assert torch.equal(shard.gate_up_proj[:, : i // 2], gate[:, half])
    assert torch.equal(shard.gate_up_proj[:, i // 2:], up[:, half])
    assert torch.equal(shard.down_proj, down[:, :, half])
    weights, ids = route(logits_, k, True)
    with torch.no_grad():
        whole = layer(0, 1)(x, weights, ids)
        parts = sum(backend.fused_moe(x, m.gate_up_proj, m.down_proj, weights, ids)  # before the all-reduce
                    for m in (layer(r, 2) for r in range(2)))
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)


def test_forced_routings_send_every_token_to_the_same_experts_or_spread_them_evenly():
    ids = torch.tensor([[3, 1], [3, 1], [0, 2], [5, 7], [6, 4]], dtype=torch.int32)
    routing = Routing()
    assert torch.equal(routing.apply(ids, 8), ids)
    routing.set("worst")
    assert routing.apply(ids, 8).tolist() == [[0, 1]] * 5
    routing.set("balanced")
    counts = torch.bincount(routing.apply(ids, 8).flatten().long(), minlength=8)
    assert counts.max() - counts.min() <= 1 and counts.sum() == 10
    assert all(len(set(row)) == 2 for row in routing.apply(ids, 8).tolist())  # k distinct experts per token
    routing.set("model")
    assert torch.equal(routing.apply(ids, 8), ids)
    with pytest.raises(ValueError, match="unknown routing 'all'"):
        routing.set("all")


def test_router_renormalises_the_top_k_only_when_the_config_says_so():
    logits_ = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = route(logits_, 2, renormalize=False)
    p = torch.softmax(logits_, -1)[0]
    assert ids.tolist() == [[0, 1]] and torch.allclose(w, p[:2].unsqueeze(0))
    w, _ = route(logits_, 2, renormalize=True)
    assert torch.allclose(w.sum(-1), torch.ones(1))


# ---------------------------------------------------------------- the stress: routing corners
@pytest.fixture(scope="module")
def runner():
    cfg = validate(ServerConfig(model="tiny-moe", dtype="float32", attention_backend="torch",
                                max_req_total_len=256, batch_max_tokens=512, running_max_req_size=16,
                                graph_max_batch_size=16, report_dir=None))
    r = ModelRunner(cfg)
    r.build(2048)
    return r


class ExpertLoad:
    """Wraps the backend's fused_moe (the real one runs): the most tokens one expert received per step."""

    def __init__(self, runner: ModelRunner):
        self.backend, self.real, self.most = runner.backend, runner.backend.fused_moe, []
        runner.backend.fused_moe = self

    def __call__(self, x, w13, w2, weights, ids, **kw):
        self.most.append(int(torch.bincount(ids.flatten().long(), minlength=w13.shape[0]).max()))
        return self.real(x, w13, w2, weights, ids, **kw)

    def close(self):
        del self.backend.fused_moe


def test_the_stress_runs_the_most_tokens_under_both_forced_routings(runner):
    env = runner.envelope
    steps = stress.prefill_steps(env, 100, 4096, 0, runner.forced_routings)
    by_routing = {r: [s for s in steps if s.routing == r] for r in ("worst", "balanced")}
    for forced in by_routing.values():
        assert max(sum(len(r.ids) for r in s.rows) for s in forced) == env.prefill_tokens
        assert any(s.decode for s in forced)  # a mixed step too
    # the forced mixed corner: the model's first mixed corner's tokens (chunk + decode rows at their
    # contexts), its chunk over no prefix (the attention over the longest prefix ran under the model's routing)
    long = dataclasses.replace(env, max_req_total_len=1024, prefill_kv_tokens=1024, max_prefix_len=1022)
    steps = stress.prefill_steps(long, 100, 4096, 0, runner.forced_routings)
    model_mixed = next(s for s in steps if s.routing == "model" and s.decode)
    assert model_mixed.rows[0].start + len(model_mixed.rows[0].ids) == 1023
    for forced in ([s for s in steps if s.routing == r] for r in ("worst", "balanced")):
        mixed = [s for s in forced if s.decode]
        assert len(mixed) == 1 and all(r.start == 0 for r in mixed[0].rows)
        assert [len(r.ids) for r in mixed[0].rows] == [len(r.ids) for r in model_mixed.rows]
        assert [r.start for r in mixed[0].decode] == [r.start for r in model_mixed.decode]
    decode = stress.decode_steps(env, 100, 4096, 0, runner.forced_routings)
    assert {len(s.rows) for s in decode if s.routing == "worst"} == {env.decode_rows}
    dense = dataclasses.replace(env)
    assert all(s.routing == "model" for s in stress.prefill_steps(dense, 100, 4096, 0, ()))


def test_real_traffic_can_route_worse_than_a_balanced_stress_and_never_worse_than_the_worst(runner):
    """A prompt of one repeated token sends every token to the same experts: one expert holds as many
    tokens as the step has, while a balanced routing (vLLM's profile run's) puts T*k/E on each. A
    balanced-only stress would have under-measured the reference's per-expert temporaries; the worst
    corner holds the step's every token on one expert, the most any routing can."""
    load = ExpertLoad(runner)
    try:
        shapes = runner.stress_prefill()
        stressed = list(load.most)
        load.most.clear()
        balanced = [n for s, n in zip(_steps_per_layer(runner, shapes), stressed) if s == "balanced"]
        # identical tokens have identical hidden states in every layer (attention averages equal values):
        # the first step's prefill_tokens tokens all reach the same experts
        LLMEngine(runner).generate([[7] * 200] * 3, max_tokens=2)
        served = max(load.most)
    finally:
        load.close()
    assert served == runner.envelope.prefill_tokens
    assert max(balanced) * 4 == served == max(stressed)  # balanced: T*k/E = 512*4/16 on each expert
    assert max(stressed) == runner.envelope.prefill_tokens


def _steps_per_layer(runner, shapes) -> list[str]:
    """The routing of each fused_moe call of the prefill stress, in order (one call per MoE layer)."""
    steps = stress.prefill_steps(runner.envelope, runner.kv.num_pages - 1, runner.model_config.vocab_size,
                                 runner.cfg.seed, runner.forced_routings)
    assert len(steps) == len(shapes)
    return [s.routing for s in steps for _ in range(runner.model_config.moe_layers)]


def test_moe_model_serves_and_stays_inside_the_envelope_after_the_stress(runner):
    out = LLMEngine(runner).generate([[3, 4, 5], [9] * 40, list(range(10, 200))], max_tokens=6)
    assert [len(o) for o in out] == [6, 6, 6]
    assert runner.routing.current == "model"


def test_moe_reference_equals_a_dense_sum_over_every_expert():
    """The reference against the definition: sum over k of w * down(silu(gate) * up) per token."""
    g = torch.Generator().manual_seed(3)
    e, h, i, t, k = 6, 8, 5, 7, 3
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    x = torch.randn(t, h, generator=g)
    weights, ids = route(torch.randn(t, e, generator=g), k, True)
    want = torch.zeros(t, h)
    for tok in range(t):
        for j in range(k):
            gate, up = (w13[ids[tok, j]] @ x[tok]).chunk(2)
            want[tok] += weights[tok, j] * (w2[ids[tok, j]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(moe_reference(x, w13, w2, weights, ids), want, rtol=1e-5, atol=1e-5)


def test_sparse_block_is_the_moe_layers_mlp_and_dense_layers_keep_theirs():
    mc = load_model_config("tiny-moe")
    assert [mc.is_moe_layer(i) for i in range(mc.num_layers)] == [False, True, True, True]
    backend = get_backend_class("torch")(mc.num_heads, mc.num_kv_heads, mc.head_dim, PAGE, torch.float32,
                                         torch.device("cpu"))
    model = LlamaForCausalLM(mc, backend, dtype=torch.float32)
    block = model.model.layers[1].mlp
    assert isinstance(block, SparseMoeBlock) and block.experts.routing is model.model.routing
    assert tuple(block.experts.gate_up_proj.shape) == (16, 256, 256)
    assert tuple(block.experts.down_proj.shape) == (16, 256, 128)


# ---------------------------------------------------------------- the fused kernels' block layout
def blockwise_moe(x, w13, w2, weights, ids, block_m: int) -> torch.Tensor:
    """What AITER's fused MoE kernels compute from sort_by_expert's layout, block by block: the gate_up GEMM
    with silu(gate) * up into the pair's row, then the down GEMM scaled by the pair's weight, then a sum
    over k (kernels.triton_moe)."""
    t, k = ids.shape
    pairs = t * k
    sorted_ids, block_experts, padded = sort_by_expert(ids, w13.shape[0], block_m)
    act, down = torch.zeros(pairs, w2.shape[2]), torch.zeros(pairs, x.shape[1])
    blocks = [(sorted_ids[b:b + block_m], int(block_experts[b // block_m]))
              for b in range(0, int(padded), block_m)]
    for rows, e in blocks:
        valid = rows[rows < pairs].long()
        gate, up = torch.nn.functional.linear(x[valid // k], w13[e]).chunk(2, dim=-1)
        act[valid] = torch.nn.functional.silu(gate) * up
    for rows, e in blocks:
        valid = rows[rows < pairs].long()
        down[valid] = torch.nn.functional.linear(act[valid], w2[e]) * weights.flatten()[valid, None]
    return down.view(t, k, -1).sum(1)


@pytest.mark.parametrize("routing", ["model", "worst", "balanced"])
@pytest.mark.parametrize("tokens,block_m", [(1, 16), (5, 16), (40, 16), (40, 64), (300, 64)])
def test_sort_by_expert_lays_out_what_the_block_kernels_need(tokens, block_m, routing):
    e, k, h, i = 16, 4, 8, 6
    g = torch.Generator().manual_seed(tokens)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    x = torch.randn(tokens, h, generator=g)
    weights, ids = route(torch.randn(tokens, e, generator=g), k, True)
    r = Routing()
    r.set(routing)
    ids = r.apply(ids, e)
    sorted_ids, block_experts, padded = sort_by_expert(ids, e, block_m)
    pairs = tokens * k
    counts = torch.bincount(ids.flatten().long(), minlength=e)
    assert len(sorted_ids) == sorted_slots(tokens, k, e, block_m) >= int(padded)
    assert int(padded) == int(((counts + block_m - 1) // block_m * block_m).sum())
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs)) and (sorted_ids[int(padded):] == pairs).all()
    for b in range(0, int(padded), block_m):  # a block holds one expert's pairs, in pair order
        rows = sorted_ids[b:b + block_m]
        rows = rows[rows < pairs].long()
        assert (ids.flatten()[rows] == block_experts[b // block_m]).all()
        assert rows.tolist() == sorted(rows.tolist())
    torch.testing.assert_close(blockwise_moe(x, w13, w2, weights, ids, block_m),
                               moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
