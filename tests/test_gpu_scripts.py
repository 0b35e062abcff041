"""The scripts the GPU sessions run, exercised on the CPU at tiny sizes, so device time is never spent on a script
that breaks before it measures (the numbers here mean nothing; only that the paths run and write their records)."""

import dataclasses
import gzip
import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT


# what tests/conftest.py sets for every JAX process of the suite (the CPU's compile settings and shared cache)
_INHERITED = ("JAX_DISABLE_MOST_OPTIMIZATIONS", "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


def _run(args, tmp_path, timeout=600, env=None):
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
                              **{k: v for k, v in os.environ.items() if k in _INHERITED}, **(env or {})})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_gpu_session_script_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_session.sh")]).returncode == 0


def test_bench_decode_with_host_ple_and_ledger(tmp_path):
    res = tmp_path / "d.jsonl"
    stdout = _run(["scripts/bench_decode.py", "--tiny", "--reps", "1", "--layers", "4", "--contexts", "32",
                   "--ple-store", "pageable", "--ple-table-gb", "0.01", "--ple-dir", str(tmp_path), "--ledger", "1",
                   "--out", str(res)], tmp_path)
    assert "ledger_decode" in stdout
    recs = [json.loads(line) for line in res.read_text().splitlines()]
    run = next(r for r in recs if r.get("record") == "run")
    assert run["ple_store"] == "pageable" and run["decode_ms"] > 0 and run["mtp_round_ms"] > 0
    assert run["mtp_round_chained_ms"] > 0          # rounds fed on the device, as the overlapped engine runs them
    assert run["decode_chained_inplace_ms"] > 0     # chained steps keeping only the state (the engine's buffers)
    assert run["ledger_decode"]["calls"] == 1
    assert run["ledger_prefill"]["calls"] == 1 and run["ledger_prefill"]["tokens"] == 32    # the first context
    assert "# ledger_prefill (4 layers)" in stdout


def test_bench_decode_times_the_engine_round_program(tmp_path):
    """With the table in the params: the MTP rounds also through the engine's one-program round with its buffers in
    place (`_jit_spec_round`, chained), beside the separate draft / verify programs."""
    res = tmp_path / "d.jsonl"
    _run(["scripts/bench_decode.py", "--tiny", "--reps", "1", "--layers", "4", "--contexts", "32", "--out", str(res)],
         tmp_path)
    run = next(json.loads(line) for line in res.read_text().splitlines() if '"record": "run"' in line)
    assert run["mtp_round_chained_inplace_ms"] > 0 and run["decode_chained_inplace_ms"] > 0


def test_bench_decode_engine_only_with_quantized_weights(tmp_path):
    """--engine-only: only the Engine runs (no step / round / prefill timings), here on FP8 + NVFP4 weights with the
    FP8 head, as the 48-layer engine run on one device needs; each engine run is preceded by its phase lines."""
    res = tmp_path / "d.jsonl"
    stdout = _run(["scripts/bench_decode.py", "--tiny", "--reps", "1", "--layers", "4", "--contexts", "32",
                   "--quant", "fp8+nvfp4", "--fp8-head", "--unroll-stacked", "--engine", "3", "--engine-slots", "1",
                   "--engine-only", "--out", str(res)], tmp_path)
    run = next(json.loads(line) for line in res.read_text().splitlines() if '"record": "run"' in line)
    assert run["engine_b1_sync_ms_per_step"] > 0 and run["engine_b1_overlap_ms_per_step"] > 0
    assert "decode_ms" not in run and "mtp_round_ms" not in run
    assert "=== phase engine b1 overlap timed" in stdout


def test_bench_decode_prefill_only(tmp_path):
    """--prefill-only: the prefill timings and their ledger, no step or round (a depth whose whole run does not fit
    one device call)."""
    res = tmp_path / "d.jsonl"
    stdout = _run(["scripts/bench_decode.py", "--tiny", "--reps", "1", "--layers", "4", "--contexts", "32",
                   "--quant", "fp8+nvfp4", "--unroll-stacked", "--prefill-only", "--ledger", "1", "--out", str(res)],
                  tmp_path)
    run = next(json.loads(line) for line in res.read_text().splitlines() if '"record": "run"' in line)
    assert run["prefill_32_tok_s"] > 0 and run["ledger_prefill"]["tokens"] == 32
    assert "decode_ms" not in run and "mtp_round_ms" not in run and "ledger_decode" not in run
    assert "# ledger_prefill (4 layers)" in stdout


def test_bench_decode_prefill_chunk_sweep(tmp_path):
    """--prefill-chunks: the prefill at several chunk sizes in one run, each result named by its chunk; a chunk that
    does not divide the context is recorded as skipped; the flag needs --prefill-only."""
    res = tmp_path / "d.jsonl"
    _run(["scripts/bench_decode.py", "--tiny", "--reps", "1", "--layers", "4", "--contexts", "32", "--prefill-only",
          "--prefill-chunks", "16,32,24", "--out", str(res)], tmp_path)
    run = next(json.loads(line) for line in res.read_text().splitlines() if '"record": "run"' in line)
    assert run["prefill_32_chunk16_tok_s"] > 0 and run["prefill_32_chunk32_tok_s"] > 0
    assert "prefill_32_tok_s" not in run and "does not divide" in run["prefill_32_chunk24_skipped"]
    bad = subprocess.run([sys.executable, "scripts/bench_decode.py", "--tiny", "--prefill-chunks", "16",
                          "--out", str(tmp_path / "x.jsonl")], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
                              **{k: v for k, v in os.environ.items() if k in _INHERITED}})
    assert bad.returncode != 0 and "--prefill-only" in bad.stderr


