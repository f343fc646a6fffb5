"""A prompt's log probabilities through `serve`: echo with logprobs (OpenAI's legacy block, what
lm-eval's loglikelihood tasks read) and vLLM's prompt_logprobs, equal to the PyTorch model's, streamed
or not, on a compressed artifact (its own layer-by-layer prefill) and a dense one (a layer-by-layer
prefill made for it); and lm-eval's multiple-choice task run against the server."""
from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
import torch

from snapcompile.config import ExportConfig
from tests.conftest import TINY_SNAPSTREAM, build_artifact
from tests.server_process import ServerProcess

PROMPT = [5, 17, 99, 3, 250, 41, 8, 8, 120, 64, 7, 33]


@pytest.fixture(scope="module", params=["snapstream", "dense"])
def served(request, tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("scored") / request.param
    build_artifact(tiny_llama, folder, ExportConfig(slots=2, max_context=256, chunk=64),
                   TINY_SNAPSTREAM if request.param == "snapstream" else None)
    process = ServerProcess(folder, log=folder.parent / "server.log").wait_ready()
    yield folder, process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def model_logprobs(tiny_llama):
    """log-softmax [T, V] of the float model over PROMPT (position i: the token after i)."""
    with torch.no_grad():
        logits = tiny_llama.model(torch.tensor([PROMPT])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def _client(process) -> openai.OpenAI:
    return openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_echo_with_logprobs_gives_the_models_prompt_logprobs(served, model_logprobs):
    _, process = served
    answer = _client(process).completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0,
                                                 echo=True, logprobs=2)
    block = answer.choices[0].logprobs
    assert len(block.tokens) == len(block.token_logprobs) == len(block.top_logprobs) == len(PROMPT) + 1
    assert block.token_logprobs[0] is None and block.top_logprobs[0] is None
    expected = [model_logprobs[i, PROMPT[i + 1]] for i in range(len(PROMPT) - 1)]
    assert np.allclose(block.token_logprobs[1:len(PROMPT)], expected, atol=1e-4)
    for i, top in enumerate(block.top_logprobs[1:len(PROMPT)]):
        assert len(top) <= 2 and np.isclose(max(top.values()), model_logprobs[i].max(), atol=1e-4)
    generated = int(np.argmax(model_logprobs[-1]))      # greedy: the last position's likeliest
    assert np.isclose(block.token_logprobs[-1], model_logprobs[-1, generated], atol=1e-4)


def test_vllm_prompt_logprobs_name_each_token_with_its_rank(served, model_logprobs):
    _, process = served
    body = httpx.post(process.url + "/v1/completions", timeout=120,
                      json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 3}).json()
    positions = body["choices"][0]["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(PROMPT)
    for i, position in enumerate(positions[1:]):
        token = PROMPT[i + 1]
        mine = position[str(token)]
        assert np.isclose(mine["logprob"], model_logprobs[i, token], atol=1e-4)
        assert mine["rank"] == 1 + int(np.sum(model_logprobs[i] > model_logprobs[i, token] + 1e-9))
        likeliest = np.argsort(-model_logprobs[i])[:3]
        assert set(map(str, likeliest)) <= set(position) and len(position) in (3, 4)
    assert body["choices"][0]["logprobs"] is None          # not asked for the completion


def test_streamed_echo_with_logprobs_equals_the_whole_answer(served):
    _, process = served
    client = _client(process)
    args = dict(model="tiny", prompt=[PROMPT, PROMPT[:5]], max_tokens=4, temperature=0, echo=True, logprobs=1)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        streamed = [lp for c in mine if c.logprobs for lp in c.logprobs.token_logprobs]
        assert streamed == choice.logprobs.token_logprobs


def test_chat_prompt_logprobs_at_the_top_and_not_streamed(served, model_logprobs):
    _, process = served
    messages = [{"role": "user", "content": "hello there"}]
    body = httpx.post(process.url + "/v1/chat/completions", timeout=120,
                      json={"model": "tiny", "messages": messages, "max_tokens": 2, "prompt_logprobs": 0}).json()
    tokens = httpx.post(process.url + "/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == len(tokens)
    assert all(list(position) == [str(token)] for position, token in zip(body["prompt_logprobs"][1:], tokens[1:]))
    refused = httpx.post(process.url + "/v1/chat/completions", timeout=30,
                         json={"model": "tiny", "messages": messages, "prompt_logprobs": 0, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_a_scored_prompt_is_prefilled_whole_and_answers_as_an_unscored_one(served):
    """The same prompt twice in one conversation scope: the scored turn resumes nothing (every
    position's logits are computed) and answers what the plain request answers."""
    _, process = served
    client = _client(process)
    plain = client.completions.create(model="tiny", prompt=PROMPT * 4, max_tokens=6, temperature=0)
    scored = client.completions.create(model="tiny", prompt=PROMPT * 4, max_tokens=6, temperature=0, echo=True,
                                       logprobs=0)
    assert scored.choices[0].text.endswith(plain.choices[0].text)
    assert scored.usage.prompt_tokens_details.cached_tokens == 0


MC_TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def test_lm_eval_multiple_choice_runs_against_the_server(served, tiny_llama, tmp_path):
    """lm-eval's local-completions on a multiple-choice task (loglikelihood requests: echo, logprobs 1,
    max_tokens 1): each choice's log likelihood is the PyTorch model's."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from snapcompile.evaluation.ruler import tokenizer_folder
    folder, process = served
    docs = [{"question": q, "choices": [" red", " green", " blue"], "answer": a}
            for q, a in (("The sky is", 2), ("Grass is", 1), ("Blood is", 0))]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_choice.yaml").write_text(MC_TASK.format(data=data))
    tokenizer = tokenizer_folder(folder, tmp_path)
    model_args = {"model": "tiny", "base_url": f"{process.url}/v1/completions", "tokenizer": str(tokenizer),
                  "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_length": 256,
                  "num_concurrent": 1, "max_retries": 1}
    output = simple_evaluate(model="local-completions", model_args=model_args, tasks=["tiny_choice"],
                             task_manager=TaskManager(include_path=str(tmp_path / "tasks")), log_samples=True,
                             bootstrap_iters=0, verbosity="ERROR")
    samples = output["samples"]["tiny_choice"]
    assert len(samples) == len(docs)
    hf = tokenizer_of(tokenizer)
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            expected = _loglikelihood(tiny_llama.model, hf, context, continuation)
            assert np.isclose(response[0][0], expected, atol=1e-3)
    assert 0.0 <= output["results"]["tiny_choice"]["acc,none"] <= 1.0


def tokenizer_of(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


def _loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """The float model's log probability of `continuation` after `context`, split as lm-eval splits them."""
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
    return float(sum(logprobs[i - 1, whole[i]] for i in range(len(context_ids), len(whole))))


def test_n_samples_of_a_scored_prompt_share_its_log_probabilities(served):
    """n = 2: the second sample starts from the first's prefill and carries the same prompt part."""
    _, process = served
    answer = _client(process).completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=1.0, seed=5,
                                                 n=2, echo=True, logprobs=1)
    first, second = (choice.logprobs for choice in answer.choices)
    prompt = len(PROMPT)
    assert first.token_logprobs[:prompt] == second.token_logprobs[:prompt] and first.token_logprobs[1] is not None
    assert first.top_logprobs[:prompt] == second.top_logprobs[:prompt]
    assert answer.usage.prompt_tokens == prompt           # prefilled once


def test_prompt_log_probabilities_are_bounded_per_request():
    """Prompt tokens x (k + 1) x n past MAX_PROMPT_LOGPROB_ENTRIES is a 400 naming the field, whatever
    the server's context and slots allow (at 32k tokens, 32 prompts, k 20 and n 16 would be 352M)."""
    from types import SimpleNamespace

    from snapcompile.serve.completions import MAX_PROMPT_LOGPROB_ENTRIES, OpenAIServing
    from snapcompile.serve.protocol import ApiError, CompletionRequest
    serving = SimpleNamespace(engine_loop=SimpleNamespace(engine=SimpleNamespace(
        backend=SimpleNamespace(scores_prompts=True))))
    prompts = [[7] * 4000] * 12
    fits = CompletionRequest(model="m", prompt=prompts, prompt_logprobs=20)         # 1,008,000 entries at n 1
    for params, refused in ((fits.model_copy(update={"prompt_logprobs": 19}), False), (fits, True),
                            (CompletionRequest(model="m", prompt=prompts, echo=True, logprobs=5, n=4), True)):
        entries = 12 * 4000 * ((params.prompt_logprob_count() or 0) + 1) * params.n
        assert (entries > MAX_PROMPT_LOGPROB_ENTRIES) == refused
        if not refused:
            OpenAIServing._check_prompt_logprobs(serving, params, prompts)
            continue
        with pytest.raises(ApiError, match=f"make {entries} entries") as error:
            OpenAIServing._check_prompt_logprobs(serving, params, prompts)
        assert error.value.param == ("prompt_logprobs" if params.prompt_logprobs is not None else "echo")
