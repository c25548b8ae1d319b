"""TierConnector: prefetch while earlier requests run, uploads as prefill steps land, write-back and
write-through to host tiers. Over the memory and disk stores (the ``store`` fixture in conftest.py);
the first prefetch scenario also runs against Mooncake in test_store_tier_mooncake.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hkv_helpers import assert_exact, run_one, tokens
from tier_helpers import held, host_instance, instance

from hybridkv.store.memory import MemoryStore

# -- prefetch and installs -------------------------------------------------------------------------


def test_prefetch_loads_while_earlier_requests_run(tiny_model, store):
    """Requests queued behind a running one get their store entries loaded in the background
    (started before that step's compute) and installed at admission; outputs stay exact."""
    from hybridkv.engine.request import Request, Status

    v = tiny_model.config.vocab_size
    P = tokens(70, 2048, v)
    a, _ = instance(tiny_model, store, policy="tail=2048")
    run_one(a, np.concatenate([P, tokens(71, 100, v)]), max_output_tokens=1)
    b, tier_b = instance(tiny_model, store, max_num_seqs=1)    # the others wait while q0 runs
    reqs = [b.add_request(Request(f"q{i}", np.concatenate([tokens(80 + i, 300, v)] if i == 0 else
                                                          [P, tokens(80 + i, 50, v)]), 2, record_logits=True))
            for i in range(3)]
    b.step()                                                    # admits q0; q1's loads overlap its compute
    assert b.connector.prefetching(reqs[1])
    b.run_until_done()
    assert all(r.status == Status.FINISHED for r in reqs)
    assert reqs[1].reused == 2048 and tier_b.stats.hit_tokens >= 2048
    assert b.connector.prefetch_used >= 1 and b.connector.prefetch_held_bytes == 0
    for r in reqs:
        assert_exact(tiny_model, r)
    b.cache.check_invariants()


def test_prefetch_byte_budget(tiny_model, store):
    """Prefetches that would hold more than prefetch_limit_bytes load nothing (the request loads at
    admission), and the budget is whole again once the queue is done."""
    from hybridkv.engine.request import Request

    v = tiny_model.config.vocab_size
    P = tokens(81, 2048, v)
    a, _ = instance(tiny_model, store, policy="tail=2048")
    run_one(a, np.concatenate([P, tokens(82, 100, v)]), max_output_tokens=1)
    b, tier_b = instance(tiny_model, store, max_num_seqs=1)
    b.connector.prefetch_limit_bytes = tier_b.entry_nbytes("kda")            # less than one prefix
    reqs = [b.add_request(Request(f"q{i}", np.concatenate([tokens(83, 300, v)] if i == 0 else
                                                          [P, tokens(83 + i, 50, v)]), 2, record_logits=True))
            for i in range(2)]
    b.run_until_done()
    assert b.connector.prefetch_skipped >= 1 and b.connector.prefetch_used == 0
    assert reqs[1].reused == 2048 and b.connector.prefetch_held_bytes == 0
    assert_exact(tiny_model, reqs[1])


def test_engine_without_prefetch_loads_at_admission(tiny_model, store):
    from hybridkv.engine.request import Request

    v = tiny_model.config.vocab_size
    P = tokens(76, 2048, v)
    a, _ = instance(tiny_model, store, policy="tail=2048")
    run_one(a, np.concatenate([P, tokens(77, 100, v)]), max_output_tokens=1)
    b, _ = instance(tiny_model, store, max_num_seqs=1)
    b.prefetch_enabled = False
    reqs = [b.add_request(Request(f"q{i}", np.concatenate([P, tokens(78 + i, 50, v)]), 2)) for i in range(2)]
    b.step()
    assert not b.connector.prefetching(reqs[1])
    b.run_until_done()
    assert [r.reused for r in reqs] == [2048, 2048] and b.connector.prefetch_used == 0


def test_prefetch_take_rejects_stale_results():
    """Prefetch.take hands out loads only for the same best checkpoint and when the device still
    holds the KV the loads started from; every job's reserved bytes are released exactly once."""
    from concurrent.futures import Future

    from hybridkv.tiers.connector import Prefetch

    released = []

    def done(value):
        f = Future()
        f.set_result(value)
        return f

    def handle(kv_from, result):
        return Prefetch(kv_from, {"store": done(result)}, release=released.append)

    loaded = {(1024, "full"): {"latents": None}, (1024, "kda"): {}}
    assert handle(0, (1024, loaded, 10)).take("store", 1024, 0) is loaded
    assert handle(0, (1024, loaded, 20)).take("store", 2048, 0) is None        # newer entry now
    assert handle(1024, (2048, loaded, 30)).take("store", 2048, 0) is None     # device lost KV
    assert handle(0, (0, {}, 0)).take("store", 0, 0) is None
    p = handle(0, (1024, loaded, 40))
    p.cancel()
    assert p.take("store", 1024, 0) is None
    assert released == [10, 20, 30, 0, 40]


def test_prefetch_belongs_to_the_connector_that_started_it(tiny_model, store):
    """Prefetch state lives in the connector that started it: the same prompt queued in another engine
    loads on its own, and cancelling the request in the first engine gives its prefetch bytes back."""
    from hybridkv.engine.request import Request

    v = tiny_model.config.vocab_size
    P = tokens(5, 2048, v)
    a, _ = instance(tiny_model, store, policy="tail=2048")
    run_one(a, np.concatenate([P, tokens(6, 100, v)]), max_output_tokens=1)
    first, _ = instance(tiny_model, store)
    r = first.add_request(Request("r", np.concatenate([P, tokens(7, 50, v)]), 2, record_logits=True))
    first.prefetch()
    assert first.connector.prefetching(r)
    second, _ = instance(tiny_model, store)
    r2 = run_one(second, r.prompt, max_output_tokens=2)
    assert r2.reused == 2048 and second.connector.prefetch_used == 0     # not the first engine's loads
    assert_exact(tiny_model, r2)
    first.cancel(r)
    assert first.connector.drain(timeout_s=30)                          # the cancelled job has ended
    assert first.connector.prefetch_held_bytes == 0 and first.connector.num_requests == 0


def test_prefetch_job_error_returns_its_bytes(tiny_model):
    from hybridkv.engine.request import Request

    class BuggyOnce(MemoryStore):
        boom = False

        def get_into(self, keys, buffers):
            if self.boom:
                self.boom = False
                raise RuntimeError("backend bug")
            return super().get_into(keys, buffers)

    v = tiny_model.config.vocab_size
    store = BuggyOnce()
    P = tokens(5, 2048, v)
    a, _ = instance(tiny_model, store, policy="tail=2048")
    run_one(a, np.concatenate([P, tokens(6, 100, v)]), max_output_tokens=1)
    e, _ = instance(tiny_model, store)
    store.boom = True
    r = e.add_request(Request("r", np.concatenate([P, tokens(7, 50, v)]), 2))
    e.prefetch()
    assert e.connector.prefetching(r) and e.connector.drain(timeout_s=30)
    assert e.connector.prefetch_held_bytes == 0
    e.cancel(r)
    assert e.connector.prefetch_held_bytes == 0


def test_failed_install_repeats_the_device_lookup(tiny_model):
    """An install that evicts a cached page of the device hit and then fails for lack of pages must
    not leave admission holding a match that names the freed page."""
    from hybridkv.cache.config import CacheConfig, CheckpointPolicy
    from hybridkv.cache.namespace import CacheIdentity
    from hybridkv.engine.backend import TorchBackend
    from hybridkv.engine.engine import Engine
    from hybridkv.engine.request import Request, Status
    from hybridkv.tiers.connector import tier_for

    v = tiny_model.config.vocab_size
    ns = CacheIdentity(model_repo="tiny", weight_digest=tiny_model.weight_digest()).digest()

    def engine(store, pages, policy):
        cfg = CacheConfig(block_size=256, prefix_match_unit=64, max_num_batched_tokens=4096, num_kv_pages=pages,
                          num_checkpoint_slots=4, policy=CheckpointPolicy.parse(policy), store_alignment=512,
                          max_num_seqs=2)
        be = TorchBackend(tiny_model, pages, 256)
        return Engine(cfg, be, ns, tiers=[tier_for(store, be, ns, 64, 512)])

    store = MemoryStore()
    P = tokens(1, 1024, v)
    run_one(engine(store, 64, "interval=1024"), np.concatenate([P, tokens(2, 10, v)]), 1)
    e = engine(store, 5, "tail=256")
    run_one(e, np.concatenate([P[:768], tokens(3, 10, v)]), 1)      # device: [0, 768) cached
    e.add_request(Request("R", tokens(9, 300, v), 100))              # takes the free pages first
    z = e.add_request(Request("Z", np.concatenate([P, tokens(4, 10, v)]), 1, record_logits=True))
    e.run_until_done()
    assert z.status == Status.FINISHED
    assert_exact(tiny_model, z)
    e.cache.check_invariants()


# -- uploads ---------------------------------------------------------------------------------------


def test_connector_rejects_tiers_with_one_name(tiny_model):
    from hybridkv.cache.config import CacheConfig
    from hybridkv.engine.backend import TorchBackend
    from hybridkv.engine.engine import Engine
    from hybridkv.tiers.connector import tier_for

    be = TorchBackend(tiny_model, 8, 1024)
    tiers = [tier_for(MemoryStore(), be, b"ns", 64, 1024), tier_for(MemoryStore(), be, b"ns", 64, 1024)]
    with pytest.raises(ValueError, match="distinct names"):
        Engine(CacheConfig(block_size=1024, num_kv_pages=8), be, b"ns", tiers=tiers)


def test_upload_queries_each_boundary_once_per_request(tiny_model):
    """A long prompt prefilled in many steps: the upload marks keep each step's existence query to
    the new boundaries (not the whole prefix again), and every entry still lands."""
    from hybridkv.engine.request import Request, Status

    class CountingStore(MemoryStore):
        def __init__(self):
            super().__init__()
            self.queried = []

        def exists(self, keys):
            self.queried += [k for k in keys if k.endswith("/full/r0/manifest")]
            return super().exists(keys)

    v = tiny_model.config.vocab_size
    store = CountingStore()
    a, tier = instance(tiny_model, store, policy="tail", block_size=256, alignment=256, pages=32,
                       max_num_batched_tokens=512)
    P = tokens(90, 4096, v)
    r = a.add_request(Request("p", P, 2))
    while r.status != Status.DECODE:
        a.step()
    assert a.connector.upload_marks(r) == {"store": 4096}
    a.run_until_done()
    hashes = a.cache.hash_prompt(P)
    bounds = list(range(256, 4096 + 1, 256))
    assert held(tier, hashes, bounds, "full") == [True] * len(bounds)
    from_uploads = len(store.queried) - len(bounds)          # the last has() above queried them all once more
    # the admission lookup (15 boundaries below T - 1), one query per boundary, and the last step's
    # repair pass over all 16; re-querying the prefix at each of the 8 steps would be 15 + (2 + ... + 16) = 87
    assert from_uploads <= 3 * len(bounds), from_uploads
    assert a.connector.num_requests == 0                     # forgotten once finished


def test_last_prefill_step_reuploads_what_the_store_lost_mid_request(tiny_model):
    """The store loses everything after a request's first step: its last step re-queries the whole
    prompt (whatever the upload mark says), so the next instance still gets the full prefix."""
    from hybridkv.engine.request import Request

    v = tiny_model.config.vocab_size
    store = MemoryStore()
    P = tokens(73, 4096, v)
    a, tier_a = instance(tiny_model, store, policy="tail=1024", max_num_batched_tokens=1024)
    r = a.add_request(Request("a", np.concatenate([P, tokens(74, 100, v)]), 2))
    a.step()
    assert a.connector.upload_marks(r) == {"store": 1024}
    store.remove(list(store._data))                                   # lost: restart or eviction
    a.run_until_done()
    assert held(tier_a, a.cache.hash_prompt(r.prompt), [1024, 2048, 3072, 4096], "full") == [True] * 4
    b, _ = instance(tiny_model, store)
    rb = run_one(b, np.concatenate([P, tokens(75, 100, v)]))
    assert rb.reused == 4096
    assert_exact(tiny_model, rb)


# -- write-back to host tiers ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tensors", "memory-store"])
def test_host_tier_write_back_and_load_back(tiny_model, kind):
    v = tiny_model.config.vocab_size
    e, host = host_instance(tiny_model, block_size=256, pages=8, policy="branch+tail=256", kind=kind)
    P = tokens(50, 1024, v)
    run_one(e, np.concatenate([P, tokens(51, 30, v)]))             # C(P_1024) and 4 pages
    for i in range(3):                                              # push P's pages out of the device pool
        run_one(e, tokens(60 + i, 1000, v), max_output_tokens=1)
    assert e.cache.evicted_pages > 0 and host.stats.bytes_saved > 0
    assert len(e.cache.index.walk(e.cache.hash_prompt(P))) < 16     # no longer fully on the device
    r = run_one(e, np.concatenate([P, tokens(52, 40, v)]))
    assert r.reused == 1024 and host.stats.hit_tokens > 0
    assert_exact(tiny_model, r)
    e.cache.check_invariants()


def test_host_tier_write_through_serves_after_device_clear(tiny_model):
    v = tiny_model.config.vocab_size
    e, host = host_instance(tiny_model, block_size=256, pages=16, policy="tail=256", write_through=True)
    P = tokens(55, 1024, v)
    run_one(e, np.concatenate([P, tokens(56, 30, v)]))
    assert e.cache.evicted_pages == 0 and host.stats.bytes_saved > 0   # saved as computed, not on eviction
    e.cache.clear()
    r = run_one(e, np.concatenate([P, tokens(57, 40, v)]))
    assert r.reused == 1024 and host.stats.hit_tokens == 1024
    assert_exact(tiny_model, r)
    e.cache.check_invariants()


def test_host_write_through_still_writes_back_on_eviction(tiny_model):
    """A write-through host tier also saves what the device evicts: an entry that fell out of the
    host's LRU while hot on the device is saved again when the device drops it."""
    v = tiny_model.config.vocab_size
    e, host = host_instance(tiny_model, block_size=1024, pages=6, policy="tail=1024", write_through=True)
    assert host.write_through and host.write_back
    P = tokens(58, 1024, v)
    run_one(e, np.concatenate([P, tokens(59, 30, v)]))
    host.invalidate(e.cache.hash_prompt(P), 1024, "full")              # as if the host's LRU dropped it
    host.invalidate(e.cache.hash_prompt(P), 1024, "kda")
    for i in range(8):                                                # until the device evicts P
        run_one(e, np.concatenate([tokens(300 + i, 1024, v), tokens(3, 30, v)]), max_output_tokens=1)
        if e.cache.lookup(np.concatenate([P, tokens(4, 30, v)]), touch=False).kv_hit == 0:
            break
    assert held(host, e.cache.hash_prompt(P), [1024], "full") == [True]
    r = run_one(e, np.concatenate([P, tokens(4, 30, v)]))
    assert r.reused == 1024
    assert_exact(tiny_model, r)


def test_write_back_skips_entries_the_tier_holds(tiny_model):
    """Evicting a prefix the write-back tier already holds sends nothing again."""
    v = tiny_model.config.vocab_size
    store = MemoryStore()
    e, host = host_instance(tiny_model, block_size=1024, pages=4, policy="tail=1024", kind="store", store=store)
    P = tokens(1, 1024, v)

    def evict(seed):
        for i in range(3):
            run_one(e, np.concatenate([tokens(seed + i, 1024, v), tokens(2, 20, v)]), 1)

    run_one(e, np.concatenate([P, tokens(3, 20, v)]), 1)
    evict(100)
    assert run_one(e, np.concatenate([P, tokens(4, 20, v)]), 1).reused == 1024    # back from the tier
    saved = host.stats.bytes_saved
    held = store._bytes
    evict(200)                                                        # P evicted again: already held
    new = store._bytes - held
    assert host.stats.bytes_saved - saved == new                      # only the new prompts' entries



def test_an_admission_that_raises_still_returns_its_prefetch_bytes(tiny_model):
    """A store error on the engine thread while admission asks the tiers (after the background
    loads were reserved) propagates, yet the prefetch's bytes go back to the budget."""
    import threading

    from hybridkv.engine.request import Request

    class FailsOnEngineThread(MemoryStore):
        armed = False

        def exists(self, keys):
            if self.armed and threading.current_thread() is threading.main_thread():
                raise KeyboardInterrupt("interrupted during admission")
            return super().exists(keys)

    v = tiny_model.config.vocab_size
    store = FailsOnEngineThread()
    P = tokens(21, 2048, v)
    a, _ = instance(tiny_model, store, policy="tail=2048")
    run_one(a, np.concatenate([P, tokens(22, 100, v)]), max_output_tokens=1)
    e, _ = instance(tiny_model, store)
    r = e.add_request(Request("r", np.concatenate([P, tokens(23, 50, v)]), 2))
    e.prefetch()
    assert e.connector.prefetching(r) and e.connector.drain(timeout_s=30)
    assert e.connector.prefetch_held_bytes > 0                          # loaded, waiting for admission
    store.armed = True
    with pytest.raises(KeyboardInterrupt):
        e.step()
    assert e.connector.drain(timeout_s=30) and e.connector.prefetch_held_bytes == 0
    store.armed = False
    e.run_until_done()                                                  # the request still runs, exact
    assert r.reused == 2048
    e.cache.check_invariants()


def test_empty_existence_queries_never_reach_the_store(tiny_model):
    """Prefill steps that land no new aligned boundary ask the store nothing."""
    class Counting(MemoryStore):
        calls = 0

        def exists(self, keys):
            type(self).calls += 1
            assert keys, "an empty existence query reached the store"
            return super().exists(keys)

    v = tiny_model.config.vocab_size
    e, tier = instance(tiny_model, Counting(), policy="tail", max_num_batched_tokens=128)
    assert tier.exists([]) == []
    run_one(e, tokens(24, 1100, v), max_output_tokens=1)               # 9 steps, one aligned boundary
    assert Counting.calls <= 4


def test_tiers_given_as_an_iterator_are_all_kept(tiny_model):
    from hybridkv.cache.config import CacheConfig
    from hybridkv.engine.backend import TorchBackend
    from hybridkv.engine.engine import Engine
    from hybridkv.tiers.connector import host_tier_for, tier_for

    be = TorchBackend(tiny_model, 8, 1024)
    tiers = [host_tier_for(1 << 20, be, b"ns", 64, 1024), tier_for(MemoryStore(), be, b"ns", 64, 1024)]
    e = Engine(CacheConfig(num_kv_pages=8), be, b"ns", tiers=iter(tiers))
    assert [t.name for t in e.connector.tiers] == ["host", "store"] and e.connector.writes_back


def test_identical_resend_reuses_from_the_store_in_a_fresh_engine(tiny_model):
    """The tail of a store-aligned prompt sits at T - 1 aligned down, so a fresh engine sending the
    same prompt again takes it from the store (before: 0 reused)."""
    v = tiny_model.config.vocab_size
    store = MemoryStore()
    P = tokens(45, 1024, v)
    a, _ = instance(tiny_model, store, policy="tail=256", block_size=256, alignment=256)
    run_one(a, P, max_output_tokens=1)
    b, tier_b = instance(tiny_model, store, policy="tail=256", block_size=256, alignment=256)
    r = run_one(b, P, max_output_tokens=2)
    assert r.reused == 768 and tier_b.stats.hit_tokens == 768
    assert_exact(tiny_model, r)


def test_a_request_waiting_for_pages_is_loaded_once_and_the_store_credited_in_full(tiny_model):
    """Issue 11b: the store holds P (1,024 tokens, checkpoints every 256); the reader's 25-page pool
    has 10 pages held by two running requests, so Q = P + 40 cannot be admitted yet. Before: Q was
    installed and evicted again at every admission attempt (61 reads) and the store was credited
    256 of its 1,024 reused tokens. Now it waits without loading, loads once, and the store is
    credited with everything it supplied."""
    from hybridkv.engine.request import Request, Status

    class Counting(MemoryStore):
        reads = 0

        def get_into(self, keys, buffers):
            type(self).reads += 1
            return super().get_into(keys, buffers)

    v = tiny_model.config.vocab_size
    store = Counting()
    P = tokens(120, 1024, v)
    a, _ = instance(tiny_model, store, policy="interval=256", block_size=64, alignment=256, pages=64)
    run_one(a, np.concatenate([P, tokens(121, 30, v)]), max_output_tokens=1)
    Counting.reads = 0
    b, tier = instance(tiny_model, store, policy="tail", block_size=64, alignment=256, pages=25, max_num_seqs=3)
    b.prefetch_enabled = False
    running = [b.add_request(Request(f"r{i}", tokens(122 + i, 200, v), 60)) for i in range(2)]
    b.step()
    assert all(r.status != Status.WAITING for r in running)
    q = b.add_request(Request("q", np.concatenate([P, tokens(125, 40, v)]), 2, record_logits=True))
    b.run_until_done()
    assert q.status == Status.FINISHED and q.reused == 1024 and q.admission_failures > 10
    assert Counting.reads <= 2, Counting.reads
    assert tier.stats.hit_tokens == 1024
    assert_exact(tiny_model, q)


def test_a_shorter_hit_credits_each_tier_with_what_it_supplied_below_it():
    """Issue 11b: the device held [0, 256), the host added [256, 512) and the store [512, 1024).
    Admitted with a shorter hit of 600 (pages were short), the host supplied 256 of it and the
    store 88 (before: each gain was clipped to 600, crediting the store 512)."""
    from hybridkv.cache.coordinator import MatchResult
    from hybridkv.tiers.connector import FetchResult

    match = MatchResult(hit=1024, kv_hit=1024, checkpoint_hit=1024, branching_boundary=None,
                        per_group={"full": 1024, "kda": 1024}, hashes=[], path=[])
    fetched = FetchResult(match, None, {"host": [(256, 512)], "store": [(512, 1024)]})
    assert fetched.gains == {"host": 256, "store": 512}
    assert fetched.credit(600) == {"host": 256, "store": 88}
    assert fetched.credit(256) == {"host": 0, "store": 0}


def test_a_load_slower_than_recomputing_is_declined_and_counted(tiny_model):
    """Issue 9, item 3: the store answers every call after 3 s. The reader's first request loads
    (no rates measured yet) and so measures the store; its second, on another stored prefix,
    would wait seconds to save 1,024 tokens the tiny model computes far faster, so it
    recomputes: declined and counted, output exact."""
    from hybridkv.store.faults import FaultyStore

    v = tiny_model.config.vocab_size
    store = MemoryStore()
    P, Q = tokens(140, 1024, v), tokens(141, 1024, v)
    a, _ = instance(tiny_model, store, policy="tail=1024")
    for prefix in (P, Q):
        run_one(a, np.concatenate([prefix, tokens(142, 50, v)]))
    slow = FaultyStore(store, {"slow": 1.0}, slow_seconds=3.0, close_inner=False)
    b, tier = instance(tiny_model, slow, policy="tail=1024")
    first = run_one(b, np.concatenate([P, tokens(143, 50, v)]))
    assert first.reused == 1024 and tier.stats.loads_taken == 1
    second = run_one(b, np.concatenate([Q, tokens(144, 50, v)]))
    assert second.reused == 0 and tier.stats.loads_declined == 1 and tier.stats.loads_taken == 1
    assert b.connector.load_seconds_per_entry[tier.name] * 2 > b.connector.compute_seconds_per_token * 1024
    assert_exact(tiny_model, second)
