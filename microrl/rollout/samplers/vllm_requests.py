"""The wire format of ``/inference/v1/generate`` on a ``vllm serve`` server: ids and
``SamplingParams`` in, ids, log-probs and weight-version spans out (docs/async.md#vllm-servers)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from microrl.rollout.base import SamplingParams
from microrl.rollout.images import ImageEncoder, ImagePrompts
from microrl.rollout.samplers import vllm_images, vllm_options
from microrl.rollout.samplers.vllm_http import ServerError

__all__ = [
    "GENERATE_ROUTE",
    "ServerPrompt",
    "generate_body",
    "parse_samples",
    "probe_body",
    "prompt_logprobs",
    "server_prompt",
]

#: vLLM's token-in, token-out route.
GENERATE_ROUTE = "inference/v1/generate"


def generate_body(
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    seed: int,
    eos_token_id: int | Sequence[int],
    adapter: str | None,
    images: Sequence[Any] = (),
) -> dict[str, Any]:
    """One prompt's request, sampled as the in-process engine does; ``adapter``: the LoRA
    adapter's name (None: the served weights); ``images``: one placeholder each in the ids."""
    sampling = vllm_options.sampling_args(params, seed=seed, eos_token_id=eos_token_id)
    body = _body(prompt_ids, sampling, adapter)
    if images:  # the server answers the prompt it ran, placeholders expanded, to check
        body["content_parts"] = vllm_images.image_content_parts(list(images))
        body["return_token_ids"] = True
    return body


@dataclass(frozen=True)
class ServerPrompt:
    """One prompt as a server gets it: ``ids`` (one placeholder per image), its PIL ``images``,
    the expanded ids the server must have run (``expected``) and its ``index`` in the call."""

    ids: list[int]
    images: tuple[Any, ...] = ()
    expected: list[int] | None = None
    index: int = 0

    def check(self, response: dict[str, Any]) -> None:
        """Raise when the server ran another prompt than the trainer's expanded one."""
        if self.expected is not None:
            ran = response.get("prompt_token_ids") or []
            vllm_images.check_expanded(ran, self.expected, self.index)


def server_prompt(
    ids: list[int], images: ImagePrompts | None, index: int, encoder: ImageEncoder | None
) -> ServerPrompt:
    """Prompt ``index`` (``ids`` expanded) as :func:`generate_body` sends it."""
    if images is None or images.images[index] is None:
        return ServerPrompt(list(ids))
    grid = images.images[index][1]
    collapsed = vllm_images.collapse_placeholders(
        ids, grid, encoder.image_token_id, encoder.merge_size
    )
    return ServerPrompt(collapsed, tuple(images.raw[index]), list(ids), index)


def parse_samples(
    response: dict[str, Any], *, url: str, version: int | None
) -> list[tuple[list[int], list[float], tuple[int, int]]]:
    """Each sample's token ids, log-probs and the policy versions of its first and last token:
    ``version`` (a LoRA adapter's), or None to read the response's weight-version spans."""
    samples = []
    for choice in sorted(response["choices"], key=lambda c: c["index"]):
        tokens = list(choice["token_ids"])
        logprobs = [step["logprob"] for step in (choice.get("logprobs") or {}).get("content", [])]
        if len(logprobs) != len(tokens):
            raise ServerError(
                f"the vLLM server at {url} returned {len(tokens)} tokens but {len(logprobs)} log-probs"
            )
        if version is not None:
            versions = (version, version)
        else:
            spans = choice.get("weight_versions") or []
            if not spans:
                raise ServerError(f"the vLLM server at {url} reports no weight versions")
            versions = (_version(spans[0]["version"], url), _version(spans[-1]["version"], url))
        samples.append((tokens, logprobs, versions))
    return samples


def probe_body(row: list[int], adapter: str | None) -> dict[str, Any]:
    """A request for ``row``'s prompt log-probs (at temperature 1)."""
    return _body(row, {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}, adapter)


def _body(ids: list[int], sampling: dict[str, Any], adapter: str | None) -> dict[str, Any]:
    """A request of ``ids``; ``adapter``: the LoRA adapter's name (None: the served weights)."""
    body: dict[str, Any] = {"token_ids": list(ids), "sampling_params": sampling}
    if adapter is not None:
        body["model"] = adapter
    return body


def prompt_logprobs(response: dict[str, Any], row: list[int]) -> list[float]:
    """The log-probs of ``row[1:]`` from a :func:`probe_body` response."""
    steps = response["prompt_logprobs"][1:]  # the first token has no prediction (null)
    return [step[str(t)]["logprob"] for step, t in zip(steps, row[1:], strict=True)]


def _version(label: str, url: str) -> int:
    try:
        return int(label)
    except (TypeError, ValueError):
        raise ServerError(
            f"the vLLM server at {url} reports weight version {label!r}: not one microrl pushed "
            "(another trainer or a restart changed its weights?)"
        ) from None
