"""The frontier's step plan: each step estimated by kind of work, the estimates scaled by what finished steps took."""

from tqsdeploy.evaluation.plan import StepPlan, model_shape


class Clock:
    """Seconds that pass when the test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_eta_is_the_estimates_scaled_by_each_kinds_finished_steps():
    clock = Clock()
    plan = StepPlan(rollout_s=1.0, check_s=2.0, clock=clock)
    plan.plan("baseline", "a", 10)
    plan.plan("baseline", "b", 10)
    plan.plan("eval", "e", 1)  # in checks: 2 s
    assert plan.total == 3 and plan.remaining() == 22
    plan.begin("a")
    clock.now = 5
    assert plan.remaining() == 5 + 10 + 2  # the step in progress counts what it should still take
    clock.now = 20
    plan.begin("b")  # a took twice its estimate: baselines, and kinds not seen yet, are scaled by 2
    assert plan.ratio("baseline") == 2 and plan.remaining() == 20 + 4
    clock.now = 25
    plan.begin("e")  # b took half its estimate: baselines 25 s for 20 estimated
    assert plan.ratio("baseline") == 1.25 and plan.remaining() == 2 * 1.25
    clock.now = 26
    plan.begin("kept", kept=True)  # a step taken from an earlier run: not counted against any estimate
    clock.now = 99
    plan.end()
    assert plan.ratio("eval") == 0.5 and plan.finished == 4 == plan.total and plan.remaining() == 0


def test_dropped_steps_leave_the_plan():
    plan = StepPlan(rollout_s=1.0, check_s=1.0)
    plan.plan("export", "x", 3)
    plan.plan("export", "x", 5)  # planned again: its new estimate
    plan.plan("eval", "y", 1)
    plan.drop("y")
    assert plan.total == 1 and plan.remaining() == 5


def test_the_model_shape_counts_units_and_the_slots_a_large_one_is_cut_into(tmp_path):
    import models

    model = models.mlp_forecaster(tmp_path / "mlp.onnx", n=32, hidden=64)  # 2048, 4096 and 2048 weights
    assert model_shape(model, 1024, 0.0) == model_shape(model, 1024, 0.9)
    shape = model_shape(model, 1024, 0.1)
    assert shape.units == 3 and shape.slots == 3 + 5 + 3  # 25%, 50% and 25% of the units, in groups of 10% or less
    assert model_shape(model, 4096, 0.0).units == 1
