"""Tasks with images: the toy vision task (microrl/tasks/digits.py) and ``task.images.field`` of
prompt files (microrl/tasks/dataset.py, microrl/tasks/images.py): every form of image cell
(a relative or absolute path, a file:// URL, an http URL served by a local stand-in server,
bytes in Parquet and a ``datasets`` Image column), and bad rows refused at load time naming the
row and the key.
"""

from __future__ import annotations

import http.server
import io
import json
import random
import re
import threading
from pathlib import Path

import pytest
from PIL import Image

from microrl.configs.run import TaskConfig
from microrl.configs.task import DatasetConfig, ImagesConfig, RewardsConfig
from microrl.tasks import make_task
from microrl.tasks.dataset import DatasetTask
from microrl.tasks.digits import DigitsTask
from microrl.tasks.images import IMAGE_PLACEHOLDER
from microrl.tasks.rewards import exact_match


def _png(colour: tuple[int, int, int], size: int = 8) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(out, format="PNG")
    return out.getvalue()


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_digits_are_deterministic_held_out_and_scored_by_exact_match() -> None:
    task, again = DigitsTask(9, 20, seed=3), DigitsTask(9, 20, seed=3)
    held_out = task.eval_problems()
    assert [p.answer for p in held_out] == [p.answer for p in again.eval_problems()]
    assert [p.images[0].tobytes() for p in held_out] == [
        p.images[0].tobytes() for p in again.eval_problems()
    ]
    problem = held_out[0]
    assert problem.prompt == IMAGE_PLACEHOLDER + "number?"
    assert problem.images[0].size == (24, 24) and problem.images[0].mode == "RGB"
    train = task.sample(random.Random(0), 200)
    seen = {p.images[0].tobytes() for p in train}
    assert not seen & {p.images[0].tobytes() for p in held_out}  # never trained on
    assert {p.answer for p in train} == {str(d) for d in range(10)}
    assert task.score([f" {problem.answer} ", "x", "07"], [problem, problem, problem])[0] == 1.0
    assert task.score(["x"], [problem]) == [0.0]
    other = DigitsTask(9, 20, seed=4).eval_problems()
    assert [p.images[0].tobytes() for p in other] != [p.images[0].tobytes() for p in held_out]


def test_digits_task_from_the_config_and_its_errors() -> None:
    task = make_task(TaskConfig(name="digits", max_operand=9, eval_size=10))
    assert isinstance(task, DigitsTask) and len(task.eval_problems()) == 10
    with pytest.raises(ValueError, match=re.escape("task.max_operand")):
        TaskConfig(name="digits", max_operand=100)
    with pytest.raises(ValueError, match=re.escape("task.eval_size")):
        DigitsTask(9, 5000)
    with pytest.raises(ValueError, match=re.escape("task.images.field")):
        TaskConfig(name="addition", images=ImagesConfig(field="image"))


class _Images(http.server.BaseHTTPRequestHandler):
    """A stand-in image server: /red.png, anything else 404; counts the requests."""

    hits = 0

    def do_GET(self) -> None:
        type(self).hits += 1
        if self.path != "/red.png":
            self.send_error(404)
            return
        body = _png((255, 0, 0))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def image_server():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Images.hits = 0
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_image_field_reads_paths_urls_and_bytes(tmp_path: Path, image_server: str) -> None:
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "green.png").write_bytes(_png((0, 255, 0)))
    blue = tmp_path / "blue.png"
    blue.write_bytes(_png((0, 0, 255)))
    prompt = IMAGE_PLACEHOLDER + "colour?"
    rows = [
        {"prompt": prompt, "answer": "green", "image": "pics/green.png"},  # relative to the file
        {"prompt": prompt, "answer": "blue", "image": str(blue)},  # absolute
        {"prompt": prompt, "answer": "blue", "image": blue.as_uri()},  # file:// URL
        {"prompt": prompt, "answer": "red", "image": f"{image_server}/red.png"},
        {"prompt": prompt * 2, "answer": "red", "image": [f"{image_server}/red.png", str(blue)]},
        {"prompt": "text only", "answer": "none", "image": None},
    ]
    path = _jsonl(tmp_path / "train.jsonl", rows)
    task = make_task(
        TaskConfig(
            name="dataset",
            eval_size=6,
            dataset=DatasetConfig(train_file=str(path), eval_file=str(path)),
            images=ImagesConfig(field="image"),
            rewards=RewardsConfig(functions=["microrl.tasks.rewards:exact_match"]),
        )
    )
    problems = task.eval_problems()
    colours = [[image.getpixel((0, 0)) for image in p.images] for p in problems]
    green, blue_px, red = (0, 255, 0), (0, 0, 255), (255, 0, 0)
    assert colours == [[green], [blue_px], [blue_px], [red], [red, blue_px], []]
    assert all(image.mode == "RGB" for p in problems for image in p.images)
    assert "image" not in problems[0].columns  # the images are not a reward column
    assert _Images.hits == 1  # each URL fetched once, at load time (train and eval: one file)


