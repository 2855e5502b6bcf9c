"""load_function: resolving ``--custom-*-function-path`` hooks, and its one-line errors.

Proves: a hook loads from a dotted module name and from a ``.py`` path (the
loaded function really runs); a hook shaped like the built-in passes the
``expected`` signature check; each failure (bad spec, module not found,
missing dependency inside the module, missing attribute, not callable,
missing / misplaced / extra parameters) is a ValueError naming the culprit.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from vime.algo.advantages import compute_advantages
from vime.algo.custom import load_function
from vime.algo.losses import policy_loss

HOOKS = textwrap.dedent(
    """
    import torch

    NOT_CALLABLE = 3

    def my_advantages(rewards, n_samples_per_prompt, estimator="grpo", eps=1e-6):
        return rewards * 2

    def short_advantages(rewards):
        return rewards

    def renamed(rewards, n, estimator="grpo", eps=1e-6):
        return rewards

    def needs_more(rewards, n_samples_per_prompt, estimator, eps, scale):
        return rewards

    def star_args(rewards, *args, **kwargs):
        return rewards

    def my_loss(logp, old_logp, advantages, mask, *, eps_clip=0.2, **kwargs):
        return -advantages[:, None] * logp * mask, {}

    def bare_loss(logp, old_logp, advantages, mask):
        return -advantages[:, None] * logp * mask, {}

    def some_keywords(logp, old_logp, advantages, mask, eps_clip=0.2, level="token"):
        return -advantages[:, None] * logp * mask, {}

    class Holder:
        @staticmethod
        def fn(rewards, n_samples_per_prompt, estimator="grpo", eps=1e-6):
            return rewards
    """
)


@pytest.fixture
def hooks_file(tmp_path):
    path = tmp_path / "my_hooks.py"
    path.write_text(HOOKS)
    return path


def test_load_from_file_path_and_call(hooks_file):
    fn = load_function(f"{hooks_file}:my_advantages", expected=compute_advantages)
    assert torch.equal(fn(torch.tensor([1.0, 2.0]), 2), torch.tensor([2.0, 4.0]))
    loss_fn = load_function(f"{hooks_file}:my_loss", expected=policy_loss)
    assert callable(loss_fn)
    assert load_function(f"{hooks_file}:Holder.fn", expected=compute_advantages) is not None


def test_load_from_relative_path(hooks_file, monkeypatch):
    monkeypatch.chdir(hooks_file.parent)
    assert load_function("my_hooks.py:star_args", expected=compute_advantages).__name__ == (
        "star_args"
    )


def test_load_from_module_name(tmp_path, monkeypatch):
    pkg = tmp_path / "vime_test_hookpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "adv.py").write_text(HOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_function("vime_test_hookpkg.adv:my_advantages", expected=compute_advantages)
    assert fn.__module__ == "vime_test_hookpkg.adv"
    # a built-in is a valid hook for itself
    assert load_function("vime.algo.losses:policy_loss", expected=policy_loss) is policy_loss


@pytest.mark.parametrize("spec", ["no_colon", "mod:", ":fn", "mod:fn-name", "a:b:c d"])
def test_bad_spec_format(spec):
    with pytest.raises(ValueError, match=r"bad function spec .*expected 'module.path:function'"):
        load_function(spec)


def test_module_not_found():
    with pytest.raises(ValueError, match=r"module 'vime_no_such_module\.sub' not found"):
        load_function("vime_no_such_module.sub:fn")
    with pytest.raises(ValueError, match=r"module file '.*/nowhere/hooks\.py' not found"):
        load_function("/nowhere/hooks.py:fn")


def test_missing_dependency_inside_module_is_not_reported_as_missing_module(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import vime_no_such_dependency\n")
    with pytest.raises(ValueError, match=r"importing '.*broken\.py' failed: ModuleNotFoundError"):
        load_function(f"{path}:fn")


def test_missing_attribute_and_not_callable(hooks_file):
    with pytest.raises(ValueError, match=r"module '.*my_hooks\.py' has no attribute 'nope'"):
        load_function(f"{hooks_file}:nope")
    with pytest.raises(ValueError, match=r"module '.*my_hooks\.py\.Holder' has no attribute 'x'"):
        load_function(f"{hooks_file}:Holder.x")
    with pytest.raises(ValueError, match="'NOT_CALLABLE' is a int, not callable"):
        load_function(f"{hooks_file}:NOT_CALLABLE")


@pytest.mark.parametrize(
    ("name", "match"),
    [
        (
            "short_advantages",
            r"missing or misplaced \['n_samples_per_prompt', 'estimator', 'eps'\]",
        ),
        ("renamed", r"missing or misplaced \['n_samples_per_prompt'\]; extra required \['n'\]"),
        ("needs_more", r"extra required \['scale'\]"),
    ],
)
def test_signature_mismatch_names_parameters(hooks_file, name, match):
    with pytest.raises(ValueError, match=r"does not match compute_advantages\(.*" + match):
        load_function(f"{hooks_file}:{name}", expected=compute_advantages)


def test_keyword_only_parameters_are_checked_by_name(hooks_file):
    """The trainer passes policy_loss's keyword-only flags by name, so a loss that cannot
    take them is refused when it loads, not with a TypeError at the first step."""
    with pytest.raises(ValueError, match=r"\['eps_clip', 'eps_clip_high', 'eps_clip_c', 'level'\]"):
        load_function(f"{hooks_file}:bare_loss", expected=policy_loss)
    with pytest.raises(ValueError, match=r"missing or misplaced \['eps_clip_high', 'eps_clip_c'\]"):
        load_function(f"{hooks_file}:some_keywords", expected=policy_loss)
    assert load_function(f"{hooks_file}:my_loss", expected=policy_loss).__name__ == "my_loss"


def test_signature_not_checked_without_expected(hooks_file):
    assert load_function(f"{hooks_file}:short_advantages").__name__ == "short_advantages"
