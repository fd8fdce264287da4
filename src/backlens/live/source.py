"""Finding a ``with`` block's source, and what Python would make of it in place.

A trace, an invoke and a backward block are all ``with`` statements whose
body backlens runs itself. Everything here is decided from the source: the
caller's file (or notebook cell, or ``python -c`` command) is read through
``linecache`` and parsed once with ``ast``; a call is recognised as a
``with`` expression by matching the calling instruction's source position
against the with items (no bytecode is read); and the facts that make a
compiled body behave as it would in place are collected from the enclosing
scopes: ``global``/``nonlocal`` declarations, the enclosing class (private
name mangling, zero-argument ``super()``), and the names other blocks of the
same trace bind (handed over at a barrier).
"""

from __future__ import annotations

import ast
import dis
import linecache
import os
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from backlens.errors import TraceError


@dataclass(frozen=True)
class BlockSource:
    """A ``with`` statement found in the caller's source, and the facts its body needs."""

    filename: str
    with_line: int
    first_line: int
    last_line: int
    # The first line where skipping may raise: CPython leaves a leading `pass`
    # (a NOP) outside the with's exception range, so an exception raised there
    # would escape __exit__. None when every statement is a no-op.
    skip_line: int | None
    as_name: str | None
    names: tuple[str, ...]  # used by the body, sorted so namespaces come out in one order
    assigned: frozenset[str]  # bound in the body's own scope (what can carry a saved value out)
    body: tuple[ast.stmt, ...]
    declared_global: frozenset[str]  # `global` in the enclosing scope (the body's own included)
    declared_nonlocal: frozenset[str]
    class_name: str | None  # the innermost enclosing class: private names are mangled with it
    first_param: str | None  # the enclosing function's first parameter (zero-argument super())
    in_function: bool
    shared: frozenset[str]  # names the other blocks of the same trace bind

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


# ---------------------------------------------------------------------------
# Reading and indexing a file


@dataclass(frozen=True)
class _Scope:
    """Where a ``with`` statement sits: its function, class and outermost enclosing ``with``."""

    function: ast.AST | None  # FunctionDef / AsyncFunctionDef / Lambda, None at module or class level
    class_name: str | None
    outer: ast.With


@dataclass
class _FileIndex:
    lines: list[str]
    headers: dict[int, list[ast.With]]  # line -> With nodes whose header covers it
    items: dict[tuple[int, int], ast.With]  # where a with item's call ends -> its With
    item_lines: dict[int, list[tuple[ast.With, ast.Call]]]  # each line a with item's call spans
    scopes: dict[int, _Scope]  # id(With) -> its scope
    tree: ast.Module


K = TypeVar("K")
V = TypeVar("V")


class Bounded(Generic[K, V]):
    """A dict that forgets its oldest entries beyond ``size`` (one per notebook cell, file or
    code object would otherwise grow without bound). A hit is a plain dict lookup: these are
    read on every trace, and an entry forgotten is only worked out again."""

    __slots__ = ("_items", "_size", "_lock")

    def __init__(self, size: int):
        self._items: dict[K, V] = {}
        self._size = size
        self._lock = threading.Lock()  # traces in several threads share the caches

    def get(self, key: K) -> V | None:
        return self._items.get(key)

    def put(self, key: K, value: V) -> None:
        with self._lock:
            items = self._items
            items.pop(key, None)  # re-entered as the newest
            items[key] = value
            while len(items) > self._size:
                del items[next(iter(items))]

    def __len__(self) -> int:
        return len(self._items)


_files: Bounded[str, _FileIndex] = Bounded(32)  # each holds a whole file's syntax tree
_blocks: Bounded[tuple[str, int, int], BlockSource] = Bounded(1024)
_declarations: Bounded[int, tuple[ast.AST, frozenset[str], frozenset[str]]] = Bounded(1024)
_command: list[str] | None = None
# CPython (3.11-3.12) keeps the AST converter's recursion depth per interpreter,
# not per thread: parsing or compiling ASTs in two threads at once can fail
# ("AST constructor recursion depth mismatch"). Both happen once per source.
ast_lock = threading.Lock()


def _no_source(filename: str, what: str) -> TraceError:
    return TraceError(
        f"{what} needs the source code of its with block, and {filename!r} has none: "
        "code typed into the plain Python REPL (stdin) is not kept anywhere backlens can read it.",
        code="no_source",
        remedy=(
            "Put the code in a .py file and run it, use IPython or Jupyter (which keep each "
            "cell's source), or register the source with linecache before exec()."
        ),
    )


