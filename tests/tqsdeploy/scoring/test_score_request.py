"""A score as one request: the keyword form and the request form give one run, settings are checked where they
are made, and the rollout spec is checked once, where it is resolved, then trusted by every runner of the job."""

from dataclasses import replace

import polars as pl
import pytest

from tqsdeploy import Feedback, RolloutSpec, ScoreSettings, score
from tqsdeploy.errors import InputError, InternalError, RolloutError
from tqsdeploy.rollout import CheckedSpec
from tqsdeploy.scoring.prepare import prepare
from tqsdeploy.scoring.request import ScoreProgress, ScoreRequest
from tqsdeploy.scoring.score import run_score
from tqsdeploy.sweep import SweepRunner, SweepSettings

SETTINGS = ScoreSettings(gauss_draws=1)


def test_the_keyword_form_and_the_request_form_make_one_run(two_branch, tmp_path):
    model, contexts = two_branch
    seen = []
    by_keywords = score(
        model,
        contexts,
        steps=4,
        out=tmp_path / "keywords",
        settings=SETTINGS,
        strategy="feed",
        lanes=1,
        on_result=lambda r: seen.append(r.key),
    )
    request = ScoreRequest(
        model,
        contexts,
        steps=4,
        out=tmp_path / "request",
        settings=SETTINGS,
        sweep=SweepSettings(strategy="feed", lanes=1),
    )
    started = []
    by_request = run_score(request, ScoreProgress(on_start=lambda total, done: started.append((total, done))))
    assert by_keywords.meta["strategy"] == by_request.meta["strategy"] == "feed"
    assert by_keywords.meta["fingerprint"] == by_request.meta["fingerprint"]
    columns = [c for c in by_keywords.frame.columns if c != "seconds"]  # wall time apart
    assert by_keywords.frame.select(columns).equals(by_request.frame.select(columns))
    assert len(seen) == by_keywords.meta["tasks"] and started == [(by_request.meta["tasks"], 0)]


def test_an_unknown_keyword_is_refused_as_python_refuses_one(two_branch, tmp_path):
    model, contexts = two_branch
    with pytest.raises(TypeError, match="stratgy"):
        score(model, contexts, steps=4, out=tmp_path / "run", stratgy="feed")
    assert not (tmp_path / "run").exists()


def test_an_unknown_strategy_is_refused_where_the_settings_are_made():
    with pytest.raises(InputError, match="unknown strategy 'fast'; choose one of auto, feed"):
        SweepSettings(strategy="fast")


def test_workers_on_this_machine_are_no_more_than_its_cores():
    assert SweepSettings(workers=64).processes(2) == 2
    assert SweepSettings(workers=64, ray_address="local").processes(2) == 64  # Ray actors may live elsewhere


def test_a_resolved_spec_is_checked_and_equal_to_the_spec_it_came_from(two_branch):
    model, contexts = two_branch
    prepared = prepare(ScoreRequest(model, contexts, steps=3, sweep=SweepSettings(lanes=1)))
    try:
        assert isinstance(prepared.spec, CheckedSpec) and prepared.job.spec is prepared.spec
        plain = RolloutSpec(prepared.spec.steps, prepared.spec.feedback, prepared.spec.trajectory, prepared.spec.origin)
        assert plain == prepared.spec and hash(plain) == hash(prepared.spec)
        assert type(prepared.spec.with_steps(5)) is RolloutSpec  # other steps are another spec, checked again
    finally:
        prepared.session.close()


def test_every_runner_of_a_prepared_job_takes_its_checked_spec_and_no_other(two_branch):
    model, contexts = two_branch
    prepared = prepare(ScoreRequest(model, contexts, steps=3, sweep=SweepSettings(strategy="feed", lanes=1)))
    runner = prepared.open_runner()
    try:
        again = SweepRunner(replace(prepared.job, strategy="unit"))  # as export reopens the job another way
        again.close()
        unchecked = RolloutSpec(3, prepared.spec.feedback, prepared.spec.trajectory)
        with pytest.raises(InternalError, match="CheckedSpec"):
            SweepRunner(replace(prepared.job, spec=unchecked))
    finally:
        runner.close()


def test_a_spec_that_does_not_fit_the_model_is_refused_where_it_is_resolved(two_branch):
    model, contexts = two_branch
    spec = RolloutSpec(2, (Feedback("y", "x"),), ("nope",))
    with pytest.raises(RolloutError, match="trajectory output 'nope' is not a model output"):
        prepare(ScoreRequest(model, contexts, spec))


def test_the_request_runs_as_its_run_folder_says(two_branch, tmp_path):
    model, contexts = two_branch
    request = ScoreRequest(model, contexts, steps=2, out=tmp_path / "run", settings=SETTINGS)
    first = run_score(request)
    again = run_score(request)  # a finished matching run: resumed, nothing run again
    assert again.meta["timings_s"]["resumed_tasks"] == first.meta["tasks"]
    with pytest.raises(InputError, match="different model, contexts or settings"):
        run_score(replace(request, steps=3))
    assert pl.read_csv(tmp_path / "run" / "scores.csv")["unit"].to_list() == first.frame["unit"].to_list()
