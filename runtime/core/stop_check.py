"""Token-level stop conditions, checked after each appended token.

Ported in behaviour from vLLM V1 `vllm/v1/core/sched/utils.py::check_stop`.
Stop *strings* need text and are the detokenizer's job; it ends a request
through `Scheduler.finish_requests(..., FINISHED_STOPPED)`.
"""
from __future__ import annotations

from kiln.runtime.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the request's finished status if its last token ends it; -> whether it did.

    Order (as vLLM): below min_tokens nothing but the length limit stops it;
    then EOS (unless ignore_eos), then stop token ids (recorded as
    stop_reason), then max_tokens / max_model_len."""
    output = request.output_token_ids
    num_output = len(output)
    num_tokens = request.num_prompt_tokens + num_output  # request.num_tokens, without the property
    if num_output < request.min_tokens:
        if num_tokens >= max_model_len:
            # vLLM lets min_tokens win here, which would grow a request past the KV
            # cache; max_model_len is a hard limit in kiln.
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
    last = output[-1]
    if not request.ignore_eos and last in request.eos_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in request.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    if num_tokens >= max_model_len or num_output >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def append_and_check_stop(request: Request, new_token_ids: list[int], max_model_len: int) -> bool:
    """Append sampled tokens one by one, checking after each; on a stop, drop
    the tokens after it from new_token_ids (in place). -> whether it stopped.
    (vLLM: `Scheduler._update_request_with_output`.)"""
    if len(new_token_ids) == 1:  # the usual step: nothing to drop after a stop
        token_id = new_token_ids[0]
        request.append_output_token_id(token_id)
        num_output = len(request.output_token_ids)
        # check_stop only where it can say yes (the usual token is no stop token, below every limit)
        if (token_id in request.stop_check_ids or num_output < request.min_tokens
                or num_output >= request.max_tokens
                or request.num_prompt_tokens + num_output >= max_model_len):
            return check_stop(request, max_model_len)
        return False
    for n, token_id in enumerate(new_token_ids, 1):
        request.append_output_token_ids(token_id)
        if check_stop(request, max_model_len):
            del new_token_ids[n:]
            return True
    return False
