"""Checkpoint frontier across device and host (issue 12 item 1), simulate mode.

Run by hand (not part of the test suite)::

    python benchmarks/bench_frontier.py --json frontier.json                    # whole bundled trace
    python benchmarks/bench_frontier.py --limit 2000 --variants wb dense        # a shorter check
    python benchmarks/bench_frontier.py --trace other.jsonl --device 0.05 --host 0.25

First one replay with a checkpoint at every block boundary (``interval=B``, B = 512 tokens)
and pools large enough that nothing is evicted gives the baseline: its peak resident
checkpoint bytes ``P``. Each cell then gives the device ``ceil(d * P / slot bytes)``
checkpoint slots and the host tier ``floor(h * P)`` bytes of checkpoints (the host holds
checkpoints only, ``host_groups=("kda",)``: the device KV pool is sized so nothing is evicted,
as in the every-block run, so the frontier is about checkpoint bytes alone). Reported per cell:
the fraction of the every-unit oracle reused, the device's and the host's peak checkpoint
bytes as fractions of ``P`` (measured, never above the budget), demotions (device checkpoint
evictions written back), promotions (host installs) and host evictions.

Variants (``VARIANTS``; the device policy is the replay default unless named):

* ``default``: the replay default with a host tier: device evictions are demoted to the host
  (write-back), a host hit is promoted (installed into the device, evicting another, which is
  demoted), and checkpoints are written through to the host as they are computed: the device
  policy's and, for the host only (never published on the device), one every 4 blocks
  (``host_interval=4B``, :func:`hybridkv.replay.runner.default_host_interval`).
* ``wb``: write-back only (``host_interval=0``): the host gets what the device evicts.
* ``wt``: ``wb`` plus write-through of every page-aligned checkpoint the device policy creates.
* ``dense``: ``default`` with ``host_interval=B``: a checkpoint at every block on the host.
* ``dense2``: ``default`` with ``host_interval=2B``.
* ``value``: ``default`` with ``value`` eviction in the device pools (the host tier keeps
  ``--host-eviction``'s order).
* ``probation``: ``default`` with ``checkpoint_probation=0``: the device policy's ``interval``
  checkpoints wait on probation until a request uses one and are evicted before the others
  (``--checkpoint-probation``, :class:`hybridkv.store.eviction.ProbationOrder`).
* ``utility``: ``default`` with ``checkpoint_eviction="utility"``: the device checkpoint pool
  evicts by expected saving (``--checkpoint-eviction utility``,
  :class:`hybridkv.cache.pools.UtilityOrder`); without a host tier it also places a lead
  checkpoint a block past each request's KV hit (:data:`hybridkv.cache.coordinator.LEAD`).
* ``utility_protected``: ``utility`` with the host tier's probation share at 0 (host-only
  checkpoints take only the room the others leave, ``--host-probation 0``) and a protected segment
  of 30% for checkpoints loaded from the host before (``--host-protected-share 0.3``).
* ``utility7``: ``utility`` with the device policy's ``interval`` term at 7 blocks instead of
  the replay default's 14 (``--policy branch+tail=B+interval=7B+supersede``): denser speculative
  checkpoints, which the order evicts first where they are seldom used.

Each row also gives ``share``: its reused tokens as a fraction of the every-block run's (the
frontier's headline figure; ``oracle_fraction`` divides by the every-unit oracle instead).
``--png`` draws the frontier (share against device budget, one curve per host budget and
variant). The clairvoyant bound beside it: ``benchmarks/clairvoyant.py``.

``--eviction`` and ``--host-eviction`` (``lru`` / ``value``) set the device pools' and the host
tier's eviction orders for every variant (a variant's own ``eviction`` wins for the device);
unset, each is the replay default (``ReplayOptions``). Rows record both orders.
"""

from __future__ import annotations

import argparse
import json
import math
import time

from rich.console import Console

from hybridkv.replay.runner import ReplayOptions, run_replay

DEVICE = (0.02, 0.05, 0.10)
HOST = (0.0, 0.10, 0.25)
VARIANTS = {
    "default": {},
    "wb": {"host_interval": 0},
    "wt": {"host_write_through": True, "host_interval": 0},
    "dense": {"host_interval": 1},
    "dense2": {"host_interval": 2},
    "value": {"eviction": "value"},
    "probation": {"checkpoint_probation": 0.0},
    "utility": {"checkpoint_eviction": "utility"},
    "utility7": {"checkpoint_eviction": "utility", "interval_blocks": 7},
    "utility_protected": {"checkpoint_eviction": "utility", "host_probation": 0.0, "host_protected_share": 0.3},
}
"""Variant name -> replay options (``host_interval`` in blocks; ``interval_blocks``: the device
policy's ``interval`` term in blocks, the rest of the policy the replay default's)."""


