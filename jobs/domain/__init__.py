"""The control plane's vocabulary, with no I/O: run and attempt states, errors, severity, who is
asking, where checkpoints may live, and how figures are written.
"""
