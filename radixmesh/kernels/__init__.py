"""Triton kernels of the engine, each with a plain-torch reference twin (`*_reference`) that its tests compare with.
"""
