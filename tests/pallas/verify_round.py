"""A tiny model's MTP verify window and rollback, for the tests that run it through a kernel and through the
model's jnp and compare the two."""

import jax
import jax.numpy as jnp
import numpy as np


def tiny_verify_round(path, *, seed: int, rng_seed: int, prompt_len: int, n_valid, n_keep, name: str = "tiny-b"):
    """Writes checkpoint `name` (fp32) under `path` and extends two rows by a prompt. Returns run(): a five-token
    verify window (`snapshots=True`, n_valid [2]) and `rollback` to n_keep [2], as (logits, rolled-back state).
    Each call recompiles (jax.clear_caches), so FNX_KERNELS set between calls takes effect."""
    import fnx
    from fnx.model.transformer import rollback, step
    from fnx.ple import initial_context, ngram_ids
    from tests.conftest import load_script
    d = load_script("make_tiny_checkpoint").write_checkpoint(path / name, name, seed=seed)
    model = fnx.load(d, dtype=jnp.float32)
    cfg = model.cfg
    rng = np.random.default_rng(rng_seed)
    prompt = rng.integers(0, 200, (2, prompt_len)).astype(np.int32)
    window = jnp.asarray(rng.integers(0, 200, (2, 5)), jnp.int32)
    st = fnx.new_state(model, 2, 32)
    _, st = fnx.extend(model, st, prompt)
    ctx = initial_context(2, model.ngram)
    ids = ngram_ids(ctx, np.concatenate([prompt, np.asarray(window)], axis=1), model.ngram)[0][:, -5:]
    ids = jnp.asarray(ids, jnp.int32) if cfg.ple_layer_ids else None
    nv, keep = jnp.asarray(n_valid, jnp.int32), jnp.asarray(n_keep, jnp.int32)

    def run():
        jax.clear_caches()
        lg, full, _, aux = jax.jit(lambda s: step(model.params, s, window, ids, cfg=cfg, snapshots=True,
                                                  n_valid=nv))(st)
        return lg, jax.jit(lambda f, a: rollback(cfg, f, a, keep))(full, aux)
    return run


def pallas_calls(eqns):
    """The names of the pallas_calls among a jaxpr's eqns, nested jaxprs (jit, custom calls) included, in order."""
    for e in eqns:
        if e.primitive.name == "pallas_call":
            yield str(e.params.get("name", ""))
        for sub in ("jaxpr", "call_jaxpr"):
            if sub in e.params:
                yield from pallas_calls(getattr(e.params[sub], "jaxpr", e.params[sub]).eqns)
