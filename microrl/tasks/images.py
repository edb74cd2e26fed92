"""Images of a task's prompts: the placeholder a prompt text writes, and reading a dataset's images.

A vision-language prompt is a text in which each image stands as one :data:`IMAGE_PLACEHOLDER`
(the Qwen-VL chat templates' ``<|vision_start|><|image_pad|><|vision_end|>``), with its images in
:attr:`microrl.tasks.Problem.images`, in order; the image encoder
(:mod:`microrl.rollout.images`) expands each :data:`IMAGE_PAD` per image feature.

:func:`load_image` reads one dataset cell (``task.images.field``, docs/tasks.md#images-in-datasets):
a path (relative to the data file's folder, or absolute), a ``file://`` or ``http(s)://`` URL
(fetched once, with urllib), raw bytes, or a ``{"bytes": ..., "path": ...}`` dict as ``datasets``
stores an ``Image`` column (a decoded PIL image is taken as it is).
"""

from __future__ import annotations

import io
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["IMAGE_PAD", "IMAGE_PLACEHOLDER", "ImageLoader", "count_placeholders", "mark_images"]

IMAGE_PAD = "<|image_pad|>"
IMAGE_PLACEHOLDER = f"<|vision_start|>{IMAGE_PAD}<|vision_end|>"
URL_TIMEOUT_S = 30.0


def count_placeholders(prompt: Any) -> int:
    """How many images a prompt text (or the text contents of its messages) stands for."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PAD)
    return sum(count_placeholders(m.get("content", "")) for m in prompt if isinstance(m, dict))


def mark_images(prompt: Any, marker: str) -> Any:
    """``prompt`` (a text, or messages) with each ``marker`` (e.g. ``"<image>"``) written as
    :data:`IMAGE_PLACEHOLDER`: the datasets that mark an image's place their own way."""
    if isinstance(prompt, str):
        return prompt.replace(marker, IMAGE_PLACEHOLDER)
    return [
        {**m, "content": mark_images(m["content"], marker)}
        if isinstance(m, dict) and isinstance(m.get("content"), str)
        else m
        for m in prompt
    ]


class ImageLoader:
    """Reads image cells into RGB PIL images; each URL is fetched once per loader."""

    def __init__(self) -> None:
        self._fetched: dict[str, bytes] = {}

    def load(self, value: Any, base: Path) -> Any:
        """One image as an RGB PIL image (a relative path read from ``base``); ``ValueError``
        saying why it cannot be read."""
        from PIL import Image

        if isinstance(value, Image.Image):
            return value.convert("RGB")
        if isinstance(value, dict):
            if value.get("bytes"):
                value = value["bytes"]
            elif value.get("path"):
                value = value["path"]
            else:
                raise ValueError("a dict with neither 'bytes' nor 'path'")
        if isinstance(value, (bytes, bytearray, memoryview)):
            return _decode(bytes(value), "its bytes")
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{type(value).__name__} {value!r:.60} is not an image")
        scheme = urllib.parse.urlparse(value).scheme.lower()
        if scheme in ("http", "https"):
            if value not in self._fetched:
                try:
                    with urllib.request.urlopen(value, timeout=URL_TIMEOUT_S) as response:
                        self._fetched[value] = response.read()
                except Exception as err:  # HTTP errors, timeouts, refused connections: one line
                    raise ValueError(f"fetching {value} failed: {err}") from err
            return _decode(self._fetched[value], value)
        if scheme == "file":
            path = Path(urllib.request.url2pathname(urllib.parse.urlparse(value).path))
        else:
            path = Path(value).expanduser()
            path = path if path.is_absolute() else base / path
        if not path.is_file():
            raise ValueError(f"{str(path)!r} is not a file")
        return _decode(path.read_bytes(), str(path))


def _decode(data: bytes, what: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"{what} is not a readable image ({err})") from err
    return image.convert("RGB")
