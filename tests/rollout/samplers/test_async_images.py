"""Image prompts through the asynchronous samplers (docs/async.md#images): the ``hf`` worker
process encodes a job's images with the policy's ``ImageEncoder`` and samples what the
synchronous ``HFRollout`` samples (same prompts, seed and weights: the same batch, image keys
included), each worker of a pool its share; an image job without an encoder is refused. vLLM
servers (a stand-in of the generate route: this CPU cannot run vLLM's Qwen-VL code) get each
prompt with one placeholder per image and its PNGs, and the prompt they ran is checked.
"""

from __future__ import annotations

import base64
import dataclasses
import http.server
import io
import itertools
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from hf_worker_utils import assert_same
from PIL import Image
from vlm_utils import IMAGE, picture, save_tiny_vlm, toy_vlm

from microrl.configs import ActorConfig, LoraConfig
from microrl.engine import ActorEngine
from microrl.engine.vision import pad_images
from microrl.rollout import HFRollout, SamplingParams
from microrl.rollout.images import ImageEncoder, check_image_prompts
from microrl.rollout.sampler import POLICY_VERSION_KEY, SamplerOptions
from microrl.rollout.samplers.hf_pool import AsyncRolloutPool, part_seeds

PROMPTS = [f"1{IMAGE}2=", "3+4=", f"{IMAGE}5{IMAGE}="]
SEEDED = SamplingParams(num_samples=2, max_new_tokens=4, seed=5)
IMAGE_KEYS = ("pixel_values", "image_grid_thw")


def images():
    return [[picture(8, 8, 0)], [], [picture(12, 8, 1), picture(8, 8, 2)]]


@pytest.fixture(scope="module")
def vlm_engine(tmp_path_factory):
    """A LoRA engine on the tiny Qwen2-VL (a non-trivial adapter) and its image encoder."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # beside the worker's one thread (see test_hf_worker.py)
    path = save_tiny_vlm(tmp_path_factory.mktemp("vlm") / "vlm")
    _, tokenizer, _ = toy_vlm()
    engine = ActorEngine(str(path), ActorConfig(lora=LoraConfig(rank=2)))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for name, param in engine.module.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    yield engine, tokenizer, ImageEncoder.from_pretrained(path)
    torch.set_num_threads(previous)


def _assert_same_images(rollout, reference) -> None:
    assert_same(rollout, reference)
    for key in IMAGE_KEYS:  # the one preprocessing path: the same pixels, bit for bit
        assert torch.equal(rollout.batch[key], reference.batch[key]), key


def test_pool_workers_sample_image_prompts_as_the_synchronous_sampler(vlm_engine) -> None:
    """Two workers, the prompts and their images split between them: each part's rows are
    the synchronous sampler's at the part's seed (image keys bit for bit), and the merged
    rollout carries every row's own pixels."""
    engine, tokenizer, encoder = vlm_engine
    reference = HFRollout(engine, tokenizer, image_encoder=encoder)
    with AsyncRolloutPool(
        engine, tokenizer, SamplerOptions(image_encoder=encoder), num_workers=2
    ) as pool:
        job = pool.submit(PROMPTS, SEEDED, images=images())
        seeds = part_seeds(SEEDED.seed, 2)
        for part, seed in zip(job.parts, seeds, strict=True):
            rollout = pool.workers[part.worker].collect(part.job)
            chunk = slice(part.start, part.start + part.size)
            params = dataclasses.replace(SEEDED, seed=seed)
            alone = reference.generate(PROMPTS[chunk], params, images=images()[chunk])
            _assert_same_images(rollout, alone)
            assert rollout.batch[POLICY_VERSION_KEY].tolist() == [0] * len(alone.texts)
        merged = pool.generate(PROMPTS, SEEDED, images=images())
        assert merged.batch["image_grid_thw"][:, :, 0].sum(-1).tolist() == [1, 1, 0, 0, 2, 2]
        text = pool.generate(["3+4=", "5="], SEEDED)  # a text job: no image keys
        assert not set(IMAGE_KEYS) & set(text.batch.keys())


def test_image_jobs_are_checked_before_they_are_sent() -> None:
    _, tokenizer, processor = toy_vlm()
    encoder = ImageEncoder(processor, tokenizer.convert_tokens_to_ids("<|image_pad|>"), 2)
    with pytest.raises(ValueError, match="no image_encoder"):
        check_image_prompts(SimpleNamespace(image_encoder=None), PROMPTS, images())
    with pytest.raises(ValueError, match="one image list per prompt"):
        check_image_prompts(SimpleNamespace(image_encoder=encoder), PROMPTS, images()[:2])
    with pytest.raises(ValueError, match="text prompts"):
        check_image_prompts(SimpleNamespace(image_encoder=encoder), [[1, 2]], [[]])