def test_image_field_reads_parquet_bytes_and_a_datasets_image_column(tmp_path: Path) -> None:
    import datasets

    prompt = IMAGE_PLACEHOLDER + "colour?"
    raw = tmp_path / "raw.parquet"
    datasets.Dataset.from_list(
        [{"prompt": prompt, "answer": "red", "image": _png((255, 0, 0))}] * 3
    ).to_parquet(str(raw))
    stored = tmp_path / "stored.parquet"  # as `datasets` stores images: {"bytes", "path"}
    features = datasets.Features(
        {
            "prompt": datasets.Value("string"),
            "answer": datasets.Value("string"),
            "image": datasets.Image(),
        }
    )
    datasets.Dataset.from_dict(
        {
            "prompt": [prompt] * 3,
            "answer": ["green"] * 3,
            "image": [{"bytes": _png((0, 255, 0)), "path": None}] * 3,
        },
        features=features,
    ).to_parquet(str(stored))
    for path, colour in ((raw, (255, 0, 0)), (stored, (0, 255, 0))):
        task = DatasetTask(path, exact_match, eval_size=1, image_field="image")
        for problem in [*task.eval_problems(), *task.sample(random.Random(0), 2)]:
            assert [image.getpixel((1, 1)) for image in problem.images] == [colour]


@pytest.mark.parametrize(
    ("cell", "prompt", "error"),
    [
        ("missing.png", IMAGE_PLACEHOLDER, "is not a file"),
        ("not_an_image.png", IMAGE_PLACEHOLDER, "is not a readable image"),
        (None, IMAGE_PLACEHOLDER, "has 0 image(s) but its prompt has 1 image placeholder"),
        ("ok.png", "no placeholder", "has 1 image(s) but its prompt has 0 image placeholder"),
        ("http://127.0.0.1:{port}/gone.png", IMAGE_PLACEHOLDER, "fetching"),
    ],
)
def test_a_bad_image_row_is_refused_at_load_naming_the_row_and_field(
    tmp_path: Path, image_server: str, cell, prompt, error
) -> None:
    (tmp_path / "ok.png").write_bytes(_png((0, 0, 0)))
    (tmp_path / "not_an_image.png").write_text("plain text")
    if isinstance(cell, str):
        cell = cell.replace("http://127.0.0.1:{port}", image_server)
    good = {"prompt": IMAGE_PLACEHOLDER, "answer": "1", "pic": "ok.png"}
    path = _jsonl(
        tmp_path / "rows.jsonl", [good, good, {"prompt": prompt, "answer": "1", "pic": cell}]
    )
    with pytest.raises(
        ValueError, match=r"task\.images\.field='pic': row 2 of .*rows\.jsonl"
    ) as err:
        DatasetTask(path, exact_match, eval_size=1, image_field="pic")
    assert error in str(err.value)
    with pytest.raises(ValueError, match=r"task\.images\.field='picture' is not a field"):
        DatasetTask(path, exact_match, eval_size=1, image_field="picture")


def test_image_marker_writes_the_models_placeholder_where_a_dataset_marks_images(
    tmp_path: Path,
) -> None:
    """LLaVA-style rows (geometry3k writes ``<image>`` in the problem text): ``task.images.marker``
    turns each marker into the image placeholder, in texts and in messages; a row whose markers
    and images disagree is refused naming it."""
    (tmp_path / "a.png").write_bytes(_png((9, 9, 9)))
    rows = [
        {"problem": "<image>Find x.", "answer": "3", "images": ["a.png"]},
        {"problem": [{"role": "user", "content": "Two: <image><image>"}], "answer": "4",
         "images": ["a.png", "a.png"]},
    ]  # fmt: skip
    path = _jsonl(tmp_path / "geo.jsonl", rows[:1])
    cfg = TaskConfig(
        name="dataset",
        eval_size=1,
        dataset=DatasetConfig(train_file=str(path), eval_file=str(path), prompt_field="problem"),
        images=ImagesConfig(field="images", marker="<image>"),
        rewards=RewardsConfig(functions=["microrl.tasks.rewards:exact_match"]),
    )
    (problem,) = make_task(cfg).eval_problems()
    assert problem.prompt == IMAGE_PLACEHOLDER + "Find x." and len(problem.images) == 1
    from microrl.tasks.images import mark_images

    assert (
        mark_images(rows[1]["problem"], "<image>")[0]["content"] == "Two: " + 2 * IMAGE_PLACEHOLDER
    )
    _jsonl(path, [{**rows[0], "images": ["a.png", "a.png"]}])
    with pytest.raises(
        ValueError, match=r"row 0 of .* has 2 image.* prompt has 1 image placeholder"
    ):
        make_task(cfg)
    with pytest.raises(ValueError, match=r"task\.images\.marker"):
        ImagesConfig(marker="<image>")  # without a field


def test_an_unset_max_operand_is_the_tasks_own() -> None:
    """task.max_operand=null (the default): digits read one digit (what the toy vision model
    learns; 99 would not train), addition keeps 99; a set value stays. Also when only
    task.name is overridden on a config with no YAML file: the default task's 99 was written
    into the field before the override named digits."""
    from microrl.configs import load_config
    from microrl.configs.examples import GRPOExampleConfig

    assert TaskConfig(name="digits").operand_limit == 9
    assert TaskConfig(name="addition").operand_limit == 99
    assert TaskConfig(name="digits", max_operand=20).operand_limit == 20
    cfg = load_config(GRPOExampleConfig, None, ["task.name=digits"])
    assert (cfg.task.max_operand, cfg.task.operand_limit) == (None, 9)
