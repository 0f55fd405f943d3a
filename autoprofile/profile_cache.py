"""The profile cache: an earlier probe's measurement, reused by a later boot of the very same build.

A probe measures what does not depend on the KV size: the non-KV peak (weights, activations of the stress's
corners, graph pools) and this process's non-torch memory (CUDA context, local memory the stress's kernels
reserved). Both follow from the code, the GPU and the flags that shape the envelope, so a later boot with all
of them equal measures the same figures. Such a boot skips the probe: it sizes from the entry and the GPU's
state now (free memory, peers), then rebuilds and validates at the target exactly as after a probe (the canary
held, the stress rerun, a 5% shrink on OOM). A boot whose validation needed a shrink drops the entry, so the
next boot probes again. The key covers every source file of autoprofile/ and models/, the model's
config, the budget flags, the allocator's environment (MEASURED_ENV), the GPU (name, memory, compute
capability), torch / CUDA / Triton / AITER versions, and this rank of the TP group. Pure file IO, no torch:
the runner supplies the GPU's fingerprint.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
# Flags that do not change what a probe measures (serving-side, applied after the measurement, or the cache's
# own)
NOT_MEASURED = frozenset({"host", "port", "max_waiting_requests", "stream_interval", "seed", "report_dir",
                          "profile_dir", "engine_process",
                          "allowed_media_domains", "tokenizer",
                          "mem_fraction", "shrink_ratio", "max_retries", "max_total_token_num",
                          "profile_cache", "served_model_name", "api_key", "reasoning_parser",
                          "host_kv",  # pinned host memory: the copies add no GPU memory
                          "max_waiting_steps", "waiting_served_ratio",  # when requests join: the envelope's
                          # limits stay the same
                          "node_rank", "dist_init_addr", "dist_timeout",  # the key holds the global rank
                          "device"})  # only --device cuda probes (autoprofile.cpu measures nothing)
# The environment that changes what a probe measures: the caching allocator's settings (expandable segments,
# split sizes, garbage collection: the reserved peak) and CUDA's module loading (the context's memory)
MEASURED_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
                "PYTORCH_NO_CUDA_MEMORY_CACHING", "CUDA_MODULE_LOADING")


def default_folder() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "autoprofile", "profiles")


@dataclass(frozen=True)
class Entry:
    non_kv_peak: int
    own_non_torch: int
    probe_tokens: int
    probe_sized: int
    measured_at: str  # ISO time of the probe


@functools.cache
def code_hash() -> str:
    """sha256 over every .py file of autoprofile/ and models/ (path and bytes): any change of the code probes
    again."""
    h = hashlib.sha256()
    for folder in ("autoprofile", "models"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def key(cfg, model_config, fingerprint: dict, rank: int, world_size: int,
        env: Mapping[str, str] | None = None) -> str:
    """The entry's name: a hash of everything a probe's measurement depends on (env: os.environ)."""
    flags = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in NOT_MEASURED}
    model = {f.name: getattr(model_config, f.name) for f in dataclasses.fields(model_config)}
    env = os.environ if env is None else env
    material = {"flags": flags, "model": model, "gpu": fingerprint, "rank": rank, "world_size": world_size,
                "code": code_hash(), "env": {name: env.get(name) for name in MEASURED_ENV}}
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:32]


def load(folder: str, name: str) -> Entry | None:
    path = Path(folder) / f"{name}.json"
    try:
        return Entry(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:  # unreadable or from another version: probe again
        log.warning("profile cache entry %s is unreadable (%s): probing", path, e)
        return None


def store(folder: str, name: str, entry: Entry) -> None:
    """Written atomically; a cache that cannot be written is a warning (the boot itself succeeded)."""
    path = Path(folder) / f"{name}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(entry), indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        log.warning("profile cache %s not written (%s): the next boot probes again", path, e)


def drop(folder: str, name: str) -> None:
    try:
        (Path(folder) / f"{name}.json").unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("profile cache entry %s not removed (%s)", name, e)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
