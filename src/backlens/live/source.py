"""Taking a ``with`` block's body out of the caller and running it ourselves.

A trace, an invoke and a backward block all work the same way:

1. ``__enter__`` finds the ``with`` statement the caller is executing (its
   frame's file and line, read through ``linecache``), parses it with ``ast``
   and compiles the body as a function under the user's real file name and
   line numbers, so tracebacks point at the user's own lines;
2. it arranges for the caller's frame to *skip* the body: a frame-local trace
   function raises :class:`SkipBody` at the first body line, and ``__exit__``
   swallows it;
3. ``__exit__`` runs the compiled body (on a copy of the caller's variables)
   in step with the model, then writes the saved names back into the caller's
   frame with :func:`write_locals`.
"""

from __future__ import annotations

import ast
import ctypes
import inspect
import linecache
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backlens.errors import TraceError

# Every name the generated wrapper adds starts with this prefix, so it can
# never collide with a user name and is filtered out of the final locals.
_PREFIX = "__backlens_"
_NS = _PREFIX + "ns__"
_LOCALS = _PREFIX + "locals__"
_FUNC = _PREFIX + "block__"


class SkipBody(BaseException):
    """Raised at a block's first body line so the caller's frame skips it.

    A ``BaseException`` so that ``except Exception`` in the caller (or a
    ``contextlib.suppress(Exception)`` stacked in the same ``with``) cannot
    swallow it before our ``__exit__`` sees it.
    """


@dataclass(frozen=True)
class FirstRequest:
    """``name.step.step...attr``: a chain of attribute and constant-index steps."""

    name: str
    steps: tuple[tuple[str, Any], ...]
    attr: str


_REQUEST_ATTRS = ("output", "input", "inputs", "grad")


def _first_request(stmt: ast.stmt) -> FirstRequest | None:
    """The request evaluated first by ``stmt``, when nothing runs before it.

    Python evaluates a call's function before its arguments, an attribute's
    object before the attribute, an operator's left operand first, a tuple's
    first element first, and an assignment's value before its targets;
    following those leftmost parts down from the statement reaches the first
    thing it evaluates.
    """
    if isinstance(stmt, (ast.Assign, ast.Expr)):
        node: ast.expr | None = stmt.value
    elif isinstance(stmt, ast.AnnAssign):
        node = stmt.value
    else:
        return None
    while node is not None:
        if isinstance(node, ast.Attribute) and node.attr in _REQUEST_ATTRS:
            chain = _chain(node.value)
            if chain is not None:
                return FirstRequest(chain[0], chain[1], node.attr)
        if isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
            node = node.value
        elif isinstance(node, (ast.BinOp, ast.Compare)):
            node = node.left
        elif isinstance(node, ast.UnaryOp):
            node = node.operand
        elif isinstance(node, ast.BoolOp):
            node = node.values[0]
        elif isinstance(node, (ast.Tuple, ast.List)) and node.elts:
            node = node.elts[0]
        else:
            return None
    return None


def _leading_requests(body: list[ast.stmt], grad: bool) -> tuple[FirstRequest, ...]:
    """Requests of the leading statements that only bind a value, then one more.

    ``h = lens.fc1.output`` (optionally ``.save()``) binds a local name and
    does nothing the model or another invoke could see, so running it later,
    together with the statement after it, is indistinguishable from running
    it when the value arrives. ``grad`` selects ``g = h.grad`` statements
    instead (backward blocks).
    """
    found: list[FirstRequest] = []
    bound: set[str] = set()
    for stmt in body[:16]:
        request = _first_request(stmt)
        if request is None or (request.attr == "grad") != grad or (grad and request.steps):
            break
        if request.name in bound:
            break  # resolved before the body runs, it must not depend on what the body binds
        found.append(request)
        if not _binds_only(stmt, grad):
            break
        bound.add(stmt.targets[0].id)  # type: ignore[attr-defined]
    return tuple(found)


def _reads_only(body: list[ast.stmt], grad: bool) -> bool:
    statements = [stmt for stmt in body if not _is_noop(stmt)]
    return 0 < len(statements) <= 16 and all(_binds_only(stmt, grad) for stmt in statements)


def _binds_only(stmt: ast.stmt, grad: bool) -> bool:
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return False
    value = stmt.value
    if isinstance(value, ast.Call) and not value.args and not value.keywords:
        func = value.func
        if isinstance(func, ast.Attribute) and func.attr == "save":
            value = func.value
    if not isinstance(value, ast.Attribute):
        return False
    if grad:
        return value.attr == "grad" and isinstance(value.value, ast.Name)
    return value.attr in ("output", "input", "inputs") and _chain(value.value) is not None


