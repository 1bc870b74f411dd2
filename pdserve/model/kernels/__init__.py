"""Native CPU kernels, compiled on first use with the system C compiler and cached.

Each kernel is optional: where no compiler or no suitable CPU is found, callers fall back to
plain torch ops.
"""
