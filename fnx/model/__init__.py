"""The Flash-Next text model as pure functions over a params pytree."""

from fnx.model.api import Model, extend, forward, load, new_state
from fnx.model.transformer import init_state, layer_plan, param_shapes, step

__all__ = ["Model", "extend", "forward", "init_state", "layer_plan", "load", "new_state", "param_shapes", "step"]
