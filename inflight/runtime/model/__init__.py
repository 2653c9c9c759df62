"""Our own Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, and the Qwen3-MoE and Mixtral
mixtures of experts) over packed token batches."""
