"""A request as the engine core tracks it: tokens so far, progress, status.

Ported in behaviour from vLLM V1 `vllm/v1/request.py` (`Request`,
`RequestStatus`) and `vllm/v1/engine/__init__.py` (`FinishReason`).

`sampling_params` is any object with `max_tokens`, `min_tokens`, `ignore_eos`,
`stop_token_ids` (and `n`, which the frontend fans out into `n` requests
before they reach the engine core). The fields the stop check needs are read
once here, so the per-token check touches no attribute lookups on it.
"""
from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kiln.runtime.core.kv_cache_utils import BlockHash


class FinishReason(enum.IntEnum):
    """Why a request finished, as the API reports it ("stop", "length", "abort", "error")."""

    STOP = 0  # EOS or a stop token (stop strings are the detokenizer's)
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # finished from outside (client gone, error)
    ERROR = 3  # the engine could not run it (vLLM's FinishReason.ERROR); stop_reason says why

    def __str__(self) -> str:
        return self.name.lower()


class RequestStatus(enum.IntEnum):
    """Order matters: every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASON.get(status)


_FINISHED_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}

# max_tokens=None means "until max_model_len".
_UNBOUNDED = 1 << 62


class Request:
    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: Any,
                 eos_token_id: int | Iterable[int] | None = None, arrival_time: float | None = None,
                 priority: int = 0, block_hasher: Callable[[Request], list[BlockHash]] | None = None,
                 cache_salt: str | None = None, client_index: int = 0) -> None:
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority  # lower value = scheduled first (PRIORITY policy)
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.sampling_params = sampling_params
        self.cache_salt = cache_salt
        if eos_token_id is None:
            self.eos_token_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = frozenset((eos_token_id,))
        else:
            self.eos_token_ids = frozenset(eos_token_id)

        max_tokens = getattr(sampling_params, "max_tokens", None)
        self.max_tokens: int = _UNBOUNDED if max_tokens is None else int(max_tokens)
        self.min_tokens: int = int(getattr(sampling_params, "min_tokens", 0) or 0)
        self.ignore_eos: bool = bool(getattr(sampling_params, "ignore_eos", False))
        self.stop_token_ids: frozenset[int] = frozenset(getattr(sampling_params, "stop_token_ids", None) or ())
        # read per step by the scheduler (prompt-logprobs chunks want a logits row per token)
        self.prompt_logprobs: int | None = getattr(sampling_params, "prompt_logprobs", None)
        # Tokens that may end the request once min_tokens are out: check_stop runs only for
        # these, at a length limit, or below min_tokens (stop_check.might_stop).
        self.stop_check_ids: frozenset[int] = self.stop_token_ids | (
            frozenset() if self.ignore_eos else self.eos_token_ids)

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id that finished it, if any
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # Plain attributes (read per request per step): read-only by convention, mutate
        # through append_output_token_ids.
        self.output_token_ids: list[int] = []  # generated tokens
        self.all_token_ids: list[int] = list(self.prompt_token_ids)  # prompt + generated tokens
        self.num_computed_tokens = 0  # tokens whose KV is (or is being) written
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until then
        self.num_preemptions = 0
        # Async scheduling: tokens of scheduled steps that will sample one for this request and
        # whose results have not come back yet (always 0 without async scheduling).
        self.num_output_placeholders = 0

        self.block_hashes: list[BlockHash] = []
        self.block_hasher: Callable[[Request], list[BlockHash]] | None = None
        self._hash_block_size: int | None = None
        if block_hasher is not None:
            self.set_block_hasher(block_hasher)

    def set_block_hasher(self, block_hasher: Callable[[Request], list[BlockHash]]) -> None:
        """Attach the hasher (the scheduler does, with its block size) and hash
        the full blocks present now; later blocks are hashed as tokens arrive."""
        self.block_hasher = block_hasher
        # A hasher that says its block size is called only once a new block is full.
        self._hash_block_size: int | None = getattr(block_hasher, "block_size", None)
        self.block_hashes = []
        self.block_hashes.extend(block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            token_ids = list(token_ids)
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)
        if self.block_hasher is not None and (
                self._hash_block_size is None
                or (len(self.block_hashes) + 1) * self._hash_block_size <= len(self.all_token_ids)):
            self.block_hashes.extend(self.block_hasher(self))

    def append_output_token_id(self, token_id: int) -> None:
        """append_output_token_ids for one token (every decode step of every request)."""
        self.output_token_ids.append(token_id)
        all_ids = self.all_token_ids
        all_ids.append(token_id)
        if self.block_hasher is not None and (
                self._hash_block_size is None
                or (len(self.block_hashes) + 1) * self._hash_block_size <= len(all_ids)):
            self.block_hashes.extend(self.block_hasher(self))

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
