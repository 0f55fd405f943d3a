"""`autoprofile plan`: exact rows, the solver inequality with the printed terms, JSON."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from autoprofile import budget, cli
from autoprofile import plan as plan_module
from autoprofile.budget import GiB
from autoprofile.config import ServerConfig, validate
from autoprofile.kernels import launch_rules
from autoprofile.model_config import load_model_config
from autoprofile.plan import GPUS, Card, card_for, format_plan, make_plan, sizing_for, weight_split

LLAMA_PARAMS = 8_030_261_248


def plan_for(gpu: str = "h100", **flags):
    return make_plan(validate(ServerConfig(**flags), serving=False), GPUS[gpu])


def row(rows, term):
    return next(r for r in rows if r.term == term)


def test_llama_on_h100_weights_and_cell():
    p = plan_for()
    assert p.total == 85_017_493_504  # torch.cuda.mem_get_info read on the H100
    w = row(p.fixed, "weights")
    assert w.bytes == LLAMA_PARAMS * 2
    assert round(w.bytes / GiB, 2) == 14.96 and w.how == "exact"
    assert p.cell_bytes == 128 * 1024
    assert p.attention_backend == "aiter_triton"  # auto on an NVIDIA card


def check_inequality(p, cfg):
    """T x cell <= (available - workspace(T) - table(T)) x mem_fraction, using the plan's own printed terms,
    and one more page would not fit."""
    assert p.available == p.total - sum(r.bytes for r in p.fixed)
    kv, ws, table = (r.bytes for r in p.sized)
    assert kv == p.tokens * p.cell_bytes
    assert p.tokens % p.page_size == 0
    assert kv <= (p.available - ws - table) * p.mem_fraction
    nxt = p.tokens + p.page_size
    reqs = cfg.running_max_req_size or cfg.graph_max_batch_size  # the envelope's rows
    ws_next = 0
    if p.attention_backend == "aiter":
        m = cfg.model_config
        ws_next = budget.reserved_bytes(budget.aiter_workspace_bytes(
            reqs, m.num_heads // cfg.tp, m.head_dim, launch_rules.aiter_num_partitions(p.context_len, nxt)))
    table_next = budget.reserved_bytes(budget.req_table_bytes(reqs, p.context_len, p.page_size))
    assert nxt * p.cell_bytes > (p.available - ws_next - table_next) * p.mem_fraction
    assert p.slack == p.available - kv - ws - table


@pytest.mark.parametrize("gpu, flags", [
    ("h100", {}),
    ("h100", {"mem_fraction": 0.8}),
    ("h200", {"tp": 2, "max_req_total_len": 32768}),
    ("mi300x", {}),  # native AITER: workspace solved with T
    ("mi325x", {"running_max_req_size": 1024, "graph_max_batch_size": 512}),
    ("a100-40g", {"model": "qwen2.5-7b", "max_req_total_len": 8192}),
    ("l40s", {"model": "qwen3-8b", "attention_backend": "torch", "page_size": 1, "max_req_total_len": 4096}),
    ("mi355x", {"model": "qwen3-30b-a3b", "tp": 4}),
])
def test_predicted_tokens_satisfy_the_solver_inequality(gpu, flags):
    cfg = validate(ServerConfig(**flags), serving=False)
    check_inequality(make_plan(cfg, GPUS[gpu]), cfg)


def test_native_aiter_workspace_is_charged():
    p = plan_for("mi300x")
    assert p.attention_backend == "aiter"
    ws = row(p.sized, "attention workspace").bytes
    parts = launch_rules.aiter_num_partitions(131072, p.tokens)
    assert ws == budget.aiter_workspace_bytes(p.max_num_reqs, 32, 128, parts) > 0
    # Same card and flags with the Triton backend: no persistent workspace, more tokens.
    t = plan_for("mi300x", attention_backend="aiter_triton")
    assert row(t.sized, "attention workspace").bytes == 0 and t.tokens > p.tokens


def test_bf16_pages_declare_the_split_decode_peak_and_v2_only_past_its_rows(monkeypatch):
    """bf16 pages take the split decode at launch_rules.SPLIT_DECODE_ROWS rows (every row count): the plan
    declares its peak partials, as for FP8 pages; with the rows set below the envelope's, AITER's v2 partials
    past them where larger."""
    for ctx in (131072, 1024):
        p = plan_for("h100", max_req_total_len=ctx)
        assert row(p.fixed, "decode attention scratch").bytes == budget.split_decode_peak_scratch_bytes(
            256, 32, 8, 128, ctx) > 0
    monkeypatch.setattr(launch_rules, "SPLIT_DECODE_ROWS", 32)
    p = plan_for("h100")
    assert row(p.fixed, "decode attention scratch").bytes == budget.triton_decode_workspace_bytes(
        256, 32, 128, 131072, 2) > budget.split_decode_peak_scratch_bytes(32, 32, 8, 128, 131072)
    short = plan_for("h100", max_req_total_len=1024)  # one 1024-token partition: v1, no scratch; up to 32
    split = budget.split_decode_peak_scratch_bytes(32, 32, 8, 128, 1024)  # rows: split
    assert row(short.fixed, "decode attention scratch").bytes == split > 0


def test_fp8_cache_declares_the_split_decode_peak_scratch():
    """FP8 pages decode through our split kernel: the plan declares the most any row count allocates (a few
    rows split most), not AITER's v2 partials."""
    p = plan_for("h100", kv_cache_dtype="fp8_e4m3")
    got = row(p.fixed, "decode attention scratch").bytes
    assert got == budget.split_decode_peak_scratch_bytes(256, 32, 8, 128, 131072) > 0
    splits = launch_rules.split_decode_splits
    assert got == max(launch_rules.split_decode_scratch_bytes(n, 32, 128, splits(n, 8, 131072))
                      for n in range(1, 257))


