"""The library's front door, above the engine (vLLM keeps its LLM in vllm/entrypoints/).

`LLM` and `AsyncLLM.from_engine_args` take a model path: they call kiln.loader
(open, build the graph, run the passes, compile or read the bundle, load weights)
and hand what it produced to the engine classes of kiln.runtime, which never
import the loader themselves. build.py and server/ build on this package.
"""