def source_lines(frame: types.FrameType) -> list[str]:
    """The source of the file ``frame`` runs, or [] when none can be found."""
    filename = frame.f_code.co_filename
    lines = linecache.getlines(filename, frame.f_globals)
    if not lines and filename == "<string>" and frame.f_globals.get("__name__") == "__main__":
        lines = _command_lines()
    return lines


def _command_lines() -> list[str]:
    """The program given with ``python -c`` (kept in ``sys.orig_argv``, never in linecache)."""
    global _command
    if _command is None:
        found = ""
        argv = list(getattr(sys, "orig_argv", ()))
        for i, arg in enumerate(argv[1:], start=1):
            if arg == "-c" and i + 1 < len(argv):
                found = argv[i + 1]
                break
            if arg.startswith("-c") and len(arg) > 2:
                found = arg[2:]
                break
            if not arg.startswith("-") or arg == "-m":
                break  # a script or module runs, not a command
        _command = found.splitlines(True)
    return _command


def _index(filename: str, lines: list[str], what: str) -> _FileIndex:
    cached = _files.get(filename)
    if cached is not None and cached.lines is lines:
        return cached
    try:
        with ast_lock:
            tree = ast.parse("".join(lines), filename)
    except SyntaxError as exc:
        raise TraceError(
            f"{what} could not parse {filename!r} to find its with block: {exc}",
            code="source_unparsable",
            remedy="Make sure the file on disk matches the code that is running.",
        ) from exc
    index = _FileIndex(lines, {}, {}, {}, {}, tree)
    _scan(tree, index, None, None, None)
    _files.put(filename, index)
    return index


def _scan(node: ast.AST, index: _FileIndex, function: ast.AST | None, class_name: str | None, outer: ast.With | None) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            _scan(child, index, child, class_name, None)
        elif isinstance(child, ast.ClassDef):
            _scan(child, index, None, child.name, None)
        elif isinstance(child, ast.With) and child.body:
            index.scopes[id(child)] = _Scope(function, class_name, outer or child)
            # (a body on the `with` line still gets its header line, to be refused)
            for line in range(child.lineno, max(child.body[0].lineno, child.lineno + 1)):
                index.headers.setdefault(line, []).append(child)
            for item in child.items:
                expr = item.context_expr
                if isinstance(expr, ast.Call):
                    index.items[(expr.end_lineno or expr.lineno, expr.end_col_offset or 0)] = child
                    for line in range(expr.lineno, (expr.end_lineno or expr.lineno) + 1):
                        index.item_lines.setdefault(line, []).append((child, expr))
            _scan(child, index, function, class_name, outer or child)
        else:
            _scan(child, index, function, class_name, outer)


# ---------------------------------------------------------------------------
# Finding the block


_call_sites: Bounded[tuple[int, int, str], tuple[types.CodeType, BlockSource | TraceError | None]] = Bounded(4096)
_positions: Bounded[int, tuple[types.CodeType, list[Any]]] = Bounded(256)
_entering: Bounded[int, tuple[types.CodeType, frozenset[int] | None]] = Bounded(1024)

# What follows a call whose result a `with` statement enters.
_ENTER_WITH = frozenset(
    name for name in ("BEFORE_WITH", "SETUP_WITH", "BEFORE_ASYNC_WITH", "SETUP_ASYNC_WITH") if name in dis.opmap
)
_ENTER_BY_SPECIAL = "LOAD_SPECIAL" in dis.opmap  # 3.14: COPY 1, LOAD_SPECIAL __exit__, ...


def may_enter_with(frame: types.FrameType) -> bool:
    """False when the call ``frame`` is making is surely not the expression of a ``with``.

    A cheap filter in front of :func:`with_item_at` for calls that are nearly
    never ``with`` items (a plain ``loss.backward()``): the instruction after
    the call is not one that enters a context manager. Only ever a "no": what
    the source says decides the rest. A Python whose ``with`` it does not know
    gets "maybe" for every call. Cached per code object.
    """
    code = frame.f_code
    hit = _entering.get(id(code))
    if hit is None or hit[0] is not code:
        hit = (code, _with_item_calls(code))
        _entering.put(id(code), hit)
    offsets = hit[1]
    return offsets is None or frame.f_lasti in offsets


