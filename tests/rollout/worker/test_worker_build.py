"""The ``hf`` worker builds its model on its own device (microrl/rollout/worker/main.py).

Before, it built the model on the host and then moved it: on a GPU, every rank's worker held a
host copy of the whole model at its start (15 GB for a 7B in bf16), beside the trainer's.
"""

from __future__ import annotations

import torch

from microrl.configs import LoraConfig
from microrl.configs.run import ModelConfig
from microrl.engine import setup
from microrl.rollout.worker import main as worker_main
from microrl.run.toy_model import build_model, build_tokenizer


def test_the_worker_builds_its_model_on_its_device(monkeypatch) -> None:
    tok = build_tokenizer()
    config = build_model(ModelConfig(hidden_size=32, intermediate_size=64), tok).config
    pick = setup.auto_model_class
    built_on = []

    def recording(model_config):
        cls = pick(model_config)

        class Recording:
            @staticmethod
            def from_config(*args, **kwargs):
                built_on.append(torch.get_default_device())
                return cls.from_config(*args, **kwargs)

        return Recording

    monkeypatch.setattr(setup, "auto_model_class", recording)
    spec = worker_main.WorkerSpec(
        name="w", model_config=config, lora=LoraConfig(rank=4), tokenizer=tok, temperature=1.0,
        probe={}, store_port=0, timeout_s=1.0, device="meta",
    )  # fmt: skip
    model = worker_main._build_model(spec)
    assert built_on == [torch.device("meta")]  # the host never held it
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert any("lora_A" in name for name, _ in model.named_parameters())
