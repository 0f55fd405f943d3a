"""Qwen2.5-VL against Hugging Face transformers on the same random weights (fp32, CPU, torch backend): the
vision tower's embeddings, prefill logits with one and two images and text only, a decode step after an
image, and the M-RoPE positions of get_rope_index. HF writes the checkpoint (save_pretrained), our loader
reads it."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from autoprofile.engine.attention import get_backend_class
from autoprofile.layers.attention import AttentionMetadata
from autoprofile.engine.kv_cache import KVCache
from autoprofile.engine.weights import init_random, load_weights
from autoprofile.model_config import CONFIG_DIR, ModelConfigError, from_hf_dict, load_model_config
from models import qwen2_5_vl
from models.llama import RMSNorm
from models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration, mrope_positions, vision_layout

# 5.x: get_rope_index takes mm_token_type_ids and save_pretrained nests the decoder keys under text_config
transformers = pytest.importorskip("transformers", minversion="5.0")

PAGE = 16
TINY = json.loads((CONFIG_DIR / "tiny-vl" / "config.json").read_text())
IMG, START, END = TINY["image_token_id"], TINY["vision_start_token_id"], TINY["vision_end_token_id"]
ONE = [(1, 12, 20)]  # merged 6 x 10: partial windows in both directions
TWO = [(1, 12, 20), (1, 18, 10)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(HF model, our model, folder): HF's random weights perturbed (norms off 1, biases off 0), written by
    its save_pretrained, read by our loader."""
    torch.manual_seed(0)
    hf = transformers.Qwen2_5_VLForConditionalGeneration(
        transformers.Qwen2_5_VLConfig(**{**TINY, "torch_dtype": "float32"})).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1 if name.endswith("bias") else 0.05)
    folder = tmp_path_factory.mktemp("tiny-vl")
    hf.save_pretrained(str(folder))
    return hf, build_ours(str(folder)), folder


def build_ours(folder: str) -> Qwen2_5_VLForConditionalGeneration:
    mc = load_model_config(folder)
    backend = get_backend_class("torch")(mc.num_heads, mc.num_kv_heads, mc.head_dim, PAGE, torch.float32,
                                         torch.device("cpu"))
    model = Qwen2_5_VLForConditionalGeneration(mc, backend, dtype=torch.float32)
    load_weights(model, mc.checkpoint_files, seed=0, show_progress=False)
    return model


def pixels(grids, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14, generator=g)


def prompt(grids, before=(5, 6, 7), after=(11, 12, 13)) -> list[int]:
    ids = list(before)
    for t, h, w in grids:
        ids += [START] + [IMG] * (t * h * w // 4) + [END, 9, 10]
    return ids + list(after)


def kv_cache(model) -> KVCache:
    mc = model.config
    return KVCache(mc.num_layers, 64, mc.num_kv_heads, PAGE, mc.head_dim, torch.float32, torch.device("cpu"))


def prefill_meta(n: int) -> AttentionMetadata:
    """As ModelRunner._prefill builds it for one row starting at 0 on pages 1, 2, ... (page 0 is the pad)."""
    return AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(n) + PAGE,
                             cu_seqlens=torch.tensor([0, n], dtype=torch.int32), max_seqlen=n)


@torch.no_grad()
def our_logits(model, ids, grids, kv=None) -> torch.Tensor:
    kv = kv or kv_cache(model)
    embeds = model.visual(pixels(grids), grids) if grids else None
    positions, _ = mrope_positions(ids, grids, model.config)
    mask = torch.tensor(ids) == IMG if grids else None
    hidden = model(torch.tensor(ids), positions, prefill_meta(len(ids)), kv.layers, embeds, mask)
    return model.compute_logits(hidden)


@torch.no_grad()
def hf_logits(hf, ids, grids) -> torch.Tensor:
    input_ids = torch.tensor([ids])
    if not grids:
        return hf(input_ids=input_ids).logits[0]
    return hf(input_ids=input_ids, pixel_values=pixels(grids), image_grid_thw=torch.tensor(grids),
              mm_token_type_ids=(input_ids == IMG).int()).logits[0]


@pytest.mark.parametrize("grids", [ONE, TWO, [(1, 16, 16)], [(2, 8, 12), (1, 4, 4)]],
                         ids=["partial-windows", "two-images", "whole-windows", "two-frames"])
