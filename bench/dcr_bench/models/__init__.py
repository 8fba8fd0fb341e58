"""Models the demo, the benchmark and the tests refit: a small Llama trained with AdamW, a vLLM-style Llama."""
