"""Pickles written as text: what ``pickle.loads`` of a text file would do, found without running it.

A protocol-0 pickle is plain ASCII, and the binary opcodes run in text too wherever their
arguments are bytes a UTF-8 text may hold, so every text file a repo carries is walked here as
CPython's C unpickler (``Modules/_pickle.c``) would run it, from its first byte:

- each argument is read as the C unpickler reads it: ``INT`` by ``strtol`` and then
  ``int(s, 0)`` (``I0x1``, ``I0o7``, ``I 010``), ``LONG`` by ``int(s, 0)`` less one trailing
  ``L`` (``L0x1L``), a ``GLOBAL``'s module as UTF-8 with no escapes, a ``STRING`` as any quoted
  line (an unpickler's ``encoding`` decides what its bytes may be);
- each opcode's effect on the stack, the marks and the memo is followed, so the walk stops only
  where the C unpickler raises (stack underflow, no mark, a memo key never put, a truncated
  argument, a byte that is no opcode). Where the walk cannot tell (an object's type, an
  application's ``persistent_load`` or out-of-band buffers), it assumes the unpickler goes on;
- a STOP ends one pickle, and the walk goes on with the same memo and what was imported, as
  more ``load`` calls of one ``pickle.Unpickler`` would (it keeps its memo, so a later pickle
  can ``GET`` what an earlier one imported); a fresh unpickler each time raises sooner.

``pickletools.genops`` cannot do this: it reads ``INT`` and ``LONG`` in base 10, decodes names
and strings as ASCII with escapes, and raises at the first byte past a call that has already
run (``…tR`` then junk, or no STOP), so each of those files counted as text.

Refused: a walk that reaches an import of a standard-library module (``GLOBAL`` naming one:
``sys.stdlib_module_names``, present wherever a client runs, some of whose imports act, or a
Python 2 name the unpickler maps to one below protocol 3, ``commands`` to ``subprocess`` and
``__builtin__`` to ``builtins`` by ``_compat_pickle``), an import that calls (``INST``), an
import by name from the stack or a registry (``STACK_GLOBAL``, ``EXT``), a call (``REDUCE``,
``BUILD``, ``OBJ``, ``NEWOBJ``, ``NEWOBJ_EX``) after any import earlier in the file, or
``_MAX_OPCODES`` opcodes in a row (a pickle, not text: the walk goes no further). An import
alone of a name no standard module has (a word list ``coat``, ``shirt``, ... reads as GLOBAL
``oat.shirt``) is not refused: it calls nothing, and a module of that name is not where a
repo's file can put one. A pickle that only builds data (``N.``, ``I1\n.``) runs nothing and is
text to this rule. Ordinary text stops at its first bytes: a line ``I`` has no digits, ``0x1``
pops an empty stack, ``#`` and ``[`` are no opcodes.
"""

from __future__ import annotations

import mmap
import re
import struct
import sys
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections.abc import Callable

__all__ = ["pickle_problem"]

_MAX_OPCODES = 64
"""This many opcodes in a row are a pickle, not text (and bound the walk)."""

_WS = rb"[\t-\r\x1c-\x20]*"
_INTEGER = re.compile(
    _WS + rb"[+-]?(?:0[xX](?:_?[0-9a-fA-F])+|0[oO](?:_?[0-7])+|0[bB](?:_?[01])+"
    rb"|0(?:_?[0-7])*|[1-9](?:_?[0-9])*)" + _WS
)
"""What ``strtol(s, 0)`` or ``int(s, 0)`` accepts (INT, LONG), and a little more."""
_DECIMAL = re.compile(_WS + rb"[+-]?[0-9](?:_?[0-9])*" + _WS)
"""``int(s, 10)``: a memo key (GET, PUT)."""
_FLOAT = re.compile(
    _WS + rb"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|(?i:inf(?:inity)?|nan))"
)
"""What ``PyOS_string_to_double`` accepts (FLOAT), and a little more."""
_MODULE = re.compile(rb"(?:[\w-]|[\x80-\xff])+(?:\.(?:[\w-]|[\x80-\xff])+)*")
"""A dotted module name a file on ``sys.path`` could have (``__import__`` runs its code)."""
_QUOTES = (ord("'"), ord('"'))
_STDLIB = frozenset(sys.stdlib_module_names)
"""The standard library's top-level modules: importable wherever a client unpickles."""