def test_vision_tower_matches_hf(models, grids):
    hf, ours, _ = models
    with torch.no_grad():
        ref = hf.model.visual(pixels(grids), grid_thw=torch.tensor(grids)).pooler_output
        out = ours.visual(pixels(grids), torch.tensor(grids))
    assert out.shape == (sum(t * h * w for t, h, w in grids) // 4, ours.config.hidden_size)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grids", [ONE, TWO], ids=["one-image", "two-images"])
def test_prefill_logits_with_images_match_hf(models, grids):
    hf, ours, _ = models
    ids = prompt(grids)
    torch.testing.assert_close(our_logits(ours, ids, grids), hf_logits(hf, ids, grids), rtol=1e-4, atol=1e-4)


def test_text_only_logits_match_hf_with_plain_and_3d_positions(models):
    hf, ours, _ = models
    ids = [3, 99, 250, 17, 400, 8, 8, 311, 42, 7]
    ref = hf_logits(hf, ids, [])
    positions, delta = mrope_positions(ids, [], ours.config)
    assert delta == 0 and torch.equal(positions, torch.arange(len(ids)).expand(3, -1))
    kv = kv_cache(ours)
    with torch.no_grad():
        plain = ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids)), prefill_meta(len(ids)),
                                         kv.layers))
    torch.testing.assert_close(plain, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(our_logits(ours, ids, []), ref, rtol=1e-4, atol=1e-4)


def test_decode_after_an_image_uses_position_plus_delta(models):
    """Prefill all but the last token (M-RoPE [3, T]), then decode it with a [1] position p + delta through
    the paged cache: the logits are HF's at that token."""
    hf, ours, _ = models
    ids = prompt(ONE)
    n = len(ids) - 1
    positions, delta = mrope_positions(ids, ONE, ours.config)
    assert delta < 0
    kv = kv_cache(ours)
    with torch.no_grad():
        ours(torch.tensor(ids[:n]), positions[:, :n], prefill_meta(n), kv.layers,
             ours.visual(pixels(ONE), ONE), torch.tensor(ids[:n]) == IMG)
        pages = math.ceil(len(ids) / PAGE)
        meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor([PAGE + n]),
                                 block_tables=torch.arange(1, pages + 1, dtype=torch.int32)[None],
                                 seq_lens=torch.tensor([n + 1], dtype=torch.int32), max_seq_len=pages * PAGE)
        step = ours.compute_logits(ours(torch.tensor(ids[n:]), torch.tensor([n + delta]), meta, kv.layers))
    torch.testing.assert_close(step[0], hf_logits(hf, ids, ONE)[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ids,grids", [
    (prompt(ONE), ONE),
    (prompt(ONE, before=(), after=()), ONE),               # image first, nothing after its end token
    ([START] + [IMG] * 60 + [END], ONE),                    # the image and its delimiters alone
    (prompt(TWO, after=tuple(range(20, 60))), TWO),        # two grids, long text after
    (prompt([(1, 20, 8), (1, 4, 4), (1, 8, 28)]), [(1, 20, 8), (1, 4, 4), (1, 8, 28)]),
    ([5, 6, 7, 8], []),
], ids=["text-after", "image-first", "image-alone", "two-images", "three-images", "text-only"])
def test_mrope_positions_match_hf_get_rope_index(models, ids, grids):
    hf, ours, _ = models
    input_ids = torch.tensor([ids])
    ref, ref_delta = hf.model.get_rope_index(input_ids, (input_ids == IMG).int(),
                                             torch.tensor(grids) if grids else None)
    positions, delta = mrope_positions(ids, grids, ours.config)
    assert positions.dtype == torch.int64 and torch.equal(positions, ref[:, 0])
    assert delta == int(ref_delta)


def test_mrope_positions_refuses_a_token_count_that_does_not_fit_the_grids(models):
    _, ours, _ = models
    with pytest.raises(ValueError, match="59 image tokens.*needs 60"):
        mrope_positions([START] + [IMG] * 59 + [END], ONE, ours.config)
    with pytest.raises(ValueError, match="not contiguous"):
        mrope_positions([IMG] * 30 + [5] + [IMG] * 30, ONE, ours.config)


def test_vision_tower_refuses_pixels_of_another_shape(models):
    _, ours, _ = models
    with pytest.raises(ValueError, match=r"grid_thw \[\(1, 12, 20\)\] needs \(240, 1176\)"):
        ours.visual(pixels(ONE)[:-4], ONE)


def test_window_layers_attend_all_windows_in_one_call(models, monkeypatch):
    """No loop over windows: one SDPA per window layer, one per frame in the full-attention layers."""
    _, ours, _ = models
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(q, *args, **kwargs):
        calls.append(q.shape)
        return real(q, *args, **kwargs)

    monkeypatch.setattr(qwen2_5_vl.F, "scaled_dot_product_attention", counting)
    v = ours.config.vision
    with torch.no_grad():
        ours.visual(pixels(TWO), TWO)
    full, windowed = len(v.fullatt_block_indexes), v.depth - len(v.fullatt_block_indexes)
    assert len(calls) == windowed + full * len(TWO)
    side = v.window_size // v.patch_size  # patches per window side
    windows = sum(math.ceil(h / side) * math.ceil(w / side) for _, h, w in TWO)
    batched = [c for c in calls if c[0] == windows]
    assert batched == [(windows, v.num_heads, side * side, v.head_dim)] * windowed
    # 4-D everywhere: a 3-D call cannot take torch's flash or memory-efficient kernels (quadratic memory)
    assert all(len(c) == 4 for c in calls), calls