def _chain(node: ast.expr) -> tuple[str, tuple[tuple[str, Any], ...]] | None:
    steps: list[tuple[str, Any]] = []
    while True:
        if isinstance(node, ast.Name):
            return node.id, tuple(reversed(steps))
        if isinstance(node, ast.Attribute):
            steps.append(("attr", node.attr))
            node = node.value
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            steps.append(("item", node.slice.value))
            node = node.value
        else:
            return None


@dataclass(frozen=True)
class BlockSource:
    """A ``with`` statement found in the caller's source."""

    filename: str
    with_line: int
    first_line: int
    last_line: int
    # The first line where skipping may raise: CPython leaves a leading `pass`
    # (a NOP) outside the with's exception range, so an exception raised there
    # would escape __exit__. None when every statement is a no-op.
    skip_line: int | None
    as_name: str | None
    # The requests of the body's leading statements, when all but the last
    # only bind a requested value to a name (`h = lens.fc1.output.save()`);
    # `leading_grads` the same for `g = h.grad.save()` in a backward block.
    leading_requests: tuple[FirstRequest, ...]
    leading_grads: tuple[FirstRequest, ...]
    # True when every statement is one of those bindings: nothing else runs.
    reads_only: bool
    grad_reads_only: bool
    names: tuple[str, ...]  # sorted, so a namespace's names come out in one order
    # Names the body binds in its own scope (what can carry a saved value out).
    assigned: frozenset[str]
    body: tuple[ast.stmt, ...]

    @property
    def where(self) -> str:
        """``file:line`` of the ``with``, relative to the working directory when below it."""
        return where(self.filename, self.with_line)


def where(filename: str, line: int) -> str:
    """``file:line`` for messages, short when the file is below the working directory."""
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        rel = filename
    return f"{filename if rel.startswith('..') else rel}:{line}"


@dataclass
class _FileIndex:
    lines: list[str]
    # line -> With nodes whose header (``with ... :``) covers that line
    headers: dict[int, list[ast.With]]


_files: dict[str, _FileIndex] = {}
_blocks: dict[tuple[str, int, int], BlockSource] = {}
_codes: dict[tuple[Any, ...], types.CodeType] = {}


def _no_source(filename: str, what: str) -> TraceError:
    return TraceError(
        f"{what} needs the source code of its with block, and {filename!r} has none: "
        "code typed into the plain Python REPL (stdin) or passed with `python -c` is not "
        "kept anywhere backlens can read it.",
        code="no_source",
        remedy=(
            "Put the code in a .py file and run it, use IPython or Jupyter (which keep each "
            "cell's source), or register the source with linecache before exec()."
        ),
    )


