"""A quick re-check of prediction accuracy on published runs (the full table: benchmarks/accuracy.py),
and the search against the layouts those teams published."""
import pytest

from cost_models.step_time import estimate
from planner.api import plan
from planner.capture.model_capture import capture
from benchmarks.published import DEFAULT_RUNS, load_runs, predict, published_layout
from planner.search.space import layout_problems

pytestmark = pytest.mark.skipif(not DEFAULT_RUNS.exists(), reason="shared/validation not present")

# published layouts that really ran but exceed the memory model's usable HBM (docs/accuracy.md): when the
# model is mended, the `not published.fits` check fails and the run leaves this list
OVER_THE_MEMORY_MODEL = {"nemo2407-gpt3-20b-64gpu"}
QUICK = ["narayanan21-3p6b", "korthikanti22-22b-selective", "nemo2407-llama2-7b-8gpu", "nemo2407-gpt3-20b-64gpu"]


@pytest.fixture(scope="module")
def runs():
    found, _ = load_runs()
    return {run.id: run for run in found}


@pytest.mark.parametrize("run_id", QUICK)
def test_published_step_time_within_25_percent(runs, run_id):
    run = runs[run_id]
    result = predict(run)
    assert result.step_time_s == pytest.approx(run.measured_step_s, rel=0.25)


@pytest.mark.parametrize("run_id", ["korthikanti22-22b-selective", "nemo2407-llama2-7b-8gpu", "nemo2407-gpt3-20b-64gpu",
                                    "nemo2407-gpt3-175b-128gpu", "nemo2407-llama2-70b-64gpu"])
def test_search_is_never_slower_than_the_published_layout(runs, run_id):
    run = runs[run_id]
    precision = run.precision
    layout = published_layout(run, precision)
    graph = capture(run.model, run.seq_len)
    assert layout is not None
    assert layout_problems(layout, graph, run.cluster.num_devices) == []  # inside the space
    published = estimate(graph.costs_record, run.cluster, layout)
    searched = plan(run.model, run.cluster, global_batch=run.global_batch, seq_len=run.seq_len, precision=precision,
                    time_limit_s=60, top_k=1)
    if run_id in OVER_THE_MEMORY_MODEL:   # a layout that ran but the memory model rejects (issue 20)
        assert not published.fits
        pytest.xfail(f"{run_id} ran, but the memory model predicts "
                     f"{max(m.total for m in published.stage_memory) / 1e9:.1f} GB per device")
    assert published.fits
    assert searched.step_time_s <= published.step_time_s * (1 + 1e-9)
