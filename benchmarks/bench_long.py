"""Long sequences: per-rank memory of one training micro-batch under Ulysses sequence parallelism
(``sequence_parallel_size``) and activation offload (``activation_offload``), and their time.

    python benchmarks/bench_long.py                    # CPU: all CPU parts, ~6 minutes here
    python benchmarks/bench_long.py --only sp          # one part (sp, budget, deep, offload)
    python benchmarks/bench_long.py --device cuda --only offload --lengths 16384 \
        --hidden 1024 --layers 8 --heads 16 --kv-heads 8 --vocab 32768   # a GPU (gpu_check.sh)

No ``torchrun`` needed: the script launches the ranks of ``s = 2`` and ``s = 4`` itself (gloo,
one CPU thread each, the environment ``torchrun --standalone`` gives). The model is Qwen2-style,
built from a config (default hidden 256, MLP 1024, 2 layers, 8 heads / 4 KV heads, vocab 8192,
untied head, SDPA attention), LoRA rank 16 on every linear layer but the head (``--lora 0``: full
fine-tune), float32 on the CPU (bf16 autocast on CUDA), the fused head with the policy loss
inside it. A micro-batch is one sequence of ``L`` tokens: one ``forward_backward_batch`` call
(forward, PPO-clip policy loss on the last 7/8 of the tokens, backward; gradients set to None
before each call, no optimizer step), after a warm-up call on 256 tokens.

Memory: ``peak`` is the most bytes live at once during that call, per rank, counted by
``benchmarks/live_bytes.py`` (every tensor the call allocates, forward and backward, until it is
freed; the weights and anything else that existed before the call are not counted), plus what
FSDP2 allocates in place with ``UntypedStorage.resize_`` (its gathered weights), which no
operator shows the counter. Results are in benchmarks/README.md, "Long sequences". ``held
after the forward`` is the bytes live when the forward is done: what it keeps for the backward
(the activations, and on the fused loss path the head's gradient formed in forward), the part
that splitting the tokens or offloading them divides.

Parts (``--only``, comma-separated; default ``sp,budget,deep`` on the CPU, ``offload`` on CUDA):

* ``sp``: at each of ``--lengths`` (4096 and 16384 tokens) for ``s = 1`` (this process) and
  ``s = 2`` (2 ranks), and ``s = 4`` (4 ranks) at ``--four-length`` (4096; 0 skips it); each
  ratio is against ``s = 1`` in the same run, every figure the maximum over the ranks. Time: the
  median of ``--reps`` (3) calls after the measured one (each rank's median; the slowest rank).
  ``s = 1`` runs alone on one thread, the ``s`` ranks on one thread each at once: with ``s``
  free cores, one device per rank. ``CPU time, all ranks`` sums the ranks' median CPU seconds
  (``time.process_time``, every thread of the process): the work against one process, which
  other jobs on a shared machine disturb less than the wall clock.
* ``budget``: the longest sequence whose micro-batch fits a per-rank budget, in one process, for
  gradient checkpointing off and on, each with activation offload off and on. The budget is the
  peak of the plain micro-batch (no checkpointing, no offload) at ``--budget-length`` tokens
  (2048), measured first. The search probes lengths on a ``--grid`` (512 tokens): up from half the
  budget length (each probe where the last two probes' line crosses the budget, at most twice the
  last length) until one does not fit, then inside the bracket (the same estimate, every other
  probe a bisection when the bracket did not halve) until it is one grid step wide; at most
  ``--max-length``. It assumes the peak grows with the length (the probes are printed). Offload
  without checkpointing is searched twice: held to the device peak with the copies in flight
  (below), and to the peak if every copy landed at once.
* ``deep``: part ``offload`` at ``--deep-length`` (4096) tokens on a deep, narrow model (24
  layers, hidden 64, 4 / 2 heads, vocab 2048): with checkpointing the device keeps one ``[L, H]``
  input per layer, which adds up over many layers as in an LLM (2 layers hide it).
* ``offload``: the peak, the bytes held and the time (median of ``--reps``) at each of
  ``--lengths`` for the same four configurations. On CUDA the peak is also read from the caching
  allocator (``max_memory_allocated`` less what was allocated before the call): a check of the
  counter; on a CPU the peak if every copy landed at once is shown instead. Its last line,
  ``KEY: ...``, is the GPU check's key figure.

What the device bytes mean with offload on a CPU. On CUDA the counter counts only CUDA tensors:
the pinned host copies are not counted, the device copies made for the backward are. On a CPU the
"host copy" is a second CPU buffer, so the counter models what a GPU would hold instead: a copy is
not counted from the moment the pack hook makes it until the backward unpacks it (from then on it
is counted, as the device tensor a GPU copies it back into, until it is freed); the next
``offload.PREFETCH`` copies are counted from that moment too (the GPU's prefetch); and the device
tensor of each of the last ``offload.MAX_IN_FLIGHT`` copies stays counted until the next copies
push it out, as if its copy had not landed yet (an upper bound: a copy that lands early frees it
earlier; on a GPU without checkpointing the copies are slower than the compute, and the bound is
what it holds; ``copies landed at once`` is the other end). ``host`` (in ``--json``) is the peak
of the copies held on the host. On a CPU both are host memory: the device figures model a GPU,
they are not a saving on the CPU; the computation is the same.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import weakref
from collections import deque
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # live_bytes
sys.path.insert(0, str(HERE.parent / "tests"))  # distributed_utils (the rank launcher)

from live_bytes import LiveBytes, _key, new_storages  # noqa: E402

MIB = 2.0**20
BASE_LENGTH = 256  # tokens of the warm-up micro-batch every engine runs when it is built
CONFIGS = {  # name -> (gradient_checkpointing, activation_offload)
    "plain": (False, False),
    "offload": (False, True),
    "checkpointing": (True, False),
    "checkpointing + offload": (True, True),
}


# --------------------------------------------------------------------------------------------
# Counting device bytes


class DeviceBytes(LiveBytes):
    """:class:`LiveBytes` of the bytes a device holds, activation offload's copies apart.

    ``device`` "cuda": only CUDA storages count (the pinned host copies do not). ``device``
    "cpu": every storage counts, but inside :func:`modelled_offload` the host copies are moved
    out of ``live`` (into ``host``) while a GPU would hold them on the host, and the device
    tensors of the copies in flight are added to ``in_flight`` (module docstring). ``peak``:
    the peak of ``live`` (copies landing at once); ``peak_in_flight``: of ``live + in_flight``.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device_type = device.type
        self.host = 0
        self.host_peak = 0
        self.in_flight = 0  # bytes of freed device tensors whose copy is still "in flight"
        self.peak_in_flight = 0
        self.packing = 0  # > 0 inside the pack hook: a new storage there is a host copy
        self.held: dict[int, list] = {}  # storage key -> [nbytes, "host"/"device"]
        self.copies: deque[list] = deque()  # [nbytes, freed, in flight] per copy, oldest first
        self.entries: dict[int, list] = {}  # id(storage) -> its entry, while it is counted
        self._resize = None

    def __enter__(self):
        # FSDP2 frees and refills its gathered weights (and all-gather buffers) in place with
        # UntypedStorage.resize_, which no operator dispatch sees: count those changes too.
        self._resize = torch.UntypedStorage.__dict__.get("resize_")  # None: inherited
        real = torch.UntypedStorage.resize_

        def resize_(storage, nbytes):
            before = storage.nbytes()
            out = real(storage, nbytes)
            if storage.device.type == self.device_type:
                change = storage.nbytes() - before
                entry = self.entries.get(id(storage))
                if entry is not None:
                    entry[0] += change
                if entry is None or entry[1] == "device":
                    self._add(change)
                else:
                    self._host(change)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        if self._resize is None:
            del torch.UntypedStorage.resize_
        else:
            torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key, t in new_storages(args, kwargs, out):
            if t.device.type != self.device_type:
                continue  # CUDA: a host tensor (pinned copies, the batch before it moves)
            storage = t.untyped_storage()
            entry = [storage.nbytes(), "host" if self.packing else "device"]
            if self.packing:
                self.held[key] = entry
                self._host(entry[0])
            else:
                self._add(entry[0])
            self.entries[id(storage)] = entry
            weakref.finalize(storage, self._free, entry, id(storage))
        return out

    def _add(self, nbytes: int) -> None:
        super()._add(nbytes)
        self.peak_in_flight = max(self.peak_in_flight, self.live + self.in_flight)

    def _host(self, nbytes: int) -> None:
        self.host += nbytes
        self.host_peak = max(self.host_peak, self.host)

    def _free(self, entry: list, ident: int) -> None:
        if self.entries.get(ident) is entry:
            del self.entries[ident]
        if entry[1] == "host":
            self._host(-entry[0])
        else:
            self._add(-entry[0])

    def to_device(self, host: torch.Tensor) -> None:
        """A host copy comes back: counted as the device tensor a GPU would copy it into."""
        entry = self.held.pop(_key(host), None)
        if entry is not None:
            entry[1] = "device"
            self._host(-entry[0])
            self._add(entry[0])

    def copy_issued(self, tensor: torch.Tensor, limit: int) -> None:
        """A device-to-host copy of ``tensor`` starts: its storage stays in use (``in_flight``
        once the program has freed it) until ``limit`` later copies were issued."""
        while len(self.copies) >= limit:
            self._landed(self.copies.popleft())
        copy = [tensor.untyped_storage().nbytes(), False, True]
        self.copies.append(copy)

        def freed() -> None:
            copy[1] = True
            if copy[2]:
                self.in_flight += copy[0]
                self._add(0)

        weakref.finalize(tensor.untyped_storage(), freed)

    def all_landed(self) -> None:
        while self.copies:
            self._landed(self.copies.popleft())

    def _landed(self, copy: list) -> None:
        copy[2] = False
        if copy[1]:
            self.in_flight -= copy[0]


