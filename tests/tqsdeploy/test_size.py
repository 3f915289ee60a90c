"""The size owner (`tqsdeploy.size`): C as a budget on each basis, the ratio of written files, reachability."""

import models
import numpy as np
import pytest
from conftest import cli

import graph_ops
from tqsdeploy import ScoreSettings, score
from tqsdeploy.errors import InfeasibleError, InputError
from tqsdeploy.export import ExportSettings, Planner
from tqsdeploy.export.allocate import Knapsack, allocate
from tqsdeploy.size import ModelSize, SizeBudget, reachable_label, split_bits


def test_budget_from_c_on_each_basis():
    sizes = ModelSize(reference_bits=32_000, unit_reference_bits=24_000)
    file, units = sizes.budget("file", overhead_bits=64), sizes.budget("units", overhead_bits=64)
    assert (file.basis_bits, file.fixed_bits) == (
        32_000,
        8_064,
    )  # the rest of the file and the opset overhead use budget
    assert (units.basis_bits, units.fixed_bits) == (24_000, 0)
    assert file.slot_bits(4) == 32_000 / 4 - 8_064 and units.slot_bits(4) == 6_000
    for budget in (file, units):
        assert budget.compression(budget.slot_bits(3.5)) == pytest.approx(3.5)
        assert budget.fits(budget.slot_bits(3.5), 3.5) and not budget.fits(budget.slot_bits(3.5) + 1, 3.5)
    assert sizes.file_bits(4, "file") == 8_000 and sizes.file_bits(4, "units") == 8_000 + 6_000
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(InputError, match="positive number"):
            file.slot_bits(bad)
    with pytest.raises(InputError, match="below 1"):
        file.slot_bits(0.5)
    with pytest.raises(InputError, match="'file' or 'units'"):
        sizes.budget("layers")


def test_reachability_names_a_c_that_is_itself_accepted():
    budget = SizeBudget(basis_bits=100_000, fixed_bits=1_000)
    best = budget.compression(20_205)  # 4.71587: a label rounded up (4.716 or 4.72) would be refused when typed back
    assert reachable_label(best) == "4.7158" and budget.reachable(20_205, float(reachable_label(best)))
    assert budget.reachable(20_205, best) and not budget.reachable(20_205, best * 1.001)
    with pytest.raises(InfeasibleError, match=r"largest reachable is 4\.7158 "):
        budget.check(best * 1.001, 20_205, ["int8", "int2"])


def test_split_bits_keeps_the_total():
    assert sorted(split_bits([10.4, 10.4, 10.4], 32)) == [10, 11, 11]
    assert sum(split_bits([0.5, 7.25, 3.0, 1e-3], 12)) == 12
    assert split_bits([0.0, 0.0], 5) in ([3, 2], [2, 3])


@pytest.fixture(scope="module")
def odd_run(tmp_path_factory):
    """A residual MLP with odd sizes: channel groups of a blockwise grid do not split its tensors evenly."""
    folder = tmp_path_factory.mktemp("size")
    model = models.mlp_forecaster(folder / "odd.onnx", n=125, hidden=251)
    np.savez(folder / "ctx.npz", x=np.random.default_rng(5).standard_normal((4, 2, 125)).astype(np.float32))
    score(model, folder / "ctx.npz", steps=3, out=folder / "run", settings=ScoreSettings(gauss_draws=0))
    return model, folder


@pytest.mark.parametrize("basis", ["file", "units"])
def test_the_lowest_tier_file_is_reachable_and_a_hair_above_is_not(odd_run, basis):
    """Issue 35: the C a uniform file of the lowest tier reaches (measured on the written file) is accepted;
    a hair above it is refused, naming the largest reachable C."""
    model, folder = odd_run
    planner = Planner(
        folder / "run", settings=ExportSettings(rounding="rtn", objective="paper", refine=0, group_size=32, basis=basis)
    )
    lowest = planner.tiers[-1].name
    outcome = planner.export(None, folder / f"{basis}.uniform.onnx", uniform_tier=lowest)
    reached = outcome.compression if basis == "file" else outcome.unit_compression
    assert reached == pytest.approx(planner.max_compression(), rel=1e-12)  # reachability is what the file reaches
    planner.check_targets([reached])
    assert planner.pricing.allocate(reached).tiers == {s.name: lowest for s in planner.cut.slots}
    with pytest.raises(InfeasibleError, match=f"largest reachable is {reachable_label(reached)} "):
        planner.check_targets([reached * 1.001])
    planner.close()


