"""The vLLM server mode's wire format and local-server set-up, without a server: request
bodies, response parsing (tokens, log-probs, per-token weight versions), the server's command
line and environment (the key never on the command line, no insecure serialization)."""

from __future__ import annotations

import pytest

from microrl.rollout import SamplingParams
from microrl.rollout.samplers.vllm_http import ServerError
from microrl.rollout.samplers.vllm_launch import serve_command, server_env
from microrl.rollout.samplers.vllm_requests import (
    generate_body,
    parse_samples,
    probe_body,
    prompt_logprobs,
)


def _choice(index, tokens, versions=None):
    choice = {
        "index": index,
        "token_ids": tokens,
        "logprobs": {"content": [{"token_id": t, "logprob": -0.5 * t} for t in tokens]},
    }
    if versions is not None:
        choice["weight_versions"] = versions
    return choice


def test_generate_body_maps_sampling_params():
    params = SamplingParams(num_samples=4, temperature=0.7, max_new_tokens=6, top_k=5, top_p=0.9)
    body = generate_body([3, 4], params, seed=2**31 + 5, eos_token_id=1, adapter="a-v3")
    assert body["token_ids"] == [3, 4] and body["model"] == "a-v3"
    sp = body["sampling_params"]
    assert (sp["n"], sp["temperature"], sp["top_k"], sp["top_p"]) == (4, 0.7, 5, 0.9)
    assert sp["max_tokens"] == 6 and sp["stop_token_ids"] == [1] and sp["logprobs"] == 0
    assert sp["seed"] == 6 and sp["detokenize"] is False  # seeds wrap into vLLM's int32 range
    greedy = generate_body([3], SamplingParams(num_samples=3, greedy=True), seed=0,
                           eos_token_id=(1, 9), adapter=None)  # fmt: skip
    assert greedy["sampling_params"]["n"] == 1 and greedy["sampling_params"]["temperature"] == 0
    assert greedy["sampling_params"]["top_k"] == -1 and "model" not in greedy
    assert greedy["sampling_params"]["stop_token_ids"] == [1, 9]  # every turn terminator


def test_generate_body_with_images_is_a_vllm_generate_request():
    """Images travel as the route's ``content_parts``; vLLM's own request model accepts the
    body (its sampling parameters too), and a text prompt's body has none."""
    from PIL import Image

    from microrl.rollout.samplers.vllm import _import_vllm, _without_vllm_deprecations

    _import_vllm()  # as the backends import it: vLLM's own deprecation warnings silenced
    with _without_vllm_deprecations():
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    image = Image.new("RGB", (28, 28), (10, 200, 30))
    params = SamplingParams(num_samples=2, temperature=0.7, max_new_tokens=4)
    body = generate_body([3, 20, 4], params, seed=1, eos_token_id=1, adapter=None, images=[image])
    assert [p["type"] for p in body["content_parts"]] == ["image_url"]
    assert body["content_parts"][0]["url"].startswith("data:image/png;base64,")
    request = GenerateRequest.model_validate(body)
    assert request.token_ids == [3, 20, 4] and request.content_parts == body["content_parts"]
    assert request.return_token_ids  # the server answers the prompt it ran, expanded
    assert "content_parts" not in generate_body([3], params, seed=1, eos_token_id=1, adapter=None)


def test_parse_samples_keeps_order_and_versions():
    response = {
        "choices": [
            _choice(1, [7, 1], [{"version": "4", "start": 0, "end": 1},
                                {"version": "5", "start": 1, "end": 2}]),
            _choice(0, [9], [{"version": "4", "start": 0, "end": 1}]),
        ]
    }  # fmt: skip
    samples = parse_samples(response, url="http://x", version=None)
    assert [s[0] for s in samples] == [[9], [7, 1]]  # by index
    assert samples[1][1] == [-3.5, -0.5]
    assert [s[2] for s in samples] == [(4, 4), (4, 5)]  # first and last token's versions
    lora = parse_samples(response, url="http://x", version=8)
    assert [s[2] for s in lora] == [(8, 8), (8, 8)]


def test_parse_samples_refuses_what_it_cannot_trust():
    bad = {"choices": [_choice(0, [5], [{"version": "default"}])]}
    with pytest.raises(ServerError, match="weight version 'default': not one microrl pushed"):
        parse_samples(bad, url="http://x", version=None)
    short = {"choices": [{"index": 0, "token_ids": [5, 6], "logprobs": {"content": []}}]}
    with pytest.raises(ServerError, match="returned 2 tokens but 0 log-probs"):
        parse_samples(short, url="http://x", version=1)


def test_probe_round_trip():
    body = probe_body([5, 6, 7], "a-v1")
    assert body["sampling_params"]["prompt_logprobs"] == 0 and body["model"] == "a-v1"
    response = {"prompt_logprobs": [None, {"6": {"logprob": -1.0}}, {"7": {"logprob": -2.0}}]}
    assert prompt_logprobs(response, [5, 6, 7]) == [-1.0, -2.0]


def test_the_local_server_command_and_environment(monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the colocated backend's
    lora = server_env("k3y", full_weights=False, num_threads=1)
    assert lora["VLLM_API_KEY"] == "k3y" and lora["OMP_NUM_THREADS"] == "1"
    for gone in ("VLLM_ALLOW_INSECURE_SERIALIZATION", "RANK", "VLLM_SERVER_DEV_MODE"):
        assert gone not in lora  # a LoRA server mounts no weight-sync routes
    assert server_env("k3y", full_weights=True, num_threads=0)["VLLM_SERVER_DEV_MODE"] == "1"
    command = serve_command("/m", port=8123, lora_rank=8, max_loras=4, kv_cache_mb=256)
    assert "k3y" not in " ".join(command)  # the key travels in the environment only
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert "--enable-lora" in command and "--weight-transfer-config" not in command
    assert lora["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"  # a GPU server keeps vLLM's default
    assert "uni" not in command
    on_cpu = server_env("k3y", full_weights=False, num_threads=1, cpu=True)
    assert on_cpu["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "uni" in serve_command("/m", port=1, cpu=True)  # the model in the engine core
    full = serve_command("/m", port=8123, weight_transfer="gloo")
    assert '{"backend": "gloo"}' in full and "--no-enable-prefix-caching" in full
    assert "--skip-tokenizer-init" in command  # token ids only, unless images
    vision = serve_command("/m", port=1, images=True)  # vLLM's processor reads the tokenizer
    assert "--skip-tokenizer-init" not in vision
    assert vision[vision.index("--limit-mm-per-prompt") + 1] == '{"video": 0}'
