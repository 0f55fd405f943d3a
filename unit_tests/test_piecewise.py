"""Piecewise graphs (engine.piecewise) without a GPU: the buckets, the stress corner of the largest bucket,
and the seam between the model and the pieces. A CUDA graph cannot be captured on a CPU, so `EagerPieces`
runs what a replay runs, eagerly: the real PiecewiseGraphs stages the step into its static inputs (padded to
the bucket) and each layer's attention reads q, k, v from the static QKV buffer and writes the static output,
on the padded bucket, as the replay's pieces do. Its logits and K/V must be the eager forward's (the GPU test,
tests/test_piecewise_gpu.py, replays the captured pieces themselves)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autoprofile import plan
from autoprofile.config import piecewise_max_tokens
from autoprofile.engine import stress
from autoprofile.engine.envelope import Envelope
from autoprofile.engine.kv_cache import PAD_PAGE
from autoprofile.engine.piecewise import PiecewiseGraphs, piece_buckets, splits_pieces
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.sampling import GREEDY
from autoprofile.engine.scheduler import StepRow
from autoprofile.engine.weights import init_random
from unit_tests.test_engine_cpu import small_cfg


def test_buckets_pad_a_step_past_128_tokens_by_at_most_a_quarter_up_to_the_flag():
    assert piece_buckets(512) == [16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 480, 512]
    ladder = piece_buckets(8192)
    assert all(b % 32 == 0 and (b - a) * 4 <= a for a, b in zip(ladder, ladder[1:]) if a >= 128)
    assert piece_buckets(100) == [16, 32, 64, 96, 100]
    assert piece_buckets(16) == [16] and piece_buckets(10) == [10] and piece_buckets(0) == []
    pieces = PiecewiseGraphs(100, torch.float32, torch.device("cpu"), pad_slot=0)
    assert [pieces.pick(n) for n in (1, 16, 17, 97, 100, 101)] == [16, 16, 32, 100, 100, None]


@pytest.mark.parametrize("inference_mode", [False, True])
def test_static_inputs_copy_each_root_once_aligned_and_grow_only_outside_a_capture(inference_mode):
    """The eager part's tensors: views of one root share its copy (q, k, v of the packed projection), each
    root's copy starts 128 bytes after a boundary (kernels specialize on their pointers' alignment), the
    output has the asked shape; the buffers grow in a warm-up, never while a bucket is being captured.
    Under torch.inference_mode too, where a view keeps no `_base` (scripts/bench_decode.py builds in it)."""
    with torch.inference_mode(inference_mode):
        static_inputs_copy_each_root_once()


def static_inputs_copy_each_root_once():
    pieces = PiecewiseGraphs(64, torch.float32, torch.device("cpu"), pad_slot=0)
    qkv, ba = torch.randn(3, 10), torch.randn(3, 5)
    q, k, v = qkv.split([6, 2, 2], dim=-1)
    static, out = pieces.static_inputs((q.unflatten(-1, (3, 2)), k, v, ba), (4, 2))
    assert [torch.equal(a, b) for a, b in zip(static, (q.unflatten(-1, (3, 2)), k, v, ba))] == [True] * 4
    base = pieces.inputs.data_ptr()
    assert static[0].data_ptr() == static[1].data_ptr() - 6 * 4 == base  # one copy of qkv
    assert (static[3].data_ptr() - base) % 128 == 0 and static[3].data_ptr() - base >= qkv.nbytes
    assert out.shape == (3, 4, 2) and out.data_ptr() == pieces.outputs.data_ptr()
    pieces._taking = []  # a bucket being captured: what the warm-up did not size cannot fit
    with pytest.raises(AssertionError, match="never inside a capture"):
        pieces.static_inputs((torch.randn(30, 10),), (4,))
    pieces.static_inputs((qkv,), (4,))  # what fits is copied


def test_the_stress_runs_the_largest_bucket_beside_the_most_decode_rows():
    def env(piecewise):
        return Envelope.build(kv_pages=4096, page_size=16, context_len=4096, batch_max_tokens=8192,
                              running_max_req_size=None, graph_max_batch_size=256, use_graphs=True,
                              piecewise_tokens=piecewise)

    plain, pieces = stress.mixed_corners(env(0)), stress.mixed_corners(env(512))
    assert pieces[:-1] == plain
    chunks, decode = pieces[-1]
    assert chunks == [(0, 512 - 255)] and len(decode) == 255  # 256 request slots: one is the chunk's
    assert env(10**6).piecewise_tokens == env(0).mixed_tokens  # no step has more tokens than that


class EagerPieces:
    """What a replay of the captured pieces runs, eagerly (see the module's docstring)."""

    def __init__(self, runner: ModelRunner, max_tokens: int):
        self.real = PiecewiseGraphs(max_tokens, runner.dtype, runner.device, PAD_PAGE * runner.cfg.page_size)
        self.runner, self.max_tokens, self.buckets_run = runner, max_tokens, []

    def forward(self, ids, positions, meta):
        self.n, self.step_meta = ids.shape[0], meta
        bucket = self.real.stage(ids, positions, meta)
        self.buckets_run.append(bucket)
        padded = self.real.meta(bucket)
        padded.pieces = self
        return self.runner._hidden(self.real.ids[:bucket], self.real.positions[:bucket], padded)[:self.n]

    def split(self, run, views, out_shape):
        """As a replay between two pieces: run on the static copies' first n rows, into the static output."""
        static, out = self.real.static_inputs(views, out_shape)
        assert all(v.untyped_storage().data_ptr() == self.real.inputs.untyped_storage().data_ptr()
                   for v in static) and out.untyped_storage().data_ptr() == self.real.outputs.data_ptr()
        run(*(v[:self.n] for v in static), self.step_meta, out=out[:self.n])
        return out


MODELS = ["tiny", "tiny-hybrid", "tiny-hybrid-moe"]


@pytest.mark.parametrize("model", MODELS + ["tiny-moe", "tiny-fp8", "tiny-mla", "tiny-vl"])
def test_which_models_run_their_small_steps_through_pieces(model):
    """Llama-style and Qwen3.5 layers hand their eager part to the pieces; MLA layers do not, and the
    configuration rules out MLA and vision-language models (a VL step's image rows: eager)."""
    extra = dict(max_image_pixels=199136) if model == "tiny-vl" else {}
    cfg = small_cfg(model=model, **extra)
    gpu = piecewise_max_tokens(dataclasses.replace(cfg, attention_backend="aiter_triton"), "aiter_triton")
    assert (gpu == cfg.batch_max_tokens) is (model not in ("tiny-mla", "tiny-vl"))  # (256 < 512)
    assert splits_pieces(ModelRunner(cfg).model) is (model != "tiny-mla")


@pytest.fixture(params=MODELS)
def runner(request):
    r = ModelRunner(small_cfg(model=request.param))
    init_random(r.model, seed=1, std=0.08)
    r.build(2048)
    r.req_table.write([(slot, 0, list(range(1 + 8 * slot, 9 + 8 * slot))) for slot in range(4)])
    yield r
    r.teardown()


def _states(runner: ModelRunner) -> list[torch.Tensor]:
    """A hybrid's conv windows and delta-rule states (none for a dense model)."""
    return [] if runner.state is None else [runner.state.conv, runner.state.ssm]


def _step(runner: ModelRunner, rows, decode, pieces):
    runner.pieces = pieces
    try:
        logits = runner._prefill(rows, decode)[0].clone()
    finally:
        runner.pieces = None
    return logits, runner.kv.buffer.clone(), [t.clone() for t in _states(runner)]


def _nan_filled_allocations(monkeypatch) -> None:
    """Every floating torch.empty, empty_like and new_empty from now on filled with NaN (uninitialized memory
    may hold any bits): the pieces' static buffers, so their padded rows write NaN K/V into the pad page."""
    def filled(make):
        def alloc(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() and t.numel() else t
        return alloc
    monkeypatch.setattr(torch, "empty", filled(torch.empty))
    monkeypatch.setattr(torch, "empty_like", filled(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", filled(torch.Tensor.new_empty))


@torch.no_grad()
def test_pieces_give_the_eager_forwards_logits_kv_and_states_and_padding_writes_only_the_pad_page(runner,
                                                                                                 monkeypatch):
    """A 40-token prompt (bucket 64), then a mixed step: a 30-token chunk of a second prompt and the first
    request's decode row (31 tokens, bucket 32: its padded row 31 held a real slot of the step before), then
    a chunk over the second prompt's cached 30 tokens (the kv_slots path). A hybrid's linear layers run their
    rule between the pieces from each row's state: each step starts both ways from the same states and ends
    in the same ones (the decode row and the second chunk go on from them).
    Allocations start as NaN: the padded rows' NaN K/V in the pad page, which a decode row's table reaches
    past its seq_len, must not reach a real row (the torch decode once multiplied them by a zero weight:
    NaN logits, a flake of this test where memory happened to hold NaN)."""
    _nan_filled_allocations(monkeypatch)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, 4096, (n,), generator=g).tolist() for n in (41, 45))
    steps = [([StepRow(0, 0, a[:40], True, GREEDY)], None),
             ([StepRow(1, 0, b[:30], True, GREEDY)], [StepRow(0, 40, [a[40]], True, GREEDY)]),
             ([StepRow(1, 30, b[30:], True, GREEDY)], None)]
    pieces = EagerPieces(runner, 64)
    real = [p for p in range(runner.kv.buffer.shape[2]) if p != PAD_PAGE]  # [k/v, layer, page, ...]
    for rows, decode in steps:
        before = [t.clone() for t in _states(runner)]
        eager, kv_eager, states_eager = _step(runner, rows, decode, None)
        for t, saved in zip(_states(runner), before):
            t.copy_(saved)
        piecewise, kv_pieces, states_pieces = _step(runner, rows, decode, pieces)
        torch.testing.assert_close(piecewise, eager, rtol=1e-5, atol=1e-5)
        # a padded row writing a real slot leaves a foreign K/V there (differences of order 1); the real rows'
        # own K/V may differ in the last bits (a 15-row GEMM against the bucket's 16 rows: 4e-6 on an AVX-512
        # host, equal on others)
        torch.testing.assert_close(kv_pieces[:, :, real], kv_eager[:, :, real], rtol=1e-5, atol=1e-5,
                                   msg="a padded row wrote a real slot")
        for got, want in zip(states_pieces, states_eager):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # the states moved on
        assert all(not torch.equal(t, saved) for t, saved in zip(_states(runner), before))
    assert pieces.buckets_run == [64, 32, 16]
    # the static output the plan charges (plan.piece_widths); the inputs follow the backend's q, k, v (the
    # torch backend's rotated q and k are tensors of their own: the GPU test bounds aiter_triton's)
    wide, out = plan.piece_widths(runner.model_config)
    assert pieces.real.outputs.numel() == 64 * out and pieces.real.inputs.numel() >= 64 * wide
