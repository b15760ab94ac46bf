"""The one generic ``Registry`` (gr_functional/registry.py) behind losses, datasets, hooks, attention
kernels, optimizers and backends: duplicate names, the same definition imported twice, did-you-mean,
lazy loading of the shipped entries, listing order, scoped registrations."""
from __future__ import annotations

import pytest

from gr_functional.registry import Registry, did_you_mean


def _fn_a():
    pass


def _fn_b():
    pass


def test_a_taken_name_is_refused_unless_replaced_or_the_same_definition():
    reg = Registry("widget", how="register one with register_widget(NAME)")
    reg.add("a", {"v": 1}, origin_of=_fn_a)
    reg.add("a", {"v": 1}, origin_of=_fn_a)                 # the same definition again: fine
    with pytest.raises(ValueError, match="a widget named 'a' is already registered"):
        reg.add("a", {"v": 2}, origin_of=_fn_b)
    reg.add("a", {"v": 2}, origin_of=_fn_b, replace=True)
    assert reg.get("a") == {"v": 2}


def test_the_same_file_imported_twice_registers_the_same_thing():
    namespace_1, namespace_2 = {}, {}
    code = compile("def loss():\n    pass\n", "/plugins/my_loss.py", "exec")
    exec(code, namespace_1)
    exec(code, namespace_2)
    reg = Registry("loss")
    reg.add("mine", namespace_1["loss"])
    reg.add("mine", namespace_2["loss"])                      # a plugin run as a script and imported
    other = {}
    exec(compile("def loss():\n    pass\n", "/plugins/other.py", "exec"), other)
    with pytest.raises(ValueError):
        reg.add("mine", other["loss"])


def test_unknown_names_suggest_the_nearest_and_say_how_to_add_one():
    reg = Registry("loss", how="Register it with @register(NAME)")
    reg.add("sampled_softmax", object())
    reg.add("in_batch", object())
    msg = reg.unknown_message("sampled_sofmax")
    assert "no loss named 'sampled_sofmax' is registered (did you mean 'sampled_softmax'?)" in msg
    assert "registered: 'sampled_softmax', 'in_batch'" in msg and "@register('sampled_sofmax')" in msg
    with pytest.raises(KeyError, match="did you mean"):
        reg.get("sampled_sofmax")
    with pytest.raises(LookupError, match="no loss named 'x'"):
        reg.get_or("x", LookupError)
    assert reg.find("x") is None and did_you_mean("zzz", ["a"]) == ""


def test_shipped_entries_load_once_on_first_use_and_list_in_their_order():
    calls = []

    def load():
        calls.append(1)
        reg.add("late", 2)                                    # a shipped module registering on import
        reg.add("early", 1)

    reg = Registry("thing", load=load, order=lambda name, entry: entry)
    assert calls == []
    assert reg.names() == ("early", "late") and "late" in reg and len(reg) == 2
    reg.names()
    assert calls == [1]


def test_scoped_registrations_are_undone():
    reg = Registry("hook")
    reg.add("kept", 1)
    with reg.scoped():
        reg.add("temporary", 2)
        reg.remove("kept")
        assert reg.names() == ("temporary",)
    assert reg.names() == ("kept",)


def test_every_extension_point_is_a_registry():
    import backends
    from backends import kernels
    from gr_functional import hooks, losses, optimizers
    from gr_functional.data import registry as datasets

    for reg in (losses.LOSSES, datasets.DATASETS, hooks.HOOKS, kernels.KERNELS, optimizers.OPTIMIZERS,
                backends.BACKENDS):
        assert isinstance(reg, Registry) and reg.config_key
    assert datasets.names("ranking") == ("kuairand-rank-synthetic", "kuairand-rank-gr", "kuairand-rank-log",
                                         "kuairand-rank-stream")