@contextmanager
def modelled_offload(mode: DeviceBytes):
    """On a CPU device: route :class:`ActivationOffload`'s hooks through ``mode`` (module
    docstring: what is counted when). Nothing changes in what the hooks compute."""
    from microrl.engine import offload

    block = offload.ActivationOffload
    real_pack, real_unpack, real_exit = block._pack, block._unpack, block.__exit__
    pending: dict[tuple[int, int], torch.Tensor] = {}  # (block, index) -> host copy not unpacked

    def pack(self, tensor):
        mode.packing += 1
        try:
            packed = real_pack(self, tensor)
        finally:
            mode.packing -= 1
        if isinstance(packed, offload._Offloaded) and (id(self), packed.index) not in pending:
            pending[(id(self), packed.index)] = packed.host
            mode.copy_issued(tensor, offload.MAX_IN_FLIGHT)
        return packed

    def unpack(self, packed):
        out = real_unpack(self, packed)
        if isinstance(packed, offload._Offloaded):
            pending.pop((id(self), packed.index), None)
            mode.to_device(packed.host)
            earlier = sorted(
                (i for b, i in pending if b == id(self) and i < packed.index), reverse=True
            )
            for index in earlier[: offload.PREFETCH]:  # what the GPU prefetches now
                mode.to_device(pending[(id(self), index)])
        return out

    def exit_(self, *exc):
        real_exit(self, *exc)
        mode.all_landed()  # the GPU's compute stream waits for every copy here

    block._pack, block._unpack, block.__exit__ = pack, unpack, exit_
    try:
        yield
    finally:
        block._pack, block._unpack, block.__exit__ = real_pack, real_unpack, real_exit


