"""Benchmark the fused lm-head log-prob/entropy kernel against eager and peer implementations.

    python benchmarks/bench_kernel.py                    # float32 and bfloat16, CPU, ~30-50 min
    python benchmarks/bench_kernel.py --dtypes float32   # the README float32 table
    python benchmarks/bench_kernel.py --quick            # small shapes, a few minutes
    python benchmarks/bench_kernel.py --quick --impls eager,microrl --heads bias,softcap,all
                                                         # + lm-head transforms vs the plain head
    python benchmarks/bench_kernel.py --device cuda --dtypes bfloat16 --reps 10
                                                         # on a GPU: eager, microrl and Liger
    python benchmarks/bench_kernel.py --rss --dtypes float32 --impls eager,microrl \
        --cases 256x896x151936                           # memory with the .grad buffers existing

Each measurement is forward + backward (gradients to hidden and weight) of
``sum(g1 * logprobs) + sum(g2 * entropy)`` with ``hidden`` and ``weight`` in the given dtype (the
head itself computes in float32 either way), one implementation per fresh subprocess so neither
memory nor allocator state leaks between them. Reported per implementation, case and dtype:

* median wall time over all repetitions of all rounds, and the ratio to eager as the median over
  rounds of per-round ratios (rounds interleave the implementations, so each ratio compares
  processes run back to back and a shared machine's slow phases cancel); median CPU seconds;
* extra peak memory: peak RSS (VmHWM, reset before each step) minus the RSS before the step
  (inputs, library state) minus the gradient buffers the step must return ((N*H + V*H) times
  the dtype's size);
* with ``--rss`` instead (the issue-23 measurement, a training loop's steady state): a warm-up
  step creates the ``.grad`` buffers, then the peak RSS over ``--reps`` (default 3) calls that
  accumulate into them, minus the RSS before them, minus one ``[V, H]`` weight-gradient buffer
  in the weight's dtype (the new gradient that autograd adds into ``weight.grad``; the ``[N, H]``
  one is counted); the memory reported is the best (lowest) of the rounds' fresh processes,
  since allocator slack varies between processes; times as above;
* achieved GFLOP/s with the implementation's own FLOP count (8*N*H*V when the backward recomputes
  the logits, 6*N*H*V when it keeps them) and its fraction of this machine's float32 matmul
  throughput, measured in the same run on the forward GEMM shape [N, H] @ [H, V] (float32 for
  every dtype: that is the matmul the head runs on a CPU).

``--device cuda`` runs the same measurements on the current GPU: wall time between
``torch.cuda.synchronize()`` calls, and extra peak memory from ``torch.cuda.max_memory_allocated``
(reset before each step) minus the allocated bytes before it minus the gradient buffers. The
matmul probe there runs in the input dtype (on CUDA the head multiplies 16-bit inputs with
float32 accumulation and output), and the default implementations are eager, ``microrl`` (what
``implementation="auto"`` takes: the GPU path), ``microrl-tiles`` (the previous path, forced),
``microrl-fused`` (``fused_linear_loss`` on the same objective, its gradients formed in forward)
and Liger. Each row says which implementation ran (``microrl.kernels.last_implementation``) and
its time against the GEMM floor: 4 GEMMs of the probe's rate (3 for the fused loss).
``--key-figure results.json`` prints the GPU check's key line from saved results.

Peers (benchmark-only, not project dependencies; skipped when not importable):
TRL ``ChunkedLogProbFunction`` (torch path on CPU, TRL trainer's vocabulary chunk 32768), verl
``FusedLinearForPPO`` (torch backend, its default 512-row chunks; loaded from its file because
``verl/__init__`` needs ray), cut-cross-entropy ``impl="torch_compile"`` (log-probs only, no entropy;
its compile time is excluded by a warm-up step); on CUDA only: Liger-Kernel's Triton
``LigerFusedLinearCrossEntropyFunction`` (``liger_fused_linear_cross_entropy``,
``reduction="none"``: the per-token loss is ``-logprob``, and its backward recomputes the logit
chunks with the per-token upstream gradient; no entropy; its logits are in the input dtype, so
bf16 ones for bf16 inputs, where microrl's are float32).

``--heads bias,softcap,all`` also times ``microrl`` and ``eager`` with lm-head transforms (named
``impl:head``): an lm-head bias (Phi; its gradient included), Gemma 2's final-logit soft-capping
(``softcap=30``), or both with Cohere's ``logit_scale=0.0625``; a second table gives each one's
time relative to the plain head of the same implementation, paired by round in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time

IMPLS = ("eager", "microrl", "trl", "verl", "cce")
# Liger's kernels are Triton, GPU only: it is a default peer on CUDA, not on a CPU. On CUDA
# microrl runs its GPU path; microrl-tiles forces the previous one (CPU tiles, 16-bit matmuls).
CUDA_IMPLS = ("eager", "microrl", "microrl-tiles", "microrl-fused", "liger")
# x N*H*V: 6 when the logits are kept for backward (eager, cce's compiled full logits), 8 when
# backward recomputes them; microrl keeps its first tiles on a CPU, see _flops; its fused loss
# forms the gradients in forward (6 with its tiles kept; _flops).
FLOPS_FACTOR = {
    "eager": 6, "microrl": 8, "trl": 8, "verl": 8, "cce": 6, "liger": 8, "microrl-tiles": 8,
    "microrl-fused": 6,
}  # fmt: skip
# GEMMs of the floor per implementation: the fused loss's is 3 (no backward recompute).
FLOOR_GEMMS = {"microrl-fused": 3}
DEFAULT_CASES = "2048x1024x32768,1024x1024x32768,512x1024x151936,256x1024x151936"
QUICK_CASES = "512x256x8192,256x256x8192"
DTYPES = ("float32", "bfloat16")
# --heads: lm-head transforms passed to microrl and eager (a bias is created per case).
HEADS = {
    "bias": {"bias": True},
    "softcap": {"softcap": 30.0},
    "all": {"bias": True, "logit_scale": 0.0625, "softcap": 30.0},
}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError):  # give freed heap back so RSS is a fair baseline
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _load(impl: str, device: str = "cpu"):
    """Return ``fn(hidden, weight, targets) -> (logprobs, entropy | None)`` for one implementation."""
    import torch

    if impl == "eager":
        from microrl.kernels import reference_linear_logprob

        return reference_linear_logprob
    if impl == "microrl":
        from microrl.kernels import fused_linear_logprob

        return fused_linear_logprob
    if impl == "microrl-tiles":
        from functools import partial

        from microrl.kernels import fused_linear_logprob

        return partial(fused_linear_logprob, implementation="tiles")
    if impl == "trl":
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        def trl(h, w, t):
            out = ChunkedLogProbFunction.apply(h, w, None, t, 1.0, 32768, None, 1.0, ("entropy",))
            return out[0], out[1]

        return trl
    if impl == "verl":
        import importlib.util
        import sysconfig

        path = os.path.join(
            sysconfig.get_paths()["purelib"], "verl", "utils", "experimental", "torch_functional.py"
        )
        spec = importlib.util.spec_from_file_location("verl_torch_functional", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.FusedLinearForPPO(chunk_size=512)
    if impl == "cce":
        from cut_cross_entropy import linear_cross_entropy

        def cce(h, w, t):
            return -linear_cross_entropy(h, w, t, impl="torch_compile", reduction="none"), None

        return cce
    if impl == "liger":
        if not device.startswith("cuda"):
            raise ValueError("liger needs --device cuda (its kernels are Triton, GPU only)")
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        def liger(h, w, t):
            # reduction="none": a per-token loss, so the upstream gradient is per token as for
            # the others (mean/sum would let Liger compute the gradients during forward).
            return -liger_fused_linear_cross_entropy(h, w, t, reduction="none"), None

        return liger
    if impl == "microrl-fused":
        from microrl.kernels import fused_linear_loss

        return fused_linear_loss
    if impl == "matmul":

        def matmul(h, w, t):
            torch.mm(h.detach(), w.detach().T)
            return None, None

        return matmul
    raise ValueError(f"unknown implementation {impl!r}")


def fused_step(fused_linear_loss, hidden, weight, targets, g_lp, g_ent, kwargs) -> None:
    """``fused_linear_loss`` on the benchmark's objective, ``sum(g_lp * logprobs) + sum(g_ent *
    entropy)`` per group of rows: the same gradients, formed in its forward."""

    def loss_fn(start, end, lp, ent):
        return (lp * g_lp[start:end]).sum() + (ent * g_ent[start:end]).sum(), None

    out = fused_linear_loss(hidden, weight, targets, loss_fn, with_entropy=True, **kwargs)
    out.loss.backward()


def _probe_dtype(device: str, dtype: str) -> str:
    """The matmul probe's dtype: what the head's GEMM runs in (float32 on a CPU, which upcasts;
    the input dtype on CUDA, which multiplies 16-bit inputs with float32 accumulation)."""
    return dtype if device.startswith("cuda") else "float32"


def worker(
    impl: str,
    n: int,
    h: int,
    v: int,
    reps: int,
    threads: int,
    dtype: str,
    device: str = "cpu",
    rss: bool = False,
) -> dict:
    import torch

    torch.set_num_threads(threads)
    cuda = device.startswith("cuda")
    base_impl, _, head = impl.partition(":")
    fn = _load(base_impl, device)
    # On CUDA the inputs are drawn there: a [151936, 4096] weight drawn on the CPU takes seconds.
    g = torch.Generator(device=device).manual_seed(0)
    dt = getattr(torch, dtype if impl != "matmul" else _probe_dtype(device, dtype))

    def draw(*shape):
        return torch.randn(*shape, generator=g, device=device)

    hidden = draw(n, h).to(dt).requires_grad_()
    weight = (draw(v, h) * h**-0.5).to(dt).requires_grad_()  # logits ~ N(0, 1)
    targets = torch.randint(0, v, (n,), generator=g, device=device)
    g_lp, g_ent = draw(n), draw(n)
    kwargs = dict(HEADS[head]) if head else {}
    bias = None
    if kwargs.pop("bias", False):
        bias = draw(v).to(dt).requires_grad_()
        kwargs["bias"] = bias

    def step():
        if base_impl == "microrl-fused":
            fused_step(fn, hidden, weight, targets, g_lp, g_ent, kwargs)
            return
        logprobs, entropy = fn(hidden, weight, targets, **kwargs)
        if logprobs is None:  # the matmul roofline probe
            return
        loss = (logprobs * g_lp).sum()
        if entropy is not None:
            loss = loss + (entropy * g_ent).sum()
        loss.backward()

    step()  # warm-up: library init, torch.compile for cce, Triton compilation for liger
    if rss:
        new_grad = (v * h + (v if bias is not None else 0)) * dt.itemsize
        return _worker_rss(impl, step, reps, new_grad)
    times, cpu, extras = [], [], []
    grad_bytes = (n * h + v * h) * dt.itemsize if impl != "matmul" else n * v * dt.itemsize
    grad_bytes += v * dt.itemsize if bias is not None else 0
    for _ in range(reps):
        hidden.grad = weight.grad = None
        if bias is not None:
            bias.grad = None
        _trim()
        if cuda:  # the step's kernels are asynchronous: time and measure between syncs
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            base = _status_kib("VmRSS") * 1024
            _reset_peak()
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        peak = torch.cuda.max_memory_allocated() if cuda else _status_kib("VmHWM") * 1024
        extras.append(peak - base - grad_bytes)
    return {
        "impl": impl, "times": times, "cpu": cpu, "extra_bytes": max(extras), "ran": _ran(impl),
    }  # fmt: skip


def _ran(impl: str) -> str | None:
    """The implementation microrl's last call ran (None for the others)."""
    if not impl.startswith("microrl"):
        return None
    from microrl.kernels import last_implementation

    return last_implementation()