@pytest.mark.parametrize("group_size", [None, 32])
def test_written_ratio_equals_what_the_allocation_priced(odd_run, group_size):
    """Uniform files at every tier, per channel or blockwise, and mixed files: the ratio of the written file is the
    priced one and meets the target. A mixed blockwise file writes the block-index constants of its dequantized layout
    (Expand/Reshape/Slice shapes, ~512 bits) once per stretch of a tensor at one tier, as INT1 writes its unpack
    constants: the allocation is priced as written, so the file does not fall below C (it did: 5.93x for --C 6)."""
    model, folder = odd_run
    planner = Planner(
        folder / "run",
        settings=ExportSettings(rounding="rtn", objective="paper", refine=0, group_size=group_size, fallback=False),
    )
    for tier in planner.tiers:
        outcome = planner.export(None, folder / f"{tier.name}.onnx", uniform_tier=tier.name)
        assert outcome.compression == planner.comparison.uniform(tier.name).compression
        assert outcome.compression == planner.scored.sizes.file_compression(
            graph_ops.weight_bits(graph_ops.load_model(outcome.path).proto)
        )
    for target in (5, 6, 7):
        outcome = planner.export(target, folder / "mixed.onnx")
        written = graph_ops.weight_bits(graph_ops.load_model(outcome.path).proto)
        assert len(set(outcome.allocation.tiers.values())) > 1
        assert outcome.allocation.total_bits == written
        assert outcome.compression == outcome.allocation.compression >= target
        assert len(planner.sizing.stretches(outcome.allocation.tiers)) > len(
            planner.cut.slots_of
        )  # a unit cut into stretches on several tiers
    planner.close()


@pytest.mark.parametrize("basis", ["file", "units"])
def test_mixed_int1_and_blockwise_files_meet_c_on_each_basis(odd_run, basis):
    """INT1's unpack constants and a blockwise grid's shape constants, written once per stretch, on either basis:
    the slots' priced bits are the units' written bits and the target is met."""
    model, folder = odd_run
    planner = Planner(
        folder / "run",
        settings=ExportSettings(
            rounding="rtn",
            objective="paper",
            refine=0,
            group_size=32,
            fallback=False,
            basis=basis,
            tiers=("fp32", "int8", "int4", "int2", "int1"),
        ),
    )
    for target in (5, 7):
        outcome = planner.export(target, folder / f"{basis}.int1.onnx")
        reached = outcome.compression if basis == "file" else outcome.unit_compression
        assert reached == outcome.allocation.compression >= target
        assert len(planner.sizing.stretches(outcome.allocation.tiers)) > len(planner.cut.slots_of)
    planner.close()


def test_an_allocation_that_never_fits_its_written_size_falls_back_to_the_cheapest_tiers(odd_run):
    """A solver that ignores the shrunk budget (and the whole units it is offered) keeps writing more than C allows:
    after `REFITS` tries every slot goes to its cheapest tier, which is priced as written and meets C. (The
    dequantized layout: its blocks' shape constants are what the additive prices leave out.)"""
    model, folder = odd_run
    settings = ExportSettings(
        rounding="rtn", objective="paper", refine=0, group_size=32, fallback=False, runtime_layout="dequantized"
    )
    planner = Planner(folder / "run", settings=settings)
    budget, choices = planner.sizing.budget(planner.tiers), planner.pricing.choices()
    unshrunk = allocate(choices, planner.tiers, 6, budget, objective="paper")
    assert sum(planner.sizing.written_costs(unshrunk.tiers).values()) > budget.slot_bits(
        6
    )  # the additive prices fit, the file would not

    split = choices

    class IgnoresReserve(Knapsack):  # a solver deaf to the shrunk budget and to the whole units it is offered
        def solve(self, choices, reserve=0):
            return super().solve(split, 0)

    allocation = planner.pricing.fitter.fitted(IgnoresReserve(planner.tiers, 6, budget, objective="paper"), choices)
    assert allocation.solver.startswith("cheapest") and set(allocation.tiers.values()) == {planner.tiers[-1].name}
    assert allocation.compression == planner.max_compression() >= 6
    planner.close()


def test_a_bad_allocator_is_refused_up_front(tmp_path):
    result = cli("export", "--run", tmp_path / "nowhere", "--C", "4", "--allocator", "dp")
    text = result.output  # stdout and stderr together
    assert result.exit_code == 2 and len(text.strip().splitlines()) == 1, text
    assert "unknown allocator 'dp'; choose one of mckp, greedy" in " ".join(text.split())