# --------------------------------------------------------------------------------------------
# The engine and its micro-batch


def build_engine(args, *, sp: int = 1, checkpointing: bool = False, offload: bool = False):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from microrl.configs.engine import ActorConfig, LoraConfig, OptimConfig
    from microrl.engine import ActorEngine

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            vocab_size=args.vocab,
            max_position_embeddings=max(args.max_length, *args.lengths),
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
    )
    lora = LoraConfig(rank=args.lora, alpha=2.0 * args.lora) if args.lora else LoraConfig(rank=0)
    config = ActorConfig(
        micro_batch_size=1,
        gradient_checkpointing=checkpointing,
        activation_offload=offload,
        sequence_parallel_size=sp,
        device=args.device,
        lora=lora,
        optim=OptimConfig(name="adamw", lr=1e-4),
    )
    engine = ActorEngine(model, config)
    # Warm-up: what the first call allocates once (FSDP2's lazy init, lazily built buffers) is no
    # part of a micro-batch's peak.
    engine.forward_backward_batch(make_batch(BASE_LENGTH, args.vocab))
    return engine


def make_batch(length: int, vocab: int):
    """One sequence of ``length`` tokens; the loss on its last 7/8 (a prompt and a response)."""
    from tensordict import TensorDict

    gen = torch.Generator().manual_seed(length)
    mask = torch.ones(1, length, dtype=torch.bool)
    loss_mask = mask.clone()
    loss_mask[:, : length // 8] = False
    return TensorDict(
        input_ids=torch.randint(0, vocab, (1, length), generator=gen),
        attention_mask=mask,
        loss_mask=loss_mask,
        advantages=torch.randn(1, length, generator=gen),
        old_logprobs=-torch.rand(1, length, generator=gen) * 3,
        batch_size=[1],
    )


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def measure(engine, length: int, vocab: int) -> dict[str, float]:
    """One micro-batch of ``length`` tokens under the counter: device peak, device bytes held
    when the forward is done (what it keeps for the backward: the activations, and on the fused
    loss path the head's gradients formed in forward), host peak (offload's copies), bytes
    offloaded, the allocator's peak on CUDA, and the call's time."""
    batch = make_batch(length, vocab)
    engine.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
        before = torch.cuda.memory_allocated(engine.device)
    counter = DeviceBytes(engine.device)
    model = nullcontext() if cuda else modelled_offload(counter)
    held = []  # device bytes live when the forward is done: what it keeps for the backward
    forward_step = engine.forward_step

    def spy(*args, **kwargs):
        out = forward_step(*args, **kwargs)
        _sync(engine)
        held.append(counter.live)
        return out

    engine.forward_step = spy
    start = time.perf_counter()
    try:
        with model, counter:
            engine.forward_backward_batch(batch)
            _sync(engine)
    finally:
        del engine.forward_step
    seconds = time.perf_counter() - start
    stats = engine.last_offload_stats if engine.config.activation_offload else None
    result = {
        "peak": counter.peak_in_flight,
        "peak_landed": counter.peak,
        "held": max(held),
        "host": counter.host_peak,
        "offloaded": stats.bytes if stats is not None else 0,
        "counted_s": seconds,
    }
    if cuda:
        result["allocator"] = torch.cuda.max_memory_allocated(engine.device) - before
    return result


def median_time(engine, length: int, vocab: int, reps: int) -> tuple[float, float]:
    """Median wall-clock seconds and median CPU seconds (this process, all its threads) of
    ``reps`` micro-batches of ``length`` tokens (no counter)."""
    batch = make_batch(length, vocab)
    wall, cpu = [], []
    for _ in range(reps):
        engine.optimizer.zero_grad(set_to_none=True)
        _sync(engine)
        start, start_cpu = time.perf_counter(), time.process_time()
        engine.forward_backward_batch(batch)
        _sync(engine)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def sp_point(engine, args, lengths) -> dict:
    """The counter's figures and the median time at each length."""
    out = {"lengths": {}}
    for length in lengths:
        point = measure(engine, length, args.vocab)
        point["time"], point["cpu"] = median_time(engine, length, args.vocab, args.reps)
        out["lengths"][str(length)] = point
    return out


# --------------------------------------------------------------------------------------------
# Part "sp": s = 1 here, s = 2 and 4 on launched ranks


def worker(args) -> None:
    """One rank of an ``s = world`` run: prints ``RESULT <json>``."""
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    world = int(os.environ["WORLD_SIZE"])
    engine = build_engine(args, sp=world)
    result = sp_point(engine, args, args.worker_lengths)
    result["rank"] = dist.get_rank()
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def launch_ranks(args, world: int, lengths) -> list[dict]:
    from distributed_utils import launch

    forward = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("hidden", "layers", "heads", "kv_heads", "vocab", "lora", "reps", "threads")
    ]
    forward += [f"--max-length={args.max_length}", f"--lengths={','.join(map(str, lengths))}"]
    output = launch(world, Path(__file__), "--worker", *forward, timeout=args.timeout)
    results = [json.loads(line[7:]) for line in output.splitlines() if line.startswith("RESULT ")]
    if len(results) != world:
        raise RuntimeError(f"{len(results)} results from {world} ranks:\n{output[-4000:]}")
    return results