def test_bench_decode_with_a_uva_table(tmp_path):
    """--ple-store uva: the params' table is the handle of a pinned synthetic table, the timed programs gather
    their rows through it (on the CPU over a stand-in copy, --ple-emulate) from random ids over the table."""
    res = tmp_path / "d.jsonl"
    _run(["scripts/bench_decode.py", "--tiny", "--reps", "1", "--layers", "4", "--contexts", "32",
          "--ple-store", "uva", "--ple-emulate", "--ple-table-gb", "0.01", "--ple-dir", str(tmp_path),
          "--out", str(res)], tmp_path)
    run = next(json.loads(line) for line in res.read_text().splitlines() if '"record": "run"' in line)
    assert run["ple_store"] == "uva" and run["decode_ms"] > 0 and run["mtp_round_ms"] > 0


def test_bench_decode_engine_with_speculation():
    """--engine-spec: the Engine's MTP rounds, synchronous and overlapped, on random weights (the MTP params a
    built tree, as the script draws them): ms per step, tokens/s and acceptance length per run."""
    import jax
    import jax.numpy as jnp

    from fnx.model.mtp import mtp_param_shapes
    from tests.conftest import load_script
    bd = load_script("bench_decode")
    cfg = bd.bench_config(4, True)
    dt = jnp.float32
    params = bd.random_tree(bd.param_shapes(cfg, dt), jax.random.PRNGKey(0), dt)
    mshapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dt), mtp_param_shapes(cfg),
                           is_leaf=lambda x: isinstance(x, tuple))
    mp = bd.random_tree(mshapes, jax.random.PRNGKey(1), dt)
    out = bd.engine_decode(cfg, params, mp, 6, [2], spec_k=2, plain=False)
    for label in ("spec2_sync", "spec2_overlap"):
        assert out[f"engine_b2_{label}_ms_per_step"] > 0 and out[f"engine_b2_{label}_tok_s"] > 0, label
        assert out[f"engine_b2_{label}_acceptance_length"] >= 1.0
    assert not any("_sync_" in k and "spec" not in k for k in out)


def test_bench_decode_online_quant_per_leaf(monkeypatch):
    """The full-model runs quantize each leaf as it is drawn: dense projections become FP8 blocks, experts NVFP4
    with "fp8+nvfp4", small layers stay; --keep-bf16 leaves the matching paths as they are."""
    import re

    import jax
    import jax.numpy as jnp

    from fnx.model import quant
    from tests.conftest import load_script
    bd = load_script("bench_decode")
    key = lambda *names: tuple(jax.tree_util.DictKey(n) for n in names)   # noqa: E731
    w = jnp.ones((256, 256), jnp.bfloat16)
    assert isinstance(bd.quantize_leaf(key("linear_attn", "in_proj_qkv"), w, "fp8"), quant.Fp8Block)
    assert isinstance(bd.quantize_leaf(key("attn_hyper_connection", "input_mix_weight_down"), w, "fp8"),
                      quant.Fp8Block)
    assert isinstance(bd.quantize_leaf(key("mlp", "experts", "down_proj"), w[None], "fp8+nvfp4"), quant.Nvfp4)
    assert bd.quantize_leaf(key("mlp", "gate"), w, "fp8") is w
    monkeypatch.setattr(bd, "KEEP_BF16", re.compile("input_mix_weight"))
    assert bd.quantize_leaf(key("attn_hyper_connection", "input_mix_weight_down"), w, "fp8") is w
    assert isinstance(bd.quantize_leaf(key("linear_attn", "in_proj_qkv"), w, "fp8"), quant.Fp8Block)
    # --fp8-head: the lm_head too; the drafter's head: a hot subset of the first N ids and / or FP8 blocks
    assert bd.quantize_leaf(key("lm_head"), w, "fp8") is w
    monkeypatch.setattr(bd, "FP8_HEAD", True)
    head = bd.quantize_leaf(key("lm_head"), w, "fp8+nvfp4")
    assert isinstance(head, quant.Fp8Block)
    assert bd.draft_head_for(w, 256, 0, False, jnp.bfloat16) == (None, None)
    hot, sub = bd.draft_head_for(head, 256, 100, False, jnp.bfloat16)
    assert hot.tolist() == list(range(100)) and sub.shape == (100, 256) and sub.dtype == jnp.bfloat16
    hot, sub = bd.draft_head_for(w, 256, 0, True, jnp.bfloat16)
    assert hot is None and isinstance(sub, quant.Fp8Block)


def test_bench_kernels_quick_writes_a_record_per_case(tmp_path):
    res = tmp_path / "k.jsonl"
    stdout = _run(["scripts/bench_kernels.py", "--quick", "--only", "gemv", "--filter", "fp8 pallas.*M=1 N=256",
                   "--variants", "g: FNX_GEMV_FINISH=1", "--out", str(res)], tmp_path,
                  env={"FNX_DOT_ACC": "0", "FNX_COMMIT": "abc1234"})
    assert "gemv_fp8" in stdout
    recs = [json.loads(line) for line in res.read_text().splitlines()]
    rec = recs[0]
    # the knobs it ran with are in the record (the commit is the commit's field); --variants: each case again
    # under the variant's settings, its impl suffixed with the label
    assert rec["settings"] == {"FNX_DOT_ACC": "0"} and rec["commit"] == "abc1234"
    assert len(recs) == 2 and recs[1]["impl"] == rec["impl"] + "+g" and recs[1]["shape"] == rec["shape"]
    assert recs[1]["settings"] == {"FNX_DOT_ACC": "0", "FNX_GEMV_FINISH": "1"}
    # a time, or (tiny kernels timed on a shared CPU) the harness refusing a non-positive slope: never a fake number
    assert rec["kernel"] == "gemv_fp8" and ("us" in rec or "timing noise" in rec["error"])