def test_mla_declares_its_peak_partials_and_more_under_deterministic():
    """MLA's decode scratch: the splits' partials at their most over the row counts a step may take (fewer
    rows, more splits), the old kernel's token slots until re-measured, and --deterministic's 16 splits at
    the most decode rows."""
    cfg = validate(ServerConfig(model="deepseek-v2-lite"), serving=False)
    got = row(make_plan(cfg, GPUS["h100"]).fixed, "decode attention scratch").bytes
    reserve = budget.mla_unmeasured_reserve_bytes(cfg.graph_max_batch_size, cfg.context_len)
    rows = max(budget.running_reqs(cfg.running_max_req_size, cfg.graph_max_batch_size),
               cfg.graph_max_batch_size)
    peak = max(launch_rules.mla_partials_bytes(n, 16, 512, launch_rules.mla_kv_splits(n))
               for n in range(1, rows + 1))
    assert got - reserve == launch_rules.mla_decode_scratch_bytes(rows, 16, 512) == peak
    assert peak > launch_rules.mla_partials_bytes(rows, 16, 512, launch_rules.mla_kv_splits(rows))
    det = plan_for("h100", model="deepseek-v2-lite", deterministic=True)
    fixed = launch_rules.mla_partials_bytes(rows, 16, 512, launch_rules.MLA_INVARIANT_SPLITS)
    assert row(det.fixed, "decode attention scratch").bytes - reserve == fixed > peak


