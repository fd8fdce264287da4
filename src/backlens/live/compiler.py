"""Compiling a ``with`` body into a function that behaves as the body would in place.

The body becomes ``def <caller's name>(ns, locals): ...`` compiled under the
user's file name and line numbers (tracebacks point at the user's lines),
with the caller's real globals. Its first lines bind each name the body uses
that the caller has as a variable right now (a copy: only saved values go
back). What Python would do differently in place is restored here:

* names declared ``global`` in the enclosing scope are declared ``global`` in
  the function, so the body reads and writes the module's variable;
* names declared ``nonlocal`` there are copied in and always written back;
* inside a class the function is compiled in a class of the same name, so
  private names are mangled as in place (``self.__x``), and zero-argument
  ``super()`` gets the enclosing method's ``__class__`` cell and its first
  argument;
* names that other blocks of the same trace bind, and the caller does not
  have yet, are locals of the function (unbound until a barrier hands them
  over), where a plain function would look them up as globals.

Every ``X.backward(...)`` a body spells calls backlens directly, and in a
backward block's body every form of ``X.grad`` (also in its comprehensions,
lambdas and functions) goes through the running backward: the statements are
rewritten before they are compiled (``rewrite.py``), so torch's ``Tensor``
class is never patched for them (a patch of the class slows every later
attribute lookup on tensors, in every thread, until Python re-specialises them).
"""

from __future__ import annotations

import ast
import copy
import types
from dataclasses import dataclass
from typing import Any

from backlens.errors import TraceError
from backlens.live import rewrite
from backlens.live.source import BlockSource, ast_lock

# Every name the generated wrapper adds starts with this prefix and ends in
# two underscores (never mangled), so it cannot collide with a user name.
_PREFIX = "__backlens_"
_NS = _PREFIX + "ns__"
_LOCALS = _PREFIX + "locals__"
_FUNC = _PREFIX + "block__"
_NO_FIRST = object()

_codes: dict[tuple[Any, ...], tuple[BlockSource, types.CodeType, types.CodeType, dict[str, Any]]] = {}
_checked: dict[tuple[str, int, int], int] = {}


class CompiledBody:
    """A body ready to run: ``run()`` returns its final local variables.

    ``assigned`` is spelled as the final locals spell it (mangled);
    ``writeback`` names are written back to the caller whether saved or not.
    """

    __slots__ = ("fn", "namespace", "first", "assigned", "writeback", "source")

    def __init__(
        self,
        fn: types.FunctionType,
        namespace: dict[str, Any],
        first: Any,
        assigned: frozenset[str],
        writeback: frozenset[str],
        source: BlockSource,
    ):
        self.fn = fn
        self.namespace = namespace
        self.first = first
        self.assigned = assigned
        self.writeback = writeback
        self.source = source

    @property
    def code(self) -> types.CodeType:
        return self.fn.__code__

    def run(self) -> dict[str, Any]:
        if self.first is _NO_FIRST:
            return self.fn(self.namespace, locals)
        return self.fn(self.first, self.namespace, locals)


@dataclass(frozen=True)
class _Shape:
    """What compiling a block needs that depends only on its source (worked out once)."""

    names: tuple[tuple[str, str], ...]  # (name, as the caller's locals spell it), bar super's own
    first: str | None  # the parameter zero-argument super() reads
    first_key: str | None
    uses_super: bool
    assigned: frozenset[str]
    writeback: frozenset[str]
    unbound: tuple[str, ...]  # shared names the body reads but never binds


_shapes: dict[int, tuple[BlockSource, _Shape]] = {}


def _shape(block: BlockSource) -> _Shape:
    hit = _shapes.get(id(block))
    if hit is not None and hit[0] is block:
        return hit[1]
    mangle = _mangler(block.class_name)
    uses_super = block.class_name is not None and ("super" in block.names or "__class__" in block.names)
    first = block.first_param if uses_super and block.in_function else None
    shape = _Shape(
        names=tuple((name, mangle(name)) for name in block.names if name != first and name != "__class__"),
        first=first,
        first_key=mangle(first) if first is not None else None,
        uses_super=uses_super,
        assigned=frozenset(mangle(name) for name in block.assigned),
        writeback=frozenset(mangle(name) for name in block.declared_nonlocal & block.assigned),
        unbound=tuple(sorted(name for name in block.shared if name in block.names and name not in block.assigned)),
    )
    if len(_shapes) > 4096:
        _shapes.clear()
    _shapes[id(block)] = (block, shape)
    return shape


