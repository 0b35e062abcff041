"""Which settings of a `--round-variants` sweep (`scripts/probe_launch.py`, `gpu_session.sh roundsweep`) won, and
the winners' settings merged into one environment for the next run (the 48-layer `full` part).

Each variant is compared with its own sweep's first variant (the baseline) by kernel time per program call (or, with
`--by chained`, by the wall time per call of back-to-back calls, which `probe_launch.py --variant-chain` records): the
MTP round (draft + verify) and the decode step. A variant wins when it cuts either by at least --min-gain-us and
makes neither worse by more than --tolerance-us. Winners' settings are merged item by item: FNX_KERNELS by op, the
tile knobs (`FNX_*_TILES`) by field, other variables whole; where two winners set one item differently, the one with
the larger gain keeps it.

    python scripts/pick_winners.py gpu_out/probe/probe.jsonl [more.jsonl ...]
    eval "$(python scripts/pick_winners.py FILES --export)"      # the merged settings as export lines
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

ITEMIZED = ("FNX_KERNELS",)     # and every FNX_*_TILES variable: comma-separated key=value items
BY_SHAPE = {"FNX_GEMV_TILES": "/"}   # items per call shape ("fmt:N:K:M=fields"), apart by this separator


def load(paths: list[str]) -> list[dict]:
    recs = []
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    rec = json.loads(line)
                    if rec.get("part") == "round variant" and "error" in rec:   # did not compile: no timing
                        print(f"# variant {rec['variant']!r} failed: {rec['error']}", file=sys.stderr)
                    elif rec.get("part") == "round variant":
                        recs.append(rec)
    return recs


METRICS = {"kernel": "busy_us_per_call", "chained": "chained_us_per_call"}


def busy(rec: dict, program: str, by: str = "kernel") -> float | None:
    """A program's time per call in `rec`: kernel time ("kernel"), or the wall time per call of back-to-back calls
    ("chained", launch gaps and host time included; `probe_launch.py --variant-chain`)."""
    p = rec["programs"].get(program)
    if p is None:
        return None
    if METRICS[by] not in p:
        raise SystemExit(f"variant {rec['variant']!r}: its {program} record has no {METRICS[by]} (a sweep run "
                         "without --variant-chain has kernel times only: --by kernel)")
    return p[METRICS[by]]


def gains(recs: list[dict], by: str = "kernel") -> list[dict]:
    """Per non-baseline variant: its gains in us against its sweep's baseline (positive: less time, by `by`)."""
    by_sweep: dict[str, list[dict]] = {}
    for r in recs:
        by_sweep.setdefault(r.get("sweep", "?"), []).append(r)
    out = []
    for sweep, rs in by_sweep.items():
        base_label = rs[0].get("base", rs[0]["variant"])
        base = next((r for r in rs if r["variant"] == base_label), None)
        if base is None:
            raise SystemExit(f"sweep {sweep}: its baseline {base_label!r} has no record (did the run stop early?)")
        for r in rs:
            if r is base:
                continue
            g = {"sweep": sweep, "variant": r["variant"], "settings": r["settings"]}
            for prog in ("decode", "draft", "verify"):
                a, b = busy(base, prog, by), busy(r, prog, by)
                g[prog] = None if a is None or b is None else round(a - b, 2)
            g["round"] = None if g["draft"] is None or g["verify"] is None else round(g["draft"] + g["verify"], 2)
            out.append(g)
    return out


def wins(g: dict, min_gain: float, tol: float) -> bool:
    vals = [v for v in (g["round"], g["decode"]) if v is not None]
    return bool(vals) and max(vals) >= min_gain and min(vals) >= -tol


def _items(name: str, value: str) -> list[tuple[str, str]]:
    if name in BY_SHAPE:
        return [(part.split("=", 1)[0].strip(), part.strip()) for part in value.split(BY_SHAPE[name]) if part.strip()]
    if name in ITEMIZED or name.endswith("_TILES"):
        return [(part.split("=", 1)[0].strip(), part.strip()) for part in value.split(",") if part.strip()]
    return [("", value)]


def merge(winners: list[dict]) -> dict[str, str]:
    """The winners' settings, item by item; a conflict goes to the larger gain."""
    chosen: dict[tuple[str, str], tuple[float, str]] = {}
    for g in winners:
        score = max(v for v in (g["round"], g["decode"]) if v is not None)
        for name, value in g["settings"].items():
            for key, item in _items(name, value):
                if (name, key) not in chosen or score > chosen[(name, key)][0]:
                    chosen[(name, key)] = (score, item)
    out: dict[str, list[str]] = {}
    for (name, _), (_, item) in chosen.items():
        out.setdefault(name, []).append(item)
    return {name: BY_SHAPE.get(name, ",").join(items) for name, items in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="probe.jsonl files (or logs) holding 'round variant' records")
    ap.add_argument("--min-gain-us", type=float, default=3.0, help="kernel time a winner saves at least (us per call)")
    ap.add_argument("--tolerance-us", type=float, default=2.0, help="how much worse the other program may get")
    ap.add_argument("--export", action="store_true", help="print only the merged settings as shell export lines")
    ap.add_argument("--by", choices=tuple(METRICS), default="kernel",
                    help="kernel: kernel time per call (the profiler's); chained: wall time per call of calls launched "
                         "back to back (launches and host time included: what a launch-removing variant saves)")
    args = ap.parse_args()
    recs = load(args.files)
    if not recs:
        raise SystemExit(f"no 'round variant' records in {args.files}")
    gs = gains(recs, args.by)
    winners = [g for g in gs if wins(g, args.min_gain_us, args.tolerance_us)]
    merged = merge(winners)
    if args.export:
        for name, value in merged.items():
            print(f"export {name}={shlex.quote(value)}")
        return
    fmt = lambda v: "-" if v is None else f"{v:+.1f}"  # noqa: E731
    print(f"{'variant':16s} {'step':>8s} {'draft':>8s} {'verify':>8s} {'round':>8s}  won  settings  (us saved per call, "
          f"{args.by} time)")
    for g in gs:
        mark = "yes" if g in winners else ""
        sets = " ".join(f"{k}={v}" for k, v in g["settings"].items())
        print(f"{g['variant'][:16]:16s} {fmt(g['decode']):>8s} {fmt(g['draft']):>8s} {fmt(g['verify']):>8s} "
              f"{fmt(g['round']):>8s}  {mark:3s}  {sets}")
    print("merged: " + (" ".join(f"{k}={shlex.quote(v)}" for k, v in merged.items()) or "(no winner)"))


if __name__ == "__main__":
    sys.exit(main())
