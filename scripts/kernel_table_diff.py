"""Two kernel tables of one program (`probe_launch.py --kernel-table`, the `roundtable` part of gpu_session.sh)
side by side: what a change took away, added and moved, per kernel and per family.

Kernel names do not survive a recompile (XLA numbers its fusions, a Pallas kernel's name gets `__N` suffixes), so
rows are matched by what they are: a Pallas / library kernel by its base name (`moe_decode_gate_up__1` counts as
`moe_decode_gate_up`), an XLA fusion by the HLO it came from (its op_name without the program's jit prefix, and its
output shape). Times are microseconds per program call, summed over the launches of each key.

    python scripts/kernel_table_diff.py BASE.jsonl NEW.jsonl            # one program
    python scripts/kernel_table_diff.py BASE_PREFIX NEW_PREFIX --programs step draft verify
        # PREFIX + "_round_<program>_*.jsonl" under --dir (benchmarks/results/kernel_tables by default), e.g.
        # 4615334 against a new run's tables copied there
    python scripts/kernel_table_diff.py 4615334 $OUT/probe --probe   # a roundtable run's tables against 4615334's
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fnx.pallas import ledger  # noqa: E402


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def key(row: dict) -> str:
    """What a row is, independent of the compile's numbering."""
    name = row["kernel"]
    if row.get("op") or row.get("op_name"):
        op_name = re.sub(r"^jit\([^)]*\)/", "", row.get("op_name", "")) or row.get("op", "?")
        return f"xla {op_name} {row.get('shape', '')}".strip()
    return re.sub(r"(__\d+)+$", "", name)


def family(row: dict) -> str:
    """The ledger's family (`fnx.pallas.ledger.classify`: the kernel's name, and a library kernel's HLO op), so the
    families add up as in bench_decode's ledgers (an XLA fusion is "xla_other" whatever scope it came from)."""
    return ledger.classify(row["kernel"], {"hlo_op": row["hlo_op"]} if row.get("hlo_op") else None)


def summarize(rows: list[dict]) -> tuple[dict, dict]:
    """({key: [launches, us]}, {family: [launches, us]}) per program call."""
    by_key: dict = collections.defaultdict(lambda: [0.0, 0.0])
    by_fam: dict = collections.defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        for table, k in ((by_key, key(r)), (by_fam, family(r))):
            table[k][0] += r["per_call"]
            table[k][1] += r["us_per_call"]
    return dict(by_key), dict(by_fam)


def diff(base: list[dict], new: list[dict], top: int = 30) -> dict:
    """Totals, families and the keys whose time moved most (gone: only in base; new: only in new)."""
    kb, fb = summarize(base)
    kn, fn = summarize(new)
    total = lambda t: [round(sum(v[0] for v in t.values()), 2), round(sum(v[1] for v in t.values()), 2)]  # noqa
    rows = []
    for k in set(kb) | set(kn):
        a, b = kb.get(k, [0.0, 0.0]), kn.get(k, [0.0, 0.0])
        state = "gone" if k not in kn else "new" if k not in kb else ""
        rows.append({"key": k, "state": state, "launches": [a[0], b[0]], "us": [round(a[1], 2), round(b[1], 2)],
                     "delta_us": round(b[1] - a[1], 2)})
    rows.sort(key=lambda r: -abs(r["delta_us"]))
    fams = {f: {"launches": [fb.get(f, [0, 0])[0], fn.get(f, [0, 0])[0]],
                "us": [round(fb.get(f, [0, 0])[1], 2), round(fn.get(f, [0, 0])[1], 2)]}
            for f in sorted(set(fb) | set(fn))}
    return {"total": {"launches": [total(kb)[0], total(kn)[0]], "us": [total(kb)[1], total(kn)[1]]},
            "families": fams, "moved": rows[:top]}


def print_diff(name: str, d: dict) -> None:
    t = d["total"]
    print(f"== {name}: {t['launches'][0]:.0f} -> {t['launches'][1]:.0f} launches, "
          f"{t['us'][0]:.1f} -> {t['us'][1]:.1f} us ({t['us'][1] - t['us'][0]:+.1f})")
    for f, v in d["families"].items():
        if v["us"][0] != v["us"][1] or v["launches"][0] != v["launches"][1]:
            print(f"   {f:12s} {v['launches'][0]:5.0f} -> {v['launches'][1]:5.0f} launches  "
                  f"{v['us'][0]:8.1f} -> {v['us'][1]:8.1f} us")
    for r in d["moved"]:
        if r["delta_us"] == 0 and r["launches"][0] == r["launches"][1]:
            continue
        print(f"   {r['delta_us']:+8.2f} us  {r['launches'][0]:3.0f} -> {r['launches'][1]:3.0f}  "
              f"{r['state']:4s} {r['key'][:100]}")


def _program_file(directory: str, prefix: str, program: str) -> str:
    hits = sorted(glob.glob(os.path.join(directory, f"{prefix}_round_{program}_*.jsonl")))
    if len(hits) != 1:
        raise SystemExit(f"{prefix!r} / {program}: {len(hits)} tables under {directory} "
                         f"({[os.path.basename(h) for h in hits]}); give a longer prefix or the files")
    return hits[0]


def _probe_file(directory: str, program: str) -> str:
    """A new run's table as probe_launch.py writes it: kernel_table_<label>.jsonl (the step),
    kernel_table_draft_<label>.jsonl, kernel_table_verify_<label>.jsonl."""
    names = sorted(glob.glob(os.path.join(directory, "kernel_table_*.jsonl")))
    if program == "step":
        hits = [n for n in names if not re.search(r"kernel_table_(draft|verify)_", os.path.basename(n))]
    else:
        hits = [n for n in names if os.path.basename(n).startswith(f"kernel_table_{program}_")]
    if len(hits) != 1:
        raise SystemExit(f"{program}: {len(hits)} probe tables under {directory} "
                         f"({[os.path.basename(h) for h in hits]})")
    return hits[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--programs", nargs="*", default=None,
                    help="with prefixes: the programs to compare (step, draft, verify)")
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results",
                                                  "kernel_tables"))
    ap.add_argument("--probe", action="store_true",
                    help="NEW is a probe_launch.py --out folder (its kernel_table_*.jsonl), BASE a committed prefix")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", action="store_true", help="one JSON line per program instead of the text")
    args = ap.parse_args()
    if args.probe:
        pairs = [(p, _program_file(args.dir, args.base, p), _probe_file(args.new, p))
                 for p in (args.programs or ("step", "draft", "verify"))]
    elif args.programs:
        pairs = [(p, _program_file(args.dir, args.base, p), _program_file(args.dir, args.new, p))
                 for p in args.programs]
    else:
        pairs = [(os.path.basename(args.new), args.base, args.new)]
    for name, a, b in pairs:
        d = diff(load(a), load(b), args.top)
        if args.json:
            print(json.dumps({"program": name, "base": os.path.basename(a), "new": os.path.basename(b), **d}))
        else:
            print_diff(name, d)


if __name__ == "__main__":
    main()
