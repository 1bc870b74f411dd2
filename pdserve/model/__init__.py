"""pdserve.model: Llama-family models on a paged KV cache.

- `loader.load_model(model=None, dtype="auto", device="auto") -> LoadedModel`: the default
  SmolLM2 GGUF, any .gguf (llama/qwen2) or a Hugging Face folder; errors are `ModelLoadError`.
- `tokenizer.Tokenizer`: encode/decode and the chat template, as transformers does them.
- `llama.LlamaForCausalLM`: `forward(input_ids, positions, kv_cache, attn_metadata)` over a
  flat batch mixing prefill chunks and decodes; `compute_logits(hidden)`.
- `attention.AttentionMetadata.build(...)`, `kv_cache.allocate_kv_cache(...)`,
  `kv_cache.kv_bytes_per_token(...)`.
- `export_hf.export_hf(gguf_path, out_dir, dtype)`: a GGUF as a Hugging Face folder.

Submodules import torch; import them directly (this package imports nothing eagerly).
"""