def test_bench_kernels_qsa_prefill_cases_check_against_the_chunked_path(tmp_path):
    """The QSA prefill attention's cases (the kernel and the model's key-chunked path, one chunk at the end of a
    short context): the kernel's output checked against the chunked path's before it is timed."""
    res = tmp_path / "k.jsonl"
    _run(["scripts/bench_kernels.py", "--quick", "--only", "qsa", "--filter", "qsa_prefill", "--iters", "1",
          "--min-apps", "4", "--out", str(res)], tmp_path)
    recs = [json.loads(line) for line in res.read_text().splitlines() if '"kernel"' in line]
    assert sorted(r["impl"] for r in recs) == ["chunked", "pallas"]
    kern = next(r for r in recs if r["impl"] == "pallas")
    assert kern["check"] == "ok" and kern["max_rel_err"] < 0.03


def test_gemv_tune_candidates_include_what_runs_at_m():
    """The tuner's first stage at M tokens includes the tiles the model runs at M without a new entry (M's
    heuristic; the twenty-first session's M = 5 tune compared only against the M = 1 heuristic's and chose
    tiles slower than what already ran in the model), besides the M = 1 heuristic's."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_kernels

    from fnx.pallas.gemv import api
    for n, k in ((248320, 2560), (10240, 2560)):
        cands = bench_kernels.gemv_candidates("fp8", n, k, m=5)
        assert api.heuristic_tiles("fp8", n, k, 5) in cands and api.heuristic_tiles("fp8", n, k, 1) in cands
        assert api.tiles_for("fp8", n, k, 5) in cands
        assert len(set(cands)) == len(cands)
        assert api.tiles_for("fp8", n, k, 5).mma == "f16"        # FP8's default at M > 1 (fp16 MMAs) and
        assert dataclasses.replace(api.tiles_for("fp8", n, k, 5), mma="bf16") in cands    # the same on bf16 ones
        assert dataclasses.replace(api.tiles_for("fp8", n, k, 5), tr=1, mma="bf16") in cands   # other operand order
        assert not any(c.mma != "bf16" for c in bench_kernels.gemv_candidates("bf16", n, k, m=5))
        assert any(c.mma == "f16" for c in bench_kernels.gemv_candidates("nvfp4", n, k, m=1))
        assert not any(c.tr for c in bench_kernels.gemv_candidates("fp8", n, k, m=1))
        loop = api.heuristic_tiles("fp8", n, k, 5)
        assert dataclasses.replace(loop, tr=1) in bench_kernels.gemv_candidates("fp8", n, k, base=loop, m=5)
        f16 = dataclasses.replace(loop, mma="f16")     # the second stage around an fp16 best keeps fp16 MMAs
        around = bench_kernels.gemv_candidates("fp8", n, k, base=f16, m=5)
        assert dataclasses.replace(loop, mma="bf16") in around
        assert all(c.mma == "f16" for c in around if c != dataclasses.replace(loop, mma="bf16"))


def test_gemv_tuner_compiles_in_batches_and_keeps_a_cut_shape(tmp_path, monkeypatch):
    """The tuner compiles its candidates a batch at a time on host threads and times them in turn (every candidate
    timed or said skipped, the best written); a shape cut by the budget keeps the best of the candidates it timed
    and says so. Tiny shape in interpret mode: the times mean nothing."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_kernels

    from fnx.pallas.gemv import api
    from fnx.pallas.gemv import pallas as gp
    first = [api.tiles_for("fp8", 256, 512, 1), gp.Tiles(32, 128, 1), gp.Tiles(64, 128, 2)]
    assert len(set(first)) == 3
    monkeypatch.setattr(bench_kernels, "gemv_candidates", lambda fmt, n, k, base=None, m=1: [] if base else first)

    def tune(path, clock):
        lines = []
        best = bench_kernels.tune_gemv(path, True, lines.append, budget_s=100.0, fmts=("fp8",), layer_filter="^wide$",
                                       m=1, workers=2, min_apps=4, clock=clock)
        return best, lines

    best, lines = tune(tmp_path / "a.json", lambda: 0.0)
    timed = [ln for ln in lines if ln.startswith("  fp8 wide")]
    skipped = [ln for ln in lines if ln.startswith("  skip")]
    assert len(timed) + len(skipped) == 3 and timed, lines
    assert gp.Tiles(**best["fp8:256:512:1"]) in first
    assert json.loads((tmp_path / "a.json").read_text()) == best
    assert not any("cut by the budget" in ln for ln in lines)

    ticks = iter([0.0, 0.0, 0.0] + [1e9] * 100)     # start, the shape's check, the first batch's: then over
    best, lines = tune(tmp_path / "b.json", lambda: next(ticks))
    timed = [ln for ln in lines if ln.startswith("  fp8 wide")]
    assert len(timed) + sum(ln.startswith("  skip") for ln in lines) == 2, lines     # one batch of two
    assert any("budget of 100s spent after 2 of 3 candidates" in ln for ln in lines)
    if timed:
        assert gp.Tiles(**best["fp8:256:512:1"]) in first[:2]
        assert any("cut by the budget" in ln for ln in lines if ln.startswith("tune fp8:256:512:1"))


