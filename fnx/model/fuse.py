"""Fused input projections: the dense layers of one sublayer that read the same input, concatenated along their
output rows into one weight, so a decode step streams them in one GEMV instead of several small launches.

    params = fuse_projections(cfg, params)          # a new tree; the input tree is unchanged
    q, k, v, qk = linears(x, p, ("q_proj", "k_proj", "v_proj", "indexer/index_qk_proj"))

On the H200 every layer of a decode step launched the router, the shared expert's gate and up projections and its
gate as four GEMVs of 1-2.5 us each, and the GDN and QSA input projections as four each (BENCHMARKS.md, sixth H200
session: "every kernel of the step"). `linears` computes the same values either way: each output row is the same
dot over the same input, rounded once to the input dtype, then split.

Groups (`GROUPS`): the GDN input projections (qkv, z, b, a), the QSA ones (q, k, v and the indexer's q/k), the
MoE router with the shared expert's gate/up projections and its gate, the PLE key/value projections. A group is
fused by format: the members that are plain arrays of one dtype become one weight, and those in FP8 blocks of one
block shape whose row counts are whole blocks another (e.g. with `quant="fp8"` the GDN qkv and z projections fuse,
while b and a, kept in bf16, fuse with each other; the router and the shared expert's gate logit, both bf16,
fuse around the FP8 shared gate / up pair). On a device mesh the parameter names are
what `fnx.parallel` shards by, so fusion is refused there."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from fnx.model import quant

GROUPS = {
    "linear_attn": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    "self_attn": ("q_proj", "k_proj", "v_proj", "indexer/index_qk_proj"),
    "mlp": ("gate", "shared_expert/gate_proj", "shared_expert/up_proj", "shared_expert_gate"),
    "ple": ("key_proj", "value_proj"),
}
PREFIX = "fused:"


@dataclass(frozen=True)
class FusedLinear:
    """Weights [..., sum(sizes), in] (an array or `quant.Fp8Block`) of the projections `names`, stacked by rows."""
    w: object
    names: tuple[str, ...] = field(default=())
    sizes: tuple[int, ...] = field(default=())


jax.tree_util.register_dataclass(FusedLinear, data_fields=["w"], meta_fields=["names", "sizes"])


def _get(p: dict, path: str):
    for part in path.split("/"):
        p = p[part]
    return p


def _has(p: dict, path: str) -> bool:
    for part in path.split("/"):
        if not isinstance(p, dict) or part not in p:
            return False
        p = p[part]
    return True


def _pop(p: dict, path: str) -> None:
    *head, last = path.split("/")
    for part in head:
        p = p[part]
    del p[last]


def _signature(w):
    """What must agree for weights to be concatenated: the format, dtype and (FP8) block; None: never fused."""
    if isinstance(w, quant.Fp8Block):
        if w.shape[-2] % w.block[0]:
            return None                      # a partial last block of rows would mix two weights' scales
        return ("fp8", str(w.w.dtype), tuple(w.block), w.shape[-1], w.w.ndim)
    if quant.is_quantized(w):
        return None                          # NVFP4 and other formats: not fused
    return ("dense", str(w.dtype), w.shape[-1], w.ndim)


def _concat(ws: list):
    if isinstance(ws[0], quant.Fp8Block):
        return quant.Fp8Block(jnp.concatenate([w.w for w in ws], axis=-2),
                              jnp.concatenate([w.scale_inv for w in ws], axis=-2), ws[0].block)
    return jnp.concatenate(ws, axis=-2)


def _copy_dicts(tree):
    return {k: _copy_dicts(v) if isinstance(v, dict) else v for k, v in tree.items()}


def fuse_sublayer(p: dict, names: tuple[str, ...]) -> dict:
    """A copy of the sublayer dict p with the members of `names` that share a format (at least two, kept in the
    order of `names`, adjacent or not) replaced by one FusedLinear under the key PREFIX + '+'.join(members)."""
    p = _copy_dicts(p)
    present = [n for n in names if _has(p, n)]
    runs: dict = {}
    for n in present:
        sig = _signature(_get(p, n))
        if sig is not None:
            runs.setdefault(sig, []).append(n)
    for run in runs.values():
        if len(run) < 2:
            continue
        ws = [_get(p, n) for n in run]
        p[PREFIX + "+".join(run)] = FusedLinear(_concat(ws), tuple(run), tuple(int(w.shape[-2]) for w in ws))
        for n in run:
            _pop(p, n)
    return p


def _fuse_layer(layer: dict) -> dict:
    layer = dict(layer)
    for key, names in GROUPS.items():
        if key in layer:
            layer[key] = fuse_sublayer(layer[key], names)
    return layer


def fuse_projections(cfg, params: dict) -> dict:
    """The params tree with every layer's input projections fused (`GROUPS`); scanned segments (stacked weights)
    fuse along their row axis the same way. The input tree is left as it was (the fused weights are new arrays)."""
    from fnx.model.transformer import layer_plan
    segments = [tuple(_fuse_layer(lp) for lp in seg_params)
                for seg, seg_params in zip(layer_plan(cfg), params["segments"])]
    return dict(params, segments=segments)


def fuse_mtp(mp: dict) -> dict:
    """The MTP params with its decoder layer's projections fused."""
    return dict(mp, layer=_fuse_layer(mp["layer"]))


