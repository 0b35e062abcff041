"""The OpenAI-compatible server: HTTP handlers (`app`), a scheduler with no device code (`scheduler`), and one
engine thread that owns the device (`worker`); the tokenizer and chat template (`tokenizer`), stop strings and
the Qwen reasoning/tool-call format (`text`), metrics (`metrics`). Start it with `python -m fnx.serve`."""
