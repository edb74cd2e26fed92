"""Image prompts through the asynchronous samplers (docs/async.md#images): the ``hf`` worker
process encodes a job's images with the policy's ``ImageEncoder`` and samples what the
synchronous ``HFRollout`` samples (same prompts, seed and weights: the same batch, image keys
included), each worker of a pool its share; an image job without an encoder is refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_worker_utils import assert_same
from vlm_utils import IMAGE, picture, save_tiny_vlm, toy_vlm

from microrl.configs import ActorConfig, LoraConfig
from microrl.engine import ActorEngine
from microrl.engine.rollout import HFRollout, SamplingParams
from microrl.engine.rollout.images import ImageEncoder
from microrl.remote.trainer.hf_pool import AsyncRolloutPool, part_seeds
from microrl.remote.trainer.protocol import POLICY_VERSION_KEY, AsyncSamplerBase, SamplerOptions

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


class _Sampler(AsyncSamplerBase):
    def __init__(self, encoder) -> None:
        self.image_encoder = encoder


def test_image_jobs_are_checked_before_they_are_sent() -> None:
    _, tokenizer, processor = toy_vlm()
    encoder = ImageEncoder(processor, tokenizer.convert_tokens_to_ids("<|image_pad|>"), 2)
    with pytest.raises(ValueError, match="no image_encoder"):
        _Sampler(None)._check_images(PROMPTS, images())
    with pytest.raises(ValueError, match="one image list per prompt"):
        _Sampler(encoder)._check_images(PROMPTS, images()[:2])
    with pytest.raises(ValueError, match="text prompts"):
        _Sampler(encoder)._check_images([[1, 2]], [[]])