def is_fused(params) -> bool:
    return any(isinstance(leaf, FusedLinear)
               for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, FusedLinear)))


def linears(x: jax.Array, p: dict, names: tuple[str, ...], linear=None) -> tuple:
    """x @ w.T for each projection in `names` (paths into p, '/' for nested dicts), reading fused weights where
    `fuse_sublayer` made them: one product, split by rows. Same values as separate products."""
    return tuple(w.get() for w in linear_windows(x, p, names, linear))


@dataclass(frozen=True)
class Window:
    """Columns [start, start + size) of a product `buf` [..., W]: one projection's output inside a fused product,
    handed to a kernel that reads it in place (a slice feeding a custom call is a copy kernel of its own)."""
    buf: jax.Array
    start: int
    size: int

    def get(self) -> jax.Array:
        from fnx.pallas.kernel_math import take_window
        return take_window(self.buf, self.start, self.size)


def linear_windows(x: jax.Array, p: dict, names: tuple[str, ...], linear=None, partials: bool = False) -> tuple:
    """As `linears`, each output a `Window` into the product that computed it (a fused one, or its own). With the
    model's own `linear` (linear=None), exactly two products go through `fnx.model.ops.linear_pair` (one launch
    where a kernel pairs them). `partials`: the caller's consumers take split-K partials (`Window.buf` may then be
    a `fnx.pallas.kernel_math.Partials`; `Window.get` sums it)."""
    # the products to compute: each fused weight that holds one of `names`, then each name not fused
    prods: list[tuple[tuple[str, ...], tuple[int, ...], object]] = []
    covered: set[str] = set()
    for key, f in p.items():
        if isinstance(key, str) and key.startswith(PREFIX) and isinstance(f, FusedLinear) and \
                any(n in names for n in f.names):
            prods.append((tuple(f.names), tuple(f.sizes), f.w))
            covered.update(f.names)
    for n in names:
        if n not in covered:
            prods.append(((n,), (None,), _get(p, n)))
    if len(prods) == 2 and linear is None:
        # two products of x (e.g. an FP8 one and a narrow bf16 one): one launch where a kernel pairs them
        # (each as a window (buffer, start): the several-token pair computes both as columns of one buffer)
        from fnx.model.ops import linear_pair
        ys = linear_pair(x, prods[0][2], prods[1][2], windows=True, partials=partials)
    else:
        if linear is None:
            from fnx.model.ops import linear
        ys = [(linear(x, w), 0) for _, _, w in prods]
    out: dict[str, Window] = {}
    for (members, sizes, w), (y, start) in zip(prods, ys):
        for n, size in zip(members, sizes):
            size = w.shape[-2] if size is None else size     # a weight [..., out, in]
            out[n] = Window(y, start, size)
            start += size
    return tuple(out[n] for n in names)
