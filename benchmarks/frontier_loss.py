"""Where a budget loses the every-block run's reuse: a per-token attribution, simulate mode.

Run by hand (not part of the test suite)::

    python benchmarks/frontier_loss.py --trace tenants.jsonl --cells 0.05:0 0.02:0.1 0.01:0.05
    python benchmarks/frontier_loss.py --trace a.jsonl b.jsonl --variant probation --json loss.json --md loss.md

For each trace, first the every-block run (``interval=B``, nothing evicted, no host tier; as
``benchmarks/bench_frontier.py``'s baseline) gives each request's *target* ``T``: the tokens it
reuses there. Then each budget cell runs exactly as a ``bench_frontier.py`` cell of the same
variant (the same :func:`bench_frontier.cell` call: device checkpoint slots and host bytes as
fractions of the every-block peak ``P``, the host holding checkpoints only), with a
:class:`LossRecorder` attached to the real engine: the engine's
:class:`~hybridkv.engine.engine.CacheListener` hook (checkpoint evictions), and thin wrappers
that record, without changing, the calls the engine already makes (``publish``,
``install_checkpoint``, ``acquire``; the host tier's ``save_entries`` and ``load_many``; the
connector's ``write_back``). Nothing of the policy is re-implemented: at each admission the
recorder reads the live index and host tier.

At the admission of request ``i`` with joint hit ``h`` and KV hit ``k`` (tokens), when
``h < T``, its ``T - h`` lost tokens are split (every token in exactly one class):

* ``kv missing``: ``T - max(h, min(T, k))``: the KV of the target is not on the device (an
  earlier request still computing it, or evicted);
* the rest, ``(h, t]`` with ``t = min(T, k)``: let ``b*`` be the deepest boundary in ``(h, t]``
  that ever held a checkpoint (device or host) before this admission.

  - ``placement``: ``t - b*`` (or ``t - h`` without ``b*``): no checkpoint was ever placed at
    ``t``; sub-classed by the shape of the index at ``t`` when the request arrives (a
    *known branch point*: two or more earlier continuations; *inside a longer prefix*: one
    earlier continuation of at least a block, so this request is the first to branch there; a
    *prompt end*: no earlier continuation, or one shorter than a block, i.e. an earlier prompt
    ended in that block), and by whether this is the first request of the every-block run to
    reuse ``t`` (``first reuse``) or a later one;
  - ``retention``: ``b* - h``: a checkpoint at ``b*`` existed and was gone; classed by what
    happened to it on the device (``evicted`` with the uses it had, ``superseded`` tail,
    ``never`` there: host-only) and in the host (``evicted`` with how it got there:
    ``demoted``, ``through``: written through as the device published it, ``speculative``:
    host-only on probation; ``held``: still in the host but not installed; ``never``).

Requests where the budget reuses more than the target are summed as ``gain``, so
``every-block reused - cell reused = loss - gain`` (checked). Shares are of the every-block
run's reused tokens, the frontier's denominator.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import NoReturn

from rich.console import Console

import hybridkv.replay.instance as _instance
from hybridkv.replay.runner import ReplayOptions, run_replay

_spec = importlib.util.spec_from_file_location("bench_frontier", Path(__file__).resolve().parent / "bench_frontier.py")
bench_frontier = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_frontier)

CELLS = ((0.05, 0.0), (0.02, 0.10), (0.01, 0.05))
"""Default (device share, host share) cells: issue 33's three targets."""


def _uses_bucket(n: int) -> str:
    return "0 uses" if n == 0 else "1 use" if n == 1 else "2+ uses"