def baseline(trace: str | None, limit: int | None, block: int, console: Console) -> dict:
    """The every-block run: ``interval=block``, nothing evicted, no host tier."""
    r = run_replay(ReplayOptions(trace=trace, limit=limit, simulate=True, progress=False, host_bytes=0,
                                 policy=f"interval={block}", block_tokens=block), console)
    return {"oracle_fraction": r.oracle_fraction, "checkpoint_bytes_peak": r.checkpoint_bytes_peak,
            "oracle_reused_tokens": r.oracle_reused_tokens, "requests": r.requests,
            "reused_tokens": r.reused_tokens}


def cell(trace: str | None, limit: int | None, block: int, peak: int, slot_bytes: int, variant: str,
         device: float, host: float, policy: str | None, console: Console,
         eviction: str | None = None, host_eviction: str | None = None) -> dict:
    """One replay of ``variant`` with ``device`` and ``host`` fractions of ``peak`` checkpoint bytes.

    ``eviction`` / ``host_eviction``: the device pools' / host tier's order (``"lru"`` or
    ``"value"``); ``None`` keeps the replay default (a variant's own ``eviction`` wins).
    """
    v = {**({"eviction": eviction} if eviction else {}), **dict(VARIANTS[variant])}
    if host_eviction:
        v["host_eviction"] = host_eviction
    if "host_interval" in v:
        v["host_interval"] *= block
    interval_blocks = v.pop("interval_blocks", None)
    if interval_blocks and policy is None:
        policy = f"branch+tail={block}+interval={interval_blocks * block}+supersede"
    host_bytes = int(host * peak)
    if not host_bytes:            # no host tier: the write-through options have nowhere to go
        v = {k: x for k, x in v.items() if k in ("eviction", "host_eviction", "checkpoint_probation",
                                                 "checkpoint_eviction")}
    slots = max(8, math.ceil(device * peak / slot_bytes))
    t0 = time.perf_counter()
    r = run_replay(ReplayOptions(trace=trace, limit=limit, simulate=True, progress=False, block_tokens=block,
                                 policy=policy, num_checkpoint_slots=slots, host_bytes=host_bytes,
                                 host_groups=("kda",), **v), console)
    h = r.tiers["host"]
    return {"variant": variant, "eviction": r.config["eviction"],
            "checkpoint_probation": v.get("checkpoint_probation"),
            "checkpoint_eviction": v.get("checkpoint_eviction"),
            "host_eviction": r.config["host_eviction"], "host_probation": r.config["host_probation"],
            "host_protected_share": r.config["host_protected_share"],
            "policy": r.config["policy"], "device": device, "host": host, "slots": slots, "host_bytes": host_bytes,
            "oracle_fraction": r.oracle_fraction, "reused_tokens": r.reused_tokens,
            "device_peak": r.checkpoint_bytes_peak / peak, "host_peak": h["bytes_peak"] / peak,
            "demotions": r.evictions["device"]["checkpoints"], "promotions": h["loads_taken"],
            "host_hit_tokens": h["hit_tokens"], "host_evictions": r.evictions["host"]["entries"],
            "seconds": round(time.perf_counter() - t0, 1)}


def table(rows: list[dict], base_reused: int | None = None) -> str:
    """Markdown table of the frontier (``share`` of the every-block reuse when ``base_reused``,
    the every-block run's reused tokens, is given)."""
    out = [("| variant | device budget | host budget | share of every-block | oracle fraction | device peak | "
            "host peak | demotions | promotions | host evictions |"),
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = f"{100 * r['reused_tokens'] / base_reused:.2f}%" if base_reused else "-"
        out.append(f"| {r['variant']} ({r['eviction']}/{r.get('host_eviction', 'lru')}) | {100 * r['device']:g}% | {100 * r['host']:g}% | "
                   f"{share} | {100 * r['oracle_fraction']:.2f}% | {100 * r['device_peak']:.2f}% | "
                   f"{100 * r['host_peak']:.2f}% | {r['demotions']:,} | {r['promotions']:,} | "
                   f"{r['host_evictions']:,} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=None, help="Mooncake-format trace (default: the bundled one)")
    p.add_argument("--limit", type=int, default=None, help="first N requests (default: the whole trace)")
    p.add_argument("--block", type=int, default=512, help="tokens per trace hash id (default 512)")
    p.add_argument("--device", type=float, nargs="+", default=list(DEVICE), help="device budgets, fractions of P")
    p.add_argument("--host", type=float, nargs="+", default=list(HOST), help="host budgets, fractions of P")
    p.add_argument("--cells", nargs="+", default=None, metavar="DEVICE:HOST",
                   help="budget pairs to run instead of every --device x --host pair, e.g. 0.05:0 0.02:0.1")
    p.add_argument("--variants", nargs="+", default=["default", "wb", "dense"], choices=list(VARIANTS))
    p.add_argument("--policy", default=None, help="device checkpoint policy (default: the replay default)")
    p.add_argument("--peak", type=int, default=None,
                   help="P in bytes from an earlier baseline of the same trace and limit (skips the baseline run)")
    p.add_argument("--eviction", choices=("lru", "value"), default=None,
                   help="device pools' eviction order for every variant (default: the replay default)")
    p.add_argument("--host-eviction", choices=("lru", "value"), default=None,
                   help="host tier's eviction order (default: the replay default)")
    p.add_argument("--reused", type=int, default=None,
                   help="with --peak: the every-block run's reused tokens (for the share column)")
    p.add_argument("--json", help="write baseline and rows here")
    p.add_argument("--png", help="draw the frontier here (matplotlib)")
    p.add_argument("--title", default=None, help="title of the --png plot (default: the trace)")
    p.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                   help="run nothing: table (and --png) of the rows of earlier --json files of one trace "
                        "(the baseline of the first; rows of --variants only)")
    args = p.parse_args()
    if args.from_json:
        merged(args)
        return
    console = Console(stderr=True)
    from hybridkv.cache.groups import KDASpec
    from hybridkv.engine.build import model_config
    slot_bytes = KDASpec.for_model(model_config("small")).page_size_bytes
    base = ({"checkpoint_bytes_peak": args.peak, "reused_tokens": args.reused} if args.peak
            else baseline(args.trace, args.limit, args.block, console))
    console.print(base)
    peak = base["checkpoint_bytes_peak"]
    rows, seen = [], set()
    pairs = ([tuple(float(x) for x in c.split(":")) for c in args.cells] if args.cells
             else [(d, h) for d in args.device for h in args.host])
    for variant in args.variants:
        for d, h in pairs:
            if True:
                dev_order = VARIANTS[variant].get("eviction", args.eviction)
                key = (("device only", d, dev_order, VARIANTS[variant].get("checkpoint_probation"),
                        VARIANTS[variant].get("checkpoint_eviction"), VARIANTS[variant].get("interval_blocks"))
                       if h == 0 else None)
                if key is not None and key in seen:
                    continue                  # no host: every lru variant is the same run
                seen.add(key)
                rows.append(cell(args.trace, args.limit, args.block, peak, slot_bytes, variant, d, h,
                                 args.policy, console, args.eviction, args.host_eviction))
                console.print(rows[-1])
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"baseline": base, "slot_bytes": slot_bytes, "rows": rows}, f, indent=2)
    print(table(rows, base.get("reused_tokens")))
    if args.png:
        plot(rows, base["reused_tokens"], args.png, args.title or (args.trace or "bundled trace"))


