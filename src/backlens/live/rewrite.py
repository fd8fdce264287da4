"""What a body's statements become before they are compiled.

A body runs as a function compiled from its source (``compiler.py``). Two
kinds of expression are turned into calls to backlens on the way, so that
nothing needs patching in torch for them:

* ``X.backward(...)``, in every body: as the expression of a ``with`` it makes
  a backward block (:data:`WITH_BACKWARD`; the only one of its ``with``:
  :data:`GUARDED_BACKWARD`, and the statement's body is put under
  ``if BODY_HERE():``, which skips it where the block runs it itself, with
  no trace function and no exception); elsewhere it is a plain backward
  that, inside a trace, warns that intermediate ``.grad`` stays ``None`` and
  explains a freed shared graph (:data:`CALL_BACKWARD`). Both act only on
  tensors; anything else with a ``backward`` method is called as it is.
* In a backward block's body, every way Python spells an assignment, read or
  deletion of ``X.grad`` goes through the running backward:

  - a read, ``X.grad``, becomes ``GRAD(X)``;
  - every assignment target, wherever it stands (``X.grad = v``, a tuple,
    list, nested or starred target, a ``for`` or comprehension target,
    ``with ... as X.grad``, an annotated assignment), becomes
    ``GRAD_TARGET(X).grad``: the same target on an object whose attribute
    assignment sets the gradient, so Python's own order of evaluation and
    assignment is kept exactly;
  - ``X.grad op= v`` becomes ``GRAD_TARGET(X).augment("Op")(v)``: ``X``, then
    the gradient's read, then ``v``, then the store, as Python orders them,
    with the operation applied to a copy (autograd's own buffer is never
    changed in place);
  - an item assignment, ``X.grad[k] = v`` or ``X.grad[k] op= v``, becomes
    ``GRAD_ITEMS(X)[k] = ...``: the gradient is copied, the item set in the
    copy, and the copy set as the gradient (autograd may hand one buffer to
    several paths: changed in place, the edit would reach them too; other
    in-place changes of a served gradient are refused when the block hands
    control back, ``grad_changed_in_place``);
  - ``getattr``, ``setattr`` and ``delattr`` calls are routed through
    :data:`GRAD_ATTR`, which serves a ``"grad"`` name;
  - ``del X.grad`` and ``X.grad`` in a ``case`` pattern have no meaning for a
    gradient in flight, so the block is refused before its body runs
    (:class:`~backlens.errors.TraceError`, code ``unsupported_grad_form``,
    naming the file and line).

The helpers themselves are defined where they act (``backward.py``) and
registered in :data:`HELPERS`.
"""

from __future__ import annotations

import ast
import copy
from typing import Any

from backlens.errors import TraceError
from backlens.live.source import where

PREFIX = "__backlens_"
GRAD = PREFIX + "grad__"
GRAD_TARGET = PREFIX + "grad_target__"
GRAD_ITEMS = PREFIX + "grad_items__"
GRAD_ATTR = PREFIX + "grad_attr__"
WITH_BACKWARD = PREFIX + "with_backward__"
GUARDED_BACKWARD = PREFIX + "guarded_backward__"
BODY_HERE = PREFIX + "body_here__"
CALL_BACKWARD = PREFIX + "call_backward__"
# Filled by backward.py: the function each name above calls.
HELPERS: dict[str, Any] = {}

_ATTR_BUILTINS = ("getattr", "setattr", "delattr")


def rewrite(body: list[ast.stmt], grads: bool, filename: str, what: str) -> tuple[list[ast.stmt], list[str]]:
    """The statements as they are compiled (copies), and the helper names they call.

    ``grads``: a backward block's body, whose ``.grad`` go through the running
    backward. Raises :class:`TraceError` for a ``.grad`` form that cannot be served.
    """
    if grads:
        refuse_grad_forms(body, filename, what)
    if not _needs_rewrite(body, grads):
        return list(body), []
    rewriter = _Rewriter(grads, filename)
    out = [rewriter.visit(copy.deepcopy(stmt)) for stmt in body]
    return out, sorted(rewriter.used)


def _needs_rewrite(body: list[ast.stmt], grads: bool) -> bool:
    """Whether :func:`rewrite` may change anything (a body without needs no copy)."""
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Attribute) and (node.attr == "backward" or (grads and node.attr == "grad")):
                return True
            if grads and isinstance(node, ast.Name) and node.id in _ATTR_BUILTINS:
                return True
    return False


def _name(name: str, like: ast.AST) -> ast.Name:
    return ast.copy_location(ast.Name(id=name, ctx=ast.Load()), like)


