"""Logprobs in OpenAI's two shapes (vLLM: _create_completion_logprobs and
_create_chat_logprobs).

The engine gives, per position, {token id: Logprob(logprob, rank, decoded_token)}
holding the chosen token and the request's top-k. Completions list tokens,
token_logprobs, top_logprobs (a dict per position: the top-k by rank plus the chosen
token, so up to k+1 entries, as OpenAI documents) and text_offset; chat lists, per
token, {token, logprob, bytes, top_logprobs: the top-k by rank}. -inf is reported
as -9999.0 (JSON has no infinity).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

MIN_LOGPROB = -9999.0


def _clamp(lp: float) -> float:
    return max(lp, MIN_LOGPROB)


class TokenText:
    """The text a token is shown as: its decoded piece, or 'token_id:N' when asked."""

    def __init__(self, decode_one: Callable[[int], str], as_token_ids: bool) -> None:
        self.decode_one = decode_one
        self.as_token_ids = as_token_ids

    def __call__(self, token_id: int, lp: Any = None) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        text = getattr(lp, "decoded_token", None)
        return text if text is not None else self.decode_one(token_id)


def _ranked(position: dict) -> list[tuple[int, Any]]:
    return sorted(position.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))


def completion_logprobs(token_ids: Sequence[int], positions: Sequence[Optional[dict]], num: int,
                        text_of: TokenText, initial_offset: int = 0) -> dict[str, list]:
    """positions[i] belongs to token_ids[i]; None for a position nothing predicts (the first
    prompt token when echoing)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = initial_offset
    for tid, pos in zip(token_ids, positions):
        lp = pos.get(tid) if pos else None
        token = text_of(tid, lp)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if pos is None or lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_clamp(lp.logprob))
        top = {text_of(t, p): _clamp(p.logprob) for t, p in _ranked(pos)[:num]}
        top.setdefault(token, _clamp(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[dict], num: int,
                  text_of: TokenText) -> dict[str, list]:
    content = []
    for tid, pos in zip(token_ids, positions):
        lp = pos.get(tid)
        token = text_of(tid, lp)
        top = [_entry(text_of(t, p), p.logprob) for t, p in _ranked(pos)[:num]] if num else []
        content.append({**_entry(token, lp.logprob if lp is not None else MIN_LOGPROB), "top_logprobs": top})
    return {"content": content}


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _clamp(logprob), "bytes": list(token.encode("utf-8", errors="replace"))}


def prompt_logprobs_json(positions: Optional[list]) -> Optional[list]:
    """vLLM's prompt_logprobs field: per prompt token None or {id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    return [None if pos is None else
            {str(t): {"logprob": _clamp(p.logprob), "rank": p.rank, "decoded_token": p.decoded_token}
             for t, p in pos.items()} for pos in positions]
