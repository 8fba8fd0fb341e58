"""Reading a pickle as plain data, without unpickling it.

``torch.distributed.checkpoint`` writes its ``.metadata`` file with ``pickle``. DCR never runs the
unpickler on it: ``pickletools.genops`` tokenizes the opcode stream (it executes nothing) and the
small evaluator below builds plain Python values from a fixed set of data opcodes. A reference to a
class or function (``GLOBAL``/``STACK_GLOBAL``) becomes a ``Global(module, name)`` marker that is
never imported, and constructing or calling one (``REDUCE``/``NEWOBJ``/``BUILD``) becomes an
``Obj`` record holding the marker, the arguments and the state. Only globals in the caller's
allowlist are accepted; any other global or opcode is an error naming it.
"""

from __future__ import annotations

import pickletools
import struct
from dataclasses import dataclass, field
from typing import Any

from dcr_core.errors import InvalidCheckpointError


@dataclass(frozen=True)
class Global:
    module: str
    name: str


@dataclass(eq=False)
class Obj:
    """A constructed object, as data: ``cls(*args)`` then ``state`` applied (hashable by identity)."""

    cls: Global
    args: tuple = ()
    state: Any = None
    items: list = field(default_factory=list)  # APPENDs into a list subclass / SETITEMs into a dict subclass


_MARK = object()


def load_data(raw: bytes, allowed: set[tuple[str, str]], where: str, max_ops: int = 50_000_000) -> Any:
    """Evaluate the pickle ``raw`` as data (see module docstring)."""
    stack: list = []
    memo: dict[int, Any] = {}

    def fail(msg: str) -> InvalidCheckpointError:
        return InvalidCheckpointError(f"{where}: {msg}")

    def pop_mark() -> list:
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is _MARK:
                items = stack[i + 1 :]
                del stack[i:]
                return items
        raise fail("pickle MARK missing")

    def memo_index(arg: Any) -> int:
        if isinstance(arg, bool) or not isinstance(arg, int):
            raise fail("a memo index that is not an integer")
        return arg

    def glob(module: str, name: str) -> Global:
        if (module, name) not in allowed:
            raise fail(f"refers to {module}.{name}, which is not an allowed metadata type")
        return Global(module, name)

    n = 0
    try:
        for op, arg, _pos in pickletools.genops(raw):
            n += 1
            if n > max_ops:
                raise fail("too many pickle operations")
            name = op.name
            if name in ("PROTO", "FRAME"):
                continue
            if name == "STOP":
                if len(stack) != 1:
                    raise fail("malformed pickle (stack at STOP)")
                return stack[0]
            if name == "MARK":
                stack.append(_MARK)
            elif name in ("EMPTY_DICT",):
                stack.append({})
            elif name == "EMPTY_LIST":
                stack.append([])
            elif name == "EMPTY_TUPLE":
                stack.append(())
            elif name in ("EMPTY_SET",):
                stack.append(set())
            elif name == "TUPLE":
                stack.append(tuple(pop_mark()))
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                k = int(name[-1])
                top = tuple(stack[-k:])
                del stack[-k:]
                stack.append(top)
            elif name == "LIST":
                stack.append(list(pop_mark()))
            elif name == "DICT":
                items = pop_mark()
                stack.append(dict(zip(items[::2], items[1::2])))
            elif name == "APPEND":
                v = stack.pop()
                _append(stack[-1], [v], fail)
            elif name == "APPENDS":
                items = pop_mark()
                _append(stack[-1], items, fail)
            elif name == "SETITEM":
                v, k = stack.pop(), stack.pop()
                _setitems(stack[-1], [(k, v)], fail)
            elif name == "SETITEMS":
                items = pop_mark()
                _setitems(stack[-1], list(zip(items[::2], items[1::2])), fail)
            elif name == "ADDITEMS":
                items = pop_mark()
                if not isinstance(stack[-1], set):
                    raise fail("ADDITEMS on a non-set")
                stack[-1].update(items)
            elif name == "FROZENSET":
                stack.append(frozenset(pop_mark()))
            elif name in ("BININT", "BININT1", "BININT2", "LONG1", "LONG4", "BINFLOAT",
                          "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8"):
                stack.append(arg)
            elif name == "NONE":
                stack.append(None)
            elif name == "NEWTRUE":
                stack.append(True)
            elif name == "NEWFALSE":
                stack.append(False)
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINPUT", "LONG_BINPUT"):
                memo[memo_index(arg)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET"):
                stack.append(memo[memo_index(arg)])
            elif name == "GLOBAL":
                if not isinstance(arg, str):
                    raise fail("GLOBAL without a name")
                module, _, qual = arg.partition(" ")
                stack.append(glob(module, qual))
            elif name == "STACK_GLOBAL":
                qual, module = stack.pop(), stack.pop()
                stack.append(glob(module, qual))
            elif name == "REDUCE":
                args, cls = stack.pop(), stack.pop()
                if not isinstance(cls, Global) or not isinstance(args, tuple):
                    raise fail("REDUCE of something that is not an allowed type")
                stack.append(Obj(cls, args))
            elif name == "NEWOBJ":
                args, cls = stack.pop(), stack.pop()
                if not isinstance(cls, Global) or not isinstance(args, tuple):
                    raise fail("NEWOBJ of something that is not an allowed type")
                stack.append(Obj(cls, args))
            elif name == "BUILD":
                state = stack.pop()
                if not isinstance(stack[-1], Obj):
                    raise fail("BUILD on something that is not an object")
                stack[-1].state = state
            else:
                raise fail(f"unsupported pickle operation {name}")
    except InvalidCheckpointError:
        raise
    except (ValueError, IndexError, KeyError, TypeError, struct.error) as e:
        raise fail(f"malformed pickle ({type(e).__name__}: {e})") from None
    raise fail("pickle has no STOP")


def _append(target, items, fail) -> None:
    if isinstance(target, list):
        target.extend(items)
    elif isinstance(target, Obj):
        target.items.extend(items)
    else:
        raise fail("APPEND on a non-list")


def _setitems(target, pairs, fail) -> None:
    if isinstance(target, dict):
        for k, v in pairs:
            target[k] = v
    elif isinstance(target, Obj):
        target.items.extend(pairs)
    else:
        raise fail("SETITEM on a non-dict")
