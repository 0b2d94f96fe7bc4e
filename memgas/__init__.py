"""memgas: a batch pipeline for MemGAS multi-granularity conversational memory.

The distribution maps three folders under this namespace (see pyproject.toml):
``memgas.pipeline`` -> ``pipeline/``, ``memgas.kernels`` -> ``kernels/``, ``memgas.jobs`` -> ``jobs/``.
"""

__version__ = "0.1.0"