def test_probe_launch_writes_every_part(tmp_path):
    """scripts/probe_launch.py on a tiny unscanned model: the HLO, dispatch and decode records (on the CPU there are
    no device kernels, so the gap fields are zero; the parts and the trace file must exist). The draft and verify
    parts use the engine's greedy programs, tested in tests/engine. --prefill-table: one 16-token chunk's table (the
    step compiled a third time, at [1, 16])."""
    _run(["scripts/probe_launch.py", "--tiny", "--layers", "4", "--no-scan", "--reps", "2", "--calls", "1",
          "--chains", "2", "--kernel-variants", "reference", "--kernel-table", "--context", "100",
          "--draft-vocab", "64", "--prefill-table", "16", "--out", str(tmp_path)], tmp_path)
    recs = [json.loads(line) for line in (tmp_path / "probe.jsonl").read_text().splitlines()]
    parts = [r["part"] for r in recs]
    assert parts == ["decode hlo", "decode dispatch", "variant hlo", "decode dispatch", "kernel table", "kernel table",
                     "decode", "kernel table", "kernel table", "draft", "verify", "compiles"]
    # each program compiled once: its kernel table's HLO and its calls share one executable (the step twice: the
    # FNX_KERNELS=reference variant is a program of its own)
    by = recs[-1]["by_function"]
    assert (by["jit(step)"][0], by["jit(draft_program)"][0], by["jit(verify_program)"][0]) == (3, 1, 1), by
    assert [r.get("program") for r in recs if r["part"] == "kernel table"] == ["decode", "prefill", "draft", "verify"]
    assert [r.get("tokens") for r in recs if r["part"] == "kernel table"] == [None, 16, None, None]   # --prefill-table
    assert (tmp_path / "kernel_table_prefill16_default_4l_bf16_ctx100_draft64.jsonl").exists()
    for r in (r for r in recs if r["part"] == "kernel table"):
        assert r["kernels_per_call"] == 0 and (tmp_path / r["file"]).exists()   # no device lanes on a CPU
    assert all(r["context"] == 100 and r["draft_vocab"] == 64 for r in recs)   # the drafter's hot-token head
    disp = recs[1]
    assert disp["step_ms"] > 0 and disp["chained_ms_per_step"] > 0 and disp["param_leaves"] > 0
    assert len(disp["chained_ms_all"]) == 2
    assert recs[2]["kernels"] == recs[3]["kernels"] == "reference" and recs[3]["chained_ms_per_step"] > 0
    assert (tmp_path / "trace_decode_default_4l_bf16_ctx100_draft64.json.gz").exists()
    assert (tmp_path / "decode_hlo_default_4l_bf16_ctx100_draft64.txt").exists()


def test_probe_launch_addr_trace(tmp_path):
    """--addr-trace N: N decode calls, each output's address read; on the CPU the donated state is aliased (its
    leaves keep their address) while the logits, a fresh output each call, may move; the compiled step's memory
    figures come with it."""
    _run(["scripts/probe_launch.py", "--tiny", "--layers", "4", "--no-scan", "--reps", "1", "--chains", "1",
          "--context", "100", "--dispatch-only", "--no-round", "--addr-trace", "4", "--out", str(tmp_path)], tmp_path)
    recs = [json.loads(line) for line in (tmp_path / "probe.jsonl").read_text().splitlines()]
    addr = next(r for r in recs if r["part"] == "addresses")
    assert addr["calls"] == 4 and addr["leaves"] > 10, addr
    assert not any(name.startswith("['state']") for name in addr["moved"]), addr["moved"]   # donated: in place
    assert all(0 < n <= 3 for n in addr["moved"].values()), addr["moved"]
    assert addr["memory"].get("alias_size_in_bytes", 0) > 0, addr["memory"]


def test_probe_launch_round_variants(tmp_path):
    """--round-variants (--only-variants: alone): each variant's step, draft and verify compiled afresh under its
    settings (here one forces two one-token kernels in interpret mode, which changes the step's program on a CPU
    too), profiled, a table per program and variant, and the summary against the first variant. --prefill-table:
    a 16-token prefill chunk is one more program of each variant (its table, no chained timing). --save-hlo: each
    program's optimized HLO beside its table. --variant-check: each variant's decode steps against the first's."""
    stdout = _run(["scripts/probe_launch.py", "--tiny", "--layers", "4", "--no-scan", "--reps", "1", "--calls", "1",
                   "--chains", "1", "--context", "100", "--draft-vocab", "64", "--kernel-table", "--out", str(tmp_path),
                   "--prefill-table", "16", "--save-hlo",
                   "--variant-chain", "2", "--variant-check", "2", "--only-variants", "--round-variants",
                   "base: ; m1: FNX_KERNELS=hc_boundary_m1=pallas_interpret,gdn_step=pallas_interpret; "
                   "bad: FNX_KERNELS=hc_boundary_m1=pallas_interpret FNX_HC_M1_TILES=bogus=1"], tmp_path)
    recs = [json.loads(line) for line in (tmp_path / "probe.jsonl").read_text().splitlines()]
    assert {r["part"] for r in recs} == {"round variant", "kernel table", "compiles"}  # --only-variants: no other
    by = recs[-1]["by_function"]                                                   # one compile a program a variant
    assert (by["jit(step)"][0], by["jit(draft_program)"][0], by["jit(verify_program)"][0]) == (4, 2, 2), by
    # a variant that cannot build its programs is reported, and the sweep goes on without it
    failed = [r for r in recs if r["part"] == "round variant" and "error" in r]
    assert [r["variant"] for r in failed] == ["bad"] and "bogus" in failed[0]["error"], failed
    assert "variant failed bad: " in stdout
    var = [r for r in recs if r["part"] == "round variant" and "error" not in r]
    assert [(r["variant"], r["settings"]) for r in var] == [
        ("base", {}), ("m1", {"FNX_KERNELS": "hc_boundary_m1=pallas_interpret,gdn_step=pallas_interpret"})]
    # --variant-check: two greedy steps from one saved state per variant, against the first variant's
    assert var[0]["check"] == {"steps": 2, "same_bits": True, "max_rel_diff": 0.0, "argmax_agree": 2}
    assert var[1]["check"]["steps"] == 2 and var[1]["check"]["max_rel_diff"] < 0.05, var[1]["check"]
    ops = [{p: v["hlo_launch_ops"] for p, v in r["programs"].items()} for r in var]
    assert set(ops[0]) == {"decode", "draft", "verify", "prefill16"}
    assert ops[1]["decode"] > ops[0]["decode"], ops        # the interpreted kernels are in the step's program
    for r in var:     # each program also timed over back-to-back calls (3 runs of 2 calls: max(3, --chains))
        for prog, v in r["programs"].items():
            if prog == "prefill16":      # its state fills up chunk after chunk: the table only
                assert "chained_us_per_call" not in v
                continue
            assert v["chained_us_per_call"] > 0 and len(v["chained_us_all"]) == 3, (r["variant"], prog, v)
    tables = [r for r in recs if r["part"] == "kernel table" and r.get("variant")]
    assert [(r["variant"], r["program"]) for r in tables] == [(v, p) for v in ("base", "m1")
                                                              for p in ("decode", "draft", "verify", "prefill16")]
    assert all((tmp_path / r["file"]).exists() for r in tables)
    for r in tables:
        with gzip.open(tmp_path / "variants" / r["variant"] / f"hlo_{r['program']}_{r['variant']}.txt.gz", "rt") as f:
            assert f.read().startswith("HloModule"), r
    lines = stdout.splitlines()
    assert [ln.split()[2] for ln in lines if ln.startswith("variant done ")] == ["base:", "m1:"]
    head = next(i for i, ln in enumerate(lines) if re.match(r"variant +decode kernels / us", ln))
    assert lines[head + 1].split()[0] == "base" and lines[head + 2].split()[0] == "m1"
    assert "step chained" in lines[head] and "round chained" in lines[head]
    assert "prefill16 kernels / us" in lines[head]
    assert len(lines[head + 2].split()) == 1 + 4 * 3 + 2 + 4   # label, 4 x "kernels / us", round, 2 x chained
    assert "== verify: m1 against base" in stdout


