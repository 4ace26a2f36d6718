"""The estimator registry (miles_core/algo/estimators): a new estimator is one module's worth of
code, registered by name and run by the unchanged engine; an unknown name fails at recipe load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from test_estimator_math import TOK, TwoToken, batch

from miles_core.algo.estimators import (Estimator, estimator_names, get_estimator, register_estimator,
                                        unregister_estimator)
from miles_core.algo.rows import FullyMasked, MaskedStepRows, Rows
from miles_core.algo.update import update_policy
from miles_core.config import (ConfigError, EspoSettings, MeanFieldSettings, Section, UpdateConfig, bounded,
                               load_recipe, register_settings)


@dataclass(frozen=True)
class ToySettings(Section):
    scale: float = bounded(2.0, 0.0)   # what the toy multiplies the advantage by


def toy_rows(sub: Any, own: ToySettings, epochs: int, tok: Any, temperature: float, generator: torch.Generator,
             model: Any = None) -> tuple[Rows, MaskedStepRows]:
    """One fully masked row per trajectory, no prompt masking, nothing drawn."""
    b = len(sub)
    return Rows(torch.arange(b), torch.zeros(b, dtype=torch.long), torch.ones(b)), \
        MaskedStepRows(sub, tok, temperature, FullyMasked())


@pytest.fixture
def toy() -> Any:
    @register_estimator("toy")
    class Toy(Estimator):
        settings = ToySettings
        calls: list[str] = []

        def row_builders(self) -> dict[str, Any]:
            return {"masked": toy_rows}

        def advantages(self, adv: torch.Tensor, batch: Any) -> torch.Tensor:
            Toy.calls.append("advantages")
            return 2 * adv

    yield Toy
    unregister_estimator("toy")


def test_a_registered_toy_estimator_runs_through_update_policy(toy: Any) -> None:
    assert "toy" in estimator_names()
    model = TwoToken()
    cfg = UpdateConfig(estimator="toy", max_grad_norm=1e9)
    stats = update_policy(model, torch.optim.SGD(model.parameters(), lr=0.0), batch(), cfg, TOK, 1.0,
                        torch.Generator().manual_seed(0))
    assert stats["rows"] == 2.0 and toy.calls == ["advantages"]
    assert model.theta.grad.abs().sum() > 0
    # the same rows through meanfield (one draw, prompt never masked) and A doubled: twice the gradient
    ref = TwoToken()
    update_policy(ref, torch.optim.SGD(ref.parameters(), lr=0.0), batch(),
                  UpdateConfig(estimator="meanfield", max_grad_norm=1e9), TOK, 1.0,
                  torch.Generator().manual_seed(0), own=MeanFieldSettings(prompt_mask_prob=0.0))
    torch.testing.assert_close(model.theta.grad, 2 * ref.theta.grad)
    assert load_recipe(None, ["update.estimator=toy"]).update.estimator == "toy"


def test_an_unknown_estimator_fails_at_recipe_load_naming_the_field_and_the_registered_names() -> None:
    with pytest.raises(ConfigError) as e:
        load_recipe("arith", ["update.estimator=nope"])
    msg = str(e.value)
    assert "update.estimator" in msg and "'nope'" in msg
    for name in ("adpo", "meanfield", "coupled", "wd1", "spg", "espo", "ebpo"):
        assert repr(name) in msg
    with pytest.raises(ConfigError, match="update.estimator"):
        get_estimator("nope")


def test_a_name_registers_once(toy: Any) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_estimator("toy")(type("Again", (Estimator,), {}))


def test_an_estimator_without_rows_for_a_batch_kind_names_it_and_those_that_have() -> None:
    class Chain:
        kind = "renoise"

    with pytest.raises(ValueError, match=r"update.estimator='espo' builds no rows for a 'renoise' batch.*'adpo'"):
        get_estimator("espo").rows(Chain(), EspoSettings(), 1, TOK, 1.0, torch.Generator())


def test_a_registered_estimator_brings_its_own_settings_section(toy: Any) -> None:
    """``estimators.toy`` is the toy's settings class, checked field by field at load like any section."""
    cfg = load_recipe(None, ["update.estimator=toy", "estimators.toy.scale=3"])
    assert cfg.own() == ToySettings(scale=3.0) and cfg.estimators.adpo == load_recipe(None).estimators.adpo
    with pytest.raises(ConfigError, match=r"unknown config key 'estimators.toy.scal'.*did you mean 'estimators.toy.scale'"):
        load_recipe(None, ["estimators.toy.scal=3"])
    with pytest.raises(ConfigError, match=r"estimators.toy.scale: -1.0 is out of bounds"):
        load_recipe(None, ["estimators.toy.scale=-1"])
    with pytest.raises(ValueError, match="already has settings"):
        register_settings("adpo", ToySettings)  # a built-in name keeps the class the schema states
    with pytest.raises(TypeError, match="declares no settings class"):
        register_estimator("bare")(type("Bare", (Estimator,), {}))