class LossRecorder:
    """Records what the engine's cache does and attributes each admitted request's lost tokens.

    Args:
        targets: trace index -> the every-block run's reused tokens (``None``: this is the
            every-block run itself; the recorder then fills :attr:`hits`).
        first_reuse: trace index -> whether the request is the first of the every-block run to
            reuse its target boundary (from the every-block recorder's :meth:`first_reuse`).

    Attributes:
        hits: trace index -> ``(hit tokens, key of the hit boundary or None)`` of each admission.
        classes: class name -> lost tokens (see the module docstring).
        gain: tokens reused beyond the targets.
    """

    def __init__(self, targets: dict[int, int] | None = None, first_reuse: dict[int, bool] | None = None) -> None:
        self.targets = targets
        self.first = first_reuse or {}
        self.hits: dict[int, tuple[int, bytes | None]] = {}
        self.classes: Counter = Counter()
        self.shapes: Counter = Counter()
        self.gaps: list[tuple[int, int]] = []
        self.gain = 0
        self.admissions = 0
        self._index_of: dict[int, int] = {}           # id(request hashes) -> trace index
        self._dev: dict[bytes, list] = {}             # key -> [state, label, uses when evicted]
        self._uses: Counter = Counter()               # key -> admissions that hit it (device)
        self._host: dict[bytes, str] = {}             # key -> how it last entered the host
        self._host_uses: Counter = Counter()
        self._in_write_back = False
        self.engine = None
        self.host = None

    # -- the engine's listener (CacheListener) -------------------------------------------
    def stored(self, unit_keys, checkpoint_keys, retired_keys, checkpoint_boundaries=(), first_unit=None) -> None:
        """Publications are recorded by the ``publish`` wrapper (it has the labels)."""

    def evicted(self, entries) -> None:
        """Device checkpoints about to go (alone, or with their KV)."""
        for e in entries:
            if e.checkpoint is not None:
                d = self._dev.get(e.key)
                if d is None:
                    d = self._dev[e.key] = ["evicted", "?", 0, 0]
                d[0], d[2], d[3] = "evicted", self._uses[e.key], self.admissions

    # -- wiring ----------------------------------------------------------------------------
    def build(self, original):
        """A ``build_engine`` that passes this recorder as the listener and attaches it."""
        def wrapped(*args, **kwargs):
            kwargs["listener"] = self
            built = original(*args, **kwargs)
            self.attach(built)
            return built
        return wrapped

    def attach(self, built) -> None:
        """Wrap (record-only) the calls of ``built``'s engine, coordinator, connector and host tier."""
        engine, cache = built.engine, built.engine.cache
        self.engine, self.host = engine, built.host_tier
        self.g = cache.config.prefix_match_unit
        add, publish, acquire, install = engine.add_request, cache.publish, cache.acquire, cache.install_checkpoint

        def add_request(req):
            out = add(req)
            self._index_of[id(req.hashes)] = int(req.request_id[1:])
            return out

        def publish_(alloc, hashes, computed, checkpoints):
            res = publish(alloc, hashes, computed, checkpoints)
            for b, label in res.created:          # evicted again within this call: by a later one of it
                gone = alloc.nodes[b // self.g - 1].checkpoint is None
                self._dev[hashes[b // self.g - 1]] = ["evicted" if gone else "resident",
                                                      label + (", same publish" if gone else ""), 0, self.admissions]
            for b in res.retired:
                self._dev[hashes[b // self.g - 1]][0] = "superseded"
            return res

        def install_(hashes, ckpt, boundary):
            ok = install(hashes, ckpt, boundary)
            key = hashes[boundary // self.g - 1]
            d = self._dev.get(key)
            if ok and (d is None or d[0] != "resident"):
                self._dev[key] = ["resident", "promoted", 0, 0]
            return ok

        def acquire_(match, num_tokens):
            alloc = acquire(match, num_tokens)
            if alloc is not None:
                self._admitted(match)
            return alloc

        engine.add_request, cache.publish, cache.acquire, cache.install_checkpoint = (
            add_request, publish_, acquire_, install_)
        host = built.host_tier
        if host is None:
            return
        conn, save, load = engine.connector, host.save_entries, host.load_many
        write_back = conn.write_back
        state = host.state_group

        def write_back_(evicted):
            self._in_write_back = True
            try:
                write_back(evicted)
            finally:
                self._in_write_back = False

        def save_(entries, owner=None, speculative=(), **kwargs):
            keys = [(e[0], e[2]) for e in entries]
            before = host.exists(keys)
            out = save(entries, owner=owner, speculative=speculative, **kwargs)
            for (key, grp), was, now in zip(keys, before, out):
                if grp == state and now and not was:
                    self._host[key] = ("demoted" if self._in_write_back
                                       else "speculative" if key in speculative else "through")
            return out

        def load_(hashes, wanted, owner=None):
            out = load(hashes, wanted, owner=owner)
            for (b, grp), got in zip(wanted, out):
                if grp == state and got is not None:
                    self._host_uses[host.chain_hash(hashes, b)] += 1
            return out

        conn.write_back, host.save_entries, host.load_many = write_back_, save_, load_

    # -- attribution -------------------------------------------------------------------------
    def _admitted(self, m) -> None:
        i = self._index_of[id(m.hashes)]
        g, h, hashes = self.g, m.hit, m.hashes
        key = hashes[h // g - 1] if h else None
        if key is not None:
            self._uses[key] += 1
        self.admissions += 1
        self.hits[i] = (h, key)
        if self.targets is None:
            return
        t_full = self.targets.get(i, 0)
        if h >= t_full:
            self.gain += h - t_full
            return
        t = min(t_full, m.kv_hit)
        if t_full > max(h, t):
            self.classes["kv missing"] += t_full - max(h, t)
        if t <= h:
            return
        best = next((b for b in range(t // g * g, h, -g) if hashes[b // g - 1] in self._dev
                     or hashes[b // g - 1] in self._host), None)
        shape = self._shape(m.path, t)
        self.shapes[shape] += t - h
        if best is None or best < t:
            first = "first reuse" if self.first.get(i, False) else "later reuse"
            self.classes[f"placement: {shape}, {first}"] += t - (best or h)
        if best is not None:
            bkey = hashes[best // g - 1]
            node = m.path[best // g - 1]
            self.classes[f"retention: {self._fate(bkey, node.checkpoint is not None)}"] += best - h
            d = self._dev.get(bkey)
            if d is not None and d[0] == "evicted":
                self.gaps.append((self.admissions - d[3], best - h))

    def _shape(self, path, t: int) -> str:
        """What the index held past ``t`` (tokens) when the request arrived."""
        node = path[t // self.g - 1]
        kids = node.children
        if len(kids) >= 2:
            return "known branch point"
        depth, n = 0, node
        while len(n.children) == 1 and depth * self.g < 512:
            n = next(iter(n.children.values()))
            depth += 1
        return "inside a longer prefix" if depth * self.g >= 512 else "prompt end"

    def _fate(self, key: bytes, on_path: bool) -> str:
        """Where the checkpoint ``key`` went (``on_path``: the index node still holds one)."""
        d = self._dev.get(key)
        if d is None:
            dev = "device never"
        elif d[0] == "evicted":
            dev = f"device evicted ({d[1]}, {_uses_bucket(d[2])})"
        elif d[0] == "resident" and not on_path:     # detached without the eviction callback
            dev = f"device dropped unannounced ({d[1]})"
        else:
            dev = f"device {d[0]} ({d[1]})"
        if self.host is None:
            return dev
        how = self._host.get(key)
        if how is None:
            host = "host never"
        elif self.host.exists([(key, self.host.state_group)])[0]:
            host = f"host held ({how}), not installed"
        else:
            host = f"host evicted ({how}, {_uses_bucket(self._host_uses[key])})"
        return f"{dev}; {host}"

    def first_reuse(self) -> dict[int, bool]:
        """Trace index -> whether its hit boundary had not been hit before (every-block run)."""
        seen, out = set(), {}
        for i in sorted(self.hits):
            key = self.hits[i][1]
            out[i] = key is not None and key not in seen
            if key is not None:
                seen.add(key)
        return out


@contextlib.contextmanager
def recording(rec: LossRecorder):
    """Inside the block, every engine a replay builds is recorded by ``rec``."""
    original = _instance.build_engine
    _instance.build_engine = rec.build(original)
    try:
        yield rec
    finally:
        _instance.build_engine = original


def every_block(trace: str | None, limit: int | None, block: int, console: Console) -> tuple[dict, LossRecorder]:
    """The every-block run (``interval=block``, nothing evicted, no host tier), recorded."""
    rec = LossRecorder()
    with recording(rec):
        r = run_replay(ReplayOptions(trace=trace, limit=limit, simulate=True, progress=False, host_bytes=0,
                                     policy=f"interval={block}", block_tokens=block), console)
    return {"reused_tokens": r.reused_tokens, "checkpoint_bytes_peak": r.checkpoint_bytes_peak,
            "requests": r.requests}, rec


def attribute(trace: str | None, limit: int | None, block: int, base: dict, base_rec: LossRecorder,
              device: float, host: float, variant: str, console: Console, slot_bytes: int) -> dict:
    """One ``bench_frontier`` cell, recorded; its loss classes in tokens and as shares."""
    targets = {i: h for i, (h, _) in base_rec.hits.items()}
    rec = LossRecorder(targets, base_rec.first_reuse())
    with recording(rec):
        row = bench_frontier.cell(trace, limit, block, base["checkpoint_bytes_peak"], slot_bytes, variant,
                                  device, host, None, console)
    loss = sum(rec.classes.values())
    if base["reused_tokens"] - row["reused_tokens"] != loss - rec.gain:
        raise AssertionError(f"attribution does not add up: every-block {base['reused_tokens']} - cell "
                             f"{row['reused_tokens']} != loss {loss} - gain {rec.gain}")
    den = base["reused_tokens"]
    # an every-block run that reuses nothing (e.g. a one-request trace) has nothing to lose: every
    # share is 0 of 0 tokens, reported as 0.0 (the token counts above stay exact)
    scale = 1 / den if den else 0.0
    return {"trace": trace or "bundled", "variant": variant, "device": device, "host": host,
            "share": row["reused_tokens"] * scale, "every_block_reused": den, "loss_tokens": loss,
            "gain_tokens": rec.gain,
            "classes": dict(rec.classes.most_common()),
            "by_target_shape": {k: v * scale for k, v in rec.shapes.most_common()},
            "retention_gap_quartiles": _weighted_quartiles(rec.gaps),
            "class_shares": {k: v * scale for k, v in rec.classes.most_common()},
            "row": row}


def _weighted_quartiles(pairs: list[tuple[int, int]]) -> list[int] | None:
    """Token-weighted 25/50/75th percentiles of ``(value, tokens)`` pairs (``None``: no pairs)."""
    total = sum(w for _, w in pairs)
    if not total:
        return None
    out, acc, qs = [], 0, [0.25, 0.5, 0.75]
    for v, w in sorted(pairs):
        acc += w
        while qs and acc >= qs[0] * total:
            out.append(v)
            qs.pop(0)
    return out


def summary(rows: list[dict], top: int = 12) -> str:
    """Markdown: per cell, the share and the loss classes (points of the every-block reuse)."""
    out = []
    for r in rows:
        out.append(f"### {Path(r['trace']).stem}, device {100 * r['device']:g}% + host {100 * r['host']:g}% "
                   f"({r['variant']})\n")
        den = r["every_block_reused"]
        if not den:
            out.append(f"the every-block run reuses 0 tokens ({r['row']['reused_tokens']} reused here, "
                       f"{r['loss_tokens']} lost): no share to attribute\n")
            continue
        out.append(f"share {100 * r['share']:.2f}%: lost {100 * r['loss_tokens'] / den:.2f} points, "
                   f"gained {100 * r['gain_tokens'] / den:.2f}\n")
        groups = Counter()
        for k, v in r["class_shares"].items():
            groups[k.split(":")[0]] += v
        out.append("totals: " + ", ".join(f"{k} {100 * v:.2f}" for k, v in groups.most_common())
                   + "; (hit, target] lost by the target's shape: "
                   + ", ".join(f"{k} {100 * v:.2f}" for k, v in r["by_target_shape"].items())
                   + (f"; device evictions before the need, admissions (quartiles, token-weighted): "
                      f"{r['retention_gap_quartiles']}" if r["retention_gap_quartiles"] else "") + "\n")
        out.append("| class | points |")
        out.append("|---|---|")
        for k, v in list(r["class_shares"].items())[:top]:
            out.append(f"| {k} | {100 * v:.2f} |")
        rest = sum(list(r["class_shares"].values())[top:])
        if rest:
            out.append(f"| (other classes) | {100 * rest:.2f} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", nargs="+", default=[None], help="Mooncake-format traces (default: the bundled one)")
    p.add_argument("--limit", type=int, default=None, help="first N requests (default: the whole trace)")
    p.add_argument("--block", type=int, default=512, help="tokens per trace hash id (default 512)")
    p.add_argument("--cells", nargs="+", default=[f"{d}:{h}" for d, h in CELLS], metavar="DEVICE:HOST",
                   help="budget pairs, fractions of the every-block peak (default: 0.05:0 0.02:0.1 0.01:0.05)")
    p.add_argument("--variant", default="default", choices=list(bench_frontier.VARIANTS),
                   help="bench_frontier variant of the budget runs (default: default)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--md", help="write the markdown summary here")
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        _fail(f"--limit {args.limit}: must be at least 1 (leave it out for the whole trace)")
    if args.block < 1:
        _fail(f"--block {args.block}: must be a positive number of tokens")
    cells = []
    for c in args.cells:
        try:
            d, h = (float(x) for x in c.split(":"))
        except ValueError:
            _fail(f"--cells {c!r}: expected DEVICE:HOST, two fractions such as 0.02:0.1")
        if not (0 < d <= 1 and 0 <= h <= 1) or math.isnan(d) or math.isnan(h):
            _fail(f"--cells {c!r}: the device share must be in (0, 1] and the host share in [0, 1]")
        cells.append((d, h))
    for opt, path in (("--json", args.json), ("--md", args.md)):
        if path is not None:
            _check_writable(opt, path)
    from hybridkv.cache.config import ConfigError
    from hybridkv.replay.trace import TraceError, load_trace
    for trace in args.trace:            # every trace read before any run: a bad one fails in seconds
        try:
            load_trace(trace, limit=args.limit)     # as run_replay reads it
        except TraceError as e:         # its message starts with the file (and line)
            _fail(f"--trace {e}")
    console = Console(stderr=True)
    from hybridkv.cache.groups import KDASpec
    from hybridkv.engine.build import model_config
    slot_bytes = KDASpec.for_model(model_config("small")).page_size_bytes
    rows = []
    for trace in args.trace:
        try:
            base, base_rec = every_block(trace, args.limit, args.block, console)
        except ConfigError as e:        # the block is checked by the cache config the run builds
            _fail(f"--block {args.block}: {e}")
        for d, h in cells:
            rows.append(attribute(trace, args.limit, args.block, base, base_rec, d, h, args.variant, console,
                                  slot_bytes))
            console.print({k: rows[-1][k] for k in ("trace", "device", "host", "share", "loss_tokens")})
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=2)
    text = summary(rows)
    print(text)
    if args.md:
        Path(args.md).write_text(text)
    return 0


def _fail(message: str) -> NoReturn:
    """Print ``error: <message>`` (one line, no traceback) and exit 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _check_writable(option: str, path: str) -> None:
    """Exit 2 (via :func:`_fail`) unless ``path`` can be written, before any run: it is opened for
    append (nothing in an existing file changes) and removed again if it did not exist."""
    target = Path(path)
    if target.is_dir():
        _fail(f"{option} {path}: is a directory")
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as e:
        _fail(f"{option} {path}: cannot write there ({e.strerror or e})")
    if not existed:
        target.unlink(missing_ok=True)

if __name__ == "__main__":
    sys.exit(main())