class _Stop(Exception):
    """Where the C unpickler would raise: this run of opcodes ends."""


class _Refused(Exception):
    """The walk found a pickle; the message says what it would do."""


class _Run:
    """One unpickler's state over ``data``: the stack depth, its marks, the memo's keys and
    whether anything was imported (the last two outlive a STOP)."""

    def __init__(self, data: bytes | mmap.mmap) -> None:
        self.data, self.end = data, len(data)
        self.depth = 0
        self.marks: list[int] = []
        self.memo: set[int | None] = set()
        self.imported: str | None = None  # the first import this run made, said as such

    def next_pickle(self) -> None:
        """A STOP: ``load`` returns the one object left, and the next starts on an empty stack."""
        self.need(1)
        self.depth, self.marks = 0, []

    # ---------------------------------------------------------------- reading arguments

    def take(self, pos: int, n: int) -> int:
        """The position after ``n`` bytes at ``pos``: the C unpickler raises past the end."""
        if n < 0 or pos + n > self.end:
            raise _Stop  # "pickle data was truncated", or a negative byte count
        return pos + n

    def number(self, pos: int, size: int, fmt: str) -> tuple[int, int]:
        """A little-endian number of ``size`` bytes at ``pos`` and the position after it."""
        after = self.take(pos, size)
        return struct.unpack_from(fmt, self.data, pos)[0], after

    def counted(self, pos: int, size: int, fmt: str) -> int:
        """The position after a length of ``size`` bytes and that many bytes."""
        n, pos = self.number(pos, size, fmt)
        return self.take(pos, n)

    def line(self, pos: int, shortest: int = 2) -> int:
        """Where the line at ``pos`` ends (its newline): the C unpickler needs the newline and
        ``shortest`` bytes with it."""
        newline = self.data.find(b"\n", pos)
        if newline < 0 or newline + 1 - pos < shortest:
            raise _Stop  # "pickle data was truncated", "bad readline"
        return newline

    def matches(self, pattern: re.Pattern[bytes], start: int, end: int) -> bool:
        """Whether ``pattern`` takes the bytes from ``start`` to ``end`` or to a NUL before it
        (where C's string functions stop)."""
        nul = self.data.find(b"\0", start, end)
        return pattern.fullmatch(self.data, start, end if nul < 0 else nul) is not None

    def memo_key(self, pos: int) -> tuple[int | None, int]:
        """A decimal memo key (None: too long for this walk to read) and the position after."""
        end = self.line(pos)
        if not self.matches(_DECIMAL, pos, end):
            raise _Stop
        return (int(bytes(self.data[pos:end])) if end - pos < 4000 else None), end + 1

    # ------------------------------------------------------------------------- the stack

    @property
    def fence(self) -> int:
        return self.marks[-1] if self.marks else 0

    def need(self, n: int) -> None:
        if self.depth - self.fence < n:
            raise _Stop  # "unpickling stack underflow"

    def pop_mark(self) -> int:
        """The C unpickler's ``marker()``: pop the top mark (none: it raises)."""
        if not self.marks:
            raise _Stop  # "could not find MARK"
        return self.marks.pop()

    def remember(self, key: int | None) -> None:
        """A memo key put (None: one this walk could not read)."""
        self.memo.add(key)

    def recalls(self, key: int | None) -> bool:
        """Whether the C unpickler may find ``key`` in the memo."""
        return key is None or key in self.memo or None in self.memo


_Op = Callable[[_Run, int, int], int]
"""An opcode: from the run, its argument's position and its own, the position after it."""


def _push(n: int = 1, *, need: int = 0, pops: int = 0, size: int = 0) -> _Op:
    """An opcode that takes ``size`` bytes, needs ``need`` objects above the top mark, pops
    ``pops`` of them and pushes ``n``."""

    def op(r: _Run, pos: int, at: int) -> int:
        pos = r.take(pos, size)
        r.need(need)
        r.depth += n - pops
        return pos

    return op