_MISSING = object()


def _mangler(class_name: str | None) -> Any:
    stripped = class_name.lstrip("_") if class_name else ""
    if not stripped:
        return lambda name: name

    def mangle(name: str) -> str:
        if name.startswith("__") and not name.endswith("__") and "." not in name:
            return f"_{stripped}{name}"
        return name

    return mangle


def check(block: BlockSource, what: str, grads: bool = False) -> None:
    """Raise the error compiling this body would raise (once per block)."""
    key = (block.filename, block.with_line, id(block.body[0]))
    if _checked.get(key) == id(block):
        return
    with ast_lock:
        _compile(block, (), (), None, False, "<check>", "<check>", what, grads)
    if len(_checked) > 4096:
        _checked.clear()
    _checked[key] = id(block)


def compile_body(block: BlockSource, frame: types.FrameType, what: str, grads: bool = False) -> CompiledBody:
    """The block's body as a function over the caller's variables right now.

    ``grads``: the body is a backward block's, whose ``.grad`` go through
    the running backward (``rewrite.py``).
    """
    shape = _shape(block)
    caller_locals = frame.f_locals
    first = shape.first
    first_value = _NO_FIRST
    if first is not None:
        first_value = caller_locals.get(shape.first_key, _NO_FIRST)  # type: ignore[arg-type]
        if first_value is _NO_FIRST:
            first = None
    namespace: dict[str, Any] = {}
    present = []
    for name, key in shape.names:
        value = caller_locals.get(key, _MISSING)
        if value is not _MISSING:
            namespace[key] = value
            present.append(name)
    unbound = tuple(name for name in shape.unbound if name not in namespace) if shape.unbound else ()
    class_cell = shape.uses_super and "__class__" in caller_locals
    code_key = frame.f_code
    key = (id(block), tuple(present), unbound, first, class_cell, id(code_key), grads)
    hit = _codes.get(key)
    if hit is not None and hit[0] is block and hit[1] is code_key:
        code, helpers = hit[2], hit[3]
    else:
        code_name = code_key.co_name
        qualname = getattr(code_key, "co_qualname", code_name)
        with ast_lock:
            code = _compile(block, tuple(present), unbound, first, class_cell, code_name, qualname, what, grads)
        # What the rewritten statements call (rewrite.py): registered when backlens.live loads.
        helpers = {name: rewrite.HELPERS[name] for name in (*code.co_varnames, *code.co_cellvars) if name in rewrite.HELPERS}
        if len(_codes) > 4096:
            _codes.clear()
        _codes[key] = (block, code_key, code, helpers)
    if helpers:
        namespace.update(helpers)
    closure = None
    if code.co_freevars:
        cell = types.CellType(caller_locals["__class__"]) if class_cell else types.CellType()
        closure = tuple(cell if name == "__class__" else types.CellType() for name in code.co_freevars)
    fn = types.FunctionType(code, frame.f_globals, code.co_name, None, closure)
    return CompiledBody(fn, namespace, first_value, shape.assigned, shape.writeback, block)


def _from_namespace(name: str, key: str, where: dict[str, int]) -> ast.Assign:
    """``name = <the body's namespace>[key]``: a prologue line binding a local before the body."""
    return ast.Assign(
        targets=[ast.Name(id=name, ctx=ast.Store(), **where)],
        value=ast.Subscript(value=ast.Name(id=_NS, ctx=ast.Load(), **where),
                            slice=ast.Constant(value=key, **where), ctx=ast.Load(), **where),
        **where,
    )


