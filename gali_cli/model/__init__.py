"""The model layer: finding, checking and loading a Llama, and what the machine offers it.

- config.py: where a model named on the command line is, and its config read and checked without torch (gali info).
- gguf.py: GGUF files recognised, checked and identified from their header, before transformers reads them.
- chat_template.py: the model's chat template, rendered in a sandbox bounded in time and memory.
- dequantized.py: GGUF models dequantized once and kept in the user cache (gali cache lists and prunes them).
- machine.py: torch's build, the GPUs and libraries, device and dtype choices.
- loading.py: the model and tokenizer loaded as the command line asks (the only module here that needs torch).
"""
