"""Random workloads through schedule() / update_from_output() with a fake model.

Each example draws a scheduler (block size, a small block count, budgets,
policy, chunking, prefix caching) and requests (prompts sharing prefixes,
sampling limits, priorities, arrival and abort steps), then steps the engine to
the end, checking invariants after every step. The fake runner (see
tests/sched_fakes.py) also checks that every KV slot a request reads holds that
request's token, which catches bad prefix hits, early frees and wrong block
table deltas.
"""
from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kiln.runtime.core.kv_cache_utils import get_block_hash
from kiln.runtime.core.request import FinishReason, RequestStatus

from tests.sched_fakes import EOS, FakeRunner, create_scheduler, fake_token, make_request

EOS_EVERY = 7
# Three shared stems; a prompt is a slice of one plus its own tail.
STEMS = [[1000 * (k + 1) + j for j in range(48)] for k in range(3)]
# Longer ones for a hybrid's prefix cache, whose state snapshots sit on multiples of 64 tokens.
LONG_STEMS = [[1000 * (k + 1) + j for j in range(200)] for k in range(2)]


@dataclass
class Spec:
    rid: str
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: list[int]
    priority: int
    arrive: int
    abort: int | None


def expected_output(spec: Spec, max_len: int) -> tuple[list[int], FinishReason]:
    """What the fake model must produce, by the stop rules, written out independently."""
    out: list[int] = []
    while True:
        tok = fake_token(spec.rid, len(spec.prompt) + len(out), eos_every=EOS_EVERY)
        out.append(tok)
        n_total = len(spec.prompt) + len(out)
        if len(out) < spec.min_tokens:
            if n_total >= max_len:
                return out, FinishReason.LENGTH
            continue
        if tok == EOS and not spec.ignore_eos:
            return out, FinishReason.STOP
        if tok in spec.stop_token_ids:
            return out, FinishReason.STOP
        if n_total >= max_len or len(out) >= spec.max_tokens:
            return out, FinishReason.LENGTH


@st.composite
def request_specs(draw, n: int, stems=STEMS):
    specs = []
    for i in range(n):
        stem = stems[draw(st.integers(0, len(stems) - 1))]
        shared = draw(st.integers(0, len(stem)))
        tail = draw(st.lists(st.integers(1, 60), min_size=0 if shared else 1, max_size=24))
        specs.append(Spec(
            rid=f"r{i}", prompt=stem[:shared] + tail,
            max_tokens=draw(st.integers(1, 24)), min_tokens=draw(st.integers(0, 4)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.integers(1, 50), max_size=2)),
            priority=draw(st.integers(0, 3)), arrive=draw(st.integers(0, 12)),
            abort=draw(st.none() | st.integers(0, 40))))
    return specs


def _mostly(usual, rare):
    """usual 9 times in 10, rare once."""
    return st.integers(0, 9).flatmap(lambda k: rare if k == 0 else usual)


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    chunked = draw(st.booleans() | st.just(True))
    # Mostly room for a few requests at once (preemptions); now and then tiny.
    max_model_len = draw(_mostly(st.integers(48, 160), st.integers(8, 31)))
    kv_tokens = draw(_mostly(st.integers(32, 192), st.integers(1, 8)))  # rounded up to whole blocks
    budget = draw(st.integers(1, 96)) if chunked else draw(st.integers(max_model_len, max_model_len + 64))
    cfg = dict(
        num_blocks=1 + -(-kv_tokens // block_size), block_size=block_size, max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, 6)), max_model_len=max_model_len,
        enable_prefix_caching=draw(st.booleans() | st.just(True)), enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 17])),
        policy=draw(st.sampled_from(["fcfs", "priority"])))
    return cfg, draw(request_specs(draw(st.integers(1, 10))))


def check_cached_blocks_hold_their_tokens(s, runner, reqs) -> None:
    """After a step ran, every block findable by hash holds the tokens that hash names."""
    bs = s.block_size
    named: dict[bytes, list[int]] = {}
    for req in reqs:
        for i, h in enumerate(req.block_hashes):
            named[h] = req.all_token_ids[i * bs:(i + 1) * bs]
    for b in s.kv_cache_manager.block_pool.blocks:
        if b.block_hash is not None:
            want = named[get_block_hash(b.block_hash)]
            got = [runner.kv.get((b.block_id, off)) for off in range(bs)]
            assert got == want, f"cached block {b.block_id} holds {got}, its hash names {want}"


