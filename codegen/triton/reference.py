"""numpy references the kernel tests use: they live in graph/ (the definition of
every op); re-exported here for the tests' imports."""
from kiln.graph.ops import attention_preamble  # noqa: F401
from kiln.graph.rope import rope_tables  # noqa: F401
