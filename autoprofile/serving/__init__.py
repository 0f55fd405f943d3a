"""The HTTP serving layer: tokenizer, OpenAI wire format, the async wrapper around the engine loop."""
