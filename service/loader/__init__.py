"""The model side of hoist: ggml types, GGUF reading, the weights index, loading."""
