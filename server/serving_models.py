"""GET /v1/models and /v1/models/{id} (vLLM: OpenAIServingModels.show_available_models)."""
from __future__ import annotations

from typing import Any

from kiln.server.base_handler import BaseHandler
from kiln.server.errors import APIError


def model_card(state, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "kiln",
            "root": state.config.model_root or name, "parent": None,
            "max_model_len": state.engine.max_model_len}


class ModelsHandler(BaseHandler):
    requires_auth = True

    def get(self) -> None:
        self.write_json({"object": "list",
                         "data": [model_card(self.state, n) for n in self.state.config.served_model_names]})


class ModelHandler(BaseHandler):
    requires_auth = True

    def get(self, name: str) -> None:
        if name not in self.state.config.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        self.write_json(model_card(self.state, name))
