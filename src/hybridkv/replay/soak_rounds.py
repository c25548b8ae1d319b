"""What one soak round is: a random engine configuration and a random request sequence, derived
from ``(seed, round index)`` alone (docs/how-to/soak.md). :mod:`hybridkv.replay.soak`
drives the rounds and checks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from hybridkv.cache.config import CacheConfig, CheckpointPolicy

STAGES = ("waiting", "prefetch", "admitted", "prefill", "decode")
"""Where a request can be cancelled: queued; queued with a background prefetch started;
admitted, nothing computed yet; part of the prompt computed; decoding."""


# -- round configuration -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RoundConfig:
    """Engine settings of one round (tokens, bytes).

    Attributes:
        policy: checkpoint policy text (:meth:`CheckpointPolicy.parse`).
        mechanism: ``extract`` or ``split``.
        block_size, prefix_match_unit, max_num_batched_tokens, max_num_seqs,
        num_kv_pages, num_checkpoint_slots, store_alignment: :class:`CacheConfig` fields.
        host_bytes: host tier capacity (0: none).  host_write_through: the host tier also saves
            entries as they are computed.
        store: ``none``, ``memory`` or ``disk`` (a fresh temporary directory per run).
        store_capacity: store capacity in bytes (``None``: unlimited).
        instances: engines sharing the store (1 or 2); request ``i`` runs on its ``instance``.
        prefetch: background prefetch for waiting requests.
        faults: rate of each injected store fault (:class:`~hybridkv.store.faults.FaultyStore`;
            ``unavailable`` at a third of it); 0: none.
        eviction: eviction order of the device pools and the host tier (``lru`` or ``value``;
            not drawn by :func:`make_round`: the soak's ``--eviction`` option sets it).
        checkpoint_probation: :class:`CacheConfig` field (not drawn: the soak's ``--eviction probation``
            sets it to 0 with ``lru``).
        checkpoint_eviction: :class:`CacheConfig` field (not drawn: the soak's ``--eviction utility``
            sets it to ``utility`` with ``lru`` pages).
        model: the preset the round runs on (``tiny``, or DeepSeek-V4's ``v4-tiny`` / ``v4-small``;
            not drawn: the soak's ``--model`` sets it).
        swa_recovery: DeepSeek-V4 only: ``window``, ``periodic=P`` or ``recompute``
            (:class:`~hybridkv.cache.swa.SwaRecovery`; ``None``: the default, ``window``).
    """

    policy: str
    mechanism: str
    block_size: int
    prefix_match_unit: int
    max_num_batched_tokens: int
    max_num_seqs: int
    num_kv_pages: int
    num_checkpoint_slots: int
    host_bytes: int = 0
    host_write_through: bool = False
    store: str = "none"
    store_capacity: int | None = None
    store_alignment: int | None = None
    instances: int = 1
    prefetch: bool = True
    faults: float = 0.0
    eviction: str = "lru"
    checkpoint_probation: float | None = None
    checkpoint_eviction: str | None = None
    model: str = "tiny"
    swa_recovery: str | None = None

    def cache_config(self) -> CacheConfig:
        """The validated :class:`CacheConfig` of these settings."""
        return CacheConfig(block_size=self.block_size, prefix_match_unit=self.prefix_match_unit,
                           max_num_batched_tokens=self.max_num_batched_tokens, num_kv_pages=self.num_kv_pages,
                           num_checkpoint_slots=self.num_checkpoint_slots,
                           policy=CheckpointPolicy.parse(self.policy), mechanism=self.mechanism,
                           max_num_seqs=self.max_num_seqs, store_alignment=self.store_alignment,
                           eviction=self.eviction, checkpoint_probation=self.checkpoint_probation,
                           checkpoint_eviction=self.checkpoint_eviction)


# -- requests ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class RequestSpec:
    """One request of a round, reproducible without running anything before it.

    ``segments`` build the prompt, in order: ``["r", seed, n]`` the first ``n`` tokens of
    random stream ``seed`` (so ``["r", s, 40]`` is a prefix of ``["r", s, 300]``),
    ``["o", rid]`` the output request ``rid`` generated (multi-turn sessions), ``["l", ids]``
    literal ids (an ``"o"`` segment once resolved).

    Attributes:
        rid: index in the round.  instance: the engine it runs on.  kind: workload shape
            (``tree``, ``session``, ``resend``, ``short``).
        max_tokens: tokens to generate.  hints: checkpoint hints (policy ``hint``).
        cancel: stage to cancel at (:data:`STAGES`) or ``None``; a request that skips it (no
            prefetch, a prefill done in one step) is cancelled in the first later stage it is seen in.
        cancel_after: times the request is seen in that stage (or a later one) before it is cancelled.
        arrive: driver tick at which it may be submitted.
        after: request it waits for (submitted once that one is done), or ``None``.
    """

    rid: int
    instance: int
    kind: str
    segments: list
    max_tokens: int
    hints: list[int] = field(default_factory=list)
    cancel: str | None = None
    cancel_after: int = 0
    arrive: int = 0
    after: int | None = None

    def describe(self, vocab: int) -> str:
        """One line: id, engine, prompt length and shape, output, cancel plan."""
        segs = []
        for s in self.segments:
            if s[0] == "r":
                segs.append(f"rand({s[1]})[:{s[2]}]")
            elif s[0] == "o":
                segs.append(f"out(#{s[1]})")
            else:
                segs.append(f"ids{list(s[1])}")
        n = sum(s[2] if s[0] == "r" else len(s[1]) for s in self.segments if s[0] != "o")
        cancel = f" cancel={self.cancel}@{self.cancel_after}" if self.cancel else ""
        after = f" after=#{self.after}" if self.after is not None else ""
        hints = f" hints={self.hints}" if self.hints else ""
        return (f"#{self.rid} engine={self.instance} {self.kind} T={n} out={self.max_tokens} "
                f"tick>={self.arrive}{after}{cancel}{hints} prompt={' + '.join(segs)}")


def segment_tokens(seed: int, n: int, vocab: int) -> np.ndarray:
    """The first ``n`` ids of random stream ``seed`` (a shorter ``n`` is a prefix of a longer one)."""
    return np.random.default_rng([0x50A4, seed]).integers(0, vocab, n, dtype=np.int64)


def build_prompt(segments, outputs: dict[int, list[int]], vocab: int) -> tuple[np.ndarray, list]:
    """The prompt ids of ``segments`` and the segments with every ``"o"`` resolved to literals."""
    parts, resolved = [], []
    for s in segments:
        if s[0] == "r":
            parts.append(segment_tokens(int(s[1]), int(s[2]), vocab))
            resolved.append(["r", int(s[1]), int(s[2])])
        else:
            ids = list(outputs.get(int(s[1]), [])) if s[0] == "o" else [int(t) for t in s[1]]
            parts.append(np.asarray(ids, dtype=np.int64))
            resolved.append(["l", ids])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64), resolved


def _upper_len(spec: RequestSpec, specs: dict[int, RequestSpec]) -> int:
    """Most prompt tokens ``spec`` can have (an ``"o"`` segment counts its request's ``max_tokens``)."""
    n = 0
    for s in spec.segments:
        if s[0] == "r":
            n += int(s[2])
        elif s[0] == "o":
            n += specs[int(s[1])].max_tokens
        else:
            n += len(s[1])
    return n


# -- random rounds -------------------------------------------------------------------------------------
def _policy(rng: np.random.Generator, g: int, b: int) -> str:
    terms = []
    if rng.random() < 0.7:
        terms.append("branch")
    if rng.random() < 0.8:
        terms.append(f"tail={int(rng.choice([2 * g, b, 4 * g]))}" if rng.random() < 0.3 else "tail")
    if rng.random() < 0.4:
        terms.append(f"interval={int(rng.choice([g, 2 * g, 4 * g, 2 * b]))}")
    if rng.random() < 0.25:
        terms.append("hint")
    if rng.random() < 0.4:
        terms.append("supersede")
    return "+".join(terms) or "none"


def _workload(rng: np.random.Generator, *, unit: int, block: int, instances: int, hint: bool,
              vocab: int) -> list[RequestSpec]:
    """A random request sequence: prefix trees, multi-turn sessions, identical resends, short prompts."""
    target = int(rng.integers(8, 21))
    specs: list[RequestSpec] = []

    def seed() -> int:
        return int(rng.integers(1, 2**31))

    def length(lo: int, hi: int, aligned: float = 0.25) -> int:
        if rng.random() < aligned:                         # unit-aligned lengths: boundary cases
            return int(rng.integers(max(lo // unit, 1), max(hi // unit, 1) + 1)) * unit
        return int(rng.integers(lo, hi + 1))

    def add(kind: str, segments: list, arrive: int, after: int | None = None) -> RequestSpec:
        rid = len(specs)
        spec = RequestSpec(rid=rid, instance=(rid + offset) % instances, kind=kind, segments=segments,
                           max_tokens=int(rng.choice([1, 2, 3, 4, 6], p=[0.2, 0.25, 0.25, 0.2, 0.1])),
                           arrive=arrive, after=after)
        if rng.random() < 0.36:                            # some finish before their stage: about 30% cancel
            spec.cancel = str(rng.choice(STAGES))
            spec.cancel_after = int(rng.choice([0, 0, 1, 2, 4]))
        if hint and rng.random() < 0.6:
            top = max(_upper_len(spec, {s.rid: s for s in specs} | {rid: spec}) // unit, 1)
            spec.hints = sorted({int(h) * unit for h in rng.integers(1, top + 1, int(rng.integers(1, 3)))})
        specs.append(spec)
        return spec

    offset = int(rng.integers(0, 2))
    while len(specs) < target:
        t0 = int(rng.integers(0, 25))
        shape = rng.choice(["tree", "session", "resend", "short"], p=[0.4, 0.3, 0.15, 0.15])
        if shape == "tree" or (shape == "resend" and not specs):
            system = ["r", seed(), length(unit, 600)]
            for _ in range(int(rng.integers(2, 6))):
                head = [system] if rng.random() < 0.8 else [["r", system[1], int(rng.integers(1, system[2] + 1))]]
                if rng.random() < 0.3:                     # a nested branch shared with a sibling
                    mid = ["r", seed(), length(1, 200)]
                    add("tree", head + [mid, ["r", seed(), length(1, 150)]], t0 + int(rng.integers(0, 4)))
                    head = head + [mid]
                add("tree", head + [["r", seed(), length(1, 200)]], t0 + int(rng.integers(0, 4)))
        elif shape == "session":
            segs = ([["r", seed(), length(unit, 400)]] if rng.random() < 0.5 else []) + [["r", seed(), length(1, 250)]]
            prev = add("session", segs, t0)
            for _ in range(int(rng.integers(1, 4))):
                segs = segs + [["o", prev.rid], ["r", seed(), length(1, 120)]]
                prev = add("session", segs, t0, after=prev.rid)
        elif shape == "resend":
            orig = specs[int(rng.integers(len(specs)))]
            wait = orig.rid if rng.random() < 0.6 else orig.after
            add("resend", [list(s) for s in orig.segments], max(orig.arrive, t0), after=wait)
        else:
            base = next((s for s in reversed(specs) if s.segments[0][0] == "r"), None)
            n = int(rng.integers(1, unit)) if rng.random() < 0.5 else int(rng.integers(1, block + 1))
            if base is not None and rng.random() < 0.5:       # a short prefix of a cached prompt
                add("short", [["r", base.segments[0][1], min(n, int(base.segments[0][2]))]], t0)
            else:
                add("short", [["r", seed(), n]], t0)
    return specs


EVICTION_CHOICES = ("lru", "value", "mixed", "probation", "utility")
"""The soak's ``--eviction`` values: one order for every round, ``mixed`` (by round parity),
``probation`` (``lru`` with ``checkpoint_probation=0``) or ``utility`` (``lru`` pages with
``checkpoint_eviction="utility"``): :func:`apply_eviction`."""


def apply_eviction(rc: RoundConfig, order: str) -> RoundConfig:
    """``rc`` with the order :func:`round_eviction` gave: ``probation`` is ``lru`` with the device
    checkpoint pool's probation at 0 (``CacheConfig.checkpoint_probation``); ``utility`` is ``lru``
    pages with the device checkpoint pool by expected saving (``CacheConfig.checkpoint_eviction``)."""
    if order == "probation":
        return replace(rc, eviction="lru", checkpoint_probation=0.0)
    if order == "utility":
        return replace(rc, eviction="lru", checkpoint_eviction="utility")
    return replace(rc, eviction=order)


def round_eviction(choice: str, round_index: int) -> str:
    """The eviction order of round ``round_index`` under the soak's ``--eviction`` ``choice``
    (``mixed``: ``value`` in odd rounds). Kept out of :func:`make_round`'s random stream, so
    every round's other draws are the same whatever the choice."""
    if choice not in EVICTION_CHOICES:
        raise ValueError(f"eviction={choice!r} must be one of {EVICTION_CHOICES}")
    if choice == "mixed":
        return "value" if round_index % 2 else "lru"
    return choice


def make_round(seed: int, round_index: int, vocab: int) -> tuple[RoundConfig, list[RequestSpec]]:
    """The configuration and request sequence of round ``round_index`` of soak ``seed``."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, round_index]))
    b = int(rng.choice([64, 128, 256]))
    g = 128 if b >= 128 and rng.random() < 0.3 else 64
    policy = _policy(rng, g, b)
    store = str(rng.choice(["none", "memory", "disk"], p=[0.3, 0.35, 0.35]))
    instances = 2 if store != "none" and rng.random() < 0.4 else 1
    specs = _workload(rng, unit=g, block=b, instances=instances, hint="hint" in policy, vocab=vocab)
    by_id = {s.rid: s for s in specs}
    need = max(-(-(_upper_len(s, by_id) + s.max_tokens - 1) // b) for s in specs)
    pages = need + int(rng.choice([0, 0, 1, 2, need, 2 * need + 4]))     # often just the largest request
    host = int(rng.choice([0, 0, 64 << 10, 256 << 10, 4 << 20]))
    config = RoundConfig(
        policy=policy, mechanism=str(rng.choice(["extract", "split"])), block_size=b, prefix_match_unit=g,
        max_num_batched_tokens=int(rng.choice([64, 128, 512, 8192])), max_num_seqs=int(rng.integers(1, 5)),
        num_kv_pages=pages, num_checkpoint_slots=int(rng.integers(1, 9)),
        host_bytes=host, host_write_through=bool(host and rng.random() < 0.3), store=store,
        store_capacity=int(rng.choice([256 << 10, 1 << 20])) if store != "none" and rng.random() < 0.3 else None,
        store_alignment=2 * b if store != "none" and rng.random() < 0.2 else None,
        instances=instances, prefetch=bool(rng.random() < 0.85),
        faults=0.03 if store != "none" and rng.random() < 0.3 else 0.0)
    return config, specs
