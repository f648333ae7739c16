"""Where a collective was called from, and where a thread is now, as ``file:line in function``.

The place a user can act on is the first frame outside ddpkit, torch and the standard library: the
``dist.all_reduce`` in the training script, or the ``loss.backward()`` whose hook issued DDP's bucket.
The walk is a few attribute reads per frame, with the verdict per code object cached, since it runs
on every collective. The cache is keyed by the code object's ``id``, not the object: Python hashes a
code object anew at each lookup, over all of its bytecode (3.11: 24 us for a 15 KB function), and a
walk out of a backward hook passes a dozen frames, a user's long training loop among them. On a
short DDP step that halved the recorder's cost (``tests/hangs/recorder_cost.py``, third measure).
"""
from __future__ import annotations

import os
import sys
import sysconfig
from types import CodeType, FrameType

import torch

import ddpkit
from ddpkit.runtime.hangs.report import ISSUERS

__all__ = ["Site", "call_site", "thread_site", "format_site", "traceback_site", "handled_error", "describe_error"]

Site = tuple  # (filename, lineno, function[, caller's Site or None]): formatted only when a report needs it;
# a caller in the innermost frame's own file carries the training script's innermost frame as its own

_DDP = os.path.join(os.path.dirname(ddpkit.__file__), "ddp") + os.sep
_OURS = tuple(os.path.dirname(m.__file__) + os.sep for m in (ddpkit, torch))
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_THIRD_PARTY = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
# torch's Join: the count of ranks still active that each forward inside ``with model.join():`` all-reduces
_JOIN = os.path.join(os.path.dirname(torch.__file__), "distributed", "algorithms", "join.py")
# id(code) -> (code, internal, via): the entry holds its code object, so that no other one takes its
# id; via: "DDP" for ddpkit's DDP, "SyncBatchNorm" for its layer, "torch's Join" for torch's join.py,
# the function's name elsewhere in ddpkit, else None
_known: dict[int, tuple[CodeType, bool, str | None]] = {}


def _classify(code: CodeType) -> tuple[CodeType, bool, str | None]:
    name = code.co_filename
    if name.startswith("<frozen") or name.startswith(_OURS):
        internal = True
    else:
        internal = name.startswith(_STDLIB) and not any(part in name for part in _THIRD_PARTY)
    via = (("SyncBatchNorm" if os.path.basename(name).startswith("sync_batchnorm") else "DDP")
           if name.startswith(_DDP) else code.co_name if name.startswith(_OURS[0])
           else "torch's Join" if name == _JOIN else None)
    entry = _known[id(code)] = (code, internal, via)
    return entry


def _is_internal(code: CodeType) -> bool:
    return (_known.get(id(code)) or _classify(code))[1]


def call_site(depth: int = 2) -> tuple[Site | None, str | None]:
    """The caller's user frame as a ``Site``, with the user frame that called it, and which of
    ddpkit's functions the user called on the way: ``"DDP"`` when ddpkit's DDP issued it (in
    backward), ``"SyncBatchNorm"`` when that layer did (also inside a DDP's forward), ``"torch's
    Join"`` for the count of ranks still active that a forward inside ``model.join()`` issues, else e.g.
    ``"save"``, or None. The second frame tells apart two calls of one helper
    (``reduce_mean()`` called from two lines), which a report shows as two places."""
    frame: FrameType | None = sys._getframe(depth)
    via = None
    known = _known
    while frame is not None:
        entry = known.get(id(frame.f_code)) or _classify(frame.f_code)
        if not entry[1]:
            return _with_caller(frame), via
        if via not in ISSUERS and entry[2] is not None:
            via = entry[2]
        frame = frame.f_back
    return None, via


def _first_user(frame: FrameType | None) -> FrameType | None:
    """The innermost user frame from ``frame`` outwards."""
    while frame is not None and _is_internal(frame.f_code):
        frame = frame.f_back
    return frame


