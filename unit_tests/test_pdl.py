"""kernels.pdl: where programmatic dependent launch is on (the launch keywords every PDL kernel takes)."""
from __future__ import annotations

import pytest
import torch

from autoprofile.kernels import pdl


@pytest.fixture(autouse=True)
def fresh():
    pdl.enabled.cache_clear()
    yield
    pdl.enabled.cache_clear()


def test_on_only_for_a_hopper_or_later_gpu(monkeypatch):
    monkeypatch.delenv("AUTOPROFILE_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, on in (((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda c=capability: c)
        pdl.enabled.cache_clear()
        assert pdl.launch() == ({"PDL": True, "launch_pdl": True} if on else {"PDL": False}), capability


@pytest.mark.parametrize("env", [{"AUTOPROFILE_PDL": "0"}, {"TRITON_INTERPRET": "1"}])
def test_off_when_turned_off_or_interpreted(monkeypatch, env):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert pdl.launch() == {"PDL": False}


def test_off_without_a_gpu(monkeypatch):
    monkeypatch.delenv("AUTOPROFILE_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pdl.launch() == {"PDL": False}
