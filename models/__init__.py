"""Model definitions (Llama-family decoders) and their HF-style config.json files."""
