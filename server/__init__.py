"""The OpenAI-compatible HTTP server on Tornado (`python build.py serve`).

server.app.make_app(AsyncLLM, ServerConfig) builds the application; server.api_server
runs it. Handlers talk to the engine only through kiln.runtime's request and output
dataclasses.
"""
