"""Derived gradients for frameworks other than torch (API.md §11, docs/derive.md).

* ``dispatch.derive``: ``bl.derive(fn, params, *inputs)``; recognises the
  framework and runs its module (``jax_grads``, ``tinygrad_grads``,
  ``mlx_grads``, ``paddle_grads``, ``tensorflow_grads``), each imported only
  when used, so ``import backlens`` imports no framework.
* ``jax_intermediates``: per-op gradients from a jaxpr, each checked.
* ``record``: ``DerivedGrads`` and its intermediate records (numpy arrays).
* ``bundle``: a derived record's own bundle format (``kind: "derived"``).
* ``frameworks``: which framework an object belongs to, from type names only;
  the torch-only entry points refuse other frameworks' models with it.
"""