def over_ranks(results: list[dict]) -> dict:
    """The maximum over ranks of every figure, the smallest peak, and the CPU time summed."""
    merged = {"lengths": {}}
    for length in results[0]["lengths"]:
        points = [r["lengths"][length] for r in results]
        merged["lengths"][length] = {k: max(p[k] for p in points) for k in points[0]}
        merged["lengths"][length]["peak_min"] = min(p["peak"] for p in points)
        merged["lengths"][length]["cpu_sum"] = sum(p["cpu"] for p in points)
    return merged


def part_sp(args) -> tuple[list[str], dict]:
    if args.device != "cpu":
        return ["(sp: CPU only here: one GPU per rank is needed; run it on gloo)"], {}
    runs = {1: sp_point(build_engine(args), args, args.lengths)}
    print(f"  s=1 done ({time.perf_counter() - T0:.0f} s)", flush=True)
    plan = [(2, args.lengths)]
    if args.four_length:
        plan.append((4, [args.four_length]))
    for world, lengths in plan:
        runs[world] = over_ranks(launch_ranks(args, world, lengths))
        print(f"  s={world} done ({time.perf_counter() - T0:.0f} s)", flush=True)
    one = runs[1]
    lines = [
        "| tokens | s | per-rank peak (MiB) | vs s=1 | held after the forward (MiB) | vs s=1 "
        "| time per micro-batch (s) | vs s=1 | CPU time, all ranks (s) | vs s=1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for length in sorted({int(k) for r in runs.values() for k in r["lengths"]}):
        key = str(length)
        if key not in one["lengths"]:
            continue
        ref = one["lengths"][key]
        for s, run in runs.items():
            if key not in run["lengths"]:
                continue
            p = run["lengths"][key]
            cpu = p.get("cpu_sum", p["cpu"])
            note = f" ({s} ranks on {args.cores} cores)" if s > args.cores else ""
            lines.append(
                f"| {length} | {s} | {p['peak'] / MIB:.1f} | {p['peak'] / ref['peak']:.2f}x "
                f"| {p['held'] / MIB:.1f} | {p['held'] / ref['held']:.2f}x | {p['time']:.2f}{note} "
                f"| {p['time'] / ref['time']:.2f}x | {cpu:.2f} | {cpu / ref['cpu']:.2f}x |"
            )
    return lines, runs


# --------------------------------------------------------------------------------------------
# Part "budget": the longest sequence within a per-rank budget


def _down(x: float, grid: int) -> int:
    return int(x // grid) * grid


def _crossing(a: tuple[int, int], b: tuple[int, int], budget: int) -> float | None:
    """Where the line through (length, peak) points ``a`` and ``b`` reaches ``budget``."""
    (la, pa), (lb, pb) = a, b
    if pb == pa:
        return None
    return la + (budget - pa) * (lb - la) / (pb - pa)


def longest_fitting(peak_of, budget: int, start: int, grid: int, cap: int):
    """The longest length on the grid whose peak is <= ``budget`` (``peak_of`` grows with the
    length), the probes ``{length: peak}`` and whether the search stopped at ``cap``."""
    probes: dict[int, int] = {}

    def fits(length: int) -> bool:
        probes[length] = peak_of(length)
        return probes[length] <= budget

    lo = start
    if not fits(lo):
        return None, probes, False
    prev, n = None, min(2 * lo, cap)
    while n > lo:  # up: towards where the last two probes' line crosses the budget
        if not fits(n):
            hi = n
            break
        prev, lo = lo, n
        if lo >= cap:
            return lo, probes, True
        cross = _crossing((prev, probes[prev]), (lo, probes[lo]), budget)
        guess = 2 * lo if cross is None or cross <= lo else _down(cross, grid)
        n = min(max(guess, lo + grid), 2 * lo, cap)
    else:
        return lo, probes, True
    bisect = False
    while hi - lo > grid:  # inside the bracket: the line's crossing, or every other time halves
        cross = None if bisect else _crossing((lo, probes[lo]), (hi, probes[hi]), budget)
        n = _down((lo + hi) / 2, grid) if cross is None else _down(cross, grid)
        n = min(max(n, lo + grid), hi - grid)
        width = hi - lo
        if fits(n):
            lo = n
        else:
            hi = n
        bisect = not bisect and hi - lo > width / 2
    return lo, probes, False


# Rows of the budget part: (configuration, the peak it is held to). "peak": the copies in
# flight hold their device tensors (the bound); "peak_landed": every copy lands at once.
BUDGET_ROWS = [
    ("plain", "peak"),
    ("offload", "peak"),
    ("offload", "peak_landed"),
    ("checkpointing", "peak"),
    ("checkpointing + offload", "peak"),
]


def part_budget(args) -> tuple[list[str], dict]:
    engines = {}

    def engine(name):
        if name not in engines:
            engines.clear()  # one engine alive at a time
            gc.collect()
            engines[name] = build_engine(
                args, checkpointing=CONFIGS[name][0], offload=CONFIGS[name][1]
            )
        return engines[name]

    budget = measure(engine("plain"), args.budget_length, args.vocab)["peak"]
    print(f"  budget {budget / MIB:.1f} MiB (plain at {args.budget_length} tokens)", flush=True)
    results = {}
    for name, key in BUDGET_ROWS:
        row = name if key == "peak" else f"{name}, copies landed at once"
        at_budget = measure(engine(name), args.budget_length, args.vocab)
        found, probes, capped = longest_fitting(
            lambda n, name=name, key=key: measure(engine(name), n, args.vocab)[key],
            budget,
            args.budget_length // 2,
            args.grid,
            args.max_length,
        )
        results[row] = {
            "at": at_budget[key],
            "held": at_budget["held"],
            "offloaded": at_budget["offloaded"],
            "longest": found,
            "probes": probes,
            "capped": capped,
        }
        trail = ", ".join(f"{n}: {p / MIB:.1f}" for n, p in probes.items())
        print(f"  {row}: {found} ({time.perf_counter() - T0:.0f} s; MiB at {trail})", flush=True)
    plain = results["plain"]
    lines = [
        f"Budget: {budget / MIB:.1f} MiB per rank (the plain micro-batch's peak at "
        f"{args.budget_length} tokens); grid {args.grid} tokens.",
        "",
        f"| configuration | at {args.budget_length} tokens: device peak (MiB) | vs plain "
        "| held after the forward (MiB) | offloaded (MiB) | longest sequence within the budget "
        "| vs plain | probes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row, r in results.items():
        longest = r["longest"]
        shown = "none" if longest is None else f"{'>= ' if r['capped'] else ''}{longest}"
        ratio = f"{longest / plain['longest']:.2f}x" if longest and plain["longest"] else "-"
        lines.append(
            f"| {row} | {r['at'] / MIB:.1f} | {r['at'] / plain['at']:.2f}x "
            f"| {r['held'] / MIB:.1f} | {r['offloaded'] / MIB:.1f} | {shown} | {ratio} "
            f"| {len(r['probes'])} |"
        )
    return lines, {"budget": budget, **results}


# --------------------------------------------------------------------------------------------
# Part "offload": peak and time per configuration at fixed lengths (the GPU's part)


def part_offload(args) -> tuple[list[str], dict]:
    cuda = args.device.startswith("cuda")
    head = "| tokens | configuration | device peak (MiB) | vs plain |"
    head += " allocator peak (MiB) |" if cuda else " copies landed at once (MiB) |"
    head += " held after the forward (MiB) | offloaded (MiB) | time (s) | vs plain |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    results = {}
    for name in CONFIGS:
        engine = build_engine(args, checkpointing=CONFIGS[name][0], offload=CONFIGS[name][1])
        for length in args.lengths:
            point = measure(engine, length, args.vocab)
            point["time"], point["cpu"] = median_time(engine, length, args.vocab, args.reps)
            results[(length, name)] = point
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    for length in args.lengths:
        plain = results[(length, "plain")]
        for name in CONFIGS:
            p = results[(length, name)]
            row = (
                f"| {length} | {name} | {p['peak'] / MIB:.1f} | {p['peak'] / plain['peak']:.2f}x |"
            )
            row += f" {p['allocator' if cuda else 'peak_landed'] / MIB:.1f} |"
            row += f" {p['held'] / MIB:.1f} | {p['offloaded'] / MIB:.1f} | {p['time']:.3f}"
            row += f" | {p['time'] / plain['time']:.2f}x |"
            lines.append(row)
    # One line for gpu_check.sh: the saving and the time of offload at the longest length.
    length = max(args.lengths)
    figures = []
    pairs = (("off", "plain", "offload"), ("on", "checkpointing", "checkpointing + offload"))
    for ckpt, off, on in pairs:
        a, b = results[(length, off)], results[(length, on)]
        key = "allocator" if cuda else "peak"
        figures.append(
            f"checkpointing {ckpt}: {a[key] / MIB:.0f} -> {b[key] / MIB:.0f} MiB, "
            f"time {b['time'] / a['time']:.2f}x"
        )
    lines += ["", f"KEY: offload at {length} tokens: " + "; ".join(figures)]
    return lines, {f"{k[0]}/{k[1]}": v for k, v in results.items()}


def part_deep(args) -> tuple[list[str], dict]:
    """Part ``offload`` on a deep, narrow model (``DEEP``), at ``--deep-length`` tokens."""
    deep = argparse.Namespace(**{**vars(args), **DEEP, "lengths": [args.deep_length]})
    lines, results = part_offload(deep)
    lines = [line for line in lines if not line.startswith("KEY: ")]
    model = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in DEEP.items())
    return [f"Model: {model} (the rest as above).", "", *lines], results


# The "deep" part's model: checkpoint boundaries (one [L, H] input per layer) add up over many
# layers, as in an LLM, while one layer's recompute stays small.
DEEP = {"layers": 24, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 2048}


# --------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=None, help="sp,budget,deep,offload (see the docstring)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--lora", type=int, default=16, help="LoRA rank (0: full fine-tune)")
    parser.add_argument("--lengths", type=_ints, default=[4096, 16384], help="sp and offload")
    parser.add_argument("--four-length", type=int, default=4096, help="s = 4 at this length")
    parser.add_argument("--reps", type=int, default=3, help="timed micro-batches per point")
    parser.add_argument("--budget-length", type=int, default=2048)
    parser.add_argument("--deep-length", type=int, default=4096, help="tokens of the deep part")
    parser.add_argument("--grid", type=int, default=512)
    parser.add_argument("--max-length", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--cores", type=int, default=2, help="cores the ranks share (a note)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.worker_lengths = args.lengths
        worker(args)
        return
    torch.set_num_threads(args.threads)
    parts = (args.only or ("sp,budget,deep" if args.device == "cpu" else "offload")).split(",")
    lora = f"LoRA rank {args.lora}" if args.lora else "full fine-tune"
    print(
        f"Qwen2-style hidden {args.hidden}, {args.layers} layers, {args.heads} heads / "
        f"{args.kv_heads} KV heads, vocab {args.vocab}, {lora}, SDPA, {args.device}, "
        f"{args.threads} thread(s) per process; one sequence per micro-batch",
        flush=True,
    )
    out, results = [], {}
    for part in parts:
        print(f"[{part}]", flush=True)
        run = {"sp": part_sp, "budget": part_budget, "deep": part_deep, "offload": part_offload}
        lines, results[part] = run[part](args)
        out += ["", f"### {part}", "", *lines]
    print("\n".join(out))
    print(f"\ntotal {time.perf_counter() - T0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


T0 = time.perf_counter()

if __name__ == "__main__":
    main()
