"""The GPU kernels: each module holds a Triton kernel (or AITER's, loaded by aiter_loader) and its launcher.
Below the engine: the attention backends (engine.attention) and the sampler (engine.sampling) call them, a
kernel imports no module of the engine (scripts/import_graph.py enforces it). This package's __init__
imports none of them: a kernel module imports triton, and is imported when a backend is built.

The torch reference each kernel matches is the path the torch backend runs, so it stays with its callers;
each kernel's CPU test (unit_tests/, through Triton's interpreter) checks the kernel against it:

  module           launcher: what                      torch reference                   unit_tests/
  triton_act       silu_mul: SiLU * up                 layers.attention.AttentionBackend test_triton_act
  triton_norm      rms_norm: RMSNorm                   layers.attention.AttentionBackend test_triton_norm
  triton_rope      rope_store: RoPE + KV-cache store   layers.attention.AttentionBackend test_triton_rope
  triton_gemv      linear: one-row GEMV                torch.nn.functional.linear        test_triton_gemv
  triton_matmul    linear: batch-invariant GEMM        torch.nn.functional.linear        test_deterministic
  triton_fp8       linear: FP8 quant, GEMV, GEMM       layers.quant                      test_triton_fp8
  triton_fp8_skinny gemm: FP8 weights at 2-64 rows    layers.quant                      test_triton_fp8_
                   (split-K, TMA and a8 launches)                                        skinny(_variants)
  triton_fp8_rows  gemv: FP8 weights at 2-16 rows     layers.quant                      test_triton_fp8_rows
  triton_route     route_topk: MoE router              layers.moe.route                  test_triton_route
                   biased_grouped_topk: noaux_tc      layers.moe.biased_grouped_topk    test_triton_route_
                                                                                          grouped
  triton_moe_sort  sort_by_expert: expert sort         layers.moe.sort_by_expert         test_triton_moe_sort
  triton_moe       fused_moe: AITER's fused experts    layers.moe.moe_reference          test_triton_moe
  triton_moe_gemv  experts: the experts as GEMVs       layers.moe.moe_reference          test_triton_moe_gemv
                   at a few (token, slot) pairs
  triton_mla       mla_decode: MLA absorbed decode     engine.attention.torch_sdpa       test_triton_mla
  triton_prefill   prefill: varlen prefill attention   engine.attention.torch_sdpa       test_triton_prefill
  triton_reduce    reduce_partitions: split decode     float64 attention (in its test)   test_triton_reduce
  triton_unified   attention: AITER's, batch-invariant engine.attention.torch_sdpa       test_deterministic
  triton_sample    sample_batch: the one-kernel sampler engine.sampling (torch path)     test_triton_sample
                   and the split top-k path                                              (and _topk)
  triton_argmax    argmax: greedy, several programs a row torch.argmax                   test_triton_argmax
  triton_bitmask   apply_bitmask_: structured output's engine.grammar.mask_logits_      test_triton_bitmask
                   token mask, in place               (and xgrammar's, in the test)
  triton_kv_copy   copy_pages: KV pages GPU <-> host     engine.host_kv.HostKVPool._copy   test_triton_kv_copy
  triton_decode    decode: split-KV paged decode         float64 attention (in its test)   test_triton_decode
  pdl              launch, begin: dependent launch      (none: a launch attribute)        test_pdl (GPU:
                   (Hopper), a kernel's wait + signal                                      test_pdl_gpu)
  aiter_loader     AITER's Triton modules without its ROCm-only package __init__        test_unspecialize
  compile_ahead    CompileAhead: a boot's Triton compiles  (none: compiles only)         test_compile_ahead
                   in a pool; dry (compile-only) launches                                  (GPU: the same)
"""
