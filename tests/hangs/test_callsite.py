"""Where a collective was called from: the user's line and its caller, found once per code object."""
from __future__ import annotations

from ddpkit.runtime.hangs import callsite


def _helper():  # a script's reduce_mean(): the recorder's wrapper would stand where call_site's caller is
    return callsite.call_site(depth=1)


def _training_loop():
    return _helper()


def test_the_site_is_the_first_user_frame_with_the_user_frame_that_called_it():
    site, via = _training_loop()
    assert site[:3] == (__file__, _helper.__code__.co_firstlineno + 1, "_helper")
    assert site[3][:3] == (__file__, _training_loop.__code__.co_firstlineno + 1, "_training_loop")
    assert via is None  # no ddpkit function on the way
    assert "in _helper(), called from " in callsite.format_site(site)


def test_through_a_helper_module_the_training_scripts_line_is_named_too(monkeypatch):
    # train.py:3 calls log_metrics() in utils.py, which calls reduce_mean() there: the script's line is
    # the one a user looks for, and neither of the two innermost frames is in it
    utils: dict = {}
    exec(compile("def reduce_mean():\n    return site()\n\ndef log_metrics():\n    return reduce_mean()\n",
                 "/home/user/utils.py", "exec"), utils)
    utils["site"] = lambda: callsite.call_site(depth=2)
    train: dict = {"log_metrics": utils["log_metrics"]}
    exec(compile("def main():\n    x = 1\n    return log_metrics()\n", "/home/user/train.py", "exec"), train)
    monkeypatch.setattr(callsite, "_main_file", lambda: "/home/user/train.py")
    site, _ = train["main"]()
    assert callsite.format_site(site) == ("/home/user/utils.py:2 in reduce_mean(), called from /home/user/utils.py:5 "
                                          "in log_metrics(), from /home/user/train.py:3 in main()")
    monkeypatch.setattr(callsite, "_main_file", lambda: "/home/user/utils.py")  # the helpers are the script
    assert callsite.format_site(train["main"]()[0]).endswith("called from /home/user/utils.py:5 in log_metrics()")


def test_a_long_function_is_classified_once_by_the_identity_of_its_code():
    # Python hashes a code object over all of its bytecode at every lookup: a long training loop
    # made each collective's walk slow, so the verdict is cached under id(code), with the code kept
    source = "def long_loop(f):\n" + "".join(f"    x{i} = {i}\n" for i in range(2000)) + "    return f()\n"
    namespace: dict = {}
    exec(compile(source, "/home/user/train.py", "exec"), namespace)
    site, _ = namespace["long_loop"](lambda: callsite.call_site(depth=1))
    code = namespace["long_loop"].__code__
    assert site[3] == ("/home/user/train.py", 2002, "long_loop")
    assert callsite._known[id(code)] == (code, False, None)
    assert callsite._is_internal(code) is False
    assert callsite._is_internal(callsite.call_site.__code__) is True
    assert callsite._known[id(callsite.call_site.__code__)][2] == "call_site"  # ddpkit's, named


def test_via_is_the_outermost_ddpkit_function_unless_ddp_issued_it():
    import functools
    import os

    import ddpkit

    package = os.path.dirname(ddpkit.__file__)
    ours: dict = {}  # a helper of ddpkit's that a user calls (save()), and one of its DDP's
    exec(compile("def save(call):\n    return call()\n\ndef helper(call):\n    return call()\n",
                 os.path.join(package, "runtime", "example_helpers.py"), "exec"), ours)
    ddp: dict = {}
    exec(compile("def launch(call):\n    return call()\n", os.path.join(package, "ddp", "example_reducer.py"),
                 "exec"), ddp)
    here = functools.partial(callsite.call_site, 0)  # the walk starts in ddpkit's own call_site

    site, via = ours["save"](functools.partial(ours["helper"], here))
    assert via == "save" and site[2] == "test_via_is_the_outermost_ddpkit_function_unless_ddp_issued_it"
    _, via = ours["save"](functools.partial(ddp["launch"], here))
    assert via == "DDP"


def test_sync_batchnorm_is_named_as_the_issuer_also_inside_ddps_forward():
    import functools
    import os

    import ddpkit

    package = os.path.join(os.path.dirname(ddpkit.__file__), "ddp")
    code: dict = {}  # a layer of ddpkit's SyncBatchNorm, and DDP's forward that calls the module
    exec(compile("def forward(call):\n    return call()\n", os.path.join(package, "sync_batchnorm.py"), "exec"), code)
    sbn = code["forward"]
    exec(compile("def forward(call):\n    return call()\n", os.path.join(package, "distributed.py"), "exec"), code)
    ddp = code["forward"]
    here = functools.partial(callsite.call_site, 0)

    assert sbn(here)[1] == "SyncBatchNorm"  # a SyncBatchNorm used without DDP: not "issued by DDP"
    assert ddp(functools.partial(sbn, here))[1] == "SyncBatchNorm"  # the innermost issuer
    assert sbn(functools.partial(ddp, here))[1] == "DDP"
