"""TEST-ONLY stand-ins that let vLLM 0.32's CPU build load a Qwen2-VL without torchvision.

Machines without torchvision (this CPU test machine: no wheel of it imports beside torch's CPU
build) cannot start vLLM's Qwen-VL models (docs/rollouts.md#images): vLLM imports transformers'
torchvision image-processing module, and builds transformers' ``Qwen2VLProcessor``, whose video
processor needs torchvision. :func:`without_torchvision` replaces exactly those two constructions
(and runs vLLM's model inspection in this process, so the first replacement reaches it):

- the module ``transformers.models.qwen2_vl.image_processing_qwen2_vl`` stands for the PIL one
  (vLLM reads ``smart_resize`` from it: the same function in both modules);
- vLLM's ``Qwen2VLProcessingInfo.get_hf_processor`` returns a ``Qwen2VLProcessor`` holding the
  checkpoint's PIL image processor (``backend="pil"``), the tokenizer and no video processor.

The model, its vision tower, vLLM's multimodal processing and sampling all run for real: only the
processor objects come from elsewhere, and they are the PIL preprocessing the trainer uses. With
torchvision installed (GPU machines) nothing is replaced. Never import this outside tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types

import pytest

_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


def _processor(info, **kwargs):
    """A ``Qwen2VLProcessor`` built from its parts (``from_pretrained`` loads the video
    processor, which needs torchvision); the video processor slot holds the image processor,
    whose keyword names vLLM reads (videos are off: ``limit_mm_per_prompt={"video": 0}``)."""
    from transformers import AutoImageProcessor, Qwen2VLProcessor

    processor = object.__new__(Qwen2VLProcessor)
    tokenizer = info.get_tokenizer()
    image = AutoImageProcessor.from_pretrained(info.ctx.model_config.model, backend="pil")
    processor.tokenizer, processor.image_processor, processor.video_processor = (
        tokenizer,
        image,
        image,
    )
    processor.chat_template = None
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = tokenizer.convert_tokens_to_ids(processor.image_token)
    processor.video_token_id = tokenizer.convert_tokens_to_ids(processor.video_token)
    return processor


@contextlib.contextmanager
def without_torchvision():
    """The stand-ins above, for the duration (nothing when torchvision is installed)."""
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    from microrl.rollout.samplers import vllm_images
    from microrl.rollout.samplers.vllm import _import_vllm

    _import_vllm()  # vLLM's in-process settings, as the backend imports it
    shim = types.ModuleType(_MODULE)
    shim.smart_resize = pil.smart_resize
    shim.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, _MODULE, shim)
        from vllm.model_executor.models import qwen2_vl, registry

        patch.setattr(registry, "_run_in_subprocess", lambda fn: fn())
        patch.setattr(qwen2_vl.Qwen2VLProcessingInfo, "get_hf_processor", _processor)
        patch.setattr(vllm_images, "vision_unsupported", lambda: None)
        yield