def test_vision_layout_pads_partial_windows_and_keeps_every_patch_once():
    v = load_model_config("tiny-vl").vision
    layout = vision_layout(TWO, v)
    patches = sum(t * h * w for t, h, w in TWO)
    assert torch.equal(layout.patch_order.sort().values, torch.arange(patches))
    assert layout.window_dst.unique().numel() == patches == int(layout.window_mask.sum())
    assert torch.equal(layout.window_mask.flatten()[layout.window_dst], torch.ones(patches, dtype=torch.bool))
    assert layout.padded_tokens > patches and layout.frame_bounds == (0, 12 * 20, 12 * 20 + 18 * 10)
    assert vision_layout([(2, 8, 12), (1, 4, 4)], v).frame_bounds == (0, 96, 2 * 96, 2 * 96 + 16)


def test_checkpoint_with_language_model_and_visual_prefixes_loads_the_same(models, tmp_path):
    """transformers 4.52+ in-memory names (model.language_model.*, model.visual.*) map onto ours."""
    _, ours, folder = models
    state = load_file(str(folder / "model.safetensors"))
    renamed = {("model.language_model." + k[6:] if k.startswith("model.") else
                "model." + k if k.startswith("visual.") else k): v for k, v in state.items()}
    assert any(k.startswith("model.visual.") for k in renamed)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    again = build_ours(str(tmp_path))
    for (name, a), (_, b) in zip(ours.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_configs_read_as_transformers_reads_them(models):
    """The built-in 7B config and a save_pretrained one (text keys nested under text_config) give HF's fields;
    the vision parameter count is HF's."""
    hf, ours, _ = models
    assert ours.config.vision.num_params() == sum(p.numel() for p in hf.model.visual.parameters())
    assert ours.config.hidden_size == TINY["hidden_size"] and ours.config.attention_bias
    big = load_model_config("qwen2.5-vl-7b")
    hf_cfg = transformers.Qwen2_5_VLConfig(**json.loads((CONFIG_DIR / "qwen2.5-vl-7b" / "config.json")
                                                         .read_text()))
    vc, tc = hf_cfg.vision_config, hf_cfg.text_config
    assert (big.vision.depth, big.vision.hidden_size, big.vision.num_heads, big.vision.intermediate_size,
            list(big.vision.fullatt_block_indexes), big.vision.window_size, big.vision.out_hidden_size) == \
        (vc.depth, vc.hidden_size, vc.num_heads, vc.intermediate_size, list(vc.fullatt_block_indexes),
         vc.window_size, vc.out_hidden_size)
    assert (big.hidden_size, big.num_layers, big.num_kv_heads, big.rope_theta, big.rope_scaling,
            list(big.mrope_section), big.image_token_id, big.runnable) == \
        (tc.hidden_size, tc.num_hidden_layers, tc.num_key_value_heads, tc.rope_parameters["rope_theta"], None,
         tc.rope_parameters["mrope_section"], hf_cfg.image_token_id, True)
    with torch.device("meta"):
        tower = transformers.Qwen2_5_VLModel(hf_cfg).visual
    assert big.vision.num_params() == sum(p.numel() for p in tower.parameters())


def test_a_bad_mrope_section_names_the_key_and_a_value_that_works():
    bad = {**TINY, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 4]}}
    with pytest.raises(ModelConfigError, match=r"'rope_scaling'.*head_dim / 2 \(8\), e.g. \[2, 3, 3\]"):
        from_hf_dict(bad)
    with pytest.raises(ModelConfigError, match=r"'vision_config'.*'fullatt_block_indexes'"):
        from_hf_dict({**TINY, "vision_config": {**TINY["vision_config"], "fullatt_block_indexes": [4]}})


def test_random_init_sets_every_norm_scale_to_one():
    """--model tiny-vl / qwen2.5-vl-7b run on random weights: the tower's norms (norm1, norm2, ln_q) too."""
    mc = load_model_config("tiny-vl")
    backend = get_backend_class("torch")(mc.num_heads, mc.num_kv_heads, mc.head_dim, PAGE, torch.float32,
                                         torch.device("cpu"))
    model = Qwen2_5_VLForConditionalGeneration(mc, backend, dtype=torch.float32)
    init_random(model, seed=0)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * mc.num_layers + 1 + 2 * mc.vision.depth + 1
    assert all(bool((m.weight == 1).all()) for m in norms)
    assert model.visual.blocks[0].attn.qkv.weight.std() > 0