def _with_item_calls(code: types.CodeType) -> frozenset[int] | None:
    """Offsets of the instructions whose result the next instructions enter as a context manager."""
    if not _ENTER_WITH and not _ENTER_BY_SPECIAL:
        return None
    found: list[int] = []
    instructions = list(dis.get_instructions(code))
    for i in range(len(instructions) - 1):
        after = instructions[i + 1]
        if after.opname in _ENTER_WITH or (
            _ENTER_BY_SPECIAL and after.opname == "COPY" and i + 2 < len(instructions)
            and instructions[i + 2].opname == "LOAD_SPECIAL"
        ):
            # While the call runs, ``f_lasti`` may point at any of its inline cache entries.
            found.extend(range(instructions[i].offset, after.offset, 2))
    return frozenset(found)


def with_item_at(frame: types.FrameType, attr: str, what: str, need_source: bool) -> BlockSource | TraceError | None:
    """The ``with`` statement whose item is the call ``frame`` is making.

    ``attr`` is the called method's name (``backward``, ``trace``,
    ``invoke``). The calling instruction's source position ends where
    the call expression ends, so the match is exact; cached per code object
    and instruction. None when the call is not a ``with`` item; the error to
    raise when it is one whose body cannot run (or, with ``need_source``,
    when there is no source to tell).
    """
    code = frame.f_code
    key = (id(code), frame.f_lasti, attr)
    # Keyed by id (hashing a code object hashes its bytecode); the code object
    # is kept in the value, so its id cannot be reused while cached.
    hit = _call_sites.get(key)
    if hit is not None and hit[0] is code:
        return hit[1]
    try:
        found: BlockSource | TraceError | None = _find_item(frame, attr, what, need_source)
    except TraceError as error:
        found = error
    if not isinstance(found, TraceError):  # an error may be mended (a cell re-registered): look again
        _call_sites.put(key, (code, found))
    return found


def _find_item(frame: types.FrameType, attr: str, what: str, need_source: bool) -> BlockSource | None:
    lines = source_lines(frame)
    if not lines:
        if need_source:
            raise _no_source(frame.f_code.co_filename, what)
        return None
    try:
        index = _index(frame.f_code.co_filename, lines, what)
    except TraceError:
        if need_source:
            raise
        return None
    if not hasattr(frame.f_code, "co_positions"):  # Python 3.10: only the line is known
        found = [
            node
            for node, expr in index.item_lines.get(frame.f_lineno, ())
            if isinstance(expr.func, ast.Attribute) and expr.func.attr == attr
        ]
        return _block(found[0], index, frame.f_code.co_filename, what) if len(found) == 1 else None
    span = _call_span(frame)
    if span is None or span[1] is None or span[3] is None:
        return None
    # A call ends at its own closing parenthesis, so where it ends names it (its
    # start is the attribute's position when the call spans several lines).
    end = (span[1], span[3])
    node = index.items.get(end)
    if node is None:
        return None
    for item in node.items:
        expr = item.context_expr
        if (
            isinstance(expr, ast.Call)
            and (expr.end_lineno, expr.end_col_offset) == end
            and isinstance(expr.func, ast.Attribute)
            and expr.func.attr == attr
        ):
            return _block(node, index, frame.f_code.co_filename, what)
    return None


def _call_span(frame: types.FrameType) -> tuple[Any, ...] | None:
    code = frame.f_code
    cached = _positions.get(id(code))
    if cached is None or cached[0] is not code:
        cached = (code, list(code.co_positions()))
        _positions.put(id(code), cached)
    positions = cached[1]
    i = frame.f_lasti // 2
    return positions[i] if 0 <= i < len(positions) else None


def find_block(frame: types.FrameType, what: str) -> BlockSource:
    """The ``with`` statement that ``frame`` is entering (found by its line), with its body.

    ``what`` names the construct for error messages (``"lens.trace()"``).
    """
    filename = frame.f_code.co_filename
    lines = source_lines(frame)
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
    return _block(node, index, filename, what)


def _block(node: ast.With, index: _FileIndex, filename: str, what: str) -> BlockSource:
    key = (filename, node.lineno, node.col_offset)
    cached = _blocks.get(key)
    if cached is not None and cached.body and cached.body[0] is node.body[0]:
        return cached
    block = _describe(node, index, filename, what)
    _blocks.put(key, block)
    return block


# ---------------------------------------------------------------------------
# What the body is, in its scope


