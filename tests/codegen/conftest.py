"""tests/codegen runs Triton kernels under the interpreter (TRITON_INTERPRET=1, CPU).

Triton picks interpret-or-compile once, when it is first imported, so the variable
is set here, before any test module imports triton. (pytest collects this folder
before the test_*.py files beside it, so a plain `pytest` run gets it in time; a run
that imports triton earlier skips the interpreter tests with a reason.) The AOT
tests compile in a child process without the variable (codegen/triton/aot.py).
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