def _counted(size: int, fmt: str) -> _Op:
    """BINSTRING, BINBYTES, LONG1 and the like: a length, that many bytes, one object."""

    def op(r: _Run, pos: int, at: int) -> int:
        pos = r.counted(pos, size, fmt)
        r.depth += 1
        return pos

    return op


def _text(pattern: re.Pattern[bytes] | None, shortest: int = 2) -> _Op:
    """INT, FLOAT, UNICODE, PERSID: a line (that ``pattern`` takes), one object."""

    def op(r: _Run, pos: int, at: int) -> int:
        end = r.line(pos, shortest)
        if pattern is not None and not r.matches(pattern, pos, end):
            raise _Stop  # "could not convert string to int", ... to float
        r.depth += 1
        return end + 1

    return op


def _long(r: _Run, pos: int, at: int) -> int:
    end = r.line(pos)
    value_end = end - 1 if r.data[end - 1] == ord("L") else end  # one L is dropped
    if not r.matches(_INTEGER, pos, value_end):
        raise _Stop
    r.depth += 1
    return end + 1


def _string(r: _Run, pos: int, at: int) -> int:
    end = r.line(pos)
    if end - pos < 2 or r.data[pos] != r.data[end - 1] or r.data[pos] not in _QUOTES:
        raise _Stop  # "the STRING opcode argument must be quoted"
    r.depth += 1  # what its escapes and the unpickler's encoding make of it: not read
    return end + 1


def _fixed(module: str, name: str) -> str:
    """The module ``find_class`` imports for ``module`` and ``name`` below protocol 3
    (``fix_imports``): a Python 2 name mapped to its Python 3 one, as ``_compat_pickle`` says."""
    if (module, name) in NAME_MAPPING:
        return NAME_MAPPING[module, name][0]
    return IMPORT_MAPPING.get(module, module)


def _import(r: _Run, pos: int, opcode: str, at: int) -> int:
    """GLOBAL and INST: a module line and a name line, then the module is imported (INST then
    calls the name); the position after the name's line."""
    end = r.line(pos)
    after = r.line(end + 1) + 1
    if not _MODULE.fullmatch(r.data, pos, end):
        raise _Stop  # no file is named so: the import fails
    module, name = (  # 100 bytes: longer than any name _compat_pickle maps
        bytes(r.data[start : min(stop, start + 100)]).decode("utf-8", "replace")
        for start, stop in ((pos, end), (end + 1, after - 1))
    )
    fixed = _fixed(module, name)  # a Python 2 name: always a standard module's
    said = f"the module {module!r} ({opcode} at byte {at})"
    if fixed != module:
        said = f"the module {fixed!r} (named {module!r}, {opcode} at byte {at})"
    if opcode == "INST" or fixed != module or module.split(".")[0] in _STDLIB:
        raise _Refused(f"unpickling it would import {said}")
    r.imported = r.imported or said
    return after


def _global(r: _Run, pos: int, at: int) -> int:
    pos = _import(r, pos, "GLOBAL", at)
    r.depth += 1
    return pos


def _inst(r: _Run, pos: int, at: int) -> int:
    r.pop_mark()  # the C unpickler finds the mark before it reads the names
    return _import(r, pos, "INST", at)


def _call(need: int) -> _Op:
    """REDUCE, BUILD, NEWOBJ, NEWOBJ_EX: ``need`` objects in, one out (BUILD keeps its object),
    a call: refused once this run has imported anything."""
    plain = _push(need=need, pops=need)

    def op(r: _Run, pos: int, at: int) -> int:
        pos = plain(r, pos, at)
        if r.imported is not None:
            raise _Refused(f"unpickling it would import {r.imported} and call what it imported")
        r.depth += 1
        return pos

    return op


def _stack_global(r: _Run, pos: int, at: int) -> int:
    r.need(2)
    raise _Refused(f"unpickling it would import a module (STACK_GLOBAL at byte {at})")


