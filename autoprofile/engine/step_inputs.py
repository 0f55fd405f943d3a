"""A step's indices on their way to the GPU: built as int64 host arrays in numpy (prefill_inputs), then one
host-to-device copy of them all (upload) from the runner's pinned buffers (Staging). The runner's step input
building, apart from the runner so each can be read (and tested: unit_tests/test_step_inputs.py) alone."""
from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch

from autoprofile.engine.pinned import PinnedBuffers
from autoprofile.engine.scheduler import StepRow


def prefill_inputs(rows: list[StepRow], decode: list[StepRow], with_keys: bool) -> dict[str, np.ndarray]:
    """A prefill (or mixed) step's indices as int64 host arrays, built in numpy (one upload; about 40 small
    torch ops and copies before, each a GIL release and re-acquire beside the server's event loop): lens,
    cu [R+1] and slots of the R prefill rows; ids and positions of their n tokens then of the D decode rows;
    token_rows [n] (each token's request slot); decode_slots [D]; last [S + D] (the hidden rows to sample:
    each sampled prefill row's last token, then every decode row) and sample_slots (their request slots);
    kv_lens [R]. A decode row's id may be PENDING (the runner feeds it from ReqTable.last_tokens). with_keys
    and a row past its start (a cached prefix or an earlier chunk): kv_rows, kv_pos (the request slot and
    position of every key the rows attend to) and cu_k."""
    lens = np.fromiter((len(r.ids) for r in rows), np.int64, len(rows))
    starts = np.fromiter((r.start for r in rows), np.int64, len(rows))
    slots = np.fromiter((r.slot for r in rows), np.int64, len(rows))
    cu = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    n, d = int(cu[-1]), len(decode)
    ids = np.fromiter(itertools.chain(itertools.chain.from_iterable(r.ids for r in rows),
                                      (r.ids[0] for r in decode)), np.int64, n + d)
    positions = np.concatenate([np.arange(n, dtype=np.int64) - np.repeat(cu[:-1] - starts, lens),
                                np.fromiter((r.start for r in decode), np.int64, d)])
    sampled = np.fromiter((r.sample for r in rows), bool, len(rows))
    decode_slots = np.fromiter((r.slot for r in decode), np.int64, d)
    out = {"lens": lens, "cu": cu, "slots": slots, "ids": ids, "positions": positions,
           "token_rows": np.repeat(slots, lens), "decode_slots": decode_slots,
           "last": np.concatenate([(cu[1:] - 1)[sampled], n + np.arange(d, dtype=np.int64)]),
           "sample_slots": np.concatenate([slots[sampled], decode_slots]), "kv_lens": starts + lens}
    if with_keys and starts.any():
        kv_lens = out["kv_lens"]
        cu_k = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(kv_lens, out=cu_k[1:])
        out["kv_rows"] = np.repeat(slots, kv_lens)
        out["kv_pos"] = np.arange(int(cu_k[-1]), dtype=np.int64) - np.repeat(cu_k[:-1], kv_lens)
        out["cu_k"] = cu_k
    return out


def upload(arrays: dict[str, np.ndarray], device: torch.device,
           stage: Staging | None = None) -> dict[str, torch.Tensor]:
    """The int64 host arrays on `device`: a view each, by name, of one tensor. On a GPU one copy from
    `stage`'s pinned buffers (the runner's: required there); on the CPU the concatenation itself."""
    names = list(arrays)
    parts = [arrays[k] for k in names]
    ends = np.cumsum([len(a) for a in parts]).tolist()
    flat = (stage.copy(parts, ends[-1], device) if device.type == "cuda"
            else torch.from_numpy(np.concatenate(parts)))
    return {k: flat[e - len(arrays[k]):e] for k, e in zip(names, ends)}


def upload_array(a: np.ndarray, device: torch.device, staging: Staging | None) -> torch.Tensor:
    """An int64 (or int64-viewed) host array on `device`. On a GPU through the runner's pinned Staging buffers
    (reused once their copy has run; a pageable copy would wait for the overlapped step's forward, and a fresh
    pin_memory() a step costs milliseconds: Staging)."""
    if device.type != "cuda":
        return torch.from_numpy(a)
    if staging is None:  # a caller without the runner (GPU tests, compile-ahead's dry calls)
        return torch.from_numpy(a).pin_memory().to(device, non_blocking=True)
    return staging.copy([a], len(a), device)


class Staging(PinnedBuffers):
    """Pinned int64 host buffers that a step's inputs go up from (one owner: the runner; host memory, no GPU
    memory; engine.pinned's reuse rule). Under --tp 2 (2 H100s, c256) a fresh pin_memory() per prefill step
    cost 7.4-11.0 ms of the host's launch (with the prefix keys' indices in the upload; 0.34 ms without),
    unhidden where steps do not overlap."""

    def __init__(self, new_event: Callable[[], torch.cuda.Event] = torch.cuda.Event, pin_memory: bool = True):
        super().__init__(torch.int64, 16, pin_memory, new_event)

    def copy(self, parts: list[np.ndarray], n: int, device: torch.device) -> torch.Tensor:
        """The concatenated parts (n elements) on `device` (the current CUDA device: the event is recorded on
        its stream), copied from a pinned buffer."""
        i, buf = self.take(n)
        np.concatenate(parts, out=buf.numpy()[:n])
        flat = buf[:n].to(device, non_blocking=True)
        self.release(i)
        return flat
