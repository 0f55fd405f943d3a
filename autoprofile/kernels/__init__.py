"""The GPU kernels: Triton kernels with their launchers, and the AITER loader. Below the engine."""
