"""The hybrid router's many-views adapter (``_ViewsPresence``) answers the joint-hit rule's
questions for every view at once: through ``joint_hits`` it gives each view's own
``InstanceView.match`` (the rule over one view), whatever the views hold and in any order
(its reuse of the last run found must never leak from one view to the next)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.cache.groups import FULL, KIMI_LINEAR, joint_hits
from hybridkv.fleet.routers import _RoutedPresence, _ViewsPresence

from test_routers import UNIT, chain, view

PROMPT = chain(*(f"p{i}" for i in range(12)))
OTHER = chain(*(f"o{i}" for i in range(12)))


def held(units: list[int], prompt=PROMPT) -> list[bytes]:
    return [prompt[i] for i in units if i < len(prompt)]


unit_sets = st.lists(st.integers(0, 11), max_size=12)


@settings(max_examples=80, deadline=None)
@given(views=st.lists(st.tuples(st.integers(0, 12), unit_sets, unit_sets, st.booleans()), min_size=1, max_size=8),
       limit=st.integers(0, 13 * UNIT))
def test_views_presence_gives_each_views_own_joint_hit(views, limit):
    vs = []
    for run, holes, cks, other in views:
        kv = [PROMPT[i] for i in range(run)] + held(holes) + (OTHER if other else [])
        vs.append(view(kv=kv, checkpoints=held(cks)))
    units = PROMPT[: limit // UNIT]
    kvs, hits, restarts = joint_hits(KIMI_LINEAR, _ViewsPresence(units, UNIT, vs), limit)
    want = [v.match(PROMPT, limit) for v in vs]
    assert kvs == [m.kv_hit for m in want] and hits == [m.hit for m in want] == restarts


def test_a_shared_run_is_reused_but_checked_per_view():
    a = view(kv=PROMPT[:6], checkpoints=[PROMPT[5]])
    b = view(kv=PROMPT[:8], checkpoints=[PROMPT[2]])           # holds the guess and more
    c = view(kv=PROMPT[:3] + PROMPT[4:6], checkpoints=[PROMPT[5]])   # a hole inside the guess
    kvs, hits, _ = joint_hits(KIMI_LINEAR, _ViewsPresence(PROMPT[:10], UNIT, [a, b, c]), 10 * UNIT)
    assert kvs == [6 * UNIT, 8 * UNIT, 3 * UNIT] and hits == [6 * UNIT, 3 * UNIT, 0]


def test_routed_presence_continues_the_views_run_through_routed_units():
    v = view(kv=PROMPT[:3], checkpoints=[PROMPT[2]])
    routed_kv = {h: 0 for h in PROMPT[3:6]}
    p = _RoutedPresence(PROMPT[:10], UNIT, routed_kv, v.held, {PROMPT[5]: 0}, (3 * UNIT, 3 * UNIT, 3 * UNIT))
    assert p.prefix_run(FULL, 10 * UNIT) == 6 * UNIT
    assert p.deepest_state("kda", 6 * UNIT) == 6 * UNIT
    assert p.deepest_state("kda", 5 * UNIT) == 3 * UNIT        # down to the view's own hit
    assert p.deepest_state("kda", 2 * UNIT) == 0               # below it: nothing known there
