"""The waiting queue, ordered per scheduling policy.

Ported in behaviour from vLLM V1 `vllm/v1/core/sched/request_queue.py`
(`SchedulingPolicy`, `RequestQueue`, `FCFSRequestQueue`,
`PriorityRequestQueue`, `create_request_queue`).
"""
from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator

from kiln.runtime.core.request import Request


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue:
    """add/pop/peek at the head; prepend puts a request back where it will be
    taken next (preempted requests, requests skipped this step)."""

    def add_request(self, request: Request) -> None:
        raise NotImplementedError

    def pop_request(self) -> Request:
        raise NotImplementedError

    def peek_request(self) -> Request:
        raise NotImplementedError

    def prepend_request(self, request: Request) -> None:
        raise NotImplementedError

    def prepend_requests(self, requests: RequestQueue) -> None:
        raise NotImplementedError

    def remove_request(self, request: Request) -> None:
        raise NotImplementedError

    def remove_requests(self, requests: Iterable[Request]) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Request]:
        """In the order requests would be popped."""
        raise NotImplementedError


class FCFSRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._q.append(request)

    def pop_request(self) -> Request:
        return self._q.popleft()

    def peek_request(self) -> Request:
        if not self._q:
            raise IndexError("peek from an empty queue")
        return self._q[0]

    def prepend_request(self, request: Request) -> None:
        self._q.appendleft(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        # Keep their order: the first of `requests` ends up at the head.
        self._q.extendleft(reversed(list(requests)))

    def remove_request(self, request: Request) -> None:
        self._q.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = set(map(id, requests))
        self._q = deque(r for r in self._q if id(r) not in drop)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityRequestQueue(RequestQueue):
    """Min-heap on (priority, arrival_time): lower priority value first, then
    earlier arrival. Prepending is just adding: the heap decides the order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        # Tie-breaker so requests themselves are never compared.
        self._counter = itertools.count()

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[-1]

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][-1]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        for r in requests:
            self.add_request(r)

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = set(map(id, requests))
        self._heap = [e for e in self._heap if id(e[-1]) not in drop]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy == SchedulingPolicy.FCFS:
        return FCFSRequestQueue()
    if policy == SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy: {policy}")