def _worker_rss(impl: str, step, calls: int, new_grad_bytes: int) -> dict:
    """``--rss``: the warm-up step left the ``.grad`` buffers in place; peak RSS over ``calls``
    steps accumulating into them, minus the RSS before them and the new gradient buffers that
    autograd adds into ``.grad`` (``new_grad_bytes``: the ``[V, H]`` one and a bias's)."""
    if impl == "matmul":
        new_grad_bytes = 0
    _trim()
    base = _status_kib("VmRSS") * 1024
    _reset_peak()
    times, cpu = [], []
    for _ in range(calls):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    extra = _status_kib("VmHWM") * 1024 - base - new_grad_bytes
    return {"impl": impl, "times": times, "cpu": cpu, "extra_bytes": extra, "ran": _ran(impl)}


def _run_worker(impl, case, reps, threads, timeout, dtype, device="cpu", rss=False):
    n, h, v = case
    cmd = [sys.executable, __file__, "--worker", impl, "--case", f"{n}x{h}x{v}"]
    cmd += ["--reps", str(reps), "--threads", str(threads), "--dtypes", dtype, "--device", device]
    cmd += ["--rss"] if rss else []
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "error": f"timed out after {timeout}s"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"impl": impl, "error": last[:160]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=None, help=f"NxHxV,... (default {DEFAULT_CASES})")
    parser.add_argument(
        "--impls",
        default=None,
        help=f"comma-separated (default {','.join(IMPLS)}; on CUDA {','.join(CUDA_IMPLS)})",
    )
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the current GPU")
    parser.add_argument(
        "--heads",
        default="",
        help=f"also time microrl/eager with lm-head transforms: {','.join(HEADS)}",
    )
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="input dtypes, comma-separated")
    parser.add_argument(
        "--reps", type=int, default=None, help="timed steps per subprocess (2; 3 with --rss)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of subprocesses")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per subprocess")
    parser.add_argument("--quick", action="store_true", help="small shapes, one round")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument("--from-json", default=None, help="only print the table of saved results")
    parser.add_argument(
        "--key-figure", default=None, help="print the GPU check's key line of saved CUDA results"
    )
    parser.add_argument(
        "--rss",
        action="store_true",
        help="CPU: memory with the .grad buffers existing (peak RSS over the steps less one [V, H]"
        " gradient; best of the rounds' processes)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reps is None:
        args.reps = 3 if args.rss else 2
    if args.rss and args.device != "cpu":
        parser.error("--rss measures the resident set of CPU runs")
    if args.worker:
        n, h, v = (int(x) for x in args.case.split("x"))
        result = worker(
            args.worker, n, h, v, args.reps, args.threads, args.dtypes, args.device, args.rss
        )
        print(json.dumps(result))
        return
    if args.from_json:
        with open(args.from_json) as f:
            print(_table(json.load(f), args))
        return
    if args.key_figure:
        with open(args.key_figure) as f:
            line, ok = key_figure(json.load(f))
        print(line)
        sys.exit(0 if ok else 1)
    if args.quick:
        args.cases = args.cases or QUICK_CASES
        args.rounds = 1
    cases = [tuple(int(x) for x in c.split("x")) for c in (args.cases or DEFAULT_CASES).split(",")]
    if args.impls is None:
        args.impls = ",".join(CUDA_IMPLS if args.device.startswith("cuda") else IMPLS)
    impls = args.impls.split(",")
    heads = [x for x in args.heads.split(",") if x]
    if unknown := set(heads) - set(HEADS):
        parser.error(f"unknown --heads {sorted(unknown)}; choose from {sorted(HEADS)}")
    impls += [f"{i}:{x}" for x in heads for i in ("microrl", "eager") if i in impls]
    results = {}
    for case, dtype in [(c, d) for c in cases for d in args.dtypes.split(",")]:
        per = {impl: {"times": [], "cpu": [], "extra_bytes": None} for impl in ["matmul", *impls]}
        # Peak of the steps: the worst process; with --rss the best one (allocator slack varies).
        pick = min if args.rss else max
        for _ in range(args.rounds):
            for impl in ["matmul", *impls]:
                r = _run_worker(
                    impl, case, args.reps, args.threads, args.timeout, dtype, args.device, args.rss
                )
                if "error" in r:
                    per[impl]["error"] = r["error"]
                    continue
                per[impl]["times"] += r["times"]
                per[impl]["cpu"] += r["cpu"]
                if r.get("ran"):
                    per[impl]["ran"] = r["ran"]
                per[impl].setdefault("rounds", []).append(r["times"])
                old, new = per[impl]["extra_bytes"], r["extra_bytes"]
                per[impl]["extra_bytes"] = new if old is None else pick(old, new)
                times = [round(t, 2) for t in r["times"]]
                mib = r["extra_bytes"] / 2**20
                print(f"  {case} {dtype} {impl}: {times} s, {mib:.1f} MiB", file=sys.stderr)
        for r in per.values():  # no successful process: 0, as before --rss existed
            r["extra_bytes"] = r["extra_bytes"] or 0
        results["x".join(map(str, case)) + f":{dtype}"] = per
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(_table(results, args))


def _flops(impl: str, n: int, h: int, v: int, ran: str | None = None) -> float:
    """FLOPs of one forward+backward: 2*N*H*V per matmul over the logits (``ran``: the
    implementation microrl ran; its GPU path recomputes every tile, 8*N*H*V)."""
    impl, _, head = impl.partition(":")
    if impl != "microrl" or ran not in (None, "tiles"):
        return FLOPS_FACTOR[impl] * n * h * v
    from microrl.kernels import linear_logprob
    from microrl.kernels._checks import HeadSpec

    softcap = HEADS[head].get("softcap") if head else None
    plan = linear_logprob._plan(n, v, HeadSpec(softcap=softcap), (True, True), False, h)
    tiles = [
        min(plan.rows, n - i) * min(plan.vocab_tile, v - j)
        for i in range(0, n, plan.rows)
        for j in range(0, v, plan.vocab_tile)
    ]  # in the kernel's loop order: the first kept_tiles skip their backward recompute
    return 8 * n * h * v - 2 * h * sum(tiles[: plan.kept_tiles])


def _rounds(r: dict, reps: int, key: str = "times") -> list[list[float]]:
    """Per-round lists of one implementation's measurements (older JSON: split by reps)."""
    if key == "times" and "rounds" in r:
        return r["rounds"]
    values = r.get(key, [])
    return [values[k : k + reps] for k in range(0, len(values), reps)]


def _paired(a: list[list[float]], b: list[list[float]]) -> float:
    """Median over rounds of median(a) / median(b): each ratio compares processes run back to back,
    so a shared machine's slow phases cancel instead of landing on one implementation."""
    pairs = [
        statistics.median(x) / statistics.median(y) for x, y in zip(a, b, strict=False) if x and y
    ]
    return statistics.median(pairs) if pairs else float("nan")


def _seconds(t: float) -> str:
    """Two decimals, as the CPU tables have; four below 0.1 s (a GPU step takes milliseconds)."""
    return f"{t:.2f}" if t >= 0.1 else f"{t:.4f}"


def _table(results: dict, args) -> str:
    device = getattr(args, "device", "cpu")
    mode = ", --rss: .grad buffers existing, best process's memory" if args.rss else ""
    lines = [
        f"device {device}, torch.set_num_threads({args.threads}), "
        f"reps={args.reps} x rounds={args.rounds}{mode}",
        "",
        "| N x H x V | dtype | impl | ran | median s | vs eager | CPU s | extra peak MiB "
        "| vs eager | GFLOP/s | of matmul | vs floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, per in results.items():
        shape, _, dtype = key.partition(":")  # older JSON: "NxHxV", float32
        case = f"{shape} | {dtype or 'float32'}"
        n, h, v = (int(x) for x in shape.split("x"))
        mm_rounds = _rounds(per["matmul"], args.reps)
        roof = 2 * n * h * v / statistics.median(per["matmul"]["times"]) / 1e9
        eager = per.get("eager", {})
        m_eager = eager.get("extra_bytes") if eager.get("times") else None
        for impl, r in per.items():
            if impl == "matmul":
                continue
            if not r["times"]:
                lines.append(f"| {case} | {impl} | n/a: {r.get('error', 'no result')} ||||||||||")
                continue
            t, cpu = statistics.median(r["times"]), statistics.median(r["cpu"])
            rounds = _rounds(r, args.reps)
            vs_eager = _paired(rounds, _rounds(eager, args.reps)) if m_eager else float("nan")
            flops = _flops(impl, n, h, v, r.get("ran"))
            # of matmul: this implementation's FLOP rate over the matmul probe's, paired by round;
            # vs floor: its time over the floor's (4 GEMMs, or 3, at the probe's rate).
            ratio = _paired(rounds, mm_rounds)
            of_matmul = flops / (2 * n * h * v) / ratio
            vs_floor = ratio / FLOOR_GEMMS.get(impl.partition(":")[0], 4)
            mib = r["extra_bytes"] / 2**20
            mem = f"{r['extra_bytes'] / m_eager:.1%}" if m_eager else ""
            lines.append(
                f"| {case} | {impl} | {r.get('ran') or ''} | {_seconds(t)} | {vs_eager:.2f}x | "
                f"{cpu:.1f} | {mib:.0f} | {mem} | {flops / t / 1e9:.0f} | {of_matmul:.0%} | "
                f"{vs_floor:.2f}x |"
            )
        probe = _probe_dtype(device, dtype or "float32")
        lines.append(f"| {case} | ({probe} matmul probe) | | | | | | | {roof:.0f} | 100% | |")
    heads = [
        (key, impl, r, per[impl.partition(":")[0]])
        for key, per in results.items()
        for impl, r in per.items()
        if ":" in impl and r["times"] and per.get(impl.partition(":")[0], {}).get("times")
    ]
    if heads:
        lines += [
            "",
            "| N x H x V | dtype | impl:head | median s | vs plain head |",
            "|---|---|---|---|---|",
        ]
        for key, impl, r, plain in heads:
            shape, _, dtype = key.partition(":")
            ratio = _paired(_rounds(r, args.reps), _rounds(plain, args.reps))
            t = statistics.median(r["times"])
            lines.append(
                f"| {shape} | {dtype or 'float32'} | {impl} | {_seconds(t)} | {ratio:.2f}x |"
            )
    return "\n".join(lines)


def key_figure(results: dict) -> tuple[str, bool]:
    """``(KEY line, ok)`` of CUDA results: per shape, microrl's time and extra peak memory over
    Liger's (eager's without Liger), its fused loss's time over Liger's, its time over the
    4-GEMM floor, and the implementation that ran; not ok when microrl failed or did not run its
    GPU path (``"triton"``)."""
    figures, ok = [], True
    for case, per in results.items():
        shape = case.split(":")[0]
        mine, liger = per["microrl"], per.get("liger")
        if not mine["times"] or mine.get("ran") != "triton":
            figures.append(f"{shape}: microrl {mine.get('error') or 'ran ' + str(mine.get('ran'))}")
            ok = False
            continue
        peer = "liger" if liger and liger["times"] else "eager"
        other = per[peer]
        if not other["times"]:
            continue
        t = statistics.median(mine["times"])
        parts = [
            f"time {t / statistics.median(other['times']):.2f}x",
            # Extra peak memory can be ~0 for a kernel that keeps nothing: guard the division.
            f"extra peak memory {mine['extra_bytes'] / max(other['extra_bytes'], 1):.2f}x",
        ]
        fused = per.get("microrl-fused", {})
        if fused.get("times"):
            ratio = statistics.median(fused["times"]) / statistics.median(other["times"])
            parts.append(f"fused loss {ratio:.2f}x")
        if per["matmul"]["times"]:
            parts.append(f"{t / (4 * statistics.median(per['matmul']['times'])):.2f}x the floor")
        figures.append(f"{shape} microrl/{peer} ({mine['ran']}): " + ", ".join(parts))
    return "KEY: " + "; ".join(figures), ok


if __name__ == "__main__":
    main()