def _describe(node: ast.With, index: _FileIndex, filename: str, what: str) -> BlockSource:
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
    _reject_guarded_start([stmt for stmt in node.body if not _is_noop(stmt)], filename, what)
    as_name = None
    for item in node.items:
        if isinstance(item.optional_vars, ast.Name):
            as_name = item.optional_vars.id
    scope = index.scopes[id(node)]
    _, declared_global, declared_nonlocal = _declared(scope.function, index.tree)
    # A global name is read and written in the module, never copied in or out;
    # a nonlocal one is copied in and always written back (see compiler.py).
    declared = declared_global
    used: set[str] = set()
    for stmt in node.body:
        for sub in ast.walk(stmt):
            if isinstance(sub, ast.Name):
                used.add(sub.id)
    assigned = _assigned(node.body)
    shared: set[str] = set()
    for sub in _withs_inside(scope.outer):
        shared |= _assigned(sub.body)
    last = max((stmt.end_lineno or stmt.lineno) for stmt in node.body)
    effective = [stmt for stmt in node.body if not _is_noop(stmt)]
    first_param = None
    function = scope.function
    if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        params = [*function.args.posonlyargs, *function.args.args]
        first_param = params[0].arg if params else None
    return BlockSource(
        filename=filename,
        with_line=node.lineno,
        first_line=first,
        last_line=last,
        skip_line=effective[0].lineno if effective else None,
        as_name=as_name,
        names=tuple(sorted(used - declared)),
        assigned=frozenset(assigned - declared),
        body=tuple(node.body),
        declared_global=declared_global,
        declared_nonlocal=declared_nonlocal,
        class_name=scope.class_name,
        first_param=first_param,
        in_function=function is not None,
        shared=frozenset(shared - declared),
    )


def _declared(function: ast.AST | None, tree: ast.Module) -> tuple[ast.AST, frozenset[str], frozenset[str]]:
    """The ``global`` and ``nonlocal`` names of a scope (they hold for its whole body)."""
    scope = function if function is not None else tree
    cached = _declarations.get(id(scope))
    if cached is not None and cached[0] is scope:
        return cached
    found_global: set[str] = set()
    found_nonlocal: set[str] = set()
    stack: list[ast.AST] = list(ast.iter_child_nodes(scope))
    while stack:
        sub = stack.pop()
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(sub, ast.Global):
            found_global.update(sub.names)
        elif isinstance(sub, ast.Nonlocal):
            found_nonlocal.update(sub.names)
        stack.extend(ast.iter_child_nodes(sub))
    result = (scope, frozenset(found_global), frozenset(found_nonlocal))
    _declarations.put(id(scope), result)
    return result


def _withs_inside(node: ast.With) -> list[ast.With]:
    """Every ``with`` statement inside ``node``'s body, in the same function scope."""
    found = []
    stack: list[ast.AST] = list(node.body)
    while stack:
        sub = stack.pop()
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(sub, ast.With):
            found.append(sub)
        stack.extend(ast.iter_child_nodes(sub))
    return found


def _assigned(body: list[ast.stmt] | tuple[ast.stmt, ...]) -> set[str]:
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
            found.update((alias.asname or alias.name).split(".")[0] for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.ExceptHandler) and node.name:
            found.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            found.add(node.name)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _is_noop(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))


def _reject_guarded_start(body: list[ast.stmt], filename: str, what: str) -> None:
    """A body is skipped in place by an exception raised at its first instruction; a ``try``
    there with a ``finally`` or a handler for every exception would run its own code on it."""
    while body and isinstance(body[0], (ast.Try, *_TRY_STAR)):
        first = body[0]
        catch_all = [h for h in first.handlers if h.type is None
                     or (isinstance(h.type, ast.Name) and h.type.id == "BaseException")]
        if first.finalbody or catch_all:
            clause = "finally:" if first.finalbody else ("except:" if catch_all[0].type is None
                                                         else "except BaseException:")
            raise TraceError(
                f"the {what} block at {filename}:{first.lineno} begins with a `try` whose `{clause}` "
                "would run when backlens skips the body in place (it stops your frame at the body's "
                "first instruction, inside that try).",
                code="unsupported_statement",
                remedy="Begin the body with another statement (e.g. `result = None`), or move the "
                "try into a function the body calls.",
            )
        body = [stmt for stmt in first.body if not _is_noop(stmt)]


_TRY_STAR: tuple[type, ...] = (ast.TryStar,) if hasattr(ast, "TryStar") else ()


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
