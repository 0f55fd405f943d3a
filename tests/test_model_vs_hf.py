"""GPU: our decoder against HF transformers on the same random checkpoint (Llama 3 with llama3 rope
scaling, Qwen2 with q/k/v bias, Qwen3 with q/k norm and tied embeddings).

float32: prefill logits agree to 1e-4 and 32 greedy steps (batched, through the decode graphs) give the
very same tokens. bfloat16 (torch and aiter_triton backends): prefill logits within bf16 error of the
fp32 reference, and every greedy token is an argmax of HF's fp32 logits up to bf16 noise."""
from __future__ import annotations

import json
import math

import pytest
import torch

from autoprofile.config import ServerConfig, validate
from autoprofile.layers.attention import AttentionMetadata
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.runner import ModelRunner
from autoprofile.model_config import load_model_config
from models.llama import rope_inv_freq
from tests.conftest import require_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BASE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 2048, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "torch_dtype": "float32", "bos_token_id": 1,
        "eos_token_id": 2}
FAMILIES = {
    "llama3": {**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
               "attention_bias": False, "tie_word_embeddings": False},
    "qwen2": {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_theta": 1000000.0,
              "head_dim": None, "hidden_size": 512, "tie_word_embeddings": False},
    "qwen3": {**BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rope_theta": 1000000.0,
              "attention_bias": False, "tie_word_embeddings": True},
}
PROMPTS = [[11, 250, 7, 1999, 42], list(range(100, 137)), [(i * 37) % 2048 for i in range(300)]]
STEPS = 32
MODES = [("torch", "float32"), ("torch", "bfloat16"), ("aiter_triton", "bfloat16")]


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """(folder, HF fp32 model): config.json written by us, weights by HF's own model class."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    d = {k: v for k, v in FAMILIES[request.param].items() if v is not None}
    folder = tmp_path_factory.mktemp(request.param)
    (folder / "config.json").write_text(json.dumps(d))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(folder)))
    hf = hf.to(device="cuda", dtype=torch.float32).eval()
    with torch.no_grad():  # HF's init leaves norms at 1 and biases at 0: perturb them so they are tested
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1 if name.endswith("bias") else 0.05)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()
             if not (d["tie_word_embeddings"] and k == "lm_head.weight")}
    save_file(state, str(folder / "model.safetensors"))
    rotary = getattr(hf.model, "rotary_emb", None)
    if rotary is not None and hasattr(rotary, "inv_freq"):  # HF read our rope config the way we do
        mc = load_model_config(str(folder))
        ours = rope_inv_freq(mc.head_dim, mc.rope_theta, mc.rope_scaling)
        torch.testing.assert_close(rotary.inv_freq.float().cpu(), ours, rtol=1e-6, atol=0)
    yield folder, hf
    del hf


def make_runner(folder, backend: str, dtype: str) -> ModelRunner:
    require_backend(backend)
    cfg = validate(ServerConfig(model=str(folder), dtype=dtype, attention_backend=backend,
                                max_req_total_len=512, batch_max_tokens=1024, graph_max_batch_size=8,
                                running_max_req_size=16, report_dir=None))
    runner = ModelRunner(cfg)
    runner.build(4096)
    return runner


def all_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """Our prefill logits at every position [L, vocab] (fp32)."""
    ps = runner.cfg.page_size
    pages = list(range(1, 1 + math.ceil(len(tokens) / ps)))  # the runner is idle: every page is free
    tok = torch.arange(len(tokens), device="cuda")
    slots = torch.tensor(pages, device="cuda")[tok // ps] * ps + tok % ps
    cu = torch.tensor([0, len(tokens)], dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(is_prefill=True, slot_mapping=slots, cu_seqlens=cu, max_seqlen=len(tokens))
    with torch.no_grad():
        hidden = runner.model(torch.tensor(tokens, device="cuda"), tok, meta, runner.kv.layers)
        return runner.model.compute_logits(hidden).float()


@torch.no_grad()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(input_ids=torch.tensor([tokens], device="cuda")).logits[0].float()


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(hf_logits(hf, seq)[-1].argmax()))
    return seq[len(prompt):]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("backend,dtype", MODES, ids=[f"{b}-{d}" for b, d in MODES])
def test_prefill_and_greedy_decode_match_hf(checkpoint, backend, dtype):
    folder, hf = checkpoint
    runner = make_runner(folder, backend, dtype)
    try:
        errs = [rel_err(all_logits(runner, p), hf_logits(hf, p)) for p in PROMPTS]
        ours = LLMEngine(runner).generate(PROMPTS, max_tokens=STEPS)  # batched prefill, graph decode
        print(f"\n{folder.name} {backend} {dtype}: prefill logits rel err {max(errs):.2e}")
        if dtype == "float32":
            assert max(errs) < 1e-4, errs
            assert ours == [hf_greedy(hf, p, STEPS) for p in PROMPTS]
            return
        assert max(errs) < 3e-2, errs
        for prompt, out in zip(PROMPTS, ours):  # teacher-forced on our tokens: each one near HF's argmax
            ref = hf_logits(hf, prompt + out)[len(prompt) - 1:-1]
            chosen = ref.gather(1, torch.tensor(out, device="cuda")[:, None]).squeeze(1)
            gap = (ref.max(-1).values - chosen).max().item()
            print(f"  greedy: largest gap to HF's argmax {gap:.3f} (logit std {ref.std().item():.2f})")
            assert gap < 0.1 * ref.std().item() + 0.02, gap
    finally:
        runner.teardown()
