"""The length-extrapolation methods gali runs a model with, behind one interface (every command's --method).

Each method is one module here, written against the contract of engine/contract.py: its attention, how its
settings resolve for an input and what it installs (a `Method`, method.py); windowed.py holds the attention split
at a distance that the windowed methods share. `registry.py` lists them by name without importing them, and
everything else (the CLI, `gali info`, docs/methods.md's table, the tests) derives from it. Installing is not done
here: `gali_cli.patching` puts a method into a loaded model through the seam (engine/seam/hooks.py), so no file in
methods/ imports the modules that hook transformers.
"""