def check_invariants(s, out) -> None:
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= s.max_num_scheduled_tokens
    assert len(s.running) <= s.max_num_running_reqs
    assert all(r.status == RequestStatus.RUNNING for r in s.running)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in s.waiting)
    if s.has_unfinished_requests():
        assert out.total_num_scheduled_tokens > 0, "unfinished requests but nothing scheduled"
    kv = s.kv_cache_manager
    manager = kv.coordinator.single_type_managers[0]
    pool = kv.block_pool
    holders: dict[int, int] = {}
    for rid, blocks in manager.req_to_blocks.items():
        req = s.requests[rid]
        assert req.status == RequestStatus.RUNNING, f"{rid} holds blocks while {req.status.name}"
        assert len(blocks) * s.block_size >= req.num_computed_tokens
        for b in blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for b in pool.blocks[1:]:
        assert b.ref_cnt >= 0
        assert b.block_hash is None or s.kv_cache_manager.enable_caching
        assert b.ref_cnt == holders.get(b.block_id, 0), f"block {b.block_id}: ref_cnt {b.ref_cnt}"
    assert pool.get_num_free_blocks() == sum(1 for b in pool.blocks[1:] if b.ref_cnt == 0)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads(workload):
    run_workload(*workload)


def check_state_slots(s) -> None:
    """A hybrid model's state group: every running request holds exactly one slot of its own,
    nothing else holds one, and the pool's free count agrees."""
    kv = s.kv_cache_manager
    manager = kv.coordinator.single_type_managers[1]
    pool = kv.coordinator.state_pool
    held = {rid: [b.block_id for b in blocks] for rid, blocks in manager.req_to_blocks.items() if blocks}
    running = {r.request_id for r in s.running}
    assert set(held) <= running, f"{set(held) - running} hold state slots while not running"
    assert all(len(v) == 1 for v in held.values())
    ids = [v[0] for v in held.values()]
    assert len(set(ids)) == len(ids) and 0 not in ids
    assert pool.get_num_free_blocks() == pool.num_blocks - 1 - len(ids)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(1, 7))
def test_random_hybrid_workloads(workload, slots):
    """The same workloads on a hybrid model's two groups, prefix caching off, with sometimes
    fewer state slots than max_num_seqs: admission waits for a slot, and every slot is free at
    the end."""
    cfg, specs = workload
    run_workload(dict(cfg, enable_prefix_caching=False, num_state_slots=slots), specs)


@st.composite
def hybrid_caching_workloads(draw):
    """Prompts of up to ~220 tokens sharing long stems, so that state snapshots (every 64
    tokens) are taken, hit, evicted and preempted around."""
    block_size = draw(st.sampled_from([1, 4, 16, 32]))
    max_model_len = draw(st.integers(130, 320))
    kv_tokens = draw(_mostly(st.integers(260, 900), st.integers(64, 259)))
    cfg = dict(num_blocks=1 + -(-kv_tokens // block_size), block_size=block_size,
               max_num_batched_tokens=draw(st.integers(16, 300)), max_num_seqs=draw(st.integers(1, 5)),
               max_model_len=max_model_len, enable_prefix_caching=True, enable_chunked_prefill=True,
               long_prefill_token_threshold=draw(st.sampled_from([0, 0, 50])),
               policy=draw(st.sampled_from(["fcfs", "priority"])))
    slots = draw(st.integers(1, 5))
    cfg.update(num_state_slots=slots + draw(st.integers(0, 4)), num_state_snapshots=0)
    cfg["num_state_snapshots"] = cfg["num_state_slots"] - slots
    return cfg, draw(request_specs(draw(st.integers(1, 10)), LONG_STEMS))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hybrid_caching_workloads())
def test_random_hybrid_workloads_with_prefix_caching(workload):
    """A hybrid model's prefix cache: every chunk finds its slot holding the state of exactly
    the tokens before it (the fake runner's check), whether it came from the request's own
    steps or from a snapshot restored at a prefix hit; every slot is free at the end."""
    run_workload(*workload)


def check_gdn_chunks(s, out) -> None:
    """A hybrid model's chunk short of its request's end ends on a multiple of the GDN chunk
    size, or lies inside one such window (runtime/core/scheduler.py, _gdn_aligned_chunk)."""
    align = s.prefill_chunk_align
    assert align == 64
    starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
    starts.update(zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.num_computed_tokens))
    for rid, start in starts.items():
        end = start + out.num_scheduled_tokens[rid]
        if end < len(s.requests[rid].all_token_ids):
            assert end % align == 0 or end // align == start // align, (rid, start, end)