def _site(frame: FrameType) -> Site:
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


def _with_caller(frame: FrameType) -> Site:
    """``frame`` as a ``Site``, with the user frame that called it. Where that caller is in the same
    file, a helper module's (``log_metrics()`` calling ``reduce_mean()`` in ``utils.py``), the caller
    carries the innermost frame of the training script (``__main__``) as its own, where there is one."""
    caller = _first_user(frame.f_back)
    if caller is None:
        return _site(frame) + (None,)
    here, script = frame.f_code.co_filename, _main_file()
    if caller.f_code.co_filename != here or here == script or script is None:
        return _site(frame) + (_site(caller),)
    outer = caller.f_back
    for _ in range(_SCRIPT_SEARCH):  # bounded: where the script is not on this stack (a test runner's
        if outer is None or outer.f_code.co_filename == script:  # workers), the walk went to its bottom
            break
        outer = outer.f_back
    else:
        outer = None
    return _site(frame) + (_site(caller) + (None if outer is None else _site(outer),),)


_SCRIPT_SEARCH = 16
"""How many frames past a helper module's caller the walk looks for the training script's."""


def _main_file() -> str | None:
    """The training script's file name as its frames give it (``__main__``'s ``__file__``)."""
    return getattr(sys.modules.get("__main__"), "__file__", None)


def thread_site(frame: FrameType | None) -> tuple[Site | None, Site | None]:
    """(the innermost user frame with its caller, the innermost frame) of a thread whose top frame
    is ``frame``: a rank stuck in a helper (``wait_for_file()``) is shown with the line that called it."""
    user = _first_user(frame)
    return (None if user is None else _with_caller(user)), (None if frame is None else _site(frame))


def traceback_site(tb) -> Site | None:
    """The innermost user frame of a traceback (where an uncaught exception was raised)."""
    site = None
    while tb is not None:
        if not _is_internal(tb.tb_frame.f_code):
            code = tb.tb_frame.f_code
            site = (code.co_filename, tb.tb_lineno, code.co_name)
        tb = tb.tb_next
    return site


def handled_error(thread_id: int | None) -> BaseException | None:
    """The exception thread ``thread_id`` is handling now (inside an ``except:`` or ``finally:``
    block, where cleanup code may call a collective), or None."""
    current = getattr(sys, "_current_exceptions", None)
    if thread_id is None or current is None:
        return None
    info = current().get(thread_id)
    return info[1] if isinstance(info, tuple) else info  # Python 3.11: an exc_info tuple


def describe_error(error: BaseException) -> str:
    """``ValueError: bad batch (raised at train.py:9 in <module>)``, on one line."""
    try:
        text = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails is still named
        text = ""
    site = traceback_site(error.__traceback__)
    return (type(error).__name__ + (f": {text}" if text else "")
            + (f" (raised at {format_site(site)})" if site else ""))


def format_site(site: Site | None) -> str:
    """``train.py:88 in step()``, the path relative to the working directory when it is under it;
    with its caller, ``utils.py:3 in reduce_mean(), called from train.py:88 in step()``; through a
    helper module, ``utils.py:3 in reduce_mean(), called from utils.py:9 in log(), from train.py:88 in
    step()``."""
    if site is None:
        return "an unknown place (no Python frame outside ddpkit and torch)"
    filename, lineno, function, *caller = site
    text = _format_frame(filename, lineno, function)
    if caller and caller[0] is not None:
        filename, lineno, function, *outer = caller[0]
        text += ", called from " + _format_frame(filename, lineno, function)
        if outer and outer[0] is not None:
            text += ", from " + _format_frame(*outer[0])
    return text


def _format_frame(filename: str, lineno: int, function: str) -> str:
    try:
        relative = os.path.relpath(filename)
        if not relative.startswith(".."):
            filename = relative
    except ValueError:  # another drive on Windows
        pass
    return f"{filename}:{lineno} in {function}" + ("" if function.startswith("<") else "()")
