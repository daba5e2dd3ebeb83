"""Accelerate's names cadence has not: `from cadence.utils import X` says what instead, while `hasattr`, `getattr(...,
None)` and monkeypatch see a plain missing attribute (before: `hasattr(cadence.utils, "get_grad_scaler")` raised ImportError)."""

import pytest

import cadence.utils
import cadence.utils.dataclasses
from cadence.utils.unavailable import REPLACEMENTS

GENERIC = ["get_grad_scaler", "convert_model", "no_such_name"]   # names a library may probe for with hasattr


@pytest.mark.parametrize("module", [cadence.utils, cadence.utils.dataclasses])
def test_hasattr_and_getattr_with_a_default_see_no_attribute_for_every_listed_name(module):
    for name in [*REPLACEMENTS, *GENERIC]:
        assert not hasattr(module, name), name
        assert getattr(module, name, None) is None, name


def test_generic_names_are_not_listed():
    assert not set(GENERIC) & set(REPLACEMENTS)


def test_attribute_access_is_an_attribute_error_naming_the_replacement():
    with pytest.raises(AttributeError, match=r"cadence.utils has no MegatronLMPlugin .*ParallelismConfig\(tp_size=N\)"):
        cadence.utils.MegatronLMPlugin   # noqa: B018
    with pytest.raises(AttributeError, match=r"has no attribute 'convert_model'"):
        cadence.utils.convert_model   # noqa: B018


def test_from_import_still_raises_the_import_error_with_the_replacement():
    with pytest.raises(ImportError, match=r"^cadence.utils has no FP8RecipeKwargs \(accelerate.utils.FP8RecipeKwargs\): "
                                          r"fp8 training is not in cadence"):
        from cadence.utils import FP8RecipeKwargs  # noqa: F401
    with pytest.raises(ImportError, match=r"^cadence.utils.dataclasses has no TERecipeKwargs"):
        from cadence.utils.dataclasses import TERecipeKwargs  # noqa: F401
    with pytest.raises(ImportError, match=r"cannot import name 'convert_model'"):
        from cadence.utils import convert_model  # noqa: F401


@pytest.mark.parametrize("name", ["convert_model", "FP8RecipeKwargs"])
def test_monkeypatch_can_set_and_undo_a_missing_name(monkeypatch, name):
    monkeypatch.setattr(cadence.utils, name, "patched", raising=False)
    assert getattr(cadence.utils, name) == "patched"
    monkeypatch.undo()
    assert not hasattr(cadence.utils, name)