def _index(filename: str, lines: list[str], what: str) -> _FileIndex:
    cached = _files.get(filename)
    if cached is not None and cached.lines is lines:
        return cached
    try:
        tree = ast.parse("".join(lines), filename)
    except SyntaxError as exc:
        raise TraceError(
            f"{what} could not parse {filename!r} to find its with block: {exc}",
            code="source_unparsable",
            remedy="Make sure the file on disk matches the code that is running.",
        ) from exc
    headers: dict[int, list[ast.With]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and node.body:
            # (a body on the `with` line still gets its header line, to be refused)
            for line in range(node.lineno, max(node.body[0].lineno, node.lineno + 1)):
                headers.setdefault(line, []).append(node)
    index = _FileIndex(lines, headers)
    _files[filename] = index
    if len(_blocks) > 4096:
        _blocks.clear()
    return index


def find_block(frame: types.FrameType, what: str) -> BlockSource:
    """The ``with`` statement that ``frame`` is entering, with its body.

    ``what`` names the construct for error messages (``"lens.trace()"``).
    """
    filename = frame.f_code.co_filename
    lines = linecache.getlines(filename, frame.f_globals)
    if not lines:
        raise _no_source(filename, what)
    index = _index(filename, lines, what)
    line = frame.f_lineno
    candidates = index.headers.get(line)
    if not candidates:
        raise TraceError(
            f"{what} is used as a context manager at {filename}:{line}, but no `with` "
            "statement starts there in the source backlens can read (was the file edited "
            "after it was loaded?).",
            code="source_mismatch",
            remedy="Rerun the code from the saved file.",
        )
    # Nested headers cannot share a line except in `with a, b:` (one node), so
    # the latest-starting candidate is the innermost statement.
    node = candidates[0] if len(candidates) == 1 else max(candidates, key=lambda n: (n.lineno, n.col_offset))
    key = (filename, node.lineno, node.col_offset)
    cached = _blocks.get(key)
    if cached is not None and cached.body and cached.body[0] is node.body[0]:
        return cached
    block = _describe(node, filename, what)
    _blocks[key] = block
    return block


def _describe(node: ast.With, filename: str, what: str) -> BlockSource:
    first = node.body[0].lineno
    if first == node.lineno or first <= max(item.context_expr.end_lineno or 0 for item in node.items):
        raise TraceError(
            f"the body of the with block at {filename}:{node.lineno} starts on the same line "
            f"as `with`; {what} needs the body on its own lines.",
            code="body_on_with_line",
            remedy="Move the body to the next line, indented.",
        )
    for stmt in node.body:
        _reject_escapes(stmt, filename, what)
    as_name = None
    for item in node.items:
        if isinstance(item.optional_vars, ast.Name):
            as_name = item.optional_vars.id
    declared: set[str] = set()
    used: set[str] = set()
    for stmt in node.body:
        for sub in ast.walk(stmt):
            if isinstance(sub, ast.Name):
                used.add(sub.id)
            elif isinstance(sub, (ast.Global, ast.Nonlocal)):
                declared.update(sub.names)
    last = max((stmt.end_lineno or stmt.lineno) for stmt in node.body)
    effective = [stmt for stmt in node.body if not _is_noop(stmt)]
    return BlockSource(
        filename=filename,
        with_line=node.lineno,
        first_line=first,
        last_line=last,
        skip_line=effective[0].lineno if effective else None,
        leading_requests=_leading_requests(node.body, grad=False),
        leading_grads=_leading_requests(node.body, grad=True),
        reads_only=_reads_only(node.body, grad=False),
        grad_reads_only=_reads_only(node.body, grad=True),
        as_name=as_name,
        names=tuple(sorted(used - declared)),
        assigned=frozenset(_assigned(node.body) - declared),
        body=tuple(node.body),
    )


def _assigned(body: list[ast.stmt]) -> set[str]:
    """Names bound in the body's own scope (not inside functions, classes or comprehensions)."""
    found: set[str] = set()
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
            continue
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            found.add(node.id)
        elif isinstance(node, ast.NamedExpr) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            found.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            found.add(node.name)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _is_noop(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))


def _reject_escapes(stmt: ast.stmt, filename: str, what: str) -> None:
    """``return``/``yield``/``await`` cannot leave a body that runs elsewhere."""
    stack: list[ast.AST] = [stmt]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom, ast.Await)):
            keyword = {ast.Return: "return", ast.Yield: "yield", ast.YieldFrom: "yield from"}.get(
                type(node), "await"
            )
            raise TraceError(
                f"`{keyword}` at {filename}:{node.lineno} cannot be used inside a {what} block: "
                "the block's body runs in step with the model, not in your function.",
                code="unsupported_statement",
                remedy=f"Save the value inside the block and {keyword} it after the block.",
            )
        stack.extend(ast.iter_child_nodes(node))


def compile_body(
    block: BlockSource, frame: types.FrameType, what: str
) -> tuple[Callable[[dict[str, Any], Callable[[], dict[str, Any]]], dict[str, Any]], dict[str, Any]]:
    """The block's body as a function, and the namespace to call it with.

    The function takes ``(namespace, locals)`` and returns its final locals.
    Its first lines bind each name the body uses that the caller has as a
    variable right now; the rest are the body's own statements, compiled with
    their original line numbers. Globals are the caller's real globals.
    """
    caller_locals = frame.f_locals
    present = tuple(name for name in block.names if name in caller_locals)
    namespace = {name: caller_locals[name] for name in present}
    key = (block.filename, block.with_line, block.first_line, id(block.body[0]), present, frame.f_code.co_name)
    code = _codes.get(key)
    if code is None:
        code = _compile(block, present, frame.f_code.co_name, what)
        if len(_codes) > 4096:
            _codes.clear()
        _codes[key] = code
    return types.FunctionType(code, frame.f_globals), namespace