def _device_setting(variant: str, row: dict | None = None) -> tuple:
    """What a run without a host tier depends on: the device order, probation and interval term
    (of ``variant``, or as recorded in ``row``)."""
    v = VARIANTS.get(variant, {})
    if row is None:
        return v.get("checkpoint_probation"), v.get("checkpoint_eviction"), v.get("interval_blocks")
    return row.get("checkpoint_probation"), row.get("checkpoint_eviction"), v.get("interval_blocks")


def merged(args) -> None:
    """``--from-json``: the rows of ``args.variants`` from earlier ``--json`` files of one trace,
    one row per variant and cell (a later file's row wins), as a table and ``--png`` plot. A row
    without a host tier also stands for every asked variant of the same device setting (a run
    skips those cells for a second variant of that setting)."""
    base, rows = None, {}
    for path in args.from_json:
        with open(path) as f:
            data = json.load(f)
        base = base or data["baseline"]
        for r in data["rows"]:
            same = [v for v in args.variants if v == r["variant"]
                    or (r["host"] == 0 and _device_setting(v) == _device_setting(r["variant"], r))]
            for v in same:
                rows[(v, r["device"], r["host"])] = {**r, "variant": v}
    out = sorted(rows.values(), key=lambda r: (args.variants.index(r["variant"]), r["host"], r["device"]))
    print(table(out, base.get("reused_tokens")))
    if args.png:
        plot(out, base["reused_tokens"], args.png, args.title or (args.trace or "bundled trace"))


def plot(rows: list[dict], base_reused: int, path: str, title: str) -> None:
    """Share of the every-block reuse against the device budget, one line per variant and host
    budget (a device-only row belongs to every variant of its probation setting)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    hosts = sorted({r["host"] for r in rows})
    styles = ["-", "--", ":", "-."]
    for vi, variant in enumerate(variants):
        probation = VARIANTS[variant].get("checkpoint_probation")
        order = VARIANTS[variant].get("checkpoint_eviction")
        blocks = VARIANTS[variant].get("interval_blocks")
        for hi, h in enumerate(hosts):
            pts = sorted((r["device"], 100 * r["reused_tokens"] / base_reused) for r in rows
                         if r["host"] == h and (r["variant"] == variant
                                                or (h == 0 and r.get("checkpoint_probation") == probation
                                                    and r.get("checkpoint_eviction") == order
                                                    and VARIANTS.get(r["variant"], {}).get("interval_blocks") == blocks)))
            if pts:
                ax.plot([100 * x for x, _ in pts], [y for _, y in pts], styles[vi % len(styles)], marker="o",
                        color=f"C{hi}", label=f"{variant}, host {100 * h:g}%")
    ax.set_xscale("log")
    xs = sorted({100 * r["device"] for r in rows})
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.minorticks_off()
    ax.set_xlabel("device checkpoint budget, % of the every-block peak")
    ax.set_ylabel("reused tokens, % of every-block")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
