import pytest

from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError


def test_default_prompt_share_leaves_a_quarter_ring():
    assert PolicyConfig(budget=512).resolved_prompt_share == 384
    assert PolicyConfig(budget=100, window=8).resolved_prompt_share == 75


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget=36, sinks=4, window=32), r"must exceed sinks \+ window"),
    (dict(kernel=4), "odd"),
    (dict(kernel=0), "odd"),
    (dict(pooling="median"), "unknown pooling"),
    (dict(policy="h2o"), "unknown policy"),
    (dict(scope="token"), "selection scope"),
    (dict(budget=128, prompt_share=128), "prompt share"),
    (dict(budget=128, prompt_share=30), "prompt share"),
])
def test_invalid_policies_are_rejected(kwargs, message):
    with pytest.raises(SnapcompileError, match=message):
        PolicyConfig(**kwargs)


def test_window_longer_than_chunk_is_rejected():
    with pytest.raises(SnapcompileError, match="window 64 is longer than the prefill chunk 32"):
        PolicyConfig(budget=256, window=64).check_against(ExportConfig(chunk=32, max_context=1024))


def test_window_longer_than_the_tail_is_rejected_but_no_tail_is_fine():
    with pytest.raises(SnapcompileError, match="window 48 is longer than the tail graph's 32 tokens: convert with "
                                               "--tail 48"):
        PolicyConfig(budget=256, window=48).check_against(ExportConfig(chunk=64, max_context=1024))
    PolicyConfig(budget=256, window=48).check_against(ExportConfig(chunk=64, max_context=1024, tail=0))
    PolicyConfig(policy="streamingllm", budget=256, window=48).check_against(ExportConfig(chunk=64, max_context=1024))


def test_export_records_name_the_tail_only_where_there_is_one():
    """An artifact written before the tail graph has no "tail" in its record: it reads as none, and
    a record without a tail keeps the key it had."""
    assert ExportConfig.from_dict(ExportConfig(tail=16).to_dict()).tail == 16
    record = ExportConfig(tail=0).to_dict()
    assert "tail" not in record and ExportConfig.from_dict(record).tail == 0
    assert ExportConfig().tail == 32


def test_budget_above_context_is_rejected():
    with pytest.raises(SnapcompileError, match="exceeds --max-context"):
        PolicyConfig(budget=4096).check_against(ExportConfig(max_context=1024))


def test_dense_ignores_budget_fields():
    policy = PolicyConfig(policy="dense", budget=1)
    assert not policy.compressed
    assert policy.to_dict()["prompt_share"] is None


@pytest.mark.parametrize("kwargs", [dict(slots=0), dict(chunk=0), dict(chunk=64, max_context=32),
                                    dict(weight_format="bf16"), dict(block_size=48), dict(tail=-1),
                                    dict(tail=65, max_context=64)])
def test_invalid_export_configs(kwargs):
    with pytest.raises(SnapcompileError):
        ExportConfig(**kwargs)


def test_policy_round_trips_through_dict():
    policy = PolicyConfig(budget=256, pooling="avg", scope="layer", prompt_share=200)
    assert PolicyConfig.from_dict(policy.to_dict()) == policy


def test_a_too_small_budget_is_reported_as_a_budget_problem_with_the_smallest_that_works():
    with pytest.raises(SnapcompileError, match=r"budget 40 is too small .* use --budget >= 50"):
        PolicyConfig(budget=40)
    assert PolicyConfig(budget=50).resolved_prompt_share == 37
    with pytest.raises(SnapcompileError, match=r"prompt share 30 must be in \[37, 39\]"):
        PolicyConfig(budget=40, prompt_share=30)      # a share the user set is named as such
