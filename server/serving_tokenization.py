"""POST /tokenize and /detokenize in vLLM's shapes (vLLM: OpenAIServingTokenization).

/tokenize takes {"prompt": text} or {"messages": [...]} (rendered with the chat
template as /v1/chat/completions would) and answers {"count", "max_model_len",
"tokens", "token_strs"}; /detokenize takes {"tokens": [...]} and answers {"prompt"}.
"""
from __future__ import annotations

from kiln.server.errors import bad_request
from kiln.server.protocol import check_field, parse_chat_request
from kiln.server.serving_chat import render_prompt
from kiln.server.serving_engine import OpenAIServingHandler


class TokenizeHandler(OpenAIServingHandler):
    async def post(self) -> None:
        body = await self.read_json()
        engine = self.state.engine
        if engine.tokenizer is None:
            raise bad_request("This model was loaded without a tokenizer.")
        if "messages" in body:
            req = parse_chat_request({**body, "stream": False}, self.state.config.limits)
            self.check_request(req)
            text = await self.state.run_sized(self._body_size, render_prompt, self.state, req)
            ids = await self._encode(text, req.add_special_tokens)
        else:
            prompt = check_field(body, "prompt", "str")
            if prompt is None:
                raise bad_request("prompt (a string) or messages is required.", "prompt")
            model = check_field(body, "model", "str")
            if model is not None:
                self.check_model_name(model)
            add_special = check_field(body, "add_special_tokens", "bool")
            ids = await self._encode(prompt, True if add_special is None else add_special)
        strs = None
        if check_field(body, "return_token_strs", "bool"):
            strs = [engine.tokenizer.id_to_token(t) for t in ids]
        self.write_json({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                         "token_strs": strs})


    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Every id, past the context too (the count is the answer), on a worker thread when long."""
        tok = self.state.engine.tokenizer
        return await self.state.run_sized(len(text) * 4, tok.encode_long, text, add_special_tokens)


class DetokenizeHandler(OpenAIServingHandler):
    async def post(self) -> None:
        body = await self.read_json()
        engine = self.state.engine
        tokens = check_field(body, "tokens", "ints")
        if tokens is None:
            raise bad_request("tokens (a list of token ids) is required.", "tokens")
        model = check_field(body, "model", "str")
        if model is not None:
            self.check_model_name(model)
        if engine.tokenizer is None:
            raise bad_request("This model was loaded without a tokenizer.")
        ids = await self.tokenize(tokens, False, "tokens")
        self.write_json({"prompt": engine.decode(ids, skip_special_tokens=False)})
