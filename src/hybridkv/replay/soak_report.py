"""What a soak reports: its failing rounds (with shrunk sequences) and its totals."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING

from hybridkv.replay.soak_rounds import STAGES, RequestSpec, RoundConfig

if TYPE_CHECKING:
    from hybridkv.replay.soak import RunResult


@dataclass(slots=True)
class SoakFailure:
    """A failing round: enough to reproduce it and the smallest sequence that still fails."""

    round: int
    kind: str
    detail: str
    config: dict
    requests: int
    shrunk: list[dict]
    shrink_runs: int
    reproduce: str

    def render(self, vocab: int) -> str:
        """Several lines for a terminal."""
        lines = [f"FAILURE in round {self.round}: {self.kind}: {self.detail.splitlines()[0] if self.detail else ''}",
                 f"  config: {json.dumps(self.config)}",
                 (f"  smallest failing sequence ({len(self.shrunk)} of {self.requests} requests, "
                  f"{self.shrink_runs} shrink runs):")]
        lines += ["    " + RequestSpec(**s).describe(vocab) for s in self.shrunk]
        lines.append(f"  reproduce: {self.reproduce}")
        return "\n".join(lines)


def add_counts(into: dict, counts: Mapping) -> None:
    """Add ``counts`` (key -> number) into ``into`` key by key."""
    for k, n in counts.items():
        into[k] = into.get(k, 0) + n


@dataclass(slots=True)
class SoakCounters:
    """The counters a run of a request sequence and a whole soak share (tokens, bytes, seconds).

    Attributes:
        checks: finished requests compared with a full prefill.
        routing_ties: finished requests that differ from the first position on which the full
            prefill's MoE routing is a tie (:func:`check_request`); not counted as checks.
        argmax_ties: finished requests whose logits all agree but whose greedy tokens differ only
            where the full prefill's logits of the two tokens are within the argmax-tie tolerance
            (:func:`check_request`); not counted as checks.
        max_abs_logit_diff: largest difference over every check.
        evicted_pages, evicted_checkpoints: device evictions (all engines).
        store_hit_tokens, host_hit_tokens: hit tokens the store / host tiers supplied.
        reused_tokens, prompt_tokens: over all admitted requests.
        rejected: refused requests (each is also a failure).
        store_misses: store-tier misses by reason (plain dicts, JSON-ready: add with
            :func:`add_counts`).  prefetch_used: installs served by a prefetch.
        faults_injected: store fault kind -> faults injected.  max_store_call_seconds: longest
            store call in rounds with faults (seconds).
    """

    checks: int = 0
    routing_ties: int = 0
    argmax_ties: int = 0
    max_abs_logit_diff: float = 0.0
    evicted_pages: int = 0
    evicted_checkpoints: int = 0
    store_hit_tokens: int = 0
    host_hit_tokens: int = 0
    reused_tokens: int = 0
    prompt_tokens: int = 0
    rejected: int = 0
    store_misses: dict = field(default_factory=dict)
    prefetch_used: int = 0
    faults_injected: dict = field(default_factory=dict)
    max_store_call_seconds: float = 0.0

    _MAXIMA = ("max_abs_logit_diff", "max_store_call_seconds")

    def merge(self, other: SoakCounters) -> None:
        """Add ``other``'s counters to these: sums, per-key sums of the dicts, maxima of the
        ``max_*`` fields."""
        for f in fields(SoakCounters):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name in self._MAXIMA:
                setattr(self, f.name, max(mine, theirs))
            elif isinstance(mine, dict):
                add_counts(mine, theirs)
            else:
                setattr(self, f.name, mine + theirs)


@dataclass(slots=True)
class SoakReport(SoakCounters):
    """What a soak did (tokens, bytes, seconds): the :class:`SoakCounters` of every round, plus

    Attributes:
        seed: the soak seed (required).  rounds: rounds run (``first_round`` onward).
        mismatches: checks that failed.  cancellations: stage -> requests cancelled there.
        requests: requests submitted.
        leaks: leak findings after draining.  exceptions: rounds that raised.
        failures: the failing rounds (:class:`SoakFailure`) with shrunk sequences.
        coverage: settings -> how many rounds used each value.
        wall_seconds: whole run.  command: the command that reruns exactly these rounds.
    """

    seed: int = -1
    first_round: int = 0
    rounds: int = 0
    mismatches: int = 0
    cancellations: dict = field(default_factory=lambda: dict.fromkeys(STAGES, 0))
    requests: int = 0
    leaks: int = 0
    exceptions: int = 0
    failures: list[SoakFailure] = field(default_factory=list)
    coverage: dict = field(default_factory=dict)
    wall_seconds: float = 0.0
    command: str = ""

    @property
    def ok(self) -> bool:
        """No failure of any kind."""
        return not self.failures

    def to_dict(self) -> dict:
        """JSON-ready form (``ok`` first)."""
        return {"ok": self.ok, **asdict(self)}

    def add(self, rc: RoundConfig, res: RunResult) -> None:
        """Merge one round."""
        self.rounds += 1
        self.merge(res)
        self.mismatches += sum(f.kind == "mismatch" for f in res.failures)
        for stage, n in res.cancellations.items():
            self.cancellations[stage] = self.cancellations.get(stage, 0) + n
        self.requests += res.submitted
        self.leaks += sum(f.kind == "leak" for f in res.failures)
        self.exceptions += any(f.kind == "exception" for f in res.failures)
        for key, value in (("mechanism", rc.mechanism), ("block_size", rc.block_size),
                           ("prefix_match_unit", rc.prefix_match_unit), ("store", rc.store),
                           ("instances", rc.instances), ("host", bool(rc.host_bytes)), ("faults", bool(rc.faults)),
                           ("max_num_batched_tokens", rc.max_num_batched_tokens), ("eviction", rc.eviction)):
            counts = self.coverage.setdefault(key, {})
            counts[str(value)] = counts.get(str(value), 0) + 1

    def summary(self) -> str:
        """A few lines for a terminal."""
        c = ", ".join(f"{k} {v}" for k, v in self.cancellations.items())
        return "\n".join([
            (f"soak seed {self.seed}: {self.rounds} rounds, {self.checks} checks, {self.mismatches} mismatches, "
             f"{self.routing_ties} routing ties, {self.argmax_ties} argmax ties, "
             f"max |dlogit| {self.max_abs_logit_diff:.3g}, {self.leaks} leaks, "
             f"{self.exceptions} exceptions, "
             f"{self.rejected} rejected, {self.wall_seconds:.1f} s"),
            f"  requests {self.requests}; cancelled: {c}",
            (f"  evicted: {self.evicted_pages} pages, {self.evicted_checkpoints} checkpoints; reused "
             f"{self.reused_tokens} of {self.prompt_tokens} prompt tokens (store {self.store_hit_tokens}, "
             f"host {self.host_hit_tokens}); store misses {self.store_misses}"),
            f"  store faults injected {self.faults_injected}; longest store call {self.max_store_call_seconds:.3f} s",
            f"  reproduce: {self.command}",
        ])
