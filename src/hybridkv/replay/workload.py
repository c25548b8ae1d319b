"""What a replay's mode changes in its work: the values a ``--simulate`` run uses where a model run
of the same command line would use others, and how a real timed run prices its routing.

A simulation is compared with a real run by adding ``--simulate`` to the real run's command line.
Several defaults depend on the mode (the trace's lengths, the requests replayed, the output
length, the pool sizes, the lower tiers, what times a step), so that pair replays different work
unless the command line pins them. :func:`workload_notes` lists each such value with why it
differs and the option that pins it; ``hybridkv replay`` prints them before it runs and writes
them to the report (``workload_notes``). An empty list: the two runs replay the same work.
"""

from __future__ import annotations

from dataclasses import dataclass

MODEL_RUN_BLOCK_TOKENS = 64
"""``--block-tokens`` of a model run when not given (prompts scaled 1/8: the CPU models run them)."""
SIMULATED_BLOCK_TOKENS = 512
"""``--block-tokens`` of a ``--simulate`` run when not given (the trace's own block)."""
MODEL_RUN_LIMIT = 40
"""Requests a model run replays when neither ``--limit`` nor ``--all`` is given."""
MODEL_RUN_OUTPUT_TOKENS = 4
"""Tokens a model run generates per request when ``--max-output-tokens`` is not given."""


@dataclass(frozen=True, slots=True)
class WorkloadNote:
    """One value of this run that differs from what the other mode would use.

    Attributes:
        option: the command-line option that pins it (e.g. ``--block-tokens``).
        this_run: the value this run uses, as text.
        other_mode: the value the same command line uses in the other mode, as text: for a
            ``--simulate`` run the model run's (no ``--simulate``), for a real run the simulation's.
        simulate: whether this run is the simulated one (the console line names the other mode).
        why: why the modes differ, and how to make them agree.
    """

    option: str
    this_run: str
    other_mode: str
    why: str
    simulate: bool = True

    def as_dict(self) -> dict[str, str]:
        """``{option, this_run, other_mode, why}``."""
        return {"option": self.option, "this_run": self.this_run, "other_mode": self.other_mode, "why": self.why}

    def line(self) -> str:
        """One console line."""
        other = "without --simulate" if self.simulate else "with --simulate"
        return f"{self.option}: {self.this_run}; {other}: {self.other_mode}. {self.why}"


def workload_notes(opts, requests: int, checkpoint_slots: int, cost_model: str | None) -> list[WorkloadNote]:
    """The values in which this run's work differs from the same command line in the other mode.

    For a ``--simulate`` run: every value that differs from the model run's (``--limit`` left to its
    mode's default, ``--block-tokens``, the output length, the default ``--checkpoint-slots``, and
    with ``--timed`` the step times, the shared store and the host tier). For a real ``--timed`` run:
    the cost model its router prices prefill with when ``--cost-model`` is not given (a flat CPU
    estimate, not the model a simulation of it prices steps with).

    Args:
        opts: the run's :class:`~hybridkv.replay.runner.ReplayOptions` as given (``block_tokens``,
            ``max_output_tokens``, ``num_checkpoint_slots``, ``cost_model`` still ``None`` when not given).
        requests: requests this run replays.
        checkpoint_slots: checkpoint slots per instance this run uses (a model run of the same
            requests defaults to ``max(16, 4 * requests)``).
        cost_model: name of the cost model that prices steps (simulated) or the router (real timed).
    """
    model_run_slots = max(16, 4 * requests)
    notes: list[WorkloadNote] = []
    if not opts.simulate:
        if opts.timed and opts.cost_model is None:
            notes.append(WorkloadNote(
                "--cost-model", f"the router prices prefill with {cost_model}",
                "steps and router priced by the simulation's default cost model", simulate=False, why=(
                "a real timed run measures its steps, but its router (and the queued seconds it books) prices "
                "prefill with this flat estimate, not with the cost model a simulation of it uses: give "
                "--cost-model FILE (hybridkv calibrate --from-steps) to both runs to price routing alike")))
        return notes
    if opts.defaulted_limit:
        notes.append(WorkloadNote(
            "--limit", f"all {requests:,} requests", f"the first {MODEL_RUN_LIMIT}",
            "the CPU model takes seconds per request, so a model run replays 40 by default; give --limit N to both"))
    if opts.block_tokens is None:
        notes.append(WorkloadNote(
            "--block-tokens", f"{SIMULATED_BLOCK_TOKENS} tokens per trace hash id (the trace's real lengths)",
            f"{MODEL_RUN_BLOCK_TOKENS} (prompts scaled down 8x so the CPU model can run them)",
            f"prompts are 8x longer here; give --block-tokens {MODEL_RUN_BLOCK_TOKENS} to replay the model run's prompt lengths"))
    model_out = opts.max_output_tokens or MODEL_RUN_OUTPUT_TOKENS
    if not opts.timed:
        if model_out != 1:
            notes.append(WorkloadNote(
                "--max-output-tokens", "1 token per request", f"{model_out} tokens per request",
                "an untimed simulation generates the first token only (no decode is modelled without a clock)"))
    elif opts.max_output_tokens is None:
        notes.append(WorkloadNote(
            "--max-output-tokens", "the trace's output lengths, uncapped", f"{MODEL_RUN_OUTPUT_TOKENS} tokens per request",
            "a timed simulation models the whole decode; give --max-output-tokens 4 to replay the model run's output lengths"))
    if opts.num_checkpoint_slots is None and checkpoint_slots != model_run_slots:
        notes.append(WorkloadNote(
            "--checkpoint-slots", f"{checkpoint_slots:,} (the most the policy can create)",
            f"{model_run_slots:,} (4 per request)",
            "a model run's pool holds real states and is sized smaller, so it may evict checkpoints this run "
            "keeps; give --checkpoint-slots N to both"))
    if opts.timed:
        notes.append(WorkloadNote(
            "--cost-model", f"steps priced by {cost_model}", "steps measured (their wall or CPU seconds, --step-clock)",
            "a simulation prices every step with a cost model; to predict a real run on this machine give both runs "
            "--cost-model FILE fitted by hybridkv calibrate --from-steps"))
        if opts.instances > 1 and opts.store_gbps > 0:
            gib = "unlimited" if opts.store_gib == 0 else f"{1024 if opts.store_gib is None else opts.store_gib:g} GiB"
            notes.append(WorkloadNote(
                "--store-gbps", f"a modelled shared store: {opts.store_gbps:g} GB/s, "
                f"{opts.store_latency_s * 1e6:g} us per object, {gib}",
                "the engines' store tier (a fresh disk store unless --store names one), timed by its real I/O",
                "give both runs --store-gbps and --store-latency-us measured for the real store (its router prices "
                "loads with them too)"))
        if opts.host_bytes:
            notes.append(WorkloadNote(
                "--host-mib", "no host tier (a simulated timed fleet builds none)",
                f"a {opts.host_bytes >> 20} MiB host tier per instance (evicted entries written back, "
                "host-only checkpoints written through)",
                "give both runs --host-mib 0 to compare like with like"))
    return notes