def _ext(size: int, fmt: str) -> _Op:
    def op(r: _Run, pos: int, at: int) -> int:
        code, pos = r.number(pos, size, fmt)
        if code <= 0:
            raise _Stop  # "EXT specifies code <= 0"
        raise _Refused(f"unpickling it would import extension code {code} (EXT at byte {at})")

    return op


def _frame(r: _Run, pos: int, at: int) -> int:
    n, pos = r.number(pos, 8, "<Q")
    r.take(pos, n)  # the C unpickler reads the whole frame first
    return pos


def _mark(r: _Run, pos: int, at: int) -> int:
    r.marks.append(r.depth)
    return pos


def _pop(r: _Run, pos: int, at: int) -> int:
    if r.marks and r.marks[-1] == r.depth:
        r.marks.pop()  # the C unpickler pops a mark with nothing above it
    else:
        r.need(1)
        r.depth -= 1
    return pos


def _pop_mark(r: _Run, pos: int, at: int) -> int:
    r.depth = r.pop_mark()
    return pos


def _collect(*, even: bool = False) -> _Op:
    """TUPLE, LIST, DICT, FROZENSET: the objects above the top mark become one."""

    def op(r: _Run, pos: int, at: int) -> int:
        mark = r.pop_mark()
        if even and (r.depth - mark) % 2:
            raise _Stop  # "odd number of items for DICT"
        r.depth = mark + 1
        return pos

    return op


def _extend(*, even: bool = False) -> _Op:
    """APPENDS, SETITEMS, ADDITEMS: the objects above the top mark go into the one below it."""

    def op(r: _Run, pos: int, at: int) -> int:
        mark = r.pop_mark()
        if mark <= r.fence or (even and (r.depth - mark) % 2):
            raise _Stop  # "unpickling stack underflow", "odd number of items for SETITEMS"
        r.depth = mark
        return pos

    return op


def _obj(r: _Run, pos: int, at: int) -> int:
    mark = r.pop_mark()
    if r.depth - mark < 1:
        raise _Stop
    if r.imported is not None:  # OBJ calls the class below its arguments
        raise _Refused(f"unpickling it would import {r.imported} and call what it imported")
    r.depth = mark + 1
    return pos


def _put(key: Callable[[_Run, int], tuple[int | None, int]]) -> _Op:
    """PUT, BINPUT, LONG_BINPUT: the top object under a memo key."""

    def op(r: _Run, pos: int, at: int) -> int:
        k, pos = key(r, pos)
        if k is not None and k < 0:
            raise _Stop  # "negative PUT argument"
        r.need(1)
        r.remember(k)
        return pos

    return op


def _get(key: Callable[[_Run, int], tuple[int | None, int]]) -> _Op:
    """GET, BINGET, LONG_BINGET: the object under a memo key."""

    def op(r: _Run, pos: int, at: int) -> int:
        k, pos = key(r, pos)
        if not r.recalls(k):
            raise _Stop  # "Memo value not found"
        r.depth += 1
        return pos

    return op


def _memoize(r: _Run, pos: int, at: int) -> int:
    r.need(1)
    r.remember(len(r.memo))
    return pos


def _binary_key(size: int, fmt: str) -> Callable[[_Run, int], tuple[int | None, int]]:
    return lambda r, pos: r.number(pos, size, fmt)


