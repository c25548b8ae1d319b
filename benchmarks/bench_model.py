"""CPU prefill throughput of hybridkv.model vs transformers, and the KDA op alone.

Run by hand (not part of the test suite)::

    python benchmarks/bench_model.py                       # 1k, 4k, 16k on the `small` preset
    python benchmarks/bench_model.py --lengths 1024 4096 --threads 1 --json out.json

Both models hold the same weights (ours saved, then loaded by
``transformers.KimiLinearForCausalLM.from_pretrained``), run fp32 on CPU in the
same process, and produce only the last position's logits (a prefill). Each
figure is the best of ``--repeats`` runs after one warm-up run at 1k tokens.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from hybridkv.model.kda import kda_chunked, kda_recurrent
from hybridkv.model.model import HybridModel
from hybridkv.model.state import ForwardRequest


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_prefill(lengths, repeats, with_reference, preset="small"):
    model = HybridModel.from_preset(preset, seed=0)
    ref = None
    if with_reference:
        from transformers import KimiLinearForCausalLM

        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            ref = KimiLinearForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    rows = []
    warm = torch.randint(3, vocab, (1024,))

    def ours(ids):
        pool = model.new_kv_pool(-(-len(ids) // 64), 64)
        req = ForwardRequest(ids, 0, torch.arange(pool.num_pages))
        return model.forward_paged([req], pool)[0].logits[0]

    def theirs(ids):
        with torch.no_grad():
            return ref(ids[None], logits_to_keep=1).logits[0, -1]

    ours(warm)
    if ref is not None:
        theirs(warm)
    for T in lengths:
        ids = torch.randint(3, vocab, (T,), generator=torch.Generator().manual_seed(T))
        row = {"tokens": T}
        row["ours_s"] = _best(lambda ids=ids: ours(ids), repeats)
        row["ours_tok_s"] = T / row["ours_s"]
        if ref is not None:
            row["ref_s"] = _best(lambda ids=ids: theirs(ids), 1 if T > 4096 else repeats)
            row["ref_tok_s"] = T / row["ref_s"]
            row["speedup"] = row["ref_s"] / row["ours_s"]
            row["max_abs_logit_diff"] = float((ours(ids) - theirs(ids).float()).abs().max())
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_kda_op(T=4096, H=4, K=64, V=64, repeats=3):
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(T, H, K, generator=gen), dim=-1) * K ** -0.5
    k = torch.nn.functional.normalize(torch.randn(T, H, K, generator=gen), dim=-1)
    v = torch.randn(T, H, V, generator=gen)
    g = -torch.rand(T, H, K, generator=gen)
    beta = torch.rand(T, H, generator=gen)
    kda_chunked(q, k, v, g, beta)
    row = {"op": "kda", "T": T, "H": H, "K": K, "V": V,
           "chunked_s": _best(lambda: kda_chunked(q, k, v, g, beta), repeats),
           "recurrent_s": _best(lambda: kda_recurrent(q, k, v, g, beta), 1)}
    row["speedup"] = row["recurrent_s"] / row["chunked_s"]
    o1, _s1 = kda_recurrent(q, k, v, g, beta)
    o2, _s2, _ = kda_chunked(q, k, v, g, beta)
    row["max_abs_out_diff"] = float((o1 - o2).abs().max())
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--no-reference", action="store_true", help="skip transformers")
    ap.add_argument("--json", help="write all figures to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__}), flush=True)
    out = {"threads": torch.get_num_threads(),
           "prefill": bench_prefill(args.lengths, args.repeats, not args.no_reference, args.preset),
           "kda_op": bench_kda_op()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
