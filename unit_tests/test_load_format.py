"""Where the weights come from (--load_format): a model folder's safetensors or PyTorch .bin files (an HF
index's files only), read through the same per-parameter weight_loader; random weights only by choice
(--load_format dummy) or for a built-in config; and the boot log's line that says which."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from autoprofile.config import ServerConfig, validate
from autoprofile.engine.attention.torch_sdpa import TorchBackend
from autoprofile.engine.runner import ModelRunner
from autoprofile.engine.weights import load_weights
from autoprofile.layers.parallel import TP
from autoprofile.model_config import ModelConfigError, find_weights, load_model_config
from models.llama import LlamaForCausalLM
from unit_tests.test_engine_cpu import QWEN_SMALL, hf_tensors

SMALL = dict(dtype="float32", attention_backend="torch", max_req_total_len=256, batch_max_tokens=256,
             graph_max_batch_size=4, running_max_req_size=16, report_dir=None)
TRACE = []  # a pickled call appends here if a .bin is ever unpickled unsafely


def write(folder: Path, fmt: str, files: int = 2, index: bool = False) -> dict[str, torch.Tensor]:
    """QWEN_SMALL's config.json and random weights in `files` shards of safetensors or .bin (+ HF index)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN_SMALL))
    t = hf_tensors(QWEN_SMALL, seed=3)
    names, weight_map = sorted(t), {}
    for f in range(files):
        part = {n: t[n].contiguous() for n in names[f::files]}
        if fmt == "safetensors":
            name = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
            save_file(part, str(folder / name))
        else:
            name = f"pytorch_model-{f + 1:05d}-of-{files:05d}.bin"
            torch.save(part, folder / name)
        weight_map |= dict.fromkeys(part, name)
    if index:
        index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
        (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return t


def names(files: list[Path]) -> list[str]:
    return [f.name for f in files]


# ---------------------------------------------------------------- finding the files
def test_auto_takes_safetensors_else_bin_and_a_named_format_only_its_own(tmp_path):
    write(tmp_path / "st", "safetensors")
    write(tmp_path / "pt", "pt")
    both = tmp_path / "both"
    write(both, "safetensors")
    write(both, "pt")
    st = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    pt = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
    assert names(find_weights(tmp_path / "st")) == names(find_weights(both)) == st
    assert names(find_weights(tmp_path / "pt")) == names(find_weights(both, "pt")) == pt
    assert names(find_weights(both, "safetensors")) == st
    with pytest.raises(ModelConfigError, match=r"st: holds no weights \(looked for "
                                               r"pytorch_model\.bin\.index\.json / \*\.bin\)"):
        find_weights(tmp_path / "st", "pt")


def test_an_index_names_the_files_and_only_those_load(tmp_path):
    t = write(tmp_path, "safetensors", index=True)
    save_file({"stray": torch.zeros(1)}, str(tmp_path / "consolidated.safetensors"))  # e.g. Mistral's
    assert names(find_weights(tmp_path)) == ["model-00001-of-00002.safetensors",
                                             "model-00002-of-00002.safetensors"]
    assert names(load_model_config(str(tmp_path)).checkpoint_files) == names(find_weights(tmp_path))
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelConfigError, match=r"model\.safetensors\.index\.json: key 'weight_map' names "
                                               r"model-00002-of-00002\.safetensors, not in"):
        find_weights(tmp_path)
    assert t


def test_trainer_files_are_not_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_SMALL))
    torch.save({"lr": torch.tensor(1.0)}, tmp_path / "training_args.bin")
    with pytest.raises(ModelConfigError, match=r"holds no weights \(looked for model\.safetensors\.index\."
                                               r"json / \*\.safetensors or pytorch_model\.bin\.index\.json / "
                                               r"\*\.bin\)"):
        find_weights(tmp_path)


# ---------------------------------------------------------------- reading .bin files
def qwen_model(mc, tp: TP) -> LlamaForCausalLM:
    heads, kv = 4 // tp.size, 2 // tp.size
    return LlamaForCausalLM(mc, TorchBackend(heads, kv, 32, 16, torch.float32, torch.device("cpu")), tp,
                            torch.float32)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_bin_checkpoint_loads_each_ranks_shard_as_the_safetensors_one_does(tmp_path, rank):
    t = write(tmp_path / "st", "safetensors")
    write(tmp_path / "pt", "pt", files=3, index=True)
    models = []
    for fmt in ("st", "pt"):
        mc = load_model_config(str(tmp_path / fmt))
        model = qwen_model(mc, TP(rank=rank, size=2))
        load_weights(model, find_weights(tmp_path / fmt), seed=0, show_progress=False)
        models.append(dict(model.named_parameters()))
    st, pt = models
    assert st.keys() == pt.keys() and all(torch.equal(st[n], pt[n]) for n in st)
    half = t["model.layers.1.mlp.down_proj.weight"].shape[1] // 2
    assert torch.equal(pt["model.layers.1.mlp.down_proj.weight"],
                       t["model.layers.1.mlp.down_proj.weight"][:, rank * half:(rank + 1) * half])


class Pickled:
    """Unpickles by calling TRACE.append: what torch.load(weights_only=False) would run."""

    def __reduce__(self):
        return TRACE.append, ("ran",)


def test_a_bin_is_unpickled_with_weights_only(tmp_path):
    write(tmp_path, "pt", files=1)
    file = tmp_path / "pytorch_model-00001-of-00001.bin"
    torch.save({**torch.load(file, weights_only=True), "extra": Pickled()}, file)
    model = qwen_model(load_model_config(str(tmp_path)), TP())
    with pytest.raises(ValueError, match=r"00001-of-00001\.bin: torch\.load\(weights_only=True"):
        load_weights(model, find_weights(tmp_path), seed=0, show_progress=False)
    assert TRACE == []


def test_a_bin_that_cannot_be_mapped_is_refused_naming_the_conversion(tmp_path):
    """mmap=True: the pre-1.6 (non-zip) format cannot be mapped, so it is not read whole either."""
    write(tmp_path, "pt", files=1)
    file = tmp_path / "pytorch_model-00001-of-00001.bin"
    torch.save(torch.load(file, weights_only=True), file, _use_new_zipfile_serialization=False)
    model = qwen_model(load_model_config(str(tmp_path)), TP())
    with pytest.raises(ValueError, match=r"\.bin: torch\.load\(weights_only=True, mmap=True\) cannot read it "
                                         r".*convert it to safetensors"):
        load_weights(model, find_weights(tmp_path), seed=0, show_progress=False)


# ---------------------------------------------------------------- the runner: which weights, said once
def test_the_boot_log_says_where_the_weights_come_from_and_dummy_ignores_the_files(tmp_path, caplog):
    t = write(tmp_path, "pt")
    caplog.set_level(logging.INFO, logger="autoprofile.engine.runner")
    loaded = ModelRunner(validate(ServerConfig(model=str(tmp_path), **SMALL)))
    assert f"weights: 2 .bin files in {tmp_path}" in caplog.text
    assert torch.equal(loaded.model.lm_head.weight, t["lm_head.weight"])
    caplog.clear()
    dummy = ModelRunner(validate(ServerConfig(model=str(tmp_path), load_format="dummy", seed=5, **SMALL)))
    assert "weights: random (seed 5): --load_format dummy" in caplog.text
    assert not torch.equal(dummy.model.lm_head.weight, t["lm_head.weight"])
    caplog.clear()
    ModelRunner(validate(ServerConfig(model="tiny", **SMALL)))
    assert "weights: random (seed 0): tiny is a built-in config without weights" in caplog.text
