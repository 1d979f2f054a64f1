"""What more than one test module uses: builders, constants and fixtures shared by import (`from helpers.x import
y`; tests/ is on pytest's pythonpath). A test module imports only these, conftest's fixtures and gali_cli, never
another test module. Fixtures every test gets, or that most tests ask for by name, stay in tests/conftest.py.

- paths: the repository's root and tests/data.
- tiny_models: the tiny random Llama's tokenizer, chat template, corpus and token ids; a model saved to disk.
- gguf_files: GGUF files written at test time as llama.cpp's converter lays them out.
- caches: a cache directory's contents, a write stopped by kill -9, backdating a temporary.
- attention: random queries, keys and values and a RoPE table for the attention kernels' tests.
- decoding: a prefilled cache for the static decoding step, and the step held to the model's own forward.
- methods: a method's logits fed in several forwards, greedy decoding, Llama 3's architecture.
- documents: PDFs written at test time.
- commands: the `gali` command run in-process, and a document to run it on.
- server: a gali server in this process or as a process, and its clients.
- timing: waits scaled by how slow the machine is now.
- terminal: gali in a pseudo-terminal, its screen drawn by a terminal emulator.
- interrupts: one SIGINT stops a test run, however it was started (conftest imports its hook).
"""
