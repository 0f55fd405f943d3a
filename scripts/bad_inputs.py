"""Bad-input table (issue 11): every bad CLI input or config.json ends in exit 2 with the flag or the file and
key named, never a traceback; where the message says `try --flag VALUE`, that value is applied and must get
past validation (serve: exit 1 "no GPU here"; plan: exit 0).

    python3 scripts/bad_inputs.py              # in-process main([...]): fast, no GPU touched
    python3 scripts/bad_inputs.py --subprocess # each case as `python3 -m autoprofile.cli ...`
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoprofile import cli  # noqa: E402
from autoprofile.model_config import CONFIG_DIR  # noqa: E402


@dataclass
class Case:
    argv: list[str]
    named: list[str]  # what stderr must name: the flag, or the file and the key
    group: str


def flag_cases(report_file: str) -> list[Case]:
    s = lambda *a, named: Case(["serve", *a], [named], "serve flags")  # noqa: E731
    p = lambda *a, named: Case(["plan", *a], [named], "plan")  # noqa: E731
    return [
        s("--tp", "0", named="--tp"), s("--tp", "3", named="--tp"), s("--tp", "16", named="--tp"),
        s("--tp", "abc", named="--tp"), s("--tp", named="--tp"),
        s("--mem_fraction", "0", named="--mem_fraction"), s("--mem_fraction", "1.5", named="--mem_fraction"),
        s("--mem_fraction", "x", named="--mem_fraction"), s("--mem_fraction", "nan", named="--mem_fraction"),
        s("--mem-fraction", "-0.5", named="--mem_fraction"),
        s("--batch_max_tokens", "0", named="--batch_max_tokens"),
        s("--batch_max_tokens", "999999999999", named="--batch_max_tokens"),
        s("--batch_max_tokens", "1.5", named="--batch_max_tokens"),
        s("--graph_max_batch_size", "0", named="--graph_max_batch_size"),
        s("--graph_max_batch_size", "2048", named="--graph_max_batch_size"),
        s("--running_max_req_size", "0", named="--running_max_req_size"),
        s("--running_max_req_size", "100", named="--graph_max_batch_size"),
        s("--max_total_token_num", "0", named="--max_total_token_num"),
        s("--max_total_token_num", "1000", named="--max_total_token_num"),
        s("--max_total_token_num", "131072", "--max_req_total_len", "131072", named="--max_total_token_num"),
        s("--max_total_token_num", "131090", named="--max_total_token_num"),
        s("--max_total_token_num", "5000", "--max_req_total_len", "4096", named="--max_total_token_num"),
        s("--max_req_total_len", "1", named="--max_req_total_len"),
        s("--max_req_total_len", "200000", named="--max_req_total_len"),
        s("--attention_backend", "flash", named="--attention_backend"),
        s("--model", "tiny-hybrid", "--host_kv", "auto", named="--host_kv"),
        s("--model", "tiny-hybrid", "--deterministic", named="--deterministic"),
        s("--model", "tiny-hybrid", "--quantization", "fp8", named="--quantization"),
        s("--kv_cache_dtype", "fp8", named="--kv_cache_dtype"),
        s("--kv_cache_dtype", "float32", named="--kv_cache_dtype"),
        s("--kv_cache_dtype", "fp8_e4m3", "--attention_backend", "aiter", named="--kv_cache_dtype"),
        s("--kv_scales", "max", named="--kv_scales"),
        s("--dtype", "int8", named="--dtype"), s("--dtype", "float32", named="--dtype"),
        s("--page_size", "24", named="--page_size"), s("--page_size", "8", named="--page_size"),
        s("--page_size", "512", named="--page_size"), s("--page_size", "0", named="--page_size"),
        s("--canary_mb", "-1", named="--canary_mb"), s("--canary_mb", "999999999", named="--canary_mb"),
        s("--shrink_ratio", "1.0", named="--shrink_ratio"), s("--shrink_ratio", "0.1",
                                                              named="--shrink_ratio"),
        s("--max_retries", "-1", named="--max_retries"), s("--max_retries", "50", named="--max_retries"),
        s("--port", "70000", named="--port"), s("--port", "-1", named="--port"),
        s("--host", " ", named="--host"), s("--report_dir", report_file, named="--report_dir"),
        s("--model", "no-such-model", named="--model"),
        s("--model", "deepseek-v2-lite", "--attention_backend", "aiter", named="--attention_backend"),
        s("--model", "tiny", "--tp", "3", named="--tp"),
        s("--tp", "2", "--nnodes", "2", named="--dist_init_addr"),
        s("--tp", "3", "--nnodes", "2", "--dist_init_addr", "10.0.0.1:29500", named="--tp"),
        s("--tp", "2", "--nnodes", "2", "--dist_init_addr", "10.0.0.1:29500", "--node_rank", "2",
          named="--node_rank"),
        s("--tp", "2", "--nnodes", "2", "--dist_init_addr", "host0", named="--dist_init_addr"),
        s("--tp", "2", "--nnodes", "2", "--dist_init_addr", "10.0.0.1:29500", "--dist_timeout", "0",
          named="--dist_timeout"),
        s("--dist_init_addr", "10.0.0.1:29500", named="--dist_init_addr"),
        s("--model", "tiny", "--max_req_total_len", "8192", named="--max_req_total_len"),
        s("--mem-fractio", "0.9", named="did you mean --mem_fraction"),
        s("--mem", "0.9", named="did you mean --mem_fraction"),
        s("--max_total_tokens", "5", named="did you mean --max_total_token_num"),
        s("--graph-max-bs", "64", named="did you mean --graph_max_batch_size"),
        s("--disable_cudagraph", "true", named="--disable_cudagraph: takes no value"),
        s("--kv_cache_dtype", "fp8", named="did you mean fp8_e4m3?"),
        Case(["serv"], ["did you mean serve"], "command"), Case([], ["command"], "command"),
        p(named="--gpu"), p("--gpu", "h300", named="--gpu"),
        p("--gpu", "h100", "--gpu_memory_gib", "80", named="--gpu"),
        p("--gpu_memory_gib", "inf", named="--gpu_memory_gib"),
        p("--gpu_memory_gib", "nan", named="--gpu_memory_gib"),
        p("--gpu_memory_gib", "1e30", named="--gpu_memory_gib"),
        p("--gpu_memory_gib", "0", named="--gpu_memory_gib"),
        p("--gpu-memory-gib", "-5", named="--gpu_memory_gib"),
        p("--gpu_memory", "80", named="did you mean --gpu_memory_gib"),
        p("--gpu", "h100", "--host", "0.0.0.0", named="--host is a flag of `autoprofile serve`"),
        p("--gpu", "h100", "--mem_fraction", "0.000001", named="--mem_fraction"),
        p("--gpu", "h100", "--canary_mb", "60000", "--max_req_total_len", "131072", named="--canary_mb"),
        p("--gpu", "h100", "--batch_max_tokens", "1000000", named="--batch_max_tokens"),
        p("--gpu", "h100", "--attention_backend", "aiter", named="--attention_backend"),
        p("--gpu", "h100", "--max_total_token_num", "600000", named="--max_total_token_num"),
        p("--gpu_memory_gib", "24", "--max_req_total_len", "131072", named="--max_req_total_len"),
        p("--gpu_memory_gib", "14", named="--tp"),
        p("--gpu", "h100", "--tp", "2", "--nnodes", "4", named="--tp"),
        p("--gpu", "h100", "--model", "qwen3-30b-a3b", "--max_req_total_len", "262144",
          named="--max_req_total_len"),
    ]


TINY = json.loads((CONFIG_DIR / "tiny" / "config.json").read_text())
DEEPSEEK = TINY | {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"}
HYBRID = json.loads((CONFIG_DIR / "tiny-hybrid" / "config.json").read_text())
CONFIG_CASES = [  # (what is wrong, key named, config.json text)
    ("missing num_attention_heads", "num_attention_heads",
     {k: v for k, v in TINY.items() if k != "num_attention_heads"}),
    ("zero heads", "num_attention_heads", TINY | {"num_attention_heads": 0}),
    ("string heads", "num_attention_heads", TINY | {"num_attention_heads": "8"}),
    ("bool heads", "num_attention_heads", TINY | {"num_attention_heads": True}),
    ("fractional hidden_size", "hidden_size", TINY | {"hidden_size": 250.5}),
    ("negative layers", "num_hidden_layers", TINY | {"num_hidden_layers": -1}),
    ("kv heads do not divide heads", "num_key_value_heads", TINY | {"num_key_value_heads": 3}),
    ("hidden not a multiple of heads", "hidden_size",
     {k: v for k, v in (TINY | {"hidden_size": 260}).items() if k != "head_dim"}),
    ("string vocab_size", "vocab_size", TINY | {"vocab_size": "4096"}),
    ("max_position_embeddings 1", "max_position_embeddings", TINY | {"max_position_embeddings": 1}),
    ("string rms_norm_eps", "rms_norm_eps", TINY | {"rms_norm_eps": "1e-5"}),
    ("zero rope_theta", "rope_theta", TINY | {"rope_theta": 0}),
    ("string rope_scaling", "rope_scaling", TINY | {"rope_scaling": "llama3"}),
    ("unsupported rope type", "rope_scaling",
     TINY | {"rope_scaling": {"rope_type": "longrope", "factor": 4}}),
    ("yarn without its original context", "original_max_position_embeddings",
     TINY | {"rope_scaling": {"rope_type": "yarn", "factor": 4}}),
    ("unknown MoE topk_method", "topk_method",
     TINY | {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
             "topk_method": "noaux_tc"}),
    ("MLA with an odd rope dim", "qk_rope_head_dim",
     DEEPSEEK | {"kv_lora_rank": 64, "qk_rope_head_dim": 7, "qk_nope_head_dim": 16, "v_head_dim": 16}),
    ("MLA without v_head_dim", "v_head_dim", DEEPSEEK | {"kv_lora_rank": 64, "qk_rope_head_dim": 8,
                                                         "qk_nope_head_dim": 16}),
    ("DeepSeek-V2 without kv_lora_rank", "kv_lora_rank", DEEPSEEK),
    ("string rope factor", "factor", TINY | {"rope_scaling": {"rope_type": "llama3", "factor": "8"}}),
    ("string bool", "tie_word_embeddings", TINY | {"tie_word_embeddings": "yes"}),
    ("architectures not a list", "architectures", TINY | {"architectures": "LlamaForCausalLM"}),
    ("zero intermediate_size", "intermediate_size", TINY | {"intermediate_size": 0}),
    ("MoE with 0 experts per token", "num_experts_per_tok",
     TINY | {"num_experts": 8, "num_experts_per_tok": 0, "moe_intermediate_size": 64}),
    ("hybrid layer type not served", "layer_types",
     HYBRID | {"layer_types": ["linear_attention", "mamba2", "linear_attention", "full_attention"]}),
    ("hybrid state dtype not served", "mamba_ssm_dtype", HYBRID | {"mamba_ssm_dtype": "float64"}),
    ("hybrid value heads not a multiple of key heads", "linear_num_value_heads",
     HYBRID | {"linear_num_value_heads": 3}),
    ("JSON syntax error", "not valid JSON", "{"),
    ("trailing comma", "not valid JSON", '{"hidden_size": 256,}'),
    ("empty file", "not valid JSON", ""),
    ("a list, not an object", "JSON object", "[1, 2]"),
    ("invalid UTF-8", "cannot be read", b"\xff\xfe{}"),
]


def config_cases(tmp: Path) -> list[Case]:
    out = []
    for i, (what, key, content) in enumerate(CONFIG_CASES):
        folder = tmp / f"cfg{i}"
        folder.mkdir()
        file = folder / "config.json"
        if isinstance(content, bytes):
            file.write_bytes(content)
        else:
            file.write_text(content if isinstance(content, str) else json.dumps(content))
        command = ["plan", "--gpu", "h100"] if i % 2 else ["serve"]
        out.append(Case([*command, "--model", str(folder)], [str(file), key], f"config.json: {what}"))
    (tmp / "dir_config" / "config.json").mkdir(parents=True)
    out.append(Case(["serve", "--model", str(tmp / "dir_config")], ["--model", "no config.json"],
                    "config.json: a folder"))
    (tmp / "empty_folder").mkdir()
    out.append(Case(["serve", "--model", str(tmp / "empty_folder")], ["--model", "no config.json"],
                    "config.json: missing"))
    return out


def run_in_process(argv: list[str]) -> tuple[int, str, bool]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = cli.main(argv)
        except BaseException:  # noqa: BLE001 - the thing we count
            return -1, err.getvalue() + traceback.format_exc(), True
    return rc, err.getvalue(), "Traceback (most recent call last)" in err.getvalue()


def run_subprocess(argv: list[str]) -> tuple[int, str, bool]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-m", "autoprofile.cli", *argv], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    return out.returncode, out.stderr, "Traceback (most recent call last)" in out.stderr


def suggestion(argv: list[str], err: str) -> list[str] | None:
    """argv with the `try --flag VALUE` of the message applied, if it has one."""
    m = re.search(r"try (--\w+) (\S+?)[;,)]?(\s|$)", err)
    if not m:
        return None
    flag, value = m.group(1), m.group(2)
    out, skip = [], False
    for i, a in enumerate(argv):  # drop the flag's earlier value (either spelling)
        if skip:
            skip = False
            continue
        if a.replace("-", "_").lstrip("_") == flag.lstrip("-"):
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(a)
    return [*out, flag, value]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--subprocess", action="store_true", help="run each case as its own process")
    args = ap.parse_args()
    run = run_subprocess if args.subprocess else run_in_process
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "a_file").write_text("not a folder")
        cases = flag_cases(str(tmp / "a_file")) + config_cases(tmp)
        rows, n_exit2, n_named, n_tb, n_sugg, n_sugg_ok = [], 0, 0, 0, 0, 0
        for c in cases:
            rc, err, tb = run(c.argv)
            named = all(n in err for n in c.named)
            ok = rc == 2 and named and not tb
            n_exit2 += rc == 2
            n_named += rc == 2 and named
            n_tb += tb
            fixed = suggestion(c.argv, err) if ok else None
            sugg = "-"
            if fixed is not None:
                n_sugg += 1
                frc, ferr, _ = run(fixed)
                good = frc == (0 if fixed and fixed[0] == "plan" else 1)
                n_sugg_ok += good
                last = ferr.strip().splitlines()[-1][:80] if ferr.strip() else ""
                sugg = "works" if good else f"FAILS (exit {frc}: {last})"
            first = err.strip().splitlines()[0] if err.strip() else ""
            rows.append((("ok" if ok else "BAD"), rc, c.group, " ".join(c.argv)[:60], sugg, first[:110]))
    print(f"{'':4} {'rc':>3}  {'group':<34} {'argv':<60}  {'suggestion':<10}  message")
    for r in rows:
        print(f"{r[0]:<4} {r[1]:>3}  {r[2]:<34} {r[3]:<60}  {r[4]:<10}  {r[5]}")
    total = len(rows)
    print(f"\n{total} bad inputs: {n_exit2} exit 2, {n_named} exit 2 naming the flag or file+key, "
          f"{n_tb} tracebacks; {n_sugg} messages carry a `try --flag VALUE`, {n_sugg_ok} of those values "
          "pass validation when applied")
    return 0 if n_named == total and n_tb == 0 and n_sugg_ok == n_sugg else 1


if __name__ == "__main__":
    sys.exit(main())
