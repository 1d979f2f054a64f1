"""What each command does once its options are parsed: read, load, run, report (cli.py only parses and calls).

answer.py (summarize, ask, chat), ppl.py (perplexity), batches.py (many documents into a JSON-lines file), cache.py
(gali cache), serve.py (gali serve), common.py (what they share): those import torch. choices.py (what the command
line chose: ModelChoice and the rest) does not, so that the command line can build a ModelChoice, and refuse a bad
option, before anything heavy loads; nor does info.py (gali info), nor this file.
"""
