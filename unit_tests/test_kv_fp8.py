"""The FP8 KV cache on CPU (torch backend): quantisation, calibration, the paged decode over FP8 pages, the
scale sources (checkpoint, first real batch, 1.0), the halved cell in the budget and plan, and what it
costs in accuracy against a cache in the model's dtype (scripts/kv_accuracy.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from autoprofile import plan
from autoprofile.config import ServerConfig, validate
from autoprofile.layers.attention import (CALIBRATION_HEADROOM, FP8_MAX, AttentionMetadata, calibrate_,
                                          dequantize, quantize)
from autoprofile.engine.attention.torch_sdpa import TorchBackend
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.kv_cache import KVCache, kv_scale_source
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.weights import kv_scale_target, kv_scales_tensor
from scripts.kv_accuracy import VARIANTS, Decoder, compare
from unit_tests.test_engine_cpu import QWEN_SMALL, write_checkpoint

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn
SMALL = dict(model="tiny", dtype="bfloat16", attention_backend="torch", max_req_total_len=256,
             batch_max_tokens=256, graph_max_batch_size=4, running_max_req_size=16, report_dir=None)


def cfg(**kw) -> ServerConfig:
    return validate(ServerConfig(**{**SMALL, **kw}))


# ---------------------------------------------------------------- quantisation and calibration
def test_quantize_saturates_and_round_trips_within_fp8_precision():
    x = torch.randn(4096) * 3
    scale = torch.tensor(0.05)
    q = quantize(x, scale, FP8)
    assert q.dtype == FP8
    back = dequantize(q, scale, torch.float32)
    normal = (x / scale).abs() > 2 ** -6  # e4m3's smallest normal: relative error <= 2^-4 above it
    assert ((back - x).abs()[normal] <= x.abs()[normal] * 2 ** -4 + 1e-7).all()
    big = quantize(torch.tensor([1e6, -1e6, float("inf")]), torch.tensor(1.0), FP8).float()
    assert big.tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX]  # saturated, never NaN


def test_calibrate_sets_amax_with_headroom_and_keeps_a_scale_for_zeros():
    scales = torch.ones(2)
    k, v = torch.randn(7, 2, 8), torch.randn(7, 2, 8) * 10
    k[3, 1, 5] = -40.0
    calibrate_(scales, k, v)
    want = torch.tensor([40.0, float(v.abs().max())]) * CALIBRATION_HEADROOM / FP8_MAX
    torch.testing.assert_close(scales, want)
    calibrate_(scales, torch.zeros(3, 2, 8), v)
    torch.testing.assert_close(scales, want)  # an all-zero K keeps its scale (no division by zero later)


# ---------------------------------------------------------------- the backend over FP8 pages
def paged(seq_lens: list[int], page: int, hkv: int, d: int, dtype: torch.dtype):
    pages_per = [-(-n // page) for n in seq_lens]
    perm = torch.randperm(sum(pages_per), generator=torch.Generator().manual_seed(1)) + 1
    tables = torch.zeros(len(seq_lens), max(pages_per), dtype=torch.int32)
    at = 0
    for i, n in enumerate(pages_per):
        tables[i, :n] = perm[at:at + n]
        at += n
    kv = KVCache(1, sum(pages_per) + 1, hkv, page, d, dtype, CPU)
    return kv, tables


@pytest.mark.parametrize("calibrating", [True, False])
def test_decode_over_fp8_pages_equals_attention_over_the_dequantised_kv(calibrating):
    hq, hkv, d, page, lens = 4, 2, 16, 4, [9, 1, 22]
    be = TorchBackend(hq, hkv, d, page, torch.float32, CPU)
    kv, tables = paged(lens, page, hkv, d, FP8)
    layer = kv.layers[0]
    assert layer.scales.data_ptr() == kv.scales.data_ptr()  # a view: graphs see set_scales' values
    gen = torch.Generator().manual_seed(2)
    ks = [torch.randn(n, hkv, d, generator=gen) * 5 for n in lens]
    vs = [torch.randn(n, hkv, d, generator=gen) * 0.01 for n in lens]  # small V: 1.0 would be subnormal
    be.calibrating = calibrating
    for b, (k, v) in enumerate(zip(ks, vs)):
        pos = torch.arange(lens[b])
        be.store_kv(k, v, layer, tables[b, pos // page].long() * page + pos % page)
        be.calibrating = False  # the first batch sets the scales: later rows use them
    if calibrating:
        want = torch.tensor([ks[0].abs().max(), vs[0].abs().max()]) * CALIBRATION_HEADROOM / FP8_MAX
        torch.testing.assert_close(layer.scales, want)
    else:
        assert layer.scales.tolist() == [1.0, 1.0]
    q = torch.randn(len(lens), hq, d, generator=gen)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(3, dtype=torch.int64),
                             block_tables=tables,
                             seq_lens=torch.tensor(lens, dtype=torch.int32), max_seq_len=32)
    out = be.decode(q, layer, meta)
    def read(cache: torch.Tensor, scale: torch.Tensor, b: int) -> torch.Tensor:  # [n, hkv, d] in fp32
        pos = torch.arange(lens[b])
        return dequantize(cache[tables[b, pos // page].long(), :, pos % page], scale, torch.float32)

    deq = [(read(layer.k, layer.scales[0], b), read(layer.v, layer.scales[1], b)) for b in range(len(lens))]
    for b in range(len(lens)):
        k, v = deq[b][0].repeat_interleave(hq // hkv, 1), deq[b][1].repeat_interleave(hq // hkv, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b], k) * d ** -0.5, -1)
        torch.testing.assert_close(out[b], torch.einsum("hn,nhd->hd", p, v), rtol=1e-5, atol=1e-6)
    # and the quantised values are close to what was stored (calibrated scales keep small V precise)
    err = (deq[2][1] - vs[2]).abs().max() / vs[2].abs().max()
    assert err < (0.07 if calibrating else 1.0) and err > 0


def test_gather_kv_dequantises_to_the_model_dtype():
    be = TorchBackend(2, 1, 8, 4, torch.bfloat16, CPU)
    kv = KVCache(1, 3, 1, 4, 8, FP8, CPU)
    kv.set_scales(torch.tensor([[0.5, 0.01]]))
    k, v = torch.randn(6, 1, 8), torch.randn(6, 1, 8) * 0.02
    slots = torch.tensor([4, 5, 6, 7, 8, 9])
    be.store_kv(k, v, kv.layers[0], slots)
    gk, gv = be.gather_kv(kv.layers[0], slots)
    assert gk.dtype == gv.dtype == torch.bfloat16
    torch.testing.assert_close(gk.float(), k, rtol=0.07, atol=0.5 * 2 ** -9)
    torch.testing.assert_close(gv.float(), v, rtol=0.07, atol=0.01 * 2 ** -9)


# ---------------------------------------------------------------- scale sources, the runner
def test_scale_source_follows_the_flag_and_the_checkpoint():
    assert kv_scale_source("bfloat16", "auto", True) is None
    assert kv_scale_source("fp8_e4m3", "auto", True) == "checkpoint"
    assert kv_scale_source("fp8_e4m3", "auto", False) == "first_batch"
    assert kv_scale_source("fp8_e4m3", "unit", True) == "unit"
    assert kv_scale_source("fp8_e4m3", "first_batch", True) == "first_batch"


def test_checkpoint_scale_names_and_missing_layers():
    assert kv_scale_target("model.layers.3.self_attn.k_scale") == (3, "k")
    assert kv_scale_target("model.layers.3.self_attn.attn.v_scale") == (3, "v")
    assert kv_scale_target("model.layers.12.self_attn.v_proj.output_scale") == (12, "v")
    assert kv_scale_target("model.layers.0.self_attn.kv_scale") == (0, "kv")
    assert kv_scale_target("model.layers.0.self_attn.q_proj.output_scale") is None
    assert kv_scale_target("model.layers.0.self_attn.k_proj.weight") is None
    got = kv_scales_tensor({(0, "kv"): 0.5, (1, "k"): 0.25, (1, "v"): 0.125}, 2, "ckpt")
    assert got.tolist() == [[0.5, 0.5], [0.25, 0.125]]
    with pytest.raises(ValueError, match="ckpt: .*layer 1's v_scale is missing.*--kv_scales first_batch"):
        kv_scales_tensor({(0, "kv"): 0.5, (1, "k"): 0.25}, 2, "ckpt")
    assert kv_scales_tensor({}, 2, "ckpt") is None


def test_stress_calibrates_then_leaves_the_scales_to_the_first_real_batch():
    r = ModelRunner(cfg(kv_cache_dtype="fp8_e4m3"))
    assert r.kv_scale_source == "first_batch"
    assert r.sizing.cell_bytes * 2 == ModelRunner(cfg()).sizing.cell_bytes
    r.build(1024)
    assert r.kv.buffer.dtype == FP8 and r.kv.nbytes == 1024 * r.sizing.cell_bytes
    calibrated = []
    store = r.backend.store_kv
    r.backend.store_kv = lambda *a: (calibrated.append(r.backend.calibrating), store(*a))[1]
    r.stress_prefill()
    assert True in calibrated and False in calibrated  # fresh-row corners calibrate, prefix corners do not
    assert r.kv_scales_pending and (r.kv.scales == 1).all()  # stress data never sets the serving scales
    r.stress_decode()
    calibrated.clear()
    out = LLMEngine(r).generate([[5, 6, 7] * 20, [9] * 40], max_tokens=4)
    assert [len(o) for o in out] == [4, 4]
    assert not r.kv_scales_pending and (r.kv.scales != 1).all()
    assert calibrated.count(True) == r.model_config.num_layers  # one step calibrated, once per layer
    first = r.kv.scales.clone()
    LLMEngine(r).generate([[100] * 50], max_tokens=2)
    assert torch.equal(r.kv.scales, first)  # later batches keep them
    r.teardown()
    r.build(1024)  # a rebuild starts over: the scales wait for the first batch again
    assert r.kv_scales_pending and (r.kv.scales == 1).all()


def checkpoint_with_scales(tmp_path: Path, scales: dict[str, torch.Tensor]) -> Path:
    """A small HF-style Qwen2 folder (test_engine_cpu.write_checkpoint) plus a file of KV cache scales."""
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, QWEN_SMALL)
    save_file(scales, str(folder / "model-kv-scales.safetensors"))
    return folder


def test_checkpoint_scales_are_used_and_never_recalibrated(tmp_path):
    layers = QWEN_SMALL["num_hidden_layers"]
    scales = {f"model.layers.{i}.self_attn.k_scale": torch.tensor(0.01 * (i + 1)) for i in range(layers)}
    scales |= {f"model.layers.{i}.self_attn.v_scale": torch.tensor([0.002]) for i in range(layers)}
    folder = checkpoint_with_scales(tmp_path, scales)
    r = ModelRunner(cfg(model=str(folder), kv_cache_dtype="fp8_e4m3"))
    assert r.kv_scale_source == "checkpoint"
    want = torch.tensor([[0.01 * (i + 1), 0.002] for i in range(layers)])
    torch.testing.assert_close(r.checkpoint_kv_scales, want)
    r.build(1024)
    r.stress_prefill()
    LLMEngine(r).generate([[5, 6, 7] * 20], max_tokens=2)
    torch.testing.assert_close(r.kv.scales, want)
    assert not r.kv_scales_pending
    r2 = ModelRunner(cfg(model=str(folder), kv_cache_dtype="fp8_e4m3", kv_scales="unit"))
    r2.build(1024)
    assert (r2.kv.scales == 1).all()


def test_a_checkpoint_with_some_scales_missing_is_refused_naming_the_layer(tmp_path):
    folder = checkpoint_with_scales(tmp_path, {"model.layers.0.self_attn.kv_scale": torch.tensor(0.1)})
    with pytest.raises(ValueError, match="layer 1's k_scale is missing"):
        ModelRunner(cfg(model=str(folder), kv_cache_dtype="fp8_e4m3"))


# ---------------------------------------------------------------- the cell in plan
def test_plan_halves_the_cell_and_fits_about_twice_the_tokens():
    base = dict(model="llama-3.1-8b", max_req_total_len=32768)
    bf16 = plan.make_plan(validate(ServerConfig(**base)), plan.GPUS["h100"])
    fp8 = plan.make_plan(validate(ServerConfig(**base, kv_cache_dtype="fp8_e4m3")), plan.GPUS["h100"])
    assert fp8.cell_bytes * 2 == bf16.cell_bytes
    assert 1.95 < fp8.tokens / bf16.tokens < 2.05


# ---------------------------------------------------------------- accuracy against the model's dtype
def test_fp8_kv_accuracy_against_bf16_kv_on_the_tiny_model():
    """scripts/kv_accuracy.py on the tiny model (bf16 weights): FP8 pages cost a small logits error and no
    greedy token at the loader's init; the numbers the README quotes come from this script."""
    dec = Decoder("tiny", "torch", "bfloat16", CPU, seed=0, std=None)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, dec.mc.vocab_size, (120,), generator=gen).tolist() for _ in range(2)]
    rows = {r.kv: r for r in compare(dec, prompts, 16, VARIANTS)}
    for r in rows.values():
        assert 0 < r.mean_rel_err < 0.03 and r.top1_agree >= 0.9
    same = compare(dec, prompts[:1], 4, {"a": ("auto", False), "b": ("auto", False)})[0]
    assert same.mean_rel_err == 0 and same.top1_agree == same.greedy_match == 1  # the metric sees no noise