def test_tp2_halves_weights_and_cell():
    one, two = plan_for(), plan_for(tp=2)
    split = weight_split(validate(ServerConfig()).model_config)
    assert split.layers + split.vocab + split.replicated == LLAMA_PARAMS
    assert split.replicated == 32 * 2 * 4096 + 4096  # two RMSNorms per layer + the final one
    w1, w2 = row(one.fixed, "weights").bytes, row(two.fixed, "weights").bytes
    assert w2 == ((split.layers + split.vocab) // 2 + split.replicated) * 2
    assert 2 * w2 - w1 == split.replicated * 2  # exactly half, but for the replicated norms (< 1 MiB)
    assert two.cell_bytes * 2 == one.cell_bytes
    assert two.tokens > one.tokens


def test_vocab_shards_round_up():
    m = validate(ServerConfig(model="qwen2.5-7b")).model_config  # vocab 152064, 28 heads / 4 KV heads
    split = weight_split(m)
    per_rank = split.per_rank(m, 4)
    assert per_rank == split.layers // 4 + 2 * (152064 // 4) * m.hidden_size + split.replicated
    assert split.per_rank(m, 1) == m.num_params()


def test_bigger_card_predicts_more_tokens():
    tokens = [plan_for(g).tokens for g in ("a100-40g", "h100", "h200")]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    assert make_plan(validate(ServerConfig()), card_for(None, 200)).tokens > tokens[-1]


def test_mem_fraction_lowers_the_prediction():
    assert plan_for(mem_fraction=0.5).tokens < plan_for(mem_fraction=0.9).tokens < plan_for().tokens


def test_estimated_rows_are_marked():
    p = plan_for()
    how = {r.term: r.how for r in p.fixed}
    assert how["CUDA context, non-torch"] == "ESTIMATED"
    assert how["prefill activation peak"] == "ESTIMATED"
    assert how["decode graph pools"] == "ESTIMATED"
    assert how["weights"] == "exact"
    assert row(p.fixed, "CUDA context, non-torch").bytes == plan_module.CUDA_CONTEXT_ESTIMATE
    assert all(r.on_gpu for r in (*p.fixed, *p.sized))
    assert row(plan_for(disable_cudagraph=True).fixed, "decode graph pools").bytes == 0


def test_the_piecewise_pool_is_charged_where_the_engine_captures_pieces():
    """The largest bucket's layer live set and static buffers, without the margin (the estimate is above the
    measured pool); none where config.piecewise_max_tokens rules the pieces out (the engine builds none)."""
    base = plan_for()
    pieces = row(base.fixed, "piecewise graph pool")
    m = validate(ServerConfig(), serving=False).model_config
    assert pieces.how == "ESTIMATED" and "512 tokens" in pieces.note
    live = plan_module.layer_live_bytes
    assert pieces.bytes > live(m, 512, 1, 2) > live(m, 256, 1, 2)
    half = row(plan_for(piecewise_cuda_graph_max_tokens=256).fixed, "piecewise graph pool").bytes
    assert half < pieces.bytes
    off = plan_for(piecewise_cuda_graph_max_tokens=0)
    assert row(off.fixed, "piecewise graph pool").bytes == 0
    assert row(base.fixed, "activation margin").bytes == row(off.fixed, "activation margin").bytes
    assert off.tokens > base.tokens
    for flags in (dict(tp=2), dict(disable_cudagraph=True), dict(deterministic=True),
                  dict(model="deepseek-v2-lite"), dict(attention_backend="torch")):
        assert row(plan_for("h200", **flags).fixed, "piecewise graph pool").bytes == 0, flags
    # a hybrid's pieces, by default up to 8192 tokens (their static buffers against the real ones:
    # tests/test_piecewise_gpu.py)
    hybrid = validate(ServerConfig(model="qwen3.5-35b-a3b"), serving=False).model_config
    charged = row(plan_for("h200", model="qwen3.5-35b-a3b").fixed, "piecewise graph pool")
    assert "8192 tokens" in charged.note
    assert charged.bytes > live(hybrid, 8192, 1, 2) + 8192 * 2 * sum(plan_module.piece_widths(hybrid))
    small = row(plan_for("h200", model="qwen3.5-35b-a3b", piecewise_cuda_graph_max_tokens=512).fixed,
                "piecewise graph pool")
    assert "512 tokens" in small.note and 0 < small.bytes < charged.bytes
    dense = row(plan_for("h100", model="qwen3.5-27b").fixed, "piecewise graph pool")  # a dense hybrid's
    assert "512 tokens" in dense.note


def test_moe_config_plans():
    p = plan_for("h200", model="qwen3-30b-a3b")
    m = validate(ServerConfig(model="qwen3-30b-a3b"), serving=False).model_config
    assert row(p.fixed, "weights").bytes == m.num_params() * 2
    assert p.cell_bytes == 2 * 4 * 128 * 48 * 2
    assert p.tokens > 0 and p.architecture == "Qwen3MoeForCausalLM"


def test_too_small_card_names_the_flag_to_change():
    p = make_plan(validate(ServerConfig(max_req_total_len=131072)), Card("small", 24 * GiB, "nvidia", "test"))
    assert p.tokens < p.min_tokens
    assert p.problem_flag == "max_req_total_len" and "try --max_req_total_len" in p.problem
    assert "CANNOT SERVE AS CONFIGURED: --max_req_total_len" in format_plan(p)


def test_auto_context_is_cut_as_the_profiler_cuts_it():
    card = Card("small", 24 * GiB, "nvidia", "test")
    full = make_plan(validate(ServerConfig(max_req_total_len=131072)), card)
    p = make_plan(validate(ServerConfig()), card)  # --max_req_total_len auto
    cut = (full.tokens // 16 - 1) * 16  # the longest request the full context's predicted cache holds
    assert p.context_len == cut and p.problem is None and p.tokens >= p.min_tokens
    assert f"serving requests of at most {cut} tokens" in format_plan(p)
    assert make_plan(validate(ServerConfig()), Card("big", 80 * GiB, "nvidia", "test")).context_len == 131072


def test_pinned_size_above_prediction_is_a_problem():
    p = plan_for("a100-40g", max_req_total_len=4096, max_total_token_num=2_000_000)
    assert p.problem_flag == "max_total_token_num" and f"try --max_total_token_num {p.tokens}" in p.problem


def printed_bytes(text: str) -> dict[str, int]:
    """term -> bytes from the printed table (`  - term   GiB   1,234  how ...`)."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s+[-=]?\s*(\S.*?)\s{2,}(-?\d+\.\d\d)\s+(-?[\d,]+)(\s|$)", line)
        if m:
            out[m.group(1)] = int(m.group(3).replace(",", ""))
    return out


@pytest.mark.parametrize("gpu, flags", [("h100", {}), ("mi300x", {"mem_fraction": 0.9}), ("h200", {"tp": 2})])
def test_printed_terms_satisfy_the_inequality(gpu, flags):
    cfg = validate(ServerConfig(**flags))
    text = format_plan(make_plan(cfg, GPUS[gpu]))
    b = printed_bytes(text)

    def number(pattern: str) -> int:
        return int(re.search(pattern, text).group(1).replace(",", ""))
    tokens = number(r"predicted --max_total_token_num: ([\d,]+) tokens")
    cell = number(r"KV per token: ([\d,]+) B")
    fixed = [k for k in b if k not in ("GPU total", "available for T-sized terms", "KV cache",
                                       "attention workspace", "request table", "slack (mem_fraction, pages)")]
    assert len(fixed) == 12  # incl. NCCL buffers, the pieces' pool, the activation margin, the driver reserve
    available = b["GPU total"] - sum(b[k] for k in fixed)
    assert available == b["available for T-sized terms"]
    assert b["KV cache"] == tokens * cell
    assert b["KV cache"] <= (available - b["attention workspace"] - b["request table"]) * cfg.mem_fraction
    assert b["slack (mem_fraction, pages)"] == available - b["KV cache"] - b["attention workspace"] \
        - b["request table"]


def test_format_shows_every_row_and_the_prediction():
    p = plan_for()
    text = format_plan(p)
    for r in (*p.fixed, *p.sized):
        assert r.term in text and f"{r.bytes:,}" in text
    assert f"predicted --max_total_token_num: {p.tokens:,} tokens" in text
    assert "14.96" in text and "128.00 KiB" in text and "ESTIMATED" in text


def test_json_round_trip():
    p = plan_for()
    d = json.loads(p.to_json())
    assert d["tokens"] == p.tokens and d["cell_bytes"] == 131072
    assert [r["term"] for r in d["fixed"]] == [r.term for r in p.fixed]
    assert d == json.loads(json.dumps(dataclasses.asdict(p)))


def test_plan_cli_json(capsys):
    assert cli.main(["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tokens"] == plan_for().tokens and d["gpu"] == "h100"


def test_plan_cli_gpu_memory_gib(capsys):
    assert cli.main(["plan", "--gpu_memory_gib", "80", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["total"] == 80 * GiB and "vendor unknown" in d["gpu"]


TINY_VARIANTS = {
    "llama-tied": {},
    "qwen2-bias-untied": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                          "tie_word_embeddings": False},
    "qwen3-qk-norm": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "rope_scaling": None},
    "qwen3-moe": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "rope_scaling": None,
                  "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "mlp_only_layers": [0]},
    "deepseek-v2-mla": {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
                        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 64, "first_k_dense_replace": 1, "kv_lora_rank": 64,
                        "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "q_lora_rank": 48,
                        "rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": 0.707,
                                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 256}},
    "qwen3.5-hybrid": {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "rope_scaling": None,
                       "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                       "linear_value_head_dim": 24, "full_attention_interval": 2, "tie_word_embeddings": False},
    "qwen3.5-hybrid-moe": {"model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
                           "rope_scaling": None, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                           "linear_key_head_dim": 16, "linear_value_head_dim": 24, "num_experts": 8,
                           "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                           "shared_expert_intermediate_size": 32},
}


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_plan_matches_the_engine_on_cpu(variant, tmp_path):
    """The exact rows are what the engine really allocates: weights + rope table = the runner's
    parameters and buffers; the plan's Sizing charges what the runner's Sizing charges."""
    from autoprofile.engine.runner import ModelRunner
    from autoprofile.model_config import CONFIG_DIR

    d = json.loads((CONFIG_DIR / "tiny" / "config.json").read_text()) | TINY_VARIANTS[variant]
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = validate(ServerConfig(model=str(tmp_path), attention_backend="torch", max_req_total_len=1024,
                                batch_max_tokens=512, graph_max_batch_size=8, disable_cudagraph=True,
                                load_format="dummy"))
    p = make_plan(cfg, GPUS["h100"])
    runner = ModelRunner(cfg)
    assert row(p.fixed, "weights").bytes + row(p.fixed, "rope table").bytes == runner.weight_bytes
    assert p.cell_bytes == runner.sizing.cell_bytes
    assert sizing_for(cfg, "torch").max_tokens == runner.sizing.max_tokens  # the 32-bit offset cap too
    for t in (0, 1024, 50_000, p.tokens):
        assert sum(r.bytes for r in make_plan_sized(cfg, t)) == runner.sizing.sized_bytes(t)


BLOCK_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
             "modules_to_not_convert": ["lm_head"]}
STATIC_FP8 = {"quant_method": "compressed-tensors", "ignore": ["lm_head"], "config_groups": {"g": {
    "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}}
FP8_VARIANTS = {  # (tiny variant, quantization_config or None, --quantization, --tp)
    "llama-block": ("llama-tied", BLOCK_FP8, None, 1),
    "llama-block-tp2": ("llama-tied", BLOCK_FP8, None, 2),
    "qwen2-static-tensor": ("qwen2-bias-untied", STATIC_FP8, None, 1),
    "qwen3-moe-block": ("qwen3-moe", BLOCK_FP8, None, 1),
    "deepseek-v2-mla-block": ("deepseek-v2-mla", BLOCK_FP8, None, 1),
    "llama-runtime": ("llama-tied", None, "fp8", 1),
    "qwen3-moe-runtime-tp2": ("qwen3-moe", None, "fp8", 2),
}


@pytest.mark.parametrize("variant", sorted(FP8_VARIANTS))
def test_fp8_weight_bytes_are_the_engine_s_parameters(variant, tmp_path):
    """FP8 weights at one byte each plus their fp32 scales (bf16 for embeddings, norms, routers): the plan's
    weights row is the real model's parameter bytes on each rank (built on the meta device: its shapes
    and dtypes are the runner's), and the runner's on one rank."""
    import torch

    from autoprofile.layers.parallel import TP
    from autoprofile.layers.quant import FP8
    from autoprofile.model_config import CONFIG_DIR
    from models import model_class

    base, quant, flag, tp = FP8_VARIANTS[variant]
    d = json.loads((CONFIG_DIR / "tiny" / "config.json").read_text()) | TINY_VARIANTS[base]
    if quant is not None:
        d["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = validate(ServerConfig(model=str(tmp_path), attention_backend="torch", max_req_total_len=1024,
                                batch_max_tokens=512, graph_max_batch_size=8, disable_cudagraph=True,
                                quantization=flag, tp=tp, load_format="dummy"))
    mc = cfg.model_config
    p = make_plan(cfg, GPUS["h100"])
    weights = row(p.fixed, "weights").bytes
    for rank in range(tp):
        with torch.device("meta"):
            model = model_class(mc)(mc, None, TP(rank, tp), torch.bfloat16, cfg.context_len)
        assert any(t.dtype == FP8 for t in model.parameters())
        assert weights + row(p.fixed, "rope table").bytes == sum(
            t.nbytes for t in (*model.parameters(), *model.buffers()))
    if tp == 1:
        from autoprofile.engine.runner import ModelRunner
        assert weights + row(p.fixed, "rope table").bytes == ModelRunner(cfg).weight_bytes
    bf16 = make_plan(cfg.replace(model=str(CONFIG_DIR / "tiny"), quantization=None), GPUS["h100"])
    assert p.fixed != bf16.fixed


def test_fp8_activation_quantization_is_in_the_prefill_estimate():
    """x_q [T, K] fp8 + its fp32 scales per T for the widest FP8 layer input that a quantization kernel of
    its own makes (llama: o_proj's 4,096 columns with one per-token scale; Qwen3-30B-A3B: o_proj's 4,096 in
    32 groups of 128); a dense MLP's activation is SiLU-mul's FP8 rows (14,336 bytes and a scale a token, in
    place of 14,336 bf16 values)."""
    bf16 = row(plan_for(model="llama-3.1-8b").fixed, "prefill activation peak").bytes
    fp8 = row(plan_for(model="llama-3.1-8b", quantization="fp8").fixed, "prefill activation peak").bytes
    assert fp8 - bf16 == 8192 * (4096 + 4) + 8192 * (14336 + 4 - 2 * 14336)
    block = row(plan_for(model="qwen3-30b-a3b-fp8").fixed, "prefill activation peak").bytes
    plain = row(plan_for(model="qwen3-30b-a3b").fixed, "prefill activation peak").bytes
    assert block - plain == 8192 * (4096 + 4 * 32)  # widest input: o_proj's 32 heads x 128, 32 groups


def make_plan_sized(cfg, tokens):
    from autoprofile.plan import sized_rows, sizing_for
    return sized_rows(sizing_for(cfg, "torch"), tokens, "torch")


def test_tp_counts_nccl_buffers():
    one, two = plan_for(tp=1), plan_for(tp=2)
    assert row(one.fixed, "NCCL buffers").bytes == 0
    nccl = row(two.fixed, "NCCL buffers")
    assert nccl.bytes == plan_module.NCCL_ESTIMATE and nccl.how == "ESTIMATED"
    prefill = row(two.fixed, "prefill activation peak").bytes
    pools = sum(row(two.fixed, t).bytes for t in ("decode graph pools", "decode attention scratch"))
    assert row(two.fixed, "activation margin").bytes == int(  # the prefill's factor at --tp 2 is its own
        prefill * (plan_module.ACTIVATION_FACTOR_TP - 1) + pools * (plan_module.ACTIVATION_FACTOR - 1))
    assert plan_module.ACTIVATION_FACTOR_TP > plan_module.ACTIVATION_FACTOR


# ---------------------------------------------------------------- the vision encoder
VL_MEASURED = {"h100": 1_073_216, "h200": 2_208_272}  # autoprofile profile --model qwen2.5-vl-7b, 2026-11-23


@pytest.mark.parametrize("card", sorted(VL_MEASURED))
def test_vl_plan_counts_the_encoder_and_stays_below_the_measurement(card):
    p = plan_for(card, model="qwen2.5-vl-7b")
    vision = sum(row(p.fixed, t).bytes for t in ("vision encoder weights", "encoder output buffer",
                                                  "encoder activation peak"))
    assert row(p.fixed, "vision encoder weights").bytes == 676_550_144 * 2  # HF's parameter count, bf16
    assert row(p.fixed, "encoder output buffer").bytes == 4 * 1280 * 3584 * 2
    assert vision > 5 * GiB
    assert 0.95 * VL_MEASURED[card] <= p.tokens <= VL_MEASURED[card]


def test_encoder_estimate_grows_with_pixels_and_images_and_refuses_bad_pixels():
    def peak(**flags):
        return row(plan_for("h100", model="qwen2.5-vl-7b", **flags).fixed, "encoder activation peak").bytes
    base = peak()
    assert peak(max_image_pixels=2560 * 28 * 28) > base > peak(max_image_pixels=640 * 28 * 28)
    assert peak(visual_batch_size=8) > base > peak(visual_batch_size=1)
    assert plan_module.encoder_activation_bytes(1, (1, 16, 16)) == 4 * 64 * 21_500 + 256 ** 2 * 145
    assert cli.main(["plan", "--gpu", "h100", "--model", "qwen2.5-vl-7b", "--max_image_pixels", "100"]) == 2


def test_a_text_model_plan_has_no_encoder_rows():
    assert not [r for r in plan_for("h100").fixed if "encoder" in r.term]


# state slots the profiler chose on the device (docs/measurements.md, "Hybrid models"; 2026-11-27)
SLOTS_MEASURED = [("qwen3.5-27b", "h200", 1, 256), ("qwen3.5-27b", "h100", 1, 98),
                  ("qwen3.5-35b-a3b-fp8", "h100", 1, 256), ("qwen3.5-122b-a10b-fp8", "h100", 2, 142)]


@pytest.mark.parametrize("model, gpu, tp, slots", SLOTS_MEASURED)
def test_plan_keeps_the_state_slots_the_profiler_chose(model, gpu, tp, slots):
    """plan's slots are the profiler's (never more: their state would take KV the profiler keeps)."""
    assert plan_for(gpu, model=model, tp=tp).max_num_reqs == slots


def test_a_hybrid_plan_trades_state_slots_against_kv_tokens_as_the_profiler_chooses_them():
    """qwen3.5-27b: on an H200 every decode row keeps its state (256 x 147 MiB); on an H100 the state would
    take more than half of what the weights leave, so plan (as the profiler) keeps fewer slots and says so in
    its state row; --running_max_req_size pins them."""
    from autoprofile import budget

    def plan(gpu, **kw):
        return make_plan(validate(ServerConfig(model="qwen3.5-27b", **kw), serving=False), GPUS[gpu])
    big, small = plan("h200"), plan("h100")
    assert big.max_num_reqs == 256 and 0 < small.max_num_reqs < 128
    per_slot = load_model_config("qwen3.5-27b").state_bytes(1, 2)
    # chosen before the stress reserves local memory: the context then, not the non-torch row's estimate
    free = GPUS["h100"].total - plan_module.CONTEXT_BEFORE_STRESS - row(small.fixed, "weights").bytes
    assert small.max_num_reqs == budget.state_slots(256, free, per_slot) == 98  # as the profiler on an H100
    assert row(small.sized, "state slots").bytes >= (small.max_num_reqs + 1) * per_slot
    pinned = plan("h100", running_max_req_size=32, graph_max_batch_size=32)
    assert pinned.max_num_reqs == 32 and pinned.tokens > small.tokens  # fewer slots: more KV
    assert row(pinned.sized, "state slots").bytes < row(small.sized, "state slots").bytes
