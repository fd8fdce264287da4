"""Every error backlens raises, and its one warning class.

Each error is a :class:`BacklensError` with a snake_case ``code`` and a
one-sentence ``remedy``, and also subclasses the builtin a user would catch
(``RuntimeError``, ``KeyError``, ``ValueError``, ``NotImplementedError``), so
``except RuntimeError`` keeps working around code that starts using backlens.
"""

from __future__ import annotations

__all__ = [
    "AmbiguousGradError",
    "BacklensError",
    "BacklensWarning",
    "BackwardUnavailableError",
    "BundleError",
    "CaptureClosedError",
    "DeriveError",
    "FreedGraphError",
    "LabelNotFoundError",
    "NoGradForwardError",
    "NoGradientPathError",
    "NonFiniteGradError",
    "OnceOnlyNodeError",
    "SavedTensorModifiedError",
    "OutOfOrderError",
    "OutputPathError",
    "ReplayError",
    "TraceError",
    "UnsupportedFrameworkError",
    "UnsupportedInputError",
]


class BacklensError(Exception):
    """Base of every backlens error.

    ``code`` names the failure for programs; ``remedy`` tells a person what
    to do about it. Subclasses set class-level defaults; an instance may
    override either.
    """

    code: str = "backlens_error"
    remedy: str = "See the message above."

    def __init__(self, message: str, *, code: str | None = None, remedy: str | None = None):
        if code is not None:
            self.code = code
        if remedy is not None:
            self.remedy = remedy
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:
        text = self.message
        if self.remedy and self.remedy not in text:
            text = f"{text}\nRemedy: {self.remedy}"
        return text

    def __reduce__(self):
        return (_rebuild, (type(self), self.message, self.code, self.remedy))


def _rebuild(cls, message, code, remedy):
    return cls(message, code=code, remedy=remedy)


class AmbiguousGradError(BacklensError, RuntimeError):
    """``.grad`` was read where zero or several gradients were saved."""

    code = "ambiguous_grad"
    remedy = "Pick one with .grads[i] or .grad_for(pass_=k)."


class AmbiguousLabelError(BacklensError, KeyError):
    """A record lookup by a name that several records answer to (a module called
    several times, looked up by its address)."""

    code = "ambiguous_label"
    remedy = "Name one of them with its :k suffix, as listed in the message."

    def __str__(self) -> str:  # KeyError would repr() the message
        return BacklensError.__str__(self)


class BackwardUnavailableError(BacklensError, RuntimeError):
    """The capture cannot run or record a backward pass."""

    code = "backward_unavailable"
    remedy = "Capture the forward with gradients enabled and backward=True."


class BundleError(BacklensError, ValueError):
    """A bundle on disk is missing, corrupt, or cannot be written."""

    code = "bundle_error"
    remedy = "Save the capture again with cap.save(path), or point bl.load at a bundle directory."


class CaptureClosedError(BacklensError, RuntimeError):
    """An operation needs hooks that ``close()`` already removed."""

    code = "capture_closed"
    remedy = "Make a new capture with bl.capture(...)."


class LabelNotFoundError(BacklensError, KeyError, IndexError):
    """A label, address or name matched no record (also a position past a list's end:
    it is an ``IndexError`` too)."""

    code = "label_not_found"
    remedy = "Use one of the labels listed in the message."

    def __str__(self) -> str:  # KeyError would repr() the message
        return BacklensError.__str__(self)


class OutOfOrderError(BacklensError, RuntimeError):
    """A gradient was requested before a later-forward one it depends on."""

    code = "out_of_order"
    remedy = "Request gradients in reverse forward order: later layers first."


class FreedGraphError(BacklensError, RuntimeError):
    """A backward ran over a graph an earlier backward freed."""

    code = "freed_graph"
    remedy = "Pass retain_graph=True to every .backward() but the last."


class NoGradForwardError(BacklensError, NotImplementedError):
    """A backward block was opened over a tensor that carries no graph."""

    code = "no_grad_forward"
    remedy = "Run the forward with gradients enabled (no torch.no_grad / inference_mode)."


class NoGradientPathError(BacklensError, RuntimeError):
    """A gradient was requested for a tensor the loss does not depend on."""

    code = "no_gradient_path"
    remedy = "Request the gradient of a tensor that the loss depends on."


class TraceError(BacklensError, RuntimeError):
    """A live trace was used in a way it cannot serve."""

    code = "trace_error"
    remedy = "See the message above."


class UnsupportedInputError(BacklensError, ValueError, TypeError):
    """An argument backlens cannot work with (wrong type or value, uncombinable batch).

    Both a ``ValueError`` and a ``TypeError``: a wrong value and a wrong type
    are caught as Python code would catch them."""

    code = "unsupported_input"
    remedy = "Pass the kind of value the message names."


class UnsupportedFrameworkError(UnsupportedInputError, NotImplementedError):
    """A torch-only call got another framework's model (JAX, tinygrad, MLX, Paddle, TensorFlow).

    Also an :class:`UnsupportedInputError`, which such calls raised before
    they named the framework. ``framework`` is the framework's name.
    """

    code = "unsupported_framework"
    remedy = ("Backward capture and live tracing are torch-only; use bl.derive(fn, params, *inputs) "
              "for gradients derived with that framework's own autodiff.")

    def __init__(self, message: str, *, framework: str | None = None, code: str | None = None,
                 remedy: str | None = None):
        self.framework = framework
        super().__init__(message, code=code, remedy=remedy)

    def __reduce__(self):
        return (_rebuild_framework, (type(self), self.message, self.framework, self.code, self.remedy))


def _rebuild_framework(cls, message, framework, code, remedy):
    return cls(message, framework=framework, code=code, remedy=remedy)


class DeriveError(BacklensError, RuntimeError):
    """``bl.derive`` could not derive gradients that describe the function's run."""

    code = "derive_failed"
    remedy = "Make fn(params, *inputs) a pure function of its arguments that returns a scalar loss."


class OnceOnlyNodeError(BacklensError, RuntimeError):
    """A node freed its own saved tensors, so a retained graph cannot run it again."""

    code = "once_only_node"
    remedy = (
        "Run a fresh forward for each backward; the Function's author can use "
        "ctx.maybe_clear_saved_tensors() or clear only when the graph is not retained."
    )


class SavedTensorModifiedError(BacklensError, RuntimeError):
    """A tensor saved for backward was modified in place after it was saved."""

    code = "saved_tensor_modified"
    remedy = "Use the out-of-place form of the in-place op (or inplace=False), or clone before it."


class NonFiniteGradError(BacklensError, RuntimeError):
    """A node produced NaN/Inf gradients from finite incoming gradients."""

    code = "nonfinite_grad"
    remedy = "Guard the forward op the message names (clamp its input, add an epsilon, use a stable form)."


class OutputPathError(BacklensError, OSError, ValueError):
    """A file or folder backlens was asked to write (a report, a timeline, a monitor's sink)
    cannot be written where it was asked to: an ``OSError`` as file code expects, and a
    ``ValueError`` as a bad path argument is."""

    code = "output_not_writable"
    remedy = "Choose a writable location: a folder you may write to, and a file name that is not a folder."


class ReplayError(BacklensError, RuntimeError):
    """Differentiable replay cannot rerun what the capture recorded; the message names the op."""

    code = "replay_op_unsupported"
    remedy = "Rerun the model instead: cap.do(site, edit) without differentiable=True."


class BacklensWarning(UserWarning):
    """The one warning class; ``code`` names what happened."""

    def __init__(self, message: str, *, code: str = "backlens_warning"):
        self.code = code
        super().__init__(message)
