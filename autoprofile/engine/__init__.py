"""The engine: KV pool, request table, model runner, decode CUDA graphs, attention backends."""
