"""The Tornado application: routes, and the handlers for what no route matches.

    POST /v1/completions, /v1/chat/completions    generation (OpenAI's API + vLLM's extras)
    GET  /v1/models, /v1/models/{id}              the served model
    POST /tokenize, /detokenize                   vLLM's tokenizer endpoints
    GET  /health, /version, /metrics              operations (no API key, as vLLM)
    GET  /openapi.json                            every route and body above (server/openapi.py)

Every error is JSON in OpenAI's shape: unknown route 404, wrong method 405, body over
the limit 413, bad or missing API key 401 (on /v1/* and the tokenizer endpoints).
"""
from __future__ import annotations

from typing import Optional

import tornado.web

from kiln.server.base_handler import NotFoundHandler
from kiln.server.metrics import MetricsHandler, PrometheusStatLogger
from kiln.server.openapi import OpenAPIHandler
from kiln.server.serving_chat import ChatCompletionHandler
from kiln.server.serving_completion import CompletionHandler
from kiln.server.serving_health import HealthHandler, VersionHandler
from kiln.server.serving_models import ModelHandler, ModelsHandler
from kiln.server.serving_tokenization import DetokenizeHandler, TokenizeHandler
from kiln.server.state import ServerConfig, ServerState


def make_metrics(engine, config: ServerConfig) -> PrometheusStatLogger:
    """A Prometheus logger subscribed to the engine, with its own registry."""
    args = getattr(engine, "args", None)
    cache_info = None
    if args is not None:
        blocks = engine.engine.core.snapshot()["num_total_blocks"]
        cache_info = {"block_size": str(args.block_size), "num_gpu_blocks": str(blocks),
                      "enable_prefix_caching": str(args.enable_prefix_caching)}
    metrics = PrometheusStatLogger(config.served_model_names[0], max_model_len=engine.max_model_len,
                                   max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),
                                   cache_info=cache_info)
    engine.add_stat_logger(metrics)
    return metrics


def make_app(engine, config: Optional[ServerConfig] = None, **settings) -> tornado.web.Application:
    """The app serving `engine` (an AsyncLLM). Several apps may share one engine; each has
    its own metrics registry."""
    if config is None:
        config = ServerConfig(served_model_names=("kiln",))
    state = ServerState(engine=engine, config=config, metrics=make_metrics(engine, config))
    s = {"state": state}
    routes = [
        (r"/v1/completions", CompletionHandler, s),
        (r"/v1/chat/completions", ChatCompletionHandler, s),
        (r"/v1/models", ModelsHandler, s),
        (r"/v1/models/(.+)", ModelHandler, s),
        (r"/tokenize", TokenizeHandler, s),
        (r"/detokenize", DetokenizeHandler, s),
        (r"/health", HealthHandler, s),
        (r"/version", VersionHandler, s),
        (r"/metrics", MetricsHandler, s),
        (r"/openapi.json", OpenAPIHandler, s),
    ]
    app = tornado.web.Application(routes, default_handler_class=NotFoundHandler, default_handler_args=s,
                                  serve_traceback=False, compress_response=False, **settings)
    app.state = state
    return app
