"""The text-pickle walk against the C unpickler's Python 2 names and a memo kept across loads."""

import builtins
import io
import pickle
import subprocess

import pytest

from vip_hub.repo.pickles import pickle_problem

_PWN = b"ccommands\ngetoutput\np0\n.g0\n(S'id > /tmp/x'\ntR."
"""The review's file: one pickle imports ``subprocess.getoutput``, the next calls it."""


def test_the_c_unpickler_maps_python_2_names_and_keeps_its_memo() -> None:
    """What the walk must follow: below protocol 3 ``commands`` is ``subprocess`` (imported,
    not called here), and one unpickler's memo outlives a STOP."""
    assert pickle.loads(b"ccommands\ngetoutput\n.") is subprocess.getoutput
    assert pickle.loads(b"c__builtin__\nlen\n.") is builtins.len
    unpickler = pickle.Unpickler(io.BytesIO(b"c__builtin__\nlen\np0\n.g0\n."))
    assert unpickler.load() is unpickler.load() is builtins.len


@pytest.mark.parametrize(
    ("data", "module"),
    [
        (b"c__builtin__\neval\n.", "'builtins' (named '__builtin__', GLOBAL at byte 0)"),
        (b"ccommands\ngetoutput\n.", "'subprocess' (named 'commands', GLOBAL at byte 0)"),
        (b"ccopy_reg\n_reconstructor\n.", "'copyreg' (named 'copy_reg'"),
        (b"ccPickle\nloads\n.", "'pickle' (named 'cPickle'"),
        (b"cUserDict\nUserDict\n.", "'collections' (named 'UserDict'"),
        (b"c__builtin__\nxrange\n.", "'builtins' (named '__builtin__'"),  # NAME_MAPPING
        (b"cexceptions\nStandardError\n.", "'builtins' (named 'exceptions'"),  # NAME_MAPPING
        (b"I1\n.ccommands\ngetoutput\n.", "'subprocess' (named 'commands', GLOBAL at byte 4)"),
        (b"(i__builtin__\neval\n.", "'builtins' (named '__builtin__', INST at byte 1)"),
    ],
)
def test_a_python_2_name_of_a_standard_module_is_refused(data: bytes, module: str) -> None:
    problem = pickle_problem(data)
    assert problem is not None, data
    assert problem.startswith(f"holds a pickle: unpickling it would import the module {module}")


def test_the_reviews_file_is_refused() -> None:
    """Refused at its first import (``commands``), and at its call were that allowed."""
    assert pickle_problem(_PWN) == (
        "holds a pickle: unpickling it would import the module 'subprocess' "
        "(named 'commands', GLOBAL at byte 0)"
    )


def test_python_3_names_are_still_refused_as_before() -> None:
    assert pickle_problem(b"cos\nsystem\n.") == (
        "holds a pickle: unpickling it would import the module 'os' (GLOBAL at byte 0)"
    )
    assert pickle_problem(b"cposix\nsystem\n.") is not None


@pytest.mark.parametrize(
    "data",
    [
        b"cmymodule\nrun\np0\n.g0\n(S'x'\ntR.",  # GET, REDUCE
        b"cmymodule\nrun\nq\x00.h\x00(S'x'\ntR.",  # BINPUT, BINGET
        b"cmymodule\nrun\nr\x01\x00\x00\x00.j\x01\x00\x00\x00)R.",  # LONG_BINPUT, LONG_BINGET
        b"cmymodule\nrun\n\x94.h\x00)R.",  # MEMOIZE
        b"cmymodule\nThing\np0\n.(g0\no.",  # OBJ
        b"cmymodule\nThing\np0\n.g0\n)\x81.",  # NEWOBJ
        b"cmymodule\nThing\np0\n.N.I1\n.g0\n}b.",  # BUILD, two pickles later
    ],
)
def test_a_later_pickle_cannot_call_what_an_earlier_one_imported(data: bytes) -> None:
    """A reused ``pickle.Unpickler`` keeps its memo across ``load`` calls: a later pickle's GET
    finds what an earlier one imported, and a call on it is refused."""
    problem = pickle_problem(data)
    assert problem is not None and "call what it imported" in problem, problem


@pytest.mark.parametrize(
    "data",
    [
        b"I1\np0\n.g0\n.",  # data through the memo, across a STOP
        b"(lp0\nI1\na.g0\n.N.",
        b"N.N.I2\n.",
        b"cmymodule\nname\n.N.",  # an import alone of no standard module, then data
        b"c" + b"a" * 150 + b"\nx\n.",  # a long name is no Python 2 one
        b"coat\nshirt\nbag\nsneaker\n",
        b"I1\n.g0\n)R.",  # a key never put: the C unpickler raises before the call
    ],
)
def test_files_of_data_pickles_and_word_lists_still_pass(data: bytes) -> None:
    assert pickle_problem(data) is None, data


def test_a_long_run_of_opcodes_is_a_pickle_whatever_it_imports() -> None:
    """The walk stops at ``_MAX_OPCODES`` (64) opcodes in a row and calls them a pickle: a
    protocol-0 list of 40 numbers (84 opcodes) imports nothing and is still refused, while one of
    20 (44 opcodes) is data."""
    assert pickle_problem(pickle.dumps(list(range(20)), protocol=0)) is None
    problem = pickle_problem(pickle.dumps(list(range(40)), protocol=0))
    assert problem == "holds a pickle: its first 64 opcodes run without error", problem