def _is_grad(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "grad"


def _is_backward_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "backward"


class _Rewriter(ast.NodeTransformer):
    def __init__(self, grads: bool, filename: str):
        self.grads = grads
        self.filename = filename
        self.used: set[str] = set()
        self._with_items: set[int] = set()
        self._guarded: set[int] = set()

    def _helper(self, name: str, like: ast.AST) -> ast.Name:
        self.used.add(name)
        return _name(name, like)

    # -- .backward() ---------------------------------------------------------
    def visit_With(self, node: ast.With) -> ast.AST:
        backwards = [item.context_expr for item in node.items if _is_backward_call(item.context_expr)]
        for expr in backwards:
            self._with_items.add(id(expr))
            # Refused with the enclosing block, before anything of it runs.
            refuse_grad_forms(node.body, self.filename, "loss.backward()")
        if len(backwards) == 1:
            self._guarded.add(id(backwards[0]))
        self.generic_visit(node)
        if len(backwards) == 1:
            first = node.body[0]
            test = ast.copy_location(ast.Call(func=self._helper(BODY_HERE, first), args=[], keywords=[]), first)
            node.body = [ast.copy_location(ast.If(test=test, body=node.body, orelse=[]), first)]
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        with_item = id(node) in self._with_items
        if self.grads and isinstance(node.func, ast.Name) and node.func.id in _ATTR_BUILTINS:
            self.generic_visit(node)
            helper = self._helper(GRAD_ATTR, node.func)
            node.args = [node.func, *node.args]
            node.func = helper
            return node
        self.generic_visit(node)
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "backward":
            if with_item:
                helper = GUARDED_BACKWARD if id(node) in self._guarded else WITH_BACKWARD
            else:
                helper = CALL_BACKWARD
            # Only the callee changes: the call keeps its source position, by which a
            # with item is recognised (source.with_item_at).
            node.func = ast.copy_location(
                ast.Call(func=self._helper(helper, func), args=[func.value], keywords=[]), func
            )
        return node

    # -- .grad -----------------------------------------------------------------
    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        if not (self.grads and isinstance(node.ctx, ast.Store) and _is_grad(node.value)):
            return self.generic_visit(node)
        grad = node.value
        assert isinstance(grad, ast.Attribute)
        node.value = _call_with(self._helper(GRAD_ITEMS, grad), [self.visit(grad.value)], grad)
        node.slice = self.visit(node.slice)
        return node

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        self.generic_visit(node)
        if not self.grads or node.attr != "grad":
            return node
        if isinstance(node.ctx, ast.Load):
            return _call_with(self._helper(GRAD, node), [node.value], node)
        if isinstance(node.ctx, ast.Store):
            node.value = _call_with(self._helper(GRAD_TARGET, node), [node.value], node.value)
        return node  # (a deletion was refused before: refuse_grad_forms)

    def visit_AugAssign(self, node: ast.AugAssign) -> ast.AST:
        if not (self.grads and _is_grad(node.target)):
            return self.generic_visit(node)
        target = node.target
        assert isinstance(target, ast.Attribute)
        obj = self.visit(target.value)
        value = self.visit(node.value)
        holder = _call_with(self._helper(GRAD_TARGET, target), [obj], target)
        augment = ast.copy_location(ast.Attribute(value=holder, attr="augment", ctx=ast.Load()), target)
        apply = ast.copy_location(
            ast.Call(func=augment, args=[ast.copy_location(ast.Constant(type(node.op).__name__), node)], keywords=[]),
            target,
        )
        call = ast.copy_location(ast.Call(func=apply, args=[value], keywords=[]), node)
        return ast.copy_location(ast.Expr(value=call), node)


def refuse_grad_forms(body: list[ast.stmt], filename: str, what: str) -> None:
    """Raise for a ``.grad`` form a backward block's body cannot serve (see the module docstring)."""
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Attribute) and node.attr == "grad" and isinstance(node.ctx, ast.Del):
                raise _refusal(node, f"`del {ast.unparse(node)}`", "deleting it", filename, what)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "delattr":
                if _constant_grad(node):
                    raise _refusal(node, f"`{ast.unparse(node)}`", "deleting it", filename, what)
            if isinstance(node, ast.match_case):
                for sub in ast.walk(node.pattern):
                    if _is_grad(sub):
                        raise _refusal(sub, f"`{ast.unparse(sub)}` in a `case` pattern", "matching against it", filename, what)


def _refusal(node: ast.AST, spelled: str, doing: str, filename: str, what: str) -> TraceError:
    line = getattr(node, "lineno", 0)
    return TraceError(
        f"{spelled} at {where(filename, line)} cannot run in the body of a {what} block: "
        "there `.grad` is the gradient flowing into a tensor as the backward runs, and "
        f"{doing} has no meaning for it.",
        code="unsupported_grad_form",
        remedy="Read or set .grad instead (to stop the gradient, set it to zeros: "
        "h.grad = torch.zeros_like(h.grad)), or do this after the block.",
    )


def _call_with(func: ast.Name, args: list[ast.expr], like: ast.AST) -> ast.Call:
    return ast.copy_location(ast.Call(func=func, args=args, keywords=[]), like)


def _constant_grad(node: ast.Call) -> bool:
    return len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "grad"
