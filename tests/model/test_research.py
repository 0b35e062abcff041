"""Research hooks: per-layer hidden states and router choices, and gradients through the forward."""

import jax
import jax.numpy as jnp
import numpy as np

import fnx
from fnx.model.api import logits_fn
from tests.model.conftest import rel_err


def test_return_layers(cases):
    c = cases("tiny-a")
    ids = c.tokens(2, 12, seed=11)
    logits, layers = fnx.forward(c.model, ids, return_layers=True)
    cfg = c.cfg
    assert layers["hidden"].shape == (cfg.num_hidden_layers, 2, 12, cfg.hc_dim)
    assert layers["experts"].shape == (cfg.num_hidden_layers, 2, 12, cfg.num_experts_per_tok)
    assert rel_err(logits, fnx.forward(c.model, ids)) < 1e-6
    np.testing.assert_array_equal(np.asarray(layers["hidden"][-1]), np.asarray(layers["final"]))
    # the transformers reference's per-layer outputs are the same hidden states
    import torch
    with torch.no_grad():
        out = c.ref(torch.as_tensor(ids), output_hidden_states=True)
    ref_last_layer = out.hidden_states[-1].numpy() if out.hidden_states[-1].shape[-1] == cfg.hc_dim else None
    if ref_last_layer is not None:
        assert rel_err(layers["hidden"][-1], ref_last_layer) < 5e-5


def test_gradient_matches_finite_differences(cases):
    c = cases("tiny-a")
    ids = jnp.asarray(c.tokens(1, 10, seed=12), jnp.int32)
    f = logits_fn(c.model, moe_impl="gather")
    target = 7

    @jax.jit     # compiled once: run op by op, the gradient and the four shifted losses took ~35 s on the CPU
    def loss(params):
        return -jax.nn.log_softmax(f(params, ids)[0, -1])[target]

    params = c.model.params
    grads = jax.jit(jax.grad(loss))(params)
    rng = np.random.default_rng(0)
    for path in (("lm_head",), ("hyper_connection_mixer", "input_mix_weight_up")):
        w = params
        g = grads
        for p in path:
            w, g = w[p], g[p]
        v = jnp.asarray(rng.normal(size=w.shape), jnp.float32)
        eps = 1e-3

        def shifted(sign):
            new = jax.tree.map(lambda x: x, params)
            node = new
            for p in path[:-1]:
                node = node[p]
            node[path[-1]] = w + sign * eps * v
            return loss(new)
        fd = (shifted(1) - shifted(-1)) / (2 * eps)
        an = jnp.vdot(g, v)
        assert abs(float(fd) - float(an)) <= 2e-2 * abs(float(an)) + 1e-4, (path, float(fd), float(an))
    # gradients reach the GDN and QSA layers too
    leaves = jax.tree_util.tree_leaves_with_path(grads["segments"])
    assert all(np.isfinite(np.asarray(x)).all() for _, x in leaves)
    assert sum(float(jnp.abs(x).sum()) > 0 for _, x in leaves) > len(leaves) // 2
