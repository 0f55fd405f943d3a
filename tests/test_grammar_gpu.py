"""GPU: structured output's token bitmask (autoprofile.engine.grammar) on CUDA logits before the fused Triton
sampler: the batched host fill equals the per-row one, the CUDA mask equals the CPU one, every sampled token of
a grammar row is one its grammar allows (greedy, top-k/top-p and seeded rows, bf16 logits of a 152k
vocabulary); and the overlapped engine on a llama-shaped model with decode graphs answers JSON schemas that
validate, beside free rows, after a stress that masks every sampled row."""
from __future__ import annotations

import json
import random

import pytest
import torch

from autoprofile.config import ServerConfig, validate
from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.grammar import TokenBitmask
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.sampling import SamplingBatch, SamplingParams, SeedStream, make_generator, sample
from autoprofile.engine.weights import init_random
from autoprofile.serving.structured import Grammars, Spec
from autoprofile.serving.tokenizer import ByteTokenizer
from tests.conftest import require_backend
from tests.test_deterministic_gpu import SMALL_LLAMA

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["x", "y", "zz"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}


def _allowed(mask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (mask_row.cpu().to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab].bool()


def test_cuda_mask_equals_cpu_and_the_fused_sampler_draws_only_allowed_tokens():
    vocab, rows = 152064, 256
    dev = torch.device("cuda")
    grammars = Grammars(ByteTokenizer(vocab, eos_token_ids=[2]), vocab)
    rng = random.Random(0)
    picked = sorted(rng.sample(range(rows), 100))
    specs = [Spec("regex", r"[a-f]{3,9}", "r"), Spec("json", json.dumps(SCHEMA), "s"),
             Spec("choice", json.dumps(["yes", "no"]), "c")]
    matchers = {i: grammars.new_matcher(specs[k % 3]) for k, i in enumerate(picked)}
    mask = TokenBitmask(rows, vocab, dev)
    logits = torch.randn(rows, vocab, device=dev, dtype=torch.bfloat16)
    ref = logits.float().cpu()
    mask.apply(logits, list(matchers.items()))
    per_row = torch.full_like(mask.host, -1)
    for i, m in matchers.items():  # the batched fill (pinned host rows) against each matcher's own call
        m.fill_next_token_bitmask(per_row, i)
    assert mask._batch is not None and torch.equal(mask.host[picked], per_row[picked])
    xgrammar.apply_token_bitmask_inplace(ref, mask.host, indices=picked)
    assert torch.equal(logits.float().cpu(), ref)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, top_k=50),
              SamplingParams(temperature=1.0, seed=7)]
    batch = SamplingBatch.from_params([params[i % 3] for i in range(rows)], dev)
    gens = [SeedStream(i) if i % 3 == 2 else None for i in range(rows)]
    for _ in range(4):
        tokens = sample(logits, batch, make_generator(1, dev), gens).cpu()
        for i in picked:
            assert _allowed(mask.host[i], vocab)[tokens[i]], (i, int(tokens[i]))


MASK_CASES = [(256, 128256, 128256, None), (256, 151936, 152064, None), (256, 128256, 128256, [0, 7, 255]),
              (3, 100, 131, [2]), (9, 8200, 8200, None)]


@pytest.mark.parametrize("rows, vocab, width, index", MASK_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_mask_kernel_equals_its_torch_reference(rows, vocab, width, index, dtype):
    """kernels.triton_bitmask on the GPU (engine.grammar.mask_logits_ on CUDA) against the torch path the same
    call takes on the CPU (unit_tests: that path against xgrammar's): random words, every row and named rows,
    logits wider than the vocabulary left alone past it."""
    from autoprofile.engine.grammar import mask_logits_
    g = torch.Generator(device="cuda").manual_seed(rows + vocab)
    logits = torch.randn(rows, width, device="cuda", generator=g).to(dtype)
    bits = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), device="cuda", generator=g,
                         dtype=torch.int64).to(torch.int32)
    idx = None if index is None else torch.tensor(index, dtype=torch.int32)
    got = mask_logits_(logits.clone(), bits, vocab, None if idx is None else idx.cuda()).cpu()
    want = mask_logits_(logits.cpu(), bits.cpu(), vocab, idx)
    assert torch.equal(got, want)
    assert 0 < int(torch.isinf(got).sum()) and torch.equal(got[:, vocab:], logits[:, vocab:].cpu())


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    require_backend("aiter_triton")
    folder = tmp_path_factory.mktemp("small-llama")
    (folder / "config.json").write_text(json.dumps(SMALL_LLAMA))
    cfg = validate(ServerConfig(model=str(folder), load_format="dummy", attention_backend="aiter_triton",
                                max_req_total_len=2048, batch_max_tokens=512, graph_max_batch_size=32,
                                running_max_req_size=48, report_dir=None))
    r = ModelRunner(cfg)
    init_random(r.model, seed=1, std=0.02)
    r.build(65536)
    yield r
    r.teardown()


@pytest.mark.parametrize("overlap", [True, False])
def test_json_schema_rows_beside_free_rows_on_the_overlapped_engine(runner, overlap):
    runner.stress_decode()  # every sampled row masked (the bitmask at the envelope's sampled rows)
    tok = ByteTokenizer(SMALL_LLAMA["vocab_size"], eos_token_ids=[2])
    grammars = Grammars(tok, SMALL_LLAMA["vocab_size"])
    spec = Spec("json", json.dumps(SCHEMA), "s")
    engine = LLMEngine(runner, overlap=overlap)
    rng = random.Random(1)
    ids = {}
    for i in range(48):
        prompt = [rng.randrange(3, 31000) for _ in range(rng.randrange(1, 600))]
        params = (SamplingParams(temperature=1.0, seed=i) if i % 2
                  else SamplingParams(temperature=0.8, top_p=0.9))
        grammar = grammars.new_matcher(spec) if i % 2 else None
        ids[engine.add_request(prompt, params, 80 if grammar else rng.randrange(1, 60), stop_token_ids={2},
                               grammar=grammar)] = grammar is not None
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    for rid, constrained in ids.items():
        if constrained:
            assert reasons[rid] == "stop", (rid, tok.decode(out[rid]))
            jsonschema.validate(json.loads(tok.decode(out[rid])), SCHEMA)
    assert engine.stats.pages_used == 0 and engine.stats.ooms == 0