def _compile(
    block: BlockSource,
    present: tuple[str, ...],
    unbound: tuple[str, ...],
    first: str | None,
    class_cell: bool,
    name: str,
    qualname: str,
    what: str,
    grads: bool = False,
) -> types.CodeType:
    mangle = _mangler(block.class_name)
    line = block.with_line
    where = {"lineno": line, "col_offset": 0, "end_lineno": line, "end_col_offset": 0}
    prologue: list[ast.stmt] = []
    declared = sorted(block.declared_global & _identifiers(block.body))
    if declared:
        prologue.append(ast.Global(names=declared, **where))
    prologue += [_from_namespace(var, mangle(var), where) for var in present]
    body, helpers = rewrite.rewrite(_without_declarations(block.body), grads, block.filename, what)
    prologue += [_from_namespace(helper, helper, where) for helper in helpers]
    if unbound:
        # Never runs; makes the names locals, so a barrier can bind them.
        prologue.append(
            ast.If(
                test=ast.Constant(value=False, **where),
                body=[
                    ast.Assign(
                        targets=[ast.Name(id=var, ctx=ast.Store(), **where) for var in unbound],
                        value=ast.Constant(value=None, **where),
                        **where,
                    )
                ],
                orelse=[],
                **where,
            )
        )
    epilogue = ast.Return(
        value=ast.Call(func=ast.Name(id=_LOCALS, ctx=ast.Load(), **where), args=[], keywords=[], **where),
        lineno=block.last_line,
        col_offset=0,
        end_lineno=block.last_line,
        end_col_offset=0,
    )
    params = ([first] if first is not None else []) + [_NS, _LOCALS]
    header = f"def {_FUNC}({', '.join(params)}):\n    pass\n"
    if block.class_name is not None:
        indented = "".join("    " + text for text in header.splitlines(True))
        template = ast.parse(f"class {block.class_name}:\n{indented}")
        func = template.body[0].body[0]  # type: ignore[attr-defined]
    else:
        template = ast.parse(header)
        func = template.body[0]
    assert isinstance(func, ast.FunctionDef)
    func.body = [*prologue, *body, epilogue]
    ast.fix_missing_locations(func)
    for node in ast.walk(template):
        if node is func or node in func.args.args or node is func.args or node in template.body:
            node.lineno, node.col_offset = line, 0  # type: ignore[attr-defined]
            node.end_lineno, node.end_col_offset = line, 0  # type: ignore[attr-defined]
    try:
        module_code = compile(template, block.filename, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise TraceError(
            f"the body of the {what} block at {block.where} cannot run on its own: {exc.msg} "
            f"(line {exc.lineno}). `break` and `continue` cannot reach outside it.",
            code="unsupported_statement",
            remedy="Keep control flow that leaves the block outside the with statement.",
        ) from None
    code = _function_code(module_code)
    # Tracebacks then read like the user's own function.
    return code.replace(co_name=name, co_qualname=qualname)


def _function_code(code: types.CodeType) -> types.CodeType:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_name == _FUNC:
                return const
            found = _function_code(const)
            if found is not None:
                return found
    return None  # type: ignore[return-value]


def _identifiers(body: tuple[ast.stmt, ...]) -> set[str]:
    return {node.id for stmt in body for node in ast.walk(stmt) if isinstance(node, ast.Name)}


def _without_declarations(body: tuple[ast.stmt, ...]) -> list[ast.stmt]:
    """The body with its own ``global``/``nonlocal`` statements removed (the function declares them)."""
    if not any(_declares(stmt) for stmt in body):
        return list(body)
    return [_strip(copy.deepcopy(stmt)) for stmt in body]


def _declares(node: ast.AST) -> bool:
    stack = [node]
    while stack:
        sub = stack.pop()
        if isinstance(sub, (ast.Global, ast.Nonlocal)):
            return True
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        stack.extend(ast.iter_child_nodes(sub))
    return False


class _Strip(ast.NodeTransformer):
    def visit_Global(self, node: ast.Global) -> ast.AST:
        return ast.copy_location(ast.Pass(), node)

    def visit_Nonlocal(self, node: ast.Nonlocal) -> ast.AST:
        return ast.copy_location(ast.Pass(), node)

    def _keep(self, node: ast.AST) -> ast.AST:
        return node  # a nested scope's declarations are its own

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = visit_ClassDef = _keep


def _strip(stmt: ast.stmt) -> ast.stmt:
    return _Strip().visit(stmt)
