"""Our own Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over packed token batches."""
