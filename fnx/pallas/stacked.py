"""Layer views of stacked weights: one argument array per weight kind instead of one per layer.

The host cost of launching a jitted program grows with its argument arrays: about 1.2 us each on the H200 host,
where a stacked argument that every kernel node indexes costs nothing per node (`scripts/probe_graph.py`,
BENCHMARKS.md fourteenth H200 session). The 48-layer step passes 1,646 parameter arrays. With the weights of
same-shaped layers stacked [L, ...], a layer reads its slice, but a slice of an XLA value that feeds a Pallas
(Triton) custom call is copied first: XLA's dynamic-slice fusion serves only registered custom calls and cuBLAS.
So the kernels take the stack itself, with a leading block of one layer squeezed out (`BlockSpec((None, ...))`,
the index static): no copy, and the kernel body sees the same ref as with a per-layer array.

- `LayerRef(stack, index)`: layer `index` of `stack`, with the slice's shape, dtype and ndim. Kernel wrappers pass
  it to `call` unchanged; everything else gets the slice through `get` / `materialize` (an XLA slice, which XLA
  fuses into its consumer fusion); `materialize_tree` for a whole pytree.
- `call(kernel, args, **pallas_call_kwargs)`: `pl.pallas_call(kernel, ...)(*args)`, where an argument may be a
  `LayerRef`: its spec is its layer, then the block the kernel's own spec asks for; the other arguments keep the
  specs given (whole blocks without any).
- `astype(x, dtype)`: a LayerRef already of that dtype stays a view; otherwise the converted slice.
- `flatten(x)`: x.reshape(-1), a LayerRef staying a view."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fnx.pallas import pdl


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class LayerRef:
    """A pytree: through a jit boundary its stack is the argument (one array for all layers), the index static."""
    stack: jax.Array
    index: int

    def tree_flatten(self):
        return (self.stack,), self.index

    @classmethod
    def tree_unflatten(cls, index, children):
        ref = object.__new__(cls)           # no checks: JAX unflattens with placeholders too
        object.__setattr__(ref, "stack", children[0])
        object.__setattr__(ref, "index", index)
        return ref

    def __post_init__(self):
        if isinstance(self.index, bool) or not isinstance(self.index, int):
            raise TypeError(f"LayerRef index must be a Python int (static), got {type(self.index).__name__}")
        if not 0 <= self.index < self.stack.shape[0]:
            raise IndexError(f"LayerRef index {self.index} outside a stack of {self.stack.shape[0]}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    @property
    def dtype(self):
        return self.stack.dtype

    @property
    def ndim(self) -> int:
        return self.stack.ndim - 1

    def get(self) -> jax.Array:
        return self.stack[self.index]

    # XLA-side code (norms, gates, reference paths) uses a layer's weight as an array: it gets the slice, which XLA
    # fuses into the consuming fusion. Only a Pallas kernel needs the view itself (`call`).
    def __jax_array__(self):
        return self.get()

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def T(self):  # noqa: N802
        return self.get().T

    def astype(self, dtype):
        return self.get().astype(dtype)

    def reshape(self, *shape):
        return self.get().reshape(*shape)

    def __getitem__(self, idx):
        return self.get()[idx]

    def __array__(self, dtype=None, copy=None):
        raise TypeError("a LayerRef is a view inside a traced program; materialize() it there")

    __add__ = lambda self, o: self.get() + o          # noqa: E731
    __radd__ = lambda self, o: o + self.get()         # noqa: E731
    __sub__ = lambda self, o: self.get() - o          # noqa: E731
    __rsub__ = lambda self, o: o - self.get()         # noqa: E731
    __mul__ = lambda self, o: self.get() * o          # noqa: E731
    __rmul__ = lambda self, o: o * self.get()         # noqa: E731
    __truediv__ = lambda self, o: self.get() / o      # noqa: E731
    __rtruediv__ = lambda self, o: o / self.get()     # noqa: E731
    __matmul__ = lambda self, o: self.get() @ o       # noqa: E731
    __rmatmul__ = lambda self, o: o @ self.get()      # noqa: E731
    __neg__ = lambda self: -self.get()                # noqa: E731
    __and__ = lambda self, o: self.get() & o          # noqa: E731
    __rshift__ = lambda self, o: self.get() >> o      # noqa: E731
    __pow__ = lambda self, o: self.get() ** o         # noqa: E731


def materialize(x):
    """x, or for a LayerRef its layer's slice."""
    return x.get() if isinstance(x, LayerRef) else x


def is_ref(a) -> bool:
    return isinstance(a, LayerRef)


def materialize_tree(tree):
    """`materialize` on every LayerRef of a pytree (a quantized weight's fields, a layer's params)."""
    return jax.tree.map(materialize, tree, is_leaf=is_ref)


def tree_map(fn, tree):
    """jax.tree.map with each LayerRef one leaf (a LayerRef is a pytree whose child is the whole stack: a plain
    tree.map would apply fn to the stack, e.g. index its layer axis)."""
    return jax.tree.map(fn, tree, is_leaf=is_ref)


def astype(x, dtype):
    """x.astype(dtype), keeping a LayerRef a view when its dtype already matches (no copy)."""
    if isinstance(x, LayerRef):
        return x if jnp.dtype(x.dtype) == jnp.dtype(dtype) else x.get().astype(dtype)
    return x.astype(dtype)


def flatten(x):
    """x.reshape(-1), a LayerRef staying a view (its stack reshaped [L, -1]: a bitcast, no copy)."""
    if isinstance(x, LayerRef):
        return LayerRef(x.stack.reshape(x.stack.shape[0], -1), x.index)
    return x.reshape(-1)


def _whole(shape):
    nd = len(shape)
    return pl.BlockSpec(tuple(shape), lambda *_: (0,) * nd)


def _layer(ref: LayerRef, given=None):
    """The spec of a LayerRef operand: layer `index`, then the block the kernel asked for (`given`, whose
    index map gets the grid indices), or without one the whole layer."""
    i = ref.index
    if given is None or getattr(given, "block_shape", None) is None:
        nd = ref.ndim
        return pl.BlockSpec((None, *ref.shape), lambda *_: (i,) + (0,) * nd)
    inner = given.index_map
    return pl.BlockSpec((None, *given.block_shape), lambda *g: (i, *inner(*g)))


def call(kernel, args, **kwargs):
    """`pl.pallas_call(kernel, **kwargs)(*args)` with LayerRef arguments read in place from their stacks. Without a
    LayerRef among args this is the plain call, so a kernel is unchanged until it is given one. The in_specs given
    (or, without any, whole blocks) stay for the other arguments. A LayerRef's spec is its layer, then the block
    its given spec asks for (the grid indices mapped as before), or the whole layer where the kernel takes the
    operand whole (`BlockSpec(memory_space=ANY)` or no specs): the kernel sees the same ref either way."""
    if not any(isinstance(a, LayerRef) for a in args):
        return pdl.pallas_call(kernel, **kwargs)(*args)
    given = kwargs.pop("in_specs", None)
    if given is not None and len(given) != len(args):
        raise ValueError(f"stacked.call: {len(given)} in_specs for {len(args)} arguments")
    if "grid" not in kwargs:
        kwargs["grid"] = ()
    specs = []
    for j, a in enumerate(args):
        g = None if given is None else given[j]
        specs.append(_layer(a, g) if isinstance(a, LayerRef) else _whole(jnp.shape(a)) if g is None else g)
    arrays = [a.stack if isinstance(a, LayerRef) else a for a in args]
    return pdl.pallas_call(kernel, in_specs=specs, **kwargs)(*arrays)
