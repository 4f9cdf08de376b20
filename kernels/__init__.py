"""Triton kernels of the engine, each with a plain-torch reference twin (`*_reference`) that its tests compare with.

No `__version__` here: Hugging Face transformers probes for a package named `kernels` and must not find ours usable.
"""
