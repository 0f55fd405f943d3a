"""`autoprofile plan --dp_attention`: SGLang's data-parallel attention layout for MLA models, on paper."""
from __future__ import annotations

import json
import math

import pytest

from autoprofile import cli
from autoprofile import plan as plan_module
from autoprofile.config import ServerConfig, validate
from autoprofile.plan import card_for, make_plan

TP = 2
CARD = card_for(None, 4.0)


def tiny_cfg(**kw) -> ServerConfig:
    return validate(ServerConfig(model="tiny-deepseek-v3", tp=TP, batch_max_tokens=1024,
                                 graph_max_batch_size=32, max_req_total_len=2048, **kw), serving=False)


def by_hand(tp: int, dp_attention: bool) -> int:
    """tiny-deepseek-v3's weights of one rank in bf16 (its routers fp32), from its config's numbers."""
    h, layers, vocab, heads = 256, 4, 4096, 8
    qr, rank, rope, nope, v = 96, 128, 32, 32, 32
    down = h * qr + qr + h * (rank + rope) + rank  # q_a_proj, kv_a_proj_with_mqa and their norms
    up = qr * heads * (nope + rope) + rank * heads * (nope + v) + heads * v * h  # q_b, kv_b, o_proj
    mlp = 3 * h * 704 + 3 * (16 + 1) * 3 * h * 128  # layer 0 dense; 3 MoE layers: 16 experts + 1 shared
    norms = 2 * h * layers + h
    router_fp32 = 3 * 16 * (h + 1)  # gate weight + e_score_correction_bias
    shard = math.ceil(vocab / tp) * h
    if dp_attention:  # attention and embedding whole, lm_head vocab-parallel, MLP split
        params = layers * (down + up) + mlp // tp + vocab * h + shard + norms
    else:
        params = (layers * up + mlp) // tp + 2 * shard + layers * down + norms
    return params * 2 + router_fp32 * 4


@pytest.mark.parametrize("dp_attention", [False, True])
def test_weights_per_rank_are_the_arithmetic_of_each_layout(dp_attention):
    p = make_plan(tiny_cfg(), CARD, dp_attention)
    weights = next(r.bytes for r in p.fixed if r.term == "weights")
    assert weights == by_hand(TP, dp_attention)


def test_dp_attention_splits_the_step_and_multiplies_the_model_s_tokens():
    cfg = tiny_cfg()
    p = make_plan(cfg, CARD, dp_attention=True)
    tp_layout, dp_layout = p.layouts
    cell = 4 * (128 + 32) * 2  # one latent per layer, bf16, the same on every rank in both layouts
    assert p.cell_bytes == cell
    # TP: every rank caches every token's latent; DP attention: each rank its own requests'
    assert tp_layout.model_tokens == tp_layout.tokens == make_plan(cfg, CARD).tokens
    assert dp_layout.model_tokens == TP * dp_layout.tokens == TP * p.tokens
    assert (tp_layout.prefill_tokens, tp_layout.decode_rows) == (1024, 32)
    assert (dp_layout.prefill_tokens, dp_layout.decode_rows) == (1024 // TP, 32 // TP) == \
        (p.batch_max_tokens, p.max_num_reqs)
    assert dp_layout.weights == by_hand(TP, True) and tp_layout.weights == by_hand(TP, False)
    # the solver's inequality holds for the rank's own rows: KV + request table within what is left
    assert p.available == CARD.total - sum(r.bytes for r in p.fixed)
    kv, table = (next(r.bytes for r in p.sized if r.term == t) for t in ("KV cache", "request table"))
    assert kv == p.tokens * cell
    assert table >= 32 // TP * math.ceil(2048 / 16) * 4  # the rank's request slots x pages, int32
    assert kv + table <= p.available and p.tokens % 16 == 0


def test_the_gather_before_the_mlp_is_in_the_layer_live_set():
    m = tiny_cfg().model_config
    t, h, db, top_k, inter = 512, 256, 2, 4, 128
    attn_q = 8 * m.head_dim  # every head on the rank under DP attention
    attention = t * (3 * attn_q + h) * db  # num_kv_heads = num_heads here: q + 2 kv, attention out, o_proj
    moe = TP * t * (3 * top_k * inter // TP + h + 2 * top_k * h) * db  # the gathered tokens, experts split
    gathered = TP * t * h * db
    expected = t * (2 * h * db + 4 * h) + max(attention, moe + gathered)
    assert plan_module.layer_live_bytes(m, t, TP, db, dp=TP) == expected
    assert plan_module.gather_bytes(m, t, 1, db) == 0


@pytest.mark.parametrize("args", [["--model", "tiny", "--tp", "2"], ["--model", "tiny-moe", "--tp", "2"],
                                  ["--model", "tiny-deepseek-v3"]])
def test_the_flag_is_refused_where_it_does_not_apply_naming_it(args, capsys):
    assert cli.main(["plan", "--gpu", "h100", "--dp_attention", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --dp_attention: ") and "try --" in err


@pytest.mark.parametrize("gpu, hosts, ranks", [("h200", [], 8), ("h100", ["--nnodes", "2"], 16)])
def test_deepseek_v3_shows_both_layouts(gpu, hosts, ranks, capsys):
    args = ["plan", "--model", "deepseek-v3", "--gpu", gpu, "--tp", str(ranks), *hosts]
    assert cli.main([*args, "--dp_attention", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert cli.main([*args, "--json"]) == 0
    tp_plan = json.loads(capsys.readouterr().out)
    tp_layout, dp_layout = p["layouts"]
    assert tp_layout["name"] == "tp" and tp_layout["tokens"] == tp_layout["model_tokens"] == tp_plan["tokens"]
    assert dp_layout["name"] == "dp_attention" and dp_layout["model_tokens"] == ranks * p["tokens"]
    assert dp_layout["weights"] > tp_layout["weights"]  # the attention and the embedding whole on each rank
    assert cli.main([*args, "--dp_attention"]) == 0
    text = capsys.readouterr().out
    assert "DP attention" in text and f"layouts on {ranks} ranks" in text
