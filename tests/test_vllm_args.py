"""vLLM keyword arguments checked against the installed vllm package (skipped where vllm is absent).

vLLM's package imports on a CPU-only machine, and both SamplingParams (a msgspec Struct) and EngineArgs (a
dataclass) reject unknown keywords with TypeError, so a renamed argument fails here, not on the GPU.
"""

import pytest

import starpo_bandit as sb

vllm = pytest.importorskip("vllm", reason="vllm is not installed (GPU extra: requirements-vllm.txt)")


def args():
    return sb.Args(model="tiny", max_tokens=64)


def test_engine_kwargs_are_accepted_by_engine_args(tmp_path):
    kwargs = sb.vllm_engine_kwargs(args(), str(tmp_path))
    engine_args = vllm.EngineArgs(**kwargs)
    assert engine_args.enable_prefix_caching is True and engine_args.trust_remote_code is False
    assert engine_args.logprobs_mode == "processed_logprobs"  # log-probs of the tempered distribution


def test_sampling_kwargs_match_hf_semantics():
    params = vllm.SamplingParams(**sb.vllm_sampling_kwargs(0.5, 1.0, 64, [7, 9]))
    assert params.temperature == 0.5 and params.top_p == 1.0 and params.max_tokens == 64
    assert params.top_k in (0, -1)  # top-k disabled, as in hf_generate
    assert params.logprobs == 0 and set(params.stop_token_ids) == {7, 9}
    assert params.repetition_penalty == 1.0 and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0


def test_unknown_keyword_would_be_caught():
    with pytest.raises(TypeError):
        vllm.SamplingParams(not_a_real_argument=1)
    with pytest.raises(TypeError):
        vllm.EngineArgs(not_a_real_argument=1)