_OPCODES: dict[int, _Op] = {
    code[0]: op
    for code, op in {
        b"(": _mark,  # MARK
        b".": _push(0),  # STOP: the walk handles it
        b"0": _pop,  # POP
        b"1": _pop_mark,  # POP_MARK
        b"2": _push(need=1),  # DUP
        b"F": _text(_FLOAT),  # FLOAT
        b"G": _push(size=8),  # BINFLOAT
        b"I": _text(_INTEGER),  # INT
        b"J": _push(size=4),  # BININT
        b"K": _push(size=1),  # BININT1
        b"L": _long,  # LONG
        b"M": _push(size=2),  # BININT2
        b"N": _push(),  # NONE
        b"P": _text(None, shortest=1),  # PERSID: an application's persistent_load
        b"Q": _push(need=1, pops=1),  # BINPERSID
        b"R": _call(2),  # REDUCE
        b"S": _string,  # STRING
        b"T": _counted(4, "<i"),  # BINSTRING
        b"U": _counted(1, "<B"),  # SHORT_BINSTRING
        b"V": _text(None, shortest=1),  # UNICODE
        b"X": _counted(4, "<I"),  # BINUNICODE
        b"a": _push(0, need=2, pops=1),  # APPEND
        b"b": _call(2),  # BUILD (may call __setstate__)
        b"c": _global,  # GLOBAL
        b"d": _collect(even=True),  # DICT
        b"}": _push(),  # EMPTY_DICT
        b"e": _extend(),  # APPENDS
        b"g": _get(_Run.memo_key),  # GET
        b"h": _get(_binary_key(1, "<B")),  # BINGET
        b"i": _inst,  # INST
        b"j": _get(_binary_key(4, "<I")),  # LONG_BINGET
        b"l": _collect(),  # LIST
        b"]": _push(),  # EMPTY_LIST
        b"o": _obj,  # OBJ
        b"p": _put(_Run.memo_key),  # PUT
        b"q": _put(_binary_key(1, "<B")),  # BINPUT
        b"r": _put(_binary_key(4, "<I")),  # LONG_BINPUT
        b"s": _push(0, need=3, pops=2),  # SETITEM
        b"t": _collect(),  # TUPLE
        b")": _push(),  # EMPTY_TUPLE
        b"u": _extend(even=True),  # SETITEMS
        b"B": _counted(4, "<I"),  # BINBYTES
        b"C": _counted(1, "<B"),  # SHORT_BINBYTES
        b"\x80": _push(0, size=1),  # PROTO
        b"\x81": _call(2),  # NEWOBJ
        b"\x82": _ext(1, "<B"),  # EXT1
        b"\x83": _ext(2, "<H"),  # EXT2
        b"\x84": _ext(4, "<i"),  # EXT4
        b"\x85": _push(need=1, pops=1),  # TUPLE1
        b"\x86": _push(need=2, pops=2),  # TUPLE2
        b"\x87": _push(need=3, pops=3),  # TUPLE3
        b"\x88": _push(),  # NEWTRUE
        b"\x89": _push(),  # NEWFALSE
        b"\x8a": _counted(1, "<B"),  # LONG1
        b"\x8b": _counted(4, "<i"),  # LONG4
        b"\x8c": _counted(1, "<B"),  # SHORT_BINUNICODE
        b"\x8d": _counted(8, "<Q"),  # BINUNICODE8
        b"\x8e": _counted(8, "<Q"),  # BINBYTES8
        b"\x8f": _push(),  # EMPTY_SET
        b"\x90": _extend(),  # ADDITEMS
        b"\x91": _collect(),  # FROZENSET
        b"\x92": _call(3),  # NEWOBJ_EX
        b"\x93": _stack_global,  # STACK_GLOBAL
        b"\x94": _memoize,  # MEMOIZE
        b"\x95": _frame,  # FRAME
        b"\x96": _counted(8, "<Q"),  # BYTEARRAY8
        b"\x97": _push(),  # NEXT_BUFFER: out-of-band buffers an application gives
        b"\x98": _push(0, need=1),  # READONLY_BUFFER
    }.items()
}
"""Every opcode of protocols 0 to 5, as the C unpickler runs it."""
_STOP = ord(".")


def pickle_problem(data: bytes | mmap.mmap) -> str | None:
    """Why ``data`` is a pickle (what unpickling it would import), or None: the C unpickler
    would raise, or stop, before it imports anything."""
    run, pos, ops = _Run(data), 0, 0
    try:
        while pos < len(data):
            at, op = pos, _OPCODES.get(data[pos])
            if op is None:
                return None  # "invalid load key"
            ops += 1
            if ops >= _MAX_OPCODES:
                return f"holds a pickle: its first {ops} opcodes run without error"
            pos = op(run, pos + 1, at)
            if data[at] == _STOP:  # one pickle ends; the unpickler's next load goes on
                run.next_pickle()
    except _Stop:
        return None
    except _Refused as e:
        return f"holds a pickle: {e}"
    return None