# ----------------------------------------------------------------- vLLM servers (stand-in)
class _GenerateHandler(http.server.BaseHTTPRequestHandler):
    """Plays ``vllm serve``'s generate route for image prompts: decodes the PNGs, expands each
    placeholder by its own image processor's count (``extra``: a wrongly sized one), answers
    that prompt (``return_token_ids``) and two tokens per sample."""

    bodies: ClassVar[list[dict]] = []
    extra = 0
    token = eos = 0
    processor = None

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _GenerateHandler.bodies.append(body)
        pictures = [
            Image.open(io.BytesIO(base64.b64decode(p["url"].split(",", 1)[1])))
            for p in body.get("content_parts", [])
        ]
        counts = iter(
            [int(g.prod()) // 4 + self.extra for g in self._grids(pictures)] if pictures else []
        )
        ran = []
        for t in body["token_ids"]:
            ran += [t] * (next(counts) if t == self.token else 1)
        samples = body["sampling_params"].get("n", 1)
        choices = [
            {
                "index": k,
                "token_ids": [5 + k, self.eos],
                "logprobs": {"content": [{"logprob": -0.5 - k}, {"logprob": -0.25}]},
            }
            for k in range(samples)
        ]
        answer = {"choices": choices}
        if body.get("return_token_ids"):
            answer["prompt_token_ids"] = ran
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _grids(self, pictures):
        return self.processor(images=pictures, return_tensors="pt")["image_grid_thw"]

    def log_message(self, *args) -> None:
        pass


def _server_rollout(url: str, tokenizer, encoder):
    """A :class:`VLLMServerRollout` on the stand-in (no engine, no push: its jobs only)."""
    from microrl.rollout.samplers.vllm_http import ServerClient
    from microrl.rollout.samplers.vllm_servers import VLLMServerRollout, _ServerBackend

    rollout = VLLMServerRollout.__new__(VLLMServerRollout)
    rollout.tokenizer, rollout.image_encoder, rollout.env_maker = tokenizer, encoder, None
    rollout.backend = _ServerBackend(rollout)
    rollout.clients = [ServerClient(url, "key", timeout_s=30)]
    rollout.is_lora, rollout._run_id, rollout.version, rollout.timeout_s = True, "t", 0, 30.0
    rollout._context, rollout._jobs = threading.local(), itertools.count()
    rollout._futures, rollout._syncs, rollout._servers, rollout.job_seconds = {}, {}, [], []
    rollout._requests = ThreadPoolExecutor(4)
    rollout._job_thread = ThreadPoolExecutor(1)
    rollout._closed = False
    return rollout


def test_server_jobs_send_images_and_check_the_prompt_the_server_ran() -> None:
    _, tokenizer, processor = toy_vlm()
    token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    encoder = ImageEncoder(processor, token, 2)
    handler = _GenerateHandler
    handler.token, handler.eos, handler.processor = token, tokenizer.eos_token_id, processor
    handler.bodies.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    rollout = _server_rollout(f"http://127.0.0.1:{server.server_port}", tokenizer, encoder)
    try:
        got = rollout.collect(rollout.submit(PROMPTS, SEEDED, images=images()))
        batch = got.batch
        assert (batch["input_ids"] == token).sum(-1).tolist() == [4, 4, 0, 0, 10, 10]
        encoded = encoder.encode(tokenizer, PROMPTS, images())  # the trainer's pixels
        expected = pad_images([encoded.images[i // 2] for i in range(6)])
        for key in IMAGE_KEYS:
            assert torch.equal(batch[key], expected[key]), key
        assert batch[POLICY_VERSION_KEY].tolist() == [0] * 6
        sent = sorted(handler.bodies, key=lambda b: len(b["token_ids"]))
        by_images = {len(b.get("content_parts", [])): b for b in sent}
        assert set(by_images) == {0, 1, 2} and by_images[2]["return_token_ids"]
        assert by_images[2]["token_ids"].count(token) == 2  # one placeholder per image
        decoded = [
            Image.open(io.BytesIO(base64.b64decode(p["url"].split(",", 1)[1])))
            for p in by_images[2]["content_parts"]
        ]
        assert [d.tobytes() for d in decoded] == [i.tobytes() for i in images()[2]]  # lossless
        assert "return_token_ids" not in by_images[0]
        handler.extra = 1  # a server whose processor sizes images otherwise: refused
        with pytest.raises(RuntimeError, match="prompt 0: vLLM expanded its image placeholders"):
            rollout.collect(rollout.submit(PROMPTS[:1], SEEDED, images=images()[:1]))
    finally:
        handler.extra = 0
        server.shutdown()
        rollout._requests.shutdown()
        rollout._job_thread.shutdown()
