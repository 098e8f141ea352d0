"""Where the user's code came from, for tracebacks that come back from the workers (private).

cloudpickle sends a function defined in a script's ``__main__``, a notebook cell or a module registered
with ``cloudpickle.register_pickle_by_value`` *by value*, and since its 3.1.3 release the code objects it
rebuilds on the worker are named ``<dynamic-code>``: a worker's traceback then reads ``File
"<dynamic-code>", line 86, in fail_on_rank_1`` with no source line (older releases kept the client's file
name).  The names and line numbers survive pickling, and the client still holds the original functions,
so :func:`client_traceback` gives each such frame back the client's file name, and with it the source
line (the client's ``linecache`` knows scripts and notebook cells alike).  A frame whose file the client
can read stays as it is; one that matches none of the client's code stays as the worker wrote it.
"""

from __future__ import annotations

import functools
import linecache
import sys
import traceback
import types

WALK_BUDGET = 5000  # objects looked at per call, at most: a callable's reach can be large


def _pickled_by_value(obj) -> bool:
    """Whether cloudpickle sends ``obj``'s code (not a reference to its module)."""
    module = getattr(obj, "__module__", None)
    if module is None or module == "__main__" or module not in sys.modules:
        return True
    try:
        import cloudpickle

        return module in cloudpickle.list_registry_pickle_by_value()
    except (ImportError, AttributeError):
        return False


def _names(code: types.CodeType):
    yield from code.co_names
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _names(c)


def code_objects(*roots) -> list[types.CodeType]:
    """The code objects that pickling ``roots`` sends by value: functions, their nested functions, what
    their closures, defaults and globals hold (functions, classes, partials, methods), recursively."""
    out: list[types.CodeType] = []
    seen: set[int] = set()
    stack = list(roots)
    budget = WALK_BUDGET
    while stack and budget > 0:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, types.ModuleType):
            continue
        seen.add(id(obj))
        budget -= 1
        if isinstance(obj, types.CodeType):
            out.append(obj)
            stack.extend(c for c in obj.co_consts if isinstance(c, types.CodeType))
        elif isinstance(obj, types.FunctionType):
            if not _pickled_by_value(obj):
                continue  # sent by reference: the worker runs the installed file, and its frames say so
            stack.append(obj.__code__)
            for cell in obj.__closure__ or ():
                try:
                    stack.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
            stack.extend(obj.__defaults__ or ())
            stack.extend((obj.__kwdefaults__ or {}).values())
            g = obj.__globals__
            stack.extend(g[n] for n in set(_names(obj.__code__)) if n in g)
        elif isinstance(obj, (types.MethodType, staticmethod, classmethod)):
            stack.append(obj.__func__)
        elif isinstance(obj, functools.partial):
            stack.extend((obj.func, *obj.args, *obj.keywords.values()))
        elif isinstance(obj, property):
            stack.extend((obj.fget, obj.fset, obj.fdel))
        elif isinstance(obj, type):
            if _pickled_by_value(obj):
                stack.extend(vars(obj).values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(list(obj)[:100])
        elif isinstance(obj, dict):
            stack.extend(list(obj.values())[:100])
        elif callable(obj) and _pickled_by_value(type(obj)):
            stack.append(type(obj))  # an instance with __call__
    return out


def _origin(codes: list[types.CodeType], filename: str, name: str, lineno: int) -> str | None:
    """The client's file of the code named ``name`` that spans ``lineno``, where the frame's own
    ``filename`` is not readable here."""
    if linecache.getline(filename, lineno):
        return None
    for code in codes:
        if code.co_name == name and any(line == lineno for _, _, line in code.co_lines()):
            if linecache.getline(code.co_filename, lineno):
                return code.co_filename
    return None


def client_traceback(tb: types.TracebackType | None, *roots) -> types.TracebackType | None:
    """``tb`` (a worker's, as distributed hands it to the client) with the client's file names for the
    frames of code that pickling ``roots`` sent by value (see the module's docstring)."""
    if tb is None:
        return None
    codes = code_objects(*roots)
    if not codes:
        return tb
    import tblib  # distributed's own dependency: it ships tracebacks with it

    t = tblib.Traceback(tb)
    changed = False
    cur = t
    while cur is not None:
        code = cur.tb_frame.f_code
        origin = _origin(codes, code.co_filename, code.co_name, cur.tb_lineno)
        if origin is not None:
            code.co_filename = origin
            changed = True
        cur = cur.tb_next
    return t.as_traceback() if changed else tb


def format_traceback(tb: types.TracebackType | None) -> str:
    """``tb`` as ``traceback.format_tb`` writes it, without the column markers: a traceback that came
    from a worker is rebuilt from file names and line numbers only, and its columns are not the code's."""
    if tb is None:
        return ""
    frames = [traceback.FrameSummary(f.filename, f.lineno, f.name) for f in traceback.extract_tb(tb)]
    return "".join(traceback.StackSummary.from_list(frames).format())
