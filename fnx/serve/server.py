"""`python -m fnx.serve`: load a checkpoint, build the engine, warm it up, and serve the OpenAI-compatible API
under uvicorn until SIGTERM/SIGINT (then: stop accepting, let running requests finish for --shutdown-timeout
seconds, abort the rest, exit 0)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "checkpoints" / "fnx-mini"

log = logging.getLogger("fnx.serve")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


IDLE_CHUNK_GPU = 2048   # 24 layers, 8K prompt, H100 (2026-12-06): 13.5K tok/s at 512, 17.9K at 2048, 17.9K at 4096


def idle_chunk(requested: int | None, chunk: int, capacity: int, backend: str) -> int:
    """--prefill-chunk-idle's value: as asked, else IDLE_CHUNK_GPU on an accelerator (at most the capacity, at least
    the chunk) and the chunk itself on the CPU, where the small models it serves gain nothing from a longer chunk
    and the warm-up would compile more lengths."""
    if requested is not None:
        return requested
    if backend == "cpu":
        return chunk
    return max(chunk, min(IDLE_CHUNK_GPU, capacity))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fnx.serve",
        description="Serve a Qwen3.8-Flash-Next (qwen4_exp) checkpoint over an OpenAI-compatible HTTP API: "
                    "/v1/completions, /v1/chat/completions (both with SSE streaming), /v1/models, /tokenize, "
                    "/detokenize, /health, /metrics (Prometheus) and a chat page at /.",
        formatter_class=_Help)
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="HF checkpoint directory: config.json, *.safetensors, tokenizer.json (+ tokenizer_config.json "
                        "for the chat template, generation_config.json for EOS ids and sampling defaults); or a "
                        "`qwen4exp` .gguf file; or a directory written by `fnx convert`")
    p.add_argument("--tokenizer", default=None,
                   help="directory with tokenizer.json / tokenizer_config.json (default: the model directory, or "
                        "the directory holding the .gguf file)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="weight and activation dtype; auto: float32 on the CPU, bfloat16 on an accelerator")
    p.add_argument("--max-slots", type=int, default=8,
                   help="batch slots: requests decoded together (continuous batching; more wait in the queue)")
    p.add_argument("--capacity", type=int, default=4096,
                   help="context positions per slot: prompt + generated tokens (+ K + 1 with --speculative K)")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prompt tokens per prefill step; longer prompts are prefilled in chunks interleaved with "
                        "decode steps of the running requests")
    p.add_argument("--prefill-chunk-idle", type=int, default=None, metavar="N",
                   help=f"prompt tokens per prefill step while no request is decoding (default: {IDLE_CHUNK_GPU} on "
                        "a GPU, at most --capacity; --prefill-chunk on the CPU): no decode step waits behind these "
                        "chunks, and a longer chunk prefills a token for less (each chunk reads every routed expert); "
                        "the warm-up compiles their lengths too")
    p.add_argument("--speculative", type=int, default=0, metavar="K",
                   help="MTP speculative decoding with K draft tokens per round (1..8; 0: off); lossless for "
                        "every sampling setting, penalties and logit bias included (the drafts "
                        "take them too)")
    p.add_argument("--quant", choices=["fp8", "fp8-head"], default=None,
                   help="online weight-only quantization while loading a BF16 checkpoint: fp8 (the dense "
                        "projections and experts in FP8 128x128 blocks), fp8-head (those and the lm_head)")
    p.add_argument("--layers", choices=["auto", "unrolled", "scanned", "stacked"], default="auto",
                   help="params layout: 'stacked' stacks identical layer groups but runs every layer unrolled, the "
                        "kernels reading each layer's slice of the stacks in place (the fastest decode measured on "
                        "the H200: about a sixth of the argument arrays per launch), 'unrolled' keeps every "
                        "layer's params separate, 'scanned' runs the stacked groups under lax.scan (the shortest "
                        "compiles; on a GPU the loop copies the weights its kernels read, every step); auto: "
                        "stacked on an accelerator, scanned on the CPU (a converted checkpoint keeps its saved "
                        "layout)")
    p.add_argument("--compile-cache", default=None,
                   help="directory for JAX's persistent compilation cache, so a restart skips the compiles it has "
                        "already done ('' turns it off; default: $JAX_COMPILATION_CACHE_DIR when set, else "
                        "~/.cache/fnx/jax)")
    p.add_argument("--no-fuse-projections", action="store_true",
                   help="keep each sublayer's input projections as separate GEMVs (default: one fused GEMV per "
                        "sublayer input, fnx.model.fuse; measured faster on the H200)")
    p.add_argument("--no-overlap", action="store_true",
                   help="run every decode step and MTP round synchronously (by default the next one is launched "
                        "before this one's tokens reach the host, hiding the launch behind the device; same tokens)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; beyond slots + queue, requests get HTTP 429")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds running requests may take to finish before they are aborted")
    p.add_argument("--reasoning-parser", choices=["auto", "qwen3", "none"], default="auto",
                   help="split <think>...</think> output into reasoning_content (auto: when the tokenizer or the "
                        "chat template knows </think>)")
    p.add_argument("--ple-store", choices=["device", "pinned", "pageable", "swap", "direct", "uva", "ring"],
                   default="device",
                   help="where the PLE n-gram table lives: in device memory (device), or on the host with its rows "
                        "fetched per step: pinned host memory, a read-only mmap of the checkpoint's shards "
                        "(pageable), swappable anonymous memory (swap) or O_DIRECT reads (direct); or in pinned "
                        "host memory read by the GPU itself inside each step (uva: CUDA only); or a pageable mmap "
                        "whose rows a host thread copies into a small pinned ring for each step (ring: CUDA only)")
    p.add_argument("--ple-policy", choices=["fail", "degrade"], default="fail",
                   help="host PLE store: when rows cannot be read in time, end the affected request with an "
                        "error (fail) or run it on zero rows and count it (degrade)")
    p.add_argument("--ple-deadline-ms", type=float, default=None,
                   help="host PLE store: per-fetch deadline; rows not read by then are zero-filled (see "
                        "--ple-policy). Default: none")
    p.add_argument("--ple-fetch", choices=["auto", "ring", "sync", "pipeline", "split", "callback-pure",
                                           "callback-io", "callback-buffer"], default="auto",
                   help="host PLE store: how each step's rows reach the device. auto (default): on a CUDA GPU the "
                        "fastest measured on the H200, 'ring' (pageable, swap, direct: the step posts its row ids and "
                        "a host thread copies the rows into a small pinned ring while the first layers run; pinned: "
                        "the GPU reads the pinned table itself, as --ple-store uva), elsewhere 'sync'. Or by name: "
                        "ring; fetched before the step (sync); while the layers before the PLE layer run as a "
                        "separate program (pipeline: by a host thread; split: by the engine thread); or by a host "
                        "callback inside the step (callback-*)")
    p.add_argument("--skip-warmup", action="store_true",
                   help="do not compile the engine's programs at start-up (the first requests then wait on "
                        "compiles; for development only)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                   help="server log level")
    return p.parse_args(argv)


def _fail(msg: str) -> int:
    print(f"fnx.serve: error: {msg}", file=sys.stderr)
    return 2


def _generation_config(d: Path) -> tuple[tuple[int, ...], dict]:
    """EOS ids and sampling defaults from generation_config.json (when present)."""
    f = d / "generation_config.json"
    if not f.is_file():
        return (), {}
    g = json.loads(f.read_text())
    eos = g.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    defaults = {}
    if g.get("do_sample") is False:
        defaults["temperature"] = 0.0
    for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if k in g and g[k] is not None and not (k == "temperature" and "temperature" in defaults):
            defaults[k] = g[k]
    return eos, defaults


def ple_plan(store: str, fetch: str, policy: str, deadline_ms: float | None, cuda: bool | None = None):
    """--ple-store / --ple-fetch / --ple-policy / --ple-deadline-ms -> (ple_store for fnx.load, its options, the
    engine's ple_fetch), or an error message. fetch "auto": on a CUDA GPU the H200's fastest (a host table ->
    "ring" over it, a pinned one -> "uva"), elsewhere "sync"."""
    if cuda is None:
        from fnx.pallas.dispatch import why_unavailable
        cuda = why_unavailable("pallas") is None
    host_opts = {"policy": policy, "deadline_s": None if deadline_ms is None else deadline_ms / 1e3}
    if store in ("device", "uva"):
        if deadline_ms is not None or policy != "fail" or fetch != "auto":
            return (f"--ple-policy, --ple-deadline-ms and --ple-fetch apply to a host --ple-store, not {store!r} "
                    "(its rows are gathered inside each step)")
        return store, None, "sync"
    if store == "ring":
        if fetch not in ("auto", "ring"):
            return f"--ple-store ring fetches inside each step; --ple-fetch {fetch} applies to a host --ple-store"
        return "ring", host_opts, "sync"
    if fetch == "auto":
        fetch = "ring" if cuda else "sync"
    if fetch == "ring":
        if store == "pinned":      # the table is page-locked already: the GPU reads it in place
            return "uva", host_opts, "sync"
        return "ring", {**host_opts, "backing": store}, "sync"
    return store, host_opts, fetch


def _ple_label(asked: str, store: str, fetch: str) -> str:
    if store in ("device", "uva") and asked == store:
        return store
    if store in ("ring", "uva"):
        return f"{asked} (fetched inside each step: {store})"
    return f"{store} ({fetch})"


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_dir = Path(args.model)
    from fnx.checkpoint.orbax_io import is_converted
    is_gguf = model_dir.is_file() and model_dir.suffix == ".gguf"
    tok_dir = Path(args.tokenizer) if args.tokenizer else (model_dir.parent if is_gguf else model_dir)
    if is_gguf or (model_dir.is_dir() and is_converted(model_dir)):
        pass  # fnx.load reads these; the tokenizer comes from --tokenizer (default: beside the file / inside)
    elif not (model_dir / "config.json").is_file():
        if model_dir == DEFAULT_MODEL:
            return _fail(f"the embedded checkpoint {DEFAULT_MODEL} is not there (no config.json). Pass a checkpoint "
                         f"directory with --model PATH, e.g. one written by `python scripts/make_tiny_checkpoint.py "
                         f"/tmp/tiny` plus a tokenizer.json")
        return _fail(f"--model {model_dir}: not an HF checkpoint directory (no config.json), a .gguf file or a "
                     f"directory written by `fnx convert`")
    if args.max_slots < 1 or args.max_queue < 0 or args.capacity < 8 or args.prefill_chunk < 1:
        return _fail("need --max-slots >= 1, --max-queue >= 0, --capacity >= 8 and --prefill-chunk >= 1")
    if args.prefill_chunk_idle is not None and args.prefill_chunk_idle < args.prefill_chunk:
        return _fail(f"--prefill-chunk-idle ({args.prefill_chunk_idle}) must be at least --prefill-chunk "
                     f"({args.prefill_chunk})")
    if args.speculative and not 1 <= args.speculative <= 8:
        return _fail(f"--speculative K must be in 1..8 (0 turns it off), got {args.speculative}")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import uvicorn

    import fnx
    from fnx.engine import Engine
    from fnx.serve.app import ServerState, build_app
    from fnx.serve.metrics import Metrics
    from fnx.serve.scheduler import Scheduler
    from fnx.tokenizer import Tokenizer, TokenizerError
    from fnx.serve.worker import EngineThread

    try:
        tokenizer = Tokenizer(tok_dir)
    except TokenizerError as e:
        return _fail(str(e))
    backend = jax.default_backend()
    cache = args.compile_cache
    if cache is None and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        cache = str(Path.home() / ".cache" / "fnx" / "jax")
    if cache:
        try:
            Path(cache).mkdir(parents=True, exist_ok=True)
            jax.config.update("jax_compilation_cache_dir", cache)
        except OSError as e:
            return _fail(f"--compile-cache {cache}: {e} (pass --compile-cache '' to run without it)")
    elif cache == "":
        jax.config.update("jax_compilation_cache_dir", None)
    dtype = {"float32": np.float32, "bfloat16": jnp.bfloat16}.get(
        args.dtype, np.float32 if backend == "cpu" else jnp.bfloat16)
    if args.dtype == "auto" and model_dir.is_dir() and is_converted(model_dir):
        dtype = None  # a converted tree is restored in the dtype it was converted with
    t0 = time.perf_counter()
    try:
        plan = ple_plan(args.ple_store, args.ple_fetch, args.ple_policy, args.ple_deadline_ms)
        if isinstance(plan, str):
            return _fail(plan)
        ple_store, ple_opts, ple_fetch = plan
        model = fnx.load(model_dir, dtype=dtype, ple_store=ple_store, ple_options=ple_opts,
                         layers=args.layers, quant=args.quant)
    except (ValueError, OSError, NotImplementedError) as e:   # config, checkpoint and format errors explain
        return _fail(f"could not load {model_dir}: {e}")        # themselves
    t_load = time.perf_counter() - t0
    if tokenizer.vocab_size > model.cfg.vocab_size:
        return _fail(f"tokenizer.json has {tokenizer.vocab_size} tokens, more than the model's vocab_size "
                     f"{model.cfg.vocab_size}")
    eos, defaults = _generation_config(tok_dir if is_gguf else model_dir)
    if not eos:  # no generation_config: the chat format's end tokens
        eos = tuple(i for i in map(tokenizer.token_id, ("<|im_end|>", "<|endoftext|>")) if i is not None)
    engine = Engine(model, max_slots=args.max_slots, capacity=args.capacity, prefill_chunk=args.prefill_chunk,
                    prefill_chunk_idle=idle_chunk(args.prefill_chunk_idle, args.prefill_chunk, args.capacity,
                                                  backend),
                    speculative=args.speculative or None, extra_eos=eos, overlap=not args.no_overlap,
                    ple_fetch=ple_fetch, fuse_projections=False if args.no_fuse_projections else None)
    model = engine.model   # the engine's (fused) params: the loaded tree's separate projections are not kept
    name = args.served_model_name or model_dir.resolve().name
    idle_note = (f" ({engine.prefill_chunk_idle} while none decodes)"
                 if engine.prefill_chunk_idle > engine.prefill_chunk else "")
    print(f"fnx.serve: loaded {model_dir} in {t_load:.1f} s: {model!r}", flush=True)
    print(f"fnx.serve: engine on {backend} ({jax.devices()[0].device_kind}): {args.max_slots} slots x "
          f"{args.capacity} positions, prefill chunk {args.prefill_chunk}{idle_note}, "
          f"{'MTP speculative k=%d' % args.speculative if args.speculative else 'no speculative decoding'}, "
          f"PLE table: {_ple_label(args.ple_store, ple_store, ple_fetch)}, decode {'overlapped' if engine.overlap else 'synchronous'}, "
          f"layers {'stacked' if model.cfg.unroll_stacked else 'scanned' if model.cfg.scan_layers else 'unrolled'}, "
          f"input projections {'fused' if engine.fused else 'separate'}, "
          f"stop ids {sorted(engine.eos)}", flush=True)

    metrics = Metrics(name)
    worker = EngineThread(engine, deliver=lambda outs: None, warmup=not args.skip_warmup)
    scheduler = Scheduler(worker, args.max_slots, args.max_queue, metrics)
    worker.start()
    worker.ready.wait()
    if worker.failed is not None:
        return _fail(f"engine warm-up failed: {worker.failed}")
    if not args.skip_warmup:
        print(f"fnx.serve: warm-up compiled every request shape in {worker.warmup_seconds:.1f} s:", flush=True)
        for line in worker.warmup_log:
            print(f"  {line}", flush=True)
    reasoning = args.reasoning_parser == "qwen3" or (
        args.reasoning_parser == "auto" and (tokenizer.token_id("</think>") is not None
                                             or "</think>" in (tokenizer.template_source or "")))
    state = ServerState(tokenizer=tokenizer, scheduler=scheduler, metrics=metrics, model_name=name,
                        capacity=args.capacity, reserve=engine.reserve, vocab=model.cfg.vocab_size,
                        reasoning=reasoning, defaults=defaults)
    app = build_app(state)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    server = _Server(config, scheduler)
    print(f"fnx.serve: serving `{name}` on http://{args.host}:{args.port}  (OpenAI API at /v1, chat page at /, "
          f"metrics at /metrics; {'chat template found' if tokenizer.template_source else 'no chat template'}"
          f"{', reasoning parser on' if reasoning else ''})", flush=True)
    server.run()
    worker.stop()
    worker.join(timeout=10)
    print("fnx.serve: stopped", flush=True)
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a shutdown asked for by SIGTERM/SIGINT ends with exit status 0 (uvicorn
        re-raises the signal after shutting down) and new requests are refused as soon as the signal arrives."""

        def __init__(self, config, scheduler):
            super().__init__(config)
            self.scheduler = scheduler

        def handle_exit(self, sig, frame):
            self.scheduler.draining = True
            if not self.should_exit:
                print(f"fnx.serve: {signal.Signals(sig).name}: refusing new requests, finishing running ones "
                      f"(up to {self.config.timeout_graceful_shutdown:g} s)", flush=True)
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            original = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in original.items():
                    signal.signal(s, h)
    return Server


def _Server(config, scheduler):
    return _server_class()(config, scheduler)
