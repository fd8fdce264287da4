"""Live tracing: code in a ``with`` block that runs during the real forward and backward.

``bl.wrap(model)`` gives a :class:`Lens`; ``with lens.trace(x):`` runs its
body in step with the model; ``with loss.backward():`` runs its body in step
with the autograd engine, where ``h.grad`` is the gradient as it arrives.
Importing this package changes nothing in torch: the first ``bl.wrap()``
installs ``Tensor.backward`` (a plain call keeps its stock behaviour) and
``Tensor.save`` (see ``entry.py``).
"""

from backlens.live.batching import Batcher
from backlens.live.lens import Lens, wrap
from backlens.live.save import save
from backlens.live.tracer import Tracer

__all__ = ["Batcher", "Lens", "Tracer", "save", "wrap"]