def _compile(block: BlockSource, present: tuple[str, ...], name: str, what: str) -> types.CodeType:
    line = block.with_line
    where = {"lineno": line, "col_offset": 0, "end_lineno": line, "end_col_offset": 0}
    prologue: list[ast.stmt] = [
        ast.Assign(
            targets=[ast.Name(id=var, ctx=ast.Store(), **where)],
            value=ast.Subscript(
                value=ast.Name(id=_NS, ctx=ast.Load(), **where),
                slice=ast.Constant(value=var, **where),
                ctx=ast.Load(),
                **where,
            ),
            **where,
        )
        for var in present
    ]
    epilogue = ast.Return(
        value=ast.Call(func=ast.Name(id=_LOCALS, ctx=ast.Load(), **where), args=[], keywords=[], **where),
        lineno=block.last_line,
        col_offset=0,
        end_lineno=block.last_line,
        end_col_offset=0,
    )
    template = ast.parse(f"def {_FUNC}({_NS}, {_LOCALS}):\n    pass\n")
    func = template.body[0]
    assert isinstance(func, ast.FunctionDef)
    func.body = [*prologue, *block.body, epilogue]
    for node in (func, func.args, *func.args.args):
        node.lineno, node.col_offset = line, 0  # type: ignore[attr-defined]
        node.end_lineno, node.end_col_offset = line, 0  # type: ignore[attr-defined]
    try:
        module_code = compile(template, block.filename, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise TraceError(
            f"the body of the {what} block at {block.where} cannot run on its own: {exc.msg} "
            f"(line {exc.lineno}). `break`, `continue` and `nonlocal` cannot reach outside it.",
            code="unsupported_statement",
            remedy="Keep control flow that leaves the block outside the with statement.",
        ) from exc
    code = next(c for c in module_code.co_consts if isinstance(c, types.CodeType))
    # Tracebacks then read like the user's own function.
    return code.replace(co_name=name, co_qualname=name) if sys.version_info >= (3, 11) else code.replace(co_name=name)


def run_body(fn: Callable[..., dict[str, Any]], namespace: dict[str, Any]) -> dict[str, Any]:
    """Run a compiled body; returns its final local variables."""
    return fn(namespace, locals)


class Skipper:
    """Makes the caller's frame skip a block's body.

    ``install`` sets a trace function on the caller's frame that raises
    :class:`SkipBody` when the first body line is about to run. CPython drops
    the thread's trace function when one raises, so ``restore`` puts back any
    tracer (a debugger, coverage) that was there before. A body of no-op
    statements only (``pass``) needs no skipping: it may run as it is.
    """

    def __init__(self, frame: types.FrameType, first_line: int | None):
        self.frame = frame
        self.first_line = first_line
        self.fired = first_line is None
        self._active = False
        self._token = SkipBody()
        self._prev_global: Any = None
        self._prev_local: Any = None

    def install(self) -> None:
        if self.first_line is None:
            return
        self._prev_global = sys.gettrace()
        self._prev_local = self.frame.f_trace
        self.frame.f_trace = self._trace
        if self._prev_global is None:
            sys.settrace(_untraced)
        self._active = True

    def _trace(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "line" and frame is self.frame and frame.f_lineno >= self.first_line:  # type: ignore[operator]
            self.fired = True
            raise self._token
        return self._trace

    def owns(self, exc: BaseException | None) -> bool:
        return exc is self._token

    def restore(self) -> None:
        if not self._active:
            return
        self._active = False
        if sys.gettrace() is not self._prev_global:
            sys.settrace(self._prev_global)
        self.frame.f_trace = self._prev_local
        # The token's traceback holds the caller's frame: drop it, so no cycle
        # is left for the garbage collector.
        self._token.__traceback__ = None
        self._token.__context__ = None


def _untraced(frame: types.FrameType, event: str, arg: Any) -> None:
    """Global tracer while a skip is armed: traces no new frame."""
    return None


_CO_OPTIMIZED = inspect.CO_OPTIMIZED
_locals_to_fast: Any = None
if sys.version_info < (3, 13):
    _locals_to_fast = ctypes.pythonapi.PyFrame_LocalsToFast
    _locals_to_fast.argtypes = [ctypes.py_object, ctypes.c_int]
    _locals_to_fast.restype = None


def write_locals(frame: types.FrameType, updates: dict[str, Any]) -> None:
    """Bind ``updates`` as variables of ``frame`` (a function, module or exec frame).

    Module, class and ``exec`` frames keep their variables in a dict, which
    ``f_locals`` returns. A function frame keeps them in fast slots: before
    3.13, ``f_locals`` is a snapshot that ``PyFrame_LocalsToFast`` copies
    back; from 3.13 on it is a write-through proxy.
    """
    if not updates:
        return
    f_locals = frame.f_locals
    for name, value in updates.items():
        f_locals[name] = value
    if _locals_to_fast is not None and frame.f_code.co_flags & _CO_OPTIMIZED:
        _locals_to_fast(frame, 0)