def run_workload(cfg, specs) -> None:
    s = create_scheduler(**cfg)
    hybrid = cfg.get("num_state_slots", 0) > 0
    runner = FakeRunner(cfg["block_size"], token_fn=lambda rid, pos: fake_token(rid, pos, eos_every=EOS_EVERY))
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    rejected, aborted = set(), set()
    reqs = []
    step = 0
    last_arrival = max(sp.arrive for sp in specs)
    while step <= last_arrival or s.has_unfinished_requests():
        assert step < 3000, "the engine did not finish"
        for sp in specs:
            if sp.arrive == step:
                req = make_request(sp.rid, sp.prompt, max_tokens=sp.max_tokens, min_tokens=sp.min_tokens,
                                   ignore_eos=sp.ignore_eos, stop_token_ids=sp.stop_token_ids,
                                   priority=sp.priority, arrival_time=float(sp.arrive))
                if len(sp.prompt) > s.max_model_len:
                    rejected.add(sp.rid)
                    try:
                        s.add_request(req)
                    except ValueError:
                        continue
                    raise AssertionError("a prompt longer than the scheduler can hold was accepted")
                s.add_request(req)
                reqs.append(req)
            if (sp.abort == step and sp.rid not in rejected and sp.rid not in reasons
                    and s.finish_requests(sp.rid, RequestStatus.FINISHED_ABORTED)):
                aborted.add(sp.rid)
        out = s.schedule()
        check_invariants(s, out)
        if hybrid:
            check_state_slots(s)
            check_gdn_chunks(s, out)
        mro = runner.execute(out)
        check_cached_blocks_hold_their_tokens(s, runner, reqs)
        for rid, o in s.update_from_output(out, mro).items():
            assert rid not in reasons, f"{rid} got output after finishing"
            tokens.setdefault(rid, []).extend(o.new_token_ids)
            if o.finished:
                reasons[rid] = o.finish_reason
        step += 1

    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == cfg["num_blocks"] - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    if hybrid:
        state = s.kv_cache_manager.coordinator.state_pool
        assert state.get_num_free_blocks() == cfg["num_state_slots"] and s.kv_cache_manager.state_usage == 0
    assert not s.requests and not s.running and not s.waiting
    for sp in specs:
        if sp.rid in rejected:
            assert sp.rid not in tokens
            continue
        want, why = expected_output(sp, s.max_model_len)
        got = tokens.get(sp.rid, [])
        if sp.rid in aborted:
            assert got == want[:len(got)] and sp.rid not in reasons
        else:
            assert got == want, f"{sp.rid}: got {got}, want {want}"
            assert reasons[sp.rid] == why


def _step_record(out, res) -> tuple:
    """What a step told the runner and the caller, in comparable form."""
    c = out.scheduled_cached_reqs
    return (out.num_scheduled_tokens, [(n.req_id, n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs],
            c.req_ids, c.resumed_req_ids, c.new_token_ids, c.all_token_ids, c.new_block_ids, c.num_computed_tokens,
            c.num_output_tokens, out.finished_req_ids, out.preempted_req_ids, out.num_common_prefix_blocks,
            {rid: (o.new_token_ids, o.finish_reason, o.stop_reason) for rid, o in res.items()})


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_slot_room_shortcut_equals_allocate_slots(workload):
    """KVCacheManager.slot_room lets the scheduler skip allocate_slots for a running request
    that needs no block and publishes none; with the shortcut off (slot_room None: every call
    takes allocate_slots' full path) every step must be the same."""
    cfg, specs = workload
    fast, slow = create_scheduler(**cfg), create_scheduler(**cfg)
    slow.kv_cache_manager.slot_room = None
    token_fn = lambda rid, pos: fake_token(rid, pos, eos_every=EOS_EVERY)  # noqa: E731
    runners = {id(fast): FakeRunner(cfg["block_size"], token_fn), id(slow): FakeRunner(cfg["block_size"], token_fn)}
    last_arrival = max(sp.arrive for sp in specs)
    step = 0
    while step <= last_arrival or fast.has_unfinished_requests() or slow.has_unfinished_requests():
        assert step < 3000, "the engine did not finish"
        records = []
        for s in (fast, slow):
            for sp in specs:
                if sp.arrive == step and len(sp.prompt) <= s.max_model_len:
                    s.add_request(make_request(sp.rid, sp.prompt, max_tokens=sp.max_tokens, min_tokens=sp.min_tokens,
                                               ignore_eos=sp.ignore_eos, stop_token_ids=sp.stop_token_ids,
                                               priority=sp.priority, arrival_time=float(sp.arrive)))
                if sp.abort == step:
                    s.finish_requests(sp.rid, RequestStatus.FINISHED_ABORTED)
            out = s.schedule()
            res = s.update_from_output(out, runners[id(s)].execute(out))
            records.append(_step_record(out, res))
        assert records[0] == records[1], f"step {step}"
        room = fast.kv_cache_manager.slot_room
        manager = fast.kv_cache_manager.coordinator.single_type_managers[0]
        assert set(room) == set(manager.req_to_blocks)
        for rid, n in room.items():
            assert n <= len(manager.req_to_blocks[rid]) * fast.block_size
        step += 1