def test_pick_winners_compares_each_sweep_with_its_own_base_and_merges_the_winners(tmp_path):
    """scripts/pick_winners.py on two sweeps' records: gains against each sweep's first variant, a winner saves at
    least --min-gain-us on the round or the step and loses at most --tolerance-us on the other; the winners'
    settings merged per op / tile field, a conflict to the larger gain."""
    def rec(sweep, label, settings, step, draft, verify, base="base"):
        progs = {"decode": step, "draft": draft, "verify": verify}
        return {"part": "round variant", "sweep": sweep, "base": base, "variant": label, "settings": settings,
                "programs": {k: {"busy_us_per_call": v, "kernels_per_call": 1} for k, v in progs.items()}}
    recs = [rec("a", "base", {}, 500, 300, 900),
            rec("a", "pair", {"FNX_KERNELS": "gemv_pair_many=pallas"}, 500, 290, 860),          # round -50: wins
            rec("a", "acts", {"FNX_KERNELS": "moe_route_acts=pallas"}, 500, 300, 899),          # -1: too small
            rec("a", "slow", {"FNX_KERNELS": "qsa_prep=pallas"}, 520, 280, 880),                # step +20: loses
            rec("b", "base", {}, 510, 305, 905),
            rec("b", "xla1", {"FNX_HC_FEW_TILES": "mid=xla1"}, 510, 305, 895),                  # -10: wins
            rec("b", "fold", {"FNX_HC_FEW_TILES": "pre=fold,mid=pallas"}, 509, 300, 870),        # -40: wins
            rec("b", "m1", {"FNX_HC_M1_TILES": "early=1", "FNX_GEMV_XFIRST": "1"}, 490, 305, 905),  # step -20
            rec("b", "gs8", {"FNX_GEMV_TILES": "fp8:2560:6144:1=bn=8,split=1"}, 500, 305, 905),  # step -10: wins
            rec("b", "gs4", {"FNX_GEMV_TILES": "fp8:2560:6144:1=bn=4,split=1/fp8:1280:2560:1=rows=2"},
                505, 305, 905),                                  # step -5: wins, its 2560 x 6144 item loses to gs8
            {"part": "round variant", "sweep": "b", "base": "base", "variant": "smem",      # did not compile
             "settings": {"FNX_GDN_SCAN_TILES": "num_stages=3"}, "error": "RESOURCE_EXHAUSTED: shared memory"}]
    path = tmp_path / "probe.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    out = _run(["scripts/pick_winners.py", str(path)], tmp_path)
    won = {ln.split()[0] for ln in out.splitlines() if "  yes  " in ln}
    assert won == {"pair", "xla1", "fold", "m1", "gs8", "gs4"}, out
    assert "smem" not in out               # a variant that failed to compile has no row (its error on stderr)
    exports = _run(["scripts/pick_winners.py", str(path), "--export"], tmp_path).splitlines()
    env = dict(line.removeprefix("export ").split("=", 1) for line in exports)
    assert env == {"FNX_KERNELS": "gemv_pair_many=pallas", "FNX_HC_FEW_TILES": "mid=pallas,pre=fold",
                   "FNX_HC_M1_TILES": "early=1", "FNX_GEMV_XFIRST": "1",
                   "FNX_GEMV_TILES": "fp8:2560:6144:1=bn=8,split=1/fp8:1280:2560:1=rows=2"}, env
    # a stricter threshold keeps only the larger gains
    out = _run(["scripts/pick_winners.py", str(path), "--min-gain-us", "30"], tmp_path)
    assert {ln.split()[0] for ln in out.splitlines() if "  yes  " in ln} == {"pair", "fold"}, out
    # --by chained: the wall time per call of back-to-back calls decides (a variant that removes launches may add
    # kernel time and still win); records without it are refused by name
    bad = subprocess.run([sys.executable, "scripts/pick_winners.py", str(path), "--by", "chained"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no chained_us_per_call" in bad.stderr and "--by kernel" in bad.stderr, bad.stderr

    def chained(label, busy_step, chained_step, settings):
        r = rec("c", label, settings, busy_step, 300, 900)
        for prog, v in r["programs"].items():
            v["chained_us_per_call"] = chained_step if prog == "decode" else v["busy_us_per_call"] + 100
        return r
    path.write_text("\n".join(json.dumps(r) for r in (
        chained("base", 537, 700, {}), chained("mf", 539, 680, {"FNX_MOE_FINISH": "1"}),
        chained("one", 571, 720, {"FNX_KERNELS": "hc_boundary_one=pallas"}))) + "\n")
    assert {ln.split()[0] for ln in _run(["scripts/pick_winners.py", str(path)], tmp_path).splitlines()
            if "  yes  " in ln} == set()
    out = _run(["scripts/pick_winners.py", str(path), "--by", "chained"], tmp_path)
    assert {ln.split()[0] for ln in out.splitlines() if "  yes  " in ln} == {"mf"} and "chained time" in out, out


@pytest.mark.parametrize("spec,why", [("base", "must be 'LABEL: ENV=VALUE"), ("a: ; a: FNX_X=1", "given twice"),
                                      ("a: XLA_FLAGS=--x", "not FNX_NAME=VALUE"), ("a: FNX_X=1 FNX_X=2", "set twice"),
                                      (" ; ", "no variant")])
def test_probe_launch_round_variants_refuses_bad_specs(spec, why):
    import importlib.util
    sp = importlib.util.spec_from_file_location("probe_launch", ROOT / "scripts" / "probe_launch.py")
    probe = importlib.util.module_from_spec(sp)
    sp.loader.exec_module(probe)
    with pytest.raises(SystemExit, match=why.replace("'", ".")):
        probe.parse_variants(spec)
    assert probe.parse_variants("b: FNX_KERNELS=a=pallas,b=pallas FNX_HC_FEW_TILES=mid=xla1;c:") == [
        ("b", {"FNX_KERNELS": "a=pallas,b=pallas", "FNX_HC_FEW_TILES": "mid=xla1"}), ("c", {})]


def test_probe_launch_kernel_table_matches_kernels_to_their_hlo():
    """--kernel-table's parsing: kernel events grouped by name per call, matched to the optimized HLO instruction
    they come from ('.' and '-' as '_' in a profile), with the instruction's op_name and its fused opcodes; a kernel
    with no instruction of its name (a Pallas kernel names itself) keeps only its time."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("probe_launch", ROOT / "scripts" / "probe_launch.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    hlo = "\n".join([
        "%fused_computation.3 (param_0: bf16[8]) -> bf16[8] {",
        "  %param_0 = bf16[8]{0} parameter(0)",
        "  %convert.1 = f32[8]{0} convert(%param_0)",
        "  %multiply.2 = f32[8]{0} multiply(%convert.1, %convert.1)",
        "  ROOT %convert.2 = bf16[8]{0} convert(%multiply.2)",
        "}",
        "",
        "ENTRY %main.9 (p: bf16[8]) -> bf16[8] {",
        "  %p = bf16[8]{0} parameter(0)",
        '  %loop_multiply_fusion.3 = bf16[8]{0} fusion(%p), kind=kLoop, calls=%fused_computation.3, '
        'metadata={op_name="jit(step)/hc/mul" source_file="x.py" source_line=3}',
        '  %loop_slice_fusion = bf16[1,3]{1,0} fusion(%p), kind=kLoop, calls=%fused_computation.3, '
        'metadata={op_name="jit(step)/gdn/dynamic_slice"}',
        '  %loop_slice_fusion.25 = (f16[4,8]{1,0}, f16[4,8]{1,0}) fusion(%p), kind=kLoop, '
        'calls=%fused_computation.3, metadata={op_name="jit(step)/moe/slice"}',
        '  ROOT %copy.7 = bf16[8]{0} copy(%loop_multiply_fusion.3), metadata={op_name="jit(step)/gdn/copy"}',
        "}",
    ])
    fusions = probe.hlo_fusions(hlo)
    assert fusions["loop_multiply_fusion_3"]["op"] == "fusion"
    assert fusions["loop_multiply_fusion_3"]["op_name"] == "jit(step)/hc/mul"
    assert fusions["loop_multiply_fusion_3"]["body"] == {"convert": 2, "multiply": 1}
    assert fusions["copy_7"]["op"] == "copy"
    # a multi-output fusion (a tuple result) is its own instruction, not the one named without its digits
    assert fusions["loop_slice_fusion_25"]["op_name"] == "jit(step)/moe/slice"
    assert fusions["loop_slice_fusion_25"]["shape"] == "(f16[4,8]{1,0}, f16[4,8]{1,0})"
    assert probe._instruction_of("loop_slice_fusion_25", None, fusions)[1]["op_name"] == "jit(step)/moe/slice"
    events = [{"name": "loop_multiply_fusion_3", "ts": 0, "dur": 2.0}, {"name": "copy_7", "ts": 3, "dur": 1.0},
              {"name": "hc_down1", "ts": 5, "dur": 4.0}] * 2
    table = {r["kernel"]: r for r in probe.kernel_table(events, 2, fusions)}
    assert table["loop_multiply_fusion_3"]["per_call"] == 1 and table["loop_multiply_fusion_3"]["us_per_call"] == 2.0
    assert table["loop_multiply_fusion_3"]["body"] == {"convert": 2, "multiply": 1}
    assert table["copy_7"]["op_name"] == "jit(step)/gdn/copy"
    assert table["hc_down1"]["us_per_call"] == 4.0 and "op" not in table["hc_down1"]
    # a library kernel (a cuBLAS GEMM) is named by the library; the profiler's hlo_op argument names its
    # instruction, and two instructions running the same library kernel stay apart
    fusions["custom_call_5"] = {"op": "custom-call:__cublas$gemm", "shape": "bf16[5,4]", "op_name": "jit(v)/hc/dot",
                                "body": {}}
    fusions["custom_call_6"] = {"op": "custom-call:__cublas$gemm", "shape": "bf16[5,320]",
                                "op_name": "jit(v)/gdn/dot", "body": {}}
    gemm = "void cutlass::Kernel2<cutlass_80_wmma_tensorop_s161616gemm_bf16_32x32_128x2_tn_align8>"
    events = [{"name": gemm, "ts": 0, "dur": 4.0, "args": {"hlo_module": "jit_v", "hlo_op": "custom-call.5"}},
              {"name": gemm, "ts": 5, "dur": 3.0, "args": {"hlo_op": "custom-call.6"}},
              {"name": gemm, "ts": 9, "dur": 1.0, "args": {"hlo_op": "not-in-the-module"}}]
    rows = probe.kernel_table(events, 1, fusions)
    assert [(r.get("hlo_op"), r.get("op_name"), r["us_per_call"]) for r in rows] == [
        ("custom-call.5", "jit(v)/hc/dot", 4.0), ("custom-call.6", "jit(v)/gdn/dot", 3.0), (None, None, 1.0)]


def test_probe_graph_writes_points_and_slopes(tmp_path):
    """scripts/probe_graph.py: a chain of N kernels per program (alone, each with its own weight argument, or all
    reading rows of one stacked argument), timed per N, the result checked against the closed form, then the
    fitted slopes (numbers meaningless on the CPU). The kernels also lower for CUDA."""
    import jax
    import jax.numpy as jnp

    from tests.conftest import load_script
    _run(["scripts/probe_graph.py", "--nodes", "2", "3", "--reps", "2", "--chain", "2", "--out", str(tmp_path)],
         tmp_path, timeout=300)
    recs = [json.loads(line) for line in (tmp_path / "probe_graph.jsonl").read_text().splitlines()]
    points = [r for r in recs if r["part"] == "point"]
    assert [(r["case"], r["nodes"]) for r in points] == [
        (c, n) for c in ("none:donated", "none:kept", "separate:donated", "stacked:donated") for n in (2, 3)]
    assert all(r["sync_us"] > 0 and r["chained_us"] > 0 and r["calls"] == 1 + 3 + 2 + 3 * 2 for r in points)
    slopes = recs[-1]
    assert slopes["part"] == "slopes" and slopes["sync_us_per_node[stacked:donated]"] is not None
    pg = load_script("probe_graph")
    x = jax.ShapeDtypeStruct((256,), jnp.float32)
    for weights, w in (("separate", [x] * 3), ("stacked", jax.ShapeDtypeStruct((3, 256), jnp.float32))):
        text = jax.jit(pg.chain_program(3, 256, False, weights)).trace(x, w).lower(
            lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @__gpu$xla.gpu.triton") == 3, weights     # Triton, not Mosaic GPU


def test_probe_hmm_reports_what_it_cannot_probe(tmp_path, monkeypatch, capsys):
    """scripts/probe_hmm.py: without a CUDA driver it says so and exits 0; where the driver reports no pageable
    memory access it skips the read test and says why; its record is one JSON line appended to --out."""
    from tests.conftest import load_script
    ph = load_script("probe_hmm")
    out = tmp_path / "hmm.jsonl"
    monkeypatch.setattr(ph, "driver_facts", lambda: {"kernel": "k", "error": "no CUDA driver library here (test)"})
    assert ph.main(["--out", str(out)]) == 0
    assert "no CUDA driver to probe" in capsys.readouterr().out
    monkeypatch.setattr(ph, "driver_facts", lambda: {"kernel": "k", "pageable_memory_access": 0})
    assert ph.main(["--out", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert recs[0]["error"].startswith("no CUDA driver") and "read_test" not in recs[0]
    assert recs[1]["read_test"].startswith("skipped: the driver reports no pageable memory access")
    facts = ph.driver_facts()          # the real query: on this machine either the answers or why there are none
    assert "kernel" in facts and ("error" in facts or "pageable_memory_access" in facts)


def test_probe_ncu_runs_its_cases_and_refuses_unknown_ones(monkeypatch, capsys):
    """scripts/probe_ncu.py (what `gpu_session.sh ncu` profiles): the GEMV cases through the interpreter at a small
    shape run and report their calls; a case it does not know is an error that names the accepted forms."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import probe_ncu
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    monkeypatch.setattr(probe_ncu, "GEMV_SHAPES", ((256, 256),))
    monkeypatch.setattr(probe_ncu, "IMPL", "pallas_interpret")
    monkeypatch.setattr(sys, "argv", ["probe_ncu", "--cases", "gemv_fp8", "gemv_bf16_m5", "--reps", "1"])
    probe_ncu.main()
    out = capsys.readouterr().out
    assert "probe_ncu gemv_fp8 N=256 K=256: 1 calls" in out and "probe_ncu gemv_bf16_m5 N=256 K=256: 1 calls" in out
    monkeypatch.setattr(sys, "argv", ["probe_ncu", "--cases", "attn_fp8"])
    with pytest.raises(SystemExit, match="unknown case 'attn_fp8'"):
        probe_ncu.main()


def test_sass_count_finds_loop_bodies():
    """scripts/sass_count.py counts a loop's instructions per trip from cuobjdump's listing: the body of each
    backward branch (a predicated one too), not the end-of-kernel self-branch."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import sass_count
    listing = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   LDG.E R2, desc[UR6][R4.64] ;",
        "        /*0020*/                   HMMA.16816.F32 R8, R12, R16, R8 ;",
        "        /*0030*/                   IMAD R3, R2, 0x2, R3 ;",
        "        /*0040*/               @P0 BRA 0x20 ;",
        "        /*0050*/                   EXIT ;",
        "        /*0060*/                   BRA 0x60;"])
    (start, end, body), = sass_count.loop_bodies(listing)
    assert (start, end) == (0x20, 0x40) and body == ["HMMA", "IMAD", "BRA"]
    # every instruction counted, past 64 KB of code too (5-digit addresses)
    long = listing + "\n        /*1fff0*/                   STL [R1], R2 ;"
    assert sass_count.opcodes(long) == ["MOV", "LDG", "HMMA", "IMAD", "BRA", "EXIT", "BRA", "STL"]


def test_sass_count_counts_loads_after_the_first_barrier():
    """The load-order line: global loads after the first barrier (LDG only; a shared-memory load is no round trip
    to memory), all global loads, and spills."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import sass_count
    assert sass_count.load_order(["LDG", "LDG", "FFMA", "BAR", "LDS", "LDG", "STL", "BAR", "LDG", "LDL"]) == (2, 4, 2)
    assert sass_count.load_order(["LDG", "FFMA", "STG"]) == (0, 1, 0)
    assert sass_count.load_groups(["LDG", "LDG", "FFMA", "BAR", "LDG", "STG", "LDG", "LDS", "LDG", "BAR"]) == 3
    assert sass_count.load_groups(["FFMA", "STG", "BAR"]) == 0


def test_sass_count_reads_the_pipelined_loops():
    """The pipeline line from a kernel's TTGIR: a loop whose next copies go out after its product and whose waits
    keep none in flight is reported as not overlapping (the QSA decode kernel's shape, with its plain index load);
    one whose wait keeps copies in flight is not; plain loads before the first wait are counted as issued early."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import sass_count

    def loop(*ops):
        return "\n".join(["  tt.func @k() {", "    %0 = scf.for %i = %c0 to %c4 step %c1 iter_args(%a = %z) -> (f32) {",
                          *(f"      {op}" for op in ops), "      scf.yield %a : f32", "    }", "  }"])
    serial = loop("%1 = ttg.async_wait %t {num = 0 : i32}", "%2 = tt.dot %x, %y, %a : f32",
                  "%3 = tt.load %p : tensor<32x!tt.ptr<i32>>", "%4 = ttg.async_copy_global_to_local %q, %s : x")
    (line,) = sass_count.pipeline_report(serial)
    assert "1 plain loads in the loop (0 before its first wait), 1 async copies, waits num [0]; NO OVERLAP" in line
    flight = loop("%3 = tt.load %p : tensor<64x4x!tt.ptr<f8E4M3FN>>", "%1 = ttg.async_wait %t {num = 3 : i32}",
                  "%2 = ttng.warp_group_dot %x, %y, %a : f32", "%4 = ttg.async_copy_global_to_local %q, %s : x")
    (line,) = sass_count.pipeline_report(flight)
    assert "(1 before its first wait)" in line and "waits num [3]; copies in flight across steps" in line
    assert sass_count.pipeline_report(loop("%3 = tt.load %p : f32"))[0].endswith("(the loop's loads are plain)")
    assert sass_count.pipeline_report("tt.func @k() {\n}") == []


def test_kernel_table_diff_matches_rows_across_compiles(tmp_path):
    """scripts/kernel_table_diff.py on two committed verify tables (54c3f01 -> 4615334: e2m1 "mma" in the gate / up
    kernels, the replay in place): the totals the BENCHMARKS section quotes, the gate / up kernel's 54 us, the
    replay's copies gone and the activations' fusion new (fusion names differ between the two compiles: rows match
    by HLO op and shape); and a probe_launch.py output folder against a committed prefix."""
    import shutil
    stdout = _run(["scripts/kernel_table_diff.py", "54c3f01", "4615334", "--programs", "verify"], tmp_path)
    assert "== verify: 173 -> 178 launches, 972.4 -> 926.9 us (-45.6)" in stdout
    lines = stdout.splitlines()
    assert any("-53.97 us" in ln and ln.rstrip().endswith("moe_decode_gate_up") for ln in lines), stdout
    assert any("gone" in ln and "memcpy128" in ln for ln in lines), stdout
    assert any("new" in ln and "moe/concatenate u32[5,1281]" in ln for ln in lines), stdout
    tables = ROOT / "benchmarks" / "results" / "kernel_tables"
    probe = tmp_path / "probe"
    probe.mkdir()
    for prog, name in (("step", "kernel_table_roundtable_4l.jsonl"),
                       ("draft", "kernel_table_draft_roundtable_4l.jsonl"),
                       ("verify", "kernel_table_verify_roundtable_4l.jsonl")):
        shutil.copy(next(tables.glob(f"4615334_round_{prog}_*.jsonl")), probe / name)
    out = _run(["scripts/kernel_table_diff.py", "54c3f01", str(probe), "--probe", "--json"], tmp_path)
    recs = [json.loads(line) for line in out.splitlines()]
    assert [r["program"] for r in recs] == ["step", "draft", "verify"]
    assert recs[2]["total"]["us"] == [972.44, 926.86] and recs[2]["new"] == "kernel_table_verify_roundtable_4l.jsonl"
